"""Tiered counterparts of transformers' cache layer kinds other than plain full attention.

Facts about transformers' layers: docs/sources.md#transformers-layer-kinds.
Which stock layer becomes which (registered in :data:`cxlalloc.hf.cache.TIERED_LAYERS`,
used by :class:`~cxlalloc.hf.CxlCache`; the table is in docs/huggingface.md#what-runs-where):

| transformers 5.24 layer (``cache_utils.py``) | cxlalloc.hf layer | in the extents |
|---|---|---|
| ``DynamicLayer`` (full attention) | :class:`~cxlalloc.hf.CxlKVLayer` | K/V (shared store) |
| ``DynamicIndexedLayer`` (DSA: DeepSeek-V3.2, GLM-MoE-DSA, ...) | :class:`CxlIndexedLayer` | K/V (shared store) + indexer keys (a store per layer) |
| ``LinearAttentionAndFullAttentionLayer`` (``"hybrid"``) | :class:`CxlHybridLayer` | K/V (shared store); conv/recurrent state stays torch's (fixed size) |
| ``DynamicSlidingWindowLayer`` (sliding / chunked) | :class:`~cxlalloc.hf.sliding.CxlSlidingLayer` | the window, bounded |
| ``LinearAttentionAndSlidingWindowAttentionLayer`` (``"hybrid_sliding"``) | :class:`CxlHybridSlidingLayer` | the window; state stays torch's |

Each keeps the stock class's other methods and attributes (``update_indexer``,
``indexer_position_ids``, ``update_conv_state``, ``has_previous_state``, ...)
behaving as the stock class does.  Only exact stock types are replaced: a
model's own subclass keeps its behaviour and is reported as left to
transformers (:mod:`cxlalloc.hf.coverage`).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from transformers.cache_utils import (DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionAndFullAttentionLayer,
                                      LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionLayer)

from cxlalloc.hf.cache import TIERED_LAYERS, CxlKVLayer, KVPool
from cxlalloc.hf.sliding import CxlSlidingLayer
from cxlalloc.hf.storage import Geometry, KVStorage

# Attributes of transformers' LinearAttentionCacheLayerMixin (the fixed-size SSM / conv state).
LINEAR_STATE_ATTRS = ("number_of_states", "conv_states", "recurrent_states", "is_conv_states_initialized",
                      "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size", "record_past")


class CxlIndexedLayer(CxlKVLayer):
    """``DynamicIndexedLayer`` (Dynamic Sparse Attention) with its K/V in the shared
    full-attention store and its indexer keys in a cxlalloc extent of its own.

    ``update_indexer(indexer_key_states)`` takes ``(B, q, D_idx)`` and returns the
    ``(B, L + q, D_idx)`` cached indexer keys (a strided view, values equal to the
    stock layer's ``torch.cat``).  ``indexer_position_ids`` (int64, optional,
    ``[position_dims, B, L]``, set by the model) stays an ordinary tensor, as in
    the stock layer (8 bytes per token and position dim).

    Raises (from ``update_indexer``):
        ValueError: the indexer keys' batch/dim/dtype differ from the cached ones.
        cxlalloc.OutOfMemoryError: neither tier has room.
    """

    def __init__(self, pool: KVPool, share_slot: Optional[int] = None):
        super().__init__(pool, share_slot)
        self._istore: Optional[KVStorage] = None
        self._ilen = 0
        self.indexer_position_ids: Optional[torch.Tensor] = None
        self.is_indexer_initialized = False

    @property
    def indexer_keys(self) -> Optional[torch.Tensor]:
        """``(B, L, D_idx)`` view of the cached indexer keys (None before the first update_indexer)."""
        if not self.is_indexer_initialized:
            return None
        if self._istore is None:
            return torch.empty((0,), dtype=self.indexer_dtype, device=self.indexer_device)
        self._istore.apply_pending()
        return self._istore.key_view(0, 0, self._ilen)[:, 0]

    @indexer_keys.setter
    def indexer_keys(self, value) -> None:
        if value is not None:
            raise AttributeError("cxlalloc.hf: CxlIndexedLayer.indexer_keys is a view of cxlalloc storage; "
                                 "write through update_indexer()")
        self._ilen = 0

    def lazy_initialization_indexer(self, indexer_key_states: torch.Tensor) -> None:
        self.indexer_dtype, self.indexer_device = indexer_key_states.dtype, indexer_key_states.device
        self.is_indexer_initialized = True

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append ``(B, q, D_idx)`` indexer keys in place; returns all cached ones ``(B, L + q, D_idx)``."""
        if not self.is_indexer_initialized:
            self.lazy_initialization_indexer(indexer_key_states)
        b, q, d = indexer_key_states.shape
        g = Geometry(b, 1, d, 0, indexer_key_states.dtype, indexer_key_states.device)
        pool = self._pool
        s = self._istore
        if s is None or (s.g != g and self._ilen == 0):
            self._istore = s = pool.new_store(g, 1, q)
        elif s.g != g:
            raise ValueError(f"cxlalloc.hf: new indexer keys (B={b}, D={d}, {indexer_key_states.dtype}) do not match "
                             f"the {self._ilen} cached ones (B={s.g.batch}, D={s.g.k_dim}, {s.g.dtype}); to continue "
                             f"with num_return_sequences/num_beams=n call cache.batch_repeat_interleave(n) first")
        s.apply_pending()
        need = self._ilen + q
        if need > s.capacity_tokens:
            s.regrow(pool.clamp(pool.capacity_for(need, s.capacity_tokens), need, s.row_bytes))
        s.ensure(need)
        grad = torch.is_grad_enabled() and indexer_key_states.requires_grad
        k = indexer_key_states.detach().unsqueeze(1)  # stored detached, as CxlKVLayer stores K/V
        start = self._ilen
        s.write(0, start, k, k.new_empty((b, 1, q, 0)))
        self._ilen = need
        if grad:  # the stock layer's cat: cached keys (no grad), then this forward's, in its graph
            return torch.cat([s.key_view(0, 0, start)[:, 0], indexer_key_states], dim=1)
        return s.key_view(0, 0, need)[:, 0]

    def _extra_stores(self) -> list:
        return [] if self._istore is None else [self._istore]

    def reset(self) -> None:
        super().reset()
        self._ilen = 0
        if self._istore is not None:
            self._istore._pending = None
            self._istore.trim(0)
        self.indexer_position_ids = None
        self.is_indexer_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove == 0:
            return
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids[..., : -abs(tokens_to_remove)]
        if self._ilen:
            # Only the length: no memory is released (an all-or-nothing crop may put the length back;
            # the rows beyond it are rewritten by the next update_indexer, released by reset()).
            self._ilen = min(self._ilen, int(tokens_to_remove)) if tokens_to_remove > 0 else \
                max(0, self._ilen + int(tokens_to_remove))

    def _reorder_extra(self, beam_idx: torch.LongTensor) -> None:
        if self._ilen:
            self._istore.reorder(beam_idx)
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids.index_select(
                1, beam_idx.to(self.indexer_position_ids.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._reorder_extra(beam_idx)

    def _batch_extra(self, op: str, arg) -> None:
        if self._ilen:
            s = self._istore
            if op == "batch_repeat_interleave":
                new = s.rebuilt(s.g.batch * arg, lambda t: t.repeat_interleave(arg, dim=0))
            else:
                n = torch.arange(s.g.batch)[torch.as_tensor(arg).cpu()].numel()
                new = s.rebuilt(n, lambda t: t[arg])
            new.live_tokens = self._ilen
            self._pool.stores.add(new)
            self._istore = new
        if self.indexer_position_ids is not None:
            p = self.indexer_position_ids
            self.indexer_position_ids = (p.repeat_interleave(arg, dim=1) if op == "batch_repeat_interleave"
                                         else p[:, arg, :])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._batch_extra("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._batch_extra("batch_select_indices", indices)

    def _empty_like(self, pool: KVPool, memo) -> "CxlIndexedLayer":
        new = CxlIndexedLayer(pool, self._share_slot)
        new.is_indexer_initialized = self.is_indexer_initialized
        if self.is_indexer_initialized:
            new.indexer_dtype, new.indexer_device = self.indexer_dtype, self.indexer_device
        if self.indexer_position_ids is not None:
            new.indexer_position_ids = self.indexer_position_ids.clone()
        if self._ilen:
            new._istore = self._istore.clone(pool.counters)
            new._istore.live_tokens = new._ilen = self._ilen
            pool.stores.add(new._istore)
        return new

    def __deepcopy__(self, memo):
        new = super().__deepcopy__(memo)  # K/V in a store of its own
        extra = self._empty_like(self._pool, memo)
        for k in ("_istore", "_ilen", "is_indexer_initialized", "indexer_position_ids", "indexer_dtype",
                  "indexer_device"):
            if k in extra.__dict__:
                new.__dict__[k] = extra.__dict__[k]
        new.__class__ = CxlIndexedLayer
        return new


class _LinearState:
    """The fixed-size conv/recurrent state half of a hybrid layer: transformers'
    own ``LinearAttentionLayer`` code and tensors (torch's memory, not tiered)."""

    def _copy_linear_state(self, src, memo) -> None:
        for k in LINEAR_STATE_ATTRS:
            if k in src.__dict__:
                self.__dict__[k] = copy.deepcopy(src.__dict__[k], memo)


class _HybridCalls:
    """What both hybrid layers do with a Cache call: the linear-attention
    (conv/recurrent state) half is transformers' own code, the attention half
    (``_attn``: :class:`CxlKVLayer` or :class:`CxlSlidingLayer`) cxlalloc's;
    each call goes to both, state first, as the stock classes do."""

    _attn: type

    def lazy_initialization(self, *args, **kwargs) -> None:
        # As the stock classes: two positional args from update() (attention), keywords from the state updates.
        if len(args) == 2 and not kwargs:
            self._attn.lazy_initialization(self, *args)
        if not args and len(kwargs) in (1, 2, 3):
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        self._attn.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        self._attn.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        self._attn.crop(self, tokens_to_remove)


class CxlHybridLayer(_HybridCalls, LinearAttentionLayer, CxlKVLayer, _LinearState):
    """``LinearAttentionAndFullAttentionLayer`` (Falcon-H1-, Zamba-style layers
    holding attention K/V and an SSM/conv state): the attention half's K/V in
    the shared full-attention store; the conv/recurrent state (fixed size, no
    token axis) is transformers' own code and memory, reported by
    :mod:`cxlalloc.hf.coverage` as untiered fixed-size state."""

    is_compileable = False  # as the stock class: the attention half grows

    _attn = CxlKVLayer

    def __init__(self, pool: KVPool, share_slot: Optional[int] = None, number_of_states: int = 1):
        CxlKVLayer.__init__(self, pool, share_slot)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def _reorder_extra(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)

    # batch_repeat_interleave / batch_select_indices: the stock class inherits
    # DynamicLayer's (K/V only), so do these (CxlKVLayer's; _batch_extra a no-op).

    def _empty_like(self, pool: KVPool, memo) -> "CxlHybridLayer":
        new = CxlHybridLayer(pool, self._share_slot, self.number_of_states)
        new._copy_linear_state(self, memo)
        return new

    def __deepcopy__(self, memo):
        new = CxlKVLayer.__deepcopy__(self, memo)
        new.__class__ = CxlHybridLayer
        _LinearState._copy_linear_state(new, self, memo)
        return new


class CxlHybridSlidingLayer(_HybridCalls, LinearAttentionLayer, CxlSlidingLayer, _LinearState):
    """``LinearAttentionAndSlidingWindowAttentionLayer``: the sliding-window K/V in
    a bounded extent (:class:`~cxlalloc.hf.sliding.CxlSlidingLayer`), the
    conv/recurrent state transformers' own (fixed size, reported untiered)."""

    is_compileable = False

    _attn = CxlSlidingLayer

    def __init__(self, pool: KVPool, sliding_window: int, number_of_states: int = 1):
        CxlSlidingLayer.__init__(self, pool, sliding_window)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)


def _states(layer) -> int:
    return int(getattr(layer, "number_of_states", 1))


def _sliding(layer, pool, slot):
    return CxlSlidingLayer(pool, layer.sliding_window) if int(layer.sliding_window) >= 2 else None


def _hybrid_sliding(layer, pool, slot):
    return (CxlHybridSlidingLayer(pool, layer.sliding_window, _states(layer))
            if int(layer.sliding_window) >= 2 else None)


TIERED_LAYERS.update({
    DynamicIndexedLayer: (True, lambda layer, pool, slot: CxlIndexedLayer(pool, slot)),
    LinearAttentionAndFullAttentionLayer: (True, lambda layer, pool, slot: CxlHybridLayer(pool, slot, _states(layer))),
    DynamicSlidingWindowLayer: (False, _sliding),
    LinearAttentionAndSlidingWindowAttentionLayer: (False, _hybrid_sliding),
})

# Tiered class -> the stock kind it stands for (the names hf.stats() reports).
STOCK_KIND = {
    CxlKVLayer: DynamicLayer.__name__,
    CxlIndexedLayer: DynamicIndexedLayer.__name__,
    CxlHybridLayer: LinearAttentionAndFullAttentionLayer.__name__,
    CxlSlidingLayer: DynamicSlidingWindowLayer.__name__,
    CxlHybridSlidingLayer: LinearAttentionAndSlidingWindowAttentionLayer.__name__,
}
