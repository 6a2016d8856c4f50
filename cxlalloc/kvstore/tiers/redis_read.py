"""The Redis tier's bounded reads (:class:`~cxlalloc.kvstore.tiers.redis.RedisTier`'s
``get_many_ns_tokens``; module level so the tier's class and module stay small).

Each value is read with ``GETRANGE`` up to ``limit + 1`` bytes (its header,
``max_value_bytes`` and a MAC: a planted huge value is never read whole and is
counted in ``too_large_values``), on one server in pipelined batches of
``batch_keys``, on a cluster with one pipeline per primary
(:meth:`~cxlalloc.kvstore.tiers.redis_cluster.ClusterRouter.get_status`); the
whole read has a deadline (:func:`_expire` closes the connections in use).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, List, Optional, Sequence

from cxlalloc.kvstore.tiers.redis_format import HEADER_BYTES, _length, value_problem, value_tokens

if TYPE_CHECKING:
    from cxlalloc.kvstore.tiers.redis import RedisTier

log = logging.getLogger("cxlalloc.kvstore.redis")


def _expire(tier: "RedisTier", expired: threading.Event) -> None:
    """A read's deadline passed: close every connection of ``tier`` (in use too; a
    cluster's on every node) so the blocked read fails."""
    expired.set()
    with tier._lock:
        tier.c["deadline_expired"] += 1
    try:
        if tier._cluster is not None:
            _disconnect_cluster(tier._cluster)
        else:
            tier._r.connection_pool.disconnect(inuse_connections=True)
    except Exception:  # closing is best effort: the read fails on its own timeout then
        pass


def _disconnect_cluster(router) -> None:
    """Close every node's connections of a :class:`~cxlalloc.kvstore.tiers.redis_cluster.ClusterRouter`,
    those in use too (the reads blocked on them fail at once)."""
    rc = router._rc
    if rc is None:
        return
    for node in [rc.node] if router.standalone else rc.get_nodes():
        conn = rc.get_redis_connection(node)
        if conn is not None:
            conn.connection_pool.disconnect(inuse_connections=True)


def _accept(tier: "RedisTier", k: bytes, v: Optional[bytes], limit: int) -> Optional[bytes]:
    """The block bytes of value ``v`` (read with ``GETRANGE`` up to ``limit + 1``
    bytes) of namespaced key ``k``, or None: missing; too large, bad or forged
    (counted, a forged one warned about once)."""
    problem = "too_large" if v is not None and len(v) > limit else value_problem(k, v or None, tier._mac_key)
    if problem is None:
        return v[HEADER_BYTES:HEADER_BYTES + _length(v)]
    if problem != "missing":
        with tier._lock:
            tier.c["forged_values" if problem == "forged" else "bad_values"] += 1
            tier.c["too_large_values"] += problem == "too_large"
        if problem == "forged" and not tier._warned_forged:
            tier._warned_forged = True
            log.warning("cxlalloc kv: a Redis value without a valid MAC was refused (key "
                        "%s...; counted in forged_values; said once)", tier._rkey(k)[:40])
    return None


def _read_cluster(tier: "RedisTier", nskeys: Sequence[bytes], out: List[Optional[tuple]], limit: int):
    """Fill ``out`` with the longest sound prefix of ``nskeys`` read from a
    cluster in one call (one pipeline of ``GETRANGE`` up to ``limit + 1``
    bytes per primary).  Returns (blocks, bytes, [nodes answered, failed])."""
    got = nbytes = 0
    values, answered, failed = tier._cluster.get_status([tier._rkey(k) for k in nskeys], limit)
    for i, (k, v) in enumerate(zip(nskeys, values)):
        data = _accept(tier, k, v, limit)
        if data is None:
            break
        out[i] = (data, value_tokens(v))
        got += 1
        nbytes += len(data)
    return got, nbytes, [answered, failed]


def _read_prefix(tier: "RedisTier", nskeys: Sequence[bytes], out: List[Optional[tuple]], limit: int,
                 expired: threading.Event):
    """Fill ``out`` with the values of the longest sound prefix of ``nskeys``,
    read ``tier.batch_keys`` at a time with pipelined ``GETRANGE`` of at most
    ``limit + 1`` bytes each (a longer value is refused, never read whole).
    Returns (blocks, bytes) found; counts refused values on ``tier``.

    Raises:
        TimeoutError: ``expired`` was set (the read's deadline) between batches.
        redis.RedisError / OSError: from the connection (closed at the deadline).
    """
    got = nbytes = 0
    for i in range(0, len(nskeys), tier.batch_keys):
        if expired.is_set():
            raise TimeoutError(f"the Redis read passed its {tier.timeout:g} s deadline (--redis-timeout)")
        part = nskeys[i:i + tier.batch_keys]
        pipe = tier._r.pipeline(transaction=False)
        for k in part:
            pipe.getrange(tier._rkey(k), 0, limit)  # at most limit + 1 bytes, whatever is stored
        for j, (k, v) in enumerate(zip(part, pipe.execute())):
            data = _accept(tier, k, v, limit)
            if data is None:
                return got, nbytes
            out[i + j] = (data, value_tokens(v))
            got += 1
            nbytes += len(data)
    return got, nbytes
