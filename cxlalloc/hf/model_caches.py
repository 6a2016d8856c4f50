"""Model-specific cache classes that subclass transformers' ``DynamicCache``, tiered.

A few models build their own cache inside ``forward()`` instead of taking the
``DynamicCache`` generate() prepares: their ``_supports_default_dynamic_cache()``
is False (transformers ``generation/utils.py``) and their modeling module defines
a ``DynamicCache`` subclass, e.g. ``MiniMaxCache``
(``models/minimax/modeling_minimax.py``: full-attention layers as plain
``DynamicLayer``\\ s appended lazily, plus ``linear_cache``, the fixed-size
lightning-attention state per linear layer), and their forward refuses any cache
that is not an instance of it.

:func:`cxl_cache_for` makes an instance of ``Cxl<Name>``, a subclass of both the
model's class (first in the MRO: its own methods, e.g. ``MiniMaxCache``'s batch
operations and ``crop``, behave as they do) and :class:`~cxlalloc.hf.CxlCache`
(its full-attention layers are :class:`~cxlalloc.hf.CxlKVLayer`\\ s, each with a
store of its own, as for a cache built without a config).  The class's own
attributes (``linear_cache``) are those of a fresh instance of it, left in
torch's memory (fixed-size state, reported by :mod:`cxlalloc.hf.coverage`).
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Dict, Optional

from transformers.cache_utils import Cache, DynamicCache

from cxlalloc.hf.cache import CxlCache

_CLASSES: Dict[type, type] = {}
_CACHE_ATTRS = frozenset(("layers", "layer_class_to_replicate", "offloading", "only_non_sliding", "prefetch_stream"))


def own_cache_class(model) -> Optional[type]:
    """The model's own ``DynamicCache`` subclass (defined in its modeling module,
    constructible without arguments), if it has one and does not take
    generate()'s default cache; else None."""
    supports = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
    if supports:
        return None
    mod = sys.modules.get(type(model).__module__)
    found = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, DynamicCache)
             and c is not DynamicCache and c.__module__ == getattr(mod, "__name__", None)] if mod else []
    if len(found) != 1:
        return None
    try:
        params = list(inspect.signature(found[0].__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return found[0]


def _tiered_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        def __init__(self, *, allocator, max_cache_len: Optional[int] = None):
            CxlCache.__init__(self, config=None, allocator=allocator, max_cache_len=max_cache_len)
            proto = base()  # the class's own state, as a fresh instance has it (no memory: lazy layers)
            for k, v in proto.__dict__.items():
                if k not in _CACHE_ATTRS and k not in Cache.__dict__:
                    setattr(self, k, copy.deepcopy(v))

        def prepare_forward(self, tokens: int, batch: int, guess=None) -> bool:
            # No plan: the layers are appended lazily up to each updated index, and those of
            # other kinds (MiniMax's linear-attention layers) are never updated, so a plan
            # would commit storage for them.  update() binds what is used.
            return False

        cls = type(f"Cxl{base.__name__}", (base, CxlCache), {
            "__init__": __init__, "prepare_forward": prepare_forward, "__module__": __name__,
            "__doc__": f"transformers' {base.__name__} with its full-attention layers in cxlalloc "
                       f"(cxlalloc.hf.model_caches)."})
        _CLASSES[base] = cls
    return cls


def cxl_cache_for(model, allocator, max_cache_len: Optional[int] = None) -> Optional[CxlCache]:
    """A tiered instance of the model's own cache class (see the module doc), or None."""
    base = own_cache_class(model)
    if base is None:
        return None
    return _tiered_class(base)(allocator=allocator, max_cache_len=max_cache_len)
