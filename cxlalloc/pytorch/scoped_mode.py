"""Scoped mode (CUDA already initialised): torch's own allocator stays.

Allocations inside ``with cxlalloc.kv():`` go to a ``MemPool`` whose segments
cxlalloc places (VRAM, then host), and a pre-reserved host spill pool
(``MemPool(use_on_oom=True)``) catches other allocations that would otherwise
OOM, up to its reservation: on an outside OOM torch only looks for an already
cached free block in use-on-OOM pools; it never asks their allocator for a new
segment (docs/sources.md#torch-oom-order).
"""

from __future__ import annotations

import warnings

from cxlalloc import _C
from cxlalloc.config import Config, format_bytes, resolve_fraction
from cxlalloc.pytorch.devices import c_library_path, configure_engine, device_config, visible_devices
from cxlalloc.pytorch.state import CxlallocWarning, State

SPILL_RESERVE_FRACTION = 0.25


def spill_reserve_bytes(cfg: Config, opts: dict, total_vram: int) -> int:
    if opts["host_limit"] <= 0:
        return 0
    if cfg.spill_reserve is None:
        return int(min(opts["host_limit"], SPILL_RESERVE_FRACTION * total_vram))
    return int(min(resolve_fraction(cfg.spill_reserve, total_vram), opts["host_limit"]))


def enable_scoped(torch, cfg: Config, settings, source) -> State:
    from torch.cuda.memory import CUDAPluggableAllocator

    probe = _C.Engine(cfg.libcuda, False)
    count = probe.device_count
    del probe
    devices = [cfg.device] if cfg.device is not None else list(range(count))
    visible_devices(count, cfg)
    engine, resolved = configure_engine(cfg, devices, source)
    _C.set_current_engine(engine)
    try:
        path = c_library_path()
        kv_alloc = CUDAPluggableAllocator(path, "cxlalloc_kv_malloc", "cxlalloc_kv_free")
        spill_alloc = CUDAPluggableAllocator(path, "cxlalloc_host_malloc", "cxlalloc_host_free")
        st = State("scoped", settings, source, cfg, engine, resolved, keepalive=[kv_alloc, spill_alloc])
        for d in devices:
            # A MemPool belongs to the device current at its creation.
            with torch.cuda.device(d):
                kv_pool = torch.cuda.MemPool(kv_alloc.allocator())
                st.keepalive.append(kv_pool)
                st.kv_pools[d] = kv_pool
                total = torch.cuda.get_device_properties(d).total_memory
                reserve = spill_reserve_bytes(device_config(cfg, d), resolved[d], total)
                if reserve > 0:
                    spill = torch.cuda.MemPool(spill_alloc.allocator(), use_on_oom=True)
                    st.keepalive.append(spill)
                    # Allocate and free one block: it stays cached in the pool,
                    # which is all torch's OOM fallback can use.
                    with torch.cuda.use_mem_pool(spill):
                        block = torch.empty(reserve, dtype=torch.uint8, device=f"cuda:{d}")
                    del block
                    st.spill_pools[d] = spill
                    st.spill_reserved[d] = reserve
        spill_text = ", ".join(f"cuda:{d}: {format_bytes(n)} on NUMA node {resolved[d]['host_node']}"
                               for d, n in st.spill_reserved.items()) or "none (host_limit 0 or spill_reserve 0)"
        warnings.warn(
            "cxlalloc: CUDA was already initialised, so cxlalloc runs in scoped mode: torch's own allocator stays; "
            "allocations inside `with cxlalloc.kv():` go to cxlalloc's KV pool (VRAM first, then host memory), and "
            f"other allocations that would run out of memory may use a pre-reserved host spill pool ({spill_text}). "
            "torch.cuda memory stats do not include cxlalloc's host tier (see cxlalloc.stats()). For global mode "
            "(every allocation tiered) call cxlalloc.enable() before any CUDA use, or set CXLALLOC=1 before "
            "starting Python.", CxlallocWarning, stacklevel=4)
        return st
    except BaseException:
        _C.set_current_engine(None)
        raise
