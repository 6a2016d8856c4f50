"""Global mode (``CXLALLOC=1`` / ``cxlalloc.enable()``) on several simulated
GPUs: one allocator per visible GPU with per-GPU options (one value, a list,
or a mapping by device index; CXLALLOC's ``a|b`` and ``0=a|1=b``).

torch here is a CPU-only build, so the torch adapter cannot be linked (see
tests/pytorch/test_torch_adapter_build.py): as test_torch_mode.py does, the
engine is built by the very functions global mode calls
(``visible_devices`` + ``configure_engine``) on a 2-device simulated driver,
installed as the process engine, and driven through the C ABI exactly as the
adapter drives it (``cxlalloc_malloc(size, device, stream)``); a copy between
GPUs is the driver's ``cuMemcpy`` run by one GPU's context (what torch's
copy with P2P enabled comes down to), after ``cxlalloc_enable_peer_access``
(what the adapter's ``enablePeerAccess`` calls); ``torch.cuda.set_device`` is stood in for by
patching torch's current-device query.  Not yet run on several GPUs.
"""

import ctypes
import gc

import pytest

import cxlalloc
from cxlalloc import _C
from cxlalloc.config import check_per_device, make_enable_config, parse_env
from cxlalloc.pytorch import state
from cxlalloc.pytorch.devices import configure_engine, device_config, visible_devices
from tests.helpers.sim_driver import Cu, read, write
from tests.helpers.sim_gpus import sim_gpus
from tests.pytorch.test_torch_mode import FakeAdapter, _capi

MiB = 1 << 20


# ----------------------------------------------------------------- the option forms
def test_per_gpu_option_forms():
    cfg = make_enable_config(device_limit=["64MiB", 32 * MiB], host_limit={0: 0, "cuda:1": "128MiB"},
                             numa_node="auto", device_headroom=0)
    assert device_config(cfg, 0).device_limit == 64 * MiB and device_config(cfg, 1).device_limit == 32 * MiB
    assert device_config(cfg, 0).host_limit == 0 and device_config(cfg, 1).host_limit == 128 * MiB
    assert device_config(cfg, 2).host_limit is None  # a GPU a mapping leaves out: the default
    # CXLALLOC: the same values as text
    env = make_enable_config(**parse_env("device_limit:64MiB|32MiB,host_limit:0=0|cuda:1=128MiB,device_headroom:0"))
    assert env.per_device == cfg.per_device
    # one value is every GPU's, as before
    one = make_enable_config(device_limit="8GiB")
    assert one.per_device == () and device_config(one, 3).device_limit == 8 << 30


@pytest.mark.parametrize("options,message", [
    (dict(device_limit=[]), "cxlalloc option 'device_limit': an empty list; give one value for every GPU, a list "
                            "with one value per visible GPU (device_limit=['8GiB', '4GiB']), or a mapping by device "
                            "index (device_limit={0: '8GiB', 1: '4GiB'}); in CXLALLOC: device_limit:8GiB|4GiB or "
                            "device_limit:0=8GiB|1=4GiB"),
    (dict(device_limit=["1GiB", "lots"]), "cxlalloc option 'device_limit[1]': 'lots' is not a size or fraction"),
    (dict(host_limit={"gpu1": "1GiB"}), "cxlalloc option 'host_limit': the key 'gpu1' is not a device index"),
    (dict(numa_node={0: 1, "cuda:0": 2}), "cxlalloc option 'numa_node': cuda:0 is given twice"),
    (dict(numa_node={1: "far"}), "cxlalloc option 'numa_node[cuda:1]': 'far' is not a NUMA node"),
    (dict(kv_device_limit={"1GiB"}), "cxlalloc option 'kv_device_limit': {'1GiB'} is not one value, a list or a "
                                     "mapping"),
    (dict(device_limit="1GiB|", ), "cxlalloc option 'device_limit': '1GiB|' has an empty value"),
    (dict(device_limit="0=1GiB|0=2GiB"), "cxlalloc option 'device_limit': '0=1GiB|0=2GiB' gives device '0' twice"),
    (dict(device_limit="0=1GiB|2GiB"), "cxlalloc option 'device_limit': '0=1GiB|2GiB' mixes device=value and plain"),
    (dict(device_limit=["1GiB", "2GiB"], device=1), "cxlalloc option 'device': cannot be combined with per-GPU "
                                                    "values of device_limit"),
])
def test_bad_per_gpu_options_name_the_option_and_the_forms(options, message):
    with pytest.raises(ValueError) as e:
        make_enable_config(**options)
    assert str(e.value).startswith(message), str(e.value)


def test_per_gpu_values_are_checked_against_the_visible_gpus():
    with pytest.raises(ValueError, match=r"^cxlalloc option 'device_limit': a list of 3 values for 2 visible GPU\(s\); "
                                         r"give one value for every GPU"):
        check_per_device(make_enable_config(device_limit=["1GiB"] * 3), 2)
    with pytest.raises(ValueError, match=r"^cxlalloc option 'host_limit': cuda:2 is not a visible GPU "
                                         r"\(cuda:0..cuda:1 are\)"):
        check_per_device(make_enable_config(host_limit={2: "1GiB"}), 2)
    with pytest.raises(ValueError, match="a list of 2 values for 1 visible GPU"):
        visible_devices(1, make_enable_config(device_limit=["1GiB", "2GiB"]))  # what enable() calls first


# ----------------------------------------------------------------- two simulated GPUs, global mode's engine
@pytest.fixture
def two_gpu_global(fresh_sim):
    """Global mode's engine over 2 simulated GPUs with per-GPU options
    (GPU 0: 64 MiB of VRAM, no host tier; GPU 1: 32 MiB, 128 MiB host tier),
    installed as the process engine with a global-mode state."""
    with sim_gpus(fresh_sim, 2):
        cfg = make_enable_config(simulate=True, device_limit=[64 * MiB, 32 * MiB], host_limit={0: 0, 1: "128MiB"},
                                 device_headroom=0)
        probe = _C.Engine(cxlalloc.engine.driver_path(cfg), True)
        devices = visible_devices(probe.device_count, cfg)
        del probe
        engine, resolved = configure_engine(cfg, devices, "test")
        _C.set_current_engine(engine)
        state.current = state.State("global", state.settings(cfg), "test", cfg, engine, resolved,
                                    adapter=FakeAdapter())
        box = [engine, resolved, fresh_sim]
        del engine
        try:
            yield box
        finally:
            state.current = None
            _C.set_current_engine(None)
            box.clear()
            gc.collect()


def test_one_allocator_per_gpu_with_its_own_options(two_gpu_global, streams):
    engine, resolved, _ = two_gpu_global
    assert sorted(resolved) == [0, 1]
    assert (resolved[0]["device_limit"], resolved[0]["host_limit"]) == (64 * MiB, 0)
    assert (resolved[1]["device_limit"], resolved[1]["host_limit"]) == (32 * MiB, 128 * MiB)
    s0, s1 = cxlalloc.stats(0), cxlalloc.stats(1)
    assert (s0["device"]["limit_bytes"], s0["host"]["limit_bytes"]) == (64 * MiB, 0)
    assert (s1["device"]["limit_bytes"], s1["host"]["limit_bytes"]) == (32 * MiB, 128 * MiB)
    assert s0["device"]["device"] == 0 and s1["device"]["device"] == 1


def test_gpu_1_allocates_while_gpu_0_is_full(two_gpu_global, streams):
    c = _capi()
    s = streams.new()
    full = c.cxlalloc_malloc(64 * MiB, 0, s)  # all of GPU 0's VRAM; GPU 0 has no host tier
    assert full and c.cxlalloc_tier_of(full, 0) == 0
    assert c.cxlalloc_malloc(2 * MiB, 0, s) is None  # GPU 0 is full
    err = c.cxlalloc_last_error().decode()
    assert c.cxlalloc_last_error_kind() == 2 and "on cuda:0" in err
    on1 = c.cxlalloc_malloc(16 * MiB, 1, s)  # GPU 1 is not: its own VRAM
    assert on1 and c.cxlalloc_tier_of(on1, 1) == 0
    spill1 = c.cxlalloc_malloc(24 * MiB, 1, s)  # past GPU 1's 32 MiB: its own host tier
    assert spill1 and c.cxlalloc_tier_of(spill1, 1) == 1
    s0, s1 = cxlalloc.stats(0), cxlalloc.stats(1)
    assert (s0["device"]["allocated_bytes"], s0["host"]["allocated_bytes"], s0["spilled_bytes"]) == (64 * MiB, 0, 0)
    assert (s1["device"]["allocated_bytes"], s1["host"]["allocated_bytes"]) == (16 * MiB, 24 * MiB)
    assert s1["spilled_bytes"] == 24 * MiB and s0["ooms"] == 1 and s1["ooms"] == 0
    c.cxlalloc_free(full, 64 * MiB, 0, s)
    c.cxlalloc_free(on1, 16 * MiB, 1, s)
    c.cxlalloc_free(spill1, 24 * MiB, 1, s)
    assert cxlalloc.empty_cache() >= 104 * MiB


@pytest.fixture
def current_gpu(two_gpu_global):
    """Make a GPU's primary context current on this thread (what torch's
    device guard does before a copy); released afterwards."""
    cu = Cu(two_gpu_global[2].lib)
    held, old = [], ctypes.c_void_p()
    assert cu.cuCtxGetCurrent(ctypes.byref(old)) == 0

    def use(device):
        ctx = ctypes.c_void_p()
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
        held.append(device)
        assert cu.cuCtxSetCurrent(ctx) == 0
        return cu

    yield use
    cu.cuCtxSetCurrent(old)
    for d in held:
        cu.cuDevicePrimaryCtxRelease(d)


def test_cross_device_copies_need_and_get_peer_access(two_gpu_global, streams, current_gpu):
    """A copy run by GPU 1 between GPU 0's and GPU 1's cxlalloc memory (torch
    with P2P enabled: a plain cudaMemcpyAsync on the destination's stream).
    A VMM mapping opens only to the GPUs cuMemSetAccess names, so it is
    refused until torch's enablePeerAccess reaches cxlalloc
    (``cxlalloc_enable_peer_access``, the adapter's ``enablePeerAccess``);
    then it works for memory mapped before and after, both tiers."""
    c = _capi()
    c.cxlalloc_enable_peer_access.restype = ctypes.c_int
    c.cxlalloc_enable_peer_access.argtypes = [ctypes.c_int, ctypes.c_int]
    s = streams.new()
    on0 = c.cxlalloc_malloc(8 * MiB, 0, s)
    on1 = c.cxlalloc_malloc(8 * MiB, 1, s)
    data = bytes(range(256)) * (MiB // 256)
    cu = current_gpu(1)
    late0 = spill1 = None
    try:
        write(on0, data)
        assert cu.cuMemcpy(on1, on0, MiB) == 1  # CUDA_ERROR_INVALID_VALUE: GPU 1 may not read GPU 0's mapping
        assert c.cxlalloc_enable_peer_access(0, 1) == 0  # GPU 1 may access GPU 0's memory
        assert c.cxlalloc_enable_peer_access(0, 1) == 0  # again: a no-op
        assert cu.cuMemcpy(on1, on0, MiB) == 0 and read(on1, MiB) == data
        late0 = c.cxlalloc_malloc(40 * MiB, 0, s)  # mapped after the grant (a new segment)
        assert late0 and cu.cuMemcpy(late0 + 32 * MiB, on1, MiB) == 0 and read(late0 + 32 * MiB, MiB) == data
        spill1 = c.cxlalloc_malloc(40 * MiB, 1, s)  # GPU 1's host tier (past its 32 MiB)
        assert c.cxlalloc_tier_of(spill1, 1) == 1
        assert cu.cuMemcpy(spill1, on0, MiB) == 0 and read(spill1, MiB) == data
        # the other direction: GPU 0 copying out of GPU 1's memory needs GPU 1's grant
        cu = current_gpu(0)
        assert cu.cuMemcpy(on0 + 4 * MiB, spill1, MiB) == 1
        assert c.cxlalloc_enable_peer_access(1, 0) == 0
        assert cu.cuMemcpy(on0 + 4 * MiB, spill1, MiB) == 0 and read(on0 + 4 * MiB, MiB) == data
        assert c.cxlalloc_enable_peer_access(0, 2) == -1  # CXLALLOC_E_INVALID_ARGUMENT
        assert c.cxlalloc_last_error().decode().endswith("device 0 / peer 2 is not a visible GPU (0..1)")
    finally:
        c.cxlalloc_free(on0, 8 * MiB, 0, s)
        c.cxlalloc_free(on1, 8 * MiB, 1, s)
        if late0:
            c.cxlalloc_free(late0, 40 * MiB, 0, s)
        if spill1:
            c.cxlalloc_free(spill1, 40 * MiB, 1, s)
        c.cxlalloc_empty_cache()


def test_a_failed_peer_grant_is_an_error_and_a_retry_grants_again(two_gpu_global, streams, current_gpu):
    c = _capi()
    c.cxlalloc_enable_peer_access.restype = ctypes.c_int
    c.cxlalloc_enable_peer_access.argtypes = [ctypes.c_int, ctypes.c_int]
    sim = two_gpu_global[2]
    s = streams.new()
    a = c.cxlalloc_malloc(4 * MiB, 0, s)
    b = c.cxlalloc_malloc(40 * MiB, 0, s)  # a second segment: the grant fails on it
    on1 = c.cxlalloc_malloc(4 * MiB, 1, s)
    cu = current_gpu(1)
    try:
        sim.fail("cuMemSetAccess", 2, 999)
        assert c.cxlalloc_enable_peer_access(0, 1) == -5  # CXLALLOC_E_DRIVER
        assert "cuMemSetAccess" in c.cxlalloc_last_error().decode()
        sim.clear_faults()
        assert c.cxlalloc_enable_peer_access(0, 1) == 0  # not recorded by the failed call: granted now
        assert cu.cuMemcpy(on1, a, MiB) == 0 and cu.cuMemcpy(on1, b, MiB) == 0
    finally:
        sim.clear_faults()
        c.cxlalloc_free(a, 4 * MiB, 0, s)
        c.cxlalloc_free(b, 40 * MiB, 0, s)
        c.cxlalloc_free(on1, 4 * MiB, 1, s)
        c.cxlalloc_empty_cache()


def test_stats_gives_each_gpu_and_the_total(two_gpu_global, streams):
    c = _capi()
    s = streams.new()
    a = c.cxlalloc_malloc(8 * MiB, 0, s)
    b = c.cxlalloc_malloc(6 * MiB, 1, s)
    spill = c.cxlalloc_malloc(30 * MiB, 1, s)  # past GPU 1's 32 MiB: on its host tier
    st = cxlalloc.stats(0)
    assert sorted(st["gpus"]) == ["cuda:0", "cuda:1"]
    s0, s1 = st["gpus"]["cuda:0"], st["gpus"]["cuda:1"]
    assert s0["device"]["allocated_bytes"] == 8 * MiB and s1["device"]["allocated_bytes"] == 6 * MiB
    total = st["total"]
    assert total["device"]["allocated_bytes"] == 14 * MiB
    assert s1["host"]["allocated_bytes"] == 30 * MiB and total["host"]["allocated_bytes"] == 30 * MiB
    assert total["device"]["limit_bytes"] == 96 * MiB and total["device"]["device"] == [0, 1]
    assert cxlalloc.stats(1)["total"] == total  # the same total whichever GPU is asked
    for p, n, g in ((a, 8, 0), (b, 6, 1), (spill, 30, 1)):
        c.cxlalloc_free(p, n * MiB, g, s)


def test_set_device_switches_what_stats_and_the_summary_show(two_gpu_global, streams, monkeypatch):
    import torch

    c = _capi()
    s = streams.new()
    p = c.cxlalloc_malloc(6 * MiB, 1, s)
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    assert cxlalloc.stats()["device"]["device"] == 0 and cxlalloc.stats()["device"]["allocated_bytes"] == 0
    current[0] = 1  # torch.cuda.set_device(1)
    st = cxlalloc.stats()
    assert st["device"]["device"] == 1 and st["device"]["allocated_bytes"] == 6 * MiB
    assert cxlalloc.memory_summary(use_rich=False).splitlines()[0] == "cxlalloc memory summary (cuda:1, mode global)"
    current[0] = 0
    assert cxlalloc.memory_summary(use_rich=False).splitlines()[0] == "cxlalloc memory summary (cuda:0, mode global)"
    c.cxlalloc_free(p, 6 * MiB, 1, s)
    assert ctypes.c_int(c.cxlalloc_empty_cache()).value == 0
