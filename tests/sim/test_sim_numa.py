"""Host NUMA placement on the simulated driver: recorded and really bound pages, rejected nodes,
binding and relocation on register.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import contextlib
import ctypes

import pytest

from tests.helpers.sim_driver import (
    GRAN, INVALID_VALUE, LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA, PAGE, REGISTER_DEVICEMAP, SUCCESS, SYS, libc, page_node,
    page_policy, read, vp, write,
)


def test_host_numa_placement_is_recorded_and_really_bound(env, cu, lib_sim):
    env.configure("numa=0;1:0;2:0")
    env.retain()
    va, h = env.vmm(GRAN, LOC_HOST_NUMA, 1, locs=[(LOC_DEVICE, 0), (LOC_HOST_NUMA, 1)])
    assert lib_sim.host_node_of(va) == 1 and lib_sim.host_node_of(va + GRAN - 1) == 1
    write(va, b"x")  # fault the page in
    if SYS:
        assert page_node(va) == 0  # simulated node 1 is backed by real node 0
        mode, mask = page_policy(va)
        assert mode == 2 and mask == 1  # MPOL_BIND to real node 0, on the memfd's shared policy
    dva, _ = env.vmm(GRAN)
    assert lib_sim.host_node_of(dva) == -1  # device memory
    empty = env.reserve(GRAN)
    assert lib_sim.host_node_of(empty) == -1
    assert lib_sim.live()["host_numa_bytes"] == GRAN
    # Unknown node, and HOST (no node: placed near the calling CPU).
    env.create(GRAN, LOC_HOST_NUMA, 7, expect=INVALID_VALUE)
    hva, _ = env.vmm(GRAN, LOC_HOST, 0, locs=[(LOC_DEVICE, 0), (LOC_HOST, 0)])
    assert lib_sim.host_node_of(hva) == 0
    # HOST_NUMA access needs a HOST_NUMA allocation.
    assert env.access(hva, GRAN, (LOC_HOST_NUMA, 0)) == INVALID_VALUE


def test_reject_numa_refuses_cumemcreate_and_hostalloc(env, cu):
    env.configure("numa=0;1:0,reject_numa=1")
    env.create(GRAN, LOC_HOST_NUMA, 1, expect=INVALID_VALUE)
    env.create(GRAN, LOC_HOST_NUMA, 0)
    env.retain()
    env.host_alloc(PAGE)  # the CPU's node (0) is fine
    env.stack.close()
    env.stack = contextlib.ExitStack()
    env.configure("numa=0;1:0,reject_numa=0")
    env.retain()
    p = vp()
    assert cu.cuMemHostAlloc(ctypes.byref(p), PAGE, 0) == INVALID_VALUE


def test_numa_bind_and_relocation_on_register(env, cu, lib_sim):
    env.configure("numa=0;1:0;2:0,relocate=1:2")
    env.retain()
    buf = env.pages(4 * PAGE)
    lib_sim.numa_bind(buf, 2 * PAGE, 1)
    lib_sim.numa_bind(buf + 2 * PAGE, 2 * PAGE, 0)
    assert [lib_sim.host_node_of(buf + i * PAGE) for i in range(4)] == [1, 1, 0, 0]
    write(buf, b"y")
    if SYS:
        assert page_node(buf) == 0 and page_policy(buf) == (2, 1)
    # Registering (long-term pinning) moves node-1 pages to node 2; node 0 stays.
    assert cu.cuMemHostRegister(buf, 4 * PAGE, REGISTER_DEVICEMAP) == SUCCESS
    assert [lib_sim.host_node_of(buf + i * PAGE) for i in range(4)] == [2, 2, 0, 0]
    assert read(buf, 1) == b"y"  # data survives the move
    assert cu.cuMemHostUnregister(buf) == SUCCESS
    assert lib_sim.host_node_of(buf) == 2  # moved pages stay moved
    # Errors.
    with pytest.raises(ValueError, match="page-aligned"):
        lib_sim.numa_bind(buf + 1, PAGE, 0)
    with pytest.raises(ValueError, match="not a simulated node"):
        lib_sim.numa_bind(buf, PAGE, 5)
    d = env.managed(PAGE)
    with pytest.raises(ValueError, match="owned by the simulated driver"):
        lib_sim.numa_bind(d, PAGE, 0)
    assert lib_sim.host_node_of(0x1000) == -1


def test_numa_record_is_dropped_when_the_range_is_remapped(env, lib_sim):
    if not SYS:
        pytest.skip("no syscall numbers for this architecture")
    env.configure("numa=0;3:0")
    buf = env.pages(2 * PAGE)
    lib_sim.numa_bind(buf, 2 * PAGE, 3)
    assert lib_sim.host_node_of(buf + PAGE) == 3
    # A fresh mapping at the same address (MAP_FIXED) has the default policy.
    p = libc.mmap(vp(buf), PAGE, 3, 0x22 | 0x10, -1, 0)
    assert p == buf
    assert lib_sim.host_node_of(buf) == -1
    assert lib_sim.host_node_of(buf + PAGE) == 3
