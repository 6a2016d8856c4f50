"""``cxlalloc.enable()``: cxlalloc inside a PyTorch process.

Two modes, one engine (docs/pytorch-integration.md):

**global** (``enable()`` before CUDA is initialised, or ``CXLALLOC`` set at
start-up): cxlalloc becomes torch's CUDA caching allocator for every visible
GPU, through a small C++ adapter built against the installed torch
(:mod:`cxlalloc._torch_build`).  Every allocation is tiered; torch's memory
APIs keep working and report the device tier.  If the adapter cannot be
built, torch's plain ``CUDAPluggableAllocator`` serves instead
("global-pluggable"), with one warning naming what that loses.

**scoped** (``enable()`` after CUDA is initialised): torch's own allocator
stays.  Allocations inside ``with cxlalloc.kv():`` go to a ``MemPool`` whose
segments cxlalloc places (VRAM, then host), and a pre-reserved host spill
pool (``MemPool(use_on_oom=True)``) catches other allocations that would
otherwise OOM, up to its reservation.  Why pre-reserved: on an outside OOM
torch only looks for an already cached free block in use-on-OOM pools; it
never asks their allocator for a new segment (docs/sources.md#torch-oom-order).

Every callback, library handle, allocator object and pool created here is
kept in the module state until the process ends (case C12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import warnings
from typing import Any, Dict, Optional

from cxlalloc import _C
from cxlalloc.engine import configure, device_options, new_engine
from cxlalloc.config import Config, format_bytes, make_config, resolve_fraction

MODES = ("global", "global-pluggable", "scoped")
SPILL_RESERVE_FRACTION = 0.25


class CxlallocWarning(UserWarning):
    """A warning from cxlalloc's torch integration."""


@dataclasses.dataclass
class _State:
    mode: str
    settings: Dict[str, Any]
    source: str
    config: Config
    engine: Any
    devices: Dict[int, dict]
    adapter: Any = None
    keepalive: list = dataclasses.field(default_factory=list)  # allocators, pools: never released
    kv_pools: Dict[int, Any] = dataclasses.field(default_factory=dict)
    spill_pools: Dict[int, Any] = dataclasses.field(default_factory=dict)
    spill_reserved: Dict[int, int] = dataclasses.field(default_factory=dict)


_lock = threading.RLock()
_state: Optional[_State] = None


# ----------------------------------------------------------------- helpers
def _c_library_path() -> str:
    return os.path.abspath(_C.__file__)


def _no_cuda_reason(torch, cfg: Config) -> Optional[str]:
    """Why torch cannot use CUDA here, or None if it can."""
    if getattr(torch.version, "cuda", None) is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    try:
        engine = _C.Engine(cfg.libcuda, False)
    except Exception as e:  # CudaUnavailableError: no driver, no device, ...
        return str(e)
    if engine.device_count == 0:
        return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def _require_cuda(torch, cfg: Config) -> None:
    reason = _no_cuda_reason(torch, cfg)
    if reason is not None:
        raise RuntimeError(
            f"cxlalloc.enable(): CUDA is not available: {reason}. There is no torch CUDA allocator to tier here. "
            "Without a GPU, use cxlalloc's simulated driver instead: cxlalloc.Allocator(simulate=True), "
            "cxlalloc.hf.wrap(model, simulate=True), or `python -m cxlalloc demo|bench --simulate`.")


def _settings(cfg: Config) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def _describe_difference(old: Dict[str, Any], new: Dict[str, Any]) -> str:
    diffs = [f"{k}={old.get(k)!r} -> {new.get(k)!r}" for k in sorted(new) if old.get(k) != new.get(k)]
    return ", ".join(diffs)


def _device_config(cfg: Config, device: int) -> Config:
    """The options that apply to ``device``: all of them when ``cfg.device`` is
    None or names it; defaults for the other GPUs (global mode serves every
    GPU, so each needs an allocator)."""
    if cfg.device is None or cfg.device == device:
        return cfg
    return Config(libcuda=cfg.libcuda)


def _configure_engine(cfg: Config, devices) -> tuple:
    engine = new_engine(cfg)
    resolved = {}
    for d in devices:
        dcfg = _device_config(cfg, d)
        opts = device_options(engine, d, dcfg, default_headroom=0.05)
        resolved[d] = dict(opts)
        configure(engine, d, opts)
    return engine, resolved


def _visible_devices(engine_count: int, cfg: Config) -> list:
    if cfg.device is not None and not (0 <= cfg.device < engine_count):
        raise ValueError(f"cxlalloc option 'device': {cfg.device} is not a CUDA device ordinal "
                         f"(0..{engine_count - 1} are visible)")
    return list(range(engine_count))


# ----------------------------------------------------------------- global mode
class _TooLate(Exception):
    """torch's allocator is already initialised: global mode is impossible."""


def _enable_global(torch, cfg: Config, settings, source) -> _State:
    probe = _C.Engine(cfg.libcuda, False)
    devices = _visible_devices(probe.device_count, cfg)
    del probe
    adapter, build_error = None, None
    try:
        from cxlalloc import _torch_build

        adapter = _torch_build.load()
    except Exception as e:  # AdapterBuildError, or anything the toolchain throws
        build_error = e
    # torch.cuda.is_initialized() can be False while a library already made
    # torch's allocator initialise (case C09): ask the allocator itself.
    if adapter is not None and adapter.current_allocator()[1]:
        raise _TooLate()
    engine, resolved = _configure_engine(cfg, devices)
    _C.set_current_engine(engine)
    try:
        if adapter is None:
            return _enable_pluggable(torch, cfg, settings, source, engine, resolved, build_error)
        adapter.install(_c_library_path())
        if not adapter.is_current():
            raise RuntimeError("cxlalloc: the adapter was installed but torch does not use it")
        return _State("global", settings, source, cfg, engine, resolved, adapter=adapter, keepalive=[adapter])
    except BaseException:
        _C.set_current_engine(None)
        raise


def _enable_pluggable(torch, cfg, settings, source, engine, resolved, build_error) -> _State:
    from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator

    alloc = CUDAPluggableAllocator(_c_library_path(), "cxlalloc_malloc", "cxlalloc_free")
    try:
        change_current_allocator(alloc)
    except RuntimeError as e:  # "Can't swap an already initialized allocator" (case C09)
        if "initialized" in str(e):
            raise _TooLate() from e
        raise
    warnings.warn(
        f"cxlalloc: the torch adapter could not be built ({build_error}); cxlalloc serves torch through "
        "torch's plain CUDAPluggableAllocator instead, which loses: torch.cuda.memory_stats / memory_allocated / "
        "max_memory_allocated / memory_summary, _record_memory_history and _snapshot, record_stream safety, "
        "CUDA-graph private pools, cuDNN benchmark (cacheInfo), empty_cache, and torch.OutOfMemoryError (a request "
        "that fits neither tier returns a null pointer and fails later as a CUDA error). cxlalloc.stats() and "
        "cxlalloc.memory_summary() still work.", CxlallocWarning, stacklevel=5)
    return _State("global-pluggable", settings, source, cfg, engine, resolved, keepalive=[alloc])


# ----------------------------------------------------------------- scoped mode
def _spill_reserve_bytes(cfg: Config, opts: dict, total_vram: int) -> int:
    if opts["host_limit"] <= 0:
        return 0
    if cfg.spill_reserve is None:
        return int(min(opts["host_limit"], SPILL_RESERVE_FRACTION * total_vram))
    return int(min(resolve_fraction(cfg.spill_reserve, total_vram), opts["host_limit"]))


def _enable_scoped(torch, cfg: Config, settings, source) -> _State:
    from torch.cuda.memory import CUDAPluggableAllocator

    probe = _C.Engine(cfg.libcuda, False)
    count = probe.device_count
    del probe
    devices = [cfg.device] if cfg.device is not None else list(range(count))
    _visible_devices(count, cfg)
    engine, resolved = _configure_engine(cfg, devices)
    _C.set_current_engine(engine)
    try:
        path = _c_library_path()
        kv_alloc = CUDAPluggableAllocator(path, "cxlalloc_kv_malloc", "cxlalloc_kv_free")
        spill_alloc = CUDAPluggableAllocator(path, "cxlalloc_host_malloc", "cxlalloc_host_free")
        st = _State("scoped", settings, source, cfg, engine, resolved, keepalive=[kv_alloc, spill_alloc])
        for d in devices:
            # A MemPool belongs to the device current at its creation.
            with torch.cuda.device(d):
                kv_pool = torch.cuda.MemPool(kv_alloc.allocator())
                st.keepalive.append(kv_pool)
                st.kv_pools[d] = kv_pool
                total = torch.cuda.get_device_properties(d).total_memory
                reserve = _spill_reserve_bytes(_device_config(cfg, d), resolved[d], total)
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


# ----------------------------------------------------------------- public API
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
            every GPU.  In global mode the other GPUs get default options; in
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
    return _enable(dict(device_limit=device_limit, host_limit=host_limit, numa_node=numa_node, backend=backend,
                        device=device, **options), source="cxlalloc.enable()")


def _enable(options: dict, source: str) -> str:
    global _state
    cfg = make_config(**options)  # validation first: ValueError naming the option
    if cfg.simulate:
        raise ValueError(
            "cxlalloc option 'simulate': torch cannot allocate from cxlalloc's simulated GPU, so enable() needs a "
            "real CUDA device; use cxlalloc.Allocator(simulate=True) for simulated tiers")
    settings = _settings(cfg)
    with _lock:
        if _state is not None:
            if settings == _state.settings:
                return _state.mode
            raise RuntimeError(
                f"cxlalloc is already enabled (mode {_state.mode}, by {_state.source}) with other settings; this "
                f"call asks for {_describe_difference(_state.settings, settings)}. Options cannot change once "
                "enabled: pass the same options (or set them in CXLALLOC only).")
        import torch

        _require_cuda(torch, cfg)
        st = None
        if not torch.cuda.is_initialized():
            try:
                st = _enable_global(torch, cfg, settings, source)
            except _TooLate:
                st = None
        if st is None:
            st = _enable_scoped(torch, cfg, settings, source)
        _state = st
        return st.mode


def mode() -> Optional[str]:
    """The torch integration mode in force: ``"global"``, ``"global-pluggable"``,
    ``"scoped"``, or None (not enabled, or no longer torch's allocator).

    Checks the truth rather than remembering a request: "global" means the
    adapter is torch's CUDA allocator right now (case C09).
    """
    st = _state
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


def _current_device(device) -> int:
    from cxlalloc.config import _parse_device

    d = _parse_device(device, "device")
    if d is not None:
        return d
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return 0


def _engine():
    st = _state
    if st is None:
        raise RuntimeError("cxlalloc is not enabled in this process: call cxlalloc.enable() (or set CXLALLOC=1 "
                           "before starting Python); for a standalone allocator use cxlalloc.Allocator(...)")
    return st


def stats(device=None) -> dict:
    """Per-tier statistics of ``device`` (default: torch's current device) from
    the process's cxlalloc engine.

    Returns the dict of :meth:`cxlalloc.Allocator.stats` (bytes: ``device``
    and ``host`` tiers with allocated/reserved/peak/limit, ``kv``/``weight``/
    ``other`` classes per tier, ``spilled_bytes``, ``demoted_bytes``,
    ``promoted_bytes``, ..., ``torch``: the device tier in
    ``torch.cuda.memory_stats()`` keys) plus ``mode``, ``numa_node_reason``
    and, in scoped mode, ``spill_reserved_bytes``.

    Raises:
        RuntimeError: cxlalloc is not enabled.
        ValueError: a bad device, or a GPU cxlalloc does not serve.
    """
    st = _engine()
    d = _current_device(device)
    if d not in st.devices:
        raise ValueError(f"cxlalloc option 'device': cuda:{d} is not served by cxlalloc "
                         f"(served: {', '.join(f'cuda:{k}' for k in sorted(st.devices))})")
    out = dict(st.engine.device(d).stats())
    out["mode"] = mode()
    out["numa_node_reason"] = st.devices[d].get("node_reason", "")
    if st.mode == "scoped":
        out["spill_reserved_bytes"] = st.spill_reserved.get(d, 0)
    return out


def empty_cache() -> int:
    """Return cached free memory of both tiers to the driver (every GPU).

    In global mode this is what ``torch.cuda.empty_cache()`` does too; in
    scoped mode torch's own cache is emptied first.  Returns the bytes cxlalloc
    released.

    Raises:
        RuntimeError: cxlalloc is not enabled.
    """
    st = _engine()
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
    st = _engine()
    if hasattr(tensor, "data_ptr"):
        ptr = int(tensor.untyped_storage().data_ptr())
        d = tensor.device.index if device is None else _current_device(device)
    else:
        ptr, d = int(tensor), _current_device(device)
    if d not in st.devices:
        raise ValueError(f"cxlalloc option 'device': cuda:{d} is not served by cxlalloc")
    return st.engine.device(d).tier_of(ptr)


@contextlib.contextmanager
def _class_scope(cls: str, pools: bool):
    _C.push_class(cls)
    try:
        st = _state
        if pools and st is not None and st.mode == "scoped":
            import torch

            d = torch.cuda.current_device()
            pool = st.kv_pools.get(d)
            if pool is not None:
                with torch.cuda.use_mem_pool(pool, device=d):
                    yield
                return
        yield
    finally:
        _C.pop_class()


def kv():
    """Context manager: allocations made inside it on this thread are KV cache.

    The policy spills KV first and keeps it in its own segments so it can be
    demoted alone.  In global mode the class is passed with each allocation;
    in scoped mode the allocations also go to cxlalloc's KV ``MemPool`` of the
    current GPU.  Frees may happen anywhere (inside or outside the scope).
    Without :func:`enable` it only tags allocations of a direct
    :class:`cxlalloc.Allocator` that ask for the scope's class.
    """
    return _class_scope("kv", pools=True)


def weights():
    """Context manager: allocations made inside it on this thread are model
    weights (kept on the device while there is room, demoted last).  In scoped
    mode weights stay with torch's allocator (only the class is recorded)."""
    return _class_scope("weight", pools=False)


def memory_summary(device=None, use_rich: Optional[bool] = None) -> str:
    """A readable table of cxlalloc's tiers for ``device`` (default: current).

    Rows: device and host tier (allocated, reserved, peaks, limit), KV /
    weight / other bytes per tier, spilled / demoted / promoted totals, the
    host NUMA node and why it was chosen, the backend and the mode.  Rendered
    with ``rich`` when it is installed (``use_rich=False`` forces plain text).

    Raises:
        RuntimeError: cxlalloc is not enabled.
    """
    s = stats(device)
    d = _current_device(device)
    return format_summary(s, title=f"cxlalloc memory summary (cuda:{d}, mode {s.get('mode')})", use_rich=use_rich)


def format_summary(s: dict, title: str = "cxlalloc memory summary", use_rich: Optional[bool] = None) -> str:
    """Render a :func:`stats`-style dict as a table (see :func:`memory_summary`)."""
    dev, host = s["device"], s["host"]
    fb = format_bytes
    tier_rows = [
        ["device tier (VRAM)", fb(dev["allocated_bytes"]), fb(dev["reserved_bytes"]), fb(dev["peak_allocated_bytes"]),
         fb(dev["peak_reserved_bytes"]), fb(dev["limit_bytes"])],
        [f"host tier (NUMA node {host['numa_node']})", fb(host["allocated_bytes"]), fb(host["reserved_bytes"]),
         fb(host["peak_allocated_bytes"]), fb(host["peak_reserved_bytes"]), fb(host["limit_bytes"])],
    ]
    class_rows = [[name, fb(s[key]["device_bytes"]), fb(s[key]["host_bytes"]), fb(s[key]["peak_device_bytes"]),
                   fb(s[key]["peak_host_bytes"])] for key, name in (("kv", "KV cache"), ("weight", "weights"),
                                                                     ("other", "other"))]
    facts = [
        ("spilled", f"{fb(s['spilled_bytes'])} in {s['spilled_allocations']} allocations"),
        ("demoted", f"{fb(s['demoted_bytes'])} ({s['demotions']} moves)"),
        ("promoted", f"{fb(s['promoted_bytes'])} ({s['promotions']} moves)"),
        ("NUMA node", f"{host['numa_node']}: {s.get('numa_node_reason') or 'n/a'}"),
        ("backend", str(host.get("backend"))),
        ("mode", str(s.get("mode"))),
    ]
    if "spill_reserved_bytes" in s:
        facts.append(("spill pool (scoped)", fb(s["spill_reserved_bytes"])))
    tier_head = ["tier", "allocated", "reserved", "peak allocated", "peak reserved", "limit"]
    class_head = ["class", "on device", "on host", "peak on device", "peak on host"]

    rich = None
    if use_rich is not False:
        try:
            import rich.console
            import rich.table

            rich = sys.modules["rich"]
        except ImportError:
            if use_rich:
                raise
    if rich is not None:
        import io

        buf = io.StringIO()
        con = rich.console.Console(file=buf, width=120, force_terminal=False, color_system=None)
        for head, rows, t in ((tier_head, tier_rows, title), (class_head, class_rows, None)):
            table = rich.table.Table(title=t)
            for i, h in enumerate(head):
                table.add_column(h, justify="left" if i == 0 else "right")
            for r in rows:
                table.add_row(*r)
            con.print(table)
        for k, v in facts:
            con.print(f"{k}: {v}", markup=False, highlight=False)
        return buf.getvalue().rstrip("\n")

    def block(head, rows):
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        fmt = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]

    lines = [title] + block(tier_head, tier_rows) + [""] + block(class_head, class_rows) + [""]
    lines += [f"{k}: {v}" for k, v in facts]
    return "\n".join(lines)
