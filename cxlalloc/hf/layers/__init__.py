"""Every tiered cache layer class, and the one mapping from transformers' layer kinds to them.

:class:`~cxlalloc.hf.CxlCache` lets transformers' ``DynamicCache`` build the layer
list from the config (``config.layer_types``: ``"full_attention"``,
``"sliding_attention"``, ``"chunked_attention"``, ``"hybrid"``, ... each becoming
one of transformers' stock layer classes) and replaces each layer whose exact
stock class is a key of :data:`LAYER_CLASSES` with that value's
``from_stock(layer, pool, slot)``.  Facts about transformers' layers:
docs/sources.md#transformers-layer-kinds; the table is in
docs/huggingface.md#what-runs-where:

| transformers 5.24 layer (``cache_utils.py``) | cxlalloc.hf layer | in the extents |
|---|---|---|
| ``DynamicLayer`` (full attention) | :class:`CxlKVLayer` (``full``) | K/V (shared store) |
| ``DynamicIndexedLayer`` (DSA: DeepSeek-V3.2, GLM-MoE-DSA, ...) | :class:`CxlIndexedLayer` (``indexed``) | K/V (shared store) + indexer keys (a store per layer) |
| ``LinearAttentionAndFullAttentionLayer`` (``"hybrid"``) | :class:`CxlHybridLayer` (``hybrid``) | K/V (shared store); conv/recurrent state stays torch's (fixed size) |
| ``DynamicSlidingWindowLayer`` (sliding / chunked) | :class:`CxlSlidingLayer` (``sliding``) | the window, bounded |
| ``LinearAttentionAndSlidingWindowAttentionLayer`` (``"hybrid_sliding"``) | :class:`CxlHybridSlidingLayer` (``hybrid``) | the window; state stays torch's |

Each keeps the stock class's other methods and attributes (``update_indexer``,
``indexer_position_ids``, ``update_conv_state``, ``has_previous_state``, ...)
behaving as the stock class does.  Only exact stock types are replaced: a
model's own subclass keeps its behaviour and is reported as left to
transformers (:mod:`cxlalloc.hf.coverage`).  A new kind is one class in this
package plus one entry below.
"""

from transformers.cache_utils import (DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionAndFullAttentionLayer,
                                      LinearAttentionAndSlidingWindowAttentionLayer)

from cxlalloc.hf.layers.full import CxlKVLayer
from cxlalloc.hf.layers.hybrid import LINEAR_STATE_ATTRS, CxlHybridLayer, CxlHybridSlidingLayer
from cxlalloc.hf.layers.indexed import CxlIndexedLayer
from cxlalloc.hf.layers.sliding import CxlSlidingLayer

# Stock transformers layer class -> its tiered counterpart.  Each value has
# from_stock(layer, pool, slot) (None: leave that layer to transformers) and
# shares_full_store (whether it gets a slot in the shared full-attention store).
LAYER_CLASSES = {
    DynamicLayer: CxlKVLayer,
    DynamicIndexedLayer: CxlIndexedLayer,
    LinearAttentionAndFullAttentionLayer: CxlHybridLayer,
    DynamicSlidingWindowLayer: CxlSlidingLayer,
    LinearAttentionAndSlidingWindowAttentionLayer: CxlHybridSlidingLayer,
}

# Tiered class -> the stock kind it stands for (the names hf.stats() reports): LAYER_CLASSES read backwards.
STOCK_KIND = {tiered: stock.__name__ for stock, tiered in LAYER_CLASSES.items()}

__all__ = ["LAYER_CLASSES", "STOCK_KIND", "LINEAR_STATE_ATTRS", "CxlKVLayer", "CxlIndexedLayer", "CxlHybridLayer",
           "CxlSlidingLayer", "CxlHybridSlidingLayer"]
