"""Extents: growable KV buffers at a fixed address with per-chunk placement."""

import ctypes

import pytest

import cxlalloc

MiB = 1 << 20


def test_extent_grows_without_moving_or_copying(make_alloc, sim):
    a = make_alloc(device_limit=64 * MiB)
    e = a.extent(32 * MiB)
    assert e.lazy and e.committed == 0 and e.chunk_bytes == 2 * MiB
    base = e.base
    sim.reset_counts()
    for n in range(1, 9):
        e.grow(n * 3 * MiB)
        ctypes.memset(base + (n - 1) * 3 * MiB, n, 3 * MiB)
        assert e.base == base
    assert sim.call_count("cuMemcpy") == 0, "growth must not copy existing bytes"
    assert e.committed == 24 * MiB
    for n in range(1, 9):
        assert ctypes.string_at(base + (n - 1) * 3 * MiB, 3 * MiB) == bytes([n]) * (3 * MiB)
    assert e.tiers() == [(0, 24 * MiB, "device"), (24 * MiB, 8 * MiB, "none")]
    s = a.stats()
    assert s["kv"]["device_bytes"] == 24 * MiB
    assert s["device"]["allocated_bytes"] == 24 * MiB


def test_extent_keeps_newest_chunks_on_device_and_demotes_oldest(make_alloc):
    a = make_alloc(device_limit=64 * MiB, kv_device_limit=8 * MiB)
    e = a.extent(32 * MiB)
    e.grow(8 * MiB)
    ctypes.memset(e.base, 7, 8 * MiB)
    assert e.tiers()[0] == (0, 8 * MiB, "device")
    e.grow(12 * MiB)
    # Quota 8 MiB: the newest 4 chunks on device, the oldest 2 demoted.
    assert e.tiers()[:2] == [(0, 4 * MiB, "host"), (4 * MiB, 8 * MiB, "device")]
    assert ctypes.string_at(e.base, 8 * MiB) == bytes([7]) * (8 * MiB)
    s = a.stats()
    assert s["demoted_bytes"] == 4 * MiB
    assert s["kv"]["device_bytes"] == 8 * MiB and s["kv"]["host_bytes"] == 4 * MiB
    a.check_invariants()


def test_prefill_larger_than_quota_places_oldest_on_host_directly(make_alloc):
    a = make_alloc(device_limit=64 * MiB, kv_device_limit=8 * MiB)
    e = a.extent(32 * MiB)
    e.grow(20 * MiB)
    assert e.tiers()[:2] == [(0, 12 * MiB, "host"), (12 * MiB, 8 * MiB, "device")]
    assert a.stats()["demoted_bytes"] == 0
    assert a.stats()["spilled_bytes"] == 12 * MiB


def test_extent_trim_releases_chunks(make_alloc):
    a = make_alloc()
    e = a.extent(16 * MiB)
    e.grow(10 * MiB)
    e.trim(3 * MiB)
    assert e.committed == 4 * MiB
    assert a.stats()["device"]["reserved_bytes"] == 4 * MiB
    e.grow(6 * MiB)
    assert e.committed == 6 * MiB


def test_extent_beyond_capacity_is_an_error(make_alloc):
    a = make_alloc()
    e = a.extent(4 * MiB)
    with pytest.raises(ValueError, match="exceeds the extent's capacity"):
        e.grow(5 * MiB)


def test_extent_released_with_last_reference(make_alloc, sim):
    import gc

    import torch

    a = make_alloc()
    e = a.extent(8 * MiB)
    e.grow(8 * MiB)
    t = e.tensor(torch.float32)
    assert t.numel() == 2 * MiB
    del e
    gc.collect()
    t[:10] = 3.0  # the tensor keeps the extent alive
    assert a.stats()["kv"]["device_bytes"] == 8 * MiB
    del t
    gc.collect()
    assert a.stats()["kv"]["device_bytes"] == 0
    assert sim.live()["mappings"] == 0


def test_promotion_after_repeated_use(make_alloc):
    a = make_alloc(device_limit=64 * MiB, kv_device_limit=4 * MiB, promote_after=2)
    e = a.extent(16 * MiB)
    e.grow(8 * MiB)
    assert a.stats()["kv"]["host_bytes"] == 4 * MiB
    assert a.rebalance() == 0  # not used yet
    b = a.malloc(1000, tag="kv")  # noqa: F841 (keeps the quota busy? no: small pool 2 MiB)
    a.free(b)
    e.touch()
    e.touch()
    # Quota still full: nothing may move.
    assert a.rebalance() == 0


def test_fixed_extent_with_pinned_backend(make_alloc):
    a = make_alloc(backend="pinned", device_limit=16 * MiB)
    e = a.extent(32 * MiB)
    assert not e.lazy
    assert e.committed == 32 * MiB
    assert e.tiers() == [(0, 32 * MiB, "host")]
    e.grow(20 * MiB)  # no-op: committed whole
    with pytest.raises(cxlalloc.UnsupportedError):
        a.migrate(e.base, "device")


def test_c04_transient_does_not_demote_kv_read_in_this_step(make_alloc):
    """C04: a short-lived spike (the full-logits copy) must not evict KV the
    current step uses; it goes to the host tier instead, and after the step
    host use falls back to 0."""
    a = make_alloc(device_limit=32 * MiB)
    e = a.extent(32 * MiB)
    e.grow(24 * MiB)
    a.mark_step()
    e.touch()  # attention of this step reads the whole cache
    spike = a.malloc(12 * MiB)  # does not fit next to 24 MiB of KV
    assert a.tier_of(spike) == "host"
    assert a.stats()["demoted_bytes"] == 0
    a.free(spike)
    a.empty_cache()
    assert a.stats()["host"]["reserved_bytes"] == 0
    # Outside the step's working set the same spike demotes cold KV instead.
    a.mark_step()
    spike = a.malloc(12 * MiB)
    assert a.tier_of(spike) == "device"
    assert a.stats()["demoted_bytes"] >= 4 * MiB
    a.free(spike)
