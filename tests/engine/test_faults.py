"""A failure injected at every driver call site either falls back cleanly or
raises a clear cxlalloc error, and nothing leaks."""

import gc

import pytest

import cxlalloc
from cxlalloc import _C

MiB = 1 << 20
# A failure injected into a release call leaves that resource (and what it
# pins) held: it cannot be undone, so it must be reported, never silent.
RELEASE_CALLS = {"cuMemRelease", "cuMemUnmap", "cuMemAddressFree", "cuDevicePrimaryCtxRelease", "cuMemFree",
                 "cuMemHostUnregister", "cuEventDestroy", "cuStreamDestroy", "cuMemFreeHost"}
ALLOWED = (cxlalloc.OutOfMemoryError, cxlalloc.DriverError, cxlalloc.CudaUnavailableError,
           cxlalloc.UnsupportedError)


def scenario(state):
    """Touches every engine path: both tiers, all classes, demotion,
    promotion, an extent, frees and cache release.  What it creates goes into
    `state` so the caller can release it after any exception."""
    a = cxlalloc.Allocator(simulate=True, device_limit=48 * MiB, host_limit=96 * MiB, device_headroom=0)
    state["alloc"] = a
    ptrs = state.setdefault("ptrs", [])
    ptrs.append(a.malloc(100_000))
    ptrs.append(a.malloc(18 * MiB, tag="kv"))
    ptrs.append(a.malloc(18 * MiB, tag="kv"))
    ptrs.append(a.malloc(30 * MiB))  # demotes a KV segment or spills
    ptrs.append(a.malloc(5 * MiB, tag="weight"))
    a.demote(ptrs[1])
    if a.stats()["device"]["reserved_bytes"] <= 28 * MiB:
        a.promote(ptrs[1])
    state["ext"] = ext = a.extent(16 * MiB)
    ext.grow(6 * MiB)
    ext.trim(2 * MiB)


def run_scenario():
    """Run the scenario; free everything it made, outside of any exception's
    traceback (which would pin objects); check that stats return to zero.
    Returns the exception raised by the scenario, or None."""
    state = {}
    error = None
    try:
        scenario(state)
    except Exception as e:  # classified by the caller
        error = e
        error.__traceback__ = None  # frames would pin the scenario's objects
    a = state.get("alloc")
    if a is not None:
        for p in state.get("ptrs", []):
            a.free(p)
        state.pop("ext", None)
        gc.collect()
        s = a.stats()
        assert s["device"]["allocated_bytes"] == 0 and s["host"]["allocated_bytes"] == 0, s
        a.empty_cache()
    state.clear()
    del a
    gc.collect()
    return error


def test_clean_run_calls_the_driver(fresh_sim):
    fresh_sim.reset_counts()
    assert run_scenario() is None
    called = fresh_sim.called_functions()
    for fn in ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemAddressReserve", "cuMemcpy", "cuMemUnmap",
               "cuMemRelease", "cuMemAddressFree", "cuCtxSynchronize"):
        assert fn in called, fn


def fault_sweep():
    """Inject a failure at every driver call site of the scenario, one at a
    time, and check each outcome.  Runs in a subprocess (see the test below):
    failures injected into release calls leave driver resources held for the
    rest of the process, which must not leak into other tests."""
    from cxlalloc import _sim

    sim = _sim.Sim()
    sim.configure("vram=1GiB")
    sim.reset_counts()
    assert run_scenario() is None
    counts = {fn: sim.call_count(fn) for fn in sim.called_functions()}
    assert counts, "the scenario made no driver calls"
    outcomes = {"ok": 0, "error": 0, "cases": 0, "functions": len(counts)}
    for fn, n in sorted(counts.items()):
        # Every call of rarely-called functions, a spread of the frequent ones.
        picks = sorted({1, 2, 3, n // 2, n} - {0}) if n > 3 else range(1, n + 1)
        for k in picks:
            outcomes["cases"] += 1
            sim.clear_faults()
            before = sim.live()
            reported = _C.cleanup_failures()
            sim.fail(fn, k, 2 if fn in ("cuMemCreate", "cuMemAlloc", "cuMemAllocManaged") else 999)
            e = run_scenario()
            sim.clear_faults()
            if e is None:
                outcomes["ok"] += 1
            else:
                outcomes["error"] += 1
                assert isinstance(e, ALLOWED + (ValueError,)), f"{fn} call {k}: unexpected {type(e).__name__}: {e}"
                msg = str(e)
                if isinstance(e, cxlalloc.DriverError):
                    assert e.call == fn and "CUDA_ERROR" in msg, msg  # names the failing call and code
                elif isinstance(e, cxlalloc.OutOfMemoryError):
                    assert "out of memory" in msg, msg
                else:  # a fallback that changed what is possible, explained
                    assert len(msg) > 30, msg
            e = None
            gc.collect()
            after = sim.live()
            leaked = {key: after[key] - before[key] for key in after if after[key] > before[key]}
            if fn in RELEASE_CALLS:
                if leaked:
                    assert _C.cleanup_failures() > reported, f"{fn} failed silently: {leaked}"
            else:
                assert not leaked, f"leak after a fault in {fn} (call {k}): {leaked}"
    return outcomes


def test_fault_at_every_call_site():
    import json
    import subprocess
    import sys

    code = ("import json, sys; sys.path.insert(0, '.'); import tests.engine.test_faults as t; "
            "print(json.dumps(t.fault_sweep()))")
    root = __file__.rsplit("/tests/", 1)[0]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    outcomes = json.loads(r.stdout.strip().splitlines()[-1])
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes
    # Every driver function the scenario calls was failed at least once.
    assert outcomes["functions"] >= 20 and outcomes["cases"] >= outcomes["functions"], outcomes


def test_driver_oom_at_segment_creation_falls_back_to_host(make_alloc, sim):
    a = make_alloc()
    # CUDA_ERROR_OUT_OF_MEMORY for the 20 MiB segment and for the exact-size retry.
    sim.fail("cuMemCreate", 1, 2)
    sim.fail("cuMemCreate", 2, 2)
    p = a.malloc(4 * MiB)
    assert a.tier_of(p) == "host"
    assert a.stats()["device"]["reserved_bytes"] == 0
    a.free(p)


def test_unexpected_driver_error_is_raised_with_call_and_code(make_alloc, sim):
    a = make_alloc()
    sim.fail("cuMemMap", 1, 1)  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(cxlalloc.DriverError) as e:
        a.malloc(4 * MiB)
    assert e.value.call == "cuMemMap"
    assert e.value.code == 1
    assert "CUDA_ERROR_INVALID_VALUE" in str(e.value)
    s = a.stats()
    assert s["device"]["reserved_bytes"] == 0 and s["device"]["allocated_bytes"] == 0
    p = a.malloc(4 * MiB)  # and it still works
    a.free(p)


def test_extent_oom_names_the_tier_that_is_full_and_the_remedy_that_helps(make_alloc, sim):
    """Growing a KV extent when VRAM is at device_limit: with the host tier at
    host_limit the error says so and asks to raise a limit; with the host
    tier's limit not reached but the driver refusing the chunk (the node's
    memory is full), it says the limit is not the problem instead of "raise
    host_limit", which could not help."""
    a = make_alloc(device_limit=4 * MiB, host_limit=4 * MiB)
    ext = a.extent(8 * MiB)
    ext.grow(8 * MiB)  # 2 chunks in VRAM, 2 on the host tier: both at their limits
    more = a.extent(2 * MiB)
    with pytest.raises(cxlalloc.OutOfMemoryError) as e:
        more.grow(2 * MiB)
    msg = str(e.value)
    assert "(device tier at its limit; host tier at its limit)" in msg, msg
    assert "Raise host_limit or device_limit" in msg, msg
    b = make_alloc(device_limit=4 * MiB, host_limit=64 * MiB)
    p = b.malloc(4 * MiB)  # VRAM full of non-KV memory: nothing to demote, the chunk goes to the host tier
    assert b.tier_of(p) == "device"
    ext2 = b.extent(8 * MiB)
    sim.fail("cuMemCreate", 1, 2)  # the host chunk: CUDA_ERROR_OUT_OF_MEMORY, far below host_limit
    with pytest.raises(cxlalloc.OutOfMemoryError) as e:
        ext2.grow(2 * MiB)
    msg = str(e.value)
    assert "host tier refused by the driver (its memory is full below its limit)" in msg, msg
    assert "raising host_limit cannot help" in msg and "Raise host_limit or device_limit" not in msg, msg
    del ext, more, ext2
    b.free(p)


def test_driver_oom_while_demoting_for_a_growing_extent_places_the_chunk_elsewhere(make_alloc, sim):
    """Growing a KV extent with VRAM full of older KV: the policy demotes an old
    chunk to make room; when the driver has no host memory for that copy, the
    growth goes on without the demotion (the new chunk lands on the host tier
    when the driver then has room) instead of a raw DriverError."""
    a = make_alloc(device_limit=4 * MiB, host_limit=64 * MiB)
    ext = a.extent(16 * MiB)
    ext.grow(4 * MiB)  # both device chunks
    sim.fail("cuMemCreate", 1, 2)  # the demotion's host copy: CUDA_ERROR_OUT_OF_MEMORY
    ext.grow(6 * MiB)
    tiers = {t for _off, _len, t in ext.tiers()}
    assert ext.committed == 6 * MiB and "host" in tiers and "device" in tiers
    assert a.stats()["device"]["reserved_bytes"] <= 4 * MiB
    del ext
