"""``DynamicIndexedLayer`` (Dynamic Sparse Attention: DeepSeek-V3.2, GLM-MoE-DSA, ...) in cxlalloc.

:class:`CxlIndexedLayer` keeps its K/V in the shared full-attention store (it is a
:class:`~cxlalloc.hf.layers.full.CxlKVLayer`) and its indexer keys in a cxlalloc
extent of its own.  Facts about transformers' layer: docs/sources.md#transformers-layer-kinds.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import DynamicIndexedLayer

from cxlalloc.hf.layers.full import CxlKVLayer
from cxlalloc.hf.pool import KVPool
from cxlalloc.hf.storage import Geometry, KVStorage


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

    shares_full_store = True

    def __init__(self, pool: KVPool, share_slot: Optional[int] = None):
        super().__init__(pool, share_slot)
        self._istore: Optional[KVStorage] = None
        self._ilen = 0
        self.indexer_position_ids: Optional[torch.Tensor] = None
        self.is_indexer_initialized = False

    @classmethod
    def from_stock(cls, stock: DynamicIndexedLayer, pool: KVPool, slot: Optional[int]) -> "CxlIndexedLayer":
        """The tiered counterpart of transformers' ``stock`` layer (see :meth:`CxlKVLayer.from_stock`)."""
        return cls(pool, slot)

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
