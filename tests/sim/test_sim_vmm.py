"""Virtual memory management on the simulated driver: reserve, create, map, access rights (real
faults in a child process), VRAM capacity, deferred release.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.sim_driver import (
    GRAN, INVALID_DEVICE, INVALID_VALUE, LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA, LOC_HOST_NUMA_CURRENT, LOC_INVALID, MiB,
    OUT_OF_MEMORY, PAGE, PROT_READ_, PROT_RW, ROOT, SUCCESS, pattern, read, sz, u64, write,
)


def test_vmm_remap_same_va_to_another_handle_preserves_data_by_copy(env, cu, lib_sim):
    env.retain()
    size = 2 * GRAN
    va = env.reserve(size)
    a = env.create(size)
    env.map(va, size, a)
    assert env.access(va, size, (LOC_DEVICE, 0)) == SUCCESS
    data = pattern(size)
    write(va, data)  # the CPU stands in for a kernel on device memory
    # Migrate: a second handle mapped elsewhere, copy, then swap the VA over.
    tmp = env.reserve(size)
    b = env.create(size, LOC_HOST_NUMA, 0)
    env.map(tmp, size, b)
    assert env.access(tmp, size, (LOC_DEVICE, 0), (LOC_HOST_NUMA, 0)) == SUCCESS
    assert cu.cuMemcpy(tmp, va, size) == SUCCESS
    assert cu.cuMemUnmap(va, size) == SUCCESS
    assert cu.cuMemRelease(a) == SUCCESS
    assert cu.cuMemUnmap(tmp, size) == SUCCESS
    assert lib_sim.live()["device_bytes"] == 0 and lib_sim.live()["host_numa_bytes"] == size
    assert cu.cuMemMap(va, size, 0, b, 0) == SUCCESS
    assert env.access(va, size, (LOC_DEVICE, 0), (LOC_HOST_NUMA, 0)) == SUCCESS
    assert read(va, size) == data
    assert lib_sim.host_node_of(va) == 0
    assert cu.cuMemUnmap(va, size) == SUCCESS


def test_vmm_validation_errors(env, cu):
    g = GRAN
    va = env.reserve(4 * g)
    h = env.create(2 * g)
    # Sizes, offsets and addresses must be granularity multiples; offset must be 0.
    env.create(g + PAGE, expect=INVALID_VALUE)
    env.create(0, expect=INVALID_VALUE)
    assert cu.cuMemMap(va + PAGE, g, 0, h, 0) == INVALID_VALUE
    assert cu.cuMemMap(va, g + PAGE, 0, h, 0) == INVALID_VALUE
    assert cu.cuMemMap(va, g, g, h, 0) == INVALID_VALUE  # cuda.h: offset currently must be zero
    assert cu.cuMemMap(va, 4 * g, 0, h, 0) == INVALID_VALUE  # larger than the allocation
    assert cu.cuMemMap(va, g, 0, h, 1) == INVALID_VALUE  # flags
    assert cu.cuMemMap(va, g, 0, 0xDEAD, 0) == INVALID_VALUE  # unknown handle
    assert cu.cuMemMap(va + 3 * g, 2 * g, 0, h, 0) == INVALID_VALUE  # runs off the reservation
    outside = env.pages(2 * g)
    inside = (outside + g - 1) & ~(g - 1)  # a granule wholly inside plain host pages
    assert cu.cuMemMap(inside, g, 0, h, 0) == INVALID_VALUE  # not a reservation
    # A mapping of a prefix of the handle is fine; a second map over it is not.
    env.map(va, g, h)
    assert cu.cuMemMap(va, g, 0, h, 0) == INVALID_VALUE
    env.map(va + g, 2 * g, h)  # the same handle mapped twice is allowed
    # Unmap and set-access work on whole mappings only.
    assert cu.cuMemUnmap(va, g // 2) == INVALID_VALUE
    assert cu.cuMemUnmap(va + g, g) == INVALID_VALUE  # half of the second mapping
    assert cu.cuMemUnmap(va + 3 * g, g) == INVALID_VALUE  # never mapped
    assert env.access(va + 3 * g, g, (LOC_DEVICE, 0)) == INVALID_VALUE
    assert env.access(va, 4 * g, (LOC_DEVICE, 0)) == INVALID_VALUE  # hole at the end
    assert env.access(va, 3 * g, (LOC_DEVICE, 0)) == SUCCESS  # two whole mappings
    assert env.access(va, g, (LOC_DEVICE, 7)) == INVALID_DEVICE
    assert env.access(va, g, (LOC_HOST_NUMA, 0)) == INVALID_VALUE  # device memory, host access
    assert env.access(va, g, (LOC_HOST, 0)) == INVALID_VALUE
    assert env.access(va, g, (LOC_DEVICE, 0), flags=2) == INVALID_VALUE  # not a CUmemAccess_flags
    assert cu.cuMemSetAccess(va, g, None, 1) == INVALID_VALUE
    # The address range cannot be freed under live mappings, nor with the wrong size.
    assert cu.cuMemAddressFree(va, 4 * g) == INVALID_VALUE
    assert cu.cuMemAddressFree(va, 2 * g) == INVALID_VALUE
    assert cu.cuMemUnmap(va, 3 * g) == SUCCESS  # both mappings in one call
    env.stack.close()  # now everything releases cleanly
    env.stack = contextlib.ExitStack()
    # Allocation properties.
    bad = env.prop(LOC_HOST_NUMA_CURRENT, 0)
    hh = u64()
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_VALUE
    bad = env.prop(LOC_DEVICE, 3)
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_DEVICE
    bad = env.prop(LOC_INVALID, 0)
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_VALUE
    bad = env.prop()
    bad.type = 2  # MANAGED
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_VALUE
    good = env.prop()
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(good), 1) == INVALID_VALUE  # flags
    host = env.prop(LOC_HOST, 0)
    host.requestedHandleTypes = 1  # cuda.h: HOST allocations are not IPC capable
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(host), 0) == INVALID_VALUE
    # Release twice, map after release.
    h2 = env.create(g)
    assert cu.cuMemRelease(h2) == SUCCESS
    assert cu.cuMemRelease(h2) == INVALID_VALUE
    va2 = env.reserve(g)
    assert cu.cuMemMap(va2, g, 0, h2, 0) == INVALID_VALUE
    # Reservation arguments.
    p = u64()
    assert cu.cuMemAddressReserve(ctypes.byref(p), g, 3 * PAGE, 0, 0) == INVALID_VALUE  # alignment not 2^n
    assert cu.cuMemAddressReserve(ctypes.byref(p), g + 100, 0, 0, 0) == INVALID_VALUE
    assert cu.cuMemAddressReserve(ctypes.byref(p), g, 0, 0, 1) == INVALID_VALUE
    assert cu.cuMemAddressReserve(ctypes.byref(p), 0, 0, 0, 0) == INVALID_VALUE
    big = env.reserve(4 * g, align=8 * g)
    assert big % (8 * g) == 0
    # Granularity query.
    out = sz()
    prop = env.prop(LOC_HOST_NUMA, 0)
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop), 1) == SUCCESS
    assert out.value == GRAN
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop), 2) == INVALID_VALUE
    prop = env.prop(LOC_DEVICE, 9)
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop), 0) == INVALID_DEVICE


def test_reservation_honours_a_free_hint(env, cu):
    va = env.reserve(2 * GRAN)
    assert cu.cuMemAddressFree(va, 2 * GRAN) == SUCCESS
    env.stack.pop_all()  # freed by hand
    again = env.reserve(2 * GRAN, hint=va)
    assert again == va


def test_vram_capacity_is_enforced_and_reported(env, cu, lib_sim):
    env.configure("vram=8MiB")
    env.retain()
    hs = [env.create(GRAN) for _ in range(4)]
    env.create(GRAN, expect=OUT_OF_MEMORY)
    p = u64()
    assert cu.cuMemAlloc(ctypes.byref(p), 1) == OUT_OF_MEMORY
    free, total = sz(), sz()
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == SUCCESS
    assert (free.value, total.value) == (0, 8 * MiB)
    assert lib_sim.live()["device_bytes"] == 8 * MiB and lib_sim.live()["phys_handles"] == 4
    assert cu.cuMemRelease(hs[0]) == SUCCESS
    a = env.mem_alloc(5000)  # charged in whole pages
    assert lib_sim.live()["device_bytes"] == 6 * MiB + 8192
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == SUCCESS
    assert free.value == 2 * MiB - 8192
    env.create(GRAN, expect=OUT_OF_MEMORY)
    # Host NUMA memory is not VRAM.
    env.create(4 * GRAN, LOC_HOST_NUMA, 0)
    assert lib_sim.live()["host_numa_bytes"] == 4 * GRAN
    assert cu.cuMemFree(a) == SUCCESS
    assert cu.cuMemFree(a) == INVALID_VALUE  # double free
    assert cu.cuMemFree(a + 8) == INVALID_VALUE  # not a base


def test_large_vram_costs_no_memory(env, cu, lib_sim):
    env.configure("vram=64GiB")
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * PAGE  # noqa: E731
    before = rss()
    hs = [env.create(8 << 30) for _ in range(7)]  # 56 GiB of "VRAM", never touched
    va = env.reserve(8 << 30)
    env.map(va, 8 << 30, hs[0])
    assert rss() - before < 64 * MiB
    assert lib_sim.live()["device_bytes"] == 56 << 30


def test_release_of_a_mapped_handle_is_deferred_until_unmap(env, cu, lib_sim):
    env.retain()
    va, h = env.vmm(GRAN)
    write(va, b"still here")
    assert cu.cuMemRelease(h) == SUCCESS
    live = lib_sim.live()
    assert live["phys_handles"] == 1 and live["device_bytes"] == GRAN and live["mappings"] == 1
    assert read(va, 10) == b"still here"  # memory lives on while mapped
    assert cu.cuMemMap(va, GRAN, 0, h, 0) == INVALID_VALUE  # but the handle is gone
    assert cu.cuMemUnmap(va, GRAN) == SUCCESS
    live = lib_sim.live()
    assert live["phys_handles"] == 0 and live["device_bytes"] == 0 and live["mappings"] == 0


_FAULT_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    sys.path.insert(0, {root!r})
    import tests.helpers.sim_driver as t
    from cxlalloc import _sim
    s = _sim.Sim(); cu = t.Cu(s.lib); s.configure({spec!r}); assert cu.cuInit(0) == 0
    e = t.Env(s, cu)
    va = e.reserve(t.GRAN)
    h = e.create(t.GRAN, {ltype}, 0)
    e.map(va, t.GRAN, h)
    for loc in {locs}:
        assert e.access(va, t.GRAN, loc, flags={flags}) == 0
    print("mapped", flush=True)
    {op}
    print("survived", flush=True)
    """
)


def _touch_in_child(ltype, locs, op, flags=PROT_RW, spec=""):
    script = _FAULT_SCRIPT.format(root=ROOT, spec=spec, ltype=ltype, locs=list(locs), op=op, flags=flags)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "case,ltype,locs,op,flags",
    [
        ("no cuMemSetAccess", LOC_DEVICE, [], "ctypes.string_at(va, 8)", PROT_RW),
        ("host memory, device access only", LOC_HOST_NUMA, [(LOC_DEVICE, 0)], "ctypes.string_at(va, 8)", PROT_RW),
        ("read-only grant, CPU write", LOC_DEVICE, [(LOC_DEVICE, 0)], "ctypes.memset(va, 1, 8)", PROT_READ_),
    ],
)
def test_cpu_access_without_granted_access_is_a_real_fault(case, ltype, locs, op, flags):
    out = _touch_in_child(ltype, locs, op, flags)
    assert "mapped" in out.stdout, out.stderr
    assert "survived" not in out.stdout and out.returncode == -11, (case, out.returncode, out.stderr[-500:])


def test_cpu_access_after_granting_works_in_child():
    out = _touch_in_child(LOC_HOST_NUMA, [(LOC_DEVICE, 0), (LOC_HOST_NUMA, 0)], "ctypes.memset(va, 1, 8)")
    assert out.returncode == 0 and "survived" in out.stdout, out.stderr[-500:]


def test_device_copies_respect_per_device_access(env, cu):
    env.configure("devices=2")
    env.retain(0)
    src = env.host_alloc(GRAN)
    write(src, pattern(64))
    va = env.reserve(GRAN)
    h = env.create(GRAN)
    env.map(va, GRAN, h)
    assert cu.cuMemcpy(va, src, 64) == INVALID_VALUE  # mapped, no access yet
    assert env.access(va, GRAN, (LOC_DEVICE, 1)) == SUCCESS
    assert cu.cuMemcpy(va, src, 64) == INVALID_VALUE  # device 1 may, device 0 (current) may not
    assert env.access(va, GRAN, (LOC_DEVICE, 0), flags=PROT_READ_) == SUCCESS
    assert cu.cuMemcpy(va, src, 64) == INVALID_VALUE  # read-only for device 0
    assert cu.cuMemcpy(src + 64, va, 64) == SUCCESS  # reading is fine
    assert env.access(va, GRAN, (LOC_DEVICE, 0)) == SUCCESS
    assert cu.cuMemcpy(va, src, 64) == SUCCESS and read(va, 64) == pattern(64)
    # Reserved but unmapped VA, and ranges leaving an allocation.
    empty = env.reserve(GRAN)
    assert cu.cuMemcpy(empty, src, 8) == INVALID_VALUE
    d = env.mem_alloc(100)
    assert cu.cuMemcpy(d, src, 100) == SUCCESS
    assert cu.cuMemcpy(d, src, 101) == INVALID_VALUE
    assert cu.cuMemcpy(d, src, 0) == SUCCESS
