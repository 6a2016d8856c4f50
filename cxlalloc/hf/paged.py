"""Continuous batching on cxlalloc's tiers: transformers' paged KV cache in a cxlalloc extent.

transformers serves many requests at once with continuous batching
(``model.generate_batch(...)``, ``model.init_continuous_batching(...)``, and
``transformers serve --continuous-batching``, which calls the latter;
``transformers/generation/continuous_batching/``, 5.24).  Its paged cache
(``PagedAttentionCache``, ``cache.py``) is one flat tensor of fixed-size
*blocks* (``page_size`` tokens of every layer's K and V), sized from free VRAM
when the manager starts; requests get blocks from a pool, complete blocks are
hashed for prefix sharing, and under pressure requests are preempted into a
pinned CPU swap pool (``offloading_manager.py``) or reset and re-prefilled.

On a wrapped model (:func:`cxlalloc.hf.wrap`) the same entry points run on
cxlalloc (:class:`CxlPagedAttentionCache`):

* **Blocks from cxlalloc memory.**  The flat cache tensor is a cxlalloc extent
  of class ``kv`` committed when the manager starts: its chunks go to VRAM
  while the device budget allows and to the host tier past it, so the number
  of blocks (and of requests in flight) is bounded by device + host budget,
  not by VRAM.  Default size (``ContinuousBatchingConfig.num_blocks=None``):
  the device tier's room for KV, and as much again on the host tier (at most
  its room); a ``num_blocks`` you set is used as given (refused, naming it,
  when device + host cannot hold it).
* **KV-aware placement.**  Before each batch, the chunks holding blocks of
  the requests scheduled in it are promoted to VRAM, newest block first (a
  request's last block before its earlier ones), demoting chunks that hold
  only blocks of waiting/preempted requests or cold cached prefixes
  (:func:`plan_moves`; the engine moves whole chunks, address unchanged,
  :meth:`cxlalloc.Allocator.migrate`).  Attention reads host-tier chunks in
  place either way, so placement changes speed, never tokens.
* **Prefixes that outlive their blocks** (``wrap(..., kv_store=...)``): every
  block the cache hashes as complete is written to the KV store
  (:mod:`cxlalloc.kvstore`: the same chained keys and model fingerprint as
  ``generate()``'s reuse, with ``page_size`` tokens per stored block), so when
  continuous batching later evicts it (and forgets its hash) the prefix is not
  lost; a new request whose prefix misses in the paged cache is looked up in
  the store and the stored blocks are copied into fresh blocks (hashed, so
  later requests share them) instead of being prefilled again, across
  requests, processes (a kv-server) and restarts (Redis).
* **The swap pool on the host tier.**  ``cpu_offload_space`` (GiB) is served
  from cxlalloc's host tier (the chosen NUMA/CXL node) instead of a pinned
  ``torch.empty(..., pin_memory=True)``, sized to exactly the sectors asked
  (rounded up to the extent's chunk).

What is not shared is said once (:class:`ContinuousBatchingWarning`): models
with sliding-window or other non-full-attention layers, where transformers
turns prefix sharing off (the store is then off too, the cache is still
tiered), and tensor parallelism (left to transformers, untiered).

``hf.stats(model)["hf"]["continuous_batching"]`` reports what happened
(docs/huggingface.md#continuous-batching).  What this module relies on in
transformers' code: docs/sources.md#transformers-continuous-batching.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import warnings
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cxlalloc.config import format_bytes
from cxlalloc.hf.compat import continuous_batching_gap
from cxlalloc.kvstore import keys as kvkeys
from cxlalloc.kvstore.layout import BlockLayout

GiB = 1 << 30

CB_GAP = continuous_batching_gap()  # None: this transformers has what is replaced here
if CB_GAP is None:
    from transformers.generation.continuous_batching import continuous_api as _tf_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import CachePool
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
else:  # stand-ins so the module imports; install() leaves continuous batching to transformers and says so
    _tf_api = None
    PagedAttentionCache = CachePool = object
    compute_block_hash = None


class ContinuousBatchingWarning(UserWarning):
    """Part of a wrapped model's continuous batching is not tiered or not shared
    (said once per model and situation)."""


# --------------------------------------------------------------------------- placement (a pure decision)
def plan_moves(chunk_rank: Dict[int, int], on_device: Sequence[int], device_slots: int) -> Tuple[List[int], List[int]]:
    """Which chunks to demote and promote so the hottest chunks are in VRAM.

    Args:
        chunk_rank: ``{chunk: rank}`` for chunks holding blocks of scheduled
            requests; rank 0 is hottest (a request's newest block), larger is
            older.  Chunks absent are cold (waiting/preempted requests, cached
            prefixes, free blocks).
        on_device: chunks now in VRAM.
        device_slots: how many of this cache's chunks VRAM may hold now
            (those on device plus the device tier's free room, in chunks).

    Returns:
        ``(demote, promote)``: chunk lists, demotions first (they make the
        room), each in the order to carry out.  Only as many promotions as
        ``device_slots`` allows; a cold chunk in VRAM is demoted only to make
        room for a hotter one.
    """
    want = sorted(chunk_rank, key=lambda c: (chunk_rank[c], c))[:max(0, device_slots)]
    want_set = set(want)
    dev = set(on_device)
    promote = [c for c in want if c not in dev]
    free = max(0, device_slots - len(dev))
    need = max(0, len(promote) - free)
    # Victims: cold chunks first (oldest address last-in), then hot chunks that did not make the cut, coldest first.
    cold = sorted((c for c in dev if c not in chunk_rank), reverse=True)
    warm = sorted((c for c in dev if c in chunk_rank and c not in want_set), key=lambda c: (-chunk_rank[c], c))
    demote = (cold + warm)[:need]
    promote = promote[:free + len(demote)]
    return demote, promote


# --------------------------------------------------------------------------- per-model state and stats
@dataclasses.dataclass
class CBCounters:
    """Counters of a wrapped model's continuous batching (all caches it made)."""

    managers: int = 0
    caches: int = 0
    steps: int = 0
    max_requests_in_flight: int = 0
    scheduled_requests: int = 0
    promoted_bytes: int = 0
    demoted_bytes: int = 0
    placement_failures: int = 0
    peak_kv_device_bytes: int = 0
    peak_kv_host_bytes: int = 0
    preemptions: int = 0
    swapped_requests: int = 0
    reprefilled_requests: int = 0
    vram_hit_tokens: int = 0
    store_lookups: int = 0
    store_hit_tokens: int = 0
    store_hit_blocks: int = 0
    reprefills_avoided: int = 0
    stored_blocks: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_ms: float = 0.0
    store_ms: float = 0.0
    store_failures: int = 0
    # {tier: {"blocks", "tokens", "bytes"}}: prefix tokens reused by where they came from (cxlalloc.hf.reuse.TIERS:
    # vram_prefix = blocks already in the paged cache, then the store's host / pool / remote tiers)
    tiers: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)


class CBState:
    """What :func:`install` attached: the wrap state, counters, the live cache."""

    def __init__(self, model, wrap_state):
        self._model = weakref.ref(model)
        self.wrap_state = wrap_state
        self.counters = CBCounters()
        self.lock = threading.Lock()
        self.warned: set = set()
        self.untiered_reason: Optional[str] = None
        self.prefix_sharing: Optional[bool] = None
        self.prefix_sharing_off_reason: Optional[str] = None
        self.store_off_reason: Optional[str] = None
        self._cache: Optional[weakref.ref] = None
        self.last_cache: Optional[dict] = None
        self.swap_pool: Optional[dict] = None
        self.orig_init = None

    @property
    def model(self):
        return self._model()

    def warn_once(self, key: str, text: str, stacklevel: int = 3) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(text, ContinuousBatchingWarning, stacklevel=stacklevel)

    def cache(self) -> Optional["CxlPagedAttentionCache"]:
        return None if self._cache is None else self._cache()

    def stats(self) -> dict:
        """``hf.stats(model)["hf"]["continuous_batching"]`` (keys: docs/huggingface.md#continuous-batching)."""
        with self.lock:
            c = dataclasses.asdict(self.counters)
        cache = self.cache()
        desc = cache.describe() if cache is not None else self.last_cache
        store = None
        reuse = self.wrap_state.reuse
        if reuse is not None:
            store = {"enabled": self.store_off_reason is None and reuse.layout is not None,
                     "off_reason": self.store_off_reason, "store": reuse.store.stats()}
        return {
            "tiered": None if desc is None and self.untiered_reason is None else self.untiered_reason is None,
            "untiered_reason": self.untiered_reason,
            "prefix_sharing": self.prefix_sharing,
            "prefix_sharing_off_reason": self.prefix_sharing_off_reason,
            "cache": desc,
            "swap_pool": self.swap_pool,
            "kv_store": store,
            "counters": c,
        }


# --------------------------------------------------------------------------- the paged cache on cxlalloc
class _LowestFirstPool(CachePool):
    """transformers' sector pool, handing out the lowest free sector first
    (the stock pool pops the highest), so the sectors in use stay packed at
    the start of the extent and its VRAM chunks hold live blocks."""

    def allocate_sector(self, index: int) -> None:
        sector_id = min(self.free_sectors)
        self.free_sectors.remove(sector_id)
        self._free_blocks[index].add_tree(sector_id)


_TLS = threading.local()  # the CBState of the wrapped manager building its cache on this thread
_STOCK_CACHE = PagedAttentionCache  # transformers' class (continuous_api's name is rebound to _paged_cache)
_patch_lock = threading.Lock()


def _paged_cache(*args, **kwargs):
    """Stands for ``PagedAttentionCache`` in transformers' ``continuous_api``:
    a :class:`CxlPagedAttentionCache` when a wrapped model's manager builds its
    cache on this thread, transformers' own otherwise (unwrapped models are
    unaffected)."""
    cb = getattr(_TLS, "cb", None)
    if cb is None:
        return _STOCK_CACHE(*args, **kwargs)
    return CxlPagedAttentionCache(cb, *args, **kwargs)


def _patch_transformers() -> None:
    """Route ``continuous_api``'s ``PagedAttentionCache(...)`` through
    :func:`_paged_cache` (once per process)."""
    with _patch_lock:
        if _tf_api.PagedAttentionCache is not _paged_cache:
            _tf_api.PagedAttentionCache = _paged_cache


class CxlPagedAttentionCache(PagedAttentionCache):
    """transformers' ``PagedAttentionCache`` whose cache tensor is a cxlalloc
    extent (class ``kv``), with KV-aware placement per batch and, with a KV
    store, complete blocks stored and missing prefixes loaded.

    Built by a wrapped model's continuous-batching manager (never by hand):
    the arguments are transformers' (``PagedAttentionCache.__init__``).

    Raises:
        ValueError: ``num_blocks`` asks more than device + host can hold.
        cxlalloc.OutOfMemoryError: the cache fits in neither tier.
    """

    def __init__(self, cb: CBState, config, continuous_batching_config, device, distributed_helper,
                 dtype=torch.float16, model_supports_logits_to_keep: bool = False):
        self.cb = cb
        self.allocator = cb.wrap_state.allocator
        asked_blocks = continuous_batching_config.num_blocks
        # Let transformers lay out everything (allocators, sectors, max_batch_tokens) over a one-block tensor,
        # then put the real cache tensor, in cxlalloc, under the same allocators.
        probe = dataclasses.replace(continuous_batching_config, num_blocks=1)
        super().__init__(config, probe, device, distributed_helper, dtype, model_supports_logits_to_keep)
        bps = self.bytes_per_sector
        full = next(iter(self.cache_allocators.values()))
        self.model_block_bytes = full.bytes_per_page * config.num_hidden_layers  # page_size tokens, every layer
        self.num_sectors = self._plan_sectors(asked_blocks)
        total = (self.num_sectors + 2) * bps
        t0 = time.perf_counter()
        self.extent = self.allocator.extent(total, tag="kv")
        self.extent.grow(total)
        tensor = self.extent.tensor()[:total]
        tensor.zero_()  # the read-trash sector must read zeros (padding tokens); the stock cache is torch.zeros
        self.cache_tensor = tensor
        self.pool = _LowestFirstPool(self.num_sectors, len(self.cache_allocators))
        non_trash = self.num_sectors * bps
        for ca in self.cache_allocators.values():
            ca.register_cache_tensor(bps, non_trash, self.cache_tensor, self.pool)
        self.num_blocks = non_trash // self.model_block_bytes
        self.read_cache_limit = self._infer_read_cache_limit()
        self.max_decode_fast_path_length = self._infer_max_decode_fast_path_length()
        self.max_tokens_read = max(ca.tokens_per_page * ca.num_blocks for ca in self.cache_allocators.values())
        self.open_ms = (time.perf_counter() - t0) * 1e3
        self.chunk = self.extent.chunk_bytes
        self.page_size = full.tokens_per_page
        self._setup_store(config)

    # ------------------------------------------------------------------ sizing
    def _rooms(self) -> Tuple[int, int]:
        """(device bytes KV may still take: the device limit less what is
        reserved, the headroom and ``kv_device_limit``'s rest; host bytes free)."""
        s = self.allocator.stats()
        dev, host = s["device"], s["host"]
        dev_room = int(dev.get("limit_bytes", 0)) - int(dev.get("reserved_bytes", 0)) - self._headroom
        if self._kv_cap:
            dev_room = min(dev_room, self._kv_cap - int(s["kv"]["device_bytes"]))
        host_room = int(host.get("limit_bytes", 0)) - int(host.get("reserved_bytes", 0))
        return max(0, dev_room), max(0, host_room)

    def _plan_sectors(self, asked_blocks: Optional[int]) -> int:
        bps = self.bytes_per_sector
        info = self.allocator.info()
        kv_cap, headroom = info.get("kv_device_limit"), info.get("device_headroom")
        self._kv_cap = kv_cap if isinstance(kv_cap, int) and kv_cap > 0 else 0
        self._headroom = headroom if isinstance(headroom, int) and headroom > 0 else 0
        self.movable = bool(info.get("demotion_supported", True))
        dev_room, host_room = self._rooms()
        chunk = int(info.get("device_granularity") or (2 << 20))
        # Whole chunks on each tier (the extent commits chunk by chunk), the two trash sectors included.
        room = (dev_room // chunk) * chunk + (host_room // chunk) * chunk
        if asked_blocks is not None:
            sectors = max(1, math.ceil(int(asked_blocks) * self.model_block_bytes / bps))
            if (sectors + 2) * bps > room:
                raise ValueError(
                    f"cxlalloc.hf: ContinuousBatchingConfig(num_blocks={asked_blocks}) needs "
                    f"{format_bytes((sectors + 2) * bps)} of KV, but the device tier has {format_bytes(dev_room)} "
                    f"and the host tier {format_bytes(host_room)} free; use num_blocks <= "
                    f"{max(0, room // bps - 2) * bps // self.model_block_bytes}, or raise host_limit in "
                    "cxlalloc.hf.wrap(model, ..., host_limit=...)")
            return sectors
        dev_chunks = (dev_room // chunk) * chunk
        target = min(2 * dev_chunks, dev_chunks + (host_room // chunk) * chunk)
        sectors = target // bps - 2
        if sectors < 1:
            raise ValueError(f"cxlalloc.hf: continuous batching needs at least {format_bytes(3 * bps)} of KV "
                             f"(one sector and two trash sectors); the device tier has {format_bytes(dev_room)} and "
                             f"the host tier {format_bytes(host_room)} free: raise device_limit or host_limit in "
                             "cxlalloc.hf.wrap(model, ...)")
        return sectors

    # ------------------------------------------------------------------ placement
    def tier_bytes(self) -> Tuple[int, int]:
        """(device bytes, host bytes) of this cache's extent."""
        d = h = 0
        for _off, length, tier in self.extent.tiers():
            if tier == "device":
                d += length
            elif tier == "host":
                h += length
        return d, h

    def _chunk_tiers(self) -> Dict[int, str]:
        out = {}
        for off, length, tier in self.extent.tiers():
            for c in range(off // self.chunk, (off + length) // self.chunk):
                out[c] = tier
        return out

    def place(self, states) -> None:
        """Promote the chunks of the scheduled requests' blocks (newest first)
        to VRAM, demoting cold ones to make room (:func:`plan_moves`).  With a
        backend that cannot move chunks (``pinned``) the placement stays as
        committed."""
        if not self.movable:
            self._note_tiers()
            return
        rank: Dict[int, int] = {}
        for ca in self.cache_allocators.values():  # each views the whole tensor in blocks of its own size
            size = ca.bytes_per_block
            for state in states:
                table = ca.block_table.get(state.request_id, [])
                n = len(table)
                for i, b in enumerate(table):
                    start = b * size  # block ids count from the tensor's start (trash sectors included)
                    r = n - 1 - i  # 0: the request's newest block
                    for c in range(start // self.chunk, (start + size - 1) // self.chunk + 1):
                        if r < rank.get(c, 1 << 62):
                            rank[c] = r
        tiers = self._chunk_tiers()
        on_device = [c for c, t in tiers.items() if t == "device"]
        free_chunks = self._rooms()[0] // self.chunk
        demote, promote = plan_moves(rank, on_device, len(on_device) + free_chunks)
        moved_down = moved_up = 0
        failures = 0
        base = self.extent.base
        for c in demote:
            try:
                moved_down += self.allocator.demote(base + c * self.chunk, self.chunk)
            except Exception:
                failures += 1
        for c in promote:
            try:
                moved_up += self.allocator.promote(base + c * self.chunk, self.chunk)
            except Exception:  # no room after all (another allocation took it): keep it where it is
                failures += 1
                break
        with self.cb.lock:
            k = self.cb.counters
            k.promoted_bytes += moved_up
            k.demoted_bytes += moved_down
            k.placement_failures += failures
        self._note_tiers()

    def _note_tiers(self) -> None:
        desc = self.describe()
        with self.cb.lock:
            k = self.cb.counters
            k.peak_kv_device_bytes = max(k.peak_kv_device_bytes, desc["kv_device_bytes"])
            k.peak_kv_host_bytes = max(k.peak_kv_host_bytes, desc["kv_host_bytes"])
            self.cb.last_cache = desc

    # ------------------------------------------------------------------ the KV store
    def _setup_store(self, config) -> None:
        self.store_on = False
        reuse = self.cb.wrap_state.reuse
        cb = self.cb
        cb.prefix_sharing = bool(self.use_prefix_sharing)
        if not self.use_prefix_sharing:
            kinds = sorted(self.cache_allocators)
            cb.prefix_sharing_off_reason = (
                "allow_block_sharing=False" if not self.allow_block_sharing else
                f"transformers shares blocks only when every layer is full attention; this model's paged cache has "
                f"{', '.join(kinds)} layers")
            if self.allow_block_sharing:
                cb.warn_once("sharing", f"cxlalloc.hf: continuous batching of {type(cb.model).__name__}: prefixes are "
                             f"not shared ({cb.prefix_sharing_off_reason}); its KV blocks are tiered, but every "
                             "request prefills its whole prompt" + ("" if reuse is None else
                                                                    " and kv_store is not used"), stacklevel=6)
            if reuse is not None:
                cb.store_off_reason = cb.prefix_sharing_off_reason
            return
        if reuse is None:
            return
        if reuse.layout is None:
            cb.store_off_reason = reuse.off_reason
            return
        full = self.cache_allocators.get("full_attention")
        L = config.num_hidden_layers
        self.layout = BlockLayout(self.page_size, self.dtype, tuple((full.num_key_value_heads, full.head_dim,
                                                                     full.head_dim) for _ in range(L)))
        reuse.store.check_block_bytes(self.layout.stored_bytes)
        self.reuse = reuse
        self.ns = reuse.opts.cache_salt or ""
        self._root = None
        self._root_fp = None
        self.store_on = True
        self._wrap_allocator(full)

    def root(self) -> bytes:
        """The chain root of this paged cache.  The fingerprint (a digest of
        every weight byte, ``PrefixReuse.fingerprint``) is taken once per
        paged cache, i.e. per ``generate_batch()`` call or continuous-batching
        manager: the weights must not change in place while one serves."""
        fp = self._root_fp if self._root_fp is not None else self.reuse.fingerprint()
        if self._root is None or fp != self._root_fp:
            self._root = kvkeys.root_key(fp, self.layout.signature(), self.page_size, self.reuse.opts.cache_salt)
            self._root_fp = fp
        return self._root

    def _block_view(self, full, block_id: int) -> torch.Tensor:
        """Block ``block_id`` as ``(layers, 2, page_size, H, D)`` (the paged layout)."""
        H, D = full.num_key_value_heads, full.head_dim
        return full._copy_view[block_id].view(self.dtype).view(full.pages_per_block, 2, self.page_size, H, D)

    def _store_rows(self, raw: torch.Tensor, full) -> torch.Tensor:
        """A stored block's bytes as ``(layers, 2, page_size, H, D)`` (the store
        is token-major, :mod:`cxlalloc.kvstore.layout`)."""
        H, D = full.num_key_value_heads, full.head_dim
        rows = self.layout.rows(raw).view(self.page_size, full.pages_per_block, 2, H, D)
        return rows.permute(1, 2, 0, 3, 4)

    def _wrap_allocator(self, full) -> None:
        """Store complete blocks (write-through, as transformers hashes them) and
        load prefixes that miss in the paged cache from the store."""
        orig_mark = full.mark_complete_blocks

        def mark_complete_blocks(request_id, token_ids, new_new_blocks):
            table = full.block_table.get(request_id, [])
            before = [full.ledger.block_to_hash.get(b) is not None for b in table]
            orig_mark(request_id, token_ids, new_new_blocks)
            table = full.block_table.get(request_id, [])
            fresh = [i for i, b in enumerate(table)
                     if (i >= len(before) or not before[i]) and full.ledger.block_to_hash.get(b) is not None]
            if fresh:
                self._store_blocks(full, request_id, table, token_ids, fresh)

        full.mark_complete_blocks = mark_complete_blocks
        self._keys: Dict[str, List[bytes]] = {}  # request -> store keys of its complete blocks so far

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """transformers' release of a request's blocks; also drops its store keys."""
        if self.store_on:
            self._keys.pop(request_id, None)
        super().free_blocks(request_id, no_cache)

    def mark_complete_blocks(self, state, complete_blocks) -> None:
        """transformers' hashing of the blocks the last forward completed; and,
        for a request that just finished, the store of its complete blocks
        transformers never hashed: it skips finished requests
        (``PagedAttentionCache.mark_complete_blocks``), so a request answered
        in one token (its prompt's blocks) would otherwise be lost when its
        blocks are freed right after."""
        super().mark_complete_blocks(state, complete_blocks)
        if not self.store_on or not complete_blocks or getattr(state.status, "name", None) != "FINISHED":
            return
        full = self.cache_allocators["full_attention"]
        table = full.block_table.get(state.request_id)
        if not table:  # async batching freed it already
            return
        token_ids = state.initial_tokens + state.generated_tokens
        # K/V are in the cache for every token but the last generated one (never run through the model)
        n = min(len(table), min(int(state.position_offset), len(token_ids) - 1) // self.page_size)
        todo = [i for i in range(n) if full.ledger.block_to_hash.get(table[i]) is None]
        if todo:
            self._store_blocks(full, state.request_id, table, token_ids, todo)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        if self.store_on:
            self._keys.clear()
        super().free_all_requests(clear_ledgers)

    def _chain(self, request_id: str, token_ids, n: int) -> List[bytes]:
        """The store keys of the request's first ``n`` blocks, extending the
        chain kept per request (hashing each block once, not the whole prefix
        at every completed block)."""
        keys = self._keys.setdefault(request_id, [])
        if len(keys) < n:
            P = self.page_size
            more = token_ids[len(keys) * P:n * P]
            keys.extend(kvkeys.chain_keys(self.root(), torch.tensor(more, dtype=torch.long), P,
                                          start_key=keys[-1] if keys else None))
        return keys[:n]

    def _store_blocks(self, full, request_id: str, table, token_ids, positions: List[int]) -> None:
        t0 = time.perf_counter()
        stored = nbytes = 0
        try:
            keys = self._chain(request_id, token_ids, max(positions) + 1)
            want = [(i, keys[i]) for i in positions if i < len(keys)]
            if not want:
                return
            res = self.reuse.store.reserve(self.ns, [k for _, k in want], self.layout.stored_bytes, self.page_size)
            try:
                written = []
                for (i, k), view in zip(want, res.views):
                    if view is None:  # already stored
                        continue
                    self._store_rows(view, full).copy_(self._block_view(full, table[i]))
                    written.append((k, view))
                    nbytes += self.layout.block_bytes
                _sync(self.device)
                for k, view in written:  # the checksum trailer, over the bytes that landed
                    self.layout.seal(view, k)
                stored = res.commit()
            finally:
                res.abort()
        except Exception:  # storing is best effort: the request's answer does not depend on it
            with self.cb.lock:
                self.cb.counters.store_failures += 1
            return
        dt = time.perf_counter() - t0
        with self.cb.lock:
            k = self.cb.counters
            k.stored_blocks += stored
            k.bytes_stored += nbytes
            k.store_ms += dt * 1e3
        if nbytes:
            self.reuse.store.record_store(nbytes, dt)

    def search_prefix_match(self, request_id: str, prompt_ids: list) -> int:
        """transformers' match against the blocks in the cache, then, with a KV
        store, the longest stored continuation loaded into fresh blocks.
        Returns the matched tokens (never the whole prompt: at least its last
        token is prefilled)."""
        matched = super().search_prefix_match(request_id, prompt_ids)
        with self.cb.lock:
            self.cb.counters.vram_hit_tokens += matched
            if matched:
                d = self.cb.counters.tiers.setdefault("vram_prefix", {"blocks": 0, "tokens": 0, "bytes": 0})
                d["blocks"] += matched // self.page_size
                d["tokens"] += matched
        if not self.store_on:
            return matched
        full = self.cache_allocators["full_attention"]
        P = self.page_size
        max_blocks = (len(prompt_ids) - 1) // P
        have = matched // P
        if max_blocks <= have:
            return matched
        try:
            loaded = self._load_blocks(full, request_id, prompt_ids, have, max_blocks)
        except Exception:  # never a wrong token: the request prefills what was not loaded
            loaded = 0
            with self.cb.lock:
                self.cb.counters.store_failures += 1
            self.reuse.store.record_failure()
        return (have + loaded) * P

    def _load_blocks(self, full, request_id: str, prompt_ids: list, have: int, max_blocks: int) -> int:
        P = self.page_size
        ids = torch.tensor(prompt_ids[:max_blocks * P], dtype=torch.long)
        keys = kvkeys.chain_keys(self.root(), ids, P, max_blocks=max_blocks)
        with self.cb.lock:
            self.cb.counters.store_lookups += 1
        lease = self.reuse.store.lookup(self.ns, keys)
        corrupt = []
        try:
            n_hit = lease.blocks
            for j in range(have, n_hit):
                v = lease.views[j]
                if v.numel() != self.layout.stored_bytes:
                    return 0
                if self.reuse.opts.kv_store_verify and not self.layout.verify(v, keys[j]):
                    corrupt.append(keys[j])  # used up to the block before; dropped and stored anew
                    n_hit = j
                    break
            extra = n_hit - have
            if extra <= 0:
                return 0
            # Fresh blocks, as can_store_request_tokens would get them (sectors first); none: load nothing.
            missing = extra - self.pool.count_free_blocks(full.index)
            if missing > 0:
                sectors = math.ceil(missing / full.blocks_per_sector)
                if self.pool.num_free_sectors < sectors:
                    return 0
                for _ in range(sectors):
                    self.pool.allocate_sector(full.index)
            blocks = self.pool.get_free_blocks(full.index, extra)
            t0 = time.perf_counter()
            try:
                for j, b in enumerate(blocks):
                    self._block_view(full, b).copy_(self._store_rows(lease.views[have + j], full))
                _sync(self.device)
            except BaseException:
                self.pool.free_blocks(full.index, blocks)  # never half applied: the request prefills instead
                raise
            dt = time.perf_counter() - t0
        finally:
            lease.close()
            if corrupt:
                self.reuse.drop_corrupt(self.ns, corrupt)
        # Hash them as transformers would (chained over the tokens), so later requests share them in VRAM.
        parent = None
        table = full.block_table.setdefault(request_id, [])
        for i in range(n_hit):
            h = compute_block_hash(parent, prompt_ids[i * P:(i + 1) * P])
            if i >= have:
                b = blocks[i - have]
                if full.ledger.register_new_hash(b, h) is not None:
                    pass  # an identical block is hashed already (cannot be: it would have matched); keep ours unhashed
                table.append(b)
            parent = h
        nbytes = extra * self.layout.block_bytes
        where = [t for t, n in (getattr(lease, "tiers", None) or [("store", n_hit)]) for _ in range(int(n))]
        with self.cb.lock:
            k = self.cb.counters
            for j in range(have, have + extra):
                d = k.tiers.setdefault(where[j] if j < len(where) else "store", {"blocks": 0, "tokens": 0, "bytes": 0})
                d["blocks"] += 1
                d["tokens"] += P
                d["bytes"] += self.layout.block_bytes
            k.store_hit_blocks += extra
            k.store_hit_tokens += extra * P
            k.reprefills_avoided += 1
            k.bytes_loaded += nbytes
            k.load_ms += dt * 1e3
        self.reuse.store.record_load(nbytes, dt)
        return extra

    # ------------------------------------------------------------------ stats
    def describe(self) -> dict:
        d, h = self.tier_bytes()
        full = next(iter(self.cache_allocators.values()))
        free_blocks = self.compute_free_capacity(relative=False) // max(1, self.model_block_bytes)
        return {
            "num_blocks": int(self.num_blocks),
            "page_size": int(self.page_size),
            "block_bytes": int(self.model_block_bytes),
            "sectors": int(self.num_sectors),
            "sector_bytes": int(self.bytes_per_sector),
            "cache_bytes": int(self.extent.capacity),
            "kv_device_bytes": d,
            "kv_host_bytes": h,
            "free_blocks": int(free_blocks),
            "cached_blocks": len(full.ledger.cached_blocks),
            "max_batch_tokens": int(self.max_batch_tokens),
            "layer_kinds": sorted(self.cache_allocators),
            "store": bool(self.store_on),
            "open_ms": round(self.open_ms, 3),
            "attention_mask_bytes": int(getattr(self, "mask_bytes", 0)),
        }


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(torch.device(device)).synchronize()


# --------------------------------------------------------------------------- the swap pool on the host tier
def _host_swap_pool(cb: CBState, bp, gib: Optional[float]) -> None:
    """Give ``bp.offloading_manager`` a swap pool of ``gib`` GiB on cxlalloc's
    host tier (transformers' own: ``torch.empty(..., pin_memory=True)``).
    ``None`` (transformers: size from free RAM) is the cache's own size."""
    om = bp.offloading_manager
    cache = bp.cache
    if gib is not None and gib <= 0:
        cb.swap_pool = {"enabled": False, "off_reason": "cpu_offload_space=0 (transformers' default): preempted "
                        "requests are reset and re-prefilled"}
        return
    want = cache.num_sectors * cache.bytes_per_sector if gib is None else int(gib * GiB)
    sectors = want // cache.bytes_per_sector
    if sectors == 0:
        cb.swap_pool = {"enabled": False, "off_reason": f"cpu_offload_space={gib} GiB is below one sector "
                        f"({format_bytes(cache.bytes_per_sector)})"}
        return
    alloc = cb.wrap_state.allocator
    nbytes = sectors * cache.bytes_per_sector
    ext = alloc.extent(nbytes, tag="kv")
    # Chunk by chunk, each demoted as soon as it is committed: a committed KV chunk goes to VRAM first (and
    # would push the cache's older chunks out); so at most one of them moves to the host tier, and comes back
    # at the next batch's placement.
    chunk = ext.chunk_bytes
    for end in range(chunk, ext.capacity + chunk, chunk):
        ext.grow(min(end, nbytes))
        try:
            alloc.demote(ext.base + end - chunk, 1)
        except Exception:  # a backend that cannot move chunks (pinned): the pool stays where it was committed
            pass
        if end >= nbytes:
            break
    tensor = ext.tensor()[:nbytes]
    om._swap_extent = ext
    om._num_cpu_sectors = sectors
    om._cpu_tensor = tensor
    om._cpu_pool = CachePool(sectors, len(cache.cache_allocators), num_reserved_sectors=0)
    om._cpu_views = {}
    for name, ca in cache.cache_allocators.items():
        om._cpu_pool.set_blocks_per_sector(ca.index, ca.blocks_per_sector)
        om._cpu_views[name] = tensor.view(-1, ca.bytes_per_block)
    d = h = 0
    for _off, length, tier in ext.tiers():
        d += length if tier == "device" else 0
        h += length if tier == "host" else 0
    cb.swap_pool = {"enabled": True, "tier": "host", "sectors": sectors, "bytes": nbytes,
                    "reserved_bytes": int(ext.capacity), "device_bytes": d, "host_bytes": h,
                    "numa_node": alloc.stats()["host"].get("numa_node")}


# --------------------------------------------------------------------------- hooks
def _count_offloads(cb: CBState, om) -> None:
    orig = om._offload_to_cpu

    def _offload_to_cpu(victims, tables):
        swapped = orig(victims, tables)
        with cb.lock:
            k = cb.counters
            k.preemptions += len(victims)
            k.swapped_requests += len(swapped)
            k.reprefilled_requests += len(victims) - len(swapped)
        return swapped

    om._offload_to_cpu = _offload_to_cpu


def _hook_batches(cb: CBState, bp) -> None:
    orig = bp.prepare_next_batch
    sched = bp.scheduler

    def prepare_next_batch():
        ok = orig()
        if ok:
            states = [fs.state for fs in getattr(bp.inputs_and_outputs, "requests_in_batch", [])] or \
                list(sched.active_requests.values())
            with cb.lock:
                k = cb.counters
                k.steps += 1
                k.scheduled_requests += len(states)
                k.max_requests_in_flight = max(k.max_requests_in_flight, len(sched.active_requests))
            if isinstance(bp.cache, CxlPagedAttentionCache):
                bp.cache.place(states)
        return ok

    bp.prepare_next_batch = prepare_next_batch


MASK_WARN_BYTES = 2 * GiB  # attention masks this large can take the VRAM left to torch (not measured on a GPU)


def _mask_bytes(bp) -> int:
    """Bytes of the attention masks transformers allocated for this batch
    processor (``sdpa``/``eager``: ``(1, 1, M, N + M)`` per layer type, per
    IO pair with async batching; none with flash attention)."""
    ios = [bp.inputs_and_outputs]
    for pair in getattr(bp.inputs_and_outputs, "io_pairs", ()) or ():
        ios += [getattr(pair, "host_io", None), getattr(pair, "device_io", None)]
    total, seen = 0, set()
    for io in ios:
        masks = getattr(io, "attention_mask", None)
        for t in (masks.values() if isinstance(masks, dict) else ()):
            if torch.is_tensor(t):
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total


def _untiered_reason(manager) -> Optional[str]:
    dh = getattr(manager, "distributed_helper", None)
    if dh is not None and getattr(dh, "tp_size", 1) > 1:
        return f"tensor parallelism (tp_size={dh.tp_size}): each rank's paged cache stays transformers' own"
    return None


def _attach(cb: CBState, manager) -> None:
    orig_create = manager._create_batch_processor

    def _create_batch_processor():
        existing = getattr(manager, "batch_processor", None)
        if isinstance(existing, _tf_api.ContinuousBatchProcessor):
            return orig_create()
        reason = _untiered_reason(manager)
        if reason is not None:
            cb.untiered_reason = reason
            cb.warn_once("untiered", f"cxlalloc.hf: continuous batching of {type(cb.model).__name__} is not tiered: "
                         f"{reason}; its KV cache is in torch's memory, outside device_limit", stacklevel=4)
            return orig_create()
        cfg = manager.continuous_batching_config
        gib = cfg.cpu_offload_space
        cfg.cpu_offload_space = 0.0  # transformers' pinned pool is replaced by one on the host tier
        _TLS.cb = cb
        try:
            bp = orig_create()
        finally:
            _TLS.cb = None
            cfg.cpu_offload_space = gib
        cache = bp.cache
        if isinstance(cache, CxlPagedAttentionCache):
            with cb.lock:
                cb.counters.caches += 1
            cache.mask_bytes = _mask_bytes(bp)
            if cache.mask_bytes > MASK_WARN_BYTES:
                cb.warn_once("mask", f"cxlalloc.hf: continuous batching of {type(cb.model).__name__}: transformers' "
                             f"attention masks take {format_bytes(cache.mask_bytes)} of torch's memory for "
                             f"{cache.num_blocks} blocks (they grow with the cache under sdpa/eager); use a flash "
                             "attention implementation, a smaller max_batch_tokens or num_blocks", stacklevel=4)
            cb._cache = weakref.ref(cache)
            cb.last_cache = cache.describe()
            _host_swap_pool(cb, bp, gib)
        _count_offloads(cb, bp.offloading_manager)
        _hook_batches(cb, bp)
        return bp

    manager._create_batch_processor = _create_batch_processor
    manager._cxlalloc_cb = cb
    with cb.lock:
        cb.counters.managers += 1


def install(model, wrap_state) -> CBState:
    """Make ``model.init_continuous_batching`` (and so ``generate_batch``,
    ``continuous_batching_context_manager`` and transformers' serving code)
    build its paged cache on cxlalloc (an instance attribute; :func:`uninstall`
    removes it).  Returns the :class:`CBState` kept in the wrap state."""
    cb = CBState(model, wrap_state)
    orig = model.init_continuous_batching
    cb.orig_init = orig
    if CB_GAP is None:
        _patch_transformers()
    else:
        cb.untiered_reason = CB_GAP

    def init_continuous_batching(*args, **kwargs):
        manager = orig(*args, **kwargs)
        if cb.untiered_reason is not None and CB_GAP is not None:
            cb.warn_once("untiered", f"cxlalloc.hf: continuous batching of {type(model).__name__} is not tiered: "
                         f"{CB_GAP}; its paged KV cache is transformers' own, in torch's memory", stacklevel=3)
        elif getattr(manager, "_cxlalloc_cb", None) is None:
            _attach(cb, manager)
        return manager

    init_continuous_batching.__doc__ = getattr(orig, "__doc__", None)
    model.__dict__["init_continuous_batching"] = init_continuous_batching
    return cb


__all__ = ["CxlPagedAttentionCache", "ContinuousBatchingWarning", "CBState", "install", "plan_moves"]
