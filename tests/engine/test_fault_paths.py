"""Fault paths of the engine, one defect per test: a free that fails changes
nothing, a tensor whose free fails is parked and freed later, rebalance
stays within device_limit, extent views cover committed bytes only, bad
arguments (migrate length, huge extents, stream handles, sizes, numa_node)
raise errors that name the option, and the pinned backend refuses a
host_limit above the node's free memory."""

import gc

import pytest

import cxlalloc

MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------- free()
def test_failed_event_create_in_free_leaves_the_block_allocated(make_alloc, sim, streams):
    a = make_alloc(device_limit=32 * MiB)
    s = streams.new()
    p = a.malloc(4 * MiB)
    a.record_stream(p, s)  # the free needs an event on `s`
    before = a.stats()
    sim.fail("cuEventCreate", 1, 2)
    with pytest.raises(cxlalloc.DriverError, match="cuEventCreate"):
        a.free(p)
    sim.clear_faults()
    a.check_invariants()
    after = a.stats()
    assert after["device"]["allocated_bytes"] == before["device"]["allocated_bytes"] == 4 * MiB
    assert any(b["ptr"] == p and b["allocated"] for seg in a.snapshot() for b in seg["blocks"])
    a.free(p)  # the driver works again: the same free succeeds
    a.check_invariants()
    assert a.stats()["device"]["allocated_bytes"] == 0
    assert a.empty_cache() > 0 and a.stats()["device"]["reserved_bytes"] == 0  # its segment can be released


def test_failed_tensor_free_is_parked_then_retried(make_alloc, sim, streams):
    import torch

    a = make_alloc(device_limit=32 * MiB)
    s = streams.new()
    t = a.tensor((MiB,), torch.uint8)
    p = t.data_ptr()
    a.record_stream(p, s)
    sim.fail("cuEventCreate", 1, 2)
    del t  # the deleter's free fails: it must neither raise into torch nor leak the block
    gc.collect()
    sim.clear_faults()
    st = a.stats()
    assert st["parked_frees"] == 1 and st["device"]["allocated_bytes"] == MiB
    a.check_invariants()
    q = a.malloc(512)  # the next engine call retries the parked free
    st = a.stats()
    assert st["parked_frees"] == 0 and st["device"]["allocated_bytes"] == 512
    a.free(q)
    with pytest.raises(cxlalloc.InvalidFreeError, match="double free"):
        a.free(p)  # freed once, by the retry; not "a live tensor owns it"
    a.check_invariants()


# ---------------------------------------------------------------- rebalance()
def test_rebalance_never_reserves_past_device_limit(make_alloc):
    """The reported scenario: cached free device segments counted as room
    for promotions but never released (38 MiB reserved of a 32 MiB limit)."""
    a = make_alloc(device_limit=32 * MiB, host_limit=256 * MiB, promote_after=1)
    e = a.extent(64 * MiB)
    e.grow(40 * MiB)  # the oldest 8 MiB go to the host tier
    assert dict((t, n) for _, n, t in e.tiers() if t != "none") == {"host": 8 * MiB, "device": 32 * MiB}
    e.trim(24 * MiB)  # device room again; then a cached free segment takes it
    p = a.malloc(12 * MiB, tag="other")
    a.free(p)
    assert a.stats()["device"]["reserved_bytes"] > 16 * MiB  # the cached segment is held
    for _ in range(3):
        e.touch()
    moved = a.rebalance()
    s = a.stats()
    assert moved == 8 * MiB  # the host chunks came back ...
    assert s["device"]["reserved_bytes"] <= 32 * MiB  # ... within the limit: the cache was released for them
    assert dict((t, n) for _, n, t in e.tiers() if t != "none") == {"device": 24 * MiB}
    a.check_invariants()


# ---------------------------------------------------------------- Extent.tensor()
def test_extent_views_cover_committed_bytes_only(make_alloc):
    import torch

    a = make_alloc(device_limit=32 * MiB)
    e = a.extent(16 * MiB)
    assert e.tensor().numel() == 0  # nothing committed yet
    e.grow(3 * MiB)
    v = e.tensor()
    assert v.numel() == e.committed == 4 * MiB
    v[-1] = 5  # the last byte of the view is mapped (a read beyond would fault)
    assert int(v[-1]) == 5
    assert e.tensor(torch.float32).numel() == MiB
    # A trim keeps the chunks under a live view; once the view is gone, they go.
    e.trim(0)
    assert e.committed == 4 * MiB and int(v[-1]) == 5
    del v
    gc.collect()
    e.trim(0)
    assert e.committed == 0 and e.tensor().numel() == 0
    a.check_invariants()


# ---------------------------------------------------------------- arguments
def test_migrate_length_past_the_extent_end_names_length(make_alloc):
    a = make_alloc()
    e = a.extent(8 * MiB)
    e.grow(4 * MiB)
    for length in (2 ** 64 - 1, 8 * MiB - 2 * MiB + 1):
        with pytest.raises(ValueError, match=r"migrate: length \d+ runs past the end of the extent.*allowed: 1 \.\. "):
            a.migrate(e.base + 2 * MiB, "host", length)
    assert a.stats()["demoted_bytes"] == 0
    assert a.migrate(e.base + 2 * MiB, "host", 6 * MiB) == 2 * MiB  # to the end: the committed chunk [2, 4) MiB
    a.check_invariants()


def test_huge_extent_is_out_of_memory_naming_size_and_limits(make_alloc, sim):
    a = make_alloc(device_limit=32 * MiB, host_limit=64 * MiB)
    with pytest.raises(cxlalloc.OutOfMemoryError, match=r"tried to allocate 1.00 PiB.*device tier.*limit"):
        a.extent(1 << 50)
    # The driver refusing the address range itself (out of address space) is
    # out of memory too, not a DriverError.
    sim.fail("cuMemAddressReserve", 1, 2)
    with pytest.raises(cxlalloc.OutOfMemoryError, match="no GPU address range of that size could be reserved"):
        a.extent(16 * MiB)
    sim.clear_faults()
    a.check_invariants()


def test_bogus_stream_handles_are_refused_naming_stream(make_alloc, streams):
    a = make_alloc()
    for bogus in (0x1234_5678, 3):
        with pytest.raises(ValueError, match=r"stream 0x[0-9a-f]+ is not a live CUDA stream"):
            a.malloc(4096, stream=bogus)
    p = a.malloc(4096)
    with pytest.raises(ValueError, match="stream"):
        a.record_stream(p, 0xdead_0000)
    s = streams.new()
    q = a.malloc(4096, stream=s)  # a real stream is accepted
    a.free(q)
    streams.destroy(s)
    streams.streams.remove(s)
    with pytest.raises(ValueError, match="is not a live CUDA stream"):
        a.malloc(4096, stream=s)  # destroyed
    a.free(p)
    assert a.stats()["device"]["allocated_bytes"] == 0


@pytest.mark.parametrize("value", ["9" * 300, "9" * 300 + "PiB", "1" + "0" * 400 + "GiB", 10 ** 400])
def test_oversized_sizes_name_the_option(value):
    from cxlalloc.config import parse_size

    with pytest.raises(ValueError, match="cxlalloc option 'host_limit'") as e:
        parse_size(value, "host_limit")
    assert len(str(e.value)) < 300  # the value is shown cut, not 400 digits long
    with pytest.raises(ValueError, match="cxlalloc option 'device_limit'"):
        cxlalloc.config.make_config(device_limit=value)


@pytest.mark.parametrize("option,value", [("host_limit", "١٠MiB"), ("device_limit", "٥٠%"), ("device_limit", "٠.٥"),
                                          ("numa_node", "²"), ("numa_node", "١"), ("promote_after", "²"),
                                          ("device", "cuda:²"), ("migration_rate", "８GiB")])
def test_non_ascii_digits_are_refused_naming_the_option(option, value):
    with pytest.raises(ValueError, match=f"cxlalloc option '{option}'"):
        cxlalloc.config.make_config(**{option: value})


@pytest.mark.parametrize("node", [2 ** 80, 1024, -1])
def test_numa_node_out_of_range_names_numa_node_and_allowed_values(node):
    with pytest.raises(ValueError, match=r"cxlalloc option 'numa_node'.*'auto' or a node id 0\.\.1023"):
        cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, numa_node=node)


# ---------------------------------------------------------------- pinned host_limit
def test_pinned_host_limit_above_node_free_memory_is_refused(machine, tmp_path, monkeypatch):
    """pinned touches and pins every byte of a request at once (host-vmm and
    managed commit lazily): a host_limit above the node's free memory would
    invite the OOM killer, so it is refused with the numbers."""
    from tests.helpers.fake_sysfs import FakeSysfs

    fs = FakeSysfs(tmp_path / "sys")
    fs.node(0, cpus="0-1", mem_gib=16, free_gib=2)
    fs.distances({0: {0: 10}})
    fs.finish()
    monkeypatch.setenv("CXLALLOC_SYSFS_ROOT", str(tmp_path / "sys"))
    machine("vram=1GiB")
    with pytest.raises(ValueError, match=r"host_limit: 3.00 GiB is above the free memory of NUMA node 0 \(2.00 GiB\)"):
        cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=3 * GiB, backend="pinned", numa_node=0)
    a = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=GiB, backend="pinned", numa_node=0)
    assert a.info()["backend"] == "pinned"
    # Lazily committed backends may name more than is free now.
    b = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=3 * GiB, backend="host-vmm", numa_node=0)
    assert b.info()["host_limit"] == 3 * GiB
    del a, b
    gc.collect()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize("backend,pinned", [("pinned", True), ("host-vmm", False), ("managed", False)])
def test_pinned_commits_a_request_at_once_the_others_lazily(make_alloc, backend, pinned):
    """Why only pinned is checked against the node's free memory: it touches
    every page of a host-tier request at once (RSS grows by the request),
    host-vmm and managed commit pages as they are first used."""
    a = make_alloc(device_limit=64 * MiB, host_limit=512 * MiB, backend=backend)
    before = _rss()
    p = a.malloc(192 * MiB)
    grown = _rss() - before
    assert a.tier_of(p) == "host"
    if pinned:
        assert grown >= 190 * MiB, grown
    else:
        assert grown < 32 * MiB, grown
    a.free(p)
    a.empty_cache()
