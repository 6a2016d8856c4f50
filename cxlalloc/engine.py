"""Building and configuring engines (``cxlalloc._C.Engine``) from a Config:
driver choice, simulation set-up, per-device defaults and host NUMA node
choice.  Shared by :class:`cxlalloc.Allocator`, :func:`cxlalloc.enable`
(:mod:`cxlalloc.pytorch`), ``cxlalloc info`` and :mod:`cxlalloc.hf`.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Optional

from cxlalloc import _C, topology
from cxlalloc import _sim as simulator
from cxlalloc.config import Config, format_bytes, resolve_fraction

# Defaults (bytes).  The CUDA context, cuBLAS/cuDNN handles and kernels of a
# process take a few hundred MiB of VRAM outside any allocator; 256 MiB is
# what the default device_limit leaves for them (measured on a GPU: pending,
# README "Limits").
CONTEXT_RESERVE = 256 << 20
DEFAULT_SIM_VRAM = 16 << 30
MAX_SIM_VRAM = 1 << 50
HOST_LIMIT_FRACTION = 0.8
CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = 134

_sim_lock = threading.Lock()
_sim_vram: Optional[int] = None  # VRAM the simulator was configured with by us


def driver_path(cfg: Config) -> str:
    """Path of the driver library to load: the simulator or libcuda."""
    if cfg.simulate:
        return simulator.library_path()
    return cfg.libcuda


def ensure_sim(cfg: Config, devices: int = 1) -> None:
    """Configure the process-wide simulated GPU for `cfg` (simulation only).

    The simulated VRAM is ``sim_vram`` when given; otherwise a simulator
    already configured is kept if ``device_limit`` fits in it and it has at
    least ``devices`` GPUs, else it is configured with max(16 GiB,
    device_limit, its VRAM now) and ``devices`` GPUs (at least the GPUs it
    has when ``devices`` > 1; a resize for one GPU configures one, as
    before).  VRAM is lazily backed: only touched bytes cost RAM.

    Raises:
        ValueError: the simulator must change size while in use (live resources).
    """
    global _sim_vram
    need = cfg.device_limit if isinstance(cfg.device_limit, int) else 0
    if need > MAX_SIM_VRAM:
        raise ValueError(f"cxlalloc option 'device_limit': {format_bytes(need)} is more than the simulated GPU can "
                         f"model ({format_bytes(MAX_SIM_VRAM)})")
    with _sim_lock:
        sim = simulator.Sim()
        # Asked only for several GPUs: counting them calls the driver (cuInit), which tests arming faults count.
        have = sim.device_count() if devices > 1 else 1
        more = have < devices
        if cfg.sim_vram is None:
            if _sim_vram is not None and need <= _sim_vram and not more:
                return
            vram = max(DEFAULT_SIM_VRAM, need, _sim_vram or 0)
            why = f"device_limit={format_bytes(need)}" if need > DEFAULT_SIM_VRAM else "the default"
        else:
            if cfg.sim_vram == _sim_vram and not more:
                return
            vram = cfg.sim_vram
            why = f"sim_vram={format_bytes(vram)}"
        if more:
            why = f"{devices} simulated GPUs"
        try:
            sim.configure(f"devices={max(have, devices, 1)},vram={vram}")
        except ValueError as e:
            now = format_bytes(_sim_vram) if _sim_vram is not None else "its default"
            if more:  # the GPU count is what must change (the VRAM may be the same)
                change = f"{devices} simulated GPUs need it to have {devices} GPUs ({have} now, {now} of VRAM each)"
            else:
                change = f"{why} needs it resized to {format_bytes(vram)} ({now} of VRAM now)"
            raise ValueError(
                f"cxlalloc: the simulated driver is one per process and {change}, which is impossible while "
                f"simulated resources are alive ({e}); free the other simulated Allocators/models first, or ask "
                "for no more GPUs or VRAM than it has") from None
        _sim_vram = vram


class HostLimitWarning(UserWarning):
    """A ``host_limit`` beyond the host node's memory was clamped to it (said once per node and limit)."""


_clamped_said = set()


def clamp_host_limit(host_limit: int, node: int, option: str = "host_limit") -> int:
    """``host_limit`` (bytes), or the memory of NUMA node ``node`` when it is
    more than that: a tier larger than its node can never fill, and its last
    pages would be the kernel's OOM killer's instead of an ``OutOfMemoryError``
    naming the limit.  Said once (:class:`HostLimitWarning`) per node and limit.
    Without a NUMA topology to read, ``host_limit`` is returned as given."""
    total = _node_total_bytes(node)
    if not total or host_limit <= total:
        return host_limit
    if (node, host_limit) not in _clamped_said:
        _clamped_said.add((node, host_limit))
        warnings.warn(f"cxlalloc option '{option}': {format_bytes(host_limit)} is more than NUMA node {node}'s memory "
                      f"({format_bytes(total)}); using {format_bytes(total)} (the host tier cannot outgrow its node; "
                      f"give host_limit <= {format_bytes(total)} to silence this)", HostLimitWarning, stacklevel=4)
    return total


def new_engine(cfg: Config) -> "_C.Engine":
    """Load the driver named by `cfg` into a fresh engine.

    Raises:
        cxlalloc.CudaUnavailableError: no usable driver (the message says
            why and points to ``simulate=True``).
    """
    if cfg.simulate:
        ensure_sim(cfg)
    return _C.Engine(driver_path(cfg), bool(cfg.simulate))


def choose_node(engine: "_C.Engine", device: int, requested) -> dict:
    """Pick the host NUMA node of `device`'s host tier.

    Returns ``{"node": int, "reason": str}``.  ``requested`` is "auto" or an
    int; see :func:`cxlalloc.topology.choose_host_node` for the rule.

    Raises:
        ValueError: an explicit node that does not exist or has no memory.
    """
    near = engine.attribute(device, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, -1)
    return topology.choose_host_node(None, near, requested)


def oom_hint(example: str) -> str:
    """The last sentence of the engine's out-of-memory messages for an allocator
    made by the call in ``example`` (e.g. ``'cxlalloc.hf.wrap(model, ...,
    host_limit="64GiB")'``): the limits are raised there, where they were given
    (the engine's own default names ``CXLALLOC``, which applies only to the
    process-wide engine it configures)."""
    return f"Raise host_limit or device_limit where this allocator is made (e.g. {example})."


def device_options(engine: "_C.Engine", device: int, cfg: Config, default_headroom: float = 0.0,
                   made_by: Optional[str] = None) -> dict:
    """Resolve `cfg` into the engine's per-device configuration dict.

    Fractions become bytes (device_limit of the GPU's total VRAM;
    kv_device_limit and device_headroom of device_limit), defaults are
    filled in, and the host node is chosen.  The dict also carries
    ``"node_reason"`` (popped before it reaches the engine).  ``made_by``: the
    call that makes this allocator, as an example for out-of-memory messages
    (:func:`oom_hint`); None keeps the engine's ``CXLALLOC`` wording.
    """
    free_b, total = engine.mem_info(device)
    if cfg.device_limit is None:
        device_limit = max(free_b - CONTEXT_RESERVE, 0)
    else:
        device_limit = resolve_fraction(cfg.device_limit, total)
    if device_limit <= 0:
        raise ValueError(f"cxlalloc option 'device_limit': resolves to {device_limit} bytes on cuda:{device} "
                         f"({format_bytes(free_b)} free of {format_bytes(total)}); it must be > 0")
    choice = choose_node(engine, device, cfg.numa_node)
    host_limit = cfg.host_limit
    if host_limit is None:
        host_limit = int(HOST_LIMIT_FRACTION * _node_free_bytes(choice["node"]))
    else:
        host_limit = clamp_host_limit(int(host_limit), int(choice["node"]))
    opts = {
        "device_limit": int(device_limit),
        "host_limit": int(host_limit),
        "host_node": int(choice["node"]),
        "backend": cfg.backend,
        "kv_device_limit": resolve_fraction(cfg.kv_device_limit, device_limit),
        "device_headroom": resolve_fraction(
            cfg.device_headroom if cfg.device_headroom is not None else default_headroom, device_limit) or 0,
        "migration_rate": float(cfg.migration_rate),
        "migration_burst": int(max(1 << 30, cfg.migration_rate / 2)),
        "promote_after": int(cfg.promote_after),
        "extent_chunk": int(cfg.extent_chunk or 0),
        "strict_placement": bool(cfg.strict_placement),
        "kv_aware": cfg.policy == "kv-aware",
        "implicit_moves_any_thread": cfg.implicit_moves == "any-thread",
        "host_node_free_bytes": int(_node_free_bytes(choice["node"])),
        "node_reason": choice["reason"],
    }
    if made_by is not None:
        opts["oom_hint"] = oom_hint(made_by)
    return opts


def _node_free_bytes(node: int) -> int:
    topo = topology.read_topology()
    for n in topo["nodes"]:
        if n["id"] == node:
            return int(n["free_bytes"])
    return 0


def _node_total_bytes(node: int) -> int:
    """MemTotal of NUMA node ``node``; 0 when the topology cannot be read or has no such node."""
    try:
        topo = topology.read_topology()
    except Exception:
        return 0
    return next((int(n["total_bytes"]) for n in topo["nodes"] if n["id"] == node), 0)


def extent_chunk_message(extent_chunk: Optional[int], info: dict) -> Optional[str]:
    """What to tell the user when ``extent_chunk`` is not a multiple of the
    allocation granularity of both tiers (``info``: ``DeviceAllocator.info()``):
    the engine rounds it up (csrc/alloc/device_allocator_extents.cpp).  None
    when it is used as given (or not set)."""
    if not extent_chunk:
        return None
    d = int(info.get("device_granularity") or 2 << 20)
    h = int(info.get("host_granularity") or d)
    align = d * h // math.gcd(d, h)
    rounded = -(-int(extent_chunk) // align) * align
    if rounded == extent_chunk:
        return None
    return (f"cxlalloc option 'extent_chunk': {format_bytes(extent_chunk)} is not a multiple of the allocation "
            f"granularity ({format_bytes(align)}); KV extents commit chunks of {format_bytes(rounded)} (use a "
            f"multiple of {format_bytes(align)} to silence this)")


def configure(engine: "_C.Engine", device: int, opts: dict) -> None:
    """Hand resolved per-device options to the engine (before first use)."""
    opts = dict(opts)
    opts.pop("node_reason", None)
    engine.configure_device(device, opts)
