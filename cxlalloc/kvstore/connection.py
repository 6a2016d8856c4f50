"""One connection to a ``cxlalloc kv-server`` and the pool it maps (used by :mod:`cxlalloc.kvstore.client`).

``_Conn`` sends one request at a time and reads its reply (each with the store's timeout); one-way
messages (protocol 2's release, protocol 3's pipelined commit) are sent without a reply, and the
outcomes of pipelined commits that ride on a later reply are handed to the store.  A *deferred*
request (:meth:`_Conn.send_deferred`: a reservation asked for ahead of its use) is sent now and its
reply read later: the server answers every request in order, so replies are read in the order sent
(any version of the protocol), a later request first reading the replies still unread before it.  ``_Pool`` is the
server's pool mapped into this process; ``_slot_views`` cuts a reservation's or lease's slots out of
it.  Nothing here decides policy (reconnects, fallbacks, warnings): that is the store's.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import deque
from typing import List, Optional, Sequence

import torch

from cxlalloc.kvstore import protocol as P


class _Broken(Exception):
    """The connection failed (its state is unknown): it is abandoned."""


class _Pool:
    """One server pool mapped into this process."""

    def __init__(self, arena, hello: dict):
        self.arena = arena
        self.pool_id = hello["pool_id"]
        self.tenant = hello.get("tenant")  # the server's binding of this process's credentials (None: single-tenant)
        self.size = int(hello["size"])
        self.chunk_bytes = int(hello["chunk_bytes"])
        self.node = int(hello["node"])
        self.bytes = torch.from_dlpack(arena.dlpack())


class _Conn:
    def __init__(self, sock: socket.socket, pool: _Pool, hello: dict):
        self.sock, self.pool, self.hello = sock, pool, hello
        self.lock = threading.Lock()       # one request/response at a time
        self._held = threading.Lock()      # outstanding and closed
        self.outstanding = 0               # open leases + reservations
        self.broken = False
        self.closed = False
        self.served = 0                    # requests answered on it
        self.timed_out = False             # it broke on a time-out (the server hangs) rather than a reset
        self.pending = {}                  # pipelined commits sent, not yet acknowledged: res -> blocks sent
        self.on_commits = None             # called with (outcomes, pending) as a reply acknowledges them
        self.unread = deque()              # deferred requests sent whose replies are not read yet, in order

    @property
    def established(self) -> bool:
        """It was greeted (its hello answered: a _Conn exists only then) and broke by a reset or EOF, not a
        time-out: a restarted server, or one that closed it for idleness (``--idle-timeout``), even before its
        first request (a store connects when it is made, often long before its first lookup)."""
        return not self.timed_out

    def request(self, msg: dict) -> dict:
        acks: list = []
        with self.lock:
            if self.broken:
                raise _Broken("the connection failed earlier")
            try:
                P.send_msg(self.sock, msg)
                self._read_unread(None, acks)  # replies of deferred requests sent before this one come first
                reply = self._read_one(acks)
            except (OSError, P.ProtocolError) as e:  # socket.timeout is an OSError
                self._broke(e)
                raise _Broken(f"{type(e).__name__}: {e}") from None
        return self._answer(reply, acks)

    def send_deferred(self, msg: dict) -> "_Deferred":
        """Send a request whose reply is read later (:meth:`wait`), so the server handles it while this
        process works; a request sent after it reads its reply first (replies come in order)."""
        with self.lock:
            if self.broken:
                raise _Broken("the connection failed earlier")
            try:
                P.send_msg(self.sock, msg)
            except (OSError, P.ProtocolError) as e:
                self._broke(e)
                raise _Broken(f"{type(e).__name__}: {e}") from None
            d = _Deferred()
            self.unread.append(d)
            return d

    def wait(self, d: "_Deferred") -> dict:
        """The reply of deferred request ``d`` (read now if no later request read it already).

        Raises:
            _Broken: the connection failed before the reply was read.
            protocol.RemoteError: the server refused the request.
        """
        acks: list = []
        with self.lock:
            if d.reply is None:
                if self.broken:
                    raise _Broken("the connection failed before the reply was read")
                try:
                    self._read_unread(d, acks)
                except (OSError, P.ProtocolError) as e:
                    self._broke(e)
                    raise _Broken(f"{type(e).__name__}: {e}") from None
        return self._answer(d.reply, acks)

    def _read_one(self, acks: list) -> dict:
        """Read the next reply (under the request lock); the pipelined commits it acknowledges go to ``acks``."""
        reply, _ = P.recv_msg(self.sock)
        self.served += 1
        acked = self._acked(reply)
        if acked is not None:
            acks.append(acked)
        return reply

    def _read_unread(self, upto: Optional["_Deferred"], acks: list) -> None:
        """Read deferred replies in order until ``upto``'s (None: all of them), keeping each on its request."""
        while self.unread:
            d = self.unread.popleft()
            d.reply = self._read_one(acks)
            if d is upto:
                return

    def _broke(self, e: BaseException) -> None:
        self.broken = True
        self.timed_out = isinstance(e, socket.timeout)
        self._close_if_idle()

    def _answer(self, reply: dict, acks: list) -> dict:
        """Hand acknowledged commits to the store (outside the request lock), then the reply or its error."""
        if self.on_commits is not None:
            for acked in acks:
                self.on_commits(*acked)
        if not reply.get("ok"):
            raise P.RemoteError(str(reply.get("code", "?")), str(reply.get("error", "")))
        return reply

    def _acked(self, reply: dict):
        """The pipelined commits this reply acknowledges (under the request lock): ``(outcomes
        [[res, published, code], ...], {res: blocks sent} of those, dropped outcomes)`` or None."""
        outcomes = reply.pop("commits", None)
        dropped = int(reply.pop("commits_dropped", 0) or 0)
        if not outcomes and not dropped and not self.pending:
            return None
        if not isinstance(outcomes, list):
            outcomes = []
        sent = {}
        for o in outcomes:
            if isinstance(o, list) and len(o) == 3 and isinstance(o[0], int):
                sent[o[0]] = self.pending.pop(o[0], 0)
        if dropped:  # the server kept no outcome for the oldest: they are done, their count is unknown
            for rid in sorted(self.pending)[:dropped]:
                sent[rid] = self.pending.pop(rid)
        return outcomes, sent, dropped

    @property
    def pipelined_commit(self) -> bool:
        """The server speaks protocol 3: a commit is sent without waiting for its reply."""
        return int(self.hello.get("v", 1)) >= 3

    @property
    def one_way_release(self) -> bool:
        """The server speaks protocol 2: a lease is released without waiting for a reply."""
        return int(self.hello.get("v", 1)) >= 2

    def send_one_way(self, msg: dict, pending: int = -1) -> None:
        """Send a request the server does not answer (protocol 2's ``release``,
        protocol 3's ``commit``, with ``reply: False``); frames stay in order
        under the request lock.  ``pending >= 0``: a commit of that many blocks,
        acknowledged by a later reply."""
        with self.lock:
            if self.broken:
                raise _Broken("the connection failed earlier")
            try:
                if pending >= 0:
                    self.pending[msg["res"]] = pending
                P.send_msg(self.sock, msg)
            except (OSError, P.ProtocolError) as e:
                self.broken = True
                self._close_if_idle()
                raise _Broken(f"{type(e).__name__}: {e}") from None

    def hold(self) -> None:
        with self._held:
            self.outstanding += 1

    def unhold(self) -> None:
        with self._held:
            self.outstanding -= 1
        if self.broken:
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        with self._held:
            if self.closed or self.outstanding > 0:
                return
            self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def abandon(self) -> None:
        """Stop using this connection; it closes once nothing of it is open."""
        self.broken = True
        self._close_if_idle()


class _Deferred:
    """A deferred request's reply: None until read (:meth:`_Conn.wait`, or a later request reading it first)."""

    __slots__ = ("reply",)

    def __init__(self):
        self.reply: Optional[dict] = None


_PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


def _slot_views(pool: _Pool, slots: Sequence, nbytes: int, register) -> List[Optional[torch.Tensor]]:
    """The pool's bytes of each slot (``None`` stays None) as 1-D uint8 views of ``nbytes``, each run of slots
    one after another (the stride less than a page over ``nbytes``) built by one ``unbind`` (a reservation's slots
    are mostly consecutive: a fresh chunk's tail, or the LRU's oldest blocks freed in order) and registered once (``register(pool, offset, length)``)."""
    views: List[Optional[torch.Tensor]] = [None] * len(slots)
    i, n = 0, len(slots)
    while i < n:
        off = slots[i]
        if off is None:
            i += 1
            continue
        off = int(off)
        j = i + 1
        step = int(slots[j]) - off if j < n and slots[j] is not None else 0
        if nbytes <= step < nbytes + _PAGE:  # slots packed (a slot is nbytes rounded up to a page)
            while j < n and slots[j] is not None and int(slots[j]) == off + (j - i) * step:
                j += 1
        if j - i == 1:
            register(pool, off, nbytes)
            views[i] = pool.bytes[off:off + nbytes]
        else:
            k = j - i
            register(pool, off, (k - 1) * step + nbytes)
            run = pool.bytes[off:off + (k - 1) * step + nbytes].as_strided((k, nbytes), (step, 1))
            views[i:j] = run.unbind(0)
        i = j
    return views


__all__ = ["_Broken", "_Conn", "_Deferred", "_Pool", "_slot_views"]
