"""Attention+SSM layers in cxlalloc: the attention half tiered, the fixed-size state transformers'.

``LinearAttentionAndFullAttentionLayer`` (``"hybrid"``) becomes :class:`CxlHybridLayer`
(K/V in the shared full-attention store), ``LinearAttentionAndSlidingWindowAttentionLayer``
(``"hybrid_sliding"``) :class:`CxlHybridSlidingLayer` (the window in a bounded extent);
the conv/recurrent state (no token axis) stays transformers' own code and memory,
reported untiered by :mod:`cxlalloc.hf.coverage`.  Facts about transformers' layers:
docs/sources.md#transformers-layer-kinds.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from transformers.cache_utils import (LinearAttentionAndFullAttentionLayer,
                                      LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionLayer)

from cxlalloc.hf.layers.full import CxlKVLayer
from cxlalloc.hf.layers.sliding import CxlSlidingLayer
from cxlalloc.hf.pool import KVPool

# Attributes of transformers' LinearAttentionCacheLayerMixin (the fixed-size SSM / conv state).
LINEAR_STATE_ATTRS = ("number_of_states", "conv_states", "recurrent_states", "is_conv_states_initialized",
                      "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size", "record_past")


def _states(layer) -> int:
    return int(getattr(layer, "number_of_states", 1))


class _LinearState:
    """The fixed-size conv/recurrent state half of a hybrid layer: transformers'
    own ``LinearAttentionLayer`` code and tensors (torch's memory, not tiered)."""

    def _copy_linear_state(self, src, memo) -> None:
        for k in LINEAR_STATE_ATTRS:
            if k in src.__dict__:
                self.__dict__[k] = copy.deepcopy(src.__dict__[k], memo)


class _HybridCalls:
    """What both hybrid layers do with a Cache call: the linear-attention
    (conv/recurrent state) half is transformers' own code, the attention half
    (``_attn``: :class:`CxlKVLayer` or :class:`CxlSlidingLayer`) cxlalloc's;
    each call goes to both, state first, as the stock classes do."""

    _attn: type

    def lazy_initialization(self, *args, **kwargs) -> None:
        # As the stock classes: two positional args from update() (attention), keywords from the state updates.
        if len(args) == 2 and not kwargs:
            self._attn.lazy_initialization(self, *args)
        if not args and len(kwargs) in (1, 2, 3):
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        self._attn.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        self._attn.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        self._attn.crop(self, tokens_to_remove)


class CxlHybridLayer(_HybridCalls, LinearAttentionLayer, CxlKVLayer, _LinearState):
    """``LinearAttentionAndFullAttentionLayer`` (Falcon-H1-, Zamba-style layers
    holding attention K/V and an SSM/conv state): the attention half's K/V in
    the shared full-attention store; the conv/recurrent state (fixed size, no
    token axis) is transformers' own code and memory, reported by
    :mod:`cxlalloc.hf.coverage` as untiered fixed-size state."""

    is_compileable = False  # as the stock class: the attention half grows

    _attn = CxlKVLayer
    shares_full_store = True

    def __init__(self, pool: KVPool, share_slot: Optional[int] = None, number_of_states: int = 1):
        CxlKVLayer.__init__(self, pool, share_slot)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    @classmethod
    def from_stock(cls, stock: LinearAttentionAndFullAttentionLayer, pool: KVPool,
                   slot: Optional[int]) -> "CxlHybridLayer":
        """The tiered counterpart of transformers' ``stock`` layer (its number of states kept)."""
        return cls(pool, slot, _states(stock))

    def _reorder_extra(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)

    # batch_repeat_interleave / batch_select_indices: the stock class inherits
    # DynamicLayer's (K/V only), so do these (CxlKVLayer's; _batch_extra a no-op).

    def _empty_like(self, pool: KVPool, memo) -> "CxlHybridLayer":
        new = CxlHybridLayer(pool, self._share_slot, self.number_of_states)
        new._copy_linear_state(self, memo)
        return new

    def __deepcopy__(self, memo):
        new = CxlKVLayer.__deepcopy__(self, memo)
        new.__class__ = CxlHybridLayer
        _LinearState._copy_linear_state(new, self, memo)
        return new


class CxlHybridSlidingLayer(_HybridCalls, LinearAttentionLayer, CxlSlidingLayer, _LinearState):
    """``LinearAttentionAndSlidingWindowAttentionLayer``: the sliding-window K/V in
    a bounded extent (:class:`~cxlalloc.hf.layers.sliding.CxlSlidingLayer`), the
    conv/recurrent state transformers' own (fixed size, reported untiered)."""

    is_compileable = False

    _attn = CxlSlidingLayer
    shares_full_store = False

    def __init__(self, pool: KVPool, sliding_window: int, number_of_states: int = 1):
        CxlSlidingLayer.__init__(self, pool, sliding_window)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    @classmethod
    def from_stock(cls, stock: LinearAttentionAndSlidingWindowAttentionLayer, pool: KVPool,
                   slot: Optional[int] = None) -> Optional["CxlHybridSlidingLayer"]:
        """The tiered counterpart of transformers' ``stock`` layer, or None for a window
        under 2 tokens (no cached token: left to transformers, as :meth:`CxlSlidingLayer.from_stock`)."""
        if int(stock.sliding_window) < 2:
            return None
        return cls(pool, stock.sliding_window, _states(stock))
