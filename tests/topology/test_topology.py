"""Topology layer: sysfs NUMA/CXL discovery, host node choice, page placement, GPU caps.

Most tests build fake sysfs trees (tests/helpers/fake_sysfs.py); the "real machine"
tests read this box's /sys and bind real pages with mbind/move_pages.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import cxlalloc
from cxlalloc import _C
from cxlalloc import topology as T
from tests.helpers.fake_sysfs import BIG_BLOCK_BYTES, GiB, FakeSysfs, single_node, two_sockets, two_sockets_cxl

PAGE = mmap.PAGESIZE


@pytest.fixture
def tmp_path(request, tmp_path_factory):
    """A fresh directory for a fake sysfs tree, in tmpfs when there is one.

    A tree is a few thousand tiny files and symlinks; on the CI disk that is
    ~7x slower than /dev/shm (0.39 s vs 0.06 s per two-socket + CXL tree).
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="cxlalloc-topo-", dir=shm))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("sysfs")
MOVABLE_WARNING = (
    "node 2's memory is all ZONE_MOVABLE: the CUDA driver's pinned/page-locked memory "
    "(cuMemCreate HOST_NUMA, cuMemHostAlloc, cuMemHostRegister) cannot live there, so host-tier "
    "allocations may fail or be migrated to another node; online it as ZONE_NORMAL "
    "(daxctl reconfigure-device --mode=system-ram --no-movable) to use it for pinned memory"
)


def node(topo, nid):
    (n,) = [n for n in topo["nodes"] if n["id"] == nid]
    return n


# --------------------------------------------------------------------------
# Fake trees: machines
# --------------------------------------------------------------------------


def test_single_node_tree(tmp_path):
    single_node(tmp_path)
    t = T.read_topology(tmp_path)
    assert t["sysfs_root"] == str(tmp_path)
    assert t["warnings"] == []
    assert [n["id"] for n in t["nodes"]] == [0]
    n0 = node(t, 0)
    assert n0["cpus"] == [0, 1]
    assert n0["has_cpu"] and n0["has_memory"]
    assert n0["total_bytes"] == 8 * GiB
    assert n0["free_bytes"] == 5 * GiB
    assert n0["distance"] == {0: 10}
    assert n0["memory_tier"] == 4
    assert not n0["movable_only"] and n0["movable_bytes"] == 0
    assert not n0["cxl"] and n0["cxl_detail"] == ""
    assert t["memory_tiers"] == {4: [0]}
    assert t["demotion_enabled"] is False
    assert t["cxl_bus_present"] is False
    assert t["cxl_regions"] == [] and t["cxl_memdevs"] == []

    c = T.choose_host_node(t, -1, "auto")
    assert c == {
        "node": 0,
        "reason": "node 0: first node with memory (no CPU-less memory node; GPU's host node unknown), 5.00 GiB free",
        "warnings": [],
    }
    c = T.choose_host_node(t, 0, "auto")
    assert c["node"] == 0
    assert c["reason"] == "node 0: the GPU's nearest host node (no CPU-less memory node), 5.00 GiB free"


def test_two_sockets(tmp_path):
    two_sockets(tmp_path)
    t = T.read_topology(tmp_path)
    assert t["warnings"] == []
    assert node(t, 0)["cpus"] == list(range(0, 8)) + list(range(16, 24))
    assert node(t, 1)["cpus"] == list(range(8, 16)) + list(range(24, 32))
    assert node(t, 0)["distance"] == {0: 10, 1: 21}
    assert node(t, 1)["distance"] == {0: 21, 1: 10}
    assert t["memory_tiers"] == {4: [0, 1]}
    assert all(n["memory_tier"] == 4 and n["has_cpu"] for n in t["nodes"])

    # No CPU-less node: the GPU's own node wins, whichever it is.
    c = T.choose_host_node(t, 1, "auto")
    assert (c["node"], c["reason"]) == (
        1, "node 1: the GPU's nearest host node (no CPU-less memory node), 50.00 GiB free")
    c = T.choose_host_node(t, 0, "auto")
    assert c["node"] == 0
    # Explicit choice of the far socket is honoured and explained.
    c = T.choose_host_node(t, 1, "0")
    assert (c["node"], c["reason"]) == (
        0, "node 0: requested (numa_node=0), memory node with CPUs 0-7,16-23, distance 21 from "
           "GPU's node 1, 60.00 GiB free")
    # GPU node unknown: lowest node with memory.
    c = T.choose_host_node(t, -1, "auto")
    assert c["node"] == 0
    assert "GPU's host node unknown" in c["reason"]


def test_two_sockets_plus_cxl_node(tmp_path):
    two_sockets_cxl(tmp_path)
    t = T.read_topology(tmp_path)
    assert t["warnings"] == []
    n2 = node(t, 2)
    assert n2["cpus"] == [] and not n2["has_cpu"]
    assert n2["has_memory"] and n2["total_bytes"] == 128 * GiB and n2["free_bytes"] == 127 * GiB
    assert n2["movable_only"] is True
    assert n2["movable_bytes"] == 128 * GiB  # 64 online 2 GiB blocks, all Movable
    assert n2["memory_tier"] == 22
    assert n2["cxl"] is True
    assert n2["cxl_detail"] == "CXL region0 (ram, 128.00 GiB) via dax0.0 (kmem)"
    assert n2["distance"] == {0: 14, 1: 24, 2: 10}
    for i in (0, 1):
        assert not node(t, i)["cxl"] and not node(t, i)["movable_only"]
        assert node(t, i)["memory_tier"] == 4
    assert t["memory_tiers"] == {4: [0, 1], 22: [2]}
    assert t["demotion_enabled"] is True
    assert t["cxl_bus_present"] is True
    assert t["cxl_regions"] == ["region0"]
    assert t["cxl_memdevs"] == ["mem0"]

    c = T.choose_host_node(t, 0, "auto")
    assert c["node"] == 2
    assert c["warnings"] == [MOVABLE_WARNING]
    assert c["reason"] == (
        "node 2: CPU-less memory node backed by CXL region0 (ram, 128.00 GiB) via dax0.0 (kmem), "
        "distance 14 from GPU's node 0, 127.00 GiB free; WARNING: " + MOVABLE_WARNING)
    # Chosen from the other socket too (it is the only CPU-less node), with its distance.
    c = T.choose_host_node(t, 1, "auto")
    assert c["node"] == 2 and "distance 24 from GPU's node 1" in c["reason"]
    # Explicitly asking for it still warns: never silently.
    c = T.choose_host_node(t, 0, 2)
    assert c["node"] == 2 and c["warnings"] == [MOVABLE_WARNING]
    assert c["reason"].startswith("node 2: requested (numa_node=2), CPU-less memory node backed by CXL region0")
    # A DRAM node carries no warning.
    assert T.choose_host_node(t, 0, "1")["warnings"] == []


def test_cxl_node_onlined_normal_has_no_warning(tmp_path):
    two_sockets_cxl(tmp_path, zone="Normal")
    t = T.read_topology(tmp_path)
    n2 = node(t, 2)
    assert not n2["movable_only"] and n2["movable_bytes"] == 0
    c = T.choose_host_node(t, 0, "auto")
    assert c["warnings"] == []
    assert c["reason"] == (
        "node 2: CPU-less memory node backed by CXL region0 (ram, 128.00 GiB) via dax0.0 (kmem), "
        "distance 14 from GPU's node 0, 127.00 GiB free")


def test_partly_movable_node_gets_a_note(tmp_path):
    fs = FakeSysfs(tmp_path, block_bytes=BIG_BLOCK_BYTES)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.node(1, cpus="", mem_gib=8, free_gib=8, zone=["Normal", "Normal", "Movable", "Movable"])
    fs.finish()
    t = T.read_topology(tmp_path)
    assert t["warnings"] == []
    n1 = node(t, 1)
    assert not n1["movable_only"] and n1["movable_bytes"] == 4 * GiB
    c = T.choose_host_node(t, 0, "auto")
    assert c["node"] == 1
    assert c["warnings"] == [
        "node 1 has 4.00 GiB of ZONE_MOVABLE memory, which pinned/page-locked memory cannot use"]


def test_cpuless_node_without_cxl_bus(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.node(1, cpus="", mem_gib=4, free_gib=3)  # e.g. QEMU -numa node without cpus
    fs.finish()
    t = T.read_topology(tmp_path)
    assert t["warnings"] == []
    assert t["cxl_bus_present"] is False
    n1 = node(t, 1)
    assert not n1["has_cpu"] and n1["has_memory"] and not n1["cxl"]
    assert n1["memory_tier"] == -1  # no memory_tiering directory in this tree
    c = T.choose_host_node(t, 0, "auto")
    assert c == {
        "node": 1,
        "reason": "node 1: CPU-less memory node (CXL candidate), distance 20 from GPU's node 0, 3.00 GiB free",
        "warnings": [],
    }
    c = T.choose_host_node(t, -1, "auto")
    assert c["reason"] == "node 1: CPU-less memory node (CXL candidate), GPU's host node unknown, 3.00 GiB free"


def test_auto_order_distance_then_free_then_id(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.node(1, cpus="4-7", mem_gib=16, free_gib=10)
    fs.node(2, cpus="", mem_gib=8, free_gib=2)
    fs.node(3, cpus="", mem_gib=8, free_gib=6)
    fs.node(4, cpus="", mem_gib=8, free_gib=6)
    fs.node(5, cpus="", mem_gib=0)  # memoryless node: never a candidate
    d = {
        0: [10, 21, 14, 17, 17, 30],
        1: [21, 10, 24, 17, 17, 30],
    }
    for i in (2, 3, 4, 5):
        d[i] = [30] * 6
        d[i][i] = 10
    fs.distances({i: dict(enumerate(row)) for i, row in d.items()})
    fs.finish()
    t = T.read_topology(tmp_path)
    # From node 0: node 2 is nearest (14) despite least free memory.
    assert T.choose_host_node(t, 0, "auto")["node"] == 2
    # From node 1: 3 and 4 tie at 17 and on free memory: lower id.
    c = T.choose_host_node(t, 1, "auto")
    assert c["node"] == 3 and "distance 17 from GPU's node 1" in c["reason"]
    # GPU node unknown: no distances, most free memory then lowest id.
    assert T.choose_host_node(t, -1, "auto")["node"] == 3
    # More free on 4 breaks the distance tie.
    t2 = json.loads(json.dumps(t))  # JSON round trip: integer keys become strings
    [n for n in t2["nodes"] if n["id"] == 4][0]["free_bytes"] = 7 * GiB
    assert T.choose_host_node(t2, 1, "auto")["node"] == 4
    assert node(t, 5)["has_memory"] is False


def test_gpu_memory_nodes_are_excluded(tmp_path):
    """Grace Hopper: the GPU's HBM is a CPU-less NUMA node; it is not host memory."""
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-71", mem_gib=480, free_gib=400, blocks=4)
    fs.node(1, cpus="", mem_gib=96, free_gib=95, zone="Movable", blocks=4)  # GPU memory
    fs.distances({0: {0: 10, 1: 80}, 1: {0: 80, 1: 10}})
    fs.finish()
    t = T.read_topology(tmp_path)
    assert T.choose_host_node(t, 0, "auto")["node"] == 1  # what would happen without the hint
    c = T.choose_host_node(t, 0, "auto", exclude_nodes=[1])
    assert (c["node"], c["reason"]) == (
        0, "node 0: the GPU's nearest host node (no CPU-less memory node), 400.00 GiB free")
    with pytest.raises(ValueError) as e:
        T.choose_host_node(t, 0, "1", exclude_nodes=[1])
    assert str(e.value) == (
        'numa_node: node 1 is the GPU\'s own memory, not host memory; nodes with memory: 0 (or "auto")')


# --------------------------------------------------------------------------
# Explicit node validation
# --------------------------------------------------------------------------


@pytest.fixture
def three_plus_memoryless(tmp_path):
    fs = two_sockets_cxl(tmp_path)
    fs.node(3, cpus="32-35", mem_gib=0)  # CPUs but no memory
    fs.distances({i: {j: 10 if i == j else 20 for j in range(4)} for i in range(4)})
    fs.finish()
    return T.read_topology(tmp_path)


@pytest.mark.parametrize(
    "requested, message",
    [
        (5, 'numa_node: node 5 does not exist; nodes with memory: 0, 1, 2 (or "auto")'),
        ("5", 'numa_node: node 5 does not exist; nodes with memory: 0, 1, 2 (or "auto")'),
        ("3", 'numa_node: node 3 has no memory; nodes with memory: 0, 1, 2 (or "auto")'),
        ("abc", 'numa_node: "abc" is not "auto" or a node id; nodes with memory: 0, 1, 2 (or "auto")'),
        ("-1", 'numa_node: "-1" is not "auto" or a node id; nodes with memory: 0, 1, 2 (or "auto")'),
        ("1.5", 'numa_node: "1.5" is not "auto" or a node id; nodes with memory: 0, 1, 2 (or "auto")'),
        ("0x1", 'numa_node: "0x1" is not "auto" or a node id; nodes with memory: 0, 1, 2 (or "auto")'),
        ("9999999999", 'numa_node: "9999999999" is not "auto" or a node id; nodes with memory: 0, 1, 2 (or "auto")'),
    ],
)
def test_explicit_node_errors(three_plus_memoryless, requested, message):
    with pytest.raises(ValueError) as e:
        T.choose_host_node(three_plus_memoryless, 0, requested)
    assert str(e.value) == message


def test_explicit_node_accepted_forms(three_plus_memoryless):
    t = three_plus_memoryless
    assert T.choose_host_node(t, 0, " 1 ")["node"] == 1
    assert T.choose_host_node(t, 0, 1)["node"] == 1
    assert T.choose_host_node(t, 0, "AUTO")["node"] == 2
    assert T.choose_host_node(t, 0, "")["node"] == 2  # empty option value = auto
    with pytest.raises(ValueError, match="numa_node"):
        T.choose_host_node(t, 0, True)


def test_choose_accepts_a_root_path_and_env(tmp_path, monkeypatch):
    two_sockets_cxl(tmp_path)
    assert _C.choose_host_node(str(tmp_path), 0, "auto")["node"] == 2
    monkeypatch.setenv("CXLALLOC_SYSFS_ROOT", str(tmp_path))
    assert T.read_topology()["sysfs_root"] == str(tmp_path)
    assert [n["id"] for n in T.read_topology()["nodes"]] == [0, 1, 2]
    assert T.choose_host_node(None, 0)["node"] == 2
    with pytest.raises(TypeError):
        _C.choose_host_node(42, 0, "auto")


# --------------------------------------------------------------------------
# Other CXL / DAX shapes
# --------------------------------------------------------------------------


def test_dax_sources(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.node(1, cpus="", mem_gib=32, free_gib=30)
    fs.node(2, cpus="", mem_gib=32, free_gib=30)
    fs.node(3, cpus="", mem_gib=32, free_gib=30)
    fs.hmem_dax("dax1.0", target_node=1, size_gib=32)  # firmware-configured (soft reserved)
    fs.pmem_dax("dax2.0", target_node=2, size_gib=32)  # NVDIMM
    fs.cxl_region(3, target_node=3, size_gib=32, driver="device_dax")  # not system RAM
    fs.hmem_dax("dax9.0", target_node=9, size_gib=8)  # node not online: ignored
    fs.finish()
    t = T.read_topology(tmp_path)
    assert t["warnings"] == []
    assert node(t, 1)["cxl"] is True
    assert node(t, 1)["cxl_detail"] == (
        "soft-reserved memory (hmem; typically firmware-configured CXL) via dax1.0 (kmem)")
    assert node(t, 2)["cxl"] is False
    assert node(t, 2)["cxl_detail"] == "NVDIMM namespace (not CXL) via dax2.0 (kmem)"
    assert node(t, 3)["cxl"] is False and node(t, 3)["cxl_detail"] == ""
    assert t["cxl_regions"] == ["region3"]


def test_region_found_by_directory_without_symlinks(tmp_path):
    """A captured tree (cp -r) has no symlinks: dax devices under regionN still count."""
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.node(1, cpus="", mem_gib=32, free_gib=30)
    fs.finish()
    fs.write("bus/cxl/devices/region7/mode", "ram\n")
    fs.write("bus/cxl/devices/region7/size", "0x800000000\n")
    fs.write("bus/cxl/devices/region7/dax_region7/dax7.0/target_node", "1\n")
    fs.write("bus/dax/devices/dax7.0/target_node", "1\n")
    fs.symlink("bus/dax/devices/dax7.0/driver", "bus/dax/drivers/kmem")
    t = T.read_topology(tmp_path)
    assert t["cxl_regions"] == ["region7"]
    assert node(t, 1)["cxl_detail"] == "CXL region7 (ram, 32.00 GiB) via dax7.0 (kmem)"


def test_cxl_bus_without_regions(tmp_path):
    fs = single_node(tmp_path)
    fs.cxl_bus(memdevs=2)
    t = T.read_topology(tmp_path)
    assert t["cxl_bus_present"] is True
    assert t["cxl_memdevs"] == ["mem0", "mem1"]
    assert t["cxl_regions"] == []
    assert not node(t, 0)["cxl"]


# --------------------------------------------------------------------------
# Missing and garbled files
# --------------------------------------------------------------------------


def test_empty_root(tmp_path):
    t = T.read_topology(tmp_path)
    assert t["nodes"] == []
    assert t["warnings"] == [
        f"no NUMA node information: {tmp_path}/devices/system/node does not exist "
        "(kernel without CONFIG_NUMA, or sysfs not mounted)"]
    c = T.choose_host_node(t, -1, "auto")
    assert c["node"] == 0
    assert c["reason"].startswith(f"node 0: assumed; no NUMA node could be read under {tmp_path}")
    assert T.choose_host_node(t, -1, "0")["node"] == 0
    with pytest.raises(ValueError) as e:
        T.choose_host_node(t, -1, "1")
    assert str(e.value) == 'numa_node: node 1 does not exist; nodes with memory: none (or "auto")'
    assert T.read_topology(tmp_path / "does-not-exist")["nodes"] == []


def test_nodes_without_memory_refuse_auto(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.finish()
    fs.write("devices/system/node/has_memory", "\n")
    t = T.read_topology(tmp_path)
    assert node(t, 0)["has_memory"] is False
    with pytest.raises(cxlalloc.CudaUnavailableError, match="no online NUMA node with memory"):
        T.choose_host_node(t, 0, "auto")


def test_garbled_files_warn_and_never_crash(tmp_path):
    fs = two_sockets_cxl(tmp_path)
    root = f"{tmp_path}/devices/system/node"
    fs.write("devices/system/node/online", "0-x\n")
    fs.write("devices/system/node/node1/cpulist", "8-15,zz\n")
    fs.write("devices/system/node/node1/distance", "21 10\n")  # 2 values for 3 online nodes
    fs.remove("devices/system/node/node0/meminfo")
    fs.write("devices/virtual/memory_tiering/memory_tier22/nodelist", "2-\n")
    fs.write("kernel/mm/numa/demotion_enabled", "maybe\n")
    fs.write_bytes("bus/dax/devices/dax0.0/target_node", b"\xff\xfe\x00garbage")
    t = T.read_topology(tmp_path)
    assert t["warnings"] == [
        f"{root}/online: cannot parse (bad range '0-x' in list '0-x'); ignored",
        f"{root}/node0/meminfo is missing or unreadable; node 0 memory size unknown",
        f"{root}/node1/cpulist: cannot parse (bad item 'zz' in list '8-15,zz'); CPUs unknown",
        f"{root}/node1/distance: 2 values for 3 online nodes; distances of node 1 unknown",
        f"{tmp_path}/devices/virtual/memory_tiering/memory_tier22/nodelist: cannot parse "
        "(bad range '2-' in list '2-'); tier ignored",
        f"{tmp_path}/kernel/mm/numa/demotion_enabled: unexpected value 'maybe'; assuming demotion is off",
        f"{tmp_path}/bus/dax/devices/dax0.0/target_node is missing or garbled; cannot tell which "
        "node dax0.0 (kmem) backs",
    ]
    # Fell back to the node directories; kept what could be read.
    assert [n["id"] for n in t["nodes"]] == [0, 1, 2]
    assert node(t, 0)["total_bytes"] == 0 and node(t, 0)["has_memory"] is True  # from has_memory
    assert node(t, 1)["cpus"] == [] and node(t, 1)["has_cpu"] is True  # from has_cpu
    assert node(t, 1)["distance"] == {}
    assert node(t, 2)["memory_tier"] == -1 and 22 not in t["memory_tiers"]
    assert node(t, 2)["cxl"] is False
    assert t["demotion_enabled"] is False
    # Still usable: node 2 is CPU-less, distance from node 0 known.
    assert T.choose_host_node(t, 0, "auto")["node"] == 2


def test_huge_node_ids_are_ignored(tmp_path):
    fs = single_node(tmp_path)
    fs.write("devices/system/node/online", "0,999999\n")
    fs.write("devices/system/node/node99999999/cpulist", "\n")
    t = T.read_topology(tmp_path)
    root = f"{tmp_path}/devices/system/node"
    assert t["warnings"] == [
        f"{root}: node id 99999999 exceeds 4095; ids above it ignored",
        f"{root}/online: node id 999999 exceeds 4095; ids above it ignored",
    ]
    assert [n["id"] for n in t["nodes"]] == [0]


def test_online_node_directory_missing_and_extra(tmp_path):
    fs = two_sockets(tmp_path)
    root = f"{tmp_path}/devices/system/node"
    fs.write("devices/system/node/online", "0-2\n")
    shutil.rmtree(tmp_path / "devices/system/node/node1")
    fs.write("devices/system/node/online", "0,2\n")
    fs.node(1, cpus="8-15", mem_gib=4, free_gib=1)  # present but not "online"
    fs.write("devices/system/node/node1/distance", "21 10\n")
    fs.write("devices/system/node/online", "0,2\n")
    t = T.read_topology(tmp_path)
    assert f"node 2 is listed in {root}/online but {root}/node2 is missing; skipped" in t["warnings"]
    assert f"{root}/node1 exists but node 1 is not listed as online; included" in t["warnings"]
    assert [n["id"] for n in t["nodes"]] == [0, 1]


def test_unreadable_attribute_and_directory_in_place_of_file(tmp_path):
    single_node(tmp_path)
    (tmp_path / "devices/system/node/node0/meminfo").unlink()
    (tmp_path / "devices/system/node/node0/meminfo").mkdir()  # read() fails with EISDIR
    (tmp_path / "devices/system/node/has_cpu").unlink()
    t = T.read_topology(tmp_path)
    root = f"{tmp_path}/devices/system/node"
    assert t["warnings"] == [
        f"{root}/has_cpu is missing or unreadable",
        f"{root}/node0/meminfo is missing or unreadable; node 0 memory size unknown",
    ]
    assert node(t, 0)["has_cpu"] is True  # fallback: cpulist is non-empty


def test_meminfo_without_the_keys(tmp_path):
    fs = single_node(tmp_path)
    fs.write("devices/system/node/node0/meminfo", "Node 0 MemTotal: lots kB\n")
    t = T.read_topology(tmp_path)
    assert t["warnings"] == [
        f"{tmp_path}/devices/system/node/node0/meminfo: no parsable MemTotal/MemFree; node 0 memory size unknown"]


def test_movable_from_memory_blocks_when_has_normal_memory_absent(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=1, free_gib=1, zone=["DMA32", "Normal", "none"])
    fs.node(1, cpus="", mem_gib=1, free_gib=1, zone="Movable", blocks=3, offline_blocks=2,
            block_links="memory")  # only memoryM/nodeN links
    fs.finish(skip=("has_normal_memory",))
    t = T.read_topology(tmp_path)
    assert t["warnings"] == []
    assert node(t, 0)["movable_only"] is False
    assert node(t, 1)["movable_only"] is True
    assert node(t, 1)["movable_bytes"] == 3 * fs.block_bytes  # offline blocks do not count


def test_has_normal_memory_and_blocks_disagree(tmp_path):
    fs = two_sockets_cxl(tmp_path)
    fs.write("devices/system/node/has_normal_memory", "0-2\n")
    t = T.read_topology(tmp_path)
    assert node(t, 2)["movable_only"] is False
    assert t["warnings"] == [
        "node 2: has_normal_memory says its memory is not all ZONE_MOVABLE but 64 of 64 online "
        "memory blocks are Movable; using has_normal_memory"]


def test_no_zone_information_at_all(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=1, free_gib=1, blocks=0)
    fs.finish(skip=("has_normal_memory",))
    t = T.read_topology(tmp_path)
    assert t["warnings"] == [
        "node 0: neither has_normal_memory nor memory blocks are readable; whether its memory is "
        "ZONE_MOVABLE is unknown"]
    assert node(t, 0)["movable_only"] is False


def test_memory_tier_nodes_file_and_duplicates(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.node(1, cpus="", mem_gib=16, free_gib=10)
    fs.tiers({4: "0", 22: "1"}, file="nodes")  # the name the ABI document uses
    fs.tiers({30: "1"})
    fs.write("devices/virtual/memory_tiering/memory_tier9/uevent", "")
    fs.finish()
    t = T.read_topology(tmp_path)
    assert t["memory_tiers"] == {4: [0], 22: [1], 30: [1]}
    assert node(t, 1)["memory_tier"] == 22
    tiering = f"{tmp_path}/devices/virtual/memory_tiering"
    assert t["warnings"] == [
        f"{tiering}/memory_tier9 has neither a readable nodelist nor nodes file",
        "node 1 is listed in memory_tier22 and memory_tier30; keeping memory_tier22",
    ]


# --------------------------------------------------------------------------
# List syntax
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, cpus",
    [
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
        ("", []),
        ("\n", []),
        ("5", [5]),
        ("0-0", [0]),
        ("3,1,2", [1, 2, 3]),
        ("0-3,2-5", [0, 1, 2, 3, 4, 5]),
        (" 0-1 , 4 \n", [0, 1, 4]),
        ("0-1023", list(range(1024))),
    ],
)
def test_cpulist_syntax(tmp_path, text, cpus):
    fs = single_node(tmp_path)
    fs.write("devices/system/node/node0/cpulist", text)
    t = T.read_topology(tmp_path)
    assert t["warnings"] == []
    assert node(t, 0)["cpus"] == cpus


@pytest.mark.parametrize(
    "text, why",
    [
        ("3-1", "bad range '3-1' in list '3-1'"),
        ("a", "bad item 'a' in list 'a'"),
        ("1,,2", "empty item in list '1,,2'"),
        ("0-", "bad range '0-' in list '0-'"),
        ("-3", "bad range '-3' in list '-3'"),
        ("0-7:2/4", "bad range '0-7:2/4' in list '0-7:2/4'"),
        ("0-99999999", "range '0-99999999' is implausibly wide"),
        ("12345678901", "bad item '12345678901' in list '12345678901'"),
    ],
)
def test_cpulist_garbled(tmp_path, text, why):
    fs = single_node(tmp_path)
    fs.write("devices/system/node/node0/cpulist", text)
    t = T.read_topology(tmp_path)
    assert t["warnings"] == [
        f"{tmp_path}/devices/system/node/node0/cpulist: cannot parse ({why}); CPUs unknown"]
    assert node(t, 0)["cpus"] == [] and node(t, 0)["has_cpu"] is True


def test_binary_garbage_is_quoted_safely(tmp_path):
    """Warnings quote file content; non-UTF-8 bytes must not break the Python str."""
    fs = two_sockets(tmp_path)
    fs.write_bytes("devices/system/node/node0/cpulist", b"0-3,\xff\xfe")
    fs.write_bytes("devices/system/node/node1/distance", b"21 \xc3\x28" + b"9" * 500)
    fs.write_bytes("kernel/mm/numa/demotion_enabled", b"\x00\x01")
    t = T.read_topology(tmp_path)
    root = f"{tmp_path}/devices/system/node"
    assert t["warnings"] == [
        f"{root}/node0/cpulist: cannot parse (bad item '\\xff\\xfe' in list '0-3,\\xff\\xfe'); CPUs unknown",
        f"{root}/node1/distance: cannot parse '21 \\xc3(" + "9" * 56 + "...'; distances of node 1 unknown",
        f"{tmp_path}/kernel/mm/numa/demotion_enabled: unexpected value '\\x00\\x01'; assuming demotion is off",
    ]


def test_has_cpu_falls_back_to_cpulist(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, cpus="0-3", mem_gib=16, free_gib=10)
    fs.node(1, cpus="", mem_gib=16, free_gib=10)
    fs.finish(skip=("has_cpu", "has_memory"))
    t = T.read_topology(tmp_path)
    assert node(t, 0)["has_cpu"] and not node(t, 1)["has_cpu"]
    assert node(t, 0)["has_memory"] and node(t, 1)["has_memory"]  # from MemTotal
    assert sorted(t["warnings"]) == sorted([
        f"{tmp_path}/devices/system/node/has_cpu is missing or unreadable",
        f"{tmp_path}/devices/system/node/has_memory is missing or unreadable",
    ])


# --------------------------------------------------------------------------
# GPU nearest node and capabilities
# --------------------------------------------------------------------------


def test_gpu_nearest_node(tmp_path):
    fs = two_sockets(tmp_path)
    fs.pci_gpu("0000:c1:00.0", numa_node=1)
    fs.pci_gpu("0000:17:00.0", numa_node=-1)
    t = T.read_topology(tmp_path)
    gpu = {"host_numa_id": -1, "pci_domain": 0, "pci_bus": 0xC1, "pci_device": 0}
    assert T.gpu_nearest_node(gpu, t) == 1  # PCI fallback, lower-case hex path
    assert T.gpu_nearest_node(gpu, str(tmp_path)) == 1
    assert T.gpu_nearest_node({**gpu, "host_numa_id": 0}, t) == 0  # HOST_NUMA_ID wins
    assert T.gpu_nearest_node({**gpu, "pci_bus": 0x17}, t) == -1  # firmware gave no proximity
    assert T.gpu_nearest_node({**gpu, "pci_bus": 0x99}, t) == -1  # no such device
    assert T.gpu_nearest_node({"host_numa_id": -1}, t) == -1  # PCI ids unknown
    # Feeds the choice.
    c = T.choose_host_node(t, T.gpu_nearest_node(gpu, t), "auto")
    assert c["node"] == 1


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    """Compile tests/helpers/fake_libcuda.c: with and without the cxlsim NUMA exports."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("fakecuda")
    src = Path(__file__).resolve().parents[1] / "helpers" / "fake_libcuda.c"
    paths = {}
    for name, extra in (("sim", []), ("plain", ["-DNO_CXLSIM"])):
        so = out / f"libfakecuda_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-fvisibility=hidden", *extra, "-o", str(so), str(src)],
                       check=True)
        paths[name] = str(so)
    return paths


def test_query_gpu_against_fake_driver(fake_driver, tmp_path):
    g = T.query_gpu(fake_driver["sim"], device=1, simulated=True)
    assert g["device"] == 1
    assert g["name"] == "Fake H200"
    assert g["total_bytes"] == 141 * GiB
    assert (g["cc_major"], g["cc_minor"]) == (9, 0)
    assert (g["pci_domain"], g["pci_bus"], g["pci_device"]) == (0, 0xC1, 0)
    assert g["host_numa_id"] == -1
    assert g["vmm"] and g["managed"] and g["concurrent_managed"] and g["host_register"]
    assert g["can_use_host_ptr"] and g["unified_addressing"] and g["memory_pools"] and g["can_map_host"]
    assert not g["pageable_access"] and not g["uses_host_page_tables"]
    # The "older driver" rejects 141/142/144/145: read as 0, noted, never fatal.
    assert not g["host_numa_vmm"] and not g["host_numa_pools"] and not g["host_vmm"] and not g["host_pools"]
    assert "CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED" not in g["attributes"]
    assert g["attributes"]["CU_DEVICE_ATTRIBUTE_PCI_BUS_ID"] == 0xC1
    assert g["attributes"]["CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID"] == -1
    assert len(g["attributes"]) == 23
    assert g["notes"] == [
        f"CU_DEVICE_ATTRIBUTE_{name} ({num}): CUDA_ERROR_INVALID_VALUE (invalid argument); read as 0"
        for num, name in (
            (141, "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
            (142, "HOST_NUMA_MEMORY_POOLS_SUPPORTED"),
            (144, "HOST_MEMORY_POOLS_SUPPORTED"),
            (145, "HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
        )
    ]
    assert g["gpu_memory_nodes"] == []
    support = g["backend_support"].splitlines()
    assert support[1] == "host-vmm (cuMemCreate HOST_NUMA): no (attr 141)"
    assert support[3].startswith("managed (cuMemAllocManaged + advise/prefetch to HOST_NUMA): yes (attr 83)")
    assert support[4].startswith("pinned (mbind + cuMemHostRegister DEVICEMAP): yes")

    # HOST_NUMA_ID unknown: the PCI path of this very GPU gives its node.
    fs = two_sockets(tmp_path)
    fs.pci_gpu("0000:c1:00.0", numa_node=1)
    assert T.gpu_nearest_node(g, tmp_path) == 1

    with pytest.raises(ValueError) as e:
        T.query_gpu(fake_driver["sim"], device=5, simulated=True)
    assert str(e.value) == "device: 5 does not exist; the driver reports 2 device(s) (0..1)"


def test_query_gpu_without_driver():
    with pytest.raises(cxlalloc.CudaUnavailableError, match="CUDA unavailable"):
        T.query_gpu("/nonexistent/libcuda.so.1")


def test_simulated_numa_ops(fake_driver):
    n = 4 * PAGE
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    holder = ctypes.c_char.from_buffer(buf)
    addr = ctypes.addressof(holder)
    try:
        assert T.page_nodes(addr, n, simulated_driver=fake_driver["sim"]) == {-1: n}
        T.numa_bind(addr, 2 * PAGE, 1, simulated_driver=fake_driver["sim"])
        assert T.page_nodes(addr, n, simulated_driver=fake_driver["sim"]) == {1: 2 * PAGE, -1: 2 * PAGE}
        assert T.page_nodes(addr + 10, PAGE, simulated_driver=fake_driver["sim"]) == {1: PAGE}
        with pytest.raises(ValueError) as e:
            T.numa_bind(addr, PAGE, 7, simulated_driver=fake_driver["sim"])
        assert str(e.value) == f"numa_bind (simulated): node 7, {PAGE // 1024}.00 KiB failed: Invalid argument"
        with pytest.raises(ValueError, match="negative node id"):
            T.numa_bind(addr, PAGE, -2, simulated_driver=fake_driver["sim"])
        c = T.check_placement(addr, 2 * PAGE, 1, simulated_driver=fake_driver["sim"])
        assert (c["ok"], c["method"]) == (True, "simulated")
        assert c["detail"] == f"verified by simulated: {2 * PAGE // 1024}.00 KiB on node 1"
        with pytest.raises(cxlalloc.CudaUnavailableError, match="does not export cxlsim_numa_bind"):
            T.page_nodes(addr, n, simulated_driver=fake_driver["plain"])
    finally:
        del holder
        buf.close()


# --------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------


def test_format_topology_plain(tmp_path):
    two_sockets_cxl(tmp_path)
    text = T.format_topology(T.read_topology(tmp_path), gpu_near_node=0, use_rich=False)
    assert text.splitlines() == [
        f"NUMA topology (sysfs: {tmp_path})",
        "node     cpus        memory      free        tier  zone     distances       kind",
        "-------  ----------  ----------  ----------  ----  -------  --------------  -----------------------------------------------",
        "0 (GPU)  0-7,16-23   64.00 GiB   60.00 GiB   4     normal   0:10 1:21 2:14  CPU node",
        "1        8-15,24-31  64.00 GiB   50.00 GiB   4     normal   0:21 1:10 2:24  CPU node",
        "2        -           128.00 GiB  127.00 GiB  22    movable  0:14 1:24 2:10  CXL region0 (ram, 128.00 GiB) via dax0.0 (kmem)",
        "CXL bus: present; regions: region0; memdevs: mem0",
        "memory tiers: memory_tier4: 0-1; memory_tier22: 2",
        "demotion: enabled",
    ]
    # A root path works too, and warnings are listed.
    (tmp_path / "kernel/mm/numa/demotion_enabled").write_text("maybe\n")
    text = T.format_topology(str(tmp_path), use_rich=False)
    assert text.splitlines()[-1].startswith("warning: ") and "maybe" in text


def test_format_topology_rich(tmp_path):
    pytest.importorskip("rich")
    two_sockets_cxl(tmp_path)
    text = T.format_topology(str(tmp_path), use_rich=True)
    assert "region0" in text and "memory_tier22: 2" in text


def test_format_topology_empty(tmp_path):
    text = T.format_topology(str(tmp_path), use_rich=False)
    assert "(no NUMA nodes found)" in text and "warning: no NUMA node information" in text


# --------------------------------------------------------------------------
# This machine
# --------------------------------------------------------------------------

needs_numa_sysfs = pytest.mark.skipif(
    not os.path.isdir("/sys/devices/system/node/node0"), reason="no NUMA sysfs on this machine")


def _meminfo_kb(path, key):
    for line in open(path):
        if f" {key}:" in line:
            return int(line.split(":")[1].split()[0])
    raise AssertionError(key)


@needs_numa_sysfs
def test_real_topology(monkeypatch):
    monkeypatch.delenv("CXLALLOC_SYSFS_ROOT", raising=False)
    t = T.read_topology()
    assert t["sysfs_root"] == "/sys"
    n0 = node(t, 0)
    assert n0["has_memory"] and n0["has_cpu"]
    assert n0["cpus"], "node 0 should list CPUs"
    assert n0["distance"][0] == 10
    total_kb = _meminfo_kb("/sys/devices/system/node/node0/meminfo", "MemTotal")
    assert n0["total_bytes"] == total_kb * 1024
    assert 0 < n0["free_bytes"] <= n0["total_bytes"]
    if len(t["nodes"]) == 1:
        assert set(n0["cpus"]) >= os.sched_getaffinity(0)
    assert T.choose_host_node(t, 0)["node"] in [n["id"] for n in t["nodes"] if n["has_memory"]]


class Mapping:
    """An anonymous mmap and its address (ctypes), closed on exit."""

    def __init__(self, length):
        self.length = length
        # Private, like an allocator's memory: a shared anonymous mapping is
        # shmem, where even a read fault allocates a page.
        self.buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._holder = ctypes.c_char.from_buffer(self.buf)
        self.addr = ctypes.addressof(self._holder)

    def touch(self):
        for off in range(0, self.length, PAGE):
            self.buf[off] = 1

    def close(self):
        del self._holder
        self.buf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@needs_numa_sysfs
def test_real_bind_then_touch_is_on_node_0():
    n = 64 * PAGE
    with Mapping(n) as m:
        assert T.page_nodes(m.addr, n) == {-1: n}  # nothing faulted in by the query
        T.numa_bind(m.addr, n, 0)
        assert T.page_nodes(m.addr, n) == {-1: n}  # binding alone allocates nothing
        m.touch()
        assert T.page_nodes(m.addr, n) == {0: n}
        # Sub-ranges: partial pages count their overlap.
        assert T.page_nodes(m.addr + 100, 5000) == {0: 5000}
        assert T.page_nodes(m.addr, 0) == {}
        assert T.check_placement(m.addr, n, 0) == {
            "ok": True, "on_node": n, "elsewhere": 0, "unpopulated": 0, "method": "move_pages",
            "detail": f"verified by move_pages: {n // 1024}.00 KiB on node 0"}
        bad = T.check_placement(m.addr, n, 1)
        assert not bad["ok"] and bad["elsewhere"] == n and bad["on_node"] == 0


@needs_numa_sysfs
def test_real_check_placement_sees_unpopulated_pages():
    with Mapping(4 * PAGE) as m:
        T.numa_bind(m.addr, 4 * PAGE, 0)
        m.buf[0] = 1
        c = T.check_placement(m.addr, 4 * PAGE, 0)
        assert (c["ok"], c["on_node"], c["unpopulated"]) == (False, PAGE, 3 * PAGE)


@needs_numa_sysfs
def test_real_zero_page_and_half_touched():
    n = 8 * PAGE
    with Mapping(n) as m:
        _ = m.buf[0]  # read fault: maps the shared zero page, no memory of ours
        m.buf[4 * PAGE] = 1
        assert T.page_nodes(m.addr, n) == {-1: 7 * PAGE, 0: PAGE}


@needs_numa_sysfs
def test_real_bind_errors():
    with Mapping(4 * PAGE) as m:
        missing = max(n["id"] for n in T.read_topology("/sys")["nodes"]) + 1
        with pytest.raises(ValueError) as e:
            T.numa_bind(m.addr, PAGE, missing)
        msg = str(e.value)
        assert msg.startswith(f"numa_bind: mbind(MPOL_BIND, node {missing}) of {PAGE // 1024}.00 KiB at 0x")
        assert msg.endswith(f"failed: EINVAL: Invalid argument: node {missing} is not an online NUMA node with memory")
        with pytest.raises(ValueError, match="not page-aligned"):
            T.numa_bind(m.addr + 1, PAGE, 0)
        with pytest.raises(ValueError, match="node id out of range"):
            T.numa_bind(m.addr, PAGE, -1)
        with pytest.raises(ValueError, match="null address"):
            T.numa_bind(0, PAGE, 0)
        T.numa_bind(m.addr, 0, 0)  # empty range: nothing to do
        addr = m.addr
    # Unmapped now.
    with pytest.raises(ValueError, match="the range is not mapped"):
        T.numa_bind(addr, PAGE, 0)
    with pytest.raises(ValueError, match="part of the range is not mapped"):
        T.page_nodes(addr, PAGE)


@needs_numa_sysfs
def test_real_large_range_chunks():
    """More pages than one move_pages() chunk (4096)."""
    n = 5000 * PAGE
    with Mapping(n) as m:
        T.numa_bind(m.addr, n, 0)
        for off in range(0, n, 2 * PAGE):
            m.buf[off] = 1
        assert T.page_nodes(m.addr, n) == {0: 2500 * PAGE, -1: 2500 * PAGE}
