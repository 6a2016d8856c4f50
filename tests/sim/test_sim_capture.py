"""Stream capture rules of the simulated driver.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

from tests.helpers.sim_driver import (
    CAPTURE_ACTIVE, CAPTURE_IMPLICIT, CAPTURE_INVALIDATED, CAPTURE_NONE, CAPTURE_STATUS_INVALIDATED,
    CAPTURE_UNSUPPORTED, GRAN, INVALID_CONTEXT, PAGE, SUCCESS, cint, u64, u64_at,
)


def test_capture_rules(env, cu, lib_sim):
    ctx = env.retain()
    buf = env.host_alloc(PAGE)
    s, other = env.stream(flags=0), env.stream()
    ev = env.event()
    st = cint(-1)
    lib_sim.begin_capture(s)
    assert cu.cuStreamIsCapturing(s, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_ACTIVE
    assert cu.cuStreamIsCapturing(other, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE
    # Captured work is recorded, not run.
    env.sim.stream_write_u64(s, buf, 5)
    assert cu.cuMemcpyAsync(buf + 8, buf, 8, s) == SUCCESS
    assert cu.cuEventRecord(ev, s) == SUCCESS
    # Querying an event recorded in the capture is illegal and invalidates it.
    base = lib_sim.capture_violations()
    assert cu.cuEventQuery(ev) == CAPTURE_UNSUPPORTED
    assert lib_sim.capture_violations() == base + 1
    assert cu.cuStreamIsCapturing(s, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_STATUS_INVALIDATED
    assert cu.cuMemcpyAsync(buf + 8, buf, 8, s) == CAPTURE_INVALIDATED
    lib_sim.end_capture(s)
    assert cu.cuStreamIsCapturing(s, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE
    assert cu.cuEventQuery(ev) == SUCCESS  # the captured record is gone with the capture
    assert cu.cuCtxSynchronize() == SUCCESS and u64_at(buf) == 0  # nothing captured ran

    # Synchronizing or querying the capturing stream.
    lib_sim.begin_capture(s)
    assert cu.cuStreamSynchronize(s) == CAPTURE_UNSUPPORTED
    assert cu.cuStreamQuery(s) == CAPTURE_UNSUPPORTED
    # The legacy stream depends implicitly on the capturing blocking stream.
    assert cu.cuStreamIsCapturing(None, ctypes.byref(st)) == CAPTURE_IMPLICIT
    assert cu.cuMemcpy(buf, buf + 8, 8) == CAPTURE_IMPLICIT
    assert cu.cuStreamSynchronize(None) == CAPTURE_IMPLICIT
    # Global mode: unsafe calls from any thread fail.
    p = u64()
    assert cu.cuMemAlloc(ctypes.byref(p), 1024) == CAPTURE_UNSUPPORTED
    assert cu.cuCtxSynchronize() == CAPTURE_UNSUPPORTED
    errs = []

    def other_thread():
        errs.append(cu.cuMemHostRegister(buf, 8, 0))  # no context here: that is checked first
        cu.cuCtxSetCurrent(ctx)
        errs.append(cu.cuMemHostRegister(buf, 8, 0))
        cu.cuCtxSetCurrent(None)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert errs == [INVALID_CONTEXT, CAPTURE_UNSUPPORTED]
    assert lib_sim.capture_violations() == base + 9
    # VMM calls are not capture-unsafe.
    va = env.reserve(GRAN)
    assert va
    # Non-blocking streams do not involve the legacy stream.
    lib_sim.end_capture(s)
    lib_sim.begin_capture(other)
    assert cu.cuStreamIsCapturing(None, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE
    assert cu.cuStreamSynchronize(None) == SUCCESS
    lib_sim.end_capture(other)
    assert lib_sim.capture_violations() == base + 9

    with pytest.raises(ValueError, match="legacy"):
        lib_sim.begin_capture(0)
    with pytest.raises(ValueError, match="did not|not a stream that began"):
        lib_sim.end_capture(s)
    lib_sim.begin_capture(s)
    with pytest.raises(ValueError, match="already capturing"):
        lib_sim.begin_capture(s)
    lib_sim.end_capture(s)


def test_capture_fork_join_through_events(env, cu, lib_sim):
    env.retain()
    origin, side = env.stream(), env.stream()
    fork = env.event()
    st = cint()
    lib_sim.begin_capture(origin)
    assert cu.cuEventRecord(fork, origin) == SUCCESS
    assert cu.cuStreamWaitEvent(side, fork, 0) == SUCCESS  # side joins the capture
    assert cu.cuStreamIsCapturing(side, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_ACTIVE
    assert cu.cuStreamSynchronize(side) == CAPTURE_UNSUPPORTED  # invalidates the whole capture
    assert cu.cuStreamIsCapturing(origin, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_STATUS_INVALIDATED
    with pytest.raises(ValueError):
        lib_sim.end_capture(side)  # only the origin ends it
    lib_sim.end_capture(origin)
    assert cu.cuStreamIsCapturing(side, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE
