"""Encoder-decoder models (T5, BART, Whisper, ...): both halves of transformers'
``EncoderDecoderCache`` in cxlalloc extents.

transformers 5.24 (``generation/utils.py``, ``_prepare_cache_for_generation``)
gives an encoder-decoder model ``EncoderDecoderCache(DynamicCache(config),
DynamicCache(config))``: the first holds the decoder's self-attention K/V (grows
by one token per generated token), the second the cross-attention K/V, computed
from the encoder output in the first decoder forward (``is_updated``) and read
unchanged afterwards — as large as the encoder output (``batch x encoder tokens``
per layer; docs/sources.md#transformers-layer-kinds).  :class:`CxlEncoderDecoderCache` is that cache with a
:class:`~cxlalloc.hf.CxlCache` in each place, on one allocator: the
self-attention store reserved for ``max_length - 1`` tokens, the cross-attention
store sized at its one write (the encoder length).
"""

from __future__ import annotations

import copy
from typing import Optional

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache

from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.pool import PICKLE_ERROR

# kv_stats keys that add up over the two caches (bytes and counts).
_SUMMED = ("kv_device_bytes", "kv_host_bytes", "kv_reserved_bytes", "kv_live_bytes", "cxl_layers", "other_layers",
           "stores", "other_stores", "bytes_copied", "bytes_copied_new", "bytes_copied_existing", "regrowths",
           "reorders", "reorder_rows")


class CxlEncoderDecoderCache(EncoderDecoderCache):
    """``EncoderDecoderCache`` whose self- and cross-attention caches are :class:`CxlCache`\\ s.

    Args:
        config: the model config (the decoder's layer types are used for both).
        allocator: the :class:`cxlalloc.Allocator` (see :class:`CxlCache`).
        max_cache_len: tokens to reserve in the self-attention cache
            (generate()'s ``max_length - 1``); the cross-attention cache is
            sized by its one write.

    ``copy.deepcopy`` copies both; pickling raises ``TypeError``.
    """

    def __init__(self, config=None, *, allocator=None, max_cache_len: Optional[int] = None, cross_config=None):
        super().__init__(CxlCache(config=config, allocator=allocator, max_cache_len=max_cache_len),
                         CxlCache(config=config if cross_config is None else cross_config, allocator=allocator))

    @classmethod
    def like(cls, stock: EncoderDecoderCache, config, *, allocator, max_cache_len: Optional[int] = None):
        """A cache with the layer kinds of ``stock`` (what transformers or the
        model made: T5Gemma's cross-attention cache is full attention although
        its decoder config declares sliding layers, models/t5gemma/modeling_t5gemma.py
        ``_prepare_cache_for_generation``), or None when a half holds a kind
        other than ``DynamicLayer`` / ``DynamicSlidingWindowLayer``."""
        halves = []
        for half in (stock.self_attention_cache, stock.cross_attention_cache):
            if not half.layers:
                halves.append(None)  # built without a config: lazy full-attention layers
                continue
            types = []
            for layer in half.layers:
                if type(layer) is DynamicLayer:
                    types.append("full_attention")
                elif type(layer) is DynamicSlidingWindowLayer and layer.sliding_window == getattr(
                        config, "sliding_window", None):
                    types.append("sliding_attention")
                else:
                    return None
            c = copy.deepcopy(config)
            c.layer_types = types
            if "sliding_attention" not in types:
                c.sliding_window = None
            halves.append(c)
        new = cls.__new__(cls)
        EncoderDecoderCache.__init__(new, CxlCache(config=halves[0], allocator=allocator, max_cache_len=max_cache_len),
                                     CxlCache(config=halves[1], allocator=allocator))
        return new

    @property
    def allocator(self):
        return self.self_attention_cache.allocator

    def reserve(self, tokens: int) -> None:
        """Reserve ``tokens`` tokens of decoder self-attention (a continuation)."""
        self.self_attention_cache.reserve(tokens)

    def kv_stats(self) -> dict:
        """:meth:`CxlCache.kv_stats` of the self-attention cache with the
        cross-attention cache's bytes and counts added (keys in ``_SUMMED``),
        plus ``"self_attention"`` / ``"cross_attention"``: each cache's own."""
        a, b = self.self_attention_cache.kv_stats(), self.cross_attention_cache.kv_stats()
        d = dict(a)
        for k in _SUMMED:
            d[k] = a[k] + b[k]
        d["bytes_per_token"] = a["bytes_per_token"]  # per generated token: the self-attention rows
        d["self_attention"], d["cross_attention"] = a, b
        return d

    def __deepcopy__(self, memo):
        """Both caches copied (:meth:`CxlCache.__deepcopy__`: live tokens, same allocator)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, copy.deepcopy(v, memo))
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(PICKLE_ERROR.format(what="CxlEncoderDecoderCache"))
