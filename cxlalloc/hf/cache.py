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

Cache API semantics follow the installed transformers' ``DynamicCache``
(docs/huggingface.md#cxlcache-vs-dynamiccache says what is identical and what
differs): index arguments of every type are normalised by :func:`batch_rows`,
``crop`` is all-or-nothing across layer kinds (:func:`crop_layers`), K/V are
stored detached so a forward with grad back-propagates, and the views handed
out change only where that section says.

Supported transformers: 5.17-5.24 (the kwarg is ``past_key_values=`` on 5.17,
``cache=`` on later versions: use :func:`cxlalloc.hf.cache_kwarg`).
Source of the API facts: transformers ``cache_utils.py`` (``CacheLayerMixin``,
``DynamicLayer``, ``Cache``, ``DynamicCache``) of 5.17 and 5.24.
"""

from __future__ import annotations

import copy
import operator
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from cxlalloc import _C
from cxlalloc.allocator import Allocator
from cxlalloc.hf.compat import POSITIVE_CROP_RAISES
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


GRAD_ACROSS_FORWARDS = (
    "cxlalloc.hf: this forward needs gradients (grad enabled, K/V states requiring grad) through K/V that an "
    "earlier forward with gradients cached; a CxlCache stores K/V detached, so gradients flow through each "
    "forward's own K/V only.  Run the earlier forward under torch.no_grad(), or use transformers' DynamicCache "
    "to back-propagate across forwards")


def batch_rows(indices, batch: Optional[int], device, what: str, allow_mask: bool = True) -> torch.Tensor:
    """Normalise a batch-row argument to a 1-D ``torch.long`` tensor on ``device``.

    Every cache layer kind selects rows with the result (``index_select`` on
    dim 0), so a tuple is a sequence of rows as in ``DynamicLayer``'s
    ``keys[indices, ...]`` and never a multi-dimensional index.

    Args:
        indices: a 1-D tensor (any integer dtype, or bool: a mask of ``batch``
            rows when ``allow_mask``), a list, tuple or ``range`` of ints, or a
            1-D numpy array.  Negative rows count from the end, as in torch
            indexing.
        batch: the cache's batch size (None when no layer holds tokens yet:
            no range check).
        device: where the result goes (the storage's device).
        what: the argument's name, for messages.
        allow_mask: accept a bool mask (``batch_select_indices``; not
            ``reorder_cache``, whose ``index_select`` needs integers).

    Returns:
        ``(n,)`` long tensor of rows in ``[0, batch)``, ``n >= 1``.

    Raises:
        TypeError: not a sequence of ints (floats, nested sequences, a bool
            mask where none is accepted).
        ValueError: not 1-D, or it selects no row.
        IndexError: a row outside ``[-batch, batch)``, or a mask whose length
            is not ``batch``.
    """
    if isinstance(indices, torch.Tensor):
        t = indices.detach()
    else:
        try:
            t = torch.as_tensor(indices)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"cxlalloc.hf: {what} must be a 1-D tensor, list, tuple or numpy array of batch rows "
                            f"(ints), got {type(indices).__name__}: {e}") from None
        if t.numel() == 0:
            t = t.to(torch.long)
    if t.dim() != 1:
        raise ValueError(f"cxlalloc.hf: {what} must be 1-D (one entry per selected batch row), got shape "
                         f"{tuple(t.shape)}")
    if t.dtype == torch.bool:
        if not allow_mask:
            raise TypeError(f"cxlalloc.hf: {what} must hold integer batch rows, not a bool mask")
        if batch is not None and t.numel() != batch:
            raise IndexError(f"cxlalloc.hf: {what} is a mask of {t.numel()} rows for a cache of batch {batch}")
        t = t.nonzero().flatten()
    elif t.is_floating_point() or t.is_complex():
        raise TypeError(f"cxlalloc.hf: {what} must hold integer batch rows, got dtype {t.dtype}")
    t = t.to(device=device, dtype=torch.long)
    if t.numel() == 0:
        raise ValueError(f"cxlalloc.hf: {what} selects no batch row; a cache needs at least one")
    if batch is not None:
        lo, hi = int(t.min()), int(t.max())
        if lo < -batch or hi >= batch:
            raise IndexError(f"cxlalloc.hf: {what} {t.tolist()} has rows outside [-{batch}, {batch}) for a cache "
                             f"of batch {batch}")
        if lo < 0:
            t = torch.where(t < 0, t + batch, t)
    return t


def crop_amount(tokens_to_remove) -> int:
    """``crop()``'s argument as an int (a Python or numpy int, a 0-d integer tensor).

    Raises:
        TypeError: anything else (a float, a tensor of several values).
    """
    try:
        return operator.index(tokens_to_remove)
    except TypeError:
        raise TypeError(f"cxlalloc.hf: crop(tokens_to_remove) takes an int (negative: tokens to drop), got "
                        f"{type(tokens_to_remove).__name__} {tokens_to_remove!r}") from None


def _layer_snapshot(layer) -> list:
    """What a layer's ``crop`` may change: its attributes, and the contents of
    the dicts/lists among them (linear-attention layers assign into a dict of
    states).  Tensors are kept by reference: every crop slices and reassigns,
    none writes in place."""
    return [(k, v, dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else None)
            for k, v in vars(layer).items()]


def _layer_restore(layer, snap: list) -> None:
    d = vars(layer)
    d.clear()
    for k, v, contents in snap:
        if isinstance(v, dict):
            v.clear()
            v.update(contents)
        elif isinstance(v, list):
            v[:] = contents
        d[k] = v


def crop_layers(layers: Sequence, tokens_to_remove: int) -> None:
    """Crop every layer of a cache, or none: all-or-nothing for any mix of
    layer kinds (a hybrid sliding/full/linear cache is never left half cropped).

    The layers are cropped in order, as ``Cache.crop`` does, so the error
    raised is the one transformers' ``DynamicCache`` raises (the first layer
    that refuses: a sliding layer past its window without past recording, a
    linear-attention layer, a positive argument on 5.24); each layer's
    ``crop`` runs under a snapshot of its attributes and, if one raises, the
    layers already cropped are put back before the error propagates.
    (transformers validates inside each layer's ``crop``, so there is no
    separate check to run first; cxlalloc's own layers check before changing
    anything: :meth:`CxlKVLayer.check_crop`.)

    Raises:
        TypeError: ``tokens_to_remove`` is not an int.
        what the refusing layer raises (``ValueError``, ``RuntimeError``).
    """
    n = crop_amount(tokens_to_remove)
    snaps = [_layer_snapshot(layer) for layer in layers]
    done = 0
    try:
        for layer in layers:
            layer.crop(n)
            done += 1
    except BaseException:
        for layer, snap in zip(layers[:done + 1], snaps):
            _layer_restore(layer, snap)
        raise


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
        config, an empty layer and no ``guess``, a batch that differs from the
        cached one: update() then says what to do; or grad enabled).
        """
        layers = self._cxl_layers()
        windows = [layer for layer in self.layers if callable(getattr(layer, "plan_window", None))]
        if (not layers and not windows) or tokens < 1 or torch.is_grad_enabled():
            # With grad the update returns torch.cat'd tensors (CxlKVLayer.update), not planned views.
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
        for layer in windows:  # sliding-window layers (cxlalloc.hf.sliding): each plans itself, or not
            layer.plan_window(int(tokens), int(batch), guess)
        return True

    def _begin_step(self) -> None:
        pool = self._pool
        c = pool.counters
        c.steps += 1
        c.step_bytes_copied.append(0)
        c.step_context_tokens.append(0)
        for s in list(pool.stores):
            s.apply_pending()
            s.retry_trim()
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

    def _batch(self) -> Optional[int]:
        """The batch size of the cached tokens (None while no layer holds any)."""
        for s in self._stores():
            if s.live_tokens:
                return s.g.batch
        for layer in self.layers:
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-2] > 0:
                return int(keys.shape[0])
        return None

    def _rows(self, indices, what: str, allow_mask: bool = True) -> torch.Tensor:
        return batch_rows(indices, self._batch(), self._pool.device, what, allow_mask)

    @staticmethod
    def _on(idx: torch.Tensor, layer) -> torch.Tensor:
        dev = getattr(layer, "device", None)
        return idx.to(dev) if isinstance(dev, torch.device) and dev != idx.device else idx

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: ``new[b] = old[beam_idx[b]]`` for every layer.  Full-attention
        layers record it and apply it at the next forward (only rows that move
        are copied; the reorder after generate()'s last step is never applied).

        ``beam_idx``: integer rows as :func:`batch_rows` (tensor of any integer
        dtype, list, tuple, numpy array); one of another length than the batch
        selects those rows (:meth:`batch_select_indices`), as ``index_select``
        does in transformers' layers.  Views handed out before are rewritten in
        place when the reorder is applied (docs/huggingface.md, "CxlCache vs
        DynamicCache").

        Raises:
            TypeError / ValueError / IndexError: as :func:`batch_rows`.
        """
        idx = self._rows(beam_idx, "beam_idx", allow_mask=False)
        batch = self._batch()
        if batch is not None and idx.numel() != batch:
            self.batch_select_indices(idx)
            return
        for s in self._stores():
            s.reorder(idx)
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                layer._reorder_extra(idx)
            else:
                layer.reorder_cache(self._on(idx, layer))

    def _check_supported(self, op: str) -> None:
        """Raise before changing anything if one of transformers' own layers has
        no ``op`` (5.24's linear-attention layers have no batch_select_indices /
        batch_repeat_interleave: DynamicCache raises AttributeError there after
        the layers before it were changed)."""
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, CxlKVLayer) and not callable(getattr(layer, op, None)):
                raise AttributeError(f"cxlalloc.hf: cache layer {i} is transformers' {type(layer).__name__}, which "
                                     f"has no {op}() (DynamicCache cannot do it either); nothing was changed")

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
        repeats = operator.index(repeats)
        if repeats < 1:
            raise ValueError(f"cxlalloc.hf: batch_repeat_interleave(repeats) needs repeats >= 1, got {repeats}")
        self._check_supported("batch_repeat_interleave")
        self._rebuild(lambda b: b * repeats, lambda t: t.repeat_interleave(repeats, dim=0),
                      lambda layer: layer.batch_repeat_interleave(repeats), "batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices) -> None:
        """Keep only the batch rows ``indices``, in that order, in every layer:
        a 1-D tensor (any integer dtype, or a bool mask of ``batch`` rows), a
        list, tuple or numpy array of rows (a tuple is a sequence of rows, as in
        ``DynamicLayer``, never a multi-dimensional index); negative rows count
        from the end.  Full-attention K/V are copied into new storage; views
        handed out before keep their values.

        Raises:
            TypeError / ValueError / IndexError: as :func:`batch_rows` (nothing
            changed).
        """
        idx = self._rows(indices, "indices")
        self._check_supported("batch_select_indices")
        self._rebuild(lambda b: idx.numel(), lambda t: t.index_select(0, idx),
                      lambda layer: layer.batch_select_indices(self._on(idx, layer)), "batch_select_indices", idx)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from every layer under the installed transformers'
        rules (``crop(-n)`` drops the last ``n``, all if ``n`` is at least the
        length; ``crop(0)`` only shrinks recording sliding/linear layers back
        to their window; ``crop(n > 0)`` raises ``ValueError`` on 5.24, keeps
        ``n`` on 5.17), all-or-nothing across layer kinds
        (:func:`crop_layers`).  Chunks wholly beyond the kept tokens are
        released (deferred to the next step while a view of them is alive).

        Raises:
            TypeError: not an int.
            ValueError / RuntimeError: a layer refuses (transformers' message);
                no layer was changed.
        """
        crop_layers(self.layers, tokens_to_remove)
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
