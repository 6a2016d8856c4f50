"""Which cache layers cxlalloc.hf tiers, which it leaves to transformers, and saying so once.

:func:`layer_report` classifies the layers of the cache a ``generate()`` used
(or will use) by kind; :class:`CacheCoverageWarning` is issued once per wrapped
model when anything is left to transformers (:func:`cxlalloc.hf.wrap`, or the
first ``generate()`` when the cache is only known then); ``hf.stats(model)["hf"]
["layers"]`` carries the same facts.  The kinds are transformers' class names
(``cache_utils.py``; a tiered layer reports the stock class it stands for).

Report keys (docs/huggingface.md#what-runs-where):

* ``cache_class``: the cache's class name (``None``: the model returned no
  cache; ``"tuple"`` / ``"list"``: a legacy tuple cache or a model's own state);
* ``tiered``: ``{kind: layers}`` whose K/V (or window) live in cxlalloc extents;
* ``untiered``: ``{kind: layers}`` holding KV that grows with the context, left
  to transformers (in torch's allocator: on a GPU, outside ``device_limit``);
* ``fixed_state``: ``{kind: layers}`` holding fixed-size state (SSM / conv /
  recurrent; also the state half of tiered hybrid layers), left to transformers;
* ``no_storage``: ``{kind: layers}`` holding nothing (``DummyLayer``: KV-sharing
  consumers, MLP-only layers);
* ``untiered_kv_bytes`` / ``untiered_state_bytes``: bytes of those tensors at
  the cache's current length (0 before a generate());
* ``tiered_layers`` / ``layers``: counts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, EncoderDecoderCache, LinearAttentionCacheLayerMixin

from cxlalloc.config import format_bytes
from cxlalloc.hf.layers import LINEAR_STATE_ATTRS, STOCK_KIND

CROSS = " (cross-attention)"
GLOBAL_MODE_HINT = "to put those in the tiers too use global mode (cxlalloc.enable() / CXLALLOC=1)"


class CacheCoverageWarning(UserWarning):
    """A wrapped model keeps some cache layers (KV or fixed-size state) in
    transformers' own memory, outside cxlalloc's tiers."""


def _tensor_bytes(obj, seen: set) -> int:
    if torch.is_tensor(obj):
        key = (obj.untyped_storage().data_ptr(), obj.data_ptr(), tuple(obj.shape))
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def _split_bytes(layer) -> Tuple[int, int]:
    """(KV bytes, fixed-state bytes) of the ordinary tensors a layer holds."""
    seen: set = set()
    d = getattr(layer, "__dict__", {})
    state = sum(_tensor_bytes(d[k], seen) for k in LINEAR_STATE_ATTRS if k in d)
    kv = 0
    if type(layer) not in STOCK_KIND:  # a tiered layer's K/V are extent views, not counted here
        kv = sum(_tensor_bytes(v, seen) for k, v in d.items() if k not in LINEAR_STATE_ATTRS)
        if not d and isinstance(layer, (list, tuple)):
            kv = _tensor_bytes(layer, seen)
    return kv, state


def _layers(cache) -> List[Tuple[Any, str]]:
    if isinstance(cache, EncoderDecoderCache):
        return _layers(cache.self_attention_cache) + [(l, s + CROSS) for l, s in _layers(cache.cross_attention_cache)]
    return [(layer, "") for layer in (getattr(cache, "layers", None) or [])]


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (nested lists/tuples/dicts; each tensor once)."""
    return _tensor_bytes(obj, set())


def _plain_report(r: Dict[str, Any], cache, grew: Optional[bool]) -> None:
    """A cache that is not a transformers ``Cache``: a legacy tuple of per-layer
    ``(key, value)`` tuples (KV, grows), or the model's own list of state tensors:
    KV that grows when ``grew`` (XLNet's ``mems``), else fixed-size state (RWKV's
    recurrent state)."""
    seen: set = set()
    nbytes = _tensor_bytes(cache, seen)
    items = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    if items and all(isinstance(i, (list, tuple)) for i in items):
        r["untiered"][f"{r['cache_class']} of (key, value) per layer"] = len(items)
        r["untiered_kv_bytes"] += nbytes
    else:
        kind = f"{r['cache_class']} of {len(items)} state tensors" if isinstance(cache, (list, tuple)) else r["cache_class"]
        if grew:
            r["untiered"][kind] = 1
            r["untiered_kv_bytes"] += nbytes
        else:
            r["fixed_state"][kind] = 1
            r["untiered_state_bytes"] += nbytes


def _kind(layer) -> str:
    return STOCK_KIND.get(type(layer), type(layer).__name__)


def layer_report(cache, model_name: str = "", grew: Optional[bool] = None) -> Dict[str, Any]:
    """Classify ``cache``'s layers (a transformers ``Cache``, an
    ``EncoderDecoderCache``, a legacy tuple or list of tensors, or None: the
    model returned no cache).  ``grew``: whether a plain list of tensors held
    more bytes at the end of generate() than when first seen (then it is KV
    that grows, else fixed-size state).  Returns the dict described in the
    module docstring."""
    r: Dict[str, Any] = {"cache_class": None, "tiered": {}, "untiered": {}, "fixed_state": {}, "no_storage": {},
                         "untiered_kv_bytes": 0, "untiered_state_bytes": 0}
    if cache is None:
        r["untiered"][f"no Cache ({model_name or 'model'} returned none)"] = 1
    else:
        r["cache_class"] = type(cache).__name__
        extra = 0
        if isinstance(cache, Cache) and not isinstance(cache, EncoderDecoderCache):
            # State a model-specific cache class keeps outside its layers (e.g. MiniMaxCache.linear_cache:
            # the lightning-attention state, one fixed-size tensor per layer).
            seen: set = set()
            extra = sum(_tensor_bytes(v, seen) for k, v in cache.__dict__.items() if k != "layers")
        for layer, suffix in _layers(cache):
            kind = _kind(layer) + suffix
            kv, state = _split_bytes(layer)
            if type(layer) in STOCK_KIND:
                r["tiered"][kind] = r["tiered"].get(kind, 0) + 1
                if isinstance(layer, LinearAttentionCacheLayerMixin):
                    r["fixed_state"][kind] = r["fixed_state"].get(kind, 0) + 1
            elif isinstance(layer, DummyLayer):
                r["no_storage"][kind] = r["no_storage"].get(kind, 0) + 1
            elif isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin):
                r["fixed_state"][kind] = r["fixed_state"].get(kind, 0) + 1
            else:
                r["untiered"][kind] = r["untiered"].get(kind, 0) + 1
            r["untiered_kv_bytes"] += kv
            r["untiered_state_bytes"] += state
        if extra:
            own = type(cache)
            if own.__module__ == "cxlalloc.hf.model_caches":  # Cxl<Name>: name the model's class
                own = own.__bases__[0]
            r["fixed_state"][f"{own.__name__} (state outside its layers)"] = 1
            r["untiered_state_bytes"] += extra
        if not isinstance(cache, Cache):
            _plain_report(r, cache, grew)
    r["tiered_layers"] = sum(r["tiered"].values())
    r["layers"] = r["tiered_layers"] + sum(r["untiered"].values()) + sum(
        n for k, n in r["fixed_state"].items() if k not in r["tiered"] and "outside its layers" not in k) + sum(
        r["no_storage"].values())
    return r


def needs_warning(r: Dict[str, Any]) -> bool:
    """Whether anything with storage is left to transformers."""
    return bool(r["untiered"] or r["fixed_state"])


def signature(r: Dict[str, Any]) -> tuple:
    """What a warning says, without byte counts (the same situation warns once)."""
    return (tuple(sorted(r["tiered"].items())), tuple(sorted(r["untiered"].items())),
            tuple(sorted(r["fixed_state"].items())))


def _kinds(d: Dict[str, int]) -> str:
    return ", ".join(f"{k} x {n}" for k, n in sorted(d.items()))


def warning_text(r: Dict[str, Any], measured: bool) -> str:
    """The one-message warning: what is tiered, what is left to transformers
    (bytes when ``measured``: after a generate(); else what grows), what to do."""
    storing = r["layers"] - sum(r["no_storage"].values())
    tiered = f" (kinds {_kinds(r['tiered'])})" if r["tiered"] else ""
    left: List[str] = []
    if r["untiered"]:
        what = (f"~{format_bytes(r['untiered_kv_bytes'])} of KV at this length" if measured
                else "KV that grows with the context")
        left.append(f"{_kinds(r['untiered'])} ({what})")
    if r["fixed_state"]:
        what = (f"fixed-size state, {format_bytes(r['untiered_state_bytes'])}" if measured
                else "fixed-size state")
        kinds = ", ".join(f"{'the SSM/conv state of ' if k in r['tiered'] else ''}{k} x {n}"
                          for k, n in sorted(r["fixed_state"].items()))
        left.append(f"{kinds} ({what})")
    cls = r["cache_class"]
    why = ""
    if cls is not None and not cls.startswith("Cxl"):  # CxlCache, CxlEncoderDecoderCache, Cxl<model's class>
        why = (f" (generate() used a {cls}: one passed in, a cache_implementation, or the model's own cache class; "
               f"cxlalloc.hf tiers only the CxlCache it makes or is given)")
    return (f"cxlalloc.hf tiers {r['tiered_layers']} of {storing} cache layers{tiered}; left to transformers{why}: "
            f"{'; '.join(left)}; {GLOBAL_MODE_HINT}")
