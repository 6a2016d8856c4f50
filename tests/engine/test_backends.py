"""Host-tier backends on the simulated GPU: choice, fallbacks, placement
verification, and migration per backend."""

import ctypes

import pytest

import cxlalloc

MiB = 1 << 20


def test_auto_prefers_host_vmm(make_alloc):
    a = make_alloc()
    info = a.info()
    assert info["backend"] == "host-vmm"
    assert info["backend_support"]["host-vmm"] == (True, "")
    assert info["demotion_supported"]


def test_auto_falls_back_when_host_numa_vmm_is_missing(machine, make_alloc):
    machine("vram=1GiB,attr.141=0")
    a = make_alloc()
    info = a.info()
    assert info["backend"] == "managed"
    ok, reason = info["backend_support"]["host-vmm"]
    assert not ok and "attribute 141" in reason


def test_driver_rejecting_the_node_is_probed_like_nccl(machine, make_alloc):
    machine("vram=1GiB,reject_numa=0")
    a = make_alloc()
    ok, reason = a.info()["backend_support"]["host-vmm"]
    assert not ok and "rejected cuMemCreate on host NUMA node 0" in reason
    assert a.info()["backend"] == "managed"


def test_only_pinned_left(machine, make_alloc):
    machine("vram=1GiB,attr.141=0,attr.89=0")
    a = make_alloc()
    assert a.info()["backend"] == "pinned"
    assert not a.info()["demotion_supported"]


def test_nothing_works_is_a_clear_error(machine, fresh_sim):
    machine("vram=1GiB,attr.141=0,attr.89=0,attr.99=0")
    with pytest.raises(cxlalloc.CudaUnavailableError, match="no host-tier backend works.*pinned: cuMemHostRegister unsupported"):
        cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=64 * MiB)
    # Without a host tier the device alone still works.
    a = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=0)
    p = a.malloc(MiB)
    a.free(p)


def test_explicit_unsupported_backend_names_the_reason(machine, fresh_sim):
    machine("vram=1GiB,attr.89=0")
    with pytest.raises(cxlalloc.CudaUnavailableError, match="backend: 'managed' cannot be used on cuda:0.*attribute 89"):
        cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=64 * MiB, backend="managed")


@pytest.mark.parametrize("backend", ["host-vmm", "managed", "pinned"])
def test_each_backend_spills_and_verifies_placement(make_alloc, backend, sim):
    a = make_alloc(backend=backend, device_limit=16 * MiB)
    p = a.malloc(24 * MiB)
    assert a.tier_of(p) == "host"
    ctypes.memset(p, 0x5A, 24 * MiB)
    assert ctypes.string_at(p + 24 * MiB - 16, 16) == b"\x5a" * 16
    pl = a.stats()["host"]["placement"]
    assert pl["method"] == "simulated"
    assert pl["verified_bytes"] == 24 * MiB and pl["misplaced_bytes"] == 0
    assert sim.host_node_of(p) == 0
    a.free(p)


@pytest.mark.parametrize("backend", ["host-vmm", "managed"])
def test_kv_demotion_and_promotion_per_backend(make_alloc, backend):
    a = make_alloc(backend=backend, device_limit=64 * MiB)
    p = a.malloc(8 * MiB, tag="kv")
    assert a.tier_of(p) == "device"
    data = bytes(range(256)) * (8 * MiB // 256)
    ctypes.memmove(p, data, len(data))
    a.demote(p)
    assert a.tier_of(p) == "host"
    assert ctypes.string_at(p, len(data)) == data
    assert a.stats()["kv"]["host_bytes"] == 8 * MiB
    a.promote(p)
    assert a.tier_of(p) == "device"
    assert ctypes.string_at(p, len(data)) == data
    a.check_invariants()
    a.free(p)


def test_pinned_backend_cannot_demote(make_alloc):
    a = make_alloc(backend="pinned")
    p = a.malloc(8 * MiB, tag="kv")
    with pytest.raises(cxlalloc.UnsupportedError, match="cannot move between tiers"):
        a.demote(p)
    a.free(p)


def test_auto_chooses_the_cpu_less_cxl_node_and_places_spill_there(cxl_machine, make_alloc, sim):
    cxl_machine()
    a = make_alloc(device_limit=16 * MiB)
    assert a.info()["host_node"] == 1
    assert "CPU-less" in a.node_reason
    p = a.malloc(24 * MiB)
    assert a.tier_of(p) == "host"
    assert sim.host_node_of(p) == 1
    s = a.stats()
    assert s["host"]["numa_node"] == 1
    assert s["host"]["placement"]["verified_bytes"] == 24 * MiB
    a.free(p)


def test_relocated_pages_are_reported_never_silently_accepted(cxl_machine, make_alloc, capfd):
    """The driver moving long-term-pinned ZONE_MOVABLE pages off the node
    (docs/sources.md#cpu-less-nodes) must show up in stats and as a warning."""
    cxl_machine(",relocate=1:0")
    a = make_alloc(backend="pinned", device_limit=16 * MiB, numa_node=1)
    p = a.malloc(24 * MiB)
    assert a.tier_of(p) == "host"
    pl = a.stats()["host"]["placement"]
    assert pl["misplaced_bytes"] == 24 * MiB and pl["verified_bytes"] == 0
    assert "landed outside NUMA node 1" in capfd.readouterr().err
    a.free(p)


def test_strict_placement_fails_instead(cxl_machine, make_alloc):
    cxl_machine(",relocate=1:0")
    a = make_alloc(backend="pinned", device_limit=16 * MiB, numa_node=1, strict_placement=True, host_limit=64 * MiB)
    with pytest.raises(cxlalloc.CudaUnavailableError, match="strict_placement"):
        a.malloc(24 * MiB)
    assert a.stats()["host"]["reserved_bytes"] == 0
