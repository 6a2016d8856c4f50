"""The index of the KV reuse store: which block lives where, in what state, and what to evict.

Pure bookkeeping (no memory, no torch): the in-process store
(:class:`cxlalloc.kvstore.LocalBlockStore`) and the kv-server use the same
:class:`BlockIndex` over their arenas, under their own lock.

Space
-----
The arena is cut into **chunks** of ``chunk_bytes`` (the unit of GPU
registration too; a block never straddles two).  A block takes a **slot** of
its size rounded up to the ``granule`` (the kv-server uses the page size, so
``reserve(nbytes=1)`` holds one 4 KiB slot).  A chunk is filled from its
bottom by a bump pointer (``top``): any block size may take the free tail of
any chunk, so one tiny block held in a chunk never closes the rest of it to
other sizes.  A slot freed below ``top`` is merged with the free extents
beside it (boundary maps: offset -> size and end -> offset) and kept on the
chunk's free list for its size; a free span that reaches ``top`` lowers
``top``; a chunk with no block left is reset (``top = 0``).  A block takes a
free extent of its exact size first, else the lowest chunk with a free span
that holds it (its smallest free extent that does, split, or its tail).  So
small blocks left pinned on top of every chunk (the pinned-top attack) leave
the bytes below them one free span each, open to any size, never slots of one
size only.  Nothing is built per slot or per byte: opening a chunk is O(1),
finding the lowest chunk with room for a block is O(log chunks) (a max segment
tree over each chunk's largest free span).

Every operation costs O(blocks it touches) or O(log chunks), never O(blocks
stored): the LRU lists are intrusive (links in the entries), each owner's
pins and WRITING blocks are kept per owner (so :meth:`BlockIndex.drop_owner`
touches only that owner's), and the counts that stats show are running
counters.  :meth:`BlockIndex.memory_per_block` reports the index's bytes per
stored block.

Invariants (checked by :meth:`BlockIndex.check`)::

    used_bytes      = sum(e.nbytes for e in entries)            (READY + WRITING)
    ns_bytes[ns]    = sum(e.nbytes for e in entries if e.ns == ns)
    chunk.used      = number of entries in the chunk; every slot below its top
    a READY entry with pins == 0 is in the LRU (and its namespace's, under a quota); no other is
    an entry is never evicted while pinned (read) or WRITING (written)

States: ``reserve()`` creates a WRITING entry owned by its writer, invisible to
``match()``; ``publish()`` makes it READY (visible); ``abort()`` or the writer's
death (:meth:`drop_owner`) frees it.  So a writer killed mid-write never leaves
a half-written block visible ("write, then publish").

Eviction: least recently used first (a hit or a publish is a use), never a
pinned or WRITING block; a namespace over its quota evicts its own blocks first
(LMCache's IsolatedLRU, docs/sources.md#kv-reuse).  The order and the choice
are :mod:`cxlalloc.policy.store_eviction`; this module keeps the lists current.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
from typing import Callable, Dict, Hashable, List, Optional, Sequence

from cxlalloc.kvstore.slots import ChunkSlots
from cxlalloc.policy.store_eviction import Lru, over_quota, victim

WRITING = "writing"
READY = "ready"


class Entry:
    """One block: ``nbytes`` bytes at ``offset`` of the arena (in a slot of
    ``BlockIndex.slot_size(nbytes)`` bytes, in chunk ``offset // chunk_bytes``).

    ``prev``/``next`` link it into the index's LRU (an intrusive list: no
    per-block dict entry for the LRU).  Its state is WRITING while it has a
    ``writer``, READY after.  Compact on purpose (``__slots__``, nothing
    derivable stored): the index holds one per block, up to millions.
    """

    __slots__ = ("key", "offset", "nbytes", "ns", "tokens", "pins", "writer", "prev", "next")

    def __init__(self, key: bytes, offset: int, nbytes: int, ns: str, tokens: int,
                 pins: int = 0, writer: Optional[Hashable] = None):
        self.key, self.offset, self.nbytes, self.ns, self.tokens = key, offset, nbytes, ns, tokens
        self.pins, self.writer = pins, writer
        self.prev = self.next = None

    @property
    def state(self) -> str:
        """WRITING (reserved, invisible) or READY (published)."""
        return WRITING if self.writer is not None else READY

    def __repr__(self) -> str:
        return f"Entry({self.key.hex()[:8]}, off={self.offset}, nbytes={self.nbytes}, {self.state}, pins={self.pins})"


class QuotaEntry(Entry):
    """An entry of a namespace with a quota: also linked into its namespace's
    LRU (``nprev``/``nnext``), which the quota evicts from first.  Entries of
    other namespaces do without the two links (16 bytes a block)."""

    __slots__ = ("nprev", "nnext")

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.nprev = self.nnext = None


@dataclasses.dataclass
class IndexCounters:
    """Counts kept by :class:`BlockIndex` (blocks; bytes where named)."""

    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    duplicate_blocks: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    dropped_blocks: int = 0
    aborted_blocks: int = 0
    dropped_pins: int = 0


class BlockIndex(ChunkSlots):
    """Key -> block map with LRU eviction over a fixed arena.

    Args:
        capacity_bytes: bytes of the arena the store may use.
        chunk_bytes: registration unit (bytes); a block larger than one chunk is refused.
        quotas: optional ``{namespace: bytes}`` limits.
        on_evict: called as ``on_evict(entry)`` for each READY block evicted,
            before its slot is reused (the remote tier copies it out here).
        granule: slot sizes are multiples of it (bytes; 1: exact sizes).

    Raises:
        ValueError: capacity, chunk size or granule below one byte.
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int, quotas: Optional[Dict[str, int]] = None,
                 on_evict: Optional[Callable[[Entry], None]] = None, granule: int = 1):
        if capacity_bytes <= 0 or chunk_bytes <= 0 or granule <= 0:
            raise ValueError("cxlalloc.kvstore: capacity, chunk size and granule must be > 0 bytes")
        self.capacity_bytes = int(capacity_bytes)
        self.chunk_bytes = int(min(chunk_bytes, capacity_bytes))
        self.granule = int(granule)
        self.quotas = dict(quotas or {})
        self.on_evict = on_evict
        self._init_slots(self.capacity_bytes, self.chunk_bytes)
        self.entries: Dict[bytes, Entry] = {}
        self._lru = Lru()
        self._lru_ns: Dict[str, Lru] = {}
        self._pins: Dict[Hashable, Dict[bytes, int]] = {}
        self._writing: Dict[Hashable, Dict[bytes, Entry]] = {}
        self._writing_bytes: Dict[Hashable, int] = {}
        self.used_bytes = 0
        self.slot_bytes = 0                       # bytes of slots taken (>= used_bytes: granule rounding)
        self.writing_blocks = 0
        self.pinned_blocks = 0                    # (owner, block) pins: a block pinned by two owners counts twice
        self.ns_bytes: Dict[str, int] = collections.defaultdict(int)
        self.c = IndexCounters()

    # ------------------------------------------------------------ sizes
    def largest_block(self) -> int:
        """The largest block this index can ever hold (bytes)."""
        return self._largest

    def slot_size(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` takes (rounded up to the granule)."""
        g = self.granule
        return -(-int(nbytes) // g) * g

    def check_block_bytes(self, nbytes: int, option: str = "kv_store_limit") -> None:
        """Raise ValueError naming ``option`` if a block of ``nbytes`` can never fit."""
        if self.slot_size(nbytes) > self._largest:
            raise ValueError(
                f"cxlalloc option '{option}': the store holds {self.capacity_bytes} bytes in chunks of "
                f"{self.chunk_bytes} bytes, smaller than one block of {nbytes} bytes; raise '{option}' or lower "
                "'block_tokens'")

    # ------------------------------------------------------------ LRU
    def _ns_lru(self, ns: str) -> Lru:
        lru = self._lru_ns.get(ns)
        if lru is None:
            lru = self._lru_ns[ns] = Lru(("nprev", "nnext"))
        return lru

    def _lru_add(self, e: Entry) -> None:
        self._lru.add(e)
        if type(e) is QuotaEntry:
            self._ns_lru(e.ns).add(e)

    def _lru_remove(self, e: Entry) -> None:
        self._lru.remove(e)
        if type(e) is QuotaEntry:
            lru = self._lru_ns[e.ns]
            lru.remove(e)
            if not lru.n:
                del self._lru_ns[e.ns]

    # ------------------------------------------------------------ reads
    def match(self, keys: Sequence[bytes], owner: Hashable, new_lookup: bool = True,
              budget: Optional[int] = None) -> List[Entry]:
        """The longest prefix of ``keys`` whose blocks are READY, each pinned for
        ``owner`` (unpin with :meth:`unpin`) and marked as used.  ``new_lookup``
        False: ``keys`` continue a lookup already counted (the kv-server
        matches a long lookup in slices, releasing its lock between them).
        ``budget``: slot bytes the prefix may take at most (the kv-server's
        ``--max-pinned``); it stops before the block that would pass it."""
        self.c.lookups += bool(new_lookup)
        self.c.lookup_blocks += len(keys)
        out = []
        get = self.entries.get
        left = budget
        for k in keys:
            e = get(k)
            if e is None or e.writer is not None:
                break
            if left is not None:
                left -= self.slot_size(e.nbytes)
                if left < 0:
                    break
            out.append(e)
        if out:
            mine = self._pins.get(owner)
            if mine is None:
                mine = self._pins[owner] = {}
            for e in out:
                if e.pins == 0:
                    self._lru_remove(e)
                e.pins += 1
                n = mine.get(e.key, 0)
                if not n:
                    self.pinned_blocks += 1
                mine[e.key] = n + 1
        self.c.hit_blocks += len(out)
        self.c.hit_tokens += sum(e.tokens for e in out)
        self.c.miss_blocks += len(keys) - len(out)
        return out

    def discard(self, keys: Sequence[bytes], corrupt: Callable[[Entry], bool]) -> int:
        """Drop the READY, unpinned entries of ``keys`` for which ``corrupt(entry)``
        is true (a reader found their checksum wrong; the store checks again, so
        no caller can drop a sound block).  Returns how many were dropped."""
        n = 0
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.state == READY and e.pins == 0 and corrupt(e):
                self._forget(e)
                n += 1
        return n

    def contains(self, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and e.state == READY

    def unpin(self, entries: Sequence[Entry], owner: Hashable) -> None:
        mine = self._pins.get(owner, {})
        for e in entries:
            n = mine.get(e.key, 0)
            if n <= 0 or e.pins <= 0:
                raise ValueError("cxlalloc.kvstore: unpin of a block this owner did not pin")
            if n == 1:
                del mine[e.key]
                self.pinned_blocks -= 1
            else:
                mine[e.key] = n - 1
            e.pins -= 1
            if e.pins == 0 and e.state == READY and self.entries.get(e.key) is e:
                self._lru_add(e)
        if not mine:
            self._pins.pop(owner, None)

    def _forget(self, e: Entry, keep_slot: bool = False) -> None:
        """Drop ``e`` from the index; its slot is freed unless ``keep_slot`` (the caller reuses it as is)."""
        del self.entries[e.key]
        if e.state == READY:
            if e.pins == 0:
                self._lru_remove(e)
        else:
            self._writing_done(e)
        self.used_bytes -= e.nbytes
        self.slot_bytes -= self.slot_size(e.nbytes)
        self.ns_bytes[e.ns] -= e.nbytes
        if not self.ns_bytes[e.ns]:
            del self.ns_bytes[e.ns]
        if not keep_slot:
            self._release_slot(e.offset, self.slot_size(e.nbytes))

    def _writing_done(self, e: Entry) -> None:
        w = e.writer
        mine = self._writing.get(w)
        if mine is not None and mine.pop(e.key, None) is not None:
            self.writing_blocks -= 1
            self._writing_bytes[w] -= self.slot_size(e.nbytes)
            if not mine:
                del self._writing[w]
                del self._writing_bytes[w]

    def _evict_from(self, lru: Optional[Lru]) -> bool:
        e = victim(lru)  # everything in an LRU is unpinned and READY
        if e is None:
            return False
        self._evict(e)
        return True

    def _evict(self, e: Entry, keep_slot: bool = False) -> None:
        if self.on_evict is not None:
            self.on_evict(e)
        self._forget(e, keep_slot)
        self.c.evicted_blocks += 1
        self.c.evicted_bytes += e.nbytes

    def _make_room(self, size: int, nbytes: int, ns: str):
        quota = self.quotas.get(ns)
        while over_quota(self.ns_bytes.get(ns, 0), nbytes, quota):
            if not self._evict_from(self._lru_ns.get(ns)):
                return None
        while True:
            got = self._take_slot(size)
            if got is not None:
                return got
            # The oldest block of any size: its slot is reused by its size, or
            # it was a chunk's top slot (the tail grows), or its chunk empties.
            e = victim(self._lru)
            if e is None:
                return None
            off = e.offset
            i = off // self.chunk_bytes
            if self.slot_size(e.nbytes) == size and off not in self._fend[i]:
                # A full pool's steady state: the victim's slot is taken as it is.  Freeing it and taking a slot
                # again would give this very slot (no slot of this size was free, and no free extent ends where
                # it starts, so it merges at most with one above it, which a take splits off again), at twice
                # the cost: 7.8 us a block of a 64-block reservation, most of the kv-server's time per insert.
                self._evict(e, keep_slot=True)
                return i, off
            self._evict(e)

    # ------------------------------------------------------------ writes
    def writing_bytes(self, owner: Hashable) -> int:
        """Slot bytes of the WRITING blocks of ``owner`` (a writer's reservation budget counts them)."""
        return self._writing_bytes.get(owner, 0)

    def reserve(self, keys: Sequence[bytes], nbytes: int, ns: str, owner: Hashable,
                tokens: int = 0) -> List[Optional[Entry]]:
        """A WRITING entry for each key that is not stored yet (None for a key
        already stored or being written, or when no room can be made: the
        store is full of pinned/writing blocks, or the namespace's quota is).

        Raises:
            ValueError: ``nbytes`` exceeds the largest block the store can hold.
        """
        self.check_block_bytes(nbytes)
        size = self.slot_size(nbytes)
        make = QuotaEntry if self.quotas.get(ns) is not None else Entry
        if owner is None:
            raise ValueError("cxlalloc.kvstore: a reservation needs an owner (None marks a READY block)")
        out: List[Optional[Entry]] = []
        for k in keys:
            if k in self.entries:
                self.c.duplicate_blocks += 1
                out.append(None)
                continue
            got = self._make_room(size, nbytes, ns)
            if got is None:
                self.c.dropped_blocks += 1
                out.append(None)
                continue
            _, off = got
            e = make(k, off, nbytes, ns, tokens, 0, owner)
            self.entries[k] = e
            mine = self._writing.get(owner)
            if mine is None:
                mine = self._writing[owner] = {}
                self._writing_bytes[owner] = 0
            mine[k] = e
            self._writing_bytes[owner] += size
            self.writing_blocks += 1
            self.used_bytes += nbytes
            self.slot_bytes += size
            self.ns_bytes[ns] += nbytes
            out.append(e)
        return out

    def publish(self, entries: Sequence[Entry], owner: Hashable) -> int:
        """Make written entries visible.  Returns how many were published
        (an entry no longer WRITING for ``owner`` is skipped)."""
        n = 0
        for e in entries:
            if e is None or self.entries.get(e.key) is not e or e.state != WRITING or e.writer != owner:
                continue
            self._writing_done(e)
            e.writer = None  # READY
            self._lru_add(e)
            self.c.stored_blocks += 1
            self.c.stored_bytes += e.nbytes
            n += 1
        return n

    def abort(self, entries: Sequence[Entry], owner: Hashable) -> None:
        """Free WRITING entries of ``owner`` without publishing them."""
        for e in entries:
            if e is not None and self.entries.get(e.key) is e and e.state == WRITING and e.writer == owner:
                self._forget(e)
                self.c.aborted_blocks += 1

    def drop_owner(self, owner: Hashable, budget: Optional[int] = None) -> bool:
        """A reader/writer is gone (its connection closed, its process died):
        abort what it was writing and drop its pins.  O(its blocks), not O(blocks stored).

        Args:
            budget: at most this many of its blocks now (None: all); call
                again until it returns True, so a caller can release its lock
                between calls (a client of 65,536 blocks is dropped in slices).

        Returns:
            True when nothing of ``owner`` is left.
        """
        left = budget if budget is not None else 1 << 62
        writing = self._writing.get(owner)
        if writing:
            part = list(itertools.islice(writing.values(), left))
            self.abort(part, owner)
            left -= len(part)
            if owner in self._writing:
                return False
        mine = self._pins.get(owner)
        if mine is None:
            return True
        while mine and left > 0:
            key, n = mine.popitem()
            left -= 1
            self.pinned_blocks -= 1
            e = self.entries.get(key)
            if e is None:
                continue
            e.pins -= n
            self.c.dropped_pins += n
            if e.pins == 0 and e.state == READY:
                self._lru_add(e)
        if mine:
            return False
        del self._pins[owner]
        return True

    def clear(self, ns: Optional[str] = None) -> int:
        """Drop every READY, unpinned block (of namespace ``ns``).  Returns blocks dropped."""
        victims = [e for e in self._lru if ns is None or e.ns == ns]  # an operator's command: one pass
        for e in victims:
            self._forget(e)
        return len(victims)

    # ------------------------------------------------------------ introspection
    def blocks(self) -> int:
        """READY blocks (a running count)."""
        return len(self.entries) - self.writing_blocks

    def memory_per_block(self) -> float:
        """Bytes of index memory per stored block (0.0 when empty).

        Measured from the objects' sizes (``sys.getsizeof``: the entry with
        its GC header, its key, its offset (an int object), and its share of
        the ``entries`` hash table); the LRU links live in the entry.  Pins
        and WRITING blocks add per-owner dict entries while held (not counted:
        they are transient)."""
        n = len(self.entries)
        if not n:
            return 0.0
        e = self._lru.tail or next(iter(self.entries.values()))
        per = sys.getsizeof(e) + sys.getsizeof(e.key) + (sys.getsizeof(e.offset) if e.offset > 256 else 0)
        return sys.getsizeof(self.entries) / n + per

    def check(self) -> None:
        """Verify the invariants of the module docstring; raise AssertionError (:func:`check_invariants`)."""
        check_invariants(self)



def check_invariants(index: "BlockIndex") -> None:
    """Verify the invariants of the module docstring on ``index``; raise AssertionError naming the one broken."""
    es = list(index.entries.values())
    assert index.used_bytes == sum(e.nbytes for e in es), "used_bytes"
    assert index.slot_bytes == sum(index.slot_size(e.nbytes) for e in es), "slot_bytes"
    per_ns = collections.Counter()
    for e in es:
        per_ns[e.ns] += e.nbytes
    for ns, b in index.ns_bytes.items():
        assert per_ns.get(ns, 0) == b, f"ns_bytes[{ns}]"
    used = collections.Counter(e.offset // index.chunk_bytes for e in es)
    free_by_chunk = collections.defaultdict(list)
    for i, free in enumerate(index._free):
        for s, offs in (free or {}).items():
            assert offs and i in index._open.get(s, {}), f"chunk {i} free list of {s}"
            free_by_chunk[i] += [(o, s) for o in offs]
    for s, chunks in index._open.items():
        for i in chunks:
            assert index._free[i] and index._free[i].get(s), f"open list of {s} names chunk {i}"
    for i in range(len(index._csize)):
        assert index._used[i] == used.get(i, 0), f"chunk {i} used"
        assert 0 <= index._top[i] <= index._csize[i], f"chunk {i} top"
        assert index._tails.t[index._tails.p + i] == index._chunk_room(i), f"chunk {i} room"
        ext = sorted(index._fstart[i].items())
        assert ext == sorted((o, s) for o, s in free_by_chunk.get(i, [])), f"chunk {i} extents"
        assert index._fend[i] == {o + s: o for o, s in ext}, f"chunk {i} extent ends"
        for (a, n), (b, _) in zip(ext, ext[1:]):
            assert a + n < b, f"chunk {i}: free extents at {a} and {b} not merged"
        assert all(o + s < i * index.chunk_bytes + index._top[i] for o, s in ext), f"chunk {i}: free extent at top"
        if index._used[i] == 0:
            assert index._top[i] == 0 and not index._free[i], f"empty chunk {i} not reset"
    spans = sorted([(e.offset, index.slot_size(e.nbytes), e.offset // index.chunk_bytes) for e in es]
                   + [(o, s, i) for i, lst in free_by_chunk.items() for o, s in lst])
    for a, n, i in spans:
        base = i * index.chunk_bytes
        assert base <= a and a + n <= base + index._top[i], "slot outside its chunk's used part"
    for (a, n, _), (b, _, _) in zip(spans, spans[1:]):
        assert a + n <= b, "overlapping slots"
    in_lru = set(id(e) for e in index._lru)
    assert len(in_lru) == index._lru.n, "lru length"
    for e in es:
        assert (id(e) in in_lru) == (e.state == READY and e.pins == 0), f"lru membership of {e.key.hex()[:8]}"
    assert sum(lru.n for lru in index._lru_ns.values()) == sum(type(e) is QuotaEntry for e in index._lru), \
        "namespace lru lengths"
    pins = collections.Counter()
    for mine in index._pins.values():
        for k, n in mine.items():
            pins[k] += n
    assert index.pinned_blocks == sum(len(m) for m in index._pins.values()), "pinned_blocks"
    for e in es:
        assert e.pins == pins.get(e.key, 0), "pin counts"
    writing = [e for e in es if e.state == WRITING]
    assert index.writing_blocks == len(writing) == sum(len(m) for m in index._writing.values()), "writing"
    for e in writing:
        assert index._writing[e.writer][e.key] is e, "writing owner"
    for w, mine in index._writing.items():
        assert index._writing_bytes[w] == sum(index.slot_size(e.nbytes) for e in mine.values()), "writing bytes"
    assert index.used_bytes <= index.capacity_bytes, "over capacity"
    for ns, q in index.quotas.items():
        assert index.ns_bytes.get(ns, 0) <= q, f"namespace {ns} over quota"
