"""A failure injected at every driver call site either falls back cleanly or
raises a clear cxlalloc error, and nothing leaks (issue 2)."""

import gc

import pytest

import cxlalloc

MiB = 1 << 20
ALLOWED = (cxlalloc.OutOfMemoryError, cxlalloc.DriverError, cxlalloc.CudaUnavailableError,
           cxlalloc.UnsupportedError)


def scenario():
    """Touches every engine path: both tiers, all classes, demotion,
    promotion, an extent, frees and cache release.  Returns stats after
    freeing everything it allocated."""
    a = cxlalloc.Allocator(simulate=True, device_limit=48 * MiB, host_limit=96 * MiB, device_headroom=0)
    ptrs = []
    ext = None
    try:
        ptrs.append(a.malloc(100_000))
        ptrs.append(a.malloc(18 * MiB, tag="kv"))
        ptrs.append(a.malloc(18 * MiB, tag="kv"))
        ptrs.append(a.malloc(30 * MiB))  # demotes a KV segment or spills
        ptrs.append(a.malloc(5 * MiB, tag="weight"))
        a.demote(ptrs[1])
        a.promote(ptrs[1]) if a.stats()["device"]["reserved_bytes"] <= 28 * MiB else None
        ext = a.extent(16 * MiB)
        ext.grow(6 * MiB)
        ext.trim(2 * MiB)
        return None
    finally:
        for p in ptrs:
            a.free(p)
        ext = None
        gc.collect()
        s = a.stats()
        assert s["device"]["allocated_bytes"] == 0 and s["host"]["allocated_bytes"] == 0, s
        a.empty_cache()
        del a
        gc.collect()


def test_clean_run_calls_the_driver(fresh_sim):
    fresh_sim.reset_counts()
    scenario()
    called = fresh_sim.called_functions()
    for fn in ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemAddressReserve", "cuMemcpy", "cuMemUnmap",
               "cuMemRelease", "cuMemAddressFree", "cuCtxSynchronize"):
        assert fn in called, fn


def test_fault_at_every_call_site(fresh_sim):
    sim = fresh_sim
    sim.reset_counts()
    scenario()
    counts = {fn: sim.call_count(fn) for fn in sim.called_functions()}
    assert counts, "the scenario made no driver calls"
    outcomes = {"ok": 0, "error": 0}
    for fn, n in sorted(counts.items()):
        # Every call of rarely-called functions, a spread of the frequent ones.
        picks = sorted({1, 2, 3, n // 2, n} - {0}) if n > 3 else range(1, n + 1)
        for k in picks:
            sim.clear_faults()
            sim.fail(fn, k, 2 if fn in ("cuMemCreate", "cuMemAlloc", "cuMemAllocManaged") else 999)
            try:
                scenario()
                outcomes["ok"] += 1
            except ALLOWED as e:
                outcomes["error"] += 1
                msg = str(e)
                assert msg and ("CUDA" in msg or "out of memory" in msg or fn in msg), msg
            except ValueError as e:  # e.g. a driver failure while choosing the node
                outcomes["error"] += 1
                assert str(e)
            sim.clear_faults()
            gc.collect()
            live = sim.live()
            assert sum(live.values()) == 0, f"leak after a fault in {fn} (call {k}): {live}"
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes


def test_driver_oom_at_segment_creation_falls_back_to_host(make_alloc, sim):
    a = make_alloc()
    sim.fail("cuMemCreate", 1, 2)  # CUDA_ERROR_OUT_OF_MEMORY on the device segment
    p = a.malloc(4 * MiB)
    assert a.tier_of(p) == "host"
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
