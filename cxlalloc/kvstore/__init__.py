"""The KV reuse store: KV cache blocks kept across requests for prefix hits.

A document, system prompt or chat history prefilled once is kept as KV blocks
in host memory on the chosen NUMA node (a CXL node where one is chosen) and
loaded in bulk by the next request that shares the prefix, instead of being
prefilled again.  :mod:`cxlalloc.hf.reuse` does this for ``generate()``
(``cxlalloc.hf.wrap(model, kv_store=True)``).

Modules:
    keys       model fingerprint, chained block keys (BLAKE2b-256)
    layout     the byte format of a block (token-major rows of all KV layers)
    index      key -> block bookkeeping: slabs, LRU eviction, pins, write-then-publish
    local      LocalBlockStore: the in-process store over a HostArena
    open       kv_store=... option values -> a store
"""

from cxlalloc.kvstore.index import BlockIndex  # noqa: F401
from cxlalloc.kvstore.keys import chain_keys, model_fingerprint, root_key  # noqa: F401
from cxlalloc.kvstore.layout import BlockLayout  # noqa: F401
from cxlalloc.kvstore.local import KVStoreWarning, LocalBlockStore, resolve_limit  # noqa: F401
from cxlalloc.kvstore.open import open_store  # noqa: F401

__all__ = ["BlockIndex", "BlockLayout", "KVStoreWarning", "LocalBlockStore", "chain_keys", "model_fingerprint",
           "open_store", "resolve_limit", "root_key"]
