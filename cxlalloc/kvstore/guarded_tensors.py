"""The write guard's bookkeeping for :class:`cxlalloc.kvstore.keys.WeightsWatch` (``"guarded"`` mode): which
tensors may be guarded, which of this process's mappings the guard may cover, what identifies a tensor's memory,
and the digest of the bytes at a guarded tensor's ends (they share pages with other memory, so they are read at
every check).  The guard itself is C++ (``csrc/common/write_guard.h``); moved here from keys.py unchanged."""

from __future__ import annotations

import bisect
import ctypes
from typing import List, Tuple

import xxhash


# Shared mappings the guard may cover: the simulated driver's memory (csrc/sim/vmm.cpp), which no other
# process holds.  Other shared memory (torch's share_memory_, /dev/shm, a file) may be written by another
# process, which no fault here would show; those tensors are digested in full at every check.
_GUARDABLE_SHARED = ("/memfd:cxlsim-phys",)


def _maps() -> Tuple[List[int], List[int], List[str]]:
    """This process's mappings that the guard may cover, adjacent ones of the same protection merged:
    sorted starts, ends and ``"rw"``/``"r-"`` (``/proc/self/maps``: private mappings, and shared ones named
    in ``_GUARDABLE_SHARED``)."""
    starts: List[int] = []
    ends: List[int] = []
    prots: List[str] = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            perms = parts[1]
            if perms[3] != "p" and (len(parts) < 6 or not parts[5].startswith(_GUARDABLE_SHARED)):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            prot = perms[:2]
            if ends and ends[-1] == lo and prots[-1] == prot:
                ends[-1] = hi
            else:
                starts.append(lo)
                ends.append(hi)
                prots.append(prot)
    return starts, ends, prots


def _inside(maps, lo: int, hi: int, prot: str) -> bool:
    """Whether [lo, hi) lies in one run of guardable mappings of protection ``prot`` (``"rw"``)."""
    if not maps:
        return False
    starts, ends, prots = maps
    i = bisect.bisect_right(starts, lo) - 1
    return i >= 0 and ends[i] >= hi and prots[i] == prot


class _Guarded:
    """One tensor under the write guard: its digest, what identifies its memory, and its guarded pages.

    The pages wholly inside the tensor's bytes are read-only (``slot``); the bytes before the first and after
    the last such page (``edges``, under two pages) share pages with other memory, so they are digested at
    every check instead.  ``storage`` is held so that the guarded memory is never freed while guarded."""

    __slots__ = ("sig", "storage", "base", "digest", "slot", "edges", "edge_digest")

    def __init__(self, sig, storage, base, digest, slot, edges, edge_digest):
        self.sig, self.storage, self.base, self.digest = sig, storage, base, digest
        self.slot, self.edges, self.edge_digest = slot, edges, edge_digest

    def release(self, C) -> None:
        if self.slot is not None:
            # Make the pages writable again only while they are still this storage's memory.
            C.guard_release(self.slot, self.storage.data_ptr() == self.base)
            self.slot = None


def _sig(t) -> tuple:
    """What identifies a tensor's memory and torch-visible changes: address, storage, layout, version."""
    return (t.data_ptr(), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.dtype, tuple(t.shape),
            t.stride(), t.storage_offset(), str(t.device), t._version)


def _edge_digest(edges) -> bytes:
    """XXH3-128 of the bytes at ``(address, length)`` of each edge (the tensor's memory, kept alive and
    unmoved: its storage is held and its address is part of the signature checked first)."""
    h = xxhash.xxh3_128()
    for a, n in edges:
        if n:
            h.update(ctypes.string_at(a, n))
    return h.digest()


def _torch():
    import torch

    return torch


def _guardable(t) -> bool:
    """A contiguous strided CPU tensor in pageable memory (not pinned: a device may write that by DMA)."""
    if t.device.type != "cpu" or t.layout is not _torch().strided or not t.is_contiguous() or t.is_quantized:
        return False
    try:
        return not t.is_pinned()
    except Exception:
        return False
