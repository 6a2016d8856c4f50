"""The block-store contract: what :mod:`cxlalloc.hf.reuse` may ask of a KV reuse store.

Every store (the in-process :class:`~cxlalloc.kvstore.local.LocalBlockStore`,
with or without a tier below it (:mod:`cxlalloc.kvstore.tiers`), and the kv-server client
:class:`~cxlalloc.kvstore.client.RemoteBlockStore`) implements
:class:`BlockStore`; ``kv_store=<an object>`` accepts any object that does
(checked with ``isinstance``).  A new store is one module implementing it
(usually by subclassing :class:`AccountedStore`) plus one parameter of
``tests/kvstore/test_store_contract.py``.

Words (CONTRIBUTING.md): a *block* is the K/V of ``block_tokens`` tokens of
every KV layer, laid out by :mod:`cxlalloc.kvstore.layout`; a *key* is its
32-byte chained key (:mod:`cxlalloc.kvstore.keys`); ``ns`` is the namespace
(``cache_salt``, ``""`` for none): a namespace only ever reaches its own blocks.

Lifetimes:

* A **lease** (from :meth:`BlockStore.lookup`) pins the blocks it found: no
  eviction touches them until :meth:`BlockLease.close` (or ``with`` exit, or
  garbage collection).  Its ``views`` are valid only until then.
* A **reservation** (from :meth:`BlockStore.reserve`) holds WRITING slots no
  reader sees.  :meth:`BlockReservation.commit` publishes them;
  :meth:`BlockReservation.abort` (also on ``with`` exit without a commit, or at
  garbage collection) frees them, so nothing half-written is ever visible.
  ``abort`` after ``commit`` does nothing.
* A store that cannot serve (a kv-server away, a Redis down) answers with an
  empty lease / a reservation without slots, warns once and counts it; it
  never raises into ``generate()`` for that.
"""

from __future__ import annotations

from typing import List, Protocol, Sequence, runtime_checkable

from cxlalloc.kvstore.counters import TRANSFER_FIELDS, StoreCounters

__all__ = ["BlockLease", "BlockReservation", "BlockStore", "AccountedStore", "TRANSFER_FIELDS", "hit_rate",
           "missing_members"]


@runtime_checkable
class BlockLease(Protocol):
    """Blocks found by :meth:`BlockStore.lookup`, pinned until :meth:`close`.

    ``views[i]`` is block ``i``'s bytes: a 1-D ``torch.uint8`` CPU tensor of
    the block's size (pinned or registered host memory on a GPU machine),
    ``blocks == len(views)``.  A context manager (``__exit__`` closes)."""

    views: List
    blocks: int

    def close(self) -> None:
        """Unpin the blocks; the views must not be used afterwards.  Idempotent."""

    def __enter__(self): ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class BlockReservation(Protocol):
    """Slots from :meth:`BlockStore.reserve`: write ``views[i]`` (a 1-D
    ``torch.uint8`` tensor of ``nbytes``; None where the key is stored already
    or no room was left), then :meth:`commit`.  ``slots`` counts the non-None
    views.  A context manager (``__exit__`` aborts unless committed)."""

    views: List
    slots: int

    def commit(self) -> int:
        """Publish the written blocks; returns how many became visible (0 when
        the store went away meanwhile).  Idempotent (a second call returns 0)."""

    def abort(self) -> None:
        """Free the slots without publishing anything; a no-op after :meth:`commit`."""

    def __enter__(self): ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class BlockStore(Protocol):
    """A store of KV blocks keyed by chained block keys.

    ``kind`` names the store in its stats (``"local"``, ``"server"``).
    """

    kind: str

    def lookup(self, ns: str, keys: Sequence[bytes]) -> BlockLease:
        """The longest stored prefix of ``keys`` (the block keys of one
        sequence, in order, 32 bytes each), pinned.  Counts ``lookups``,
        ``lookup_blocks`` and ``hit_blocks``.  Raises nothing for a store
        that is away (an empty lease)."""

    def reserve(self, ns: str, keys: Sequence[bytes], nbytes: int, tokens: int) -> BlockReservation:
        """WRITING slots of ``nbytes`` bytes (a block of ``tokens`` tokens) for
        each key not stored yet; least recently used blocks are evicted to
        make room, never a pinned or WRITING one.

        Raises:
            ValueError: one block can never fit (naming the option that sets
                the store's size: ``kv_store_limit``, or the server's ``--chunk``).
        """

    def discard(self, ns: str, keys: Sequence[bytes]) -> int:
        """Drop blocks whose checksum trailer (:mod:`cxlalloc.kvstore.layout`)
        failed on a reader's load: the store checks each of ``keys`` again and
        drops only the failing, unpinned ones (counted in ``corrupt_blocks``).
        Returns how many it dropped (0 for a store that is away); never raises
        for that.  :mod:`cxlalloc.hf.reuse` calls it after a failed load."""

    def check_block_bytes(self, nbytes: int) -> None:
        """Raise ValueError (naming the option) if a block of ``nbytes`` bytes can never fit."""

    def record_load(self, nbytes: int, seconds: float) -> None:
        """The caller copied ``nbytes`` bytes out of leases into a cache in ``seconds``."""

    def record_store(self, nbytes: int, seconds: float) -> None:
        """The caller copied ``nbytes`` bytes from a cache into reservations in ``seconds``."""

    def record_failure(self) -> None:
        """A load failed and the caller recomputed the prompt."""

    def stats(self) -> dict:
        """Counters (bytes, counts, seconds; GB/s = 1e9 bytes/s).  Every store
        has ``kind``, ``capacity_bytes``, ``used_bytes``, ``blocks``,
        ``hit_rate`` and the transfer fields (:data:`TRANSFER_FIELDS`,
        ``load_GBps``, ``store_GBps``)."""


def missing_members(obj) -> List[str]:
    """The :class:`BlockStore` members ``obj`` lacks (empty for a store)."""
    names = ("kind", "lookup", "reserve", "discard", "check_block_bytes", "record_load", "record_store",
             "record_failure", "stats")
    return [n for n in names if not hasattr(obj, n)]


class AccountedStore:
    """The accounting every store shares: :class:`StoreCounters` with the
    transfer fields plus the store's own ``names``, and the ``record_*``
    methods of :class:`BlockStore` over them.

    Subclasses call ``super().__init__(names)`` and count with
    ``self.counters.add(name, n)``; ``self.counters.snapshot()`` gives the
    transfer part of :meth:`BlockStore.stats`.
    """

    kind = "?"

    def __init__(self, names: Sequence[str] = ()):
        self.counters = StoreCounters(names)

    def record_load(self, nbytes: int, seconds: float) -> None:
        self.counters.record_load(nbytes, seconds)

    def record_store(self, nbytes: int, seconds: float) -> None:
        self.counters.record_store(nbytes, seconds)

    def record_failure(self) -> None:
        self.counters.record_failure()


def hit_rate(hit_blocks: int, lookup_blocks: int) -> float:
    """Hit blocks per looked-up block (0.0 before the first lookup)."""
    return hit_blocks / lookup_blocks if lookup_blocks else 0.0

