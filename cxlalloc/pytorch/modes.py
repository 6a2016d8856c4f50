"""``cxlalloc.enable()``: validate the options, then install global mode (CUDA
not initialised yet) or scoped mode (it is); ``mode()`` and ``is_enabled()``
say what is in force (docs/pytorch-integration.md)."""

from __future__ import annotations

import sys
from typing import Optional

from cxlalloc.config import make_enable_config
from cxlalloc.pytorch import state
from cxlalloc.pytorch.devices import require_cuda
from cxlalloc.pytorch.global_mode import TooLate, enable_global
from cxlalloc.pytorch.scoped_mode import enable_scoped


def enable(device_limit=None, host_limit=None, numa_node="auto", backend="auto", device=None, **options) -> str:
    """Make cxlalloc serve this process's PyTorch CUDA allocations.

    Before CUDA is initialised this installs **global mode**: cxlalloc becomes
    torch's CUDA caching allocator for every visible GPU (VRAM first, then
    host memory on the chosen NUMA node).  After CUDA is initialised it sets
    up **scoped mode** (KV pool + pre-reserved spill pool, torch's allocator
    stays) and warns once saying what that covers.

    Args:
        device_limit: VRAM cxlalloc may use per GPU: bytes, a size string
            (``"8GiB"``), or a fraction of the GPU's VRAM (``0.5``, ``"50%"``);
            default: free VRAM at start minus 256 MiB.
        host_limit: bytes of host memory per GPU for the host tier (size
            string accepted); default 80% of the node's free memory; 0
            disables spilling.
        numa_node: host NUMA node, or ``"auto"`` (a CPU-less/CXL node near the
            GPU if any, else the GPU's nearest node), chosen per GPU.
        backend: host-tier backend: ``"auto"``, ``"host-vmm"``, ``"managed"``,
            ``"pinned"``.
        device: the GPU these options apply to (int or ``"cuda:N"``); None =
            every GPU.  ``device_limit``, ``kv_device_limit``, ``host_limit``,
            ``numa_node`` and ``device_headroom`` also take one value per GPU:
            a list (one per visible GPU, in device order) or a mapping
            ``{device index or "cuda:N": value}`` (not with ``device``).  In global mode the other GPUs get default options; in
            scoped mode only this GPU gets pools.
        **options: the other options of :mod:`cxlalloc.config`
            (``kv_device_limit``, ``device_headroom``, ``migration_rate``,
            ``promote_after``, ``extent_chunk``, ``strict_placement``,
            ``spill_reserve``, ``libcuda``).

    Returns:
        The mode now active: ``"global"``, ``"global-pluggable"`` or
        ``"scoped"``.  Calling again with the same settings returns it again.

    Raises:
        ValueError: a bad option (the message names it and its allowed
            values), or ``simulate=True`` (torch cannot use a simulated GPU).
        RuntimeError: CUDA is unavailable (CPU-only torch, no driver, no
            device; the message says which and points to
            ``cxlalloc.Allocator(simulate=True)``), or cxlalloc is already
            enabled with different settings.
    """
    return enable_from(dict(device_limit=device_limit, host_limit=host_limit, numa_node=numa_node, backend=backend,
                        device=device, **options), source="cxlalloc.enable()")


def enable_from(options: dict, source: str) -> str:
    """:func:`enable` with the options as a dict; ``source`` names the caller
    in a later conflict's message (the CXLALLOC start-up hook passes its own)."""
    cfg = make_enable_config(**options)  # validation first: ValueError naming the option
    if cfg.simulate:
        raise ValueError(
            "cxlalloc option 'simulate': torch cannot allocate from cxlalloc's simulated GPU, so enable() needs a "
            "real CUDA device; use cxlalloc.Allocator(simulate=True) for simulated tiers")
    settings = state.settings(cfg)
    with state.lock:
        current = state.current
        if current is not None:
            if settings == current.settings:
                return current.mode
            raise RuntimeError(
                f"cxlalloc is already enabled (mode {current.mode}, by {current.source}) with other settings; this "
                f"call asks for {state.describe_difference(current.settings, settings)}. Options cannot change once "
                "enabled: pass the same options (or set them in CXLALLOC only).")
        import torch

        require_cuda(torch, cfg)
        st = None
        if not torch.cuda.is_initialized():
            try:
                st = enable_global(torch, cfg, settings, source)
            except TooLate:
                st = None
        if st is None:
            st = enable_scoped(torch, cfg, settings, source)
        state.current = st
        return st.mode


def mode() -> Optional[str]:
    """The torch integration mode in force: ``"global"``, ``"global-pluggable"``,
    ``"scoped"``, or None (not enabled, or no longer torch's allocator).

    Checks the truth rather than remembering a request: "global" means the
    adapter is torch's CUDA allocator right now (case C09).
    """
    st = state.current
    if st is None:
        return None
    if st.mode == "global":
        return "global" if st.adapter is not None and st.adapter.is_current() else None
    if st.mode == "global-pluggable":
        torch = sys.modules.get("torch")
        ok = torch is not None and torch.cuda.memory.get_allocator_backend() == "pluggable"
        return "global-pluggable" if ok else None
    return st.mode


def is_enabled() -> bool:
    """True iff cxlalloc serves torch allocations in this process (see :func:`mode`)."""
    return mode() is not None
