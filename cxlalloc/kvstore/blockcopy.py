"""Writing whole blocks into reserved slots: one C++ call with streaming stores for CPU sources.

A reservation's slots are the pool's least recently used memory (LRU
eviction hands out the oldest), out of every cache: ``view.copy_(src)`` per
block reads each destination line before writing it and costs one Python
call per block.  :func:`write_blocks` copies every CPU source of a batch in
one call with the GIL released, using non-temporal (streaming) stores where
the CPU has them (``csrc/kvstore/stream_copy.h``; asked at run time, memcpy
otherwise).  A source it cannot copy as raw bytes (on a GPU, non-contiguous,
with a lazy conjugate/negative bit) goes through ``copy_`` as before, so the
result is the same bytes either way.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from cxlalloc import _C

__all__ = ["write_blocks", "streaming_available", "raw_pointers", "copy_raw"]

_STRIDED = torch.strided


def streaming_available() -> bool:
    """Whether this CPU has the streaming stores :func:`write_blocks` uses (SSE2 on x86-64; False elsewhere,
    where it copies with memcpy)."""
    return bool(_C.stream_copy_available())


def _raw_ok(t: torch.Tensor) -> bool:
    """The tensor's bytes are one contiguous CPU range, as torch would copy them (no lazy conjugate or
    negative bit, not quantized or sparse)."""
    # Cheapest checks first (a 64-block batch makes 64 of these calls: ~0.6 us each here).
    return (t.is_cpu and t.layout is _STRIDED and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t.is_quantized)


def raw_pointers(sources: Sequence[Optional[torch.Tensor]], nbytes: int) -> Optional[List[Optional[int]]]:
    """Each source's data address (None stays None) when every source is a raw CPU range of exactly
    ``nbytes`` bytes; None when one is not (the caller copies through views instead).

    Raises:
        ValueError: a source whose byte count is not ``nbytes`` (naming its index and both sizes).
    """
    out: List[Optional[int]] = []
    raw = True
    for i, s in enumerate(sources):
        if s is None:
            out.append(None)
            continue
        n = s.nbytes
        if n != nbytes:
            raise ValueError(f"write_blocks: source {i} has {n} bytes, its slot {nbytes}; a source must fill its "
                             "slot exactly")
        raw = raw and _raw_ok(s)
        out.append(s.data_ptr() if raw else None)
    return out if raw else None


def copy_raw(dsts: List[int], srcs: List[int], nbytes: int, stream: bool = True) -> None:
    """Copy ``nbytes`` from each address of ``srcs`` to the same-index address of ``dsts`` in one C++ call
    (GIL released; streaming stores when ``stream`` and the CPU has them)."""
    if dsts:
        _C.stream_copy_many(dsts, srcs, [nbytes] * len(dsts), bool(stream))


def write_blocks(views: Sequence[Optional[torch.Tensor]], sources: Sequence[Optional[torch.Tensor]], *,
                 stream: bool = True) -> int:
    """Copy ``sources[i]`` into ``views[i]`` for each ``i`` where both are not None; returns how many it wrote.

    Args:
        views: a reservation's slots (``RemoteReservation.views``: 1-D uint8
            tensors, None where the key got no slot).
        sources: as many tensors (any dtype and shape; None = skip), each
            exactly as many bytes as its slot.  CPU, contiguous sources are
            copied as raw bytes in one C++ call (streaming stores when
            ``stream`` and the CPU has them, memcpy else); any other (a GPU
            tensor, a non-contiguous one) with ``copy_`` into the slot
            viewed as its dtype and shape.

    Raises:
        ValueError: ``views`` and ``sources`` differ in length, or a source's
            byte count differs from its slot's (naming the index and both sizes).
    """
    if len(views) != len(sources):
        raise ValueError(f"write_blocks: {len(sources)} sources for {len(views)} slots; pass one source (or None) "
                         "per slot")
    dsts, srcs, sizes, slow = [], [], [], []
    for i, (v, s) in enumerate(zip(views, sources)):
        if v is None or s is None:
            continue
        n = v.numel() * v.element_size()
        ns = s.numel() * s.element_size()
        if ns != n:
            raise ValueError(f"write_blocks: source {i} has {ns} bytes, its slot {n}; a source must fill its slot "
                             "exactly")
        if v.is_cpu and v.is_contiguous() and _raw_ok(s):
            dsts.append(v.data_ptr())
            srcs.append(s.data_ptr())
            sizes.append(n)
        else:
            slow.append((v, s))
    if dsts:
        _C.stream_copy_many(dsts, srcs, sizes, bool(stream))
    for v, s in slow:
        if s.dtype == v.dtype and s.dim() == 1:
            v.copy_(s)
        else:
            v.view(s.dtype).view(s.shape).copy_(s)
    return len(dsts) + len(slow)
