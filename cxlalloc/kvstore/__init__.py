"""The KV reuse store: KV cache blocks kept across requests for prefix hits.

A document, system prompt or chat history prefilled once is kept as KV blocks
in host memory on the chosen NUMA node (a CXL node where one is chosen) and
loaded in bulk by the next request that shares the prefix, instead of being
prefilled again.  :mod:`cxlalloc.hf.reuse` does this for ``generate()``
(``cxlalloc.hf.wrap(model, kv_store=True)``).

Modules (the top: the store contract, the in-process store, what client and server share):
    store      BlockStore: the contract of every store (lookup, reserve, discard, stats, accounting)
    keys       model fingerprint, chained block keys (BLAKE2b-256), namespaced and Redis key names
    layout     the byte format of a block (token-major rows of all KV layers)
    index      key -> block bookkeeping: chunks filled by a bump pointer, pins, write-then-publish
               (the eviction order: cxlalloc.policy.store_eviction)
    local      LocalBlockStore: the in-process store over a HostArena
    open       kv_store=... option values -> a store
    handles    the scoped lease / reservation handle both stores' handles build on
    counters   the transfer counters every store shares
    protocol   the kv-server's wire format (length-prefixed msgpack over a unix socket)
    client     RemoteBlockStore: a kv-server as a store (kv_store="unix:///path/kv.sock")

Rooms:
    server/    the kv-server: one shared pool for every process of a machine (``KVServer``,
               state, transport, jobs, cli, metrics)
    tiers/     the tier below a pool: the ``Tier`` contract and the Redis/Valkey tier
               (kv_store="redis://...", --redis)
    engines/   serving-engine plugins (LMCache's ``cxlalloc://``; needs the ``lmcache`` extra;
               not imported here) and the config lines ``cxlalloc info`` prints (docs/engines.md)

``lmcache_plugin`` here is only an alias of ``engines.lmcache_plugin`` for LMCache YAML written
before the move (its ``module_path``).
"""

# Imported when first used (PEP 562): the kv-server process needs neither torch
# nor the in-process store, only the index, the keys and the protocol.
_EXPORTS = {
    "BlockIndex": "cxlalloc.kvstore.index",
    "chain_keys": "cxlalloc.kvstore.keys",
    "model_fingerprint": "cxlalloc.kvstore.keys",
    "root_key": "cxlalloc.kvstore.keys",
    "BlockLayout": "cxlalloc.kvstore.layout",
    "KVStoreWarning": "cxlalloc.kvstore.local",
    "LocalBlockStore": "cxlalloc.kvstore.local",
    "resolve_limit": "cxlalloc.kvstore.local",
    "open_store": "cxlalloc.kvstore.open",
    "BlockStore": "cxlalloc.kvstore.store",
    "AccountedStore": "cxlalloc.kvstore.store",
    "RemoteBlockStore": "cxlalloc.kvstore.client",
    "RedisTier": "cxlalloc.kvstore.tiers.redis",
    "Tier": "cxlalloc.kvstore.tiers",
    "KVServer": "cxlalloc.kvstore.server",
    "lmcache_yaml": "cxlalloc.kvstore.engines",
    "engine_lines": "cxlalloc.kvstore.engines",
    "vllm_offload_config": "cxlalloc.kvstore.engines",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'cxlalloc.kvstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
