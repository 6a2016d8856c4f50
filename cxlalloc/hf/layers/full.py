"""The full-attention layer: transformers' ``DynamicLayer`` with its K/V in cxlalloc.

:class:`CxlKVLayer` keeps its K/V in a slot of a :class:`~cxlalloc.hf.storage.KVStorage`
(the store the :class:`~cxlalloc.hf.pool.KVPool` shares among the cache's
full-attention layers of one shape, or one of its own); the layers of the other
kinds that hold full-attention K/V (:mod:`cxlalloc.hf.layers.indexed`,
:mod:`cxlalloc.hf.layers.hybrid`) subclass it.  Source of the API facts:
transformers ``cache_utils.py`` (``CacheLayerMixin``, ``DynamicLayer``) of 5.17 and 5.24.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from transformers.cache_utils import DynamicLayer

from cxlalloc.hf.compat import POSITIVE_CROP_RAISES
from cxlalloc.hf.indices import batch_rows, crop_amount
from cxlalloc.hf.pool import GRAD_ACROSS_FORWARDS, PICKLE_ERROR, KVPool, _shallow_copy
from cxlalloc.hf.storage import KVStorage


class CxlKVLayer(DynamicLayer):
    """A full-attention cache layer whose K/V live in a cxlalloc :class:`KVStorage`.

    Drop-in for transformers' ``DynamicLayer``: ``update(key_states, value_states)``
    takes ``(B, H_kv, q, D)`` tensors (any strides) of the model's dtype, writes
    them at positions ``[L, L+q)`` in place and returns ``(keys, values)``, each
    ``(B, H_kv, L+q, D)`` strided views of the storage (last-dim stride 1), exactly
    the ``kv_length`` the attention mask was built for.  With grad enabled and
    states that require grad it returns ``torch.cat(cached, new)`` instead (the
    new tokens connected to the caller's graph, as ``DynamicLayer`` does); the
    storage always holds detached copies.

    Raises (from ``update``):
        ValueError: the batch/heads/head-dim differ from the cached ones while the
            layer holds tokens (continuing a batch-B cache with
            ``num_return_sequences``/``num_beams`` needs
            ``cache.batch_repeat_interleave(n)`` first), or the tensors are on
            another device than the allocator's.
        cxlalloc.OutOfMemoryError: neither tier has room for the new tokens.
        RuntimeError: grad is needed through tokens an earlier forward with
            grad cached (:data:`GRAD_ACROSS_FORWARDS`); nothing written.
    """

    is_sliding = False
    is_compileable = False  # shapes change every step; keeps generate() from auto-compiling
    is_croppable = True
    # Never set _layer_type: transformers would register the class globally.

    # Whether CxlCache gives this kind a slot in the pool's shared full-attention store.
    shares_full_store = True
    _store: Optional[KVStorage] = None  # also before __init__ ran (transformers' constructor assigns keys = None)

    def __init__(self, pool: KVPool, share_slot: Optional[int] = None):
        self._pool = pool
        self._share_slot = share_slot
        self._store: Optional[KVStorage] = None
        self._slot = 0
        self._len = 0
        # A forward planned ahead (CxlCache.prepare_forward): the views update()
        # returns, the cached tokens before it as a view (its length), and what
        # to undo if the forward's states differ from the plan.
        self._prepared = False
        self._k = self._v = self._prev_k = None
        self._plan_undo = (0, 0)
        # First cached position written from K/V that required grad (None: none).
        self._grad_from: Optional[int] = None
        super().__init__()

    @classmethod
    def from_stock(cls, stock: DynamicLayer, pool: KVPool, slot: Optional[int]) -> Optional["CxlKVLayer"]:
        """The tiered counterpart of the layer ``stock`` that transformers' ``DynamicCache``
        built from the config (:class:`~cxlalloc.hf.CxlCache` calls this for every
        kind in :data:`cxlalloc.hf.layers.LAYER_CLASSES`), or None to leave ``stock``
        to transformers.

        Args:
            stock: the stock layer (its attributes: window, number of states).
            pool: the cache's :class:`~cxlalloc.hf.pool.KVPool`.
            slot: this layer's slot in the shared full-attention store (None: a store
                of its own); only for kinds whose ``shares_full_store`` is True.
        """
        return cls(pool, slot)

    # ------------------------------------------------------------ live views
    @property
    def storage(self) -> Optional[KVStorage]:
        """The :class:`~cxlalloc.hf.storage.KVStorage` holding this layer's K/V (None before the first token)."""
        return self._store

    @property
    def slot(self) -> int:
        """This layer's slot in :attr:`storage`."""
        return self._slot

    @property
    def held_tokens(self) -> int:
        """Tokens whose K/V this layer holds (its length, initialized or not)."""
        return self._len

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """``(B, H_kv, L, Dk)`` view of the cached keys (None before the first update)."""
        if self._store is None or not self.is_initialized:
            return None
        self._store.apply_pending()
        return self._store.key_view(self._slot, 0, self.get_seq_length())

    @keys.setter
    def keys(self, value) -> None:
        self._assign(value)

    @property
    def values(self) -> Optional[torch.Tensor]:
        """``(B, H_kv, L, Dv)`` view of the cached values (None before the first update)."""
        if self._store is None or not self.is_initialized:
            return None
        self._store.apply_pending()
        return self._store.value_view(self._slot, 0, self.get_seq_length())

    @values.setter
    def values(self, value) -> None:
        self._assign(value)

    def _assign(self, value) -> None:
        if value is None:  # transformers' constructors and resets assign None
            if self._store is not None:
                self._len = 0
            return
        raise AttributeError("cxlalloc.hf: CxlKVLayer.keys/values are views of cxlalloc storage; "
                             "write through update() (or use a DynamicCache for hand-built tensors)")

    # ------------------------------------------------------------ HF layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def plan(self, tokens: int) -> None:
        """Make the views this layer's next update() of ``tokens`` new tokens
        returns (storage bound and committed: :meth:`CxlCache.prepare_forward`),
        and count that update's bytes."""
        store, g = self._store, self._store.g
        start, need = self._len, self._len + int(tokens)
        nbytes = int(tokens) * g.slot_elems * g.elem
        self._prev_k = store.key_view(self._slot, 0, start)
        self._k = store.key_view(self._slot, 0, need)
        self._v = store.value_view(self._slot, 0, need)
        self._plan_undo = (start, nbytes)
        self._len = need
        store.live_tokens = max(store.live_tokens, need)
        counters = self._pool.counters
        counters.add_new(nbytes)
        ctx = counters.step_context_tokens
        if ctx and need > ctx[-1]:
            ctx[-1] = need
        self._prepared = True

    def _unplan(self) -> None:
        start, nbytes = self._plan_undo
        self._len = start
        self._pool.counters.add_new(-nbytes)
        self._prepared = False
        self._k = self._v = self._prev_k = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._prepared:
            # Planned before the forward: copy the new tokens into place and
            # return the views.  Only tensor operations and shapes here, so that
            # torch.compile traces it without a graph break and sees the cache
            # length as a tensor size (dynamic after one change), as it does
            # transformers' DynamicCache; no engine call.
            k, v, q = self._k, self._v, key_states.shape[-2]
            start = self._prev_k.shape[-2]
            if (key_states.shape[:2] == k.shape[:2] and value_states.shape[:2] == v.shape[:2]
                    and key_states.shape[-1] == k.shape[-1] and value_states.shape[-1] == v.shape[-1]
                    and start + q == k.shape[-2] and key_states.dtype == k.dtype
                    and not (torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad))):
                self._prepared = False
                self._k = self._v = self._prev_k = None
                k.narrow(2, start, q).copy_(key_states.detach())
                v.narrow(2, start, q).copy_(value_states.detach())
                return k, v
            self._unplan()  # not the states planned for (a model whose K/V differ from its config): as below
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._len == 0:
            self._store, self._slot = self._pool.bind(self, key_states, value_states)
        store = self._store
        g = store.g
        b, h, q, dk = key_states.shape
        if (b, h, dk, value_states.shape[-1]) != (g.batch, g.heads, g.k_dim, g.v_dim) or key_states.dtype != g.dtype:
            raise ValueError(
                f"cxlalloc.hf: new key states (B={b}, H={h}, D={dk}, {key_states.dtype}) do not match the {self._len} "
                f"cached tokens (B={g.batch}, H={g.heads}, D={g.k_dim}, {g.dtype}); to continue with "
                f"num_return_sequences/num_beams=n call cache.batch_repeat_interleave(n) first")
        store.apply_pending()
        need = self._len + q
        if need > store.capacity_tokens:
            pool = self._pool
            store.regrow(pool.clamp(pool.capacity_for(need, store.capacity_tokens), need, store.row_bytes))
        grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
        if grad and self._grad_from is not None and self._grad_from < self._len:
            raise RuntimeError(GRAD_ACROSS_FORWARDS)
        store.ensure(need)
        start = self._len
        # Stored detached: the storage is no autograd leaf written in place
        # (the next step's write would invalidate this step's graph).
        store.write(self._slot, start, key_states.detach(), value_states.detach())
        self._len = need
        ctx = self._pool.counters.step_context_tokens
        if ctx and need > ctx[-1]:
            ctx[-1] = need
        if grad:
            # What DynamicLayer's torch.cat returns: the cached tokens (no grad)
            # followed by this forward's states, connected to its graph.
            if self._grad_from is None:
                self._grad_from = start
            return (torch.cat([store.key_view(self._slot, 0, start), key_states], dim=-2),
                    torch.cat([store.value_view(self._slot, 0, start), value_states], dim=-2))
        return store.key_view(self._slot, 0, need), store.value_view(self._slot, 0, need)

    def get_seq_length(self) -> int:
        if self._prepared:  # during a planned forward, before this layer's update: a tensor size
            return self._prev_k.shape[-2]
        return self._len if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise what :meth:`crop` would raise, changing nothing.

        Raises:
            ValueError: ``tokens_to_remove > 0`` where the installed
                transformers' ``DynamicLayer.crop`` refuses it (5.24), with its
                message.
            TypeError: not an int.
        """
        n = crop_amount(tokens_to_remove)
        if n > 0 and POSITIVE_CROP_RAISES:
            raise ValueError(
                f"Calling `crop` with a positive value (`{n}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead.")

    def crop(self, tokens_to_remove: int) -> None:
        """The installed transformers' ``DynamicLayer.crop`` rules: ``crop(-n)``
        drops the last ``n`` tokens (all of them if ``n`` is at least the
        length), ``crop(0)`` and an empty layer change nothing; ``crop(n > 0)``
        raises ``ValueError`` on 5.24 and keeps the first ``n`` on 5.17.
        Memory is released by :meth:`CxlCache.crop` (or at the next step while
        a view of the dropped tokens is alive)."""
        self.check_crop(tokens_to_remove)
        n = crop_amount(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return
        if self._prepared:
            self._unplan()
        if n > 0:
            self._len = min(self._len, n)
        else:
            self._len = max(0, self._len + n)
        if self._grad_from is not None and self._grad_from >= self._len:
            self._grad_from = None

    def reset(self) -> None:
        if self._prepared:
            self._unplan()
        self._len = 0
        self._grad_from = None
        self.is_initialized = False

    def offload(self) -> None:  # tiering is cxlalloc's job: nothing to move by hand
        pass

    def prefetch(self) -> None:
        pass

    # Direct per-layer calls (CxlCache does these for all layers at once).
    def _rows(self, indices, what: str, allow_mask: bool = True) -> torch.Tensor:
        return batch_rows(indices, self._store.g.batch, self._store.g.device, what, allow_mask)

    def reorder_cache(self, beam_idx) -> None:
        """``new[b] = old[beam_idx[b]]`` for this layer's cached tokens, in place
        (``beam_idx``: as :func:`batch_rows`, integers; one of another length
        than the batch selects rows as :meth:`batch_select_indices` does)."""
        if self._len == 0:
            return
        store = self._store
        store.apply_pending()
        idx = self._rows(beam_idx, "beam_idx", allow_mask=False)
        if idx.numel() != store.g.batch:
            self._detach(idx.numel(), lambda t: t.index_select(0, idx))
            return
        for view in (store.key_view(self._slot, 0, self._len), store.value_view(self._slot, 0, self._len)):
            view.copy_(view.index_select(0, idx))
        store.counters.add_existing(self._len * store.g.slot_elems * store.g.elem)

    def _detach(self, batch: int, transform) -> None:
        self._store = self._store.rebuilt(batch, transform, slots=[self._slot])
        self._store.live_tokens = self._len
        self._slot = 0
        self._pool.stores.add(self._store)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._len:
            self._detach(self._store.g.batch * repeats, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        """Keep batch rows ``indices`` (as :func:`batch_rows`: tensor, list,
        tuple, numpy array or bool mask)."""
        if self._len:
            idx = self._rows(indices, "indices")
            self._detach(idx.numel(), lambda t: t.index_select(0, idx))

    # Whole-cache operations (CxlCache) move the K/V of all CxlKVLayers at once
    # through their stores; these hooks let a subclass carry what else it holds
    # (indexer keys, SSM state) through the same operation.
    def _reorder_extra(self, beam_idx: torch.LongTensor) -> None:
        """What else this layer holds, reordered for beam search (CxlCache.reorder_cache)."""

    def _batch_extra(self, op: str, arg) -> None:
        """What else this layer holds through ``batch_repeat_interleave`` / ``batch_select_indices`` (``op``)."""

    def _empty_like(self, pool: "KVPool", memo) -> "CxlKVLayer":
        """An empty layer of this kind for a deep copy of the cache (its K/V are set by the caller)."""
        return CxlKVLayer(pool, self._share_slot)

    def _extra_stores(self) -> list:
        """KV storage this layer holds besides its K/V slot (counted in kv_stats)."""
        return []

    def __reduce_ex__(self, protocol):
        raise TypeError(PICKLE_ERROR.format(what="CxlKVLayer"))

    def __copy__(self):
        return _shallow_copy(self)

    def __deepcopy__(self, memo):
        new = CxlKVLayer(self._pool, None)
        new.is_initialized = self.is_initialized
        if self.is_initialized:
            new.device, new.dtype = self.device, self.dtype
        if self._len:
            src = self._store
            src.apply_pending()
            new._store = KVStorage(src.allocator, src.g, 1, src.capacity_tokens, self._pool.counters)
            self._pool.stores.add(new._store)
            new._store.ensure(self._len)
            new._store.key_view(0, 0, self._len).copy_(src.key_view(self._slot, 0, self._len))
            new._store.value_view(0, 0, self._len).copy_(src.value_view(self._slot, 0, self._len))
            new._store.live_tokens = new._len = self._len
            self._pool.counters.add_existing(self._len * src.g.slot_elems * src.g.elem)
        return new
