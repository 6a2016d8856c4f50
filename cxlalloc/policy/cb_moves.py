"""Continuous batching's placement decision: which chunks of the paged KV cache go to VRAM.

Pure (no torch, no I/O): :class:`cxlalloc.hf.paged.CxlPagedAttentionCache` ranks the chunks
holding the scheduled requests' blocks and carries out the moves this returns.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple


def plan_moves(chunk_rank: Dict[int, int], on_device: Sequence[int], device_slots: int) -> Tuple[List[int], List[int]]:
    """Which chunks to demote and promote so the hottest chunks are in VRAM.

    Args:
        chunk_rank: ``{chunk: rank}`` for chunks holding blocks of scheduled
            requests; rank 0 is hottest (a request's newest block), larger is
            older.  Chunks absent are cold (waiting/preempted requests, cached
            prefixes, free blocks).
        on_device: chunks now in VRAM.
        device_slots: how many of this cache's chunks VRAM may hold now
            (those on device plus the device tier's free room, in chunks).

    Returns:
        ``(demote, promote)``: chunk lists, demotions first (they make the
        room), each in the order to carry out.  Only as many promotions as
        ``device_slots`` allows; a cold chunk in VRAM is demoted only to make
        room for a hotter one.
    """
    want = sorted(chunk_rank, key=lambda c: (chunk_rank[c], c))[:max(0, device_slots)]
    want_set = set(want)
    dev = set(on_device)
    promote = [c for c in want if c not in dev]
    free = max(0, device_slots - len(dev))
    need = max(0, len(promote) - free)
    # Victims: cold chunks first (oldest address last-in), then hot chunks that did not make the cut, coldest first.
    cold = sorted((c for c in dev if c not in chunk_rank), reverse=True)
    warm = sorted((c for c in dev if c in chunk_rank and c not in want_set), key=lambda c: (-chunk_rank[c], c))
    demote = (cold + warm)[:need]
    promote = promote[:free + len(demote)]
    return demote, promote


__all__ = ["plan_moves"]
