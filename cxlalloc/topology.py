"""Host NUMA topology for the spill tier: nodes, CXL memory, memory tiers.

A CXL Type-3 memory expander appears in Linux as a *CPU-less NUMA node*, often
onlined into ZONE_MOVABLE and placed in a lower *memory tier*.  This module
reads that picture from sysfs (``/sys``, or ``$CXLALLOC_SYSFS_ROOT``, or any
root you pass: tests use fake trees), chooses the host node for memory that
spills out of VRAM, and binds/verifies page placement.  The work is done by
the C++ engine (``csrc/topology``); these are thin, documented wrappers.

Sizes are bytes.  Node ids are Linux NUMA node ids.
"""

from __future__ import annotations

import io
import os
from typing import Any, Dict, Iterable, List, Optional, Union

from cxlalloc import _C

Topology = Dict[str, Any]
TopologyArg = Union[Topology, str, "os.PathLike[str]", None]

__all__ = [
    "read_topology",
    "choose_host_node",
    "format_topology",
    "numa_bind",
    "page_nodes",
    "check_placement",
    "query_gpu",
    "gpu_nearest_node",
]


def read_topology(sysfs_root: Optional[Union[str, "os.PathLike[str]"]] = None) -> Topology:
    """Read NUMA nodes, memory tiers and CXL devices under ``sysfs_root``.

    ``sysfs_root`` defaults to ``$CXLALLOC_SYSFS_ROOT`` or ``/sys``.  Never raises
    for missing or garbled files: each problem becomes a sentence in
    ``result["warnings"]``.  Returns a dict::

        {"sysfs_root": str,
         "nodes": [{"id", "total_bytes", "free_bytes", "cpus": [int], "has_cpu",
                    "has_memory", "movable_only", "movable_bytes", "memory_tier" (-1 unknown),
                    "distance": {node: SLIT distance}, "cxl", "cxl_detail"}],
         "cxl_bus_present": bool, "cxl_regions": [str], "cxl_memdevs": [str],
         "demotion_enabled": bool, "memory_tiers": {tier: [node]}, "warnings": [str]}

    ``movable_only`` means all of the node's memory is ZONE_MOVABLE, where the CUDA
    driver's pinned memory cannot live; ``cxl`` means a CXL region or dax kmem
    device backs the node (``cxl_detail`` says which).
    """
    return _C.read_topology(None if sysfs_root is None else os.fspath(sysfs_root))


def choose_host_node(
    topology: TopologyArg = None,
    gpu_near_node: int = -1,
    requested: Union[str, int] = "auto",
    exclude_nodes: Iterable[int] = (),
) -> Dict[str, Any]:
    """Choose the host NUMA node for host-tier (spilled) memory.

    ``topology`` is a :func:`read_topology` dict, a sysfs root, or None (read the
    default root).  ``gpu_near_node`` is the GPU's nearest host node (-1 unknown;
    see :func:`gpu_nearest_node`).  ``requested`` is ``"auto"`` or a node id (the
    ``numa_node`` option).  ``exclude_nodes`` are NUMA nodes that are GPU memory
    (Grace Hopper), never host memory.

    "auto" prefers CPU-less memory nodes (CXL candidates) nearest the GPU's node by
    SLIT distance (ties: more free memory, then lower id), else the GPU's node, else
    the first node with memory.  Returns ``{"node": int, "reason": str, "warnings":
    [str]}``; the reason is a sentence such as ``"node 2: CPU-less memory node (CXL
    candidate), distance 20 from GPU's node 0, 128.00 GiB free"`` and repeats any
    warning (e.g. the node is all ZONE_MOVABLE).

    Raises ValueError naming ``numa_node`` and the allowed values for an id that
    does not exist or has no memory.
    """
    return _C.choose_host_node(topology, int(gpu_near_node), requested, list(exclude_nodes))


def numa_bind(ptr: int, length: int, node: int, simulated_driver: Optional[str] = None) -> None:
    """Bind ``length`` bytes at address ``ptr`` to host node ``node`` (MPOL_BIND).

    Call before the pages are first touched; ``ptr`` must be page-aligned and
    mapped.  Raises ValueError (bad range, or a node that is not an online node
    with memory) or CudaUnavailableError (memory policies refused here), with the
    errno text.  ``simulated_driver``: path of the simulated driver to bind through.
    """
    _C.numa_bind(int(ptr), int(length), int(node), simulated_driver)


def page_nodes(ptr: int, length: int, simulated_driver: Optional[str] = None) -> Dict[int, int]:
    """Bytes of ``[ptr, ptr+length)`` backed by each NUMA node right now.

    Faults nothing in: untouched pages (and the shared zero page) count under key
    -1.  The values sum to ``length``.  Use it to verify a placement.
    """
    return _C.page_nodes(int(ptr), int(length), simulated_driver)


def check_placement(ptr: int, length: int, node: int, simulated_driver: Optional[str] = None) -> Dict[str, Any]:
    """Verify that every byte of ``[ptr, ptr+length)`` is populated and on ``node``.

    Returns ``{"ok": bool, "on_node", "elsewhere", "unpopulated" (bytes), "method":
    "move_pages" | "simulated", "detail": "verified by move_pages: 2.00 MiB on node 0"}``.
    A placement is never claimed without such a check.
    """
    return _C.check_placement(int(ptr), int(length), int(node), simulated_driver)


def query_gpu(libcuda: str = "libcuda.so.1", device: int = 0, simulated: bool = False) -> Dict[str, Any]:
    """Host-memory capabilities of GPU ``device`` (attributes, PCI ids, HOST_NUMA_ID).

    Attributes the driver rejects read as 0/-1 and are explained in ``"notes"``.
    ``"backend_support"`` summarises which host-tier backends the GPU allows.
    Raises CudaUnavailableError when the driver cannot be loaded.
    """
    return _C.query_gpu(libcuda, int(device), bool(simulated))


def gpu_nearest_node(gpu: Dict[str, Any], topology: TopologyArg = None) -> int:
    """The GPU's nearest host node: ``gpu["host_numa_id"]`` if >= 0, else the
    ``numa_node`` of its PCI function (``bus/pci/devices/DDDD:BB:DD.0``) under the
    topology's sysfs root, else -1."""
    return _C.gpu_nearest_node(gpu, topology)


# --- formatting -------------------------------------------------------------


def _bytes(n: int) -> str:
    """Same rendering as the engine's format_bytes: "1.50 GiB", "123 B"."""
    if n < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024.0
        if v < 1024.0 or unit == "PiB":
            return f"{v:.2f} {unit}"
    raise AssertionError("unreachable")


def _ranges(ids: List[int]) -> str:
    ids = sorted(set(ids))
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


_COLUMNS = ["node", "cpus", "memory", "free", "tier", "zone", "distances", "kind"]


def _rows(topo: Topology, gpu_near_node: int) -> List[List[str]]:
    rows = []
    for n in sorted(topo["nodes"], key=lambda n: n["id"]):
        node = str(n["id"]) + (" (GPU)" if n["id"] == gpu_near_node else "")
        cpus = _ranges(n["cpus"]) if n["cpus"] else ("-" if not n["has_cpu"] else "?")
        if not n["has_memory"]:
            zone = "-"
        elif n["movable_only"]:
            zone = "movable"
        elif n.get("movable_bytes", 0):
            zone = "normal+movable"
        else:
            zone = "normal"
        dist = " ".join(f"{k}:{v}" for k, v in sorted((int(k), v) for k, v in n["distance"].items()))
        if n["cxl_detail"]:
            kind = n["cxl_detail"]
        elif n["cxl"]:
            kind = "CXL"
        elif not n["has_memory"]:
            kind = "no memory"
        elif not n["has_cpu"]:
            kind = "CPU-less (CXL candidate)"
        else:
            kind = "CPU node"
        rows.append([
            node,
            cpus,
            _bytes(n["total_bytes"]) if n["has_memory"] else "-",
            _bytes(n["free_bytes"]) if n["has_memory"] else "-",
            str(n["memory_tier"]) if n["memory_tier"] >= 0 else "?",
            zone,
            dist or "?",
            kind,
        ])
    return rows


def _summary(topo: Topology) -> List[str]:
    lines = []
    if topo["cxl_bus_present"]:
        regions = ", ".join(topo["cxl_regions"]) or "none"
        memdevs = ", ".join(topo.get("cxl_memdevs", [])) or "none"
        lines.append(f"CXL bus: present; regions: {regions}; memdevs: {memdevs}")
    else:
        lines.append("CXL bus: absent")
    tiers = "; ".join(
        f"memory_tier{k}: {_ranges(v) or '-'}"
        for k, v in sorted((int(k), v) for k, v in topo["memory_tiers"].items())
    )
    lines.append(f"memory tiers: {tiers or 'none'}")
    lines.append("demotion: " + ("enabled" if topo["demotion_enabled"] else "disabled"))
    return lines


def format_topology(
    topology: TopologyArg = None,
    *,
    gpu_near_node: int = -1,
    use_rich: Optional[bool] = None,
) -> str:
    """A readable table of the topology (one row per node) plus CXL, tier and
    demotion lines and any warnings.

    ``topology`` is a :func:`read_topology` dict, a sysfs root, or None.  The node
    nearest the GPU is marked "(GPU)".  ``use_rich``: None renders with ``rich``
    when it is importable, else plain text; True requires rich; False forces
    plain text (stable output for logs and tests).
    """
    if topology is None or not isinstance(topology, dict):
        topology = read_topology(topology)
    title = f"NUMA topology (sysfs: {topology['sysfs_root']})"
    rows = _rows(topology, gpu_near_node)
    tail = _summary(topology)
    warnings = list(topology["warnings"])

    rich_mod = None
    if use_rich is not False:
        try:
            import rich.console
            import rich.table

            rich_mod = rich
        except ImportError:
            if use_rich:
                raise
    if rich_mod is not None:
        table = rich_mod.table.Table(title=title)
        for c in _COLUMNS:
            table.add_column(c)
        for r in rows:
            table.add_row(*r)
        buf = io.StringIO()
        console = rich_mod.console.Console(file=buf, width=140, force_terminal=False, color_system=None)
        console.print(table)
        for line in tail:
            console.print(line, markup=False, highlight=False)
        for w in warnings:
            console.print(f"warning: {w}", markup=False, highlight=False)
        return buf.getvalue().rstrip("\n")

    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(_COLUMNS)]
    fmt = lambda cells: "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()  # noqa: E731
    lines = [title, fmt(_COLUMNS), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows] or ["(no NUMA nodes found)"]
    lines += tail
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)
