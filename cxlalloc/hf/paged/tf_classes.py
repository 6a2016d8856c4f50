"""transformers' continuous-batching classes the paged cache builds on, or stand-ins.

``CB_GAP`` is None when this transformers has every piece :mod:`cxlalloc.hf.paged` replaces
(:func:`cxlalloc.hf.compat.continuous_batching_gap`); otherwise it says what is missing, the
names below are stand-ins so the package imports, and :func:`cxlalloc.hf.paged.install` leaves
continuous batching to transformers and says so.
"""

from __future__ import annotations

from cxlalloc.hf.compat import continuous_batching_gap

CB_GAP = continuous_batching_gap()  # None: this transformers has what is replaced here
if CB_GAP is None:
    from transformers.generation.continuous_batching import continuous_api as _tf_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache, group_layers_by_attn_type
    from transformers.generation.continuous_batching.cache_allocators import CachePool
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
else:  # stand-ins so the module imports; install() leaves continuous batching to transformers and says so
    _tf_api = None
    PagedAttentionCache = CachePool = object
    compute_block_hash = None
    group_layers_by_attn_type = None

__all__ = ["CB_GAP", "CachePool", "PagedAttentionCache", "compute_block_hash", "group_layers_by_attn_type"]
