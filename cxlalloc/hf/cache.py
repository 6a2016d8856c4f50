"""A transformers KV cache whose full-attention K/V live in cxlalloc extents.

:class:`CxlCache` is a ``transformers.DynamicCache``: it builds the model's usual
layer list from the config and replaces every plain ``DynamicLayer`` (full
attention) with a :class:`CxlKVLayer`, and each other stock layer kind listed in
:data:`TIERED_LAYERS` with its tiered counterpart (sliding-window, indexed and
attention+SSM layers: :mod:`cxlalloc.hf.layers`, :mod:`cxlalloc.hf.sliding`).
Linear-attention (SSM) and dummy layers, and a model's own layer classes, stay
transformers' own (:mod:`cxlalloc.hf.coverage` reports them).  transformers'
generation code is untouched: greedy,
sampling, beam search (``reorder_cache``), ``num_return_sequences``, padded batches,
assisted decoding (``crop``), continuing from a returned cache and prompt-cache
reuse (``copy.deepcopy``) all work as with ``DynamicCache``.

Storage (:mod:`cxlalloc.hf.storage`): the K/V of all full-attention layers of a
cache live token-major in one cxlalloc extent of class ``kv``; each layer's K/V are
``(B, H_kv, L, D)`` strided views at the live length ``L`` (never the capacity,
which attention would read as garbage tokens).  ``update()`` writes only the new
tokens in place; the capacity is reserved up front from generate()'s
``max_length - 1`` when known (:func:`cxlalloc.hf.wrap` passes it), so the cache is
never copied during generation; otherwise it grows geometrically (x2, rounded to
256 tokens) with one copy of the live rows per regrowth (amortised O(1) per
token, counted in ``regrowths``/``bytes_copied_existing``).

Supported transformers: 5.17-5.24 (the kwarg is ``past_key_values=`` on 5.17,
``cache=`` on later versions: use :func:`cxlalloc.hf.cache_kwarg`).
Source of the API facts: transformers ``cache_utils.py`` (``CacheLayerMixin``,
``DynamicLayer``, ``Cache``, ``DynamicCache``) of 5.17 and 5.24.
"""

from __future__ import annotations

import copy
import weakref
from typing import List, Optional, Tuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from cxlalloc import _C
from cxlalloc.allocator import Allocator
from cxlalloc.hf.storage import Geometry, KVCounters, KVStorage, grown_capacity


PICKLE_ERROR = ("cxlalloc.hf: a {what} cannot be pickled or torch.save'd: its K/V live in cxlalloc memory of "
                "this process; copy.deepcopy(cache) copies it here, and to save the K/V pickle "
                "[(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]")


# Stock transformers layer class -> (shares the full-attention store, factory(stock_layer, pool, slot)).
# The factory returns the tiered layer, or None to leave that layer to transformers.  Filled here for
# DynamicLayer and by cxlalloc.hf.layers for the other kinds (docs/huggingface.md#what-runs-where).
TIERED_LAYERS: dict = {}


def _shallow_copy(obj):
    """``copy.copy``: what the default reduction did (shares layers/storage)."""
    new = obj.__class__.__new__(obj.__class__)
    new.__dict__.update(obj.__dict__)
    return new


def default_allocator(device: int = 0):
    """The process-wide engine's allocator for ``device`` (``cxlalloc.enable()``).

    Raises:
        ValueError: there is no process-wide engine (create a
            ``cxlalloc.Allocator(...)`` and pass it as ``allocator=``).
    """
    engine = _C.current_engine()
    if engine is None or not engine.has_config(device):
        raise ValueError("cxlalloc.hf: no allocator given and no process-wide cxlalloc engine (cxlalloc.enable()); "
                         "pass allocator=cxlalloc.Allocator(...) (simulate=True without a GPU)")
    return Allocator.from_engine(engine, device)


def _allocator_device(allocator) -> torch.device:
    return torch.device("cpu") if allocator.simulated else torch.device("cuda", allocator.device)


class KVPool:
    """The storage manager of one cache: its allocator, counters, capacity hint
    and the store shared by its full-attention layers.  Holds no reference to
    the layers (so a dropped cache frees its memory by refcount, at once)."""

    def __init__(self, allocator, n_shared: int, max_cache_len: Optional[int], growth: float, round_tokens: int):
        self.allocator = allocator
        self.device = _allocator_device(allocator)
        self.n_shared = int(n_shared)
        self.hint = int(max_cache_len) if max_cache_len else None
        self.growth = float(growth)
        self.round_tokens = int(round_tokens)
        self.counters = KVCounters()
        self.shared: Optional[KVStorage] = None
        self.stores: "weakref.WeakSet[KVStorage]" = weakref.WeakSet()
        st = allocator.stats()
        self._demoted_at_start = (int(st["demoted_bytes"]), int(st["demotions"]))

    def capacity_for(self, need: int, current: int = 0) -> int:
        if self.hint is not None and need <= self.hint and current == 0:
            return self.hint
        if current == 0:
            return grown_capacity(need, 0, self.growth, self.round_tokens)
        return grown_capacity(need, current, self.growth, self.round_tokens)

    def new_store(self, g: Geometry, n_slots: int, need: int) -> KVStorage:
        if g.device != self.device:
            raise ValueError(
                f"cxlalloc.hf: this cache's allocator serves {self.device} but the model's key/value states are on "
                f"{g.device}; wrap the model on the device it runs on (one device per wrapped model), or pass "
                f"simulate=True for a CPU model")
        s = KVStorage(self.allocator, g, n_slots,
                      self.clamp(self.capacity_for(need), need, n_slots * g.slot_elems * g.elem), self.counters)
        self.stores.add(s)
        return s

    def clamp(self, tokens: int, need: int, row_bytes: int) -> int:
        """At most what both tiers together could ever hold (a generation config's
        max_length can be far beyond the memory; the reservation is address space
        only, but the engine refuses an extent larger than both tiers), at least
        ``need``."""
        st = self.allocator.stats()
        most = (int(st["device"]["limit_bytes"]) + int(st["host"]["limit_bytes"])) // max(1, row_bytes)
        return max(int(need), min(int(tokens), most))

    def bind(self, layer: "CxlKVLayer", key_states: torch.Tensor, value_states: torch.Tensor) -> Tuple[KVStorage, int]:
        """The (store, slot) an empty layer writes to, creating storage as needed."""
        return self.bind_geometry(layer, Geometry.of(key_states, value_states), key_states.shape[-2])

    def bind_geometry(self, layer: "CxlKVLayer", g: Geometry, need: int) -> Tuple[KVStorage, int]:
        """:meth:`bind` for a layer of geometry ``g`` about to hold ``need`` tokens."""
        if layer._share_slot is not None and self.n_shared > 0:
            s = self.shared
            if s is not None and s.g == g:
                return s, layer._share_slot
            if s is None or s.live_tokens == 0:
                # First use, or reuse after reset() with another batch size.
                self.shared = self.new_store(g, self.n_shared, need)
                return self.shared, layer._share_slot
        # A layer whose shape differs from the shared store's, or a cache built
        # without a config: storage of its own.
        own = layer._store
        if own is not None and own is not self.shared and own.g == g and own.n_slots == 1:
            own.live_tokens = 0
            return own, 0
        return self.new_store(g, 1, need), 0

    def reserve(self, tokens: int) -> None:
        """Make every store hold ``tokens`` tokens without a later regrowth
        (one copy of the live rows for a store that is too small now)."""
        self.hint = max(self.hint or 0, int(tokens))
        for s in list(self.stores):
            if s.capacity_tokens < tokens:
                s.regrow(self.clamp(tokens, s.live_tokens, s.row_bytes))

    def update_demotions(self) -> None:
        st = self.allocator.stats()
        self.counters.demoted_bytes = int(st["demoted_bytes"]) - self._demoted_at_start[0]
        self.counters.demotions = int(st["demotions"]) - self._demoted_at_start[1]


class CxlKVLayer(DynamicLayer):
    """A full-attention cache layer whose K/V live in a cxlalloc :class:`KVStorage`.

    Drop-in for transformers' ``DynamicLayer``: ``update(key_states, value_states)``
    takes ``(B, H_kv, q, D)`` tensors (any strides) of the model's dtype, writes
    them at positions ``[L, L+q)`` in place and returns ``(keys, values)``, each
    ``(B, H_kv, L+q, D)`` strided views of the storage (last-dim stride 1), exactly
    the ``kv_length`` the attention mask was built for.

    Raises (from ``update``):
        ValueError: the batch/heads/head-dim differ from the cached ones while the
            layer holds tokens (continuing a batch-B cache with
            ``num_return_sequences``/``num_beams`` needs
            ``cache.batch_repeat_interleave(n)`` first), or the tensors are on
            another device than the allocator's.
        cxlalloc.OutOfMemoryError: neither tier has room for the new tokens.
    """

    is_sliding = False
    is_compileable = False  # shapes change every step; keeps generate() from auto-compiling
    is_croppable = True
    # Never set _layer_type: transformers would register the class globally.

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
        super().__init__()

    # ------------------------------------------------------------ live views
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
            if getattr(self, "_store", None) is not None:
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
                    and start + q == k.shape[-2] and key_states.dtype == k.dtype):
                self._prepared = False
                self._k = self._v = self._prev_k = None
                k.narrow(2, start, q).copy_(key_states)
                v.narrow(2, start, q).copy_(value_states)
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
        store.ensure(need)
        store.write(self._slot, self._len, key_states, value_states)
        self._len = need
        ctx = self._pool.counters.step_context_tokens
        if ctx and need > ctx[-1]:
            ctx[-1] = need
        return store.key_view(self._slot, 0, need), store.value_view(self._slot, 0, need)

    def get_seq_length(self) -> int:
        if self._prepared:  # during a planned forward, before this layer's update: a tensor size
            return self._prev_k.shape[-2]
        return self._len if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` drops the last ``n`` tokens; ``crop(n)`` with ``n > 0``
        keeps the first ``n`` (transformers 5.17's meaning; 5.24 raises for it in
        its own layers).  Memory is released by :meth:`CxlCache.crop`."""
        if not self.is_initialized or tokens_to_remove == 0:
            return
        if tokens_to_remove > 0:
            self._len = min(self._len, int(tokens_to_remove))
        else:
            self._len = max(0, self._len + int(tokens_to_remove))

    def reset(self) -> None:
        if self._prepared:
            self._unplan()
        self._len = 0
        self.is_initialized = False

    def offload(self) -> None:  # tiering is cxlalloc's job: nothing to move by hand
        pass

    def prefetch(self) -> None:
        pass

    # Direct per-layer calls (CxlCache does these for all layers at once).
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._len == 0:
            return
        store = self._store
        store.apply_pending()
        idx = beam_idx.to(store.g.device)
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

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._len:
            n = torch.arange(self._store.g.batch)[torch.as_tensor(indices).cpu()].numel()
            self._detach(n, lambda t: t[indices])

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


TIERED_LAYERS[DynamicLayer] = (True, lambda layer, pool, slot: CxlKVLayer(pool, slot))


class CxlCache(DynamicCache):
    """``transformers.DynamicCache`` with its full-attention layers in cxlalloc.

    Args:
        config: the model config (``model.config``); layer types come from it.
            Without one, layers are created lazily, each with its own storage.
        allocator: the :class:`cxlalloc.Allocator` of the model's device (the
            simulated one for a CPU model).  Default: the process-wide engine
            (``cxlalloc.enable()``) for ``cuda:0``.
        max_cache_len: tokens to reserve (generate() passes ``max_length - 1``);
            None: grow geometrically.
        growth: capacity factor of a regrowth (> 1).
        round_tokens: regrown capacities are multiples of this many tokens.
        share_storage: one extent for all full-attention layers of the same
            shape (default); False gives each layer its own extent.

    Counters: :meth:`kv_stats`.  Use :func:`cxlalloc.hf.cache_kwarg` for the
    generate()/forward() keyword (``cache`` or ``past_key_values``).

    ``copy.deepcopy(cache)`` copies the live tokens into new storage of the
    same allocator; pickling (``pickle``, ``torch.save``) raises ``TypeError``.

    Raises:
        ValueError: no allocator given and no process-wide engine.
    """

    def __init__(self, config=None, *, allocator=None, max_cache_len: Optional[int] = None, growth: float = 2.0,
                 round_tokens: int = 256, share_storage: bool = True):
        if allocator is None:
            allocator = default_allocator()
        if not growth > 1.0:
            raise ValueError(f"cxlalloc.hf: growth must be > 1, got {growth}")
        super().__init__(config=config)  # never offloading=True: placement is cxlalloc's business
        if self.layer_class_to_replicate is not None:  # no config: layers appended by Cache.update
            self._pool = KVPool(allocator, 0, max_cache_len, growth, round_tokens)
            pool = self._pool
            self.layer_class_to_replicate = lambda: CxlKVLayer(pool, None)
        else:
            # Each stock layer kind with a tiered counterpart (TIERED_LAYERS) is
            # replaced; layers of a kind that shares the full-attention store get a slot.
            kinds = [TIERED_LAYERS.get(type(layer)) for layer in self.layers]
            shared = [i for i, k in enumerate(kinds) if k is not None and k[0]]
            self._pool = KVPool(allocator, len(shared) if share_storage else 0, max_cache_len, growth, round_tokens)
            slots = {i: slot for slot, i in enumerate(shared)}
            for i, kind in enumerate(kinds):
                if kind is not None:
                    made = kind[1](self.layers[i], self._pool, slots[i] if share_storage and i in slots else None)
                    if made is not None:  # None: this instance cannot be tiered (stays transformers', reported)
                        self.layers[i] = made
        self._last_layer_idx: Optional[int] = None

    # ------------------------------------------------------------ steps
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if getattr(layer, "_prepared", False):  # the step began in prepare_forward
            self._last_layer_idx = layer_idx
            return layer.update(key_states, value_states, *args, **kwargs)
        # A forward pass visits the layers in increasing order: an index that does
        # not increase starts the next forward (prefill, then one per decode step).
        if self._last_layer_idx is None or layer_idx <= self._last_layer_idx:
            self._begin_step()
        self._last_layer_idx = layer_idx
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.compiler.disable
    def prepare_forward(self, tokens: int, batch: int, guess: Optional[Geometry] = None) -> bool:
        """Do the allocator work of the next forward pass before it runs
        (:func:`cxlalloc.hf.wrap` calls this from a forward pre-hook, outside a
        ``torch.compile``'d ``model.forward``): begin the step, bind and commit
        storage for ``tokens`` more tokens (per sequence, ``batch`` sequences) in
        every full-attention layer, and make the views their update() returns.
        The forward then only copies the new K/V into place: torch.compile traces
        it without a graph break, with the cache length as a tensor size.

        ``guess``: the geometry of the model's K/V states (from its config; the
        batch is replaced), for layers with no storage yet (the prefill).  A layer
        whose states turn out to differ is handled by update() as without a plan.

        Returns False, doing nothing, when it cannot plan (no layers built from a
        config, an empty layer and no ``guess``, or a batch that differs from the
        cached one: update() then says what to do).
        """
        layers = self._cxl_layers()
        if not layers or tokens < 1:
            return False
        for layer in layers:
            if layer._len == 0 and guess is None:
                return False
            if layer._len and layer._store.g.batch != batch:
                return False
        self._begin_step()
        # -1, not None: the step has begun, so the first layer's update (an unplanned
        # sliding-window layer, say) must not begin another.
        self._last_layer_idx = -1
        pool = self._pool
        for layer in layers:  # storage for every layer first: a regrowth replaces a store's views
            if layer._prepared:
                layer._unplan()
            if layer._len == 0:
                g = Geometry(int(batch), guess.heads, guess.k_dim, guess.v_dim, guess.dtype, guess.device)
                if not layer.is_initialized:
                    layer.device, layer.dtype, layer.is_initialized = g.device, g.dtype, True
                layer._store, layer._slot = pool.bind_geometry(layer, g, int(tokens))
        for store in {id(layer._store): layer._store for layer in layers}.values():
            need = max(layer._len for layer in layers if layer._store is store) + int(tokens)
            store.apply_pending()
            if need > store.capacity_tokens:
                store.regrow(pool.clamp(pool.capacity_for(need, store.capacity_tokens), need, store.row_bytes))
            store.ensure(need)
        for layer in layers:
            layer.plan(tokens)
        return True

    def _begin_step(self) -> None:
        pool = self._pool
        c = pool.counters
        c.steps += 1
        c.step_bytes_copied.append(0)
        c.step_context_tokens.append(0)
        for s in list(pool.stores):
            s.apply_pending()
        # KV read by this step is its working set: a transient allocated during
        # the step (case C04: a full-logits copy) never demotes it.
        pool.allocator.mark_step()
        for s in list(pool.stores):
            s.touch()

    # ------------------------------------------------------------ whole-cache ops
    def _cxl_layers(self):
        return [layer for layer in self.layers if isinstance(layer, CxlKVLayer)]

    def _stores(self):
        out = []
        for layer in self._cxl_layers():
            if layer._store is not None and all(layer._store is not s for s in out):
                out.append(layer._store)
        return out

    def _refresh_live(self, trim: bool) -> None:
        for s in self._stores():
            s.live_tokens = max((layer._len for layer in self._cxl_layers() if layer._store is s), default=0)
            if trim:
                s.trim(s.live_tokens)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: ``new[b] = old[beam_idx[b]]`` for every layer.  Full-attention
        layers record it and apply it at the next forward (only rows that move
        are copied; the reorder after generate()'s last step is never applied)."""
        for s in self._stores():
            s.reorder(beam_idx)
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                layer._reorder_extra(beam_idx)
            else:
                layer.reorder_cache(beam_idx)

    def _rebuild(self, batch_of, transform, stock_op, op: str = "", arg=None) -> None:
        for s in self._stores():
            if s.live_tokens == 0:
                continue
            new = s.rebuilt(batch_of(s.g.batch), transform)
            self._pool.stores.add(new)
            if self._pool.shared is s:
                self._pool.shared = new
            for layer in self._cxl_layers():
                if layer._store is s:
                    layer._store = new
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                layer._batch_extra(op, arg)
            else:
                stock_op(layer)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every cached sequence ``repeats`` times on the batch dim (to
        continue a batch-B cache with ``num_return_sequences``/``num_beams``)."""
        self._rebuild(lambda b: b * repeats, lambda t: t.repeat_interleave(repeats, dim=0),
                      lambda layer: layer.batch_repeat_interleave(repeats), "batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (long or bool)."""
        def count(b):
            return torch.arange(b)[torch.as_tensor(indices).cpu()].numel()

        self._rebuild(count, lambda t: t[indices], lambda layer: layer.batch_select_indices(indices),
                      "batch_select_indices", indices)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)``: drop the last ``n`` tokens; ``crop(n > 0)``: keep the first
        ``n`` in the full-attention layers (5.17 meaning; transformers' own
        sliding layers follow their version's rule).  Chunks wholly beyond the
        kept tokens are released."""
        super().crop(tokens_to_remove)
        self._refresh_live(trim=True)

    def reset(self) -> None:
        """Empty the cache for reuse (storage address space kept, chunks released).

        Also clears transformers' own dynamic/sliding layers the 5.24 way (5.17's
        ``DynamicLayer.reset`` only zeroes and keeps a stale length)."""
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                layer.reset()
            elif type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
                layer.keys = layer.values = None
                layer.is_initialized = False
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = 0
            else:
                layer.reset()
        for s in self._stores():
            s._pending = None
        self._refresh_live(trim=True)
        self._last_layer_idx = None

    def reserve(self, tokens: int) -> None:
        """Reserve capacity for ``tokens`` tokens (generate() calls it through the
        wrapper with ``max_length - 1`` when this cache is passed in)."""
        self._pool.reserve(tokens)

    def open_prefix(self, geometries, batch: int, tokens: int) -> List[Tuple[KVStorage, int]]:
        """Make this empty cache hold ``tokens`` tokens in every full-attention
        layer, with storage committed but **not written**: the caller writes
        the K/V (a prefix hit loaded by :mod:`cxlalloc.hf.reuse`).

        Args:
            geometries: ``(heads, k_dim, v_dim, dtype)`` per :class:`CxlKVLayer`,
                in layer order.
            batch: rows of the cache.
            tokens: tokens to hold (>= 1).

        Returns:
            ``(storage, slot)`` per CxlKVLayer, in layer order.

        Raises:
            ValueError: the cache is not empty, or ``geometries`` does not have
                one entry per CxlKVLayer.
            cxlalloc.OutOfMemoryError: neither tier has room for the tokens.
        """
        layers = self._cxl_layers()
        if len(geometries) != len(layers):
            raise ValueError(f"cxlalloc.hf: {len(geometries)} layer geometries for {len(layers)} cache layers")
        if any(layer._len or layer.is_initialized for layer in layers):
            raise ValueError("cxlalloc.hf: open_prefix() needs an empty cache")
        out = []
        for layer, (heads, k_dim, v_dim, dtype) in zip(layers, geometries):
            g = Geometry(int(batch), int(heads), int(k_dim), int(v_dim), dtype, self._pool.device)
            store, slot = self._pool.bind_geometry(layer, g, int(tokens))
            store.ensure(int(tokens))
            layer.device, layer.dtype, layer.is_initialized = g.device, dtype, True
            layer._store, layer._slot, layer._len = store, slot, int(tokens)
            store.live_tokens = max(store.live_tokens, int(tokens))
            out.append((store, slot))
        return out

    def release(self) -> None:
        """Free all storage now (the cache is empty afterwards)."""
        self.reset()
        for layer in self._cxl_layers():
            layer._store = None
        self._pool.shared = None

    def __reduce_ex__(self, protocol):
        """Pickling (``pickle``, ``torch.save``) raises ``TypeError``: the
        storage belongs to this process's allocator.  Use ``copy.deepcopy``."""
        raise TypeError(PICKLE_ERROR.format(what="CxlCache"))

    def __copy__(self):
        return _shallow_copy(self)

    def __deepcopy__(self, memo):
        """A copy whose storage comes from the same allocator; only live tokens
        are copied (prompt-cache reuse: ``copy.deepcopy(prompt_cache)``)."""
        cls = self.__class__
        new = cls.__new__(cls)
        memo[id(self)] = new
        skip = ("layers", "_pool", "layer_class_to_replicate")
        for k, v in self.__dict__.items():
            if k not in skip:
                setattr(new, k, copy.deepcopy(v, memo))
        old = self._pool
        pool = KVPool(old.allocator, old.n_shared, old.hint, old.growth, old.round_tokens)
        new._pool = pool
        memo[id(old)] = pool  # layers of other kinds (cxlalloc.hf.sliding) find the copy's pool here
        stores = {}
        for s in self._stores():
            c = s.clone(pool.counters)
            pool.stores.add(c)
            stores[id(s)] = c
            if old.shared is s:
                pool.shared = c
        layers = []
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                nl = layer._empty_like(pool, memo)
                nl.is_initialized = layer.is_initialized
                if layer.is_initialized:
                    nl.device, nl.dtype = layer.device, layer.dtype
                if layer._store is not None:
                    nl._store, nl._slot, nl._len = stores[id(layer._store)], layer._slot, layer._len
                layers.append(nl)
            else:
                layers.append(copy.deepcopy(layer, memo))
        new.layers = layers
        new.layer_class_to_replicate = (lambda: CxlKVLayer(pool, None)) if self.layer_class_to_replicate else None
        return new

    # ------------------------------------------------------------ counters
    @property
    def allocator(self):
        """The :class:`cxlalloc.Allocator` this cache's storage comes from."""
        return self._pool.allocator

    @property
    def counters(self) -> KVCounters:
        return self._pool.counters

    def kv_stats(self) -> dict:
        """This cache's KV memory and copy counters.

        Keys (bytes unless noted):
            ``kv_device_bytes`` / ``kv_host_bytes``: committed storage per tier
            (from the allocator's chunk placement); ``kv_reserved_bytes``:
            address space reserved; ``kv_live_bytes``: bytes of the live tokens;
            ``bytes_per_token``: K+V bytes of one token (all full-attention layers,
            whole batch); ``live_tokens`` / ``capacity_tokens`` (tokens);
            ``cxl_layers`` / ``other_layers`` (counts: layers in the shared
            full-attention storage / all others, tiered or not: see
            ``cxlalloc.hf.stats()["hf"]["layers"]``); ``stores`` (full-attention
            stores); ``other_stores`` (sliding-window and indexer-key stores,
            included in the byte counts above); and the :class:`KVCounters` fields
            (``bytes_copied``, ``step_bytes_copied``, ``regrowths``, ``demoted_bytes``...).
        """
        stores = self._stores()
        extra = [s for layer in self.layers for s in getattr(layer, "_extra_stores", list)()]
        tiers = {"device": 0, "host": 0}
        for s in stores + extra:
            for k, v in s.tier_bytes().items():
                tiers[k] += v
        layers = self._cxl_layers()
        live = max((layer._len for layer in layers), default=0)
        d = {
            "kv_device_bytes": tiers["device"],
            "kv_host_bytes": tiers["host"],
            "kv_reserved_bytes": sum(s.extent.capacity for s in stores + extra),
            "bytes_per_token": sum(s.row_bytes for s in stores),
            "kv_live_bytes": sum(s.row_bytes for s in stores) * live,
            "live_tokens": live,
            "capacity_tokens": min((s.capacity_tokens for s in stores), default=0),
            "cxl_layers": len(layers),
            "other_layers": len(self.layers) - len(layers),
            "stores": len(stores),
            "other_stores": len(extra),
        }
        self._pool.update_demotions()
        d.update(self._pool.counters.as_dict())
        return d
