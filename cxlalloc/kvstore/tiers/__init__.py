"""The tier below a pool: the :class:`Tier` contract, and the tiers that implement it.

A *pool* (the in-process :class:`~cxlalloc.kvstore.local.LocalBlockStore`'s
arena, or a kv-server's shared pool) keeps KV blocks in host memory.  A
*tier below* it keeps more of them further away (Redis/Valkey today): blocks
the pool evicts (or, with ``--redis-mode through``, every committed block) are
written down to it, and a block the pool misses is read back from it before it
is recomputed.  Both sides use exactly this contract:

* :class:`~cxlalloc.kvstore.local.LocalBlockStore` (``lower=``): ``put`` on
  eviction, ``get_many`` on a miss, ``stats``, ``close``;
* the kv-server's :class:`~cxlalloc.kvstore.server.jobs.RedisLink`:
  ``put_ns``, ``get_many_ns`` (keys already namespaced), ``down``, ``stats``.

Modules:
    redis         RedisTier: Redis/Valkey (``kv_store="redis://..."``, ``kv-server --redis``)
    redis_format  its value format (header, CRC, MAC), URL options and key file

A new tier is one module here subclassing :class:`Tier`, plus one parameter of
``tests/kvstore/tiers/test_tier_contract.py`` (CONTRIBUTING.md, "Where new code goes").
"""

from __future__ import annotations

import abc
from typing import List, Optional, Sequence

from cxlalloc.kvstore.keys import namespaced_key

__all__ = ["Tier", "STATS_KEYS"]

#: Keys every tier's :meth:`Tier.stats` has (a tier may add its own).
STATS_KEYS = ("kind", "up", "last_error", "lookups", "lookup_blocks", "hit_blocks", "hit_bytes", "hit_rate",
              "queued_blocks", "put_blocks", "put_bytes", "dropped_blocks", "used_bytes", "capacity_bytes")


class Tier(abc.ABC):
    """A store of block bytes below a pool, addressed by namespaced keys.

    **Keys.**  A block is named by its *namespaced key*: 32 bytes,
    :func:`cxlalloc.kvstore.keys.namespaced_key` of the namespace (``ns``,
    ``""`` for none) and the block's chained key, so two namespaces never
    share a value and one block has one name in every process and machine.
    :meth:`put` / :meth:`get_many` take ``(key, ns)`` and namespace it
    (within :attr:`tenant`);
    :meth:`put_ns` / :meth:`get_many_ns` take namespaced keys (the kv-server's
    index holds those).

    **Sizes.**  A tier stores the bytes it was given, any length (a pool's
    block: ``block_tokens`` tokens of every KV layer, or an LMCache chunk
    slot), and returns exactly those bytes or nothing; it never returns bytes
    of another key, a truncated value or (where it authenticates values) a
    forged one.  ``used_bytes`` / ``capacity_bytes`` in :meth:`stats` are the
    tier's own (None while unknown; capacity 0 means no limit).

    **A miss.**  :meth:`get_many` returns one entry per key, in order: the
    bytes of each key up to the first one it does not have (missing, expired,
    corrupt, refused), and None from there on, since only a prefix of a
    sequence's blocks is usable by a caller.

    **A down tier.**  A tier that cannot be reached answers misses (reads)
    and drops or queues (writes); it never raises for that and never blocks a
    caller beyond its own timeout.  :meth:`down` is True while it knows it is
    unreachable (e.g. during a reconnect backoff): reads then return misses
    at once.  Failures are counted in :meth:`stats` (``up``, ``last_error``).

    **Writes never block.**  :meth:`put` is called with the pool's lock held,
    before the evicted slot is reused: it must copy nothing it was not given
    and wait for no I/O; it queues (bounded) and a writer sends later.  It
    returns False when the block was dropped (queue full, closed).
    :meth:`flush` waits for what is queued.

    **Thread-safety.**  Every method may be called from any thread, at the same
    time as any other (a kv-server's connections, a store's readers and its
    eviction path); :meth:`close` may race with them: calls after it never
    raise, writes after it are dropped (False).

    **Errors.**  The constructor raises ValueError naming the option for a bad
    setting and ImportError naming the package to install; after that no
    method raises for the tier's own failures.
    """

    #: The tier's name in stats (``"redis"``).
    kind: str = "?"
    #: The tenant whose blocks :meth:`put`/:meth:`get_many` name (``""``: the
    #: single tenant); the names a kv-server's tenant of that name gives its blocks.
    tenant: str = ""

    # ------------------------------------------------------------ writes
    @abc.abstractmethod
    def put_ns(self, nskey: bytes, data, tokens: int = 0) -> bool:
        """Queue ``data`` (bytes-like; it must not change after the call:
        pass ``bytes``) under namespaced key ``nskey`` (32 bytes); False when
        dropped (queue full or tier closed).  ``tokens``: the tokens the block
        holds, kept where the tier can (:meth:`get_many_ns_tokens` returns it,
        so a restored block counts its tokens; 0 = unknown).  Never blocks on
        I/O, never raises."""

    def put(self, key: bytes, ns: str, data, tokens: int = 0) -> bool:
        """:meth:`put_ns` of block ``key`` (32-byte chained key) in namespace ``ns``."""
        return self.put_ns(namespaced_key(ns, key, self.tenant), data, tokens)

    @abc.abstractmethod
    def flush(self, timeout: float = 5.0) -> bool:
        """Wait up to ``timeout`` seconds until every queued block was sent
        (or dropped); False on timeout."""

    # ------------------------------------------------------------ reads
    @abc.abstractmethod
    def get_many_ns(self, nskeys: Sequence[bytes]) -> List[Optional[bytes]]:
        """The bytes of each namespaced key, in order, None from the first miss
        on (a list of ``len(nskeys)``).  Never raises; all None while :meth:`down`."""

    def get_many(self, keys: Sequence[bytes], ns: str = "") -> List[Optional[bytes]]:
        """:meth:`get_many_ns` of block ``keys`` (one sequence's chained keys,
        in order) in namespace ``ns``."""
        return self.get_many_ns([namespaced_key(ns, k, self.tenant) for k in keys])

    def get_many_ns_tokens(self, nskeys: Sequence[bytes]) -> List[Optional[tuple]]:
        """:meth:`get_many_ns` with each block's tokens as given to :meth:`put_ns`:
        ``(bytes, tokens)`` or None (tokens 0 where the tier does not keep them:
        this default)."""
        return [None if v is None else (v, 0) for v in self.get_many_ns(nskeys)]

    def get_many_tokens(self, keys: Sequence[bytes], ns: str = "") -> List[Optional[tuple]]:
        """:meth:`get_many_ns_tokens` of block ``keys`` in namespace ``ns``."""
        return self.get_many_ns_tokens([namespaced_key(ns, k, self.tenant) for k in keys])

    # ------------------------------------------------------------ state
    @abc.abstractmethod
    def down(self) -> bool:
        """True while the tier knows it is unreachable (reads are misses then, at once)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Counters (blocks, bytes, seconds) and state, without I/O; has at
        least :data:`STATS_KEYS` (``up`` None until the first operation)."""

    @abc.abstractmethod
    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout`` s), stop the tier's threads and
        close its connections.  Idempotent."""
