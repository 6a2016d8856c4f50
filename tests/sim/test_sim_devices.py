"""cuInit, devices (names, memory, attributes) and primary contexts of the simulated driver.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import ctypes
import threading

from tests.helpers.sim_driver import (
    ATTACH_GLOBAL, GRAN, INVALID_CONTEXT, INVALID_DEVICE, INVALID_VALUE, LOC_DEVICE, LOC_HOST_NUMA, Location,
    NOT_INITIALIZED, NOT_SUPPORTED, NO_DEVICE, PAGE, SUCCESS, cint, sz, u64, vp,
)


def test_nothing_works_before_cuinit(env, cu, lib_sim):
    lib_sim.configure("devices=0")
    assert cu.cuInit(0) == NO_DEVICE
    lib_sim.configure("devices=2")  # a GPU-less boot leaves the driver uninitialized
    n, ctx = cint(-1), vp()
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == NOT_INITIALIZED
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == NOT_INITIALIZED
    p = u64()
    assert cu.cuMemAddressReserve(ctypes.byref(p), GRAN, 0, 0, 0) == NOT_INITIALIZED
    v = cint()
    assert cu.cuDriverGetVersion(ctypes.byref(v)) == SUCCESS and v.value == 13000  # no init needed
    assert cu.cuInit(1) == INVALID_VALUE  # flags must be 0
    assert cu.cuInit(0) == SUCCESS
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == SUCCESS and n.value == 2


def test_devices_names_memory_and_attributes(env, cu):
    env.configure("devices=2,vram=3GiB,numa=0;1:0,gpu_numa=1,attr.141=0,attr.16=7")
    d = cint()
    assert cu.cuDeviceGet(ctypes.byref(d), 1) == SUCCESS and d.value == 1
    assert cu.cuDeviceGet(ctypes.byref(d), 2) == INVALID_DEVICE
    name = ctypes.create_string_buffer(64)
    assert cu.cuDeviceGetName(name, 64, 1) == SUCCESS and name.value == b"cxlalloc simulated GPU 1"
    short = ctypes.create_string_buffer(8)
    assert cu.cuDeviceGetName(short, 6, 0) == SUCCESS and short.value == b"cxlal"  # truncated, terminated
    assert cu.cuDeviceGetName(name, 64, 5) == INVALID_DEVICE
    total = sz()
    assert cu.cuDeviceTotalMem(ctypes.byref(total), 0) == SUCCESS and total.value == 3 << 30

    def attr(a, dev=0):
        v = cint(-99)
        assert cu.cuDeviceGetAttribute(ctypes.byref(v), a, dev) == SUCCESS
        return v.value

    expected = {139: 0x233510DE, 102: 1, 83: 1, 89: 1, 99: 1, 91: 1, 41: 1, 115: 1, 142: 1, 19: 1, 88: 0, 75: 9, 76: 0,
                134: 1, 141: 0, 16: 7, 145: 1, 113: 1}
    for a, v in expected.items():
        assert attr(a) == v, a
    assert attr(33, 0) != attr(33, 1)  # distinct PCI bus ids
    v = cint()
    assert cu.cuDeviceGetAttribute(ctypes.byref(v), 0, 0) == INVALID_VALUE
    assert cu.cuDeviceGetAttribute(ctypes.byref(v), 148, 0) == INVALID_VALUE
    assert cu.cuDeviceGetAttribute(ctypes.byref(v), 16, 2) == INVALID_DEVICE
    assert cu.cuDeviceGetAttribute(None, 16, 0) == INVALID_VALUE
    # HOST_NUMA VMM off: cuMemCreate on a host node is not supported.
    env.create(GRAN, LOC_HOST_NUMA, 0, expect=NOT_SUPPORTED)


def test_primary_context_refcount_and_current_context(env, cu, lib_sim):
    ctx, cur = vp(), vp()
    assert cu.cuCtxGetCurrent(ctypes.byref(cur)) == SUCCESS and cur.value is None
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == SUCCESS
    ctx2 = vp()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx2), 0) == SUCCESS and ctx2.value == ctx.value
    assert lib_sim.live()["context_refs"] == 2
    assert cu.cuCtxSetCurrent(ctx) == SUCCESS
    assert cu.cuCtxGetCurrent(ctypes.byref(cur)) == SUCCESS and cur.value == ctx.value
    # Current context is per thread.
    seen = []

    def other_thread():
        c = vp()
        seen.append((cu.cuCtxGetCurrent(ctypes.byref(c)), c.value))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen == [(SUCCESS, None)]
    assert cu.cuDevicePrimaryCtxRelease(0) == SUCCESS
    free, total = sz(), sz()
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == SUCCESS  # one retain left
    assert cu.cuDevicePrimaryCtxRelease(0) == SUCCESS
    # Released to zero: the context is destroyed; the binding is now invalid.
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == INVALID_CONTEXT
    assert cu.cuCtxSetCurrent(ctx) == INVALID_CONTEXT
    assert cu.cuDevicePrimaryCtxRelease(0) == INVALID_CONTEXT  # never retained
    assert cu.cuDevicePrimaryCtxRelease(3) == INVALID_DEVICE
    assert cu.cuCtxSetCurrent(vp(0x1234)) == INVALID_CONTEXT  # not a context
    assert cu.cuCtxSetCurrent(None) == SUCCESS


def test_calls_that_need_a_context_fail_without_one(env, cu):
    p, s, e, q = u64(), vp(), vp(), vp()
    free, total = sz(), sz()
    host = env.pages(PAGE)
    checks = {
        "cuMemAlloc": cu.cuMemAlloc(ctypes.byref(p), 4096),
        "cuMemFree": cu.cuMemFree(0),
        "cuMemGetInfo": cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)),
        "cuMemAllocManaged": cu.cuMemAllocManaged(ctypes.byref(p), 4096, ATTACH_GLOBAL),
        "cuMemHostAlloc": cu.cuMemHostAlloc(ctypes.byref(q), 4096, 0),
        "cuMemFreeHost": cu.cuMemFreeHost(host),
        "cuMemHostRegister": cu.cuMemHostRegister(host, PAGE, 0),
        "cuMemHostUnregister": cu.cuMemHostUnregister(host),
        "cuMemHostGetDevicePointer": cu.cuMemHostGetDevicePointer(ctypes.byref(p), host, 0),
        "cuMemcpy": cu.cuMemcpy(host, host + 8, 8),
        "cuMemcpyAsync": cu.cuMemcpyAsync(host, host + 8, 8, None),
        "cuMemPrefetchAsync": cu.cuMemPrefetchAsync(host, PAGE, Location(LOC_DEVICE, 0), 0, None),
        "cuStreamCreate": cu.cuStreamCreate(ctypes.byref(s), 0),
        "cuStreamSynchronize": cu.cuStreamSynchronize(None),
        "cuStreamQuery": cu.cuStreamQuery(None),
        "cuEventCreate": cu.cuEventCreate(ctypes.byref(e), 0),
        "cuCtxSynchronize": cu.cuCtxSynchronize(),
    }
    assert {k: v for k, v in checks.items() if v != INVALID_CONTEXT} == {}
    # VMM needs no context.
    g = sz()
    prop = env.prop()
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0) == SUCCESS and g.value == GRAN
    va = env.reserve(GRAN)
    h = env.create(GRAN)
    env.map(va, GRAN, h)
    assert env.access(va, GRAN, (LOC_DEVICE, 0)) == SUCCESS
