"""The handles a :class:`~cxlalloc.kvstore.client.RemoteBlockStore` hands out: leases (blocks pinned on the
kv-server), reservations (slots to write, then commit), reservations asked for ahead of their use
(:class:`PendingReservation`) and the empty handle returned while the server is away."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.blockcopy import copy_raw, raw_pointers, write_blocks
from cxlalloc.kvstore.connection import _Broken, _Conn, _Deferred, _Pool, _slot_views
from cxlalloc.kvstore.handles import ScopedHandle

__all__ = ["RemoteLease", "RemoteReservation", "PendingReservation"]


class RemoteLease(ScopedHandle):
    """Blocks found on the server, pinned there until :meth:`close`."""

    def __init__(self, store, conn: Optional[_Conn], lease_id: int, views: List[torch.Tensor], from_tier: int = 0):
        self._store, self._conn, self._id, self.views = store, conn, lease_id, views
        # Where the blocks came from, in order: the server's pool, then the tier below it (read through).
        self.tiers = [("pool", len(views) - from_tier), ("remote", from_tier)]

    @property
    def blocks(self) -> int:
        return len(self.views)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self.views = []
        if conn is None:
            return
        try:
            if conn.broken:
                pass  # closing the connection (unhold) drops the pins
            elif conn.one_way_release:  # one round trip per hit: the release is not waited for
                conn.send_one_way({"op": "release", "leases": [self._id], "reply": False})
            else:
                conn.request({"op": "release", "leases": [self._id]})
        except (_Broken, P.RemoteError) as e:
            self._store._failed(e, conn)
        finally:
            conn.unhold()

    _release = close


class RemoteReservation(ScopedHandle):
    """Slots in the server's pool: write ``views[i]`` (None = skip), then :meth:`commit`."""

    def __init__(self, store, conn: Optional[_Conn], res_id: int, pool: _Pool, offsets: List[Optional[int]],
                 nbytes: int):
        self._store, self._conn, self._id = store, conn, res_id
        self._pool, self._offsets, self._nbytes = pool, offsets, int(nbytes)
        self._views: Optional[List[Optional[torch.Tensor]]] = None

    @property
    def views(self) -> List[Optional[torch.Tensor]]:
        """One 1-D uint8 view of ``nbytes`` into the pool per key (None: no slot), registered for the GPU.
        Built on first use: :meth:`write` of CPU tensors needs only the slots' addresses (64 views cost
        more Python time than copying a 64 KiB block)."""
        if self._views is None:
            self._views = _slot_views(self._pool, self._offsets, self._nbytes, self._store._register)
        return self._views

    @property
    def slots(self) -> int:
        return sum(1 for o in self._offsets if o is not None)

    def _finish(self, op: str, wait: bool = True) -> int:
        conn, self._conn = self._conn, None
        if conn is None:
            return 0
        try:
            if conn.broken:
                return 0
            if not wait:
                n = self.slots
                conn.send_one_way({"op": op, "res": self._id, "reply": False}, pending=n)
                self._store._count("pipelined_commits")
                return n
            reply = conn.request({"op": op, "res": self._id})
            return int(reply.get("published", 0))
        except (_Broken, P.RemoteError) as e:
            self._store._failed(e, conn)
            return 0
        finally:
            conn.unhold()

    def commit(self, wait: Optional[bool] = None) -> int:
        """Publish the written blocks to every client (write every view first).

        Waited (``wait=True``, or a server older than protocol 3, or the
        store's ``commit="wait"``): returns how many became visible (0 when
        the server went away: nothing half-written is ever visible).
        Pipelined (the default against a protocol-3 server): the commit is
        sent without waiting for its reply and the slots sent are returned;
        the server publishes them before it reads this connection's next
        request, and the next reply acknowledges them (``committed_blocks``
        counts what it published; a failure is counted and warned about
        then, :meth:`RemoteBlockStore.flush` waits for them).  Either way a
        block becomes visible only after its bytes were written, and a
        connection that closes before the commit arrives aborts it."""
        conn = self._conn
        if wait is None:
            wait = not (conn is not None and conn.pipelined_commit and self._store.pipeline_commits)
        n = self._finish("commit", wait)
        if wait:
            self._store._count("committed_blocks", n)
        return n

    def write(self, sources: Sequence[Optional[torch.Tensor]], *, stream: bool = True) -> int:
        """Copy ``sources[i]`` into ``views[i]`` (each exactly a slot's bytes; None or a slot-less key is
        skipped): CPU tensors in one call with streaming stores (:func:`cxlalloc.kvstore.blockcopy.write_blocks`,
        bit-identical to ``views[i].copy_(sources[i])``), others with ``copy_``.  Returns how many were
        written; :meth:`commit` next.

        Raises:
            ValueError: as many sources as views are needed, each the size of its slot.
        """
        if len(sources) != len(self._offsets):
            return write_blocks(self.views, sources, stream=stream)  # raises, naming both lengths
        ptrs = raw_pointers(sources, self._nbytes)
        if ptrs is None:  # a GPU or non-contiguous source: through the views (registered), with copy_
            return write_blocks(self.views, sources, stream=stream)
        base = self._pool.bytes.data_ptr()
        dsts, srcs = [], []
        for off, ptr in zip(self._offsets, ptrs):
            if off is not None and ptr is not None:
                dsts.append(base + int(off))
                srcs.append(ptr)
        copy_raw(dsts, srcs, self._nbytes, stream)
        return len(dsts)

    def abort(self) -> None:
        self._finish("abort")

    _release = abort


class _Nothing:
    """An empty lease / a reservation with no slots."""

    def __init__(self, n: int = 0):
        self.views = [None] * n
        self.blocks = 0
        self.slots = 0

    def close(self):
        pass

    def commit(self, wait=None):
        return 0

    def write(self, sources, *, stream=True):
        if len(sources) != len(self.views):
            raise ValueError(f"write_blocks: {len(sources)} sources for {len(self.views)} slots; pass one source (or "
                             "None) per slot")
        return 0

    def abort(self):
        pass

    def result(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class PendingReservation:
    """A reservation asked for ahead of its use (:meth:`RemoteBlockStore.reserve_ahead`): the request is
    on its way and the server handles it while this process copies the previous batch.

    :meth:`result` returns the :class:`RemoteReservation` (waiting for the reply only if it has not
    arrived); :meth:`close` (or leaving a ``with`` block) without taking it aborts it on the server, so
    a reservation asked for and never used holds no slot."""

    def __init__(self, conn: Optional[_Conn], deferred: Optional[_Deferred], finish, ready=None):
        # finish(read_reply) -> the reservation (the store's reply handling); ready: the reservation already
        # known instead (the server away: the fallback's, or an empty one)
        self._conn, self._deferred, self._finish, self._ready = conn, deferred, finish, ready
        self._taken = False

    def result(self):
        """The reservation (a :class:`RemoteReservation`; an empty one when the server refused it or went
        away, as :meth:`RemoteBlockStore.reserve` returns).  Call once.

        Raises:
            ValueError: a block larger than one chunk of the server (naming its ``--chunk``), or a second call.
        """
        if self._taken:
            raise ValueError("PendingReservation.result() was already called; it hands out its reservation once")
        self._taken = True
        if self._deferred is None:
            return self._ready
        conn, d = self._conn, self._deferred
        return self._finish(lambda: conn.wait(d))

    def close(self) -> None:
        """Abort the reservation when :meth:`result` was never called (a no-op after it)."""
        if not self._taken:
            self.result().abort()

    def __enter__(self) -> "PendingReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
