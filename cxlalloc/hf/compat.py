"""Differences between the transformers versions cxlalloc.hf supports (5.17-5.24).

| concern | 5.17 | 5.24 |
|---|---|---|
| generate()/forward() cache kwarg and output field | ``past_key_values`` | ``cache`` (old name warns) |
| ``forward(cache=...)`` | silently ignored (lands in ``**kwargs``) | used |
| ``DynamicLayer.reset()`` | zeroes, keeps the length (stale) | drops the tensors |
| ``crop(n > 0)`` | keep ``n`` tokens (deprecated) | ``ValueError`` (:data:`POSITIVE_CROP_RAISES`) |
| ``layer.update`` call | ``(k, v, idx)`` | ``(k, v, idx, kwargs=...)`` |
| continuous batching internals :mod:`cxlalloc.hf.paged` builds on | checked, not assumed (:func:`continuous_batching_gap`) | ``PagedAttentionCache`` + ``cache_allocators`` + ``ContinuousBatchingManager._create_batch_processor`` |

Source: transformers ``cache_utils.py`` / ``generation/utils.py`` of both versions
(docs/sources.md#transformers-cache-api).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import transformers

TRANSFORMERS_VERSION = transformers.__version__


def cache_kwarg(model) -> str:
    """The keyword generate()/forward() take a cache under: ``"cache"`` (5.24)
    or ``"past_key_values"`` (5.17).  Detected from ``model.forward``'s signature
    (passing the wrong one to forward() on 5.17 is silently ignored)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(output: Any) -> Optional[Any]:
    """The cache in a generate()/forward() output (``return_dict_in_generate=True``),
    under either version's field name; None if absent."""
    keys = output.keys() if hasattr(output, "keys") else ()
    for name in ("cache", "past_key_values"):
        if name in keys:
            return output[name]
    return None


def _positive_crop_raises() -> bool:
    """Whether the installed ``DynamicLayer.crop`` refuses a positive argument
    (5.24: ``ValueError``) rather than keeping that many tokens (5.17).  Asked
    of transformers itself, on an empty layer, not inferred from the version."""
    from transformers.cache_utils import DynamicLayer

    try:
        DynamicLayer().crop(1)
    except ValueError:
        return True
    except Exception:  # 5.17 reads the (absent) keys of an empty layer: not the refusal
        return False
    return False


POSITIVE_CROP_RAISES = _positive_crop_raises()


# PagedAttentionCache.__init__ parameters cxlalloc.hf.paged passes on (transformers 5.24 cache.py).
PAGED_CACHE_PARAMS = ("config", "continuous_batching_config", "device", "distributed_helper", "dtype",
                      "model_supports_logits_to_keep")


def continuous_batching_gap() -> Optional[str]:
    """None when the installed transformers has the continuous-batching pieces
    :mod:`cxlalloc.hf.paged` replaces (5.24: ``continuous_batching/cache.py``'s
    ``PagedAttentionCache`` with that constructor, ``cache_allocators``'
    ``CachePool`` and ``compute_block_hash``, the manager's
    ``_create_batch_processor``); else what is missing (the path is then left
    to transformers, said once)."""
    try:
        from transformers.generation.continuous_batching import continuous_api
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.cache_allocators import CachePool  # noqa: F401
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (  # noqa: F401
            compute_block_hash)
    except ImportError as exc:
        return f"transformers {TRANSFORMERS_VERSION} lacks the continuous-batching modules cxlalloc uses ({exc})"
    params = tuple(inspect.signature(PagedAttentionCache.__init__).parameters)[1:]
    if params != PAGED_CACHE_PARAMS:
        return (f"transformers {TRANSFORMERS_VERSION}'s PagedAttentionCache takes {params}, not the "
                f"{PAGED_CACHE_PARAMS} cxlalloc was written for")
    manager = getattr(continuous_api, "ContinuousBatchingManager", None)
    if not callable(getattr(manager, "_create_batch_processor", None)) or \
            getattr(continuous_api, "PagedAttentionCache", None) is None:
        return f"transformers {TRANSFORMERS_VERSION}'s ContinuousBatchingManager builds its cache another way"
    return None
