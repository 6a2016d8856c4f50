"""Fake sysfs trees for topology tests.

``FakeSysfs(root)`` writes the files and symlinks a Linux kernel exposes for
NUMA nodes, memory blocks, memory tiers, CXL regions and DAX devices, laid out
as on a real machine (paths and formats from Documentation/ABI: stable/
sysfs-devices-node, testing/sysfs-devices-memory, testing/sysfs-kernel-mm-
memory-tiers, testing/sysfs-bus-cxl, testing/sysfs-bus-dax, and observed on
kernel 6.18).  Pass ``str(root)`` as the sysfs root (or set
``CXLALLOC_SYSFS_ROOT``).

Typical use::

    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-7", mem_gib=64, free_gib=60)
    fs.node(2, cpus="", mem_gib=128, free_gib=120, zone="Movable")   # CXL node
    fs.distances({0: {0: 10, 2: 14}, 2: {0: 14, 2: 10}})
    fs.tiers({4: "0", 22: "2"})
    fs.cxl_region(0, target_node=2, size_gib=128)
    fs.finish()              # writes online/has_cpu/has_memory/... from the nodes
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

GiB = 1 << 30
BLOCK_BYTES = 128 << 20  # x86 default memory block size (block_size_bytes "8000000")
BIG_BLOCK_BYTES = 2 << 30  # x86 machines with much memory use 2 GiB blocks


def parse_list(text: str) -> List[int]:
    out: List[int] = []
    for tok in filter(None, text.strip().split(",")):
        lo, _, hi = tok.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def fmt_list(ids) -> str:
    ids = sorted(set(ids))
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def meminfo(node: int, total: int, free: int) -> str:
    """nodeN/meminfo as drivers/base/node.c prints it (values in kB)."""
    kb = lambda b: b // 1024  # noqa: E731
    used = total - free
    rows = [
        ("MemTotal", kb(total)), ("MemFree", kb(free)), ("MemUsed", kb(used)),
        ("SwapCached", 0), ("Active", kb(used) // 2), ("Inactive", kb(used) // 4),
        ("Active(anon)", 1520), ("Inactive(anon)", 3764), ("Active(file)", 84620),
        ("Inactive(file)", 114112), ("Unevictable", 0), ("Mlocked", 0), ("Dirty", 168),
        ("Writeback", 0), ("FilePages", 207520), ("Mapped", 10608), ("AnonPages", 9120),
        ("Shmem", 8788), ("KernelStack", 1364), ("PageTables", 2000), ("SecPageTables", 0),
        ("NFS_Unstable", 0), ("Bounce", 0), ("WritebackTmp", 0), ("KReclaimable", 81748),
        ("Slab", 104304), ("SReclaimable", 81748), ("SUnreclaim", 22556),
        ("AnonHugePages", 0), ("ShmemHugePages", 0), ("ShmemPmdMapped", 0),
        ("FileHugePages", 0), ("FilePmdMapped", 0),
    ]
    lines = [f"Node {node} {k + ':':<16}{v:>8} kB" for k, v in rows]
    lines += [f"Node {node} HugePages_Total:     0", f"Node {node} HugePages_Free:      0",
              f"Node {node} HugePages_Surp:      0"]
    return "\n".join(lines) + "\n"


class FakeSysfs:
    def __init__(self, root: Path, block_bytes: int = BIG_BLOCK_BYTES):
        self.root = Path(root)
        self.block_bytes = block_bytes
        self.nodes: Dict[int, dict] = {}
        self._next_block = 0
        self._dist: Optional[Dict[int, Dict[int, int]]] = None

    # -- low level -----------------------------------------------------------
    def write(self, rel: str, text: str) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def write_bytes(self, rel: str, data: bytes) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return p

    def symlink(self, rel: str, target_rel: str) -> None:
        """rel -> target_rel (both relative to the root), as a relative link like sysfs."""
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        target = self.root / target_rel
        if not target.exists():
            target.mkdir(parents=True)
        os.symlink(os.path.relpath(target, p.parent), p)

    def remove(self, rel: str) -> None:
        (self.root / rel).unlink()

    def __str__(self) -> str:
        return str(self.root)

    # -- NUMA nodes ----------------------------------------------------------
    def node(self, nid: int, cpus: str = "", mem_gib: float = 0, free_gib: float = 0,
             zone: str = "Normal", blocks: Optional[int] = None, offline_blocks: int = 0,
             block_links: str = "node") -> None:
        """A NUMA node: cpulist, meminfo, and its memory blocks.

        zone: valid_zones of its online blocks ("Normal", "Movable", or a list per block).
        block_links: "node" (nodeN/memoryM links, CONFIG_NUMA), "memory" (only the
        memoryM/nodeN links), or "none".
        """
        total, free = int(mem_gib * GiB), int(free_gib * GiB)
        d = f"devices/system/node/node{nid}"
        self.write(f"{d}/cpulist", cpus + "\n")
        self.write(f"{d}/meminfo", meminfo(nid, total, free))
        zones = zone if isinstance(zone, list) else None
        if blocks is not None:
            n_blocks = blocks
        elif zones:
            n_blocks = len(zones)
        else:  # as many blocks as the memory fills
            n_blocks = -(-total // self.block_bytes)
        for i in range(n_blocks + offline_blocks):
            m = self._next_block
            self._next_block += 1
            bd = f"devices/system/memory/memory{m}"
            online = i < n_blocks
            # Only what the reader uses (a real block also has online,
            # phys_index, phys_device, removable, uevent): keeps trees small.
            self.write(f"{bd}/state", "online\n" if online else "offline\n")
            z = (zones[i] if zones else zone) if online else "Normal Movable"
            self.write(f"{bd}/valid_zones", z + "\n")
            if block_links in ("node", "memory"):
                self.symlink(f"{bd}/node{nid}", d)
            if block_links == "node":
                self.symlink(f"{d}/memory{m}", bd)
        self.nodes[nid] = {"cpus": parse_list(cpus), "total": total, "zone": zone}

    def distances(self, matrix: Dict[int, Dict[int, int]]) -> None:
        self._dist = matrix

    def tiers(self, tiers: Dict[int, str], file: str = "nodelist") -> None:
        for k, nodes in tiers.items():
            self.write(f"devices/virtual/memory_tiering/memory_tier{k}/{file}", nodes + "\n")

    def demotion(self, enabled: bool) -> None:
        self.write("kernel/mm/numa/demotion_enabled", "true\n" if enabled else "false\n")

    # -- CXL / DAX -----------------------------------------------------------
    def cxl_bus(self, memdevs: int = 1) -> None:
        self.write("devices/platform/ACPI0017:00/root0/uevent", "")
        self.symlink("bus/cxl/devices/root0", "devices/platform/ACPI0017:00/root0")
        self.symlink("bus/cxl/devices/decoder0.0", "devices/platform/ACPI0017:00/root0/decoder0.0")
        for i in range(memdevs):
            pci = f"devices/pci0000:0c/0000:0c:00.0/0000:0d:00.0/mem{i}"
            self.write(f"{pci}/numa_node", "0\n")
            self.write(f"{pci}/serial", f"0x{i:x}\n")
            self.symlink(f"bus/cxl/devices/mem{i}", pci)
        self.write("bus/dax/drivers/kmem/uevent", "")
        self.write("bus/dax/drivers/device_dax/uevent", "")

    def cxl_region(self, r: int, target_node: int, size_gib: float, mode: str = "ram",
                   driver: str = "kmem") -> None:
        """regionR with dax_regionR/daxR.0 whose memory (kmem) is target_node."""
        if not (self.root / "bus/cxl").exists():
            self.cxl_bus()
        reg = f"devices/platform/ACPI0017:00/root0/decoder0.0/region{r}"
        self.write(f"{reg}/mode", mode + "\n")
        self.write(f"{reg}/size", hex(int(size_gib * GiB)) + "\n")
        self.write(f"{reg}/interleave_ways", "1\n")
        self.write(f"{reg}/commit", "1\n")
        self.symlink(f"bus/cxl/devices/region{r}", reg)
        self.symlink(f"bus/cxl/devices/dax_region{r}", f"{reg}/dax_region{r}")
        self._dax(f"{reg}/dax_region{r}/dax{r}.0", f"dax{r}.0", target_node, size_gib, driver)

    def hmem_dax(self, name: str, target_node: int, size_gib: float, driver: str = "kmem") -> None:
        """Soft-reserved memory (dax_hmem), not linked to a CXL region."""
        self._dax(f"devices/platform/hmem.0/{name}", name, target_node, size_gib, driver)

    def pmem_dax(self, name: str, target_node: int, size_gib: float, driver: str = "kmem") -> None:
        """An NVDIMM namespace's dax device (not CXL)."""
        self._dax(f"devices/LNXSYSTM:00/LNXSYBUS:00/ACPI0012:00/ndbus0/region0/dax0.0/{name}",
                  name, target_node, size_gib, driver)

    def _dax(self, devpath: str, name: str, target_node: int, size_gib: float, driver: str) -> None:
        self.write(f"{devpath}/target_node", f"{target_node}\n")
        self.write(f"{devpath}/numa_node", "0\n")
        self.write(f"{devpath}/size", f"{int(size_gib * GiB)}\n")
        self.write(f"bus/dax/drivers/{driver}/uevent", "")
        self.symlink(f"{devpath}/driver", f"bus/dax/drivers/{driver}")
        self.symlink(f"bus/dax/devices/{name}", devpath)

    def pci_gpu(self, bdf: str, numa_node: int) -> None:
        self.write(f"devices/pci0000:00/{bdf}/numa_node", f"{numa_node}\n")
        self.write(f"devices/pci0000:00/{bdf}/class", "0x030200\n")
        self.symlink(f"bus/pci/devices/{bdf}", f"devices/pci0000:00/{bdf}")

    # -- node-state lists ----------------------------------------------------
    def finish(self, movable_only_nodes=None, skip=()) -> "FakeSysfs":
        """Write online/possible/has_* lists and distance rows from the nodes.

        has_normal_memory excludes nodes whose zone is "Movable" (unless
        movable_only_nodes is given).  `skip`: names of list files not to write.
        """
        ids = sorted(self.nodes)
        with_mem = [i for i in ids if self.nodes[i]["total"] > 0]
        movable = (movable_only_nodes if movable_only_nodes is not None
                   else [i for i in with_mem if self.nodes[i]["zone"] == "Movable"])
        lists = {
            "online": ids,
            "possible": list(range(max(ids) + 1)) if ids else [],
            "has_cpu": [i for i in ids if self.nodes[i]["cpus"]],
            "has_memory": with_mem,
            "has_normal_memory": [i for i in with_mem if i not in movable],
            "has_generic_initiator": [],
        }
        for name, v in lists.items():
            if name not in skip:
                self.write(f"devices/system/node/{name}", fmt_list(v) + "\n")
        if "block_size_bytes" not in skip:
            self.write("devices/system/memory/block_size_bytes", f"{self.block_bytes:x}\n")
        for i in ids:
            if self._dist is not None:
                row = [self._dist[i][j] for j in ids]
            else:
                row = [10 if i == j else 20 for j in ids]
            self.write(f"devices/system/node/node{i}/distance", " ".join(map(str, row)) + "\n")
        return self


# -- ready-made machines -------------------------------------------------------


def single_node(root: Path) -> FakeSysfs:
    """This CI box: one node with 2 CPUs, memory_tier4, demotion off, no CXL."""
    fs = FakeSysfs(root, block_bytes=BLOCK_BYTES)
    fs.node(0, cpus="0-1", mem_gib=8, free_gib=5)
    fs.tiers({4: "0"})
    fs.demotion(False)
    return fs.finish()


def two_sockets(root: Path) -> FakeSysfs:
    fs = FakeSysfs(root, block_bytes=BIG_BLOCK_BYTES)
    fs.node(0, cpus="0-7,16-23", mem_gib=64, free_gib=60)
    fs.node(1, cpus="8-15,24-31", mem_gib=64, free_gib=50)
    fs.distances({0: {0: 10, 1: 21}, 1: {0: 21, 1: 10}})
    fs.tiers({4: "0-1"})
    fs.demotion(False)
    return fs.finish()


def two_sockets_cxl(root: Path, zone: str = "Movable") -> FakeSysfs:
    """Two sockets plus CXL node 2 (region0, 128 GiB, kmem, lower memory tier)."""
    fs = FakeSysfs(root, block_bytes=BIG_BLOCK_BYTES)
    fs.node(0, cpus="0-7,16-23", mem_gib=64, free_gib=60)
    fs.node(1, cpus="8-15,24-31", mem_gib=64, free_gib=50)
    fs.node(2, cpus="", mem_gib=128, free_gib=127, zone=zone)
    fs.distances({0: {0: 10, 1: 21, 2: 14}, 1: {0: 21, 1: 10, 2: 24}, 2: {0: 14, 1: 24, 2: 10}})
    fs.tiers({4: "0-1", 22: "2"})
    fs.demotion(True)
    fs.cxl_region(0, target_node=2, size_gib=128)
    return fs.finish()
