"""The kv-server's state: the pool, the index, the owners of leases and reservations.

:class:`ServerState` is everything a kv-server knows, as plain methods that
take a client id (``lookup``, ``reserve``, ``commit``, ``abort``,
``release``, ``drop``); it has no socket, so it is driven alone in
``tests/kvstore/server/test_server_state.py``.  The transport
(:mod:`cxlalloc.kvstore.server.transport`) decodes a request and calls one of
them; the background jobs (:mod:`cxlalloc.kvstore.server.jobs`) plug in as
``placement`` (which committed blocks to publish) and ``tier`` (Redis
read-through and write-back).

A client id owns its leases (pinned blocks) and reservations (WRITING
blocks); :meth:`ServerState.drop` gives both back (``BlockIndex.drop_owner``),
so a client gone mid-insert never publishes a half-written block.

Thread-safety: one lock (``self.lock``) around the index and the owners; the
bytes of a block are copied outside it while the block is pinned or WRITING,
which eviction never touches.  Fair service: a request over many blocks
(lookup, reserve, commit, release, discard, a disconnect) holds the lock for
at most ``slice_keys`` blocks at a time and lets the other connections'
threads run between slices, so one client's 65,536-key requests in a loop
cannot stall another's lookups behind them (``lock_hold_us_max`` in the
stats: the longest single hold).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import secrets
import threading
from typing import Dict, List, Optional, Sequence

from cxlalloc import _C
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.index import BlockIndex, Entry
from cxlalloc.kvstore.keys import SHARED_TENANT, namespaced_keys
from cxlalloc.kvstore.layout import verify_stored
from cxlalloc.kvstore.server.clients import ClientsMixin, Owner  # noqa: F401  (Owner: re-exported)
from cxlalloc.kvstore.server.fair import FairLock, HoldRecord

log = logging.getLogger("cxlalloc.kvstore.server")

MAX_LEASES_PER_CLIENT = 4096     # open leases/reservations of one connection
DEFAULT_SLICE_KEYS = 64          # blocks handled under one hold of the lock (--slice-keys)
DEFAULT_MAX_PINNED_FRACTION = 0.5  # of the pool: slot bytes one client may hold pinned (--max-pinned)


class _Quotas(dict):
    """``{namespace: bytes}`` with a default for namespaces not named (``--quota '*=SIZE'``)."""

    def __init__(self, quotas: Dict[str, int], default: Optional[int] = None):
        super().__init__(quotas)
        self.default = default

    def get(self, ns, fallback=None):  # BlockIndex asks quotas.get(ns)
        if dict.__contains__(self, ns):
            return dict.__getitem__(self, ns)
        return self.default if self.default is not None else fallback


class ServerState(ClientsMixin):
    """The pool (a memfd of ``size`` bytes on ``node``), its index and its owners.

    Args:
        size: pool bytes (exact; the mapping is rounded up to the page size).
        node: NUMA node of the pool.
        chunk_bytes: placement unit of the index (bytes; slots are pages within it).
        quotas: ``{namespace: bytes}``; ``default_quota``: bytes for any other namespace.
        max_clients: owners at once (:meth:`admit` refuses more).
        allow_uids: if given, only these uids may be admitted.
        tenant: the tenant this pool belongs to (``""``: the single tenant);
            part of every block's name (and so of its Redis key and MAC).
        max_reserve_bytes: slot bytes one owner may hold WRITING at once
            (default: the whole pool); keys past it get no slot, and a
            reservation of which none fits is refused (``limit``).  Slots are
            page multiples, so ``nbytes=1`` counts 4 KiB.
        slice_keys: blocks handled under one hold of the lock (fair service, above).
        max_clients_per_uid: owners of one uid at once (default ``max_clients``;
            the server's own uid, an operator's ``--status``, is not capped).
        max_pinned_bytes: slot bytes of blocks one owner may hold pinned at once
            (default ``DEFAULT_MAX_PINNED_FRACTION`` of the pool); a lookup
            stops before the block that would pass it (the rest are misses; the
            stored ones count in ``pin_budget_blocks``).

    ``placement`` (``entries -> entries to publish``) and ``tier`` (an object
    with ``evicted(entry)``, ``write_through(entries) -> int`` and
    ``read_through(ns, nskeys, owner) -> pinned entries``) are set by the
    server's background jobs; without them every committed block is published
    and nothing goes below the pool.
    """

    def __init__(self, size: int, node: int, chunk_bytes: int, *, quotas: Optional[Dict[str, int]] = None,
                 default_quota: Optional[int] = None, max_clients: int = 256,
                 allow_uids: Optional[Sequence[int]] = None, max_reserve_bytes: Optional[int] = None,
                 tenant: str = "", slice_keys: int = DEFAULT_SLICE_KEYS,
                 max_clients_per_uid: Optional[int] = None, max_pinned_bytes: Optional[int] = None):
        self.tenant = str(tenant)
        self.size, self.node, self.chunk_bytes = int(size), int(node), int(chunk_bytes)
        self.max_clients_per_uid = int(max_clients_per_uid) if max_clients_per_uid else int(max_clients)
        self._per_uid: Dict[int, int] = {}
        self.slice_keys = int(slice_keys)
        self.max_reserve_bytes = int(max_reserve_bytes) if max_reserve_bytes else self.size
        self.max_pinned_bytes = int(max_pinned_bytes) if max_pinned_bytes else \
            int(self.size * DEFAULT_MAX_PINNED_FRACTION)
        self.max_clients = int(max_clients)
        self.allow_uids = None if allow_uids is None else set(allow_uids)
        self.pool_id = secrets.token_hex(8)
        self._count_lock = threading.Lock()
        self.lock = FairLock()       # first come, first served: clients' slices round-robin (fair.py)
        self.holds = HoldRecord()     # the longest hold of self.lock (wall and CPU time)
        self.last_drop = {"seq": 0}   # the clean-up of the last client gone with pins or reservations
        self.owners: Dict[int, Owner] = {}
        self.c = {"connections": 0, "refused_full": 0, "refused_denied": 0, "protocol_errors": 0,
                  "refused_too_large": 0, "refused_busy": 0, "refused_timeout": 0, "bad_frames": 0,
                  "bad_requests": 0, "hit_bytes": 0, "redis_hit_blocks": 0, "redis_hit_bytes": 0, "redis_hit_tokens": 0,
                  "redis_put_blocks": 0,
                  "placement_verified_bytes": 0, "placement_misplaced_bytes": 0, "placement_unverified_bytes": 0,
                  "placement_skipped_bytes": 0, "misplaced_dropped_blocks": 0, "peak_clients": 0, "requests": 0,
                  "refused_reserve_budget": 0, "reserve_budget_blocks": 0, "drop_us_max": 0, "corrupt_blocks": 0,
                  "one_way_requests": 0, "one_way_errors": 0, "pipelined_commits": 0, "lock_hold_us_max": 0,
                  "refused_per_uid": 0, "closed_no_hello": 0, "closed_idle": 0, "refused_max_items": 0,
                  "refused_max_objects": 0,
                  "refused_pin_budget": 0, "pin_budget_blocks": 0}
        self.placement = None
        self.tier = None
        self.persist = None   # a PoolFile (--pool-file): committed blocks recorded for the next start
        self.shared: Dict[str, frozenset] = {}        # --shared-namespace: ns -> the tenants that may write it
        self.siblings: Dict[str, "ServerState"] = {}  # every tenant's state (the writers of a shared ns)
        # No engine: the kernel's own mbind/move_pages place and verify pages;
        # the server never registers (its clients do, for their GPU).
        self.arena = _C.HostArena(None, self.size, self.node, True)
        self.mem = (ctypes.c_char * self.arena.size).from_address(self.arena.base)
        self.view = memoryview(self.mem).cast("B")
        # Page-granular slots: a block starts on a page (the placement check
        # and the clients' copies work in pages) and a 1-byte request holds
        # one page, never a per-byte structure.
        self.index = BlockIndex(self.size, self.chunk_bytes, granule=os.sysconf("SC_PAGESIZE"))
        # After construction: BlockIndex copies its quotas argument into a plain dict.
        self.index.quotas = _Quotas(quotas or {}, default_quota)

    def names(self, ns: str, keys: Sequence[bytes]) -> List[bytes]:
        """The block names of ``keys`` in ``ns`` here: within this tenant, or
        within no tenant for a namespace the operator shares (``--shared-namespace``)."""
        return namespaced_keys(ns, keys, SHARED_TENANT if ns in self.shared else self.tenant)

    def set_tier(self, tier) -> None:
        """Put ``tier`` below the pool: evicted blocks go to ``tier.evicted``."""
        self.tier = tier
        self.index.on_evict = tier.evicted if tier is not None else None

    def block_bytes(self, e: Entry) -> memoryview:
        """The pool's bytes of block ``e`` (a view, no copy)."""
        return self.view[e.offset:e.offset + e.nbytes]

    def _sliced(self, items: Sequence, fn) -> None:
        """``fn(part)`` for each slice of ``slice_keys`` items, each under one hold of the lock."""
        n = self.slice_keys
        for i in range(0, len(items), n):
            with self.lock:  # released to the first waiting client: no sleep between slices (fair.py)
                t0 = HoldRecord.start()
                fn(items[i:i + n])
                self._held(t0)

    # ------------------------------------------------------------ blocks
    def lookup(self, cid: int, ns: str, keys: Sequence[bytes]) -> dict:
        """The longest stored prefix of ``keys`` in ``ns`` (asking the tier
        below for the rest), pinned for ``cid`` under a new lease, up to the
        client's ``max_pinned_bytes``: the blocks past it are answered as misses
        (the stored ones, up to the first key not stored, count in ``pin_budget_blocks``).

        Returns ``{"lease": id (0: nothing found), "blocks": [[offset, nbytes, tokens], ...],
        "tier_blocks": how many of the blocks (the last ones) the tier below supplied,
        "budget_cut": stored blocks answered as misses by the pin budget (only when > 0)}``.

        Raises:
            protocol.RemoteError: ``limit`` (MAX_LEASES_PER_CLIENT open leases, or
                the client holds ``max_pinned_bytes`` pinned already and the first
                key is stored: ``refused_pin_budget``).
        """
        o = self.owner(cid)
        ik = self.names(ns, keys)
        entries: List[Entry] = []
        n = self.slice_keys
        lid = 0
        cut = 0
        for i in range(0, max(len(ik), 1), n):
            part = ik[i:i + n]
            with self.lock:  # a lookup that fits one slice takes the lock once
                t0 = HoldRecord.start()
                if not i and len(o.leases) >= MAX_LEASES_PER_CLIENT:
                    raise P.RemoteError("limit", f"a client may hold {MAX_LEASES_PER_CLIENT} open leases; release some")
                room = self.max_pinned_bytes - o.pinned_bytes
                got = self.index.match(part, o, new_lookup=not i, budget=room)
                o.pinned_bytes += sum(map(self.index.slot_size, (e.nbytes for e in got)))
                refused = 0
                if len(got) < len(part) and self.index.contains(part[len(got)]):  # stopped by the pin budget
                    cut = self._stored_run(part[len(got):])  # the stored blocks kept out (the keys after: misses)
                    if not entries and not got:
                        self.c["refused_pin_budget"] += 1
                        refused = self.index.slot_size(self.index.entries[part[0]].nbytes)
                if not refused:
                    if len(got) < len(part):  # the prefix ends here: the keys after it are misses too
                        rest = len(ik) - i - len(part)
                        self.index.c.lookup_blocks += rest
                        self.index.c.miss_blocks += rest
                    entries += got
                    self.c["hit_bytes"] += sum(e.nbytes for e in got)  # per slice: a sum of 65,536 in one hold is not
                    if len(entries) == len(ik) and entries:  # all found: the lease in the same hold
                        lid = self._new_lease(o, entries, len(entries))
                self._held(t0)
            if cut and cut == len(part) - len(got) and i + n < len(ik):  # the stored run goes on past this slice
                cut += self._stored_run(ik[i + n:], sliced=True)
            if refused > self.max_pinned_bytes:  # no lease to release would make room: say what would
                raise P.RemoteError("limit", f"a stored block takes {refused} bytes, more than a client may hold pinned "
                                             f"({self.max_pinned_bytes}, --max-pinned): no client can ever load it; "
                                             "raise --max-pinned above the block size or store smaller blocks")
            if refused:
                raise P.RemoteError("limit", f"this client holds {o.pinned_bytes} bytes of blocks pinned; a client may "
                                             f"hold {self.max_pinned_bytes} (--max-pinned); release some leases")
            if len(got) < len(part):
                break
        below = []
        found = len(entries)  # in hit_bytes already
        if not lid and not cut and len(entries) < len(ik):
            if ns in self.shared:
                entries += self._within_budget(o, _from_writers(self, ns, ik[len(entries):], o))
            if self.tier is not None and len(entries) < len(ik) and not self.tier.down():
                below = self._within_budget(o, self.tier.read_through(ns, ik[len(entries):], o))
                entries += below
        if not entries:
            return {"lease": 0, "blocks": []}
        if not lid:
            with self.lock:
                lid = self._new_lease(o, entries, found)
        out = {"lease": lid, "blocks": [[e.offset, e.nbytes, e.tokens] for e in entries], "tier_blocks": len(below)}
        if cut:  # said to the client (it warns once): stored blocks answered as misses by its pin budget
            out["budget_cut"] = cut
        return out

    def _stored_run(self, keys: Sequence[bytes], sliced: bool = False) -> int:
        """How many of ``keys``, from the first, are stored (ready): blocks that a lookup cut by the pin budget
        answers as misses, added to ``pin_budget_blocks``.  Called under the lock; ``sliced``: not, it takes
        the lock a slice at a time while the run lasts."""
        if not sliced:
            run = next((j for j, k in enumerate(keys) if not self.index.contains(k)), len(keys))
            self.c["pin_budget_blocks"] += run
            return run
        total = 0
        for i in range(0, len(keys), self.slice_keys):
            part = keys[i:i + self.slice_keys]
            with self.lock:
                t0 = HoldRecord.start()
                run = self._stored_run(part)
                self._held(t0)
            total += run
            if run < len(part):
                break
        return total

    def _new_lease(self, o: Owner, entries: List[Entry], counted: int = 0) -> int:
        """Record ``entries`` (pinned for ``o``) as a new lease of ``o`` (under the lock); returns its id.
        ``counted``: how many of them (the first) are in ``hit_bytes`` already."""
        lid = o.new_id()
        o.leases[lid] = entries
        self.c["hit_bytes"] += sum(e.nbytes for e in entries[counted:])
        return lid

    def _within_budget(self, o: Owner, pinned: List[Entry]) -> List[Entry]:
        """The prefix of ``pinned`` (blocks just pinned for ``o`` by a read-through) within ``o``'s pin
        budget; the rest are unpinned and counted in ``pin_budget_blocks``."""
        with self.lock:
            keep = []
            for e in pinned:
                size = self.index.slot_size(e.nbytes)
                if o.pinned_bytes + size > self.max_pinned_bytes:
                    break
                o.pinned_bytes += size
                keep.append(e)
            if len(keep) < len(pinned):
                self.index.unpin(pinned[len(keep):], o)
                self.c["pin_budget_blocks"] += len(pinned) - len(keep)
        return keep

    def _unpin(self, o: Owner, part: Sequence[Entry]) -> None:
        self.index.unpin(part, o)
        o.pinned_bytes -= sum(map(self.index.slot_size, (e.nbytes for e in part)))

    def release(self, cid: int, lease_ids: Sequence[int]) -> int:
        """Unpin the leases ``lease_ids`` of ``cid``; returns how many were open."""
        o = self.owner(cid)
        n = 0
        for lid in lease_ids:
            with self.lock:  # a lease of one slice is released in one hold
                t0 = HoldRecord.start()
                entries = o.leases.pop(lid, None)
                small = entries is not None and len(entries) <= self.slice_keys
                if small:
                    self._unpin(o, entries)
                self._held(t0)
            if entries is not None:
                if not small:
                    self._sliced(entries, lambda part: self._unpin(o, part))
                n += 1
        return n

    def discard(self, cid: int, ns: str, keys: Sequence[bytes]) -> int:
        """Drop the blocks ``keys`` of ``ns`` that a reader found corrupt: each
        is verified here (its checksum trailer over the client's chained key,
        :func:`~cxlalloc.kvstore.layout.verify_stored`) and dropped only when it
        fails and no lease pins it, so a client cannot drop a sound block.
        Counts ``corrupt_blocks``; returns how many were dropped."""
        self.owner(cid)
        by_nskey = dict(zip(self.names(ns, keys), keys))
        dropped = [0]

        def part(ks):
            n = self.index.discard(ks, lambda e: not verify_stored(self.block_bytes(e), by_nskey[e.key]))
            dropped[0] += n
            self.c["corrupt_blocks"] += n

        self._sliced(list(by_nskey), part)
        return dropped[0]

    def reserve(self, cid: int, ns: str, keys: Sequence[bytes], nbytes: int, tokens: int) -> dict:
        """WRITING slots of ``nbytes`` for each key of ``ns`` not stored yet.

        Returns ``{"res": id (0: no slot), "slots": [offset | None, ...]}``.

        Raises:
            protocol.RemoteError: ``too_large`` (a block above one chunk),
                ``limit`` (MAX_LEASES_PER_CLIENT open reservations, or the
                owner's WRITING slots are at ``max_reserve_bytes`` already;
                keys past it get no slot, counted as ``reserve_budget_blocks``).
        """
        o = self.owner(cid)
        if self.index.slot_size(nbytes) > self.index.largest_block():
            raise P.RemoteError("too_large", f"a block of {nbytes} bytes is larger than one chunk of this kv-server "
                                             f"({self.chunk_bytes} bytes, --chunk); raise --chunk or lower "
                                             "block_tokens")
        if ns in self.shared and self.tenant not in self.shared[ns]:
            raise P.RemoteError("denied", f"namespace {ns!r} is shared by the operator; tenant {self.tenant!r} may "
                                          "read it, not write it (--shared-namespace)")
        ik = self.names(ns, keys)
        with self.lock:
            if len(o.reservations) >= MAX_LEASES_PER_CLIENT:
                raise P.RemoteError("limit", f"a client may hold {MAX_LEASES_PER_CLIENT} open reservations; commit or "
                                             "abort some")
            # The keys past the owner's budget get no slot (as when the pool is
            # full); a reservation of which nothing fits is refused.
            fit = (self.max_reserve_bytes - self.index.writing_bytes(o)) // self.index.slot_size(nbytes)
            if fit <= 0 and ik:
                self.c["refused_reserve_budget"] += 1
                raise P.RemoteError("limit", f"this client holds {self.index.writing_bytes(o)} bytes of slots "
                                             f"unpublished (blocks are rounded up to {self.index.granule}-byte pages); "
                                             f"a client may hold {self.max_reserve_bytes} (--max-reserve); commit or "
                                             "abort some")
        entries: List[Optional[Entry]] = []
        self._sliced(ik[:fit], lambda part: entries.extend(self.index.reserve(part, nbytes, ns, o, tokens)))
        with self.lock:
            if fit < len(ik):
                self.c["reserve_budget_blocks"] += len(ik) - fit
                entries += [None] * (len(ik) - fit)
            if not any(e is not None for e in entries):
                return {"res": 0, "slots": [None] * len(entries)}
            rid = o.new_id()
            o.reservations[rid] = entries
        return {"res": rid, "slots": [e.offset if e is not None else None for e in entries]}

    def commit(self, cid: int, rid: int) -> int:
        """Publish reservation ``rid`` of ``cid`` (what ``placement`` keeps;
        written through to the tier when it asks); returns blocks published.

        Raises:
            protocol.RemoteError: ``bad_request``: no such open reservation.
        """
        o = self.owner(cid)
        with self.lock:
            entries = o.reservations.pop(rid, None)
        if entries is None:
            raise P.RemoteError("bad_request", f"no open reservation {rid} on this connection")
        live = [e for e in entries if e is not None]
        keep = self.placement(live) if self.placement is not None else live
        sent = self.tier.write_through(keep) if self.tier is not None else 0
        with self.lock:
            self.c["redis_put_blocks"] += sent
        if len(keep) != len(live):  # a set: a commit of 16,384 blocks was O(n^2) with `not in keep`
            kept = set(map(id, keep))
            self._sliced([e for e in live if id(e) not in kept], lambda part: self.index.abort(part, o))
        published = [0]
        copies: List[tuple] = []

        def part(es):
            published[0] += self.index.publish(es, o)
            if self.persist is not None:
                # Copied under the lock: once published and unpinned a block may be evicted and its slot reused.
                copies.extend((e.key, e.ns, e.tokens, self.block_bytes(e).tobytes()) for e in es
                              if self.index.entries.get(e.key) is e and e.writer is None)

        self._sliced(keep, part)
        for rec in copies:  # after publishing: a record is only ever of a committed block
            self.persist.append(*rec)
        return published[0]

    def abort(self, cid: int, rid: int) -> None:
        """Free reservation ``rid`` of ``cid`` without publishing (unknown ids are ignored)."""
        o = self.owner(cid)
        with self.lock:
            entries = o.reservations.pop(rid, None)
        if entries is not None:  # in slices: an abort of 65,536 blocks held the lock 0.7 s in one piece
            self._sliced([e for e in entries if e is not None], lambda part: self.index.abort(part, o))

    # ------------------------------------------------------------ stats
    def counters(self) -> dict:
        """Monotonic counters for rates (call under the lock)."""
        ic = self.index.c
        out = {"lookups": ic.lookups, "lookup_blocks": ic.lookup_blocks, "hit_blocks": ic.hit_blocks,
               "hit_bytes": self.c["hit_bytes"], "stored_blocks": ic.stored_blocks, "stored_bytes": ic.stored_bytes,
               "evicted_blocks": ic.evicted_blocks, "evicted_bytes": ic.evicted_bytes,
               "redis_hit_blocks": self.c["redis_hit_blocks"], "redis_hit_bytes": self.c["redis_hit_bytes"]}
        if self.tier is not None:
            out.update(self.tier.counters())
        return out

    def committed_bytes(self) -> int:
        """Bytes of the pool the kernel has committed (allocated pages of the memfd)."""
        return os.fstat(self.arena.fd).st_blocks * 512

    def snapshot(self):
        """(pool, clients, counters, raw counters) of this state (:func:`.snapshot.snapshot`)."""
        from cxlalloc.kvstore.server.snapshot import snapshot

        return snapshot(self)

    def check(self) -> None:
        """The index invariants (tests)."""
        with self.lock:
            self.index.check()


def _from_writers(st: "ServerState", ns: str, iks: List[bytes], o: Owner) -> List[Entry]:
    """Blocks of shared namespace ``ns`` that a writer tenant holds (up to
    its first miss), copied into this tenant's pool and pinned for ``o``:
    the reader maps only its own pool.  Never holds two tenants' locks."""
    for w in sorted(st.shared[ns]):
        src = st.siblings.get(w)
        if src is None or src is st:
            continue
        got, tokens = [], 0
        with src.lock:  # copied under the writer's lock: its blocks cannot be evicted meanwhile
            for k in iks:
                e = src.index.entries.get(k)
                if e is None or e.writer is not None or (got and e.nbytes != len(got[0])):
                    break
                got.append(src.block_bytes(e).tobytes())
                tokens = e.tokens
        if not got:
            continue
        with st.lock:
            slots = st.index.reserve(iks[:len(got)], len(got[0]), ns, o, tokens)
        live = list(itertools.takewhile(lambda e: e is not None, slots))
        for e, data in zip(live, got):
            st.view[e.offset:e.offset + e.nbytes] = data
        with st.lock:
            st.index.abort([e for e in slots[len(live):] if e is not None], o)
            st.index.publish(live, o)
            return st.index.match([e.key for e in live], o)
    return []
