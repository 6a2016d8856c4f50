"""The tiered caching allocator on the simulated GPU: placement, spill,
reuse, frees, accounting."""

import ctypes
import re
import resource
import time

import pytest

import cxlalloc

MiB = 1 << 20


def test_small_allocations_stay_on_device_until_budget_full(make_alloc):
    a = make_alloc(device_limit=64 * MiB)
    ptrs = []
    # 2 MiB requests are carved from 20 MiB segments: 3 segments (60 MiB) fit in 64 MiB.
    for _ in range(30):
        p = a.malloc(2 * MiB)
        ptrs.append(p)
        assert a.tier_of(p) == "device"
    s = a.stats()
    assert s["spilled_bytes"] == 0
    assert s["device"]["allocated_bytes"] == 60 * MiB
    assert s["device"]["reserved_bytes"] == 60 * MiB
    assert s["host"]["allocated_bytes"] == 0
    # A 4th 20 MiB segment does not fit, but exact 2 MiB segments still do:
    # rounding alone must not cause a spill.
    for _ in range(2):
        p = a.malloc(2 * MiB)
        ptrs.append(p)
        assert a.tier_of(p) == "device"
    assert a.stats()["device"]["reserved_bytes"] == 64 * MiB
    # Now the device is full: the next one spills.
    p = a.malloc(2 * MiB)
    assert a.tier_of(p) == "host"
    s = a.stats()
    assert s["spilled_bytes"] == 2 * MiB
    assert s["host"]["allocated_bytes"] == 2 * MiB
    assert s["device"]["reserved_bytes"] <= s["device"]["limit_bytes"]
    for q in ptrs + [p]:
        a.free(q)
    a.check_invariants()
    s = a.stats()
    assert s["device"]["allocated_bytes"] == 0 and s["host"]["allocated_bytes"] == 0


def test_every_byte_placed_under_budgets(make_alloc):
    a = make_alloc(device_limit=32 * MiB, host_limit=64 * MiB)
    sizes = [300, 4096, 700 * 1024, 3 * MiB, 12 * MiB, 25 * MiB, 1000, 5 * MiB]
    live = []
    for sz in sizes * 2:
        try:
            live.append((a.malloc(sz), sz))
        except cxlalloc.OutOfMemoryError:
            break
    s = a.stats()
    assert s["device"]["reserved_bytes"] <= 32 * MiB
    assert s["host"]["reserved_bytes"] <= 64 * MiB
    # Block sizes from the snapshot (an independent walk of every segment);
    # a block is its rounded request plus, at most, an unsplit remainder.
    blocks = {b["ptr"]: (b["size"], seg["tier"]) for seg in a.snapshot() for b in seg["blocks"] if b["allocated"]}
    assert set(blocks) == {p for p, _ in live}
    for p, sz in live:
        rounded = max(512, (sz + 511) // 512 * 512)
        assert rounded <= blocks[p][0] <= rounded + (1 << 20)
        assert blocks[p][1] == a.tier_of(p)
    dev = sum(size for size, tier in blocks.values() if tier == "device")
    host = sum(size for size, tier in blocks.values() if tier == "host")
    assert dev > 0 and host > 0
    assert s["device"]["allocated_bytes"] == dev
    assert s["host"]["allocated_bytes"] == host
    assert s["other"]["device_bytes"] == dev and s["other"]["host_bytes"] == host
    a.check_invariants()
    for p, _ in live:
        a.free(p)


def test_kv_goes_to_host_after_its_device_quota_other_stays_on_device(make_alloc):
    a = make_alloc(device_limit=64 * MiB, kv_device_limit=20 * MiB)
    kv1 = a.malloc(12 * MiB, tag="kv")
    assert a.tier_of(kv1) == "device"
    kv2 = a.malloc(12 * MiB, tag="kv")  # quota of 20 MiB used by kv1's 20 MiB segment
    assert a.tier_of(kv2) == "host"
    other = a.malloc(12 * MiB)
    assert a.tier_of(other) == "device"
    s = a.stats()
    assert s["kv"]["host_bytes"] == 12 * MiB and s["kv"]["device_bytes"] == 12 * MiB
    assert s["other"]["host_bytes"] == 0
    for p in (kv1, kv2, other):
        a.free(p)


def test_other_demotes_cold_kv_instead_of_spilling(make_alloc, sim):
    a = make_alloc(device_limit=64 * MiB)
    kvs = [a.malloc(18 * MiB, tag="kv") for _ in range(3)]  # 3 x 18 MiB segments on the device
    assert all(a.tier_of(p) == "device" for p in kvs)
    # Fill KV with a pattern to check after demotion.
    for i, p in enumerate(kvs):
        ctypes.memset(p, 0x40 + i, 18 * MiB)
    other = a.malloc(18 * MiB)
    assert a.tier_of(other) == "device", "non-KV data must stay in VRAM; KV is what spills"
    s = a.stats()
    assert s["other"]["host_bytes"] == 0
    assert s["demoted_bytes"] == 18 * MiB
    demoted = [p for p in kvs if a.tier_of(p) == "host"]
    assert demoted == [kvs[0]], "the coldest (oldest) KV segment is demoted first"
    for i, p in enumerate(kvs):
        assert ctypes.string_at(p, 18 * MiB) == bytes([0x40 + i]) * (18 * MiB)
    a.check_invariants()
    for p in kvs + [other]:
        a.free(p)


def test_size_class_rounding_neither_spills_kv_nor_skips_demotion(make_alloc):
    """torch's size classes put a 1-10 MiB request in a 20 MiB segment; the
    allocator also takes a segment of the request's own size, so the policy
    judges VRAM room (and how much KV to demote) by that size: "VRAM first"
    and "demote cold KV rather than spill" hold at these sizes too."""
    a = make_alloc(device_limit=16 * MiB)
    kvs = [a.malloc(6 * MiB, tag="kv"), a.malloc(6 * MiB, tag="kv")]
    assert [a.tier_of(k) for k in kvs] == ["device", "device"]  # was: host, with VRAM empty
    a.mark_step()
    a.mark_step()
    w = a.malloc(8 * MiB, tag="weight")
    s = a.stats()
    assert a.tier_of(w) == "device"
    assert (s["demoted_bytes"], s["spilled_bytes"]) == (6 * MiB, 0)  # one KV segment, not both
    assert sorted(a.tier_of(k) for k in kvs) == ["device", "host"]
    for p in kvs + [w]:
        a.free(p)
    a.check_invariants()
    b = make_alloc(device_limit=16 * MiB, kv_device_limit=4 * MiB)
    q = b.malloc(3 * MiB, tag="kv")  # within the 4 MiB KV quota: VRAM
    assert b.tier_of(q) == "device"
    b.free(q)


def test_demotion_keeps_pointer_and_bytes(make_alloc):
    a = make_alloc()
    p = a.malloc(3 * MiB, tag="kv")
    data = bytes(range(256)) * (3 * MiB // 256)
    ctypes.memmove(p, data, len(data))
    before = a.stats()["device"]["allocated_bytes"]
    moved = a.demote(p)
    assert moved == 20 * MiB
    assert a.tier_of(p) == "host"
    assert ctypes.string_at(p, len(data)) == data
    s = a.stats()
    assert s["device"]["allocated_bytes"] == before - 3 * MiB
    assert s["device"]["reserved_bytes"] == 0
    assert s["host"]["allocated_bytes"] == 3 * MiB
    assert s["kv"]["host_bytes"] == 3 * MiB
    assert a.promote(p) == 20 * MiB
    assert a.tier_of(p) == "device"
    assert ctypes.string_at(p, len(data)) == data
    a.check_invariants()
    a.free(p)


def test_cached_segments_are_reused_no_growth(make_alloc, sim):
    a = make_alloc()
    for i in range(1000):
        p = a.malloc((i % 7 + 1) * 100_000)
        a.free(p)
    s = a.stats()
    assert s["new_device_segments"] == 1
    assert s["device"]["reserved_bytes"] == 2 * MiB
    assert s["cache_hits"] == 999
    assert sim.live()["phys_handles"] == 1


def test_host_tier_reuses_blocks_in_steady_loop(make_alloc, sim):
    """C14 (ii): a loop allocating 1.5x the device cap keeps host reserved flat."""
    a = make_alloc(device_limit=16 * MiB, host_limit=128 * MiB)
    sizes = []
    for _ in range(1000):
        p = a.malloc(24 * MiB)
        assert a.tier_of(p) == "host"
        a.free(p)
        sizes.append(a.stats()["host"]["reserved_bytes"])
    assert len(set(sizes)) == 1 and sizes[0] == 24 * MiB
    s = a.stats()
    assert s["new_host_segments"] == 1
    assert s["device"]["allocated_bytes"] == 0


def test_invalid_and_double_free_are_rejected(make_alloc):
    a = make_alloc()
    p = a.malloc(4096)
    q = a.malloc(4096)
    a.free(p)
    with pytest.raises(cxlalloc.InvalidFreeError, match="double free"):
        a.free(p)
    with pytest.raises(cxlalloc.InvalidFreeError, match="interior pointer"):
        a.free(q + 512)
    with pytest.raises(cxlalloc.InvalidFreeError, match="not allocated by cxlalloc"):
        a.free(0x1234000)
    s = a.stats()
    assert s["invalid_frees"] == 3
    assert s["device"]["allocated_bytes"] == 512 * 8  # q is still live, untouched
    a.check_invariants()
    a.free(q)
    a.check_invariants()


def test_absurd_sizes_fail_fast_without_touching_pages(make_alloc, sim):
    a = make_alloc()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sim.reset_counts()
    for n in (1 << 62, (1 << 64) - 1, 10 << 40):
        t0 = time.perf_counter()
        with pytest.raises(cxlalloc.OutOfMemoryError) as e:
            a.malloc(n)
        assert time.perf_counter() - t0 < 1.0
        assert "larger than either tier" in str(e.value)
    assert sim.call_count("cuMemCreate") == 0
    assert sim.call_count("cuMemAddressReserve") == 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 16 * 1024  # KiB
    assert a.stats()["ooms"] == 3


def test_oom_message_names_request_tiers_and_node(make_alloc):
    a = make_alloc(device_limit=32 * MiB, host_limit=32 * MiB)
    p = a.malloc(30 * MiB)
    q = a.malloc(30 * MiB)
    with pytest.raises(cxlalloc.OutOfMemoryError) as e:
        a.malloc(30 * MiB)
    msg = str(e.value)
    assert isinstance(e.value, MemoryError)
    assert "tried to allocate 30.00 MiB" in msg
    assert "device tier" in msg and "of 32.00 MiB limit" in msg
    assert "host tier (NUMA node" in msg
    # Still usable after the OOM (a small-pool segment still fits).
    r = a.malloc(512 * 1024)
    for x in (p, q, r):
        a.free(x)


def test_oom_says_when_the_driver_refused_what_the_budget_allowed(make_alloc, sim):
    """The budget has room but the GPU does not (another process holds it):
    the OOM must say the driver refused, or its tier numbers (0 B of 512 MiB)
    make no sense."""
    a = make_alloc(device_limit=512 * MiB, host_limit=64 * MiB)
    sim.fail("cuMemCreate", nth=1)  # the driver: out of memory
    with pytest.raises(cxlalloc.OutOfMemoryError) as e:
        a.malloc(384 * MiB)
    assert "the driver refused a new device-tier segment although the budget allowed it" in str(e.value)
    s = a.stats()
    assert s["driver_refused_device_segments"] == 1 and s["device"]["reserved_bytes"] == 0
    p = a.malloc(256 * MiB)  # what does fit still works
    assert a.tier_of(p) == "device"
    a.free(p)


@pytest.mark.parametrize("kw,message", [
    (dict(device_limit=1), "device_limit: 1 B is below cuda:0's allocation granularity (2.00 MiB)"),
    (dict(device_limit="1MiB"), "device_limit: 1.00 MiB is below cuda:0's allocation granularity (2.00 MiB)"),
    (dict(host_limit="1MiB"), "host_limit: 1.00 MiB is below the host tier's allocation granularity (2.00 MiB"),
])
def test_limits_below_one_segment_are_refused_naming_the_option(fresh_sim, kw, message):
    """A tier whose limit cannot hold one segment would silently never be
    used: refused at construction, naming the option and the minimum."""
    with pytest.raises(ValueError, match=re.escape(message)):
        cxlalloc.Allocator(simulate=True, **kw)
    cxlalloc.Allocator(simulate=True, device_limit="2MiB", host_limit=0)  # the minimum works


def test_zero_bytes_is_null_and_free_null_is_noop(make_alloc):
    a = make_alloc()
    assert a.malloc(0) == 0
    a.free(0)
    assert a.stats()["allocations"] == 0


def test_host_limit_zero_disables_spilling(make_alloc):
    a = make_alloc(device_limit=32 * MiB, host_limit=0)
    p = a.malloc(30 * MiB)
    with pytest.raises(cxlalloc.OutOfMemoryError):
        a.malloc(30 * MiB)
    assert a.stats()["host"]["backend"] == "none"
    a.free(p)


def test_segments_never_mix_classes(make_alloc):
    a = make_alloc()
    ptrs = {tag: [a.malloc(100_000, tag=tag) for _ in range(3)] for tag in ("kv", "weight", "other")}
    segs = a.snapshot()
    for seg in segs:
        owners = set()
        for blk in seg["blocks"]:
            if not blk["allocated"]:
                continue
            for tag, ps in ptrs.items():
                if blk["ptr"] in ps:
                    owners.add(tag)
        assert len(owners) <= 1 and (not owners or owners == {seg["class"]})
    for ps in ptrs.values():
        for p in ps:
            a.free(p)


def test_c11_cached_device_blocks_are_released_before_spilling(make_alloc):
    """C11 (pytorch#159674): 0.6C, free, 0.7C must succeed on device with 0 spill."""
    cap = 100 * MiB
    a = make_alloc(device_limit=cap)
    p = a.malloc(int(0.6 * cap))
    a.free(p)
    q = a.malloc(int(0.7 * cap))
    assert a.tier_of(q) == "device"
    s = a.stats()
    assert s["spilled_bytes"] == 0
    assert s["reclaimed_bytes"] > 0
    a.free(q)
    assert a.stats()["device"]["reserved_bytes"] > 0
    released = a.empty_cache()
    assert released > 0
    assert a.stats()["device"]["reserved_bytes"] == 0


def test_randomized_operations_match_reference_model(make_alloc):
    import random

    rng = random.Random(1234)
    a = make_alloc(device_limit=48 * MiB, host_limit=96 * MiB)
    live = {}  # ptr -> (size, tag)
    tags = ("other", "kv", "weight")
    sizes = [1, 512, 513, 4000, 65536, 700_000, 1 * MiB, 1 * MiB + 1, 3 * MiB, 9 * MiB, 11 * MiB]
    n_ops = 100_000
    for i in range(n_ops):
        if live and (rng.random() < 0.5 or len(live) > 200):
            p = rng.choice(list(live))
            a.free(p)
            del live[p]
        else:
            sz = rng.choice(sizes)
            tag = rng.choice(tags)
            try:
                p = a.malloc(sz, tag=tag)
            except cxlalloc.OutOfMemoryError:
                continue
            assert p not in live
            live[p] = (sz, tag)
        if i % 10_000 == 0:
            a.check_invariants()
            _check_no_overlap(live)
            _check_accounting(a, live)
    a.check_invariants()
    _check_no_overlap(live)
    _check_accounting(a, live)
    for p in list(live):
        a.free(p)
    s = a.stats()
    assert s["device"]["allocated_bytes"] == 0 and s["host"]["allocated_bytes"] == 0


def _rounded(n):
    return max(512, (n + 511) // 512 * 512)


def _check_no_overlap(live):
    spans = sorted((p, p + _rounded(sz)) for p, (sz, _) in live.items())
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1, "two live allocations overlap"


def _check_accounting(a, live):
    s = a.stats()
    sizes = {b["ptr"]: b["size"] for seg in a.snapshot() for b in seg["blocks"] if b["allocated"]}
    assert set(sizes) == set(live)
    by = {("device", t): 0 for t in ("kv", "weight", "other")}
    by.update({("host", t): 0 for t in ("kv", "weight", "other")})
    for p, (sz, tag) in live.items():
        assert _rounded(sz) <= sizes[p] <= _rounded(sz) + (1 << 20)
        by[(a.tier_of(p), tag)] += sizes[p]
    for tag in ("kv", "weight", "other"):
        assert s[tag]["device_bytes"] == by[("device", tag)]
        assert s[tag]["host_bytes"] == by[("host", tag)]
    assert s["device"]["allocated_bytes"] == sum(v for (t, _), v in by.items() if t == "device")
    assert s["host"]["allocated_bytes"] == sum(v for (t, _), v in by.items() if t == "host")


def test_concurrent_alloc_free_from_8_threads(make_alloc):
    import threading

    # Migrations on (the default): these threads write their blocks with
    # plain CPU stores at any moment, so implicit moves must wait for each
    # block's owner thread (docs/DESIGN.md, "Threads"); tests/engine/test_threads.py
    # does the same with KV extents and reads every byte back.
    a = make_alloc(device_limit=64 * MiB, host_limit=256 * MiB)
    errors = []

    def worker(seed):
        import random

        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(3000):
                if mine and rng.random() < 0.5:
                    p, pattern = mine.pop(rng.randrange(len(mine)))
                    assert ctypes.string_at(p, 64) == pattern * 64, "another thread wrote into my block"
                    a.free(p)
                else:
                    sz = rng.choice([512, 4096, 100_000, 2 * MiB])
                    p = a.malloc(sz, tag=rng.choice(["kv", "other"]))
                    pattern = bytes([seed])
                    ctypes.memset(p, seed, 64)
                    mine.append((p, pattern))
            for p, _ in mine:
                a.free(p)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    a.check_invariants()
    s = a.stats()
    assert s["device"]["allocated_bytes"] == 0 and s["host"]["allocated_bytes"] == 0
    assert s["allocations"] == s["frees"]


def test_stats_shape_has_documented_keys(make_alloc):
    a = make_alloc()
    s = a.stats()
    for tier in ("device", "host"):
        for k in ("allocated_bytes", "limit_bytes", "peak_allocated_bytes", "reserved_bytes"):
            assert isinstance(s[tier][k], int)
    assert s["host"]["numa_node"] == 0
    assert s["host"]["backend"] == "host-vmm"
    for k in ("spilled_bytes", "demoted_bytes", "promoted_bytes"):
        assert s[k] == 0
    for cls in ("kv", "weight", "other"):
        assert set(s[cls]) >= {"device_bytes", "host_bytes", "peak_host_bytes"}
    assert s["torch"]["allocated_bytes.all.current"] == 0


def test_peaks_track_high_water_marks(make_alloc):
    a = make_alloc(device_limit=32 * MiB)
    p = a.malloc(30 * MiB)
    q = a.malloc(10 * MiB)  # host
    a.free(q)
    a.free(p)
    s = a.stats()
    assert s["device"]["peak_allocated_bytes"] == 30 * MiB
    assert s["host"]["peak_allocated_bytes"] == 10 * MiB
    assert s["other"]["peak_host_bytes"] == 10 * MiB
    a.reset_peak_stats()
    assert a.stats()["device"]["peak_allocated_bytes"] == 0


def test_first_fit_policy_is_the_policy_free_baseline(make_alloc):
    """policy="first-fit": no KV quota, no demotion; overflow spills whatever
    comes last (the baseline the benchmarks compare the KV-aware policy with)."""
    a = make_alloc(device_limit=64 * MiB, kv_device_limit=8 * MiB, policy="first-fit")
    assert a.info()["policy"] == "first-fit"
    kvs = [a.malloc(18 * MiB, tag="kv") for _ in range(3)]
    assert all(a.tier_of(p) == "device" for p in kvs)  # no KV quota
    other = a.malloc(18 * MiB)
    assert a.tier_of(other) == "host"  # spilled: nothing was demoted
    assert a.stats()["demoted_bytes"] == 0
    for p in kvs + [other]:
        a.free(p)
