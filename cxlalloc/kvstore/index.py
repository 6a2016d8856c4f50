"""The index of the KV reuse store: which block lives where, in what state, and what to evict.

Pure bookkeeping (no memory, no torch): the in-process store
(:class:`cxlalloc.kvstore.LocalBlockStore`) and the kv-server use the same
:class:`BlockIndex` over their arenas, under their own lock.

Space
-----
The arena is cut into **chunks** of ``chunk_bytes`` (the unit of GPU
registration too).  A chunk, when first used, takes the size of the block
placed in it and holds ``chunk_bytes // block_bytes`` slots of that size (a
slab).  One model gives one block size, so a store of one model has no
fragmentation beyond the tail of each chunk (< one block); a chunk whose
blocks are all evicted returns to the free list and may take another size.

Invariants (checked by :meth:`BlockIndex.check`)::

    used_bytes      = sum(e.nbytes for e in entries)            (READY + WRITING)
    ns_bytes[ns]    = sum(e.nbytes for e in entries if e.ns == ns)
    chunk.used      = number of entries in the chunk
    a READY entry with pins == 0 is in lru[ns] and lru_class[nbytes]; no other is
    an entry is never evicted while pinned (read) or WRITING (written)

States: ``reserve()`` creates a WRITING entry owned by its writer, invisible to
``match()``; ``publish()`` makes it READY (visible); ``abort()`` or the writer's
death (:meth:`drop_owner`) frees it.  So a writer killed mid-write never leaves
a half-written block visible ("write, then publish").

Eviction: least recently used first (a hit or a publish is a use), never a
pinned or WRITING block; a namespace over its quota evicts its own blocks first
(LMCache's IsolatedLRU, docs/sources.md#kv-reuse).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, Hashable, List, Optional, Sequence

WRITING = "writing"
READY = "ready"


@dataclasses.dataclass(eq=False)
class Entry:
    """One block: ``nbytes`` bytes at ``offset`` of the arena."""

    key: bytes
    offset: int
    nbytes: int
    ns: str
    tokens: int
    state: str = WRITING
    pins: int = 0
    writer: Optional[Hashable] = None
    chunk: int = -1


class _Chunk:
    __slots__ = ("index", "offset", "size", "block_bytes", "free", "used")

    def __init__(self, index: int, offset: int, size: int):
        self.index, self.offset, self.size = index, offset, size
        self.block_bytes = 0
        self.free: List[int] = []
        self.used = 0


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


class BlockIndex:
    """Key -> block map with LRU eviction over a fixed arena.

    Args:
        capacity_bytes: bytes of the arena the store may use.
        chunk_bytes: slab size (bytes); a block larger than one chunk is refused.
        quotas: optional ``{namespace: bytes}`` limits.
        on_evict: called as ``on_evict(entry)`` for each READY block evicted,
            before its slot is reused (the remote tier copies it out here).

    Raises:
        ValueError: capacity or chunk size below one byte.
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int, quotas: Optional[Dict[str, int]] = None,
                 on_evict: Optional[Callable[[Entry], None]] = None):
        if capacity_bytes <= 0 or chunk_bytes <= 0:
            raise ValueError("cxlalloc.kvstore: capacity and chunk size must be > 0 bytes")
        self.capacity_bytes = int(capacity_bytes)
        self.chunk_bytes = int(min(chunk_bytes, capacity_bytes))
        self.quotas = dict(quotas or {})
        self.on_evict = on_evict
        n = -(-self.capacity_bytes // self.chunk_bytes)
        self._chunks = [_Chunk(i, i * self.chunk_bytes, min(self.chunk_bytes, self.capacity_bytes - i * self.chunk_bytes))
                        for i in range(n)]
        self._free_chunks: List[int] = list(range(n - 1, -1, -1))  # pop() takes the lowest address first
        self._open: Dict[int, List[int]] = collections.defaultdict(list)  # block size -> chunks with free slots
        self.entries: Dict[bytes, Entry] = {}
        self._lru_ns: Dict[str, "collections.OrderedDict[bytes, Entry]"] = collections.defaultdict(collections.OrderedDict)
        self._lru_size: Dict[int, "collections.OrderedDict[bytes, Entry]"] = collections.defaultdict(
            collections.OrderedDict)
        self._lru: "collections.OrderedDict[bytes, Entry]" = collections.OrderedDict()
        self._pins: Dict[Hashable, Dict[bytes, int]] = collections.defaultdict(dict)
        self.used_bytes = 0
        self.ns_bytes: Dict[str, int] = collections.defaultdict(int)
        self.c = IndexCounters()

    # ------------------------------------------------------------ sizes
    def largest_block(self) -> int:
        """The largest block this index can ever hold (bytes)."""
        return max(ch.size for ch in self._chunks)

    def check_block_bytes(self, nbytes: int, option: str = "kv_store_limit") -> None:
        """Raise ValueError naming ``option`` if a block of ``nbytes`` can never fit."""
        if nbytes > self.largest_block():
            raise ValueError(
                f"cxlalloc option '{option}': the store holds {self.capacity_bytes} bytes in chunks of "
                f"{self.chunk_bytes} bytes, smaller than one block of {nbytes} bytes; raise '{option}' or lower "
                "'block_tokens'")

    # ------------------------------------------------------------ LRU
    def _lru_add(self, e: Entry) -> None:
        self._lru[e.key] = e
        self._lru_ns[e.ns][e.key] = e
        self._lru_size[e.nbytes][e.key] = e

    def _lru_remove(self, e: Entry) -> None:
        self._lru.pop(e.key, None)
        self._lru_ns[e.ns].pop(e.key, None)
        self._lru_size[e.nbytes].pop(e.key, None)

    # ------------------------------------------------------------ reads
    def match(self, keys: Sequence[bytes], owner: Hashable) -> List[Entry]:
        """The longest prefix of ``keys`` whose blocks are READY, each pinned for
        ``owner`` (unpin with :meth:`unpin`) and marked as used."""
        self.c.lookups += 1
        self.c.lookup_blocks += len(keys)
        out = []
        for k in keys:
            e = self.entries.get(k)
            if e is None or e.state != READY:
                break
            out.append(e)
        for e in out:
            if e.pins == 0:
                self._lru_remove(e)
            e.pins += 1
            mine = self._pins[owner]
            mine[e.key] = mine.get(e.key, 0) + 1
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
            else:
                mine[e.key] = n - 1
            e.pins -= 1
            if e.pins == 0 and e.state == READY and self.entries.get(e.key) is e:
                self._lru_add(e)
        if not mine:
            self._pins.pop(owner, None)

    # ------------------------------------------------------------ writes
    def _take_slot(self, nbytes: int):
        chunks = self._open.get(nbytes)
        while chunks:
            ch = self._chunks[chunks[-1]]
            if ch.free:
                off = ch.free.pop()
                ch.used += 1
                if not ch.free:
                    chunks.pop()
                return ch, off
            chunks.pop()
        for i in range(len(self._free_chunks) - 1, -1, -1):
            ch = self._chunks[self._free_chunks[i]]
            if ch.size >= nbytes:
                del self._free_chunks[i]
                ch.block_bytes = nbytes
                slots = ch.size // nbytes
                ch.free = [ch.offset + s * nbytes for s in range(slots - 1, -1, -1)]
                off = ch.free.pop()
                ch.used = 1
                if ch.free:
                    self._open[nbytes].append(ch.index)
                return ch, off
        return None

    def _release_slot(self, e: Entry) -> None:
        ch = self._chunks[e.chunk]
        ch.used -= 1
        if ch.used == 0:
            # An empty chunk may take another block size next time.
            ch.free = []
            ch.block_bytes = 0
            lst = self._open.get(e.nbytes)
            if lst and ch.index in lst:
                lst.remove(ch.index)
            self._free_chunks.append(ch.index)
            self._free_chunks.sort(reverse=True)
        else:
            if not ch.free:
                self._open[e.nbytes].append(ch.index)
            ch.free.append(e.offset)

    def _forget(self, e: Entry) -> None:
        del self.entries[e.key]
        self._lru_remove(e)
        self.used_bytes -= e.nbytes
        self.ns_bytes[e.ns] -= e.nbytes
        self._release_slot(e)

    def _evict_from(self, lru) -> bool:
        for k, e in lru.items():  # oldest first; everything in an LRU is unpinned and READY
            if self.on_evict is not None:
                self.on_evict(e)
            self._forget(e)
            self.c.evicted_blocks += 1
            self.c.evicted_bytes += e.nbytes
            return True
        return False

    def _make_room(self, nbytes: int, ns: str):
        quota = self.quotas.get(ns)
        while quota is not None and self.ns_bytes[ns] + nbytes > quota:
            if not self._evict_from(self._lru_ns[ns]):
                return None
        while True:
            got = self._take_slot(nbytes)
            if got is not None:
                return got
            # Same-size blocks first (frees a slot at once), then the oldest of
            # any size (its chunk may empty and take this size).
            if not (self._evict_from(self._lru_size[nbytes]) or self._evict_from(self._lru)):
                return None

    def reserve(self, keys: Sequence[bytes], nbytes: int, ns: str, owner: Hashable,
                tokens: int = 0) -> List[Optional[Entry]]:
        """A WRITING entry for each key that is not stored yet (None for a key
        already stored or being written, or when no room can be made: the
        store is full of pinned/writing blocks, or the namespace's quota is).

        Raises:
            ValueError: ``nbytes`` exceeds the largest block the store can hold.
        """
        self.check_block_bytes(nbytes)
        out: List[Optional[Entry]] = []
        for k in keys:
            if k in self.entries:
                self.c.duplicate_blocks += 1
                out.append(None)
                continue
            got = self._make_room(nbytes, ns)
            if got is None:
                self.c.dropped_blocks += 1
                out.append(None)
                continue
            ch, off = got
            e = Entry(key=k, offset=off, nbytes=nbytes, ns=ns, tokens=tokens, writer=owner, chunk=ch.index)
            self.entries[k] = e
            self.used_bytes += nbytes
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
            e.state, e.writer = READY, None
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

    def drop_owner(self, owner: Hashable) -> None:
        """A reader/writer is gone (its connection closed, its process died):
        abort what it was writing and drop its pins."""
        writing = [e for e in self.entries.values() if e.state == WRITING and e.writer == owner]
        self.abort(writing, owner)
        mine = self._pins.pop(owner, {})
        for key, n in mine.items():
            e = self.entries.get(key)
            if e is None:
                continue
            e.pins -= n
            self.c.dropped_pins += n
            if e.pins == 0 and e.state == READY:
                self._lru_add(e)

    def clear(self, ns: Optional[str] = None) -> int:
        """Drop every READY, unpinned block (of namespace ``ns``).  Returns blocks dropped."""
        victims = [e for e in list((self._lru_ns[ns] if ns is not None else self._lru).values())]
        for e in victims:
            self._forget(e)
        return len(victims)

    # ------------------------------------------------------------ introspection
    def blocks(self) -> int:
        return sum(1 for e in self.entries.values() if e.state == READY)

    def check(self) -> None:
        """Verify the invariants of the module docstring; raise AssertionError."""
        assert self.used_bytes == sum(e.nbytes for e in self.entries.values()), "used_bytes"
        per_ns = collections.Counter()
        for e in self.entries.values():
            per_ns[e.ns] += e.nbytes
        for ns, b in self.ns_bytes.items():
            assert per_ns.get(ns, 0) == b, f"ns_bytes[{ns}]"
        used = collections.Counter(e.chunk for e in self.entries.values())
        for ch in self._chunks:
            assert ch.used == used.get(ch.index, 0), f"chunk {ch.index} used"
            assert ch.used + len(ch.free) == (ch.size // ch.block_bytes if ch.block_bytes else 0), \
                f"chunk {ch.index} slots"
        offsets = sorted((e.offset, e.nbytes) for e in self.entries.values())
        for (a, n), (b, _) in zip(offsets, offsets[1:]):
            assert a + n <= b, "overlapping blocks"
        for e in self.entries.values():
            in_lru = e.key in self._lru
            assert in_lru == (e.state == READY and e.pins == 0), f"lru membership of {e.key.hex()[:8]}"
        pins = collections.Counter()
        for mine in self._pins.values():
            for k, n in mine.items():
                pins[k] += n
        for e in self.entries.values():
            assert e.pins == pins.get(e.key, 0), "pin counts"
        assert self.used_bytes <= self.capacity_bytes, "over capacity"
        for ns, q in self.quotas.items():
            assert self.ns_bytes.get(ns, 0) <= q, f"namespace {ns} over quota"
