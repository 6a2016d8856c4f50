"""Managed memory on the simulated driver: advice, range attributes, prefetch residency.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import contextlib
import ctypes

from tests.helpers.sim_driver import (
    ADV_SET_ACC, ADV_SET_PREF, ADV_SET_READ_MOSTLY, ADV_UNSET_ACC, ADV_UNSET_PREF, ATTACH_GLOBAL, ATTACH_HOST,
    DEVICE_CPU, DEVICE_INVALID, INVALID_DEVICE, INVALID_HANDLE, INVALID_VALUE, LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA,
    LOC_HOST_NUMA_CURRENT, LOC_INVALID, Location, NOT_SUPPORTED, OUT_OF_MEMORY, PAGE, RA_ACCESSED_BY, RA_LAST_PF,
    RA_LAST_PF_ID, RA_LAST_PF_TYPE, RA_PREF, RA_PREF_ID, RA_PREF_TYPE, RA_READ_MOSTLY, SUCCESS, cint, pattern,
    range_attr, read, u64, vp, write,
)


def test_managed_advise_and_range_attributes(env, cu):
    env.configure("devices=2,numa=0;1:0")
    env.retain()
    size = 16 * PAGE
    m = env.managed(size)
    assert range_attr(cu, RA_PREF_TYPE, m, size) == LOC_INVALID
    assert range_attr(cu, RA_PREF, m, size) == DEVICE_INVALID
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_HOST_NUMA, 1)) == SUCCESS
    assert range_attr(cu, RA_PREF_TYPE, m, size) == LOC_HOST_NUMA
    assert range_attr(cu, RA_PREF_ID, m, size) == 1
    assert range_attr(cu, RA_PREF, m, size) == DEVICE_CPU  # legacy form
    # Half the range preferred on device 1: the whole no longer agrees.
    assert cu.cuMemAdvise(m, size // 2, ADV_SET_PREF, Location(LOC_DEVICE, 1)) == SUCCESS
    assert range_attr(cu, RA_PREF_TYPE, m, size) == LOC_INVALID
    assert range_attr(cu, RA_PREF_ID, m, size) == DEVICE_INVALID
    assert range_attr(cu, RA_PREF, m, size // 2) == 1
    assert range_attr(cu, RA_PREF_TYPE, m + size // 2, size // 2) == LOC_HOST_NUMA
    assert cu.cuMemAdvise(m, size, ADV_UNSET_PREF, Location(LOC_INVALID, 0)) == SUCCESS
    assert range_attr(cu, RA_PREF_TYPE, m, size) == LOC_INVALID
    # Accessed-by: devices then the CPU, CU_DEVICE_INVALID padding.
    assert cu.cuMemAdvise(m, size, ADV_SET_ACC, Location(LOC_DEVICE, 1)) == SUCCESS
    assert cu.cuMemAdvise(m, size, ADV_SET_ACC, Location(LOC_HOST, 0)) == SUCCESS
    assert cu.cuMemAdvise(m, PAGE, ADV_SET_ACC, Location(LOC_DEVICE, 0)) == SUCCESS
    assert range_attr(cu, RA_ACCESSED_BY, m, size, n=4) == [1, DEVICE_CPU, DEVICE_INVALID, DEVICE_INVALID]
    assert range_attr(cu, RA_ACCESSED_BY, m, PAGE, n=3) == [0, 1, DEVICE_CPU]
    assert cu.cuMemAdvise(m, size, ADV_UNSET_ACC, Location(LOC_DEVICE, 1)) == SUCCESS
    assert range_attr(cu, RA_ACCESSED_BY, m, size, n=2) == [DEVICE_CPU, DEVICE_INVALID]
    # Read-mostly; unaligned ranges round out to pages.
    assert cu.cuMemAdvise(m + 10, 100, ADV_SET_READ_MOSTLY, Location(LOC_INVALID, 0)) == SUCCESS
    assert range_attr(cu, RA_READ_MOSTLY, m, PAGE) == 1
    assert range_attr(cu, RA_READ_MOSTLY, m, 2 * PAGE) == 0
    # Errors: location types per advice, devices, ranges, sizes.
    assert cu.cuMemAdvise(m, size, ADV_SET_ACC, Location(LOC_HOST_NUMA, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_DEVICE, 5)) == INVALID_DEVICE
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_HOST_NUMA, 9)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_INVALID, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size, 42, Location(LOC_HOST, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size + PAGE, ADV_SET_ACC, Location(LOC_HOST, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, 0, ADV_SET_ACC, Location(LOC_HOST, 0)) == INVALID_VALUE
    plain = env.pages(PAGE)
    assert cu.cuMemAdvise(plain, PAGE, ADV_SET_ACC, Location(LOC_HOST, 0)) == INVALID_VALUE  # pageable, attr 88=0
    out = (cint * 2)()
    assert cu.cuMemRangeGetAttribute(out, 8, RA_PREF, m, size) == INVALID_VALUE  # dataSize must be 4
    assert cu.cuMemRangeGetAttribute(out, 6, RA_ACCESSED_BY, m, size) == INVALID_VALUE
    assert cu.cuMemRangeGetAttribute(out, 4, 99, m, size) == INVALID_VALUE
    assert cu.cuMemRangeGetAttribute(out, 4, RA_PREF, plain, PAGE) == INVALID_VALUE


def test_managed_prefetch_residency_vram_and_node(env, cu, lib_sim):
    env.configure("vram=48KiB,numa=0;1:0;2:0,granularity=4KiB")
    env.retain()
    size = 8 * PAGE
    m = env.managed(size)
    s = env.stream()
    write(m, pattern(size))
    assert lib_sim.host_node_of(m) == -1  # never placed
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_HOST_NUMA, 1)) == SUCCESS
    assert lib_sim.host_node_of(m) == 1  # first touch follows the preferred node
    assert cu.cuMemPrefetchAsync(m, size, Location(LOC_DEVICE, 0), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size
    assert range_attr(cu, RA_LAST_PF_TYPE, m, size) == LOC_DEVICE
    assert range_attr(cu, RA_LAST_PF_ID, m, size) == 0
    assert range_attr(cu, RA_LAST_PF, m, size) == 0
    assert lib_sim.host_node_of(m) == -1  # resident on the GPU
    # Prefetching again to the same device costs nothing more.
    assert cu.cuMemPrefetchAsync(m, size, Location(LOC_DEVICE, 0), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size
    # Half back to host node 2.
    assert cu.cuMemPrefetchAsync(m + size // 2, size // 2, Location(LOC_HOST_NUMA, 2), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size // 2
    assert range_attr(cu, RA_LAST_PF_TYPE, m, size) == LOC_INVALID
    assert range_attr(cu, RA_LAST_PF_TYPE, m + size // 2, size // 2) == LOC_HOST_NUMA
    assert range_attr(cu, RA_LAST_PF_ID, m + size // 2, size // 2) == 2
    assert range_attr(cu, RA_LAST_PF, m + size // 2, size // 2) == DEVICE_CPU
    assert lib_sim.host_node_of(m + size - 1) == 2
    assert cu.cuStreamSynchronize(s) == SUCCESS
    assert read(m, size) == pattern(size)  # data never moves in the simulator
    # Capacity: 48 KiB VRAM, 16 KiB in use by m; 40 KiB more does not fit, 32 KiB does.
    big = env.managed(10 * PAGE)
    assert cu.cuMemPrefetchAsync(big, 10 * PAGE, Location(LOC_DEVICE, 0), 0, s) == OUT_OF_MEMORY
    assert lib_sim.live()["device_bytes"] == size // 2  # no side effect
    assert cu.cuMemPrefetchAsync(big, 8 * PAGE, Location(LOC_DEVICE, 0), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size // 2 + 8 * PAGE
    # HOST and HOST_NUMA_CURRENT resolve to the CPU's node.
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_HOST_NUMA_CURRENT, 77), 0, s) == SUCCESS
    assert range_attr(cu, RA_LAST_PF_TYPE, big, PAGE) == LOC_HOST_NUMA
    assert range_attr(cu, RA_LAST_PF_ID, big, PAGE) == 0
    assert cu.cuMemPrefetchAsync(big + PAGE, PAGE, Location(LOC_HOST, 5), 0, s) == SUCCESS
    assert range_attr(cu, RA_LAST_PF_TYPE, big + PAGE, PAGE) == LOC_HOST
    # Errors.
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_DEVICE, 3), 0, s) == INVALID_DEVICE
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_HOST_NUMA, 9), 0, s) == INVALID_VALUE
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_DEVICE, 0), 1, s) == INVALID_VALUE
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_DEVICE, 0), 0, vp(0x5157000000009999)) == INVALID_HANDLE
    plain = env.pages(PAGE)
    assert cu.cuMemPrefetchAsync(plain, PAGE, Location(LOC_DEVICE, 0), 0, s) == INVALID_VALUE
    # Freeing returns the managed VRAM.
    assert cu.cuMemFree(big) == SUCCESS
    assert cu.cuMemFree(m) == SUCCESS
    assert lib_sim.live()["device_bytes"] == 0 and lib_sim.live()["managed_allocs"] == 0


def test_managed_needs_capability_attributes(env, cu):
    env.configure("attr.89=0")
    env.retain()
    m = env.managed(PAGE)
    assert cu.cuMemAdvise(m, PAGE, ADV_SET_ACC, Location(LOC_DEVICE, 0)) == INVALID_DEVICE
    assert cu.cuMemPrefetchAsync(m, PAGE, Location(LOC_DEVICE, 0), 0, None) == INVALID_DEVICE
    assert cu.cuMemAdvise(m, PAGE, ADV_SET_ACC, Location(LOC_HOST, 0)) == SUCCESS
    p = u64()
    assert cu.cuMemAllocManaged(ctypes.byref(p), PAGE, 4) == INVALID_VALUE  # SINGLE is not allowed here
    assert cu.cuMemAllocManaged(ctypes.byref(p), 0, ATTACH_GLOBAL) == INVALID_VALUE
    env.stack.close()
    env.stack = contextlib.ExitStack()
    env.configure("attr.83=0")
    env.retain()
    assert cu.cuMemAllocManaged(ctypes.byref(p), PAGE, ATTACH_HOST) == NOT_SUPPORTED
