"""Streams and events of the simulated driver: ordering, async faults, destruction, exit and fork.

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
import time

import pytest

from tests.helpers.sim_driver import (
    GRAN, ILLEGAL_ADDRESS, INVALID_HANDLE, INVALID_VALUE, LOC_DEVICE, NOT_READY, PAGE, ROOT, SUCCESS, pattern, read,
    u64_at, vp, write,
)


def test_sleep_then_write_then_event_orders_on_the_stream(env, cu):
    env.retain()
    buf = env.host_alloc(PAGE)
    s, ev = env.stream(), env.event()
    never = env.event()
    assert cu.cuEventQuery(never) == SUCCESS  # never recorded
    assert cu.cuEventSynchronize(never) == SUCCESS
    t0 = time.monotonic()
    env.sim.stream_sleep(s, 150_000)
    env.sim.stream_write_u64(s, buf, 0xC0FFEE)
    assert cu.cuEventRecord(ev, s) == SUCCESS
    assert cu.cuEventQuery(ev) == NOT_READY
    assert cu.cuStreamQuery(s) == NOT_READY
    assert u64_at(buf) == 0
    assert cu.cuEventSynchronize(ev) == SUCCESS
    assert time.monotonic() - t0 >= 0.14
    assert u64_at(buf) == 0xC0FFEE
    assert cu.cuEventQuery(ev) == SUCCESS and cu.cuStreamQuery(s) == SUCCESS
    assert cu.cuEventRecord(ev, vp(0x5157000000001234)) == INVALID_HANDLE
    assert cu.cuEventQuery(vp(0x5E5E000000001234)) == INVALID_HANDLE


def test_cross_stream_wait_orders_writes(env, cu):
    env.retain()
    buf = env.host_alloc(PAGE)
    a, b = env.stream(), env.stream()
    ev = env.event()
    env.sim.stream_sleep(a, 100_000)
    env.sim.stream_write_u64(a, buf, 1)
    assert cu.cuEventRecord(ev, a) == SUCCESS
    assert cu.cuStreamWaitEvent(b, ev, 0) == SUCCESS
    env.sim.stream_write_u64(b, buf, 2)  # without the wait this would land first and be overwritten
    assert cu.cuStreamSynchronize(b) == SUCCESS
    assert u64_at(buf) == 2
    # Control: without a wait, b's write lands before a's.
    env.sim.stream_sleep(a, 100_000)
    env.sim.stream_write_u64(a, buf, 3)
    env.sim.stream_write_u64(b, buf, 4)
    assert cu.cuStreamSynchronize(b) == SUCCESS and u64_at(buf) == 4
    assert cu.cuCtxSynchronize() == SUCCESS and u64_at(buf) == 3
    assert cu.cuStreamWaitEvent(b, ev, 1) == INVALID_VALUE  # WAIT_EXTERNAL only during capture


def test_legacy_stream_orders_against_blocking_streams(env, cu):
    env.retain()
    buf = env.host_alloc(PAGE)
    blocking = env.stream(flags=0)
    nonblocking = env.stream()
    env.sim.stream_sleep(blocking, 100_000)
    env.sim.stream_write_u64(blocking, buf, 1)
    env.sim.stream_write_u64(0, buf, 2)  # NULL stream: waits for the blocking stream
    assert cu.cuStreamSynchronize(None) == SUCCESS
    assert u64_at(buf) == 2
    env.sim.stream_sleep(nonblocking, 100_000)
    env.sim.stream_write_u64(nonblocking, buf, 3)
    env.sim.stream_write_u64(0, buf, 4)  # does not wait for a non-blocking stream
    assert cu.cuStreamSynchronize(None) == SUCCESS and u64_at(buf) == 4
    assert cu.cuStreamSynchronize(nonblocking) == SUCCESS and u64_at(buf) == 3
    # cuMemcpy is synchronous and ordered after prior blocking-stream work.
    src = env.host_alloc(PAGE)
    env.sim.stream_sleep(blocking, 50_000)
    env.sim.stream_write_u64(blocking, src, 77)
    assert cu.cuMemcpy(buf, src, 8) == SUCCESS and u64_at(buf) == 77


def test_memcpy_async_runs_in_stream_order(env, cu):
    env.retain()
    va, _ = env.vmm(GRAN)
    host = env.host_alloc(GRAN)
    write(host, pattern(4096, 3))
    s = env.stream()
    env.sim.stream_sleep(s, 80_000)
    assert cu.cuMemcpyAsync(va, host, 4096, s) == SUCCESS
    assert read(va, 4096) != pattern(4096, 3)
    assert cu.cuStreamSynchronize(s) == SUCCESS
    assert read(va, 4096) == pattern(4096, 3)
    assert cu.cuMemcpyAsync(va, host, GRAN + 1, s) == INVALID_VALUE  # runs off both allocations
    assert cu.cuMemcpyAsync(va, host, 16, vp(0x42)) == INVALID_HANDLE


def test_stream_work_after_unmap_is_an_async_fault(env, cu, lib_sim):
    env.retain()
    host = env.host_alloc(PAGE)
    va = env.reserve(GRAN)
    h = env.create(GRAN)
    assert cu.cuMemMap(va, GRAN, 0, h, 0) == SUCCESS
    assert env.access(va, GRAN, (LOC_DEVICE, 0)) == SUCCESS
    s = env.stream()
    env.sim.stream_sleep(s, 80_000)
    assert cu.cuMemcpyAsync(va, host, 64, s) == SUCCESS  # valid now...
    assert cu.cuMemUnmap(va, GRAN) == SUCCESS  # ...but unmapped before the stream gets there
    assert cu.cuStreamSynchronize(s) == ILLEGAL_ADDRESS
    assert lib_sim.async_faults() == 1
    assert "not mapped" in lib_sim.last_async_fault() and "cuMemcpyAsync" in lib_sim.last_async_fault()
    # The error is sticky for the context...
    assert cu.cuCtxSynchronize() == ILLEGAL_ADDRESS
    assert cu.cuStreamQuery(s) == ILLEGAL_ADDRESS
    env.stack.close()  # ...until its last primary-context release resets it
    env.stack = contextlib.ExitStack()
    env.retain()
    assert cu.cuCtxSynchronize() == SUCCESS


def test_kernel_write_to_pageable_memory_faults(env, cu, lib_sim):
    env.retain()
    s = env.stream()
    plain = env.pages(PAGE)
    env.sim.stream_write_u64(s, plain, 5)  # not registered: the GPU cannot reach it (attr 88 = 0)
    assert cu.cuStreamSynchronize(s) == ILLEGAL_ADDRESS
    assert u64_at(plain) == 0 and "pageable" in lib_sim.last_async_fault()
    with pytest.raises(ValueError, match="not a live stream"):
        env.sim.stream_sleep(0x5157000000000777, 1)
    with pytest.raises(ValueError, match="NULL"):
        env.sim.stream_write_u64(s, 0, 1)


def test_destroying_a_busy_stream_completes_its_work(env, cu, lib_sim):
    env.retain()
    buf = env.host_alloc(PAGE)
    s = vp()
    assert cu.cuStreamCreate(ctypes.byref(s), 0) == SUCCESS
    env.sim.stream_sleep(s.value, 500_000)
    env.sim.stream_write_u64(s.value, buf, 9)
    t0 = time.monotonic()
    assert cu.cuStreamDestroy(s.value) == SUCCESS
    assert time.monotonic() - t0 < 0.25  # returns at once, not after the stream's 0.5 s of work
    assert lib_sim.live()["streams"] == 0
    assert cu.cuStreamSynchronize(s.value) == INVALID_HANDLE
    assert cu.cuStreamDestroy(s.value) == INVALID_HANDLE
    assert cu.cuStreamDestroy(None) == INVALID_HANDLE
    assert cu.cuCtxSynchronize() == SUCCESS
    assert u64_at(buf) == 9
    assert cu.cuStreamCreate(ctypes.byref(s), 4) == INVALID_VALUE
    e = vp()
    assert cu.cuEventCreate(ctypes.byref(e), 4) == INVALID_VALUE  # INTERPROCESS needs DISABLE_TIMING
    assert cu.cuEventCreate(ctypes.byref(e), 0x10) == INVALID_VALUE


def test_events_and_streams_of_different_devices(env, cu):
    env.configure("devices=2")
    env.retain(1, make_current=False)
    env.retain(0)
    s0 = env.stream()
    ev0 = env.event()
    ctx1 = vp()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx1), 1) == SUCCESS
    assert cu.cuDevicePrimaryCtxRelease(1) == SUCCESS
    assert cu.cuCtxSetCurrent(ctx1) == SUCCESS
    s1 = vp()
    assert cu.cuStreamCreate(ctypes.byref(s1), 1) == SUCCESS
    try:
        assert cu.cuEventRecord(ev0, s1) == INVALID_HANDLE  # event and stream of different contexts
        assert cu.cuEventRecord(ev0, s0) == SUCCESS
        assert cu.cuStreamWaitEvent(s1, ev0, 0) == SUCCESS  # waiting across devices is allowed
        assert cu.cuStreamSynchronize(s1) == SUCCESS
    finally:
        assert cu.cuStreamDestroy(s1) == SUCCESS


def test_exit_with_live_streams_and_queued_work_is_clean():
    script = textwrap.dedent(
        f"""
        import ctypes, sys, time
        sys.path.insert(0, {ROOT!r})
        import tests.helpers.sim_driver as t
        from cxlalloc import _sim
        s = _sim.Sim(); cu = t.Cu(s.lib); assert cu.cuInit(0) == 0
        e = t.Env(s, cu); e.retain()
        buf = e.host_alloc(4096)
        for _ in range(4):
            st = e.stream()
            s.stream_sleep(st, 10_000_000)   # 10 s of queued "kernels"
            s.stream_write_u64(st, buf, 1)
        s.stream_sleep(0, 10_000_000)
        print("exiting", flush=True)
        """
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stderr[-800:]
    assert time.monotonic() - t0 < 8


def test_fork_child_cannot_use_the_driver_and_exits_cleanly():
    script = textwrap.dedent(
        f"""
        import ctypes, os, sys
        sys.path.insert(0, {ROOT!r})
        import tests.helpers.sim_driver as t
        from cxlalloc import _sim
        s = _sim.Sim(); cu = t.Cu(s.lib); assert cu.cuInit(0) == 0
        e = t.Env(s, cu); e.retain()
        st = e.stream()
        s.stream_sleep(st, 2_000_000)
        pid = os.fork()
        if pid == 0:
            n = ctypes.c_int()
            codes = (cu.cuDeviceGetCount(ctypes.byref(n)), cu.cuInit(0), cu.cuStreamQuery(st))
            print("child", codes, flush=True)
            sys.exit(0 if codes == (3, 3, 3) else 1)  # a normal exit runs the exit hooks
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        print("parent", cu.cuStreamQuery(st), flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr[-800:]
    assert "child (3, 3, 3)" in out.stdout and "child exit 0" in out.stdout
    assert f"parent {NOT_READY}" in out.stdout  # the parent's stream is still busy and usable
