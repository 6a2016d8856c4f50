"""HuggingFace transformers integration: generate() with a tiered, copy-free KV cache.

    import cxlalloc.hf
    model = cxlalloc.hf.wrap(model, device_limit="6GiB")   # simulate=True for a CPU model
    out = model.generate(**inputs, max_new_tokens=256)       # the user's call, unchanged
    cxlalloc.hf.stats(model)                                 # bytes per tier and class, copies, ...

Public API:
    wrap(model, **options) -> model      KV cache (and, scoped, weights) in cxlalloc
    unwrap(model) -> model               undo wrap
    generate(model, *args, **kwargs)     wrap if needed, then model.generate(...)
    stats(model) -> dict                 allocator stats + per-cache KV counters ("hf")
    kv_cache(model), allocator(model)    the latest live CxlCache / the Allocator (the first GPU's)
    allocators(model)                    {"cuda:i": Allocator}: each GPU's (a model spread over GPUs)
    forget_conversation(model)           release the previous turn's cache kept for the next turn (kv_store)
    CxlCache, CxlKVLayer                 the cache classes (transformers DynamicCache/DynamicLayer)
    CxlSlidingLayer, CxlIndexedLayer, CxlHybridLayer, CxlHybridSlidingLayer
                                         tiered sliding-window / indexed (DSA) / attention+SSM layers
    CxlEncoderDecoderCache               EncoderDecoderCache with both halves in cxlalloc
    CacheCoverageWarning                 said once when cache layers are left to transformers
    ContinuousBatchingWarning            said once when continuous batching is not tiered or shares no prefix
    cache_kwarg(model), returned_cache(out)   transformers 5.17/5.24 naming shim

copy.deepcopy / pickle / torch.save of a wrapped model give an unwrapped copy
(UnwrappedCopyWarning); a CxlCache can be deep-copied but not pickled.

Requires transformers >= 5.17 (tested on 5.17 and 5.24).  ``python -m cxlalloc demo``
(:mod:`cxlalloc_apps.demo`) is the main job: a real model's generate() past the VRAM
budget, with identical tokens.

Modules:
    wrap      wrap()/unwrap()/stats(): the generate() hook, weights placed in the allocator, copies
    devices   a model on several GPUs: each layer's and parameter's GPU, per-GPU options, stats totals
    cache     CxlCache: a transformers DynamicCache whose layers live in cxlalloc (the container only)
    layers    every tiered layer class (full, sliding, indexed, hybrid) and LAYER_CLASSES, the one
              mapping from transformers' layer kinds to them
    pool      KVPool: one cache's allocator, counters and shared full-attention store
    indices   batch-row and crop arguments normalised for every layer kind; all-or-nothing crop
    encdec    CxlEncoderDecoderCache: encoder-decoder models' self- and cross-attention caches
    model_caches  Cxl<Name>: a model's own DynamicCache subclass (MiniMaxCache) with tiered layers
    paged     continuous batching (generate_batch, init_continuous_batching): the paged cache in cxlalloc
    coverage  which layers are tiered, which are left to transformers; CacheCoverageWarning
    storage   KVStorage: token-major K/V of all layers in one cxlalloc extent; KVCounters
    compat    the differences between the transformers versions supported
"""

from cxlalloc.hf.cache import CxlCache  # noqa: F401
from cxlalloc.hf.layers import (CxlHybridLayer, CxlHybridSlidingLayer, CxlIndexedLayer, CxlKVLayer,  # noqa: F401
                                CxlSlidingLayer)
from cxlalloc.hf.encdec import CxlEncoderDecoderCache  # noqa: F401
from cxlalloc.hf.coverage import CacheCoverageWarning  # noqa: F401
from cxlalloc.hf.paged import ContinuousBatchingWarning, CxlPagedAttentionCache  # noqa: F401
from cxlalloc.hf.compat import cache_kwarg, returned_cache  # noqa: F401
from cxlalloc.hf.storage import KVCounters  # noqa: F401
from cxlalloc.hf.devices import TensorParallelWarning  # noqa: F401
from cxlalloc.hf.wrap import (UnwrappedCopyWarning, allocator, allocators, forget_conversation, generate,  # noqa: F401
                              is_wrapped, kv_cache, stats, unwrap, wrap)

__all__ = ["wrap", "unwrap", "generate", "stats", "kv_cache", "forget_conversation", "allocator", "allocators", "is_wrapped", "CxlCache", "CxlKVLayer",
           "KVCounters", "cache_kwarg", "returned_cache", "UnwrappedCopyWarning", "CxlSlidingLayer", "CxlIndexedLayer",
           "CxlHybridLayer", "CxlHybridSlidingLayer", "CxlEncoderDecoderCache", "CacheCoverageWarning",
           "ContinuousBatchingWarning", "CxlPagedAttentionCache", "TensorParallelWarning"]
