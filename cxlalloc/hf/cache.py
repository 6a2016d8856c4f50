"""A transformers KV cache whose full-attention K/V live in cxlalloc extents.

:class:`CxlCache` is a ``transformers.DynamicCache``: it builds the model's usual
layer list from the config and replaces every plain ``DynamicLayer`` (full
attention) with a :class:`~cxlalloc.hf.layers.CxlKVLayer`, and each other stock
layer kind in :data:`cxlalloc.hf.layers.LAYER_CLASSES` with its tiered counterpart
(sliding-window, indexed and attention+SSM layers: all in :mod:`cxlalloc.hf.layers`).
This module is the container only: the layers are in :mod:`cxlalloc.hf.layers`, the
storage manager in :mod:`cxlalloc.hf.pool`, the index helpers in :mod:`cxlalloc.hf.indices`.
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
differs): index arguments of every type are normalised by
:func:`~cxlalloc.hf.indices.batch_rows`, ``crop`` is all-or-nothing across layer
kinds (:func:`~cxlalloc.hf.indices.crop_layers`), K/V are
stored detached so a forward with grad back-propagates, and the views handed
out change only where that section says.

Supported transformers: 5.17-5.24 (the kwarg is ``past_key_values=`` on 5.17,
``cache=`` on later versions: use :func:`cxlalloc.hf.cache_kwarg`).
Source of the API facts: transformers ``cache_utils.py`` (``CacheLayerMixin``,
``DynamicLayer``, ``Cache``, ``DynamicCache``) of 5.17 and 5.24.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Tuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from cxlalloc.hf.cache_batch import BatchRowsMixin
from cxlalloc.hf.indices import batch_rows, crop_layers
from cxlalloc.hf.layers import LAYER_CLASSES, CxlKVLayer, CxlSlidingLayer
from cxlalloc.hf.pool import PICKLE_ERROR, KVPool, _shallow_copy, default_allocator, update_demotions
from cxlalloc.hf.storage import Geometry, KVCounters, KVStorage


class CxlCache(BatchRowsMixin, DynamicCache):
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
        layer_allocators: one :class:`cxlalloc.Allocator` per cache layer
            (``len(cache.layers)``, in layer order) for a model whose decoder
            layers sit on several GPUs (:func:`cxlalloc.hf.wrap` passes each
            layer's GPU's allocator): each layer's K/V live in its GPU's
            allocator and tiers, the full-attention layers of one GPU share one
            extent.  Needs ``config``; ``allocator`` is then ignored.

    Counters: :meth:`kv_stats`.  Use :func:`cxlalloc.hf.cache_kwarg` for the
    generate()/forward() keyword (``cache`` or ``past_key_values``).

    ``copy.deepcopy(cache)`` copies the live tokens into new storage of the
    same allocator; pickling (``pickle``, ``torch.save``) raises ``TypeError``.

    Raises:
        ValueError: no allocator given and no process-wide engine;
            ``layer_allocators`` without a config, or not one per layer.
    """

    def __init__(self, config=None, *, allocator=None, max_cache_len: Optional[int] = None, growth: float = 2.0,
                 round_tokens: int = 256, share_storage: bool = True, layer_allocators=None):
        if layer_allocators is not None:
            layer_allocators = list(layer_allocators)
            if config is None or not layer_allocators:
                raise ValueError("cxlalloc.hf: layer_allocators (one allocator per cache layer) needs the model "
                                 "config (CxlCache(config=model.config, ...))")
            allocator = layer_allocators[0]
        if allocator is None:
            allocator = default_allocator()
        if not growth > 1.0:
            raise ValueError(f"cxlalloc.hf: growth must be > 1, got {growth}")
        super().__init__(config=config)  # never offloading=True: placement is cxlalloc's business
        if self.layer_class_to_replicate is not None:  # no config: layers appended by Cache.update
            self._pool = KVPool(allocator, 0, max_cache_len, growth, round_tokens)
            self._pools = [self._pool]
            pool = self._pool
            self.layer_class_to_replicate = lambda: CxlKVLayer(pool, None)
        else:
            # Each stock layer kind with a tiered counterpart (LAYER_CLASSES) is
            # replaced; layers of a kind that shares the full-attention store get a slot.
            kinds = [LAYER_CLASSES.get(type(layer)) for layer in self.layers]
            if layer_allocators is None:
                layer_allocators = [allocator] * len(self.layers)
            elif len(layer_allocators) != len(self.layers):
                raise ValueError(f"cxlalloc.hf: layer_allocators has {len(layer_allocators)} allocators for "
                                 f"{len(self.layers)} cache layers (one per layer, in order)")
            # One pool per allocator (per GPU), its shared store holding the slots of its layers; one set of
            # counters for the whole cache.
            shared = [i for i, k in enumerate(kinds) if k is not None and k.shares_full_store]
            counters = KVCounters()
            pools, slots = {}, {}
            for a in layer_allocators:
                if id(a) not in pools:
                    on_a = [i for i in shared if layer_allocators[i] is a]
                    pools[id(a)] = KVPool(a, len(on_a) if share_storage else 0, max_cache_len, growth, round_tokens,
                                          counters)
                    slots.update({i: slot for slot, i in enumerate(on_a)})
            self._pools = list(pools.values())
            self._pool = self._pools[0]
            for i, kind in enumerate(kinds):
                if kind is not None:
                    slot = slots[i] if share_storage and i in slots else None
                    made = kind.from_stock(self.layers[i], pools[id(layer_allocators[i])], slot)
                    if made is not None:  # None: this instance cannot be tiered (stays transformers', reported)
                        self.layers[i] = made
        self._last_layer_idx: Optional[int] = None

    # ------------------------------------------------------------ steps
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, CxlKVLayer) and layer._prepared:  # the step began in prepare_forward
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
        windows = [layer for layer in self.layers if isinstance(layer, CxlSlidingLayer)]
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
        for layer in layers:  # storage for every layer first: a regrowth replaces a store's views
            if layer._prepared:
                layer._unplan()
            if layer._len == 0:
                # The layer's own GPU (its pool's device): with layers on several GPUs the guess names the first.
                dev = layer._pool.device if len(self._pools) > 1 else guess.device
                g = Geometry(int(batch), guess.heads, guess.k_dim, guess.v_dim, guess.dtype, dev)
                if not layer.is_initialized:
                    layer.device, layer.dtype, layer.is_initialized = g.device, g.dtype, True
                layer._store, layer._slot = layer._pool.bind_geometry(layer, g, int(tokens))
        for store in {id(layer._store): layer._store for layer in layers}.values():
            pool = next(layer._pool for layer in layers if layer._store is store)
            need = max(layer._len for layer in layers if layer._store is store) + int(tokens)
            store.apply_pending()
            if need > store.capacity_tokens:
                store.regrow(pool.clamp(pool.capacity_for(need, store.capacity_tokens), need, store.row_bytes))
            store.ensure(need)
        for layer in layers:
            layer.plan(tokens)
        for layer in windows:  # sliding-window layers (cxlalloc.hf.layers.sliding): each plans itself, or not
            layer.plan_window(int(tokens), int(batch), guess)
        return True

    def _begin_step(self) -> None:
        c = self._pool.counters
        c.steps += 1
        c.step_bytes_copied.append(0)
        c.step_context_tokens.append(0)
        for pool in self._pools:
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

    def kv_layers(self) -> List[CxlKVLayer]:
        """The layers whose per-token K/V live in cxlalloc (:class:`CxlKVLayer`), in order."""
        return self._cxl_layers()

    def kv_places(self) -> Optional[List[Tuple[KVStorage, int]]]:
        """``[(storage, slot)]`` of :meth:`kv_layers`, in order; None when there is
        none or a layer has no storage yet (nothing written)."""
        layers = self._cxl_layers()
        if not layers or any(layer._store is None for layer in layers):
            return None
        return [(layer._store, layer._slot) for layer in layers]

    def held_tokens(self) -> int:
        """Tokens every :meth:`kv_layers` layer holds (the least; 0 when there is none)."""
        return min((layer._len for layer in self._cxl_layers()), default=0)

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
        for pool in self._pools:
            pool.reserve(tokens)

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
            g = Geometry(int(batch), int(heads), int(k_dim), int(v_dim), dtype, layer._pool.device)
            store, slot = layer._pool.bind_geometry(layer, g, int(tokens))
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
        for pool in self._pools:
            pool.shared = None

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
        skip = ("layers", "_pool", "_pools", "layer_class_to_replicate")
        for k, v in self.__dict__.items():
            if k not in skip:
                setattr(new, k, copy.deepcopy(v, memo))
        counters = KVCounters()
        new._pools = []
        for old in self._pools:
            p = KVPool(old.allocator, old.n_shared, old.hint, old.growth, old.round_tokens, counters)
            new._pools.append(p)
            memo[id(old)] = p  # layers of other kinds (cxlalloc.hf.layers.sliding) find the copy's pool here
        new._pool = pool = memo[id(self._pool)]
        stores = {}
        for s in self._stores():
            old = next(layer._pool for layer in self._cxl_layers() if layer._store is s)
            p = memo[id(old)]
            c = s.clone(p.counters)
            p.stores.add(c)
            stores[id(s)] = c
            if old.shared is s:
                p.shared = c
        layers = []
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                nl = layer._empty_like(memo.get(id(layer._pool), pool), memo)
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
        extra = [s for layer in self.layers if isinstance(layer, (CxlKVLayer, CxlSlidingLayer))
                 for s in layer._extra_stores()]
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
        update_demotions(self._pools)
        d.update(self._pool.counters.as_dict())
        return d
