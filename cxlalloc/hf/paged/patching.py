"""Routing transformers' continuous batching to :class:`CxlPagedAttentionCache` on a wrapped model:
``continuous_api.PagedAttentionCache`` rebound (once per process, wrapped models only), the
manager's batch-processor factory and the batch processor's hooks (placement per batch,
preemption counters), and :func:`install`."""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from cxlalloc.config import format_bytes
from cxlalloc.hf.paged import tf_classes
from cxlalloc.hf.paged.cache import CxlPagedAttentionCache
from cxlalloc.hf.paged.gpu_parts import split_reason
from cxlalloc.hf.paged.stats import CBState
from cxlalloc.hf.paged.swap_pool import host_swap_pool

GiB = 1 << 30
CB_GAP = tf_classes.CB_GAP  # None: this transformers has what is replaced here
_tf_api = tf_classes._tf_api


class _Building(threading.local):
    """The CBState of the wrapped manager building its cache on this thread (None: none)."""

    cb: Optional[CBState] = None


_TLS = _Building()
_STOCK_CACHE = tf_classes.PagedAttentionCache  # transformers' class (continuous_api's name is rebound to _paged_cache)
_patch_lock = threading.Lock()
# The managers attached to (a WeakSet, not a manager -> CBState WeakKeyDictionary: a mapping's values are held strongly
# from this module, so a model whose manager died in a reference cycle was freed only by a second gc pass; the state
# is reached through the manager's own patched method instead).
_ATTACHED: "weakref.WeakSet" = weakref.WeakSet()


def _paged_cache(*args, **kwargs):
    """Stands for ``PagedAttentionCache`` in transformers' ``continuous_api``:
    a :class:`CxlPagedAttentionCache` when a wrapped model's manager builds its
    cache on this thread, transformers' own otherwise (unwrapped models are
    unaffected)."""
    cb = _TLS.cb
    if cb is None:
        return _STOCK_CACHE(*args, **kwargs)
    return CxlPagedAttentionCache(cb, *args, **kwargs)


def _patch_transformers() -> None:
    """Route ``continuous_api``'s ``PagedAttentionCache(...)`` through
    :func:`_paged_cache` (once per process)."""
    with _patch_lock:
        if _tf_api.PagedAttentionCache is not _paged_cache:
            _tf_api.PagedAttentionCache = _paged_cache


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


def _untiered_reason(manager, cb: CBState) -> Optional[str]:
    dh = getattr(manager, "distributed_helper", None)
    if dh is not None and getattr(dh, "tp_size", 1) > 1:
        return (f"tensor parallelism (tp_size={dh.tp_size}): each rank's paged cache is a shard transformers "
                "allocates per rank, and cxlalloc's paged cache is one extent of one GPU's allocator; each rank's "
                "paged cache stays transformers' own")
    st = cb.wrap_state
    if getattr(st, "multi", False):
        model = cb.model
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else \
            model.config
        why = split_reason(tf_classes.group_layers_by_attn_type(config), st.layout.layer_gpu,
                           int(config.num_hidden_layers))
        if why is not None:
            return (f"the model is spread over GPUs {['cuda:%d' % g for g in st.layout.gpus]} and {why}; the paged "
                    "cache stays transformers' own (generate() tiers each layer's KV on its GPU)")
    return None


def _attach(cb: CBState, manager) -> None:
    orig_create = manager._create_batch_processor

    def _create_batch_processor():
        existing = getattr(manager, "batch_processor", None)
        if isinstance(existing, _tf_api.ContinuousBatchProcessor):
            return orig_create()
        reason = _untiered_reason(manager, cb)
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
            host_swap_pool(cb, bp, gib)
        _count_offloads(cb, bp.offloading_manager)
        _hook_batches(cb, bp)
        return bp

    manager._create_batch_processor = _create_batch_processor
    _ATTACHED.add(manager)
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
        elif manager not in _ATTACHED:
            _attach(cb, manager)
        return manager

    init_continuous_batching.__doc__ = orig.__doc__
    model.__dict__["init_continuous_batching"] = init_continuous_batching
    return cb


__all__ = ["install"]
