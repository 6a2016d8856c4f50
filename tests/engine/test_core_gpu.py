"""The allocator on a real GPU (skipped without CUDA; run by scripts/gpu_check.sh).

Each test uses a small device_limit to emulate a small GPU: the shared test
GPU's real VRAM is never oversubscribed, and managed memory stays far below
half of the card's free memory.
"""

import pytest
import torch

import cxlalloc

pytestmark = pytest.mark.gpu

MiB = 1 << 20
BACKENDS = ["host-vmm", "managed", "pinned"]


def _alloc(**kw):
    kw.setdefault("device_limit", 256 * MiB)
    kw.setdefault("host_limit", 1024 * MiB)
    try:
        return cxlalloc.Allocator(**kw)
    except cxlalloc.CudaUnavailableError as e:
        pytest.skip(f"backend not supported on this GPU: {e}")


def test_capability_probe_reports_every_backend():
    a = _alloc()
    info = a.info()
    assert set(info["backend_support"]) == {"device", "host-vmm", "managed", "pinned"}
    for name, (ok, reason) in info["backend_support"].items():
        assert ok or reason, f"{name} unsupported without a reason"
    assert info["backend"] in BACKENDS
    assert info["total_bytes"] > 0 and info["device_granularity"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_tier_tensor_is_a_cuda_tensor_that_kernels_read_and_write(backend):
    a = _alloc(backend=backend, device_limit=16 * MiB)
    spilled = a.tensor((24 * MiB // 4,), torch.float32, tag="kv")  # larger than the device tier
    assert spilled.device.type == "cuda"
    assert a.tier_of(spilled.data_ptr()) == "host"
    spilled.copy_(torch.arange(spilled.numel(), device="cuda", dtype=torch.float32))  # GPU writes
    n = spilled.numel()
    assert float(spilled.double().sum()) == n * (n - 1) / 2  # a GPU kernel reads host-tier memory
    on_device = a.tensor((4 * MiB // 4,), torch.float32)
    assert a.tier_of(on_device.data_ptr()) == "device"
    on_device.copy_(spilled[: on_device.numel()])
    assert torch.equal(on_device, spilled[: on_device.numel()])
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_placement_is_verified(backend):
    a = _alloc(backend=backend, device_limit=16 * MiB)
    t = a.tensor((32 * MiB,), torch.uint8)
    assert a.tier_of(t.data_ptr()) == "host"
    pl = a.stats()["host"]["placement"]
    # Either verified on the node, or explicitly unverifiable: never assumed.
    assert pl["verified_bytes"] + pl["misplaced_bytes"] + pl["unverified_bytes"] >= 32 * MiB
    assert pl["method"] == "move_pages"


@pytest.mark.parametrize("backend", ["host-vmm", "managed"])
def test_demotion_and_promotion_keep_address_and_bytes_on_gpu(backend):
    a = _alloc(backend=backend)
    t = a.tensor((8 * MiB // 4,), torch.float32, tag="kv")
    t.copy_(torch.randn(t.numel(), device="cuda", generator=torch.Generator("cuda").manual_seed(0)))
    ref = t.clone()
    ptr = t.data_ptr()
    a.demote(ptr)
    assert a.tier_of(ptr) == "host" and t.data_ptr() == ptr
    assert torch.equal(t, ref)  # kernels read the demoted bytes over the link
    t.mul_(2.0)                 # and write them
    a.promote(ptr)
    assert a.tier_of(ptr) == "device"
    assert torch.equal(t, ref * 2.0)


def test_extent_spans_tiers_and_reads_as_one_tensor():
    a = _alloc(kv_device_limit=8 * MiB, device_limit=64 * MiB)
    e = a.extent(32 * MiB)
    e.grow(24 * MiB)
    tiers = e.tiers()
    assert ("host" in {t for _, _, t in tiers}) and ("device" in {t for _, _, t in tiers})
    v = e.tensor(torch.float32)[: 24 * MiB // 4]
    v.copy_(torch.ones_like(v))
    assert float(v.sum()) == v.numel()


def test_oom_past_both_tiers_keeps_the_allocator_usable():
    a = _alloc(device_limit=32 * MiB, host_limit=32 * MiB)
    keep = [a.tensor((30 * MiB,), torch.uint8), a.tensor((30 * MiB,), torch.uint8)]
    with pytest.raises(cxlalloc.OutOfMemoryError, match="tried to allocate"):
        a.tensor((30 * MiB,), torch.uint8)
    small = a.tensor((1024,), torch.uint8)
    small.zero_()
    del keep
