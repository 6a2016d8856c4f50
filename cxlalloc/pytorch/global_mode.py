"""Global mode: cxlalloc becomes torch's CUDA allocator for every visible GPU.

Through the C++ adapter (:mod:`cxlalloc.pytorch.adapter_build`) when it can
be built here; otherwise through torch's plain ``CUDAPluggableAllocator``
("global-pluggable"), with one warning naming what that loses.
"""

from __future__ import annotations

import warnings

from cxlalloc import _C
from cxlalloc.config import Config
from cxlalloc.pytorch import adapter_build
from cxlalloc.pytorch.devices import c_library_path, configure_engine, visible_devices
from cxlalloc.pytorch.state import CxlallocWarning, State


class TooLate(Exception):
    """torch's allocator is already initialised: global mode is impossible."""


def enable_global(torch, cfg: Config, settings, source) -> State:
    probe = _C.Engine(cfg.libcuda, False)
    devices = visible_devices(probe.device_count, cfg)
    del probe
    adapter, build_error = None, None
    try:
        adapter = adapter_build.load()
    except Exception as e:  # AdapterBuildError, or anything the toolchain throws
        build_error = e
    # torch.cuda.is_initialized() can be False while a library already made
    # torch's allocator initialise (case C09): ask the allocator itself.
    if adapter is not None and adapter.current_allocator()[1]:
        raise TooLate()
    engine, resolved = configure_engine(cfg, devices, source)
    _C.set_current_engine(engine)
    try:
        if adapter is None:
            return enable_pluggable(torch, cfg, settings, source, engine, resolved, build_error)
        adapter.install(c_library_path())
        if not adapter.is_current():
            raise RuntimeError("cxlalloc: the adapter was installed but torch does not use it")
        return State("global", settings, source, cfg, engine, resolved, adapter=adapter, keepalive=[adapter])
    except BaseException:
        _C.set_current_engine(None)
        raise


def enable_pluggable(torch, cfg, settings, source, engine, resolved, build_error) -> State:
    from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator

    alloc = CUDAPluggableAllocator(c_library_path(), "cxlalloc_malloc", "cxlalloc_free")
    try:
        change_current_allocator(alloc)
    except RuntimeError as e:  # "Can't swap an already initialized allocator" (case C09)
        if "initialized" in str(e):
            raise TooLate() from e
        raise
    warnings.warn(
        f"cxlalloc: the torch adapter could not be built ({build_error}); cxlalloc serves torch through "
        "torch's plain CUDAPluggableAllocator instead, which loses: torch.cuda.memory_stats / memory_allocated / "
        "max_memory_allocated / memory_summary, _record_memory_history and _snapshot, record_stream safety, "
        "CUDA-graph private pools, cuDNN benchmark (cacheInfo), empty_cache, and torch.OutOfMemoryError (a request "
        "that fits neither tier returns a null pointer and fails later as a CUDA error). cxlalloc.stats() and "
        "cxlalloc.memory_summary() still work.", CxlallocWarning, stacklevel=5)
    return State("global-pluggable", settings, source, cfg, engine, resolved, keepalive=[alloc])
