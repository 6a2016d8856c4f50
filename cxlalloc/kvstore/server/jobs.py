"""The kv-server's background jobs: placement checks, rate sampling, the Redis tier link.

* :class:`PlacementVerifier`: which committed blocks to publish.  With
  ``--strict-placement`` each block is verified before it is published and a
  misplaced one dropped; otherwise the check runs on a thread after the block
  is published (counted, warned once), so a commit never waits for it.
* :class:`RateSampler`: a sample of the monotonic counters every second, for
  the per-second rates of ``--status`` and the metrics (a 10 s window).
* :class:`RedisLink`: the pool's side of a :class:`~cxlalloc.kvstore.tiers.redis.RedisTier`
  (``--redis``): evicted blocks written back (``--redis-mode evict``) or every
  committed block written through (``through``), and blocks the pool misses
  read through into it.  It is handed the tier object; it never imports the
  Redis module, so a pool hit never touches it.

Each job works on a :class:`~cxlalloc.kvstore.server.state.ServerState`
(its lock, index, counters and the pool's bytes).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import deque
from typing import List, Optional

from cxlalloc.config import format_bytes
from cxlalloc.kvstore.index import Entry
from cxlalloc.kvstore.server.state import ServerState, log
from cxlalloc.kvstore.tiers import Tier
from cxlalloc.policy import redis_write_back as write_back

RATE_WINDOW_S = 10.0
VERIFY_QUEUE = 65536             # blocks waiting for their placement check
VERIFY_EVERY_S = 0.2             # the background checker's batch interval (a block is checked within ~0.2-0.4 s)
REDIS_MODES = write_back.MODES  # --redis-mode

_MADV_POPULATE_READ = 22  # linux/mman.h, Linux 5.14+


def _libc(name: str, *argtypes):
    """libc's ``name`` with ``argtypes``, returning int; None where it is missing."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_madvise = _libc("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_mincore = _libc("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


class PlacementVerifier:
    """Page-by-page placement checks (``move_pages``) of committed blocks.

    Args:
        state: the pool.
        strict: verify before publishing and drop a misplaced block.
        page: the page size (bytes).
    """

    def __init__(self, state: ServerState, strict: bool, page: int):
        self.state, self.strict, self._page = state, bool(strict), int(page)
        self._q: "deque[tuple]" = deque()
        self._cv = threading.Condition()
        self._verifying = 0
        self._warned = False
        self._stop = threading.Event()

    def __call__(self, entries: List[Entry]) -> List[Entry]:
        """The entries to publish (all of them unless strict and misplaced)."""
        if not self.strict:
            skipped = 0
            with self._cv:
                for e in entries:
                    if len(self._q) < VERIFY_QUEUE:
                        self._q.append((e.offset, e.nbytes))
                    else:
                        skipped += e.nbytes
                # No wake-up per commit: a woken checker takes the GIL from the
                # thread about to send this commit's reply (measured: a commit of
                # 64 blocks 1.9 ms with a wake-up, 0.27 ms without); it runs in
                # batches every VERIFY_EVERY_S, sooner only when the queue fills.
                if len(self._q) >= VERIFY_QUEUE // 2:
                    self._cv.notify()
            if skipped:
                self.state.count("placement_skipped_bytes", skipped)
            return list(entries)
        keep: List[Entry] = []
        self._verify_into(entries, keep)
        return keep

    def run(self) -> None:
        """The thread's loop: verify what commits queued, until :meth:`stop`."""
        while True:
            with self._cv:
                if self._verifying:
                    self._verifying = 0
                    self._cv.notify_all()
                while not self._stop.is_set() and len(self._q) < VERIFY_QUEUE // 2:
                    self._cv.wait(VERIFY_EVERY_S)
                    if self._q:
                        break  # one batch per interval: what the last VERIFY_EVERY_S of commits queued
                if self._stop.is_set():
                    return
                batch = list(self._q)
                self._q.clear()
                self._verifying = len(batch)
            self._verify_ranges(batch)

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()

    def pending(self) -> int:
        """Blocks waiting for (or in) their background placement check."""
        with self._cv:
            return len(self._q) + self._verifying

    def _verify_into(self, entries: List[Entry], keep: List[Entry]) -> None:
        """Check ``entries`` and append the ones to publish to ``keep`` (:meth:`_verify_ranges`)."""
        self._verify_ranges([(e.offset, e.nbytes) for e in entries], entries, keep)

    def _verify_ranges(self, ranges: List[tuple], entries: Optional[List[Entry]] = None,
                       keep: Optional[List[Entry]] = None) -> None:
        """Check the blocks ``ranges`` (``(offset, nbytes)`` each; ``entries``: their index entries, kept in
        ``keep`` when published, None for the background check of blocks already published).

        Blocks side by side in the pool (a reservation's slots mostly are) are checked as one run: one
        ``move_pages`` query of the run; a run whose every page is on the node is counted and kept whole.  A
        run with a page elsewhere or not yet mapped in this process (a slot's first use) is checked block by
        block as before, so what is counted, warned about and dropped is exact per block.  (Measured on the
        2-core Xeon VM: a 64-block batch of 64 KiB blocks cost 1.5-1.9 ms checked block by block, three system
        calls and the Python around them per block; 0.1-0.2 ms as one run.)"""
        st = self.state
        on = 0
        n = len(ranges)
        i = 0
        while i < n:
            first, size = ranges[i]
            end, j = first + size, i + 1
            while j < n and ranges[j][0] == end:
                end += ranges[j][1]
                j += 1
            try:
                chk = st.arena.verify(first, end - first)
            except Exception:
                chk = None
            if chk is not None and int(chk["on_node"]) == end - first:
                on += end - first
                if keep is not None:
                    keep.extend(entries[i:j])
            else:
                run = entries[i:j] if entries is not None else \
                    [Entry(key=b"", offset=o, nbytes=b, ns="", tokens=0) for o, b in ranges[i:j]]
                self._verify_blocks(run, keep if keep is not None else [])
            i = j
        if on:
            with st.lock:
                st.c["placement_verified_bytes"] += on

    def _verify_blocks(self, entries: List[Entry], keep: List[Entry]) -> None:
        st = self.state
        on = off = unpop = dropped = 0
        for e in entries:
            try:
                # The client wrote these pages through its own mapping; read one
                # byte of each so they are in this process's page table too
                # (move_pages reports pages of the caller's mappings only).
                # Only pages the pool already holds are read: a read fault on
                # a never-written page of the memfd would allocate it.
                resident = self._touch(e.offset, e.nbytes)
                if not resident:
                    unpop += e.nbytes
                    keep.append(e)
                    continue
                chk = st.arena.verify(e.offset, e.nbytes)
            except Exception:
                unpop += e.nbytes
                keep.append(e)
                continue
            on += int(chk["on_node"])
            unpop += int(chk["unpopulated"])
            wrong = int(chk["elsewhere"])
            off += wrong
            if wrong and not self._warned:  # said once; every misplaced block is still counted and dropped
                self._warned = True
                log.warning("%s of a block landed outside node %d (%s)%s", format_bytes(wrong), st.node,
                            chk["detail"], "; dropped (--strict-placement)" if self.strict else "")
            if wrong and self.strict:
                dropped += 1
                continue
            keep.append(e)
        with st.lock:
            st.c["placement_verified_bytes"] += on
            st.c["placement_misplaced_bytes"] += off
            st.c["placement_unverified_bytes"] += unpop
            st.c["misplaced_dropped_blocks"] += dropped

    def _touch(self, off: int, n: int) -> int:
        """Map into this process the pages of ``[off, off + n)`` the pool holds
        (``mincore``: in the memfd's page cache); never-written pages are left
        alone, so a check never commits memory.  Returns pages mapped."""
        page = self._page
        first = off - off % page
        npages = -(-(off + n - first) // page)
        base = self.state.arena.base + first
        vec = ctypes.create_string_buffer(npages)
        if _mincore is None or _mincore(base, npages * page, vec) != 0:
            return 0  # cannot tell which pages exist: verify nothing rather than allocate
        present = [i for i, b in enumerate(vec.raw) if b & 1]
        if len(present) == npages and _madvise is not None and \
                _madvise(base, npages * page, _MADV_POPULATE_READ) == 0:
            return npages
        mem = self.state.mem
        for i in present:  # one read per resident page: a read of a cached page maps it, allocates nothing
            mem[first + i * page]  # noqa: B018
        return len(present)


class RateSampler:
    """Per-second rates of the state's monotonic counters over the last :data:`RATE_WINDOW_S`."""

    def __init__(self, state: ServerState):
        self.state = state
        self._samples: "deque[tuple]" = deque(maxlen=600)

    def run(self, stop: threading.Event) -> None:
        """The thread's loop: one sample a second until ``stop`` is set."""
        while not stop.wait(1.0):
            with self.state.lock:
                self._samples.append((time.monotonic(), self.state.counters()))

    def rates(self, now_counters: dict) -> dict:
        """``{"window_s", "lookups_per_s", ...}`` (``{"window_s": 0.0}`` before a 0.5 s window exists)."""
        now = time.monotonic()
        old = None
        for t, c in self._samples:
            if now - t <= RATE_WINDOW_S + 0.5:
                old = (t, c)
                break
        if old is None or now - old[0] < 0.5:
            return {"window_s": 0.0}
        dt = now - old[0]
        d = {k: now_counters.get(k, 0) - old[1].get(k, 0) for k in now_counters}
        out = {"window_s": round(dt, 3),
               "lookups_per_s": d["lookups"] / dt,
               "loads_per_s": d["hit_blocks"] / dt, "load_bytes_per_s": d["hit_bytes"] / dt,
               "stores_per_s": d["stored_blocks"] / dt, "store_bytes_per_s": d["stored_bytes"] / dt,
               "evictions_per_s": d["evicted_blocks"] / dt,
               "hit_rate": d["hit_blocks"] / d["lookup_blocks"] if d["lookup_blocks"] else None,
               "redis_loads_per_s": d["redis_hit_blocks"] / dt, "redis_load_bytes_per_s": d["redis_hit_bytes"] / dt}
        if "redis_put_blocks" in d:
            out.update(redis_stores_per_s=d["redis_put_blocks"] / dt, redis_store_bytes_per_s=d["redis_put_bytes"] / dt)
        return out


class RedisLink:
    """The pool's side of a Redis tier (the ``tier`` of a :class:`ServerState`).

    Args:
        state: the pool.
        redis: the tier below the pool, a :class:`~cxlalloc.kvstore.tiers.Tier`
            (a :class:`~cxlalloc.kvstore.tiers.redis.RedisTier` today; ``put_ns``,
            ``get_many_ns``, ``down``, ``stats``).
        mode: ``"evict"`` (written when evicted) or ``"through"`` (when committed);
            the decision is :mod:`cxlalloc.policy.redis_write_back`.
        placement: which blocks read from Redis to publish (the state's ``placement``).
    """

    def __init__(self, state: ServerState, redis: Tier, mode: str, placement):
        self.state, self.redis, self.mode, self.placement = state, redis, mode, placement

    def down(self) -> bool:
        return self.redis.down()

    def counters(self) -> dict:
        rs = self.redis.stats()
        return {"redis_put_blocks": rs["put_blocks"], "redis_put_bytes": rs["put_bytes"],
                "redis_lookup_blocks": rs["lookup_blocks"]}

    def evicted(self, e: Entry) -> None:
        # Under the state's lock, before the slot is reused: copy the bytes
        # out; the tier sends them from its own thread.
        if not write_back.write_on_evict(self.mode):
            return  # written when committed
        if self.redis.put_ns(e.key, self.state.block_bytes(e).tobytes(), e.tokens):
            self.state.c["redis_put_blocks"] += 1

    def write_through(self, entries: List[Entry]) -> int:
        """Send committed blocks (``through`` mode); returns how many were queued."""
        if not write_back.write_on_commit(self.mode):
            return 0
        sent = 0
        for e in entries:  # still WRITING and owned by the committer: nobody else touches the slot
            sent += bool(self.redis.put_ns(e.key, self.state.block_bytes(e).tobytes(), e.tokens))
        return sent

    def read_through(self, ns: str, iks: List[bytes], owner) -> List[Entry]:
        """The blocks of ``iks`` (namespaced keys, in order) Redis has, up to
        its first miss, copied into the pool and pinned for ``owner``."""
        st = self.state
        got, toks = [], []
        for v in self.redis.get_many_ns_tokens(iks):
            if v is None:
                break
            got.append(v[0])
            toks.append(v[1])
        if not got:
            return []
        nbytes = len(got[0])
        got = [d for d in itertools.takewhile(lambda d: len(d) == nbytes, got)]
        if st.index.slot_size(nbytes) > st.index.largest_block():
            return []
        with st.lock:
            slots = st.index.reserve(iks[:len(got)], nbytes, ns, owner)
        written = []
        for e, data, tok in zip(slots, got, toks):
            if e is None:
                break
            st.view[e.offset:e.offset + e.nbytes] = data
            e.tokens = tok  # recorded in the value: hit_tokens counts restored blocks too
            written.append(e)
        keep = self.placement(written)
        with st.lock:
            kept = set(map(id, keep))
            st.index.abort([e for e in slots if e is not None and id(e) not in kept], owner)
            st.index.publish(keep, owner)
            pinned = st.index.match([e.key for e in keep], owner)
            st.index.c.lookups -= 1  # part of this lookup
            st.index.c.lookup_blocks -= len(keep)
            st.c["redis_hit_blocks"] += len(pinned)
            st.c["redis_hit_bytes"] += sum(e.nbytes for e in pinned)
            st.c["redis_hit_tokens"] += sum(e.tokens for e in pinned)
        return pinned
