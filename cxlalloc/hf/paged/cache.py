"""The paged KV cache of continuous batching in a cxlalloc extent (:class:`CxlPagedAttentionCache`),
with complete blocks stored in, and missing prefixes loaded from, the KV store
(:mod:`cxlalloc.hf.store_io`)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Dict, List, Optional

import torch

from cxlalloc.hf.paged.gpu_parts import GpuPart, StripedBlocks, local_pages, local_rows
from cxlalloc.hf.paged.placement import PlacementMixin
from cxlalloc.hf.paged.stats import CBState
from cxlalloc.hf.paged.tf_classes import CachePool, PagedAttentionCache, compute_block_hash
from cxlalloc.hf.store_io import BlockReader, BlockWriter, add_tiers, lease_tiers
from cxlalloc.kvstore import keys as kvkeys
from cxlalloc.kvstore.layout import BlockLayout


class _LowestFirstPool(CachePool):
    """transformers' sector pool, handing out the lowest free sector first
    (the stock pool pops the highest), so the sectors in use stay packed at
    the start of the extent, its VRAM chunks hold live blocks, and memory is
    committed only as far as the highest sector handed out
    (:meth:`CxlPagedAttentionCache.grow_to`)."""

    def __init__(self, num_sectors: int, num_allocators: int, cache=None) -> None:
        super().__init__(num_sectors, num_allocators)
        self.cache = cache

    def allocate_sector(self, index: int) -> None:
        sector_id = min(self.free_sectors)
        if self.cache is not None:
            self.cache.grow_to(sector_id - 1)  # sector ids count the two trash sectors: id 2 is the first
        self.free_sectors.remove(sector_id)
        self._free_blocks[index].add_tree(sector_id)


class CxlPagedAttentionCache(PlacementMixin, PagedAttentionCache):
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
        self.mask_bytes = 0  # transformers' attention masks for this cache (set by the batch-processor hook)
        asked_blocks = continuous_batching_config.num_blocks
        # Let transformers lay out everything (allocators, sectors, max_batch_tokens) over a one-block tensor,
        # then put the real cache tensor, in cxlalloc, under the same allocators.
        probe = dataclasses.replace(continuous_batching_config, num_blocks=1)
        super().__init__(config, probe, device, distributed_helper, dtype, model_supports_logits_to_keep)
        bps = self.bytes_per_sector
        full = next(iter(self.cache_allocators.values()))
        self.model_block_bytes = full.bytes_per_page * config.num_hidden_layers  # page_size tokens, every layer
        self.parts = self._make_parts(config, full)
        self.striped = self.parts[0].rows_per_block is not None  # split over GPUs (gpu_parts)
        self._local: Dict[tuple, tuple] = {}  # (index tensor, GPU) -> (index tensor, its rows on that GPU)
        self.num_sectors = self._plan_sectors(asked_blocks)
        t0 = time.perf_counter()
        # Address space for every planned sector now; memory as sectors are handed out (_LowestFirstPool keeps
        # them packed at the start): the two trash sectors now, the rest by grow_to() as the pool reaches them.
        # One extent per GPU of the model (one on one GPU), each holding its layers' pages of every block.
        for part in self.parts:
            part.extent = part.allocator.extent((self.num_sectors + 2) * part.bytes_per_sector, tag="kv")
            part.chunk = part.extent.chunk_bytes
        self.extent = self.parts[0].extent
        self.chunk = self.parts[0].chunk
        self.pool = _LowestFirstPool(self.num_sectors, len(self.cache_allocators), self)
        self.committed_sectors = -1
        self.grow_to(0)
        non_trash = self.num_sectors * bps
        self.num_blocks = non_trash // self.model_block_bytes
        self.read_cache_limit = self._infer_read_cache_limit()
        self.max_decode_fast_path_length = self._infer_max_decode_fast_path_length()
        # The KV tokens one varlen batch may read (the scheduler's cache budget): transformers sizes its inputs
        # from it once, and under sdpa/eager an attention mask of max_batch_tokens x (this + max_batch_tokens)
        # floats per layer kind; the planned capacity's tokens would make that mask gigabytes (a 6 GiB
        # device_limit: ~8 GB for SmolLM2).  Without flash attention it is what one request can need (the
        # model's max_position_embeddings, at least max_batch_tokens); more requests then take more batches.
        self.max_tokens_read = max(ca.tokens_per_page * ((non_trash // ca.bytes_per_page) // ca.pages_per_block)
                                   for ca in self.cache_allocators.values())
        positions = getattr(config, "max_position_embeddings", None)
        if "flash" not in str(getattr(config, "_attn_implementation", "") or "") and isinstance(positions, int):
            self.max_tokens_read = min(self.max_tokens_read, max(positions, int(self.max_batch_tokens)))
        self.open_ms = (time.perf_counter() - t0) * 1e3
        self.page_size = full.tokens_per_page
        self._setup_store(config)

    # ------------------------------------------------------------------ GPUs
    def _make_parts(self, config, full) -> List[GpuPart]:
        """One :class:`~cxlalloc.hf.paged.gpu_parts.GpuPart` per GPU of the model: on one GPU the full layout
        in the wrapped allocator; on several (full attention only, checked by the manager hook) each GPU's
        layers' pages in that GPU's allocator."""
        st = self.cb.wrap_state
        L = config.num_hidden_layers
        if not st.multi:
            return [GpuPart(gpu=self.allocator.device, allocator=self.allocator, layers=list(range(L)),
                            bytes_per_sector=self.bytes_per_sector, block_bytes=self.model_block_bytes)]
        per_sector = self.bytes_per_sector // full.bytes_per_block  # blocks per sector, the same on every GPU
        parts = []
        for g in st.layout.gpus:
            layers = [i for i in full.layer_indices if st.layout.layer_gpu[i] == g]
            if not layers:
                continue
            block = len(layers) * full.bytes_per_page
            parts.append(GpuPart(gpu=g, allocator=st.allocators[g], layers=layers, bytes_per_sector=per_sector * block,
                                 block_bytes=block, rows_per_block=2 * len(layers) * full.tokens_per_page))
        self._layer_part = {i: p for p in parts for i in p.layers}
        return parts

    def _install_views(self, ca) -> None:
        """Point ``ca`` (transformers' full-attention allocator, registered over a meta tensor of the full
        layout) at the GPUs' extents: each layer's shifted K/V views into its GPU's tensor, the same at page
        granularity, and whole blocks through :class:`StripedBlocks`."""
        H, D, P = ca.num_key_value_heads, ca.head_dim, ca.tokens_per_page
        tokens_views, page_views = {}, {}
        for part in self.parts:
            tokens = (part.tensor.numel() // ca.bytes_per_page) * P
            flat = part.tensor.view(ca.cache_dtype)[:tokens * 2 * H * D].view(tokens * 2, H, D)
            for j, layer in enumerate(part.layers):
                k, v = flat[2 * j * P:], flat[(2 * j + 1) * P:]
                tokens_views[layer] = (k, v)
                kp, vp = k.view(-1, P, H, D), v.view(-1, P, H, D)
                n = min(kp.shape[0], vp.shape[0])
                page_views[layer] = (kp[:n], vp[:n])
            part.copy_view = part.tensor.view(-1, part.block_bytes)
        ca._kv_token_views = tokens_views
        ca._kv_page_views = page_views
        ca._copy_view = StripedBlocks(self.parts, len(ca.layer_indices), ca.bytes_per_page, self.device)
        self._local.clear()

    def _local_index(self, index: torch.Tensor, part: GpuPart, rows: bool, ca) -> torch.Tensor:
        """``index`` (full-layout rows, or a block table in pages) as ``part``'s, on its device; computed once per
        index tensor and GPU (every layer of a forward shares the batch's index tensors)."""
        try:
            version = index._version
        except RuntimeError:  # an inference tensor: no version counter
            version = None
        key = (id(index), index.data_ptr(), tuple(index.shape), version, part.gpu, rows)
        hit = self._local.get(key)
        if hit is not None and hit[0] is index:
            return hit[1]
        R = ca.block_physical_stride
        if rows:
            out = local_rows(index, R, part.rows_per_block)
        else:
            P = ca.tokens_per_page
            out = local_pages(index, R // P, part.rows_per_block // P)
        out = out.to(part.device)
        if len(self._local) > 64:
            self._local.clear()
        self._local[key] = (index, out)  # holds the index tensor: its id cannot be reused while cached
        return out

    def update(self, key_states, value_states, layer_idx, kwargs):
        """transformers' write then read of a layer's K/V; on a model split over GPUs with the batch's indices
        translated to the layer's GPU (:mod:`cxlalloc.hf.paged.gpu_parts`)."""
        if self.striped:
            part = self._layer_part[layer_idx]
            ca = self.layer_to_allocator[layer_idx]
            for name in ("read_index", "write_index"):
                got = kwargs.get(name)
                if isinstance(got, (list, tuple)) and ca.index < len(got):
                    got = list(got)
                    got[ca.index] = self._local_index(got[ca.index], part, True, ca)
                    kwargs[name] = got
            table = kwargs.get("block_table")
            if table is not None:
                kwargs["block_table"] = self._local_index(table, part, False, ca)
        return super().update(key_states, value_states, layer_idx, kwargs)

    def _block_out(self, full, block_id: int, dst: torch.Tensor) -> None:
        """Copy block ``block_id`` into ``dst`` (``(layers, 2, page_size, H, D)``)."""
        if not self.striped:
            dst.copy_(self._block_view(full, block_id))
            return
        for part, view in self._part_blocks(full, block_id):
            for a, b, j in part.runs():
                dst[a:b].copy_(view[j:j + b - a])

    def _block_in(self, full, block_id: int, src: torch.Tensor) -> None:
        """Copy ``src`` (``(layers, 2, page_size, H, D)``) into block ``block_id``."""
        if not self.striped:
            self._block_view(full, block_id).copy_(src)
            return
        for part, view in self._part_blocks(full, block_id):
            for a, b, j in part.runs():
                view[j:j + b - a].copy_(src[a:b])

    def _part_blocks(self, full, block_id: int):
        H, D = full.num_key_value_heads, full.head_dim
        for part in self.parts:
            yield part, part.copy_view[block_id].view(self.dtype).view(len(part.layers), 2, self.page_size, H, D)

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
        """Store the request's blocks at ``positions`` of its block table
        (:class:`~cxlalloc.hf.store_io.BlockWriter`); best effort: a failure
        is counted (``store_failures``), the request's answer does not depend on it."""
        writer = BlockWriter(self.reuse.store, self.ns, self.layout, self.page_size)
        try:
            keys = self._chain(request_id, token_ids, max(positions) + 1)
            want = [(i, keys[i]) for i in positions if i < len(keys)]
            if not want:
                return
            writer.write([k for _, k in want],
                         lambda n, view: self._block_out(full, table[want[n][0]], self._store_rows(view, full)),
                         self.device)
        except Exception:  # storing is best effort: the request's answer does not depend on it
            with self.cb.lock:
                self.cb.counters.store_failures += 1
            return
        dt = writer.finish()
        with self.cb.lock:
            k = self.cb.counters
            k.stored_blocks += writer.stored
            k.bytes_stored += writer.nbytes
            k.store_ms += dt * 1e3

    def search_prefix_match(self, request_id: str, prompt_ids: list) -> int:
        """transformers' match against the blocks in the cache, then, with a KV
        store, the longest stored continuation loaded into fresh blocks.
        Returns the matched tokens (never the whole prompt: at least its last
        token is prefilled)."""
        matched = super().search_prefix_match(request_id, prompt_ids)
        with self.cb.lock:
            self.cb.counters.vram_hit_tokens += matched
            if matched:
                add_tiers(self.cb.counters.tiers, {"vram_prefix": {"blocks": matched // self.page_size,
                                                                   "tokens": matched, "bytes": 0}})
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
        """Load the stored blocks ``have..`` of the prompt (at most ``max_blocks``
        in all) into fresh blocks of the request (:class:`~cxlalloc.hf.store_io.BlockReader`);
        returns the blocks loaded (0: none stored, no room, or a block of another size)."""
        P = self.page_size
        ids = torch.tensor(prompt_ids[:max_blocks * P], dtype=torch.long)
        keys = kvkeys.chain_keys(self.root(), ids, P, max_blocks=max_blocks)
        with self.cb.lock:
            self.cb.counters.store_lookups += 1
        reuse = self.reuse
        with BlockReader(reuse.store, self.ns, self.layout, reuse.opts.kv_store_verify, reuse.drop_corrupt) as rd:
            lease, n_hit = rd.lookup(keys, first=have, strict=False)
            if n_hit is None or n_hit <= have:
                return 0
            extra = n_hit - have
            blocks = self._fresh_blocks(full, extra)
            if blocks is None:
                return 0

            def copy_in():
                for j, b in enumerate(blocks):
                    self._block_in(full, b, self._store_rows(lease.views[have + j], full))
                return extra * self.layout.block_bytes, self.device

            try:
                nbytes = rd.copy(copy_in)
            except BaseException:
                self.pool.free_blocks(full.index, blocks)  # never half applied: the request prefills instead
                raise
        self._hash_loaded(full, request_id, prompt_ids, have, n_hit, blocks)
        where = lease_tiers(lease)[have:n_hit]
        with self.cb.lock:
            k = self.cb.counters
            for tier in where:
                add_tiers(k.tiers, {tier: {"blocks": 1, "tokens": P, "bytes": self.layout.block_bytes}})
            k.store_hit_blocks += extra
            k.store_hit_tokens += extra * P
            k.reprefills_avoided += 1
            k.bytes_loaded += nbytes
            k.load_ms += rd.seconds * 1e3
        rd.record(nbytes)
        return extra

    def _fresh_blocks(self, full, n: int) -> Optional[List[int]]:
        """``n`` free blocks, as ``can_store_request_tokens`` would get them
        (sectors first); None when the pool has no room for them."""
        missing = n - self.pool.count_free_blocks(full.index)
        if missing > 0:
            sectors = math.ceil(missing / full.blocks_per_sector)
            if self.pool.num_free_sectors < sectors:
                return None
            for _ in range(sectors):
                self.pool.allocate_sector(full.index)
        return self.pool.get_free_blocks(full.index, n)

    def _hash_loaded(self, full, request_id: str, prompt_ids: list, have: int, n_hit: int, blocks: List[int]) -> None:
        """Hash the loaded blocks as transformers would (chained over the
        tokens) and append them to the request's table, so later requests
        share them in VRAM."""
        P = self.page_size
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
            "cache_bytes": sum(int(p.extent.capacity) for p in self.parts),
            "committed_bytes": sum(int(p.extent.committed) for p in self.parts),
            "committed_sectors": int(self.committed_sectors),
            "kv_device_bytes": d,
            "kv_host_bytes": h,
            "free_blocks": int(free_blocks),
            "cached_blocks": len(full.ledger.cached_blocks),
            "max_batch_tokens": int(self.max_batch_tokens),
            "layer_kinds": sorted(self.cache_allocators),
            "store": bool(self.store_on),
            "open_ms": round(self.open_ms, 3),
            "attention_mask_bytes": int(self.mask_bytes),
            **({"gpus": self._describe_gpus()} if self.striped else {}),
        }

    def _describe_gpus(self) -> Dict[str, dict]:
        """Per GPU of a model split over GPUs: its layers, block bytes, extent and KV bytes per tier."""
        out = {}
        for part in self.parts:
            d, h = self.part_tier_bytes(part)
            out[part.name] = {"layers": list(part.layers), "block_bytes": int(part.block_bytes),
                              "sector_bytes": int(part.bytes_per_sector), "cache_bytes": int(part.extent.capacity),
                              "committed_bytes": int(part.extent.committed), "kv_device_bytes": d,
                              "kv_host_bytes": h, "numa_node": part.allocator.stats()["host"].get("numa_node")}
        return out




__all__ = ["CxlPagedAttentionCache"]
