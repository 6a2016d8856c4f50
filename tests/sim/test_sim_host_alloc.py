"""cuMemHostAlloc / cuMemHostRegister rules and capability attributes of the simulated driver.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import contextlib
import ctypes

from tests.helpers.sim_driver import (
    ALREADY_REGISTERED, INVALID_VALUE, NOT_REGISTERED, NOT_SUPPORTED, PAGE, REGISTER_DEVICEMAP, REGISTER_IOMEMORY,
    REGISTER_PORTABLE, REGISTER_READ_ONLY, SUCCESS, libc, u64, vp,
)


def test_host_alloc_and_register_rules(env, cu, lib_sim):
    env.retain()
    h = env.host_alloc(10000)
    dp = u64()
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), h + 100, 0) == SUCCESS and dp.value == h + 100
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), h, 1) == INVALID_VALUE  # flags must be 0
    assert lib_sim.host_node_of(h) == 0
    assert cu.cuMemFreeHost(h + 8) == INVALID_VALUE
    assert cu.cuMemHostRegister(h, 100, 0) == ALREADY_REGISTERED  # pinned already
    nomap = env.host_alloc(PAGE, flags=0)
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), nomap, 0) == INVALID_VALUE  # no DEVICEMAP
    p = vp()
    assert cu.cuMemHostAlloc(ctypes.byref(p), PAGE, 8) == INVALID_VALUE  # unknown flag
    assert cu.cuMemHostAlloc(ctypes.byref(p), 0, 0) == INVALID_VALUE
    assert lib_sim.live()["host_allocs"] == 2

    buf = env.pages(8 * PAGE)
    assert cu.cuMemHostRegister(buf + 100, 3 * PAGE, REGISTER_DEVICEMAP | REGISTER_PORTABLE) == SUCCESS
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), buf + 200, 0) == SUCCESS and dp.value == buf + 200
    assert cu.cuMemHostRegister(buf + 2 * PAGE, PAGE, 0) == ALREADY_REGISTERED  # overlaps
    assert cu.cuMemHostRegister(buf + 3 * PAGE + 500, 10, 0) == ALREADY_REGISTERED  # shares a page
    assert cu.cuMemHostRegister(buf + 5 * PAGE, PAGE, 0) == SUCCESS  # disjoint pages
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), buf + 5 * PAGE, 0) == INVALID_VALUE  # no DEVICEMAP
    assert cu.cuMemHostRegister(buf + 6 * PAGE, PAGE, REGISTER_IOMEMORY) == NOT_SUPPORTED
    assert cu.cuMemHostRegister(buf + 6 * PAGE, PAGE, 0x20) == INVALID_VALUE
    assert cu.cuMemHostUnregister(buf + 100 + PAGE) == NOT_REGISTERED  # not the base
    assert cu.cuMemHostUnregister(buf) == NOT_REGISTERED
    assert lib_sim.live()["registrations"] == 2
    assert cu.cuMemHostUnregister(buf + 100) == SUCCESS
    assert cu.cuMemHostUnregister(buf + 5 * PAGE) == SUCCESS
    assert cu.cuMemHostUnregister(buf + 5 * PAGE) == NOT_REGISTERED
    # The range must be mapped; driver-owned memory cannot be registered.
    hole = env.pages(3 * PAGE)
    assert libc.munmap(vp(hole + PAGE), PAGE) == 0
    assert cu.cuMemHostRegister(hole, 3 * PAGE, 0) == INVALID_VALUE
    m = env.managed(PAGE)
    assert cu.cuMemHostRegister(m, PAGE, 0) == INVALID_VALUE
    assert lib_sim.live()["registrations"] == 0


def test_host_register_capability_attributes(env, cu):
    env.configure("attr.99=0")
    env.retain()
    buf = env.pages(PAGE)
    assert cu.cuMemHostRegister(buf, PAGE, 0) == NOT_SUPPORTED
    env.stack.close()
    env.stack = contextlib.ExitStack()
    env.configure("attr.113=0")
    env.retain()
    buf = env.pages(PAGE)
    assert cu.cuMemHostRegister(buf, PAGE, REGISTER_READ_ONLY) == NOT_SUPPORTED


def test_registered_read_only_memory_is_not_writable_by_the_device(env, cu):
    env.retain()
    buf = env.pages(2 * PAGE)
    dst = env.pages(PAGE)
    assert cu.cuMemHostRegister(buf, PAGE, REGISTER_READ_ONLY) == SUCCESS
    try:
        s = env.stream()
        assert cu.cuMemcpyAsync(dst, buf, 64, s) == SUCCESS  # pageable dst via the copy engine
        assert cu.cuMemcpyAsync(buf, dst, 64, s) == INVALID_VALUE
        assert cu.cuStreamSynchronize(s) == SUCCESS
    finally:
        assert cu.cuMemHostUnregister(buf) == SUCCESS
