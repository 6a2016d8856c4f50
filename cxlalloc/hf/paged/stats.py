"""Per-model state and counters of a wrapped model's continuous batching
(``hf.stats(model)["hf"]["continuous_batching"]``, docs/huggingface.md#continuous-batching)."""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from cxlalloc.hf.paged.cache import CxlPagedAttentionCache


class ContinuousBatchingWarning(UserWarning):
    """Part of a wrapped model's continuous batching is not tiered or not shared
    (said once per model and situation)."""



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
    peak_committed_bytes: int = 0  # the paged caches' committed memory (both tiers), at its highest
    commit_refusals: int = 0  # growths neither tier had room for (the cache was capped there)
    # {tier: {"blocks", "tokens", "bytes"}}: prefix tokens reused by where they came from (store_io.TIERS:
    # vram_prefix = blocks already in the paged cache, then the store's host / pool / remote tiers)
    tiers: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)
    # a model split over GPUs: {"cuda:i": {"peak_kv_device_bytes", "peak_kv_host_bytes"}} (empty on one GPU)
    per_gpu: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)


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

    def note_commit(self, committed: int) -> None:
        """Record a paged cache's committed bytes after it grew."""
        with self.lock:
            self.counters.peak_committed_bytes = max(self.counters.peak_committed_bytes, int(committed))

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


__all__ = ["CBCounters", "CBState", "ContinuousBatchingWarning"]
