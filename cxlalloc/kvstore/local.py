"""The in-process KV reuse store: blocks in a host arena on the allocator's host node.

:class:`LocalBlockStore` keeps KV blocks (:mod:`cxlalloc.kvstore.layout`) in a
:class:`cxlalloc._C.HostArena` on the same NUMA node as the allocator's host
tier (the CXL node where one is chosen), indexed by chained keys
(:mod:`cxlalloc.kvstore.keys`) in a :class:`~cxlalloc.kvstore.index.BlockIndex`.

* **Exact size, lazily committed.**  The arena is one ``MAP_NORESERVE``
  mapping of exactly ``limit`` bytes (page-rounded), bound to the node before
  first touch; pages are committed as blocks are written, so a store far
  larger than VRAM starts at once.  Never ``torch.empty(pin_memory=True)``,
  whose caching host allocator rounds each block up to a power of two (1.3-1.9x
  the memory asked for; docs/sources.md#host-pinning).
* **Placement verified** page by page (``move_pages``) after each block is
  written, as for every host-tier segment: misplaced bytes are counted and
  warned about, or the block is dropped with ``strict_placement``.
* **GPU registration** chunk by chunk, when a chunk first receives a block
  (``cuMemHostRegister``), so H2D/D2H copies of blocks run on the copy engines.
* **Thread-safe**: one lock around the index; copies run outside it on
  blocks that are pinned (being read) or WRITING (being written), which
  eviction never touches.

A ``lower`` tier (a :class:`cxlalloc.kvstore.tiers.Tier`, e.g. the Redis tier
:class:`cxlalloc.kvstore.tiers.redis.RedisTier`) is asked for blocks this store
misses, and receives blocks by ``lower_mode`` (:mod:`cxlalloc.policy.redis_write_back`):
``"through"`` (the default; each block when it is committed, so another
process sharing the tier hits it at once) or ``"evict"`` (each block when it
is evicted from here: fewer writes, but nothing is shared until this store is
full).  Sending is asynchronous (the tier's own writer thread; the bytes are
copied out first); what is queued at interpreter exit is sent for up to 2 s.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import warnings
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from cxlalloc import _C
from cxlalloc.config import format_bytes, parse_size_or_fraction
from cxlalloc.kvstore.handles import ScopedHandle
from cxlalloc.kvstore.index import BlockIndex, Entry
from cxlalloc.kvstore.layout import verify_stored
from cxlalloc.kvstore.store import AccountedStore, hit_rate
from cxlalloc.kvstore.tiers import Tier
from cxlalloc.policy.redis_write_back import check_mode, write_on_commit, write_on_evict

DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_LIMIT_FRACTION = 0.25  # of the host tier's limit


class KVStoreWarning(UserWarning):
    """A KV reuse store could not do all it was asked (placement, registration, room)."""


def resolve_limit(limit, host_limit_bytes: int) -> int:
    """``kv_store_limit`` in bytes: bytes, a size string, or a fraction of the
    host tier's limit (``0.25``, ``"25%"``); None = 25% of the host tier.

    Raises:
        ValueError: naming ``kv_store_limit`` (a bad value, or 0 bytes).
    """
    if limit is None:
        value = DEFAULT_LIMIT_FRACTION
    else:
        value = parse_size_or_fraction(limit, "kv_store_limit", of="the host tier")
    if isinstance(value, float):
        if host_limit_bytes <= 0:
            raise ValueError("cxlalloc option 'kv_store_limit': a fraction of the host tier needs a host tier, but "
                             "host_limit is 0; give kv_store_limit in bytes (e.g. '4GiB')")
        value = int(value * host_limit_bytes)
    if value <= 0:
        raise ValueError(f"cxlalloc option 'kv_store_limit': {limit!r} resolves to 0 bytes; use a size such as "
                         "'4GiB' or a fraction of the host tier such as 0.25")
    return int(value)


class Lease(ScopedHandle):
    """Blocks found by :meth:`LocalBlockStore.lookup`, pinned until :meth:`close`.

    ``views[i]`` is block ``i``'s bytes (1-D uint8 CPU tensor over the arena;
    pinned memory on a GPU machine).  Use as a context manager.
    """

    def __init__(self, store, entries: List[Entry], owner, views: List[torch.Tensor], from_lower: int = 0):
        self._store, self.entries, self._owner, self.views = store, entries, owner, views
        # Where the blocks came from, in order: this store's host/CXL memory, then the tier below.
        self.tiers = [("host", len(entries) - from_lower), ("remote", from_lower)]

    @property
    def blocks(self) -> int:
        return len(self.entries)

    def close(self) -> None:
        if self._store is not None:
            self._store._unpin(self.entries, self._owner)
            self._store = None
            self.views = []

    _release = close


class Reservation(ScopedHandle):
    """Slots for new blocks from :meth:`LocalBlockStore.reserve`: write each
    ``views[i]`` (None where the key was already stored or no room was left),
    then :meth:`commit`; leaving the ``with`` block without a commit (an
    exception) aborts, so nothing half-written is ever visible."""

    def __init__(self, store, entries: List[Optional[Entry]], owner, views: List[Optional[torch.Tensor]]):
        self._store, self.entries, self._owner, self.views = store, entries, owner, views

    @property
    def slots(self) -> int:
        return sum(1 for e in self.entries if e is not None)

    def commit(self) -> int:
        """Publish the written blocks; returns how many became visible."""
        if self._store is None:
            return 0
        store, self._store = self._store, None
        return store._publish([e for e in self.entries if e is not None], self._owner)

    def abort(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            store._abort([e for e in self.entries if e is not None], self._owner)

    _release = abort  # after commit() this does nothing


class LocalBlockStore(AccountedStore):
    """KV blocks of every model of this process in one host arena (a
    :class:`~cxlalloc.kvstore.store.BlockStore`).

    Args:
        allocator: the :class:`cxlalloc.Allocator` whose host node (and, on a
            GPU, device) the store uses; ``simulate=True`` ones place the arena
            through the simulated NUMA records.
        limit: ``kv_store_limit``: bytes, a size string, or a fraction of the
            allocator's host tier (default 25%).
        chunk_bytes: placement and GPU-registration unit (bytes; default 256 MiB,
            at most the limit).
        quotas: ``{cache_salt: bytes}`` per-namespace limits (None: the store's).
        strict_placement: drop a block whose pages did not land on the node
            (default: keep it, count it, warn once).
        lower: the tier below, a :class:`~cxlalloc.kvstore.tiers.Tier`
            (``put``, ``get_many`` on a miss, ``stats``, ``close``; ``flush(timeout)``
            if it queues), or None.
        lower_mode: when blocks go to ``lower``: ``"through"`` (when
            committed; shared at once) or ``"evict"`` (when evicted).

    Raises:
        ValueError: a bad ``kv_store_limit`` or ``lower_mode``.
        cxlalloc.OutOfMemoryError: the arena's address space cannot be mapped.
    """

    kind = "local"

    def __init__(self, allocator, limit=None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 quotas: Optional[Dict[str, int]] = None, strict_placement: bool = False,
                 lower: Optional[Tier] = None, lower_mode: str = "through"):
        check_mode(lower_mode, "lower_mode")
        st = allocator.stats()
        self.allocator = allocator
        self.node = int(st["host"]["numa_node"])
        self.capacity_bytes = resolve_limit(limit, int(st["host"]["limit_bytes"]))
        self.simulated = bool(allocator.simulated)
        chunk = max(4096, min(int(chunk_bytes), self.capacity_bytes) // 4096 * 4096)
        self._arena = _C.HostArena(allocator._engine, self.capacity_bytes, self.node, False, -1, chunk,
                                   int(allocator.device))
        self._bytes = torch.from_dlpack(self._arena.dlpack())
        self.lower = lower
        self.lower_mode = lower_mode
        if lower is not None and hasattr(lower, "flush"):
            atexit.register(_flush_at_exit, weakref.ref(self))
        self.strict_placement = bool(strict_placement)
        self._lock = threading.Lock()
        self._owners = itertools.count(1)
        self.index = BlockIndex(self.capacity_bytes, chunk, quotas=quotas,
                                on_evict=self._evicted if lower is not None and write_on_evict(lower_mode) else None)
        super().__init__(("placement_verified_bytes", "placement_misplaced_bytes",
                                       "placement_unverified_bytes", "register_failures", "lower_hit_blocks",
                                       "lower_put_blocks", "corrupt_blocks"))
        self._warned = set()

    def check_block_bytes(self, nbytes: int) -> None:
        """Raise ValueError naming ``kv_store_limit`` if a block of ``nbytes`` can never fit."""
        self.index.check_block_bytes(nbytes)

    # ------------------------------------------------------------ helpers
    def _view(self, e: Entry) -> torch.Tensor:
        return self._bytes[e.offset:e.offset + e.nbytes]

    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(msg, KVStoreWarning, stacklevel=4)

    def _evicted(self, e: Entry) -> None:
        # Under the lock: copy out before the slot is reused (the lower tier
        # sends it asynchronously).  A closed store has no tier left to send to.
        lower = self.lower
        if lower is None:
            return
        lower.put(e.key, e.ns, self._view(e).numpy().tobytes(), tokens=e.tokens)
        self.counters.add("lower_put_blocks", 1)

    # ------------------------------------------------------------ reads
    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lease:
        """The longest stored prefix of ``keys`` (block keys of one sequence,
        in order), pinned: no eviction touches them until the lease closes.
        Blocks missing here are asked of the lower tier, if any, and copied in."""
        owner = next(self._owners)
        with self._lock:
            entries = self.index.match(keys, owner)
        lower = []
        if self.lower is not None and len(entries) < len(keys):
            lower = self._from_lower(ns, list(keys[len(entries):]), owner)
            entries += lower
        return Lease(self, entries, owner, [self._view(e) for e in entries], from_lower=len(lower))

    def _from_lower(self, ns: str, keys: List[bytes], owner) -> List[Entry]:
        got, toks = [], []
        for v in self.lower.get_many_tokens(keys, ns=ns):
            if v is None:
                break
            data, tok = v
            got.append(data)
            toks.append(tok)
        if not got:
            return []
        out = []
        with self._lock:
            slots = self.index.reserve(keys[:len(got)], len(got[0]), ns, owner)
        for e, data, tok in zip(slots, got, toks):
            if e is None or len(data) != e.nbytes:
                break
            self._view(e).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            e.tokens = tok  # recorded in the value (0 for values written without it)
            out.append(e)
        with self._lock:
            self.index.publish(out, owner)
            self.index.abort([e for e in slots if e is not None and e not in out], owner)
            # Re-match so the blocks come back pinned, like local hits.
            pinned = self.index.match([e.key for e in out], owner)
            self.index.c.lookups -= 1  # the inner match is part of this lookup
        self.counters.add("lower_hit_blocks", len(pinned))
        return pinned

    def _unpin(self, entries, owner) -> None:
        with self._lock:
            self.index.unpin(entries, owner)

    # ------------------------------------------------------------ writes
    def reserve(self, ns: str, keys: Sequence[bytes], nbytes: int, tokens: int) -> Reservation:
        """Slots of ``nbytes`` for each key not stored yet (LRU blocks are
        evicted to make room; never a pinned or WRITING one).

        Raises:
            ValueError: one block is larger than the store can hold (names
                ``kv_store_limit``).
        """
        owner = next(self._owners)
        with self._lock:
            entries = self.index.reserve(keys, nbytes, ns, owner, tokens)
        views: List[Optional[torch.Tensor]] = []
        for e in entries:
            if e is None:
                views.append(None)
                continue
            try:
                self._arena.ensure_registered(e.offset, e.nbytes)
            except Exception as exc:  # pageable copies still work, slower
                self.counters.add("register_failures", 1)
                self._warn_once("register", f"cxlalloc kv store: registering a chunk for the GPU failed ({exc}); "
                                            "blocks in it are copied through pageable memory (slower)")
            views.append(self._view(e))
        return Reservation(self, entries, owner, views)

    def _publish(self, entries: List[Entry], owner) -> int:
        keep = []
        for e in entries:
            try:
                chk = self._arena.verify(e.offset, e.nbytes)
            except Exception:
                self.counters.add("placement_unverified_bytes", e.nbytes)
                keep.append(e)
                continue
            self.counters.add("placement_verified_bytes", int(chk["on_node"]))
            wrong = int(chk["elsewhere"])
            self.counters.add("placement_misplaced_bytes", wrong)
            self.counters.add("placement_unverified_bytes", int(chk["unpopulated"]))
            if wrong:
                self._warn_once("placement", f"cxlalloc kv store: {format_bytes(wrong)} of a block landed outside "
                                             f"NUMA node {self.node} ({chk['detail']})"
                                             + ("; dropped (strict_placement)" if self.strict_placement else ""))
                if self.strict_placement:
                    continue
            keep.append(e)
        lower = self.lower
        if lower is not None and write_on_commit(self.lower_mode):
            for e in keep:  # still WRITING and ours: copied out now, sent by the tier's writer thread
                lower.put(e.key, e.ns, self._view(e).numpy().tobytes(), tokens=e.tokens)
            self.counters.add("lower_put_blocks", len(keep))
        with self._lock:
            kept = set(map(id, keep))
            self.index.abort([e for e in entries if id(e) not in kept], owner)
            return self.index.publish(keep, owner)

    def _abort(self, entries, owner) -> None:
        with self._lock:
            self.index.abort(entries, owner)

    def discard(self, ns: str, keys: Sequence[bytes]) -> int:
        """Drop blocks a reader found corrupt (checksum trailer wrong,
        :func:`~cxlalloc.kvstore.layout.verify_stored`): each is checked again
        here and dropped only if it fails and nobody holds it.  Counts
        ``corrupt_blocks``; returns how many were dropped."""
        with self._lock:
            n = self.index.discard(list(keys), lambda e: not verify_stored(self._view(e).numpy(), e.key))
        self.counters.add("corrupt_blocks", n)
        return n

    # ------------------------------------------------------------ accounting
    def clear(self, ns: Optional[str] = None) -> int:
        """Drop every stored block (of namespace ``ns``) not in use; returns blocks dropped."""
        with self._lock:
            return self.index.clear(ns)

    def stats(self) -> dict:
        """Counters and capacity (bytes, counts, seconds, GB/s = 1e9 bytes/s).

        Keys: ``kind``, ``node``, ``capacity_bytes``, ``used_bytes``,
        ``blocks``, ``lookups``, ``lookup_blocks``, ``hit_blocks``,
        ``hit_tokens``, ``miss_blocks``, ``hit_rate`` (hit/looked-up blocks),
        ``index_bytes_per_block`` (the index's memory per stored block),
        ``stored_blocks``, ``evicted_blocks``, ``dropped_blocks`` (no room),
        ``bytes_loaded``/``bytes_stored`` and ``load_GBps``/``store_GBps``
        (copies timed by the caller), ``load_failures`` (fell back to
        recompute), placement bytes, ``registered_bytes``, ``namespaces``.
        """
        with self._lock:
            c = dict(vars(self.index.c))
            c["used_bytes"] = self.index.used_bytes
            c["blocks"] = self.index.blocks()  # running counts: O(1) at any store size
            c["index_bytes_per_block"] = round(self.index.memory_per_block(), 1)
            c["namespaces"] = {ns: b for ns, b in self.index.ns_bytes.items() if b}
        c.update(self.counters.snapshot())
        a = self._arena.stats()
        c.update(kind=self.kind, node=self.node, capacity_bytes=self.capacity_bytes, simulated=self.simulated,
                 registered_bytes=a["registered_bytes"], numa_method=self._arena.numa_method)
        c["register_failures"] += a["register_failures"]
        c["hit_rate"] = hit_rate(c["hit_blocks"], c["lookup_blocks"])
        if self.lower is not None:
            c["lower"] = self.lower.stats()
        return c

    def close(self, timeout: float = 2.0) -> None:
        """Close the tier below, if any: its queued write-backs are sent for up
        to ``timeout`` seconds, then its writer thread and connections stop.  The
        pool itself stays readable for leases still open (it is freed with the
        store).  Idempotent."""
        with self._lock:
            lower, self.lower = self.lower, None
        if lower is not None:
            lower.close(timeout)

    def flush(self, timeout: float = 2.0) -> bool:
        """Wait until the blocks queued for the tier below were sent (True), up to ``timeout`` s."""
        lower = self.lower
        return lower.flush(timeout) if lower is not None and hasattr(lower, "flush") else True

    def check(self) -> None:
        """Verify the index invariants (tests)."""
        with self._lock:
            self.index.check()

    def __repr__(self) -> str:
        return (f"<cxlalloc LocalBlockStore {format_bytes(self.index.used_bytes)} of "
                f"{format_bytes(self.capacity_bytes)} on node {self.node}>")


def _flush_at_exit(ref) -> None:
    store = ref()
    if store is not None:
        try:
            store.flush(2.0)
        except Exception:  # interpreter shutdown: nothing more to do
            pass
