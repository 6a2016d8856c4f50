"""Where blocks go in the KV reuse store's arena: chunks, slots and free spans.

:class:`ChunkSlots` is the space half of :class:`cxlalloc.kvstore.index.BlockIndex`
(which documents the scheme, "Space"): each chunk filled from its bottom by a
bump pointer (``top``); a freed slot merged with the free extents beside it
(boundary maps: offset -> size and end -> offset), kept on the chunk's free
list for its size, or given back to the tail; a max segment tree
(:class:`_TailTree`) over each chunk's largest free span finds the lowest
chunk with room in O(log chunks).  Pure bookkeeping: offsets and sizes only.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence


class _TailTree:
    """A max segment tree over the chunks' free tails: the lowest chunk whose
    tail holds ``n`` bytes in O(log chunks)."""

    __slots__ = ("p", "t")

    def __init__(self, tails: Sequence[int]):
        p = 1
        while p < len(tails):
            p *= 2
        self.p = p
        self.t = [0] * (2 * p)
        self.t[p:p + len(tails)] = list(tails)
        for i in range(p - 1, 0, -1):
            self.t[i] = max(self.t[2 * i], self.t[2 * i + 1])

    def set(self, i: int, v: int) -> None:
        i += self.p
        t = self.t
        t[i] = v
        i //= 2
        while i:
            m = max(t[2 * i], t[2 * i + 1])
            if t[i] == m:
                break
            t[i] = m
            i //= 2

    def first_fit(self, n: int) -> int:
        """The lowest chunk index whose tail is >= ``n`` bytes, or -1."""
        t = self.t
        if t[1] < n:
            return -1
        i = 1
        while i < self.p:
            i = 2 * i if t[2 * i] >= n else 2 * i + 1
        return i - self.p


class ChunkSlots:
    """Slots of the chunks of an arena (a base of :class:`~cxlalloc.kvstore.index.BlockIndex`).

    State per chunk ``i``: ``_csize[i]`` bytes, ``_top[i]`` (bytes below the
    bump pointer), ``_used[i]`` (slots taken), ``_free[i]`` (free extent size
    -> offsets below ``top``, None when none), ``_fstart[i]``/``_fend[i]`` (the
    same extents by start and by end, for merging); ``_open`` (extent size ->
    chunks with one of that size) and ``_tails`` (each chunk's largest free span).
    """

    def _init_slots(self, capacity_bytes: int, chunk_bytes: int) -> None:
        """Empty chunks of ``chunk_bytes`` over ``capacity_bytes`` (the last may be smaller)."""
        n = -(-capacity_bytes // chunk_bytes)
        self._csize = [min(chunk_bytes, capacity_bytes - i * chunk_bytes) for i in range(n)]
        self._top = [0] * n                       # bytes of the chunk below its bump pointer
        self._used = [0] * n                      # slots taken in the chunk
        self._free: List[Optional[Dict[int, Dict[int, None]]]] = [None] * n  # extent size -> free offsets below top
        self._fstart: List[Dict[int, int]] = [{} for _ in range(n)]    # free extent: offset -> size
        self._fend: List[Dict[int, int]] = [{} for _ in range(n)]      # free extent: end -> offset
        self._open: Dict[int, Dict[int, None]] = {}                    # extent size -> chunks with one
        self._tails = _TailTree(self._csize)
        self._largest = max(self._csize)

    def _chunk_room(self, i: int) -> int:
        """The largest free span of chunk ``i`` (bytes): its tail or its largest free extent."""
        free = self._free[i]
        tail = self._csize[i] - self._top[i]
        return max(tail, max(free)) if free else tail

    def _extent_add(self, i: int, off: int, size: int) -> None:
        free = self._free[i]
        if free is None:
            free = self._free[i] = {}
        offs = free.get(size)
        if offs is None:
            offs = free[size] = {}
            self._open.setdefault(size, {})[i] = None
        offs[off] = None
        self._fstart[i][off] = size
        self._fend[i][off + size] = off

    def _extent_remove(self, i: int, off: int, size: int) -> None:
        free = self._free[i]
        offs = free[size]
        del offs[off]
        if not offs:
            del free[size]
            chunks = self._open[size]
            del chunks[i]
            if not chunks:
                del self._open[size]
            if not free:
                self._free[i] = None
        del self._fstart[i][off]
        del self._fend[i][off + size]

    def _take_slot(self, size: int):
        """(chunk, offset) of a free slot of ``size`` bytes, or None.

        A free extent of exactly ``size`` first (any chunk); else the lowest
        chunk with a free span of ``size`` (its smallest free extent that
        holds it, split, or its tail)."""
        chunks = self._open.get(size)
        if chunks:
            i = next(iter(chunks))
            off = next(reversed(self._free[i][size]))
            self._extent_remove(i, off, size)
        else:
            i = self._tails.first_fit(size)
            if i < 0:
                return None
            free = self._free[i]
            fit = min((s for s in free if s >= size), default=0) if free else 0
            if fit:
                off = next(reversed(self._free[i][fit]))
                self._extent_remove(i, off, fit)
                self._extent_add(i, off + size, fit - size)
            else:
                off = i * self.chunk_bytes + self._top[i]
                self._top[i] += size
        self._tails.set(i, self._chunk_room(i))
        self._used[i] += 1
        return i, off

    def _release_slot(self, off: int, size: int) -> None:
        """Free the slot of ``size`` bytes at ``off``, merged with the free
        extents beside it (so pinned blocks left on top of a chunk never
        strand the free bytes below them in slots of one size), or given back
        to the tail."""
        i = off // self.chunk_bytes
        self._used[i] -= 1
        base = i * self.chunk_bytes
        if self._used[i] == 0:  # empty: the whole chunk is one tail again
            for s in self._free[i] or ():
                chunks = self._open[s]
                del chunks[i]
                if not chunks:
                    del self._open[s]
            self._free[i] = None
            self._fstart[i].clear()
            self._fend[i].clear()
            self._top[i] = 0
            self._tails.set(i, self._csize[i])
            return
        below = self._fend[i].get(off)
        if below is not None:
            self._extent_remove(i, below, off - below)
            size += off - below
            off = below
        above = self._fstart[i].get(off + size)
        if above is not None:
            self._extent_remove(i, off + size, above)
            size += above
        if off + size == base + self._top[i]:  # the top: the tail grows back
            self._top[i] = off - base
        else:
            self._extent_add(i, off, size)
        self._tails.set(i, self._chunk_room(i))
