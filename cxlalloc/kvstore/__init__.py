"""The KV reuse store: KV cache blocks kept across requests for prefix hits.

A document, system prompt or chat history prefilled once is kept as KV blocks
in host memory on the chosen NUMA node (a CXL node where one is chosen) and
loaded in bulk by the next request that shares the prefix, instead of being
prefilled again.  :mod:`cxlalloc.hf.reuse` does this for ``generate()``
(``cxlalloc.hf.wrap(model, kv_store=True)``).

Modules:
    store      BlockStore: the contract of every store (lookup, reserve, commit, release, stats, accounting)
    keys       model fingerprint, chained block keys (BLAKE2b-256), namespaced and Redis key names
    layout     the byte format of a block (token-major rows of all KV layers)
    index      key -> block bookkeeping: chunks filled by a bump pointer, LRU eviction, pins, write-then-publish
    local      LocalBlockStore: the in-process store over a HostArena
    open       kv_store=... option values -> a store
    protocol   the kv-server's wire format (length-prefixed msgpack over a unix socket)
    server     KVServer: one shared pool for every process of a machine (the façade of the three below)
    server_state      the pool, index, owners, quotas: plain methods taking a client id (no socket)
    server_transport  bind, socket permissions, framing, accept, dispatch of ops to the state
    server_jobs       placement verification, rate sampling, Redis read-through / write-back
    server_cli ``cxlalloc kv-server``: options, start-up, signals, --status
    client     RemoteBlockStore: a kv-server as a store (kv_store="unix:///path/kv.sock")
    redis_tier RedisTier: a Redis/Valkey tier below a pool (kv_store="redis://...", --redis)
    metrics    the kv-server's Prometheus metrics
    lmcache_plugin  the kv-server as LMCache's ``cxlalloc://`` remote-storage plugin (serving engines;
               needs ``cxlalloc[lmcache]``; not imported here)
    engines    the config lines that put a serving engine's KV on the kv-server / the CXL node
               (``cxlalloc info`` prints them; docs/engines.md)
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
    "RedisTier": "cxlalloc.kvstore.redis_tier",
    "KVServer": "cxlalloc.kvstore.server",
    "lmcache_yaml": "cxlalloc.kvstore.engines",
    "engine_lines": "cxlalloc.kvstore.engines",
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
