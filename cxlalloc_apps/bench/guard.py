"""The managed-memory guard: never ask for more managed memory than half the
card's free memory.

Why: on a shared GPU, oversubscribing VRAM with CUDA managed memory can hang
the GPU, not only the process (``/work/.library/device/README.md``, Notes:
"never ask for more managed memory than the card has free: a program that
does can hang the GPU").  The benchmarks emulate a small GPU with
``device_limit`` instead, and this guard keeps every managed request at or
under ``MANAGED_FRACTION`` (one half) of the free VRAM measured before the
run.

What counts as managed memory (bytes), conservatively:

* ``backend="managed"``: cxlalloc puts KV segments and extents in managed
  memory on *both* tiers (``csrc/backend/segment_factory.cpp``: "KV segments use
  managed memory under the managed backend even on the device tier") and
  other host-tier segments too, bounded by ``host_limit``.  So a cell may
  request up to ``kv_bytes + host_limit``.
* ``backend="auto"``: may resolve to managed on a GPU without host-NUMA VMM,
  so it is counted the same way.
* ``host-vmm`` / ``pinned``: no managed memory (0).
* a raw ``cuMemAllocManaged`` timing: its size.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from cxlalloc.config import format_bytes

MANAGED_FRACTION = 0.5
MANAGED_BACKENDS = ("managed", "auto")


class ManagedMemoryGuardError(RuntimeError):
    """A benchmark would request more managed memory than the guard allows."""


def managed_cap(free_bytes: int) -> int:
    """The most managed memory (bytes) any run may request: half of ``free_bytes``."""
    return int(MANAGED_FRACTION * max(int(free_bytes), 0))


def managed_request(backend: Optional[str], kv_bytes: int = 0, host_limit: int = 0, raw_bytes: int = 0) -> int:
    """Managed bytes a cell may request (see the module docstring)."""
    n = int(raw_bytes)
    if backend in MANAGED_BACKENDS:
        n += int(kv_bytes) + int(host_limit)
    return n


def check_managed(request_bytes: int, free_bytes: int, what: str = "request") -> None:
    """Raise :class:`ManagedMemoryGuardError` unless ``request_bytes`` <= half of ``free_bytes``."""
    cap = managed_cap(free_bytes)
    if int(request_bytes) > cap:
        raise ManagedMemoryGuardError(
            f"managed-memory guard: {what} would request {format_bytes(request_bytes)} of managed memory, more than "
            f"half of the card's free memory ({format_bytes(free_bytes)} free -> cap {format_bytes(cap)}); "
            "refused: oversubscribing VRAM with managed memory can hang a shared GPU. Use a smaller grid or "
            "emulate a small GPU with device_limit")


def check_grid(cells: Iterable[Dict], free_bytes: int) -> List[Dict]:
    """Check every cell's ``"managed_bytes"`` against the cap.

    Cells run one at a time and release their memory before the next, so the
    cap applies per cell; a grid with any cell over the cap is refused as a
    whole (nothing has run yet when this is called).

    Returns:
        the cells (unchanged) when all pass.

    Raises:
        ManagedMemoryGuardError: listing every offending cell.
    """
    cells = list(cells)
    cap = managed_cap(free_bytes)
    bad = [c for c in cells if int(c.get("managed_bytes", 0)) > cap]
    if bad:
        names = ", ".join(f"{c.get('id', '?')} ({format_bytes(c.get('managed_bytes', 0))})" for c in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise ManagedMemoryGuardError(
            f"managed-memory guard: {len(bad)} cell(s) of the grid would request more managed memory than half of "
            f"the card's free memory ({format_bytes(free_bytes)} free -> cap {format_bytes(cap)}): {names}{more}; "
            "the grid is refused")
    return cells


def split_grid(cells: Iterable[Dict], free_bytes: int):
    """``(allowed, refused)``: the cells within the cap, and the others, each
    refused cell annotated with ``"refused"`` (the reason)."""
    cap = managed_cap(free_bytes)
    ok, bad = [], []
    for c in cells:
        if int(c.get("managed_bytes", 0)) > cap:
            c = dict(c)
            c["refused"] = (f"managed-memory guard: {format_bytes(c['managed_bytes'])} of managed memory > half of "
                            f"free VRAM ({format_bytes(cap)})")
            bad.append(c)
        else:
            ok.append(c)
    return ok, bad
