"""Shared fixtures: the simulated GPU and allocators on it.

Every allocator test runs the real engine against the simulated CUDA driver
(cxlalloc/_simcuda*.so).  After each test the simulator must hold no live
resource: a leak anywhere fails the test that caused it.
"""

import os

import pytest

from tests.helpers.gc_util import collect_all

import cxlalloc.engine

MiB = 1 << 20
GiB = 1 << 30

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _torch_cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _torch_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (not yet run on a GPU unless benchmarks/results/ says so)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sim():
    from cxlalloc import _sim

    return _sim.Sim()


def _live_total(live: dict) -> int:
    return sum(v for k, v in live.items())


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def fresh_sim(sim, request):
    """A simulated GPU with no faults armed; after a passing test, asserts
    that the test left no simulated driver resource behind (compared with
    what was live before it: a failed earlier test may still hold some)."""
    from cxlalloc import engine

    collect_all()
    sim.clear_faults()
    before = sim.live()
    if _live_total(before) == 0:
        sim.configure("vram=1GiB")
        engine._sim_vram = 1 << 30
    yield sim
    sim.clear_faults()
    collect_all()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.passed:
        after = sim.live()
        # Only growth is a leak (an earlier failed test's objects may be
        # collected during this one).
        leaked = {k: after[k] - before[k] for k in after if after[k] > before[k]}
        assert not leaked, f"simulated driver resources leaked: {leaked}"


@pytest.fixture
def make_alloc(fresh_sim):
    """Factory for simulated Allocators (device_limit 64 MiB, host 256 MiB by default)."""
    import cxlalloc

    made = []

    def make(**kw):
        kw.setdefault("device_limit", 64 * MiB)
        kw.setdefault("host_limit", 256 * MiB)
        kw.setdefault("device_headroom", 0)
        a = cxlalloc.Allocator(simulate=True, **kw)
        made.append(a)
        return a

    yield make
    made.clear()
    collect_all()


class SimStreams:
    """Create/destroy CUDA streams on the simulated driver from a test thread."""

    def __init__(self, sim):
        import ctypes

        from cxlalloc import _sim

        self.lib = ctypes.CDLL(_sim.library_path())
        self.ctx = ctypes.c_void_p()
        self.streams = []
        getproc = self.lib.cuGetProcAddress_v2
        getproc.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                            ctypes.c_void_p]

        def fn(name, ver, argtypes):
            p = ctypes.c_void_p()
            assert getproc(name.encode(), ctypes.byref(p), ver, 0, None) == 0, name
            f = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(p.value)
            return f

        init = fn("cuInit", 2000, [ctypes.c_uint])
        assert init(0) == 0
        self.retain = fn("cuDevicePrimaryCtxRetain", 7000, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int])
        self.release = fn("cuDevicePrimaryCtxRelease", 11000, [ctypes.c_int])
        self.set_current = fn("cuCtxSetCurrent", 4000, [ctypes.c_void_p])
        self.create = fn("cuStreamCreate", 2000, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint])
        self.destroy = fn("cuStreamDestroy", 4000, [ctypes.c_void_p])
        self.sync = fn("cuStreamSynchronize", 2000, [ctypes.c_void_p])
        assert self.retain(ctypes.byref(self.ctx), 0) == 0
        assert self.set_current(self.ctx) == 0

    def new(self) -> int:
        import ctypes

        s = ctypes.c_void_p()
        assert self.create(ctypes.byref(s), 1) == 0
        self.streams.append(s.value)
        return s.value

    def synchronize(self, s: int) -> None:
        assert self.sync(s) == 0

    def close(self):
        self.set_current(self.ctx)
        for s in self.streams:
            self.destroy(s)
        self.streams.clear()
        self.set_current(None)
        self.release(0)


@pytest.fixture
def streams(fresh_sim):
    s = SimStreams(fresh_sim)
    yield s
    s.close()


@pytest.fixture
def machine(fresh_sim):
    """Reconfigure the simulated machine (needs nothing live); restore after."""
    def configure(spec):
        collect_all()
        fresh_sim.configure(spec)
        cxlalloc.engine._sim_vram = 1 << 30
    yield configure
    collect_all()
    if sum(fresh_sim.live().values()) == 0:
        fresh_sim.configure("vram=1GiB")


@pytest.fixture
def cxl_machine(machine, tmp_path, monkeypatch):
    """A simulated box with a CPU-less (CXL) node 1: a fake sysfs tree for
    topology, and the simulator's node 1 backed by this machine's node 0."""
    from tests.helpers.fake_sysfs import FakeSysfs

    fs = FakeSysfs(tmp_path / "sys")
    fs.node(0, cpus="0-1", mem_gib=16, free_gib=12)
    fs.node(1, cpus="", mem_gib=64, free_gib=60, zone="Normal")
    fs.distances({0: {0: 10, 1: 20}, 1: {0: 20, 1: 10}})
    fs.cxl_region(0, target_node=1, size_gib=64)
    fs.finish()
    monkeypatch.setenv("CXLALLOC_SYSFS_ROOT", str(tmp_path / "sys"))

    def configure(extra=""):
        machine("vram=1GiB,numa=0;1:0,gpu_numa=0" + extra)
    return configure
