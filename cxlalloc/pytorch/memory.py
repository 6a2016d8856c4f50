"""What cxlalloc's engine holds for torch, and giving it back: ``stats()``,
``tier_of()``, ``empty_cache()``."""

from __future__ import annotations

import sys

from cxlalloc.allocator import sum_stats
from cxlalloc.pytorch.devices import current_device
from cxlalloc.pytorch.modes import mode
from cxlalloc.pytorch.state import require_enabled


def stats(device=None) -> dict:
    """Per-tier statistics of ``device`` (default: torch's current device) from
    the process's cxlalloc engine.

    Returns the dict of :meth:`cxlalloc.Allocator.stats` (bytes: ``device``
    and ``host`` tiers with allocated/reserved/peak/limit, ``kv``/``weight``/
    ``other`` classes per tier, ``spilled_bytes``, ``demoted_bytes``,
    ``promoted_bytes``, ..., ``torch``: the device tier in
    ``torch.cuda.memory_stats()`` keys) plus ``mode``, ``numa_node_reason``
    and, in scoped mode, ``spill_reserved_bytes``.  When cxlalloc serves
    several GPUs, also ``gpus`` (``{"cuda:i": that GPU's stats}`` for every
    served GPU whose allocator exists, i.e. that allocated once; ``device``
    always among them) and ``total`` (their sum:
    :func:`cxlalloc.allocator.sum_stats`, numbers summed, names such as
    ``device`` and ``numa_node`` listed per GPU).

    Raises:
        RuntimeError: cxlalloc is not enabled.
        ValueError: a bad device, or a GPU cxlalloc does not serve.
    """
    st = require_enabled()
    d = current_device(device)
    if d not in st.devices:
        raise ValueError(f"cxlalloc option 'device': cuda:{d} is not served by cxlalloc "
                         f"(served: {', '.join(f'cuda:{k}' for k in sorted(st.devices))})")
    out = dict(st.engine.device(d).stats())
    out["mode"] = mode()
    out["numa_node_reason"] = st.devices[d].get("node_reason", "")
    if st.mode == "scoped":
        out["spill_reserved_bytes"] = st.spill_reserved.get(d, 0)
    if len(st.devices) > 1:
        per = {}
        for g in sorted(st.devices):
            a = st.engine.device(d) if g == d else st.engine.existing(g)  # never starts another GPU's allocator
            if a is not None:
                per[f"cuda:{g}"] = dict(a.stats())
        out["gpus"] = per
        out["total"] = sum_stats(list(per.values()))
    return out


def empty_cache() -> int:
    """Return cached free memory of both tiers to the driver (every GPU).

    In global mode this is what ``torch.cuda.empty_cache()`` does too; in
    scoped mode torch's own cache is emptied first.  Returns the bytes cxlalloc
    released.

    Raises:
        RuntimeError: cxlalloc is not enabled.
    """
    st = require_enabled()
    torch = sys.modules.get("torch")
    if st.mode == "scoped" and torch is not None:
        torch.cuda.empty_cache()
    released = 0
    for d in st.devices:
        a = st.engine.existing(d)
        if a is not None:
            released += int(a.empty_cache())
    return released


def tier_of(tensor, device=None) -> str:
    """Which cxlalloc tier holds ``tensor``'s storage: ``"device"`` (VRAM) or
    ``"host"`` (host memory on the chosen NUMA node).  ``tensor`` may also be
    an address (int), with ``device`` its GPU (default: current).

    A tensor on the host tier still reports ``device == cuda:N``: the GPU
    reads its bytes across the link.

    Raises:
        RuntimeError: cxlalloc is not enabled.
        ValueError: the memory is not cxlalloc's (in scoped mode, everything
            outside ``cxlalloc.kv()`` and the spill pool belongs to torch).
    """
    st = require_enabled()
    what = None
    if hasattr(tensor, "untyped_storage"):
        ptr = int(tensor.untyped_storage().data_ptr())
        d = tensor.device.index if device is None else current_device(device)
        # described by shape and dtype in messages, never by its values
        what = f"the storage of a tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} on {tensor.device}"
    elif isinstance(tensor, int) and not isinstance(tensor, bool):
        ptr, d = tensor, current_device(device)
    else:
        raise ValueError(f"cxlalloc.tier_of: a {type(tensor).__name__} is neither a tensor nor an address (int)")
    if d is None:
        raise ValueError(f"cxlalloc.tier_of: {what} is not CUDA memory, so not cxlalloc's")
    if d not in st.devices:
        raise ValueError(f"cxlalloc option 'device': cuda:{d} is not served by cxlalloc")
    try:
        return st.engine.device(d).tier_of(ptr)
    except ValueError:
        shown = f"{what} (address {ptr:#x})" if what else f"address {ptr:#x}"
        raise ValueError(f"cxlalloc.tier_of: {shown} is not cxlalloc memory on cuda:{d}"
                         + (" (in scoped mode, memory outside cxlalloc.kv() and the spill pool is torch's)"
                            if st.mode == "scoped" else "")) from None
