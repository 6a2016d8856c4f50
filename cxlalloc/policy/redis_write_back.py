"""When a pool's block is written down to the tier below it (Redis/Valkey): on eviction or on commit.

The decision of the kv-server's :class:`~cxlalloc.kvstore.server.jobs.RedisLink`
(``cxlalloc kv-server --redis-mode``) and of the in-process store
(:class:`~cxlalloc.kvstore.local.LocalBlockStore` with a tier below: always
``evict``).  Pure: no I/O, nothing of the project imported
(``tests/policy/test_redis_write_back.py``).

* ``evict`` (write-back): a block is written down when the pool evicts it, so
  the tier holds what the pool no longer does; a block never evicted is never
  sent (the cheapest on the network; lost with the pool if the server dies).
* ``through`` (write-through): every committed block is written down at once,
  so the tier holds everything the pool does (a restarted or second server
  finds it); eviction then sends nothing more.
"""

from __future__ import annotations

__all__ = ["MODES", "check_mode", "write_on_commit", "write_on_evict"]

MODES = ("evict", "through")


def check_mode(mode: str, option: str = "--redis-mode") -> str:
    """``mode`` when it is one of :data:`MODES`.

    Raises:
        ValueError: naming ``option`` and the allowed values.
    """
    if mode not in MODES:
        raise ValueError(f"cxlalloc option '{option}': {mode!r} is not allowed; allowed: {', '.join(MODES)}")
    return mode


def write_on_commit(mode: str) -> bool:
    """True when a block is written to the tier as it is committed (``through``)."""
    return mode == "through"


def write_on_evict(mode: str) -> bool:
    """True when a block is written to the tier as the pool evicts it (``evict``)."""
    return mode == "evict"
