"""Stream-ordered reuse, record_stream and graph capture on the simulated GPU
(cases C06, C12, C14 at the allocator layer)."""

import ctypes

import pytest

import cxlalloc

MiB = 1 << 20


def test_c06_event_pending_frees_are_reclaimed_before_spilling(make_alloc, streams, sim):
    """C06 (pytorch#71616): a free waiting on a busy stream's event, with more
    frees queued behind it, must be reused on device, not spilled."""
    a = make_alloc(device_limit=64 * MiB)
    sa, sb, sc = streams.new(), streams.new(), streams.new()
    p = a.malloc(40 * MiB, stream=sa)
    a.record_stream(p, sb)
    sim.stream_sleep(sb, 200_000)  # a long kernel on the other stream
    a.free(p)
    # Small record_stream frees on a fast stream queue up behind it.
    for _ in range(3):
        q = a.malloc(1 * MiB, stream=sa)
        a.record_stream(q, sc)
        a.free(q)
    r = a.malloc(40 * MiB, stream=sa)  # fits only by reusing p's block
    assert r == p
    assert a.tier_of(r) == "device"
    s = a.stats()
    assert s["spilled_bytes"] == 0, "spurious spill: the pending free was not reclaimed"
    assert s["event_drains"] >= 1
    a.free(r)
    a.check_invariants()


def test_pending_frees_do_not_block_each_other(make_alloc, streams, sim):
    """Completed events behind a slow one are processed (not FIFO-blocked)."""
    a = make_alloc()
    sa, slow, fast = streams.new(), streams.new(), streams.new()
    p = a.malloc(4 * MiB, stream=sa)
    a.record_stream(p, slow)
    sim.stream_sleep(slow, 500_000)
    a.free(p)
    q = a.malloc(4 * MiB, stream=sa)  # p is pending: another block
    assert q != p
    a.record_stream(q, fast)
    a.free(q)
    streams.synchronize(fast)
    r = a.malloc(4 * MiB, stream=sa)
    assert r == q, "q's event completed; it must be reusable although p's is still pending"
    a.free(r)
    streams.synchronize(slow)


def test_c12_host_blocks_are_reused_only_after_their_streams_pass(make_alloc, streams, sim):
    """C12: host pages are reused only after the last-use stream's event."""
    a = make_alloc(kv_device_limit=0)  # KV goes straight to the host tier
    sa, sb = streams.new(), streams.new()
    p = a.malloc(24 * MiB, tag="kv", stream=sa)
    assert a.tier_of(p) == "host"
    a.record_stream(p, sb)
    sim.stream_sleep(sb, 200_000)
    sim.stream_write_u64(sb, p, 0xDEAD)  # the other stream still writes p
    a.free(p)
    q = a.malloc(24 * MiB, tag="kv", stream=sa)
    assert q != p, "host pages were reused while a stream still used them"
    streams.synchronize(sb)
    a.free(q)
    r = a.malloc(24 * MiB, tag="kv", stream=sa)
    assert r in (p, q)
    assert ctypes.c_uint64.from_address(p).value == 0xDEAD  # the stream's write landed before any reuse
    a.free(r)
    a.check_invariants()


def test_event_drain_for_device_room_never_exposes_busy_host_pages(make_alloc, streams, sim):
    """A host block freed with a busy stream may only be handed out after that
    stream's work is done, whatever path the allocator takes."""
    a = make_alloc(device_limit=16 * MiB)
    sa, sb = streams.new(), streams.new()
    p = a.malloc(24 * MiB, stream=sa)
    assert a.tier_of(p) == "host"
    a.record_stream(p, sb)
    sim.stream_sleep(sb, 100_000)
    sim.stream_write_u64(sb, p, 0xBEEF)
    a.free(p)
    q = a.malloc(24 * MiB, stream=sa)
    if q == p:
        assert ctypes.c_uint64.from_address(p).value == 0xBEEF, "reused before the stream finished"
    a.free(q)
    streams.synchronize(sb)


def test_driver_refusing_a_host_segment_waits_for_the_busy_block_and_is_counted(make_alloc, streams, sim):
    """The H200 record_stream run reused a freed host block once its stream
    had finished, where a new segment was expected.  One path that does this
    is the driver refusing the new segment: the engine then waits for the
    pending free (never exposing busy pages) and reuses it.  That path must be
    visible in stats, so a GPU run can tell it from a synchronous free."""
    a = make_alloc(device_limit=8 * MiB, host_limit=1024 * MiB, backend="host-vmm")
    sa, sb = streams.new(), streams.new()
    p = a.malloc(64 * MiB, stream=sa)
    assert a.tier_of(p) == "host"
    a.record_stream(p, sb)
    sim.stream_sleep(sb, 100_000)
    sim.stream_write_u64(sb, p, 0xC0DE)
    a.free(p)
    sim.fail("cuMemCreate", nth=1)  # the budget allows a new host segment; the driver says out of memory
    q = a.malloc(64 * MiB, stream=sa)
    s = a.stats()
    assert s["driver_refused_host_segments"] == 1 and s["driver_refused_device_segments"] == 0, s
    assert s["event_record_failures"] == 0, s
    assert q == p and a.tier_of(q) == "host"
    assert ctypes.c_uint64.from_address(p).value == 0xC0DE, "reused before the stream finished"
    a.free(q)
    a.check_invariants()


def test_free_after_a_use_stream_was_destroyed_keeps_the_allocator_consistent(make_alloc, streams, sim):
    """record_stream with a stream that is gone by the time of the free: the
    event cannot be recorded, the stream cannot be waited for; the free falls
    back to waiting for the whole context, completes, and the block is reusable
    (before the fix the free raised half-way and stranded the block)."""
    a = make_alloc()
    sa, gone = streams.new(), streams.new()
    p = a.malloc(1 * MiB, stream=sa)
    with pytest.raises(ValueError, match="stream 0xdead000 is not a live CUDA stream"):
        a.record_stream(p, 0xDEAD000)  # not a stream at all: refused up front
    a.record_stream(p, gone)
    streams.destroy(gone)  # gone by the time of the free
    streams.streams.remove(gone)
    a.free(p)
    a.check_invariants()
    s = a.stats()
    assert s["event_record_failures"] == 1 and s["device"]["allocated_bytes"] == 0
    assert a.malloc(1 * MiB, stream=sa) == p  # reusable at once
    a.free(p)
    assert a.empty_cache() > 0
    a.check_invariants()


def test_same_stream_reuse_is_immediate(make_alloc, streams):
    a = make_alloc()
    s = streams.new()
    p = a.malloc(1 * MiB, stream=s)
    a.free(p)
    assert a.malloc(1 * MiB, stream=s) == p


def test_blocks_are_not_shared_across_streams(make_alloc, streams):
    a = make_alloc()
    s1, s2 = streams.new(), streams.new()
    p = a.malloc(1 * MiB, stream=s1)
    a.free(p)
    q = a.malloc(1 * MiB, stream=s2)
    assert q != p
    a.free(q)


def test_c14_capture_stays_on_device_and_issues_no_illegal_calls(make_alloc, streams, sim):
    a = make_alloc(device_limit=32 * MiB)
    host_block = a.malloc(40 * MiB)  # host-backed memory exists
    assert a.tier_of(host_block) == "host"
    s, other = streams.new(), streams.new()
    sim.begin_capture(s)
    try:
        p = a.malloc(1 * MiB, stream=s)
        assert a.tier_of(p) == "device"
        with pytest.raises(cxlalloc.CaptureError, match="graph capture"):
            a.malloc(31 * MiB, stream=s)
        a.record_stream(p, other)
        a.free(p)  # events must wait until the capture ends
        assert sim.capture_violations() == 0
    finally:
        sim.end_capture(s)
    assert a.stats()["capture_refusals"] == 1
    q = a.malloc(512, stream=s)  # flushes the deferred free
    a.free(q)
    a.free(host_block)
    streams.synchronize(other)
    a.empty_cache()
    a.check_invariants()
    assert sim.capture_violations() == 0
