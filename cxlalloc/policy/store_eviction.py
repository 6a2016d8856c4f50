"""Which KV block a store evicts: least recently used first, a namespace over its quota first from its own.

The decision of :class:`cxlalloc.kvstore.index.BlockIndex` (the in-process
store's and the kv-server's index), kept here as plain data structures and
functions: no I/O, no clock, nothing of the project imported, so it is
unit-tested directly (``tests/policy/test_store_eviction.py``).

* The order is an intrusive doubly-linked list (:class:`Lru`): the links live
  in the entries (two attributes each), so add, remove and "oldest" are O(1)
  and nothing is allocated per block.  A use (a hit, a publish) moves an entry
  to the tail: the caller removes and adds it.
* Only unpinned, READY blocks are in an LRU (the index's invariant), so the
  victim is always :func:`victim` of the list: its head.
* A namespace with a quota (``--quota``; LMCache's IsolatedLRU,
  docs/sources.md#kv-reuse) evicts its own oldest blocks while
  :func:`over_quota`; only then is the global list asked for room.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

__all__ = ["Lru", "victim", "over_quota"]


class Lru:
    """An intrusive doubly-linked list of entries, oldest first (O(1) add, remove, oldest).

    Args:
        links: the names of the two link attributes every entry has
            (``("prev", "next")``; an entry in two lists, the global one and its
            namespace's, has a second pair, e.g. ``("nprev", "nnext")``).
    """

    __slots__ = ("head", "tail", "n", "_p", "_n")

    def __init__(self, links=("prev", "next")):
        self.head = self.tail = None
        self.n = 0
        self._p, self._n = links

    def add(self, e: Any) -> None:
        """Append ``e`` as the newest (its links must be unset)."""
        p, n = self._p, self._n
        setattr(e, p, self.tail)
        setattr(e, n, None)
        if self.tail is None:
            self.head = e
        else:
            setattr(self.tail, n, e)
        self.tail = e
        self.n += 1

    def remove(self, e: Any) -> None:
        """Unlink ``e`` (which must be in this list)."""
        p, n = self._p, self._n
        a, b = getattr(e, p), getattr(e, n)
        if a is None:
            self.head = b
        else:
            setattr(a, n, b)
        if b is None:
            self.tail = a
        else:
            setattr(b, p, a)
        setattr(e, p, None)
        setattr(e, n, None)
        self.n -= 1

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        """Oldest first; an entry may be removed while iterating past it."""
        e, n = self.head, self._n
        while e is not None:
            nxt = getattr(e, n)
            yield e
            e = nxt


def victim(lru: Optional[Lru]) -> Optional[Any]:
    """The entry to evict from ``lru`` (its oldest), or None when there is none (no list, or empty)."""
    return lru.head if lru is not None else None


def over_quota(ns_bytes: int, nbytes: int, quota: Optional[int]) -> bool:
    """True when a namespace holding ``ns_bytes`` bytes cannot add a block of
    ``nbytes`` bytes under its ``quota`` (bytes; None: no quota) and must evict
    its own blocks first."""
    return quota is not None and ns_bytes + nbytes > quota
