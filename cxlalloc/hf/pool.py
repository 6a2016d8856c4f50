"""The storage manager of one cache (:class:`KVPool`) and what the cache and
all its layers share: the allocator default, the pickling refusal, the message
for gradients across forwards and the shallow copy.

A :class:`KVPool` is created by :class:`~cxlalloc.hf.CxlCache` and handed to each
tiered layer (:mod:`cxlalloc.hf.layers`); it holds the allocator, the
:class:`~cxlalloc.hf.storage.KVCounters` and the store shared by the
full-attention layers, and no reference to the layers.
"""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

from cxlalloc import _C
from cxlalloc.allocator import Allocator
from cxlalloc.hf.storage import Geometry, KVCounters, KVStorage
from cxlalloc.policy.kv_growth import grown_capacity


PICKLE_ERROR = ("cxlalloc.hf: a {what} cannot be pickled or torch.save'd: its K/V live in cxlalloc memory of "
                "this process; copy.deepcopy(cache) copies it here, and to save the K/V pickle "
                "[(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]")


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


class KVPool:
    """The storage manager of one cache: its allocator, counters, capacity hint
    and the store shared by its full-attention layers.  Holds no reference to
    the layers (so a dropped cache frees its memory by refcount, at once)."""

    def __init__(self, allocator, n_shared: int, max_cache_len: Optional[int], growth: float, round_tokens: int,
                 counters: Optional[KVCounters] = None):
        # counters: shared by the pools of one cache whose layers sit on several GPUs (one pool per GPU).
        self.allocator = allocator
        self.device = _allocator_device(allocator)
        self.n_shared = int(n_shared)
        self.hint = int(max_cache_len) if max_cache_len else None
        self.growth = float(growth)
        self.round_tokens = int(round_tokens)
        self.counters = counters if counters is not None else KVCounters()
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

    def bind(self, layer, key_states: torch.Tensor, value_states: torch.Tensor) -> Tuple[KVStorage, int]:
        """The (store, slot) an empty layer (a :class:`~cxlalloc.hf.layers.CxlKVLayer`)
        writes to, creating storage as needed."""
        return self.bind_geometry(layer, Geometry.of(key_states, value_states), key_states.shape[-2])

    def bind_geometry(self, layer, g: Geometry, need: int) -> Tuple[KVStorage, int]:
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
                # Grown like a step's regrowth (grown_capacity: x growth, whole rounds), not to exactly
                # ``tokens``: a conversation continued turn after turn reserves a little more each turn, and
                # an exact fit copied its whole KV again on every turn (profiled: 13 of 20 chat turns, a
                # full-prefix copy each).  Only address space is reserved; memory is committed as rows fill.
                s.regrow(self.clamp(self.capacity_for(tokens, s.capacity_tokens), s.live_tokens, s.row_bytes))

    def demotions_since_start(self) -> Tuple[int, int]:
        """(bytes, moves) the allocator demoted since this pool was made."""
        st = self.allocator.stats()
        return int(st["demoted_bytes"]) - self._demoted_at_start[0], int(st["demotions"]) - self._demoted_at_start[1]

    def update_demotions(self) -> None:
        self.counters.demoted_bytes, self.counters.demotions = self.demotions_since_start()


def update_demotions(pools) -> None:
    """Set the shared counters of ``pools`` (the pools of one cache: one per GPU
    its layers sit on) to the demotions of all their allocators."""
    pools = list(pools)
    got = [p.demotions_since_start() for p in pools]
    pools[0].counters.demoted_bytes = sum(b for b, _ in got)
    pools[0].counters.demotions = sum(n for _, n in got)
