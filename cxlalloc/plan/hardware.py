"""GPU and link figures for the planner: datasheet presets and measured records.

Every preset figure is a vendor datasheet number, listed with its public
source in docs/sources.md#planner-figures; measured figures come from
``cxlalloc bench`` records (``ceilings.json``: ``summary.hbm_read_gbps`` and
``summary.link[backend].zero_copy_read_gbps``) and replace the datasheet ones
when a record of the same GPU is found.  Units: bytes, GB/s = 1e9 bytes/s,
TFLOPS = 1e12 FLOP/s.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Dict, List, Optional, Tuple

GB = 1e9


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU model.

    Attributes:
        name: display name; ``match``: substring of a bench record's GPU name.
        hbm_bytes: VRAM (decimal bytes, as datasheets give it).
        hbm_gbps: HBM bandwidth (datasheet peak, or measured kernel read rate).
        bf16_tflops: dense BF16 tensor throughput (no sparsity).
        link_gbps: host link per direction (PCIe theoretical, see sources).
        source: where the figures come from.
    """

    key: str
    name: str
    match: str
    hbm_bytes: float
    hbm_gbps: float
    bf16_tflops: float
    link_gbps: float
    link_name: str
    source: str


# docs/sources.md#planner-figures (NVIDIA datasheets / product pages; PCIe arithmetic).
GPUS: Dict[str, GPU] = {
    "h100": GPU("h100", "NVIDIA H100 SXM 80 GB", "H100", 80e9, 3350.0, 989.0, 63.0, "PCIe 5.0 x16",
                "datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense BF16"),
    "h200": GPU("h200", "NVIDIA H200 SXM 141 GB", "H200", 141e9, 4800.0, 989.0, 63.0, "PCIe 5.0 x16",
                "datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16"),
    "b200": GPU("b200", "NVIDIA B200 (HGX) 180 GB", "B200", 180e9, 8000.0, 2250.0, 63.0, "PCIe 5.0 x16",
                "datasheet: 180 GB HBM3e per GPU in DGX/HGX B200, 8 TB/s, 2.25 PFLOPS dense BF16"),
    "l40s": GPU("l40s", "NVIDIA L40S 48 GB", "L40S", 48e9, 864.0, 362.0, 31.5, "PCIe 4.0 x16",
                "datasheet: 48 GB GDDR6, 864 GB/s, 362 TFLOPS dense BF16"),
}

# Host / CXL memory node presets: bandwidth of the memory itself (the GPU reads it over the link,
# so the rate used is min(link, node)).  docs/sources.md#planner-figures.
HOST_NODES: Dict[str, Tuple[float, str]] = {
    "dram": (300.0, "8-channel DDR5-4800 socket: 8 x 38.4 GB/s = 307 GB/s peak (the link binds first)"),
    "cxl-x8": (36.0, "one CXL 2.0 x8 expander (Micron CZ120: up to 36 GB/s, vendor figure)"),
    "cxl-x16": (63.0, "one CXL x16 expander at the PCIe 5.0 x16 rate (63 GB/s per direction, arithmetic)"),
}


def gpu_preset(key: str) -> GPU:
    """The preset named ``key`` (``h100``, ``h200``, ``b200``, ``l40s``).

    Raises:
        ValueError: an unknown name (the message lists the presets).
    """
    k = str(key).lower()
    if k not in GPUS:
        raise ValueError(f"--gpu must be one of {', '.join(GPUS)}, got {key!r}")
    return GPUS[k]


def _records(paths: List[str]) -> List[str]:
    out: List[str] = []
    for p in paths:
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            out += sorted(glob.glob(os.path.join(p, "**", "ceilings.json"), recursive=True))
    return out


def measured_ceilings(gpu: GPU, paths: List[str]) -> Optional[Dict[str, Any]]:
    """The newest ``ceilings`` record among ``paths`` (files, or folders searched
    for ``ceilings.json``) whose GPU name contains ``gpu.match`` and that holds
    a measured HBM read rate, as ``{"path", "hbm_gbps", "link_gbps",
    "link_backend", "gpu", "date"}`` (``link_gbps`` None when no host-tier rate
    was measured), or None."""
    best = None
    for path in _records(paths):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if rec.get("benchmark") not in (None, "ceilings") or rec.get("simulated"):
            continue
        name = str(((rec.get("hardware") or {}).get("gpu") or {}).get("name") or "")
        summ = rec.get("summary") or {}
        if gpu.match.lower() not in name.lower() or not summ.get("hbm_read_gbps"):
            continue
        link, backend = None, None
        for b, v in sorted((summ.get("link") or {}).items()):
            r = (v or {}).get("zero_copy_read_gbps")
            if r and (link is None or r > link):
                link, backend = float(r), b
        cand = {"path": path, "hbm_gbps": float(summ["hbm_read_gbps"]), "link_gbps": link, "link_backend": backend,
                "gpu": name, "date": rec.get("date_utc")}
        if best is None or str(cand["date"]) > str(best["date"]):
            best = cand
    return best


def host_node(key: str) -> Tuple[float, str]:
    """Bandwidth (GB/s) and source of a host/CXL node preset.

    Raises:
        ValueError: an unknown name.
    """
    k = str(key).lower()
    if k not in HOST_NODES:
        raise ValueError(f"--host-node must be one of {', '.join(HOST_NODES)} or a number of GB/s, got {key!r}")
    return HOST_NODES[k]


def from_info(info: Dict[str, Any]) -> Dict[str, Any]:
    """Host/CXL memory and VRAM from a ``cxlalloc info --json`` record (or
    ``{"numa": {"topology": read_topology(), ...}}`` for this machine).

    Host bytes: the total of the CPU-less / CXL memory nodes if there are any
    (where cxlalloc's ``auto`` node choice puts the host tier), else the node
    ``auto`` picks (else the largest node).  Per GPU: divided by the GPUs
    listed (at least 1).  ``hbm_bytes``: the first GPU's memory, if listed.

    Returns ``{"host_bytes_per_gpu", "host_nodes", "gpus", "hbm_bytes", "gpu_name", "source"}``.

    Raises:
        ValueError: the record lists no memory node.
    """
    numa = info.get("numa") or {}
    nodes = [n for n in ((numa.get("topology") or {}).get("nodes") or [])
             if n.get("has_memory", True) and (n.get("total_bytes") or 0) > 0]
    if not nodes:
        raise ValueError("--info: the record lists no NUMA node with memory (numa.topology.nodes)")
    far = [n for n in nodes if n.get("cxl") or not n.get("has_cpu", True)]
    if far:
        chosen, what = far, "CPU-less/CXL node"
    else:
        auto = (numa.get("auto_node") or {}).get("node")
        chosen = [n for n in nodes if n.get("id") == auto] or [max(nodes, key=lambda n: n["total_bytes"])]
        what = "host node"
    devs = list(((info.get("gpu") or {}).get("devices")) or [])
    n_gpus = max(1, len(devs))
    total = sum(int(n["total_bytes"]) for n in chosen)
    ids = ", ".join(str(n.get("id")) for n in chosen)
    return {"host_bytes_per_gpu": total / n_gpus, "host_nodes": [n.get("id") for n in chosen], "gpus": len(devs),
            "hbm_bytes": float(devs[0]["total_bytes"]) if devs and devs[0].get("total_bytes") else None,
            "gpu_name": devs[0].get("name") if devs else None,
            "source": f"cxlalloc info: {what}{'s' if len(chosen) > 1 else ''} {ids}, {total / 1e9:.1f} GB"
                      + (f" over {n_gpus} GPUs" if n_gpus > 1 else "")}


def info_here() -> Dict[str, Any]:
    """This machine's NUMA topology in the shape :func:`from_info` reads (no GPU query)."""
    from cxlalloc import topology

    topo = topology.read_topology()
    return {"numa": {"topology": topo, "auto_node": topology.choose_host_node(topo, -1, "auto")}}


def gpu_tier_nodes(info: Optional[Dict[str, Any]], gpus: int) -> List[Dict[str, Any]]:
    """The host/CXL node each of ``gpus`` GPUs' tier would use, from a
    ``cxlalloc info --json`` record, by the rule of ``numa_node="auto"``
    (:func:`cxlalloc.topology.choose_host_node`): a CPU-less/CXL node nearest
    the GPU's own node by SLIT distance (ties: more free memory, then the lower
    id), else the GPU's own node.  A GPU past the record's list, or without a
    record, gets ``{"node": None}``.

    Returns one ``{"gpu", "near_node", "node", "node_bytes", "kind"}`` per GPU
    (``node_bytes``: the node's memory; ``kind``: ``"cxl"`` / ``"cpu-less"`` / ``"host"``).
    """
    out: List[Dict[str, Any]] = []
    devs = list(((info or {}).get("gpu") or {}).get("devices") or [])
    nodes = [n for n in ((((info or {}).get("numa") or {}).get("topology") or {}).get("nodes") or [])
             if n.get("has_memory", True) and (n.get("total_bytes") or 0) > 0]
    far = [n for n in nodes if n.get("cxl") or not n.get("has_cpu", True)]
    for i in range(gpus):
        near = devs[i].get("host_numa_id") if i < len(devs) else None
        near = near if isinstance(near, int) and near >= 0 else None
        chosen = None
        if i < len(devs) and nodes:
            if far:
                def dist(n):
                    d = (n.get("distance") or {})
                    v = d.get(str(near), d.get(near)) if near is not None else None
                    return (v if isinstance(v, (int, float)) else 1 << 30, -(n.get("free_bytes") or 0), n.get("id"))
                chosen = min(far, key=dist)
            else:
                chosen = next((n for n in nodes if n.get("id") == near), None) or \
                    next((n for n in nodes if n.get("id") == ((info.get("numa") or {}).get("auto_node") or {})
                          .get("node")), None) or max(nodes, key=lambda n: n["total_bytes"])
        out.append({"gpu": i, "near_node": near, "node": chosen.get("id") if chosen else None,
                    "node_bytes": float(chosen["total_bytes"]) if chosen else None,
                    "kind": None if chosen is None else ("cxl" if chosen.get("cxl") else
                                                        "cpu-less" if not chosen.get("has_cpu", True) else "host")})
    return out
