"""cxlalloc.enable() and friends without a GPU.

- enable() on a machine where torch cannot use CUDA: the exact error, and no
  trace of success afterwards (is_enabled() False, mode() None; case C09).
- The engine's C ABI exactly as the torch adapter (csrc/torch) drives it,
  through ctypes, on the simulated driver: malloc/free with classes,
  record_stream, torch-vocabulary stats, set_device_limit (memory fraction),
  private pools with filters and use counts, snapshot callbacks, OOM errors.
- The Python plumbing of the torch mode (stats(), memory_summary(),
  empty_cache(), kv()/weights(), mode()'s truth check) over a simulated engine.

What only a GPU can check is in tests/pytorch/test_torch_gpu.py.
"""

import ctypes
import gc

import pytest

import cxlalloc
from cxlalloc import _C
from cxlalloc.pytorch import state
from cxlalloc.engine import configure, device_options, new_engine
from cxlalloc.config import make_config

MiB, GiB = 1 << 20, 1 << 30


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ----------------------------------------------------------------- enable() on CPU
@pytest.mark.skipif(_torch_cuda(), reason="torch can use CUDA here (tests/pytorch/test_torch_gpu.py covers enable())")
def test_enable_without_cuda_raises_and_reports_nothing_enabled():
    import torch

    assert cxlalloc.mode() is None and cxlalloc.is_enabled() is False
    with pytest.raises(RuntimeError) as e:
        cxlalloc.enable(device_limit="1GiB")
    msg = str(e.value)
    assert msg.startswith("cxlalloc.enable(): CUDA is not available: ")
    if torch.version.cuda is None:
        assert msg.startswith(f"cxlalloc.enable(): CUDA is not available: torch {torch.__version__} is a CPU-only "
                              "build (torch.version.cuda is None). ")
    assert msg.endswith("Without a GPU, use cxlalloc's simulated driver instead: cxlalloc.Allocator(simulate=True), "
                        "cxlalloc.hf.wrap(model, simulate=True), or `python -m cxlalloc demo|bench --simulate`.")
    assert cxlalloc.is_enabled() is False
    assert cxlalloc.mode() is None
    assert _C.current_engine() is None
    with pytest.raises(RuntimeError, match="cxlalloc is not enabled in this process"):
        cxlalloc.stats()
    with pytest.raises(RuntimeError, match="cxlalloc is not enabled in this process"):
        cxlalloc.memory_summary()
    with pytest.raises(RuntimeError, match="cxlalloc is not enabled in this process"):
        cxlalloc.empty_cache()


def test_enable_validates_options_first():
    with pytest.raises(ValueError) as e:
        cxlalloc.enable(device_limit="lots")
    assert str(e.value).startswith("cxlalloc option 'device_limit': 'lots' is not a size or fraction;")
    with pytest.raises(ValueError, match="cxlalloc: unknown option 'devicelimit'"):
        cxlalloc.enable(devicelimit="1GiB")
    with pytest.raises(ValueError) as e:
        cxlalloc.enable(simulate=True)
    assert str(e.value) == ("cxlalloc option 'simulate': torch cannot allocate from cxlalloc's simulated GPU, so "
                            "enable() needs a real CUDA device; use cxlalloc.Allocator(simulate=True) for simulated "
                            "tiers")
    assert cxlalloc.is_enabled() is False


def test_class_scopes_are_thread_local_and_nest():
    import threading

    assert _C.current_class() == "other"
    with cxlalloc.kv():
        assert _C.current_class() == "kv"
        with cxlalloc.weights():
            assert _C.current_class() == "weight"
            seen = []
            t = threading.Thread(target=lambda: seen.append(_C.current_class()))
            t.start()
            t.join()
            assert seen == ["other"]
        assert _C.current_class() == "kv"
    assert _C.current_class() == "other"
    with pytest.raises(KeyError):
        with cxlalloc.kv():
            raise KeyError("inside")
    assert _C.current_class() == "other"


# ----------------------------------------------------------------- the C ABI on the simulator
class Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64), ("allocated", ctypes.c_int64),
                ("freed", ctypes.c_int64)]


class TorchStats(ctypes.Structure):
    _fields_ = [(n, Stat * 3) for n in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                        "reserved_bytes", "active_bytes", "inactive_split_bytes",
                                        "requested_bytes")] + [
        (n, ctypes.c_int64) for n in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                                      "num_device_free")]


class BlockInfo(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_uint64), ("size", ctypes.c_size_t), ("requested", ctypes.c_size_t),
                ("allocated", ctypes.c_int), ("pending", ctypes.c_int)]


class SegmentInfo(ctypes.Structure):
    _fields_ = [("base", ctypes.c_uint64), ("size", ctypes.c_size_t), ("allocated", ctypes.c_size_t),
                ("tier", ctypes.c_int), ("is_small", ctypes.c_int), ("is_extent", ctypes.c_int),
                ("stream", ctypes.c_uint64), ("pool_a", ctypes.c_uint64), ("pool_b", ctypes.c_uint64)]


SEGMENT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(SegmentInfo), ctypes.POINTER(BlockInfo),
                              ctypes.c_size_t)
FILTER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def _capi():
    lib = ctypes.CDLL(_C.__file__)  # the already-loaded _C: same engine
    sig = {
        "cxlalloc_api_version": (ctypes.c_int, []),
        "cxlalloc_last_error": (ctypes.c_char_p, []),
        "cxlalloc_last_error_kind": (ctypes.c_int, []),
        "cxlalloc_is_enabled": (ctypes.c_int, []),
        "cxlalloc_malloc": (ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
        "cxlalloc_kv_malloc": (ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
        "cxlalloc_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
        "cxlalloc_record_stream": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
        "cxlalloc_empty_cache": (ctypes.c_int, []),
        "cxlalloc_tier_of": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
        "cxlalloc_torch_stats": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(TorchStats)]),
        "cxlalloc_reset_peak_stats": (ctypes.c_int, [ctypes.c_int]),
        "cxlalloc_device_limit": (ctypes.c_size_t, [ctypes.c_int]),
        "cxlalloc_set_device_limit": (ctypes.c_int, [ctypes.c_int, ctypes.c_size_t]),
        "cxlalloc_create_pool": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]),
        "cxlalloc_begin_allocate_to_pool": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, FILTER_FN,
                                                           ctypes.c_void_p, ctypes.c_void_p]),
        "cxlalloc_end_allocate_to_pool": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]),
        "cxlalloc_release_pool": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]),
        "cxlalloc_pool_use_count": (ctypes.c_int, [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]),
        "cxlalloc_snapshot": (ctypes.c_int, [ctypes.c_int, SEGMENT_FN, ctypes.c_void_p]),
        "cxlalloc_describe_tiers": (ctypes.c_char_p, [ctypes.c_int]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


@pytest.fixture
def process_engine(fresh_sim):
    """A simulated engine installed as the process engine (what enable() does),
    device 0: 64 MiB device tier, 256 MiB host tier."""
    engine = new_engine(make_config(simulate=True))
    opts = device_options(engine, 0, make_config(simulate=True, device_limit=64 * MiB, host_limit=256 * MiB,
                                                          device_headroom=0))
    configure(engine, 0, opts)
    _C.set_current_engine(engine)
    box = [engine, opts]  # cleared below: pytest keeps the fixture value past teardown
    del engine
    yield box
    _C.set_current_engine(None)
    box.clear()
    gc.collect()


def _snapshot(c, device=0):
    rows = []

    def cb(ctx, seg, blocks, n):
        s = seg.contents
        rows.append({"base": s.base, "size": s.size, "allocated": s.allocated, "tier": s.tier,
                     "pool": (s.pool_a, s.pool_b),
                     "blocks": [(blocks[i].ptr, blocks[i].size, blocks[i].requested, blocks[i].allocated)
                                for i in range(n)]})

    fn = SEGMENT_FN(cb)
    assert c.cxlalloc_snapshot(device, fn, None) == 0
    return rows


def test_c_abi_as_the_adapter_uses_it(process_engine, streams):
    c = _capi()
    assert c.cxlalloc_api_version() == 2
    assert c.cxlalloc_is_enabled() == 1
    s = streams.new()

    # allocation and the device-tier stats torch.cuda.memory_stats() shows
    p = c.cxlalloc_malloc(3 * MiB, 0, s)
    assert p and c.cxlalloc_tier_of(p, 0) == 0
    st = TorchStats()
    assert c.cxlalloc_torch_stats(0, ctypes.byref(st)) == 0
    assert st.allocation[0].current == 1 and st.allocated_bytes[0].current == 3 * MiB
    assert st.requested_bytes[0].current == 3 * MiB and st.allocated_bytes[2].current == 3 * MiB
    assert st.reserved_bytes[0].current >= 3 * MiB and st.segment[0].current == 1

    # record_stream on our pointer works; on a foreign one it is an error
    assert c.cxlalloc_record_stream(p, streams.new()) == 0
    assert c.cxlalloc_record_stream(ctypes.c_void_p(0x1000), s) < 0
    assert c.cxlalloc_last_error_kind() == 1
    c.cxlalloc_free(p, 3 * MiB, 0, s)
    assert c.cxlalloc_torch_stats(0, ctypes.byref(st)) == 0
    assert st.allocated_bytes[0].current == 0 and st.allocated_bytes[0].peak == 3 * MiB

    # memory fraction: a 4 MiB device cap makes the next 8 MiB spill
    assert c.cxlalloc_device_limit(0) == 64 * MiB
    assert c.cxlalloc_empty_cache() == 0
    assert c.cxlalloc_set_device_limit(0, 4 * MiB) == 0
    assert c.cxlalloc_device_limit(0) == 4 * MiB
    q = c.cxlalloc_malloc(8 * MiB, 0, s)
    assert q and c.cxlalloc_tier_of(q, 0) == 1
    assert b"host tier" in c.cxlalloc_describe_tiers(0)
    snap = _snapshot(c)
    host = [r for r in snap if r["tier"] == 1]
    assert len(host) == 1 and host[0]["allocated"] == 8 * MiB
    assert host[0]["blocks"][0][:4] == (q, 8 * MiB, 8 * MiB, 1)
    c.cxlalloc_free(q, 8 * MiB, 0, s)
    assert c.cxlalloc_set_device_limit(0, 0) < 0 and b"device_limit" in c.cxlalloc_last_error()
    assert c.cxlalloc_set_device_limit(0, 64 * MiB) == 0

    # out of memory past both tiers: NULL, kind OUT_OF_MEMORY, tier text
    assert c.cxlalloc_malloc(GiB, 0, s) is None
    assert c.cxlalloc_last_error_kind() == 2
    err = c.cxlalloc_last_error().decode()
    assert err.startswith("cxlalloc: out of memory: tried to allocate 1.00 GiB (class other) on cuda:0: ")
    assert "device tier (cuda:0)" in err and "host tier (NUMA node" in err
    assert c.cxlalloc_torch_stats(0, ctypes.byref(st)) == 0 and st.num_ooms == 1
    assert c.cxlalloc_empty_cache() == 0


def test_c_abi_private_pools(process_engine, streams):
    c = _capi()
    s, other = streams.new(), streams.new()
    assert c.cxlalloc_pool_use_count(0, 7, 1) == 0  # unknown pool: 0, like torch
    assert c.cxlalloc_create_pool(0, 7, 1) == 0  # MemPool(): one reference
    assert c.cxlalloc_pool_use_count(0, 7, 1) == 1
    freed = []
    only_s = FILTER_FN(lambda ctx, stream: 1 if stream == s else 0)
    free_ctx = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda ctx: freed.append(ctx))
    assert c.cxlalloc_begin_allocate_to_pool(0, 7, 1, only_s, ctypes.c_void_p(1234),
                                             ctypes.cast(free_ctx, ctypes.c_void_p)) == 0
    assert c.cxlalloc_pool_use_count(0, 7, 1) == 2  # begin takes a reference
    in_pool = c.cxlalloc_malloc(2 * MiB, 0, s)
    outside = c.cxlalloc_malloc(2 * MiB, 0, other)  # the filter says no
    pools = {r["blocks"][0][0]: r["pool"] for r in _snapshot(c) if r["blocks"][0][3]}
    assert pools[in_pool] == (7, 1) and pools[outside] == (0, 0)
    assert c.cxlalloc_end_allocate_to_pool(0, 7, 1) == 0
    assert freed == [1234]  # the route's context is released with the route
    assert c.cxlalloc_pool_use_count(0, 7, 1) == 2  # end does not drop the reference (torch semantics)
    assert c.cxlalloc_release_pool(0, 7, 1) == 0
    assert c.cxlalloc_release_pool(0, 7, 1) == 0
    assert c.cxlalloc_pool_use_count(0, 7, 1) == 0
    c.cxlalloc_free(in_pool, 2 * MiB, 0, s)
    c.cxlalloc_free(outside, 2 * MiB, 0, other)
    assert c.cxlalloc_empty_cache() == 0
    assert _snapshot(c) == []


def test_kv_scope_reaches_the_c_abi(process_engine, streams):
    c = _capi()
    s = streams.new()
    engine, _ = process_engine
    with cxlalloc.kv():
        p = c.cxlalloc_malloc(MiB, 0, s)
    q = c.cxlalloc_malloc(MiB, 0, s)
    cls = engine.device(0).stats()
    assert cls["kv"]["device_bytes"] == MiB and cls["other"]["device_bytes"] == MiB
    c.cxlalloc_free(p, MiB, 0, s)  # freed outside the scope: same tier, same block (case C12)
    c.cxlalloc_free(q, MiB, 0, s)
    assert engine.device(0).stats()["kv"]["device_bytes"] == 0


# ----------------------------------------------------------------- Python plumbing
class FakeAdapter:
    def __init__(self):
        self.current = True

    def is_current(self):
        return self.current


@pytest.fixture
def fake_global_state(process_engine):
    engine, opts = process_engine
    adapter = FakeAdapter()
    box = [engine, adapter]
    del engine
    cfg = make_config(device_limit=64 * MiB, host_limit=256 * MiB)
    state.current = state.State("global", state.settings(cfg), "test", cfg, box[0], {0: opts}, adapter=adapter)
    yield box
    state.current = None
    box.clear()


def test_mode_tells_the_truth(fake_global_state):
    engine, adapter = fake_global_state
    assert cxlalloc.mode() == "global" and cxlalloc.is_enabled()
    adapter.current = False  # something replaced cxlalloc as torch's allocator
    assert cxlalloc.mode() is None and not cxlalloc.is_enabled()


def test_second_enable_with_other_settings_is_refused(fake_global_state):
    with pytest.raises(RuntimeError) as e:
        cxlalloc.enable(device_limit=32 * MiB, host_limit=256 * MiB)
    assert str(e.value) == (
        "cxlalloc is already enabled (mode global, by test) with other settings; this call asks for "
        "device_limit=67108864 -> 33554432. Options cannot change once enabled: pass the same options (or set them "
        "in CXLALLOC only).")
    # the same settings: idempotent, returns the mode
    assert cxlalloc.enable(device_limit=64 * MiB, host_limit=256 * MiB) == "global"


def test_stats_summary_and_empty_cache(fake_global_state, streams):
    engine, _ = fake_global_state
    c = _capi()
    s = streams.new()
    p = c.cxlalloc_malloc(60 * MiB, 0, s)
    with cxlalloc.kv():
        q = c.cxlalloc_malloc(30 * MiB, 0, s)  # does not fit the 64 MiB device tier: spills
    st = cxlalloc.stats()
    assert st["mode"] == "global"
    assert st["device"]["allocated_bytes"] == 60 * MiB and st["other"]["device_bytes"] == 60 * MiB
    assert st["host"]["allocated_bytes"] == 30 * MiB and st["kv"]["host_bytes"] == 30 * MiB
    assert st["spilled_bytes"] == 30 * MiB and st["spilled_allocations"] == 1
    assert st["device"]["limit_bytes"] == 64 * MiB and st["host"]["limit_bytes"] == 256 * MiB
    assert st["numa_node_reason"]
    assert st["torch"]["allocated_bytes.all.current"] == 60 * MiB  # torch's view: device tier only

    plain = cxlalloc.memory_summary(use_rich=False).splitlines()
    assert plain[0] == "cxlalloc memory summary (cuda:0, mode global)"
    dev_row = next(line for line in plain if line.startswith("device tier (VRAM)")).split()
    assert dev_row[3:5] == ["60.00", "MiB"] and dev_row[-2:] == ["64.00", "MiB"]
    assert next(line for line in plain if line.startswith("KV cache")).split()[4:6] == ["30.00", "MiB"]
    assert "spilled: 30.00 MiB in 1 allocations" in plain
    assert any(line.startswith(f"NUMA node: {st['host']['numa_node']}: ") for line in plain)
    fancy = cxlalloc.memory_summary(use_rich=True)
    assert "device tier (VRAM)" in fancy and "60.00 MiB" in fancy and "spilled: 30.00 MiB" in fancy

    c.cxlalloc_free(p, 60 * MiB, 0, s)
    c.cxlalloc_free(q, 30 * MiB, 0, s)
    released = cxlalloc.empty_cache()
    assert released >= 90 * MiB
    after = cxlalloc.stats()
    assert after["device"]["reserved_bytes"] == 0 and after["host"]["reserved_bytes"] == 0
    with pytest.raises(ValueError, match="cuda:3 is not served by cxlalloc"):
        cxlalloc.stats(3)


def test_scope_without_enable_warns_once(monkeypatch):
    from cxlalloc.pytorch import scopes, state

    assert state.current is None and _C.current_engine() is None
    monkeypatch.setattr(scopes, "_warned_not_enabled", False)
    with pytest.warns(state.CxlallocWarning, match=r"cxlalloc\.kv\(\): cxlalloc is not enabled in this process"):
        with cxlalloc.kv():
            assert _C.current_class() == "kv"  # still a scope: an engine installed later sees it
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cxlalloc.weights():  # once per process, whichever scope came first
            pass


def test_scope_with_an_engine_does_not_warn(process_engine):
    import warnings

    from cxlalloc.pytorch import scopes

    scopes._warned_not_enabled = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cxlalloc.kv():
            pass
    assert scopes._warned_not_enabled is False
