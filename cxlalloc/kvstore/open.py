"""``kv_store=...``: from an option value to a block store.

| value | store |
|---|---|
| ``True``, ``"local"`` | a :class:`~cxlalloc.kvstore.local.LocalBlockStore` in this process, on the allocator's host node |
| ``"unix:///path/kv.sock"`` | a client of a ``cxlalloc kv-server`` on this machine (one pool for every process) |
| ``"redis://host:port/db"``, ``"rediss://..."`` | a local store with a Redis/Valkey tier below it |
| a :class:`~cxlalloc.kvstore.store.BlockStore` | that store, shared (e.g. by several wrapped models) |
"""

from __future__ import annotations

from cxlalloc.kvstore.local import LocalBlockStore
from cxlalloc.kvstore.store import BlockStore, missing_members

SPEC_HELP = ("True or 'local' (in this process), 'unix:///path/kv.sock' (a cxlalloc kv-server), "
             "'redis://host:port/db' (a local store with Redis below), or a store object")


def is_store(obj) -> bool:
    """Whether ``obj`` implements :class:`~cxlalloc.kvstore.store.BlockStore`."""
    return isinstance(obj, BlockStore)


def open_store(spec, allocator, limit=None):
    """The block store ``spec`` names (see the module table).

    Raises:
        ValueError: an unknown spec, naming ``kv_store`` and the allowed values;
            an object that is only part of a store (naming what it lacks);
            a bad ``kv_store_limit``.
    """
    if is_store(spec):
        return spec
    if not isinstance(spec, (str, bool)) and spec is not None and hasattr(spec, "lookup"):
        raise ValueError(f"cxlalloc option 'kv_store': {type(spec).__name__} is not a block store: it lacks "
                         f"{', '.join(missing_members(spec))} (the contract: cxlalloc.kvstore.store.BlockStore; "
                         "subclass cxlalloc.kvstore.store.AccountedStore for the record_* methods)")
    if spec is True or (isinstance(spec, str) and spec.strip().lower() in ("local", "1", "true", "on")):
        return LocalBlockStore(allocator, limit)
    if isinstance(spec, str) and spec.startswith("unix://"):
        from cxlalloc.kvstore.client import RemoteBlockStore

        if limit is not None:
            raise ValueError(f"cxlalloc option 'kv_store_limit': {limit!r} has no effect with a kv-server (its --size "
                             f"sets the pool); drop it, or add '?fallback=SIZE' to {spec!r} for a local tier used "
                             "while the server is away")

        return RemoteBlockStore(spec, allocator)
    if isinstance(spec, str) and spec.startswith(("redis://", "rediss://")):
        from cxlalloc.kvstore.tiers.redis import RedisTier

        return LocalBlockStore(allocator, limit, lower=RedisTier(spec, option="kv_store"))
    raise ValueError(f"cxlalloc option 'kv_store': {spec!r} is not allowed; use {SPEC_HELP}")
