"""Fault injection and call counters of the simulated driver.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

from tests.helpers.sim_driver import (
    GRAN, INVALID_VALUE, LOC_DEVICE, LOC_INVALID, Location, OUT_OF_MEMORY, PAGE, RA_LAST_PF_TYPE, SUCCESS, UNKNOWN,
    cint, driver_table, range_attr, u64, vp,
)


def test_injected_fault_fires_on_the_nth_call_without_side_effects(env, cu, lib_sim):
    lib_sim.fail("cuMemCreate", nth=2, error=OUT_OF_MEMORY)
    env.create(GRAN)  # 1st: fine
    before = lib_sim.live()
    h = u64(0xABCD)
    prop = env.prop()
    assert cu.cuMemCreate(ctypes.byref(h), GRAN, ctypes.byref(prop), 0) == OUT_OF_MEMORY  # 2nd
    assert h.value == 0xABCD and lib_sim.live() == before  # no handle, no accounting
    env.create(GRAN)  # 3rd: the fault is spent
    # A fault fires even on a call that would itself be invalid, and before it.
    lib_sim.fail("cuMemMap", 1, UNKNOWN)
    assert cu.cuMemMap(0, 0, 0, 0, 0) == UNKNOWN
    assert cu.cuMemMap(0, 0, 0, 0, 0) == INVALID_VALUE
    # Several faults at once, and "*".
    lib_sim.fail("cuDeviceGetCount", 1, 3)
    lib_sim.fail("*", 2, 999)
    n = cint(-1)
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == 3 and n.value == -1
    assert cu.cuDriverGetVersion(ctypes.byref(n)) == 999
    assert cu.cuDriverGetVersion(ctypes.byref(n)) == SUCCESS
    lib_sim.fail("cuInit", 5)
    lib_sim.clear_faults()
    for _ in range(5):
        assert cu.cuInit(0) == SUCCESS
    with pytest.raises(ValueError, match="unknown driver function 'cuMemFoo'"):
        lib_sim.fail("cuMemFoo")
    with pytest.raises(ValueError, match="nth"):
        lib_sim.fail("cuMemMap", 0)
    with pytest.raises(ValueError, match="CUDA_SUCCESS"):
        lib_sim.fail("cuMemMap", 1, 0)
    with pytest.raises(ValueError, match="not a failing CUresult"):
        lib_sim.fail("cuMemMap", 1, 5000)


def test_faults_on_async_and_sync_paths_leave_state_intact(env, cu, lib_sim):
    env.retain()
    lib_sim.fail("cuStreamCreate", 1, OUT_OF_MEMORY)
    s = vp()
    assert cu.cuStreamCreate(ctypes.byref(s), 0) == OUT_OF_MEMORY and lib_sim.live()["streams"] == 0
    m = env.managed(PAGE)
    lib_sim.fail("cuMemPrefetchAsync", 1, 999)
    assert cu.cuMemPrefetchAsync(m, PAGE, Location(LOC_DEVICE, 0), 0, None) == 999
    assert lib_sim.live()["device_bytes"] == 0
    assert range_attr(cu, RA_LAST_PF_TYPE, m, PAGE) == LOC_INVALID
    lib_sim.fail("cuMemFree", 1, 999)
    assert cu.cuMemFree(m) == 999 and lib_sim.live()["managed_allocs"] == 1


def test_call_counters(env, cu, lib_sim):
    lib_sim.reset_counts()
    assert lib_sim.called_functions() == []
    n = cint()
    for _ in range(3):
        cu.cuDeviceGetCount(ctypes.byref(n))
    cu.cuDeviceGetCount(None)  # failing calls count too
    lib_sim.fail("cuDriverGetVersion")
    cu.cuDriverGetVersion(ctypes.byref(n))  # so do injected failures
    assert lib_sim.call_count("cuDeviceGetCount") == 4
    assert lib_sim.call_count("cuDriverGetVersion") == 1
    assert lib_sim.call_count("cuMemCreate") == 0
    assert lib_sim.called_functions() == ["cuDeviceGetCount", "cuDriverGetVersion"]
    cu.resolve("cuInit", 2000)
    assert "cuGetProcAddress" in lib_sim.called_functions()
    with pytest.raises(ValueError, match="unknown driver function"):
        lib_sim.call_count("cuMemAlloc_v2")  # base names only
    lib_sim.reset_counts()
    assert lib_sim.call_count("cuDeviceGetCount") == 0
    assert set(lib_sim.function_names()) == {n for n, _, _ in driver_table()} | {"cuGetProcAddress"}


def test_counters_are_exact_under_concurrency(env, cu, lib_sim):
    lib_sim.reset_counts()

    def spin():
        v = cint()
        for _ in range(500):
            cu.cuDriverGetVersion(ctypes.byref(v))

    threads = [threading.Thread(target=spin) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lib_sim.call_count("cuDriverGetVersion") == 2000
