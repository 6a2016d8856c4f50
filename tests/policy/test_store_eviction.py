"""The store's eviction order (cxlalloc.policy.store_eviction) on plain objects: no store, no index."""

from __future__ import annotations

import pytest

from cxlalloc.policy.store_eviction import Lru, over_quota, victim


class Item:
    __slots__ = ("name", "prev", "next", "nprev", "nnext")

    def __init__(self, name):
        self.name = name
        self.prev = self.next = self.nprev = self.nnext = None


def names(lru):
    return [e.name for e in lru]


def test_oldest_first_and_a_use_moves_to_the_tail():
    lru = Lru()
    a, b, c = Item("a"), Item("b"), Item("c")
    for e in (a, b, c):
        lru.add(e)
    assert names(lru) == ["a", "b", "c"] and len(lru) == 3 and victim(lru) is a
    lru.remove(a)  # a hit: remove, add at the tail
    lru.add(a)
    assert names(lru) == ["b", "c", "a"] and victim(lru) is b
    lru.remove(c)  # the middle
    assert names(lru) == ["b", "a"] and c.prev is None and c.next is None
    lru.remove(a)  # the tail
    lru.remove(b)  # the last one
    assert names(lru) == [] and len(lru) == 0 and lru.head is None and lru.tail is None
    assert victim(lru) is None and victim(None) is None


def test_an_entry_in_two_lists_keeps_separate_links():
    everything, own = Lru(), Lru(("nprev", "nnext"))
    a, b, c = Item("a"), Item("b"), Item("c")
    for e in (a, b, c):
        everything.add(e)
    own.add(c)
    own.add(a)
    assert names(everything) == ["a", "b", "c"] and names(own) == ["c", "a"]
    own.remove(c)
    assert names(everything) == ["a", "b", "c"] and names(own) == ["a"]


def test_removing_while_iterating_past_an_entry():
    lru = Lru()
    items = [Item(i) for i in range(5)]
    for e in items:
        lru.add(e)
    for e in lru:
        if e.name % 2 == 0:
            lru.remove(e)
    assert names(lru) == [1, 3]


@pytest.mark.parametrize("ns_bytes,nbytes,quota,over", [
    (0, 100, None, False),      # no quota
    (0, 100, 100, False),       # exactly fits
    (1, 100, 100, True),        # one byte over
    (900, 100, 1000, False),
    (901, 100, 1000, True),
    (0, 0, 0, False),
])
def test_over_quota(ns_bytes, nbytes, quota, over):
    assert over_quota(ns_bytes, nbytes, quota) is over
