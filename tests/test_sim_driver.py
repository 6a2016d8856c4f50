"""The simulated CUDA driver (csrc/sim), driven directly through ctypes.

Every driver function is obtained the way csrc/driver/driver.cpp obtains it,
through cuGetProcAddress_v2 with the base name and ABI version listed in
csrc/driver/driver.h, so these tests also check the export table.  Each test
starts from a freshly configured machine and must leave nothing live: the
`sim` fixture asserts cxlsim_live is all zeros afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cxlalloc import _sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GRAN = 2 * MiB
PAGE = 4096

# ---------------------------------------------------------------- CUDA constants (cuda.h 13.0)
SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 0, 1, 2, 3
NO_DEVICE, INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE = 100, 101, 201, 400
NOT_READY, ILLEGAL_ADDRESS = 600, 700
ALREADY_REGISTERED, NOT_REGISTERED = 712, 713
NOT_SUPPORTED, CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED, CAPTURE_IMPLICIT = 801, 900, 901, 906
UNKNOWN = 999

LOC_INVALID, LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA, LOC_HOST_NUMA_CURRENT = 0, 1, 2, 3, 4
PINNED = 1
PROT_NONE_, PROT_READ_, PROT_RW = 0, 1, 3
ADV_SET_READ_MOSTLY, ADV_UNSET_READ_MOSTLY, ADV_SET_PREF, ADV_UNSET_PREF, ADV_SET_ACC, ADV_UNSET_ACC = 1, 2, 3, 4, 5, 6
RA_READ_MOSTLY, RA_PREF, RA_ACCESSED_BY, RA_LAST_PF = 1, 2, 3, 4
RA_PREF_TYPE, RA_PREF_ID, RA_LAST_PF_TYPE, RA_LAST_PF_ID = 5, 6, 7, 8
PA_CONTEXT, PA_MEMORY_TYPE, PA_DEVICE_POINTER, PA_HOST_POINTER = 1, 2, 3, 4
PA_IS_MANAGED, PA_DEVICE_ORDINAL, PA_RANGE_START, PA_RANGE_SIZE, PA_MAPPED = 8, 9, 11, 12, 13
MEMTYPE_HOST, MEMTYPE_DEVICE = 1, 2
DEVICE_CPU, DEVICE_INVALID = -1, -2
ATTACH_GLOBAL, ATTACH_HOST = 1, 2
HOSTALLOC_DEVICEMAP = 2
REGISTER_PORTABLE, REGISTER_DEVICEMAP, REGISTER_IOMEMORY, REGISTER_READ_ONLY = 1, 2, 4, 8
STREAM_NON_BLOCKING = 1
CAPTURE_NONE, CAPTURE_ACTIVE, CAPTURE_STATUS_INVALIDATED = 0, 1, 2
GPA_SUCCESS, GPA_SYMBOL_NOT_FOUND, GPA_VERSION_NOT_SUFFICIENT = 0, 1, 2


# ---------------------------------------------------------------- ctypes layouts
class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


assert ctypes.sizeof(Location) == 8 and ctypes.sizeof(Prop) == 32 and ctypes.sizeof(AccessDesc) == 12

P = ctypes.POINTER
u64, vp, cint, cuint, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
ull = ctypes.c_ulonglong

# Argument types per base name (prototypes of csrc/driver/driver.h).
ARGTYPES = {
    "cuInit": [cuint],
    "cuDriverGetVersion": [P(cint)],
    "cuDeviceGet": [P(cint), cint],
    "cuDeviceGetCount": [P(cint)],
    "cuDeviceGetName": [ctypes.c_char_p, cint, cint],
    "cuDeviceTotalMem": [P(sz), cint],
    "cuDeviceGetAttribute": [P(cint), cint, cint],
    "cuDevicePrimaryCtxRetain": [P(vp), cint],
    "cuDevicePrimaryCtxRelease": [cint],
    "cuCtxGetCurrent": [P(vp)],
    "cuCtxSetCurrent": [vp],
    "cuCtxSynchronize": [],
    "cuMemGetInfo": [P(sz), P(sz)],
    "cuMemAlloc": [P(u64), sz],
    "cuMemFree": [u64],
    "cuMemAddressReserve": [P(u64), sz, sz, u64, ull],
    "cuMemAddressFree": [u64, sz],
    "cuMemCreate": [P(u64), sz, P(Prop), ull],
    "cuMemRelease": [u64],
    "cuMemMap": [u64, sz, sz, u64, ull],
    "cuMemUnmap": [u64, sz],
    "cuMemSetAccess": [u64, sz, P(AccessDesc), sz],
    "cuMemGetAllocationGranularity": [P(sz), P(Prop), cint],
    "cuMemAllocManaged": [P(u64), sz, cuint],
    "cuMemAdvise": [u64, sz, cint, Location],
    "cuMemPrefetchAsync": [u64, sz, Location, cuint, vp],
    "cuMemRangeGetAttribute": [vp, sz, cint, u64, sz],
    "cuPointerGetAttribute": [vp, cint, u64],
    "cuMemHostRegister": [vp, sz, cuint],
    "cuMemHostUnregister": [vp],
    "cuMemHostGetDevicePointer": [P(u64), vp, cuint],
    "cuMemHostAlloc": [P(vp), sz, cuint],
    "cuMemFreeHost": [vp],
    "cuMemcpy": [u64, u64, sz],
    "cuMemcpyAsync": [u64, u64, sz, vp],
    "cuStreamCreate": [P(vp), cuint],
    "cuStreamDestroy": [vp],
    "cuStreamSynchronize": [vp],
    "cuStreamQuery": [vp],
    "cuStreamWaitEvent": [vp, vp, cuint],
    "cuStreamIsCapturing": [vp, P(cint)],
    "cuEventCreate": [P(vp), cuint],
    "cuEventRecord": [vp, vp],
    "cuEventQuery": [vp],
    "cuEventSynchronize": [vp],
    "cuEventDestroy": [vp],
    "cuGetErrorName": [cint, P(ctypes.c_char_p)],
    "cuGetErrorString": [cint, P(ctypes.c_char_p)],
}


def driver_table():
    """(name, version, required) of every function in csrc/driver/driver.h."""
    text = open(os.path.join(ROOT, "csrc", "driver", "driver.h")).read()
    return [(m[0], int(m[1]), m[2] == "1") for m in re.findall(r"X\((cu\w+), (\d+), ([01]),", text)]


def cuda_min_codes():
    text = open(os.path.join(ROOT, "csrc", "driver", "cuda_min.h")).read()
    body = text[text.index("typedef enum cudaError_enum") : text.index("} CUresult;")]
    return {name: int(v) for name, v in re.findall(r"(CUDA_\w+) = (\d+)", body)}


class Cu:
    """Driver entry points resolved through cuGetProcAddress_v2; each returns the CUresult."""

    def __init__(self, lib):
        self.lib = lib
        gpa = lib.cuGetProcAddress_v2
        gpa.restype = cint
        gpa.argtypes = [ctypes.c_char_p, P(vp), cint, u64, P(cint)]
        self.gpa = gpa
        for name, ver, _ in driver_table():
            fn = self.resolve(name, ver)
            assert fn is not None, f"{name} (ABI {ver}) missing from the simulator"
            setattr(self, name, ctypes.CFUNCTYPE(cint, *ARGTYPES[name])(fn))

    def resolve(self, name, ver, flags=0):
        p, q = vp(), cint(-1)
        r = self.gpa(name.encode(), ctypes.byref(p), ver, flags, ctypes.byref(q))
        return p.value if r == SUCCESS and q.value == GPA_SUCCESS else None

    def name(self, r):
        s = ctypes.c_char_p()
        self.cuGetErrorName(r, ctypes.byref(s))
        return s.value.decode() if s.value else str(r)


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def lib_sim():
    return _sim.Sim()


@pytest.fixture(scope="session")
def cu(lib_sim):
    return Cu(lib_sim.lib)


class Env:
    """Per-test helpers.  Resources made through it are released at teardown
    (in reverse order) even when the test fails, so one failure does not
    cascade into the next test's leak check."""

    def __init__(self, sim, cu):
        self.sim, self.cu = sim, cu
        self.stack = contextlib.ExitStack()
        self.gran = GRAN

    def ok(self, r, what=""):
        assert r == SUCCESS, f"{what}: {self.cu.name(r)}"

    def configure(self, spec=""):
        self.sim.configure(spec)
        self.ok(self.cu.cuInit(0), "cuInit")

    # contexts
    def retain(self, dev=0, make_current=True):
        ctx = vp()
        self.ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        self.stack.callback(self.cu.cuDevicePrimaryCtxRelease, dev)
        if make_current:
            self.ok(self.cu.cuCtxSetCurrent(ctx))
            self.stack.callback(self.cu.cuCtxSetCurrent, None)
        return ctx.value

    # VMM
    def prop(self, ltype=LOC_DEVICE, lid=0):
        p = Prop()
        p.type = PINNED
        p.location.type, p.location.id = ltype, lid
        return p

    def create(self, size, ltype=LOC_DEVICE, lid=0, expect=SUCCESS):
        h = u64()
        p = self.prop(ltype, lid)
        r = self.cu.cuMemCreate(ctypes.byref(h), size, ctypes.byref(p), 0)
        assert r == expect, f"cuMemCreate: {self.cu.name(r)}"
        if r == SUCCESS:
            self.stack.callback(self._release, h.value)
        return h.value

    def _release(self, h):
        self.cu.cuMemRelease(h)  # may already be released by the test

    def reserve(self, size, align=0, hint=0):
        p = u64()
        self.ok(self.cu.cuMemAddressReserve(ctypes.byref(p), size, align, hint, 0), "cuMemAddressReserve")
        self.stack.callback(self.cu.cuMemAddressFree, p.value, size)
        return p.value

    def map(self, va, size, h):
        self.ok(self.cu.cuMemMap(va, size, 0, h, 0), "cuMemMap")
        self.stack.callback(self.cu.cuMemUnmap, va, size)

    def access(self, va, size, *locs, flags=PROT_RW):
        descs = (AccessDesc * len(locs))()
        for d, (t, i) in zip(descs, locs):
            d.location.type, d.location.id, d.flags = t, i, flags
        return self.cu.cuMemSetAccess(va, size, descs, len(locs))

    def vmm(self, size, ltype=LOC_DEVICE, lid=0, locs=((LOC_DEVICE, 0),)):
        """Reserve, create, map and grant: a ready VMM buffer (va, handle)."""
        va = self.reserve(size)
        h = self.create(size, ltype, lid)
        self.map(va, size, h)
        self.ok(self.access(va, size, *locs), "cuMemSetAccess")
        return va, h

    # other allocations
    def mem_alloc(self, size):
        p = u64()
        self.ok(self.cu.cuMemAlloc(ctypes.byref(p), size), "cuMemAlloc")
        self.stack.callback(self._free, p.value)
        return p.value

    def managed(self, size, flags=ATTACH_GLOBAL):
        p = u64()
        self.ok(self.cu.cuMemAllocManaged(ctypes.byref(p), size, flags), "cuMemAllocManaged")
        self.stack.callback(self._free, p.value)
        return p.value

    def _free(self, p):
        self.cu.cuMemFree(p)

    def host_alloc(self, size, flags=HOSTALLOC_DEVICEMAP):
        p = vp()
        self.ok(self.cu.cuMemHostAlloc(ctypes.byref(p), size, flags), "cuMemHostAlloc")
        self.stack.callback(self.cu.cuMemFreeHost, p.value)
        return p.value

    def stream(self, flags=STREAM_NON_BLOCKING):
        s = vp()
        self.ok(self.cu.cuStreamCreate(ctypes.byref(s), flags), "cuStreamCreate")
        self.stack.callback(self.cu.cuStreamDestroy, s.value)
        return s.value

    def event(self):
        e = vp()
        self.ok(self.cu.cuEventCreate(ctypes.byref(e), 2), "cuEventCreate")
        self.stack.callback(self.cu.cuEventDestroy, e.value)
        return e.value

    def pages(self, size):
        """Plain anonymous host pages (libc mmap), unmapped at teardown."""
        p = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|MAP_ANONYMOUS
        assert p not in (None, ctypes.c_void_p(-1).value)
        self.stack.callback(libc.munmap, vp(p), size)
        return p


libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = vp
libc.mmap.argtypes = [vp, sz, cint, cint, cint, ctypes.c_long]
libc.munmap.argtypes = [vp, sz]
libc.syscall.restype = ctypes.c_long

_SYSCALLS = {"x86_64": {"get_mempolicy": 239, "move_pages": 279}, "aarch64": {"get_mempolicy": 236, "move_pages": 239}}
SYS = _SYSCALLS.get(os.uname().machine)


def page_node(addr):
    """Real NUMA node holding the page at addr (move_pages query), or -errno."""
    pages = (vp * 1)(addr & ~(PAGE - 1))
    status = (cint * 1)(-1)
    r = libc.syscall(ctypes.c_long(SYS["move_pages"]), 0, ctypes.c_ulong(1), pages, None, status, 0)
    assert r == 0, os.strerror(ctypes.get_errno())
    return status[0]


def page_policy(addr):
    """(mode, nodemask word 0) of the memory policy covering addr."""
    mode = cint(-1)
    mask = (ctypes.c_ulong * 16)()
    r = libc.syscall(ctypes.c_long(SYS["get_mempolicy"]), ctypes.byref(mode), mask, ctypes.c_ulong(1024),
                     vp(addr), ctypes.c_ulong(2))  # MPOL_F_ADDR
    assert r == 0, os.strerror(ctypes.get_errno())
    return mode.value, mask[0]


@pytest.fixture
def env(lib_sim, cu):
    lib_sim.clear_faults()
    lib_sim.configure("")
    assert cu.cuInit(0) == SUCCESS
    e = Env(lib_sim, cu)
    yield e
    lib_sim.clear_faults()
    e.stack.close()
    live = lib_sim.live()
    assert all(v == 0 for v in live.values()), f"simulated resources leaked: {live}"
    lib_sim.configure("")  # leave the default machine to whatever runs next


def write(addr, data: bytes):
    ctypes.memmove(addr, data, len(data))


def read(addr, n) -> bytes:
    return ctypes.string_at(addr, n)


def u64_at(addr):
    return ctypes.c_uint64.from_address(addr).value


def pattern(n, seed=1):
    return bytes((i * 131 + seed * 7) & 0xFF for i in range(n))


# ================================================================ export table and loader
def test_every_driver_h_function_is_exported_at_its_abi_version(env, cu):
    table = driver_table()
    assert len(table) == len(ARGTYPES) == 48
    for name, ver, _ in table:
        assert cu.resolve(name, ver) is not None, name
        assert cu.resolve(name, 13000) == cu.resolve(name, ver), f"{name}: newest ABI <= 13000"
        # Same function whatever stream flavour is asked for (no _ptsz variants).
        assert cu.resolve(name, ver, flags=2) == cu.resolve(name, ver)


def test_proc_address_errors_follow_cuda_h(env, cu):
    p, q = vp(), cint(-1)
    # Unknown symbol: success, NULL, SYMBOL_NOT_FOUND.
    assert cu.gpa(b"cuNoSuchThing", ctypes.byref(p), 13000, 0, ctypes.byref(q)) == SUCCESS
    assert p.value is None and q.value == GPA_SYMBOL_NOT_FOUND
    # Known symbol, ABI newer than asked (cuMemAdvise with a CUmemLocation is 12.2).
    assert cu.gpa(b"cuMemAdvise", ctypes.byref(p), 8000, 0, ctypes.byref(q)) == SUCCESS
    assert p.value is None and q.value == GPA_VERSION_NOT_SUFFICIENT
    # A version above the driver's is INVALID_VALUE.
    assert cu.gpa(b"cuInit", ctypes.byref(p), 13010, 0, ctypes.byref(q)) == INVALID_VALUE
    assert cu.gpa(b"cuInit", ctypes.byref(p), 2000, 7, ctypes.byref(q)) == INVALID_VALUE  # bad flags
    assert cu.gpa(None, ctypes.byref(p), 2000, 0, None) == INVALID_VALUE
    # The status pointer is optional.
    assert cu.gpa(b"cuInit", ctypes.byref(p), 2000, 0, None) == SUCCESS and p.value
    # The 11.3 four-argument form.
    gpa1 = env.sim.lib.cuGetProcAddress
    gpa1.restype, gpa1.argtypes = cint, [ctypes.c_char_p, P(vp), cint, u64]
    p1 = vp()
    assert gpa1(b"cuMemCreate", ctypes.byref(p1), 10020, 0) == SUCCESS
    assert p1.value == cu.resolve("cuMemCreate", 10020)
    # cuGetProcAddress hands out itself at both ABIs.
    assert cu.resolve("cuGetProcAddress", 11030) and cu.resolve("cuGetProcAddress", 12000)
    assert cu.resolve("cuGetProcAddress", 11030) != cu.resolve("cuGetProcAddress", 12000)


def test_older_driver_version_hides_newer_functions(env, cu):
    env.configure("version=12000")
    v = cint()
    assert cu.cuDriverGetVersion(ctypes.byref(v)) == SUCCESS and v.value == 12000
    p, q = vp(), cint(-1)
    assert cu.gpa(b"cuMemAdvise", ctypes.byref(p), 12020, 0, ctypes.byref(q)) == INVALID_VALUE
    assert cu.gpa(b"cuMemCreate", ctypes.byref(p), 10020, 0, ctypes.byref(q)) == SUCCESS and p.value
    # CU_MEM_LOCATION_TYPE_HOST is a CUDA 13.0 addition.
    env.create(GRAN, LOC_HOST, 0, expect=INVALID_VALUE)


def test_versioned_symbols_are_exported_and_nothing_else():
    out = subprocess.run(["nm", "-D", "--defined-only", _sim.library_path()], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm unavailable")
    names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert all(n.startswith(("cu", "cxlsim_")) for n in names), sorted(n for n in names if not n.startswith("cu"))
    for sym in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuMemAdvise_v2", "cuMemPrefetchAsync_v2",
                "cuStreamDestroy_v2", "cuEventDestroy_v2", "cuDevicePrimaryCtxRelease_v2", "cuMemHostRegister_v2",
                "cuMemHostGetDevicePointer_v2", "cuDeviceTotalMem_v2", "cuGetProcAddress", "cuGetProcAddress_v2",
                "cxlsim_configure", "cxlsim_live", "cxlsim_host_node_of"):
        assert sym in names, sym
    # Versioned names only: an unversioned cuMemAlloc would be the 32-bit legacy ABI.
    assert "cuMemAlloc" not in names and "cuMemAdvise" not in names


def test_dlsym_symbol_behaves_like_the_proc_table_entry(env, cu):
    alloc = ctypes.CFUNCTYPE(cint, P(u64), sz)(ctypes.cast(env.sim.lib.cuMemAlloc_v2, vp).value)
    p = u64()
    assert alloc(ctypes.byref(p), 4096) == INVALID_CONTEXT  # same checks: no context current
    env.sim.reset_counts()
    env.retain()
    assert alloc(ctypes.byref(p), 4096) == SUCCESS
    assert env.sim.call_count("cuMemAlloc") == 1
    assert cu.cuMemFree(p.value) == SUCCESS


def test_cxlalloc_loader_opens_the_simulator(env):
    C = pytest.importorskip("cxlalloc._C")
    env.configure("devices=3")
    info = C.probe_driver(_sim.library_path(), True)
    assert info["version"] == 13000 and info["device_count"] == 3 and info["simulated"] is True
    env.configure("devices=2,version=12080")
    info = C.probe_driver(_sim.library_path(), True)
    assert info["version"] == 12080 and info["device_count"] == 2


def test_error_names_and_strings_cover_cuda_min_h(env, cu):
    codes = cuda_min_codes()
    assert len(codes) >= 20
    for name, value in codes.items():
        s = ctypes.c_char_p()
        assert cu.cuGetErrorName(value, ctypes.byref(s)) == SUCCESS and s.value.decode() == name
        assert cu.cuGetErrorString(value, ctypes.byref(s)) == SUCCESS and s.value
    s = ctypes.c_char_p()
    assert cu.cuGetErrorString(OUT_OF_MEMORY, ctypes.byref(s)) == SUCCESS and s.value == b"out of memory"
    assert cu.cuGetErrorName(CAPTURE_IMPLICIT, ctypes.byref(s)) == SUCCESS
    assert s.value == b"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"
    s = ctypes.c_char_p(b"x")
    assert cu.cuGetErrorName(12345, ctypes.byref(s)) == INVALID_VALUE and s.value is None
    assert cu.cuGetErrorString(0, None) == INVALID_VALUE


# ================================================================ init, devices, contexts
def test_nothing_works_before_cuinit(env, cu, lib_sim):
    lib_sim.configure("devices=0")
    assert cu.cuInit(0) == NO_DEVICE
    lib_sim.configure("devices=2")  # a GPU-less boot leaves the driver uninitialized
    n, ctx = cint(-1), vp()
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == NOT_INITIALIZED
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == NOT_INITIALIZED
    p = u64()
    assert cu.cuMemAddressReserve(ctypes.byref(p), GRAN, 0, 0, 0) == NOT_INITIALIZED
    v = cint()
    assert cu.cuDriverGetVersion(ctypes.byref(v)) == SUCCESS and v.value == 13000  # no init needed
    assert cu.cuInit(1) == INVALID_VALUE  # flags must be 0
    assert cu.cuInit(0) == SUCCESS
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == SUCCESS and n.value == 2


def test_devices_names_memory_and_attributes(env, cu):
    env.configure("devices=2,vram=3GiB,numa=0;1:0,gpu_numa=1,attr.141=0,attr.16=7")
    d = cint()
    assert cu.cuDeviceGet(ctypes.byref(d), 1) == SUCCESS and d.value == 1
    assert cu.cuDeviceGet(ctypes.byref(d), 2) == INVALID_DEVICE
    name = ctypes.create_string_buffer(64)
    assert cu.cuDeviceGetName(name, 64, 1) == SUCCESS and name.value == b"cxlalloc simulated GPU 1"
    short = ctypes.create_string_buffer(8)
    assert cu.cuDeviceGetName(short, 6, 0) == SUCCESS and short.value == b"cxlal"  # truncated, terminated
    assert cu.cuDeviceGetName(name, 64, 5) == INVALID_DEVICE
    total = sz()
    assert cu.cuDeviceTotalMem(ctypes.byref(total), 0) == SUCCESS and total.value == 3 << 30

    def attr(a, dev=0):
        v = cint(-99)
        assert cu.cuDeviceGetAttribute(ctypes.byref(v), a, dev) == SUCCESS
        return v.value

    expected = {139: 0x233510DE, 102: 1, 83: 1, 89: 1, 99: 1, 91: 1, 41: 1, 115: 1, 142: 1, 19: 1, 88: 0, 75: 9, 76: 0,
                134: 1, 141: 0, 16: 7, 145: 1, 113: 1}
    for a, v in expected.items():
        assert attr(a) == v, a
    assert attr(33, 0) != attr(33, 1)  # distinct PCI bus ids
    v = cint()
    assert cu.cuDeviceGetAttribute(ctypes.byref(v), 0, 0) == INVALID_VALUE
    assert cu.cuDeviceGetAttribute(ctypes.byref(v), 148, 0) == INVALID_VALUE
    assert cu.cuDeviceGetAttribute(ctypes.byref(v), 16, 2) == INVALID_DEVICE
    assert cu.cuDeviceGetAttribute(None, 16, 0) == INVALID_VALUE
    # HOST_NUMA VMM off: cuMemCreate on a host node is not supported.
    env.create(GRAN, LOC_HOST_NUMA, 0, expect=NOT_SUPPORTED)


def test_primary_context_refcount_and_current_context(env, cu, lib_sim):
    ctx, cur = vp(), vp()
    assert cu.cuCtxGetCurrent(ctypes.byref(cur)) == SUCCESS and cur.value is None
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == SUCCESS
    ctx2 = vp()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx2), 0) == SUCCESS and ctx2.value == ctx.value
    assert lib_sim.live()["context_refs"] == 2
    assert cu.cuCtxSetCurrent(ctx) == SUCCESS
    assert cu.cuCtxGetCurrent(ctypes.byref(cur)) == SUCCESS and cur.value == ctx.value
    # Current context is per thread.
    seen = []

    def other_thread():
        c = vp()
        seen.append((cu.cuCtxGetCurrent(ctypes.byref(c)), c.value))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen == [(SUCCESS, None)]
    assert cu.cuDevicePrimaryCtxRelease(0) == SUCCESS
    free, total = sz(), sz()
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == SUCCESS  # one retain left
    assert cu.cuDevicePrimaryCtxRelease(0) == SUCCESS
    # Released to zero: the context is destroyed; the binding is now invalid.
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == INVALID_CONTEXT
    assert cu.cuCtxSetCurrent(ctx) == INVALID_CONTEXT
    assert cu.cuDevicePrimaryCtxRelease(0) == INVALID_CONTEXT  # never retained
    assert cu.cuDevicePrimaryCtxRelease(3) == INVALID_DEVICE
    assert cu.cuCtxSetCurrent(vp(0x1234)) == INVALID_CONTEXT  # not a context
    assert cu.cuCtxSetCurrent(None) == SUCCESS


def test_calls_that_need_a_context_fail_without_one(env, cu):
    p, s, e, q = u64(), vp(), vp(), vp()
    free, total = sz(), sz()
    host = env.pages(PAGE)
    checks = {
        "cuMemAlloc": cu.cuMemAlloc(ctypes.byref(p), 4096),
        "cuMemFree": cu.cuMemFree(0),
        "cuMemGetInfo": cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)),
        "cuMemAllocManaged": cu.cuMemAllocManaged(ctypes.byref(p), 4096, ATTACH_GLOBAL),
        "cuMemHostAlloc": cu.cuMemHostAlloc(ctypes.byref(q), 4096, 0),
        "cuMemFreeHost": cu.cuMemFreeHost(host),
        "cuMemHostRegister": cu.cuMemHostRegister(host, PAGE, 0),
        "cuMemHostUnregister": cu.cuMemHostUnregister(host),
        "cuMemHostGetDevicePointer": cu.cuMemHostGetDevicePointer(ctypes.byref(p), host, 0),
        "cuMemcpy": cu.cuMemcpy(host, host + 8, 8),
        "cuMemcpyAsync": cu.cuMemcpyAsync(host, host + 8, 8, None),
        "cuMemPrefetchAsync": cu.cuMemPrefetchAsync(host, PAGE, Location(LOC_DEVICE, 0), 0, None),
        "cuStreamCreate": cu.cuStreamCreate(ctypes.byref(s), 0),
        "cuStreamSynchronize": cu.cuStreamSynchronize(None),
        "cuStreamQuery": cu.cuStreamQuery(None),
        "cuEventCreate": cu.cuEventCreate(ctypes.byref(e), 0),
        "cuCtxSynchronize": cu.cuCtxSynchronize(),
    }
    assert {k: v for k, v in checks.items() if v != INVALID_CONTEXT} == {}
    # VMM needs no context.
    g = sz()
    prop = env.prop()
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0) == SUCCESS and g.value == GRAN
    va = env.reserve(GRAN)
    h = env.create(GRAN)
    env.map(va, GRAN, h)
    assert env.access(va, GRAN, (LOC_DEVICE, 0)) == SUCCESS


# ================================================================ VMM
def test_vmm_remap_same_va_to_another_handle_preserves_data_by_copy(env, cu, lib_sim):
    env.retain()
    size = 2 * GRAN
    va = env.reserve(size)
    a = env.create(size)
    env.map(va, size, a)
    assert env.access(va, size, (LOC_DEVICE, 0)) == SUCCESS
    data = pattern(size)
    write(va, data)  # the CPU stands in for a kernel on device memory
    # Migrate: a second handle mapped elsewhere, copy, then swap the VA over.
    tmp = env.reserve(size)
    b = env.create(size, LOC_HOST_NUMA, 0)
    env.map(tmp, size, b)
    assert env.access(tmp, size, (LOC_DEVICE, 0), (LOC_HOST_NUMA, 0)) == SUCCESS
    assert cu.cuMemcpy(tmp, va, size) == SUCCESS
    assert cu.cuMemUnmap(va, size) == SUCCESS
    assert cu.cuMemRelease(a) == SUCCESS
    assert cu.cuMemUnmap(tmp, size) == SUCCESS
    assert lib_sim.live()["device_bytes"] == 0 and lib_sim.live()["host_numa_bytes"] == size
    assert cu.cuMemMap(va, size, 0, b, 0) == SUCCESS
    assert env.access(va, size, (LOC_DEVICE, 0), (LOC_HOST_NUMA, 0)) == SUCCESS
    assert read(va, size) == data
    assert lib_sim.host_node_of(va) == 0
    assert cu.cuMemUnmap(va, size) == SUCCESS


def test_vmm_validation_errors(env, cu):
    g = GRAN
    va = env.reserve(4 * g)
    h = env.create(2 * g)
    # Sizes, offsets and addresses must be granularity multiples; offset must be 0.
    env.create(g + PAGE, expect=INVALID_VALUE)
    env.create(0, expect=INVALID_VALUE)
    assert cu.cuMemMap(va + PAGE, g, 0, h, 0) == INVALID_VALUE
    assert cu.cuMemMap(va, g + PAGE, 0, h, 0) == INVALID_VALUE
    assert cu.cuMemMap(va, g, g, h, 0) == INVALID_VALUE  # cuda.h: offset currently must be zero
    assert cu.cuMemMap(va, 4 * g, 0, h, 0) == INVALID_VALUE  # larger than the allocation
    assert cu.cuMemMap(va, g, 0, h, 1) == INVALID_VALUE  # flags
    assert cu.cuMemMap(va, g, 0, 0xDEAD, 0) == INVALID_VALUE  # unknown handle
    assert cu.cuMemMap(va + 3 * g, 2 * g, 0, h, 0) == INVALID_VALUE  # runs off the reservation
    outside = env.pages(2 * g)
    inside = (outside + g - 1) & ~(g - 1)  # a granule wholly inside plain host pages
    assert cu.cuMemMap(inside, g, 0, h, 0) == INVALID_VALUE  # not a reservation
    # A mapping of a prefix of the handle is fine; a second map over it is not.
    env.map(va, g, h)
    assert cu.cuMemMap(va, g, 0, h, 0) == INVALID_VALUE
    env.map(va + g, 2 * g, h)  # the same handle mapped twice is allowed
    # Unmap and set-access work on whole mappings only.
    assert cu.cuMemUnmap(va, g // 2) == INVALID_VALUE
    assert cu.cuMemUnmap(va + g, g) == INVALID_VALUE  # half of the second mapping
    assert cu.cuMemUnmap(va + 3 * g, g) == INVALID_VALUE  # never mapped
    assert env.access(va + 3 * g, g, (LOC_DEVICE, 0)) == INVALID_VALUE
    assert env.access(va, 4 * g, (LOC_DEVICE, 0)) == INVALID_VALUE  # hole at the end
    assert env.access(va, 3 * g, (LOC_DEVICE, 0)) == SUCCESS  # two whole mappings
    assert env.access(va, g, (LOC_DEVICE, 7)) == INVALID_DEVICE
    assert env.access(va, g, (LOC_HOST_NUMA, 0)) == INVALID_VALUE  # device memory, host access
    assert env.access(va, g, (LOC_HOST, 0)) == INVALID_VALUE
    assert env.access(va, g, (LOC_DEVICE, 0), flags=2) == INVALID_VALUE  # not a CUmemAccess_flags
    assert cu.cuMemSetAccess(va, g, None, 1) == INVALID_VALUE
    # The address range cannot be freed under live mappings, nor with the wrong size.
    assert cu.cuMemAddressFree(va, 4 * g) == INVALID_VALUE
    assert cu.cuMemAddressFree(va, 2 * g) == INVALID_VALUE
    assert cu.cuMemUnmap(va, 3 * g) == SUCCESS  # both mappings in one call
    env.stack.close()  # now everything releases cleanly
    env.stack = contextlib.ExitStack()
    # Allocation properties.
    bad = env.prop(LOC_HOST_NUMA_CURRENT, 0)
    hh = u64()
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_VALUE
    bad = env.prop(LOC_DEVICE, 3)
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_DEVICE
    bad = env.prop(LOC_INVALID, 0)
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_VALUE
    bad = env.prop()
    bad.type = 2  # MANAGED
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(bad), 0) == INVALID_VALUE
    good = env.prop()
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(good), 1) == INVALID_VALUE  # flags
    host = env.prop(LOC_HOST, 0)
    host.requestedHandleTypes = 1  # cuda.h: HOST allocations are not IPC capable
    assert cu.cuMemCreate(ctypes.byref(hh), g, ctypes.byref(host), 0) == INVALID_VALUE
    # Release twice, map after release.
    h2 = env.create(g)
    assert cu.cuMemRelease(h2) == SUCCESS
    assert cu.cuMemRelease(h2) == INVALID_VALUE
    va2 = env.reserve(g)
    assert cu.cuMemMap(va2, g, 0, h2, 0) == INVALID_VALUE
    # Reservation arguments.
    p = u64()
    assert cu.cuMemAddressReserve(ctypes.byref(p), g, 3 * PAGE, 0, 0) == INVALID_VALUE  # alignment not 2^n
    assert cu.cuMemAddressReserve(ctypes.byref(p), g + 100, 0, 0, 0) == INVALID_VALUE
    assert cu.cuMemAddressReserve(ctypes.byref(p), g, 0, 0, 1) == INVALID_VALUE
    assert cu.cuMemAddressReserve(ctypes.byref(p), 0, 0, 0, 0) == INVALID_VALUE
    big = env.reserve(4 * g, align=8 * g)
    assert big % (8 * g) == 0
    # Granularity query.
    out = sz()
    prop = env.prop(LOC_HOST_NUMA, 0)
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop), 1) == SUCCESS
    assert out.value == GRAN
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop), 2) == INVALID_VALUE
    prop = env.prop(LOC_DEVICE, 9)
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop), 0) == INVALID_DEVICE


def test_reservation_honours_a_free_hint(env, cu):
    va = env.reserve(2 * GRAN)
    assert cu.cuMemAddressFree(va, 2 * GRAN) == SUCCESS
    env.stack.pop_all()  # freed by hand
    again = env.reserve(2 * GRAN, hint=va)
    assert again == va


def test_vram_capacity_is_enforced_and_reported(env, cu, lib_sim):
    env.configure("vram=8MiB")
    env.retain()
    hs = [env.create(GRAN) for _ in range(4)]
    env.create(GRAN, expect=OUT_OF_MEMORY)
    p = u64()
    assert cu.cuMemAlloc(ctypes.byref(p), 1) == OUT_OF_MEMORY
    free, total = sz(), sz()
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == SUCCESS
    assert (free.value, total.value) == (0, 8 * MiB)
    assert lib_sim.live()["device_bytes"] == 8 * MiB and lib_sim.live()["phys_handles"] == 4
    assert cu.cuMemRelease(hs[0]) == SUCCESS
    a = env.mem_alloc(5000)  # charged in whole pages
    assert lib_sim.live()["device_bytes"] == 6 * MiB + 8192
    assert cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == SUCCESS
    assert free.value == 2 * MiB - 8192
    env.create(GRAN, expect=OUT_OF_MEMORY)
    # Host NUMA memory is not VRAM.
    env.create(4 * GRAN, LOC_HOST_NUMA, 0)
    assert lib_sim.live()["host_numa_bytes"] == 4 * GRAN
    assert cu.cuMemFree(a) == SUCCESS
    assert cu.cuMemFree(a) == INVALID_VALUE  # double free
    assert cu.cuMemFree(a + 8) == INVALID_VALUE  # not a base


def test_large_vram_costs_no_memory(env, cu, lib_sim):
    env.configure("vram=64GiB")
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * PAGE  # noqa: E731
    before = rss()
    hs = [env.create(8 << 30) for _ in range(7)]  # 56 GiB of "VRAM", never touched
    va = env.reserve(8 << 30)
    env.map(va, 8 << 30, hs[0])
    assert rss() - before < 64 * MiB
    assert lib_sim.live()["device_bytes"] == 56 << 30


def test_release_of_a_mapped_handle_is_deferred_until_unmap(env, cu, lib_sim):
    env.retain()
    va, h = env.vmm(GRAN)
    write(va, b"still here")
    assert cu.cuMemRelease(h) == SUCCESS
    live = lib_sim.live()
    assert live["phys_handles"] == 1 and live["device_bytes"] == GRAN and live["mappings"] == 1
    assert read(va, 10) == b"still here"  # memory lives on while mapped
    assert cu.cuMemMap(va, GRAN, 0, h, 0) == INVALID_VALUE  # but the handle is gone
    assert cu.cuMemUnmap(va, GRAN) == SUCCESS
    live = lib_sim.live()
    assert live["phys_handles"] == 0 and live["device_bytes"] == 0 and live["mappings"] == 0


_FAULT_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    import test_sim_driver as t
    from cxlalloc import _sim
    s = _sim.Sim(); cu = t.Cu(s.lib); s.configure({spec!r}); assert cu.cuInit(0) == 0
    e = t.Env(s, cu)
    va = e.reserve(t.GRAN)
    h = e.create(t.GRAN, {ltype}, 0)
    e.map(va, t.GRAN, h)
    for loc in {locs}:
        assert e.access(va, t.GRAN, loc, flags={flags}) == 0
    print("mapped", flush=True)
    {op}
    print("survived", flush=True)
    """
)


def _touch_in_child(ltype, locs, op, flags=PROT_RW, spec=""):
    script = _FAULT_SCRIPT.format(root=ROOT, tests=os.path.dirname(__file__), spec=spec, ltype=ltype,
                                  locs=list(locs), op=op, flags=flags)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "case,ltype,locs,op,flags",
    [
        ("no cuMemSetAccess", LOC_DEVICE, [], "ctypes.string_at(va, 8)", PROT_RW),
        ("host memory, device access only", LOC_HOST_NUMA, [(LOC_DEVICE, 0)], "ctypes.string_at(va, 8)", PROT_RW),
        ("read-only grant, CPU write", LOC_DEVICE, [(LOC_DEVICE, 0)], "ctypes.memset(va, 1, 8)", PROT_READ_),
    ],
)
def test_cpu_access_without_granted_access_is_a_real_fault(case, ltype, locs, op, flags):
    out = _touch_in_child(ltype, locs, op, flags)
    assert "mapped" in out.stdout, out.stderr
    assert "survived" not in out.stdout and out.returncode == -11, (case, out.returncode, out.stderr[-500:])


def test_cpu_access_after_granting_works_in_child():
    out = _touch_in_child(LOC_HOST_NUMA, [(LOC_DEVICE, 0), (LOC_HOST_NUMA, 0)], "ctypes.memset(va, 1, 8)")
    assert out.returncode == 0 and "survived" in out.stdout, out.stderr[-500:]


def test_device_copies_respect_per_device_access(env, cu):
    env.configure("devices=2")
    env.retain(0)
    src = env.host_alloc(GRAN)
    write(src, pattern(64))
    va = env.reserve(GRAN)
    h = env.create(GRAN)
    env.map(va, GRAN, h)
    assert cu.cuMemcpy(va, src, 64) == INVALID_VALUE  # mapped, no access yet
    assert env.access(va, GRAN, (LOC_DEVICE, 1)) == SUCCESS
    assert cu.cuMemcpy(va, src, 64) == INVALID_VALUE  # device 1 may, device 0 (current) may not
    assert env.access(va, GRAN, (LOC_DEVICE, 0), flags=PROT_READ_) == SUCCESS
    assert cu.cuMemcpy(va, src, 64) == INVALID_VALUE  # read-only for device 0
    assert cu.cuMemcpy(src + 64, va, 64) == SUCCESS  # reading is fine
    assert env.access(va, GRAN, (LOC_DEVICE, 0)) == SUCCESS
    assert cu.cuMemcpy(va, src, 64) == SUCCESS and read(va, 64) == pattern(64)
    # Reserved but unmapped VA, and ranges leaving an allocation.
    empty = env.reserve(GRAN)
    assert cu.cuMemcpy(empty, src, 8) == INVALID_VALUE
    d = env.mem_alloc(100)
    assert cu.cuMemcpy(d, src, 100) == SUCCESS
    assert cu.cuMemcpy(d, src, 101) == INVALID_VALUE
    assert cu.cuMemcpy(d, src, 0) == SUCCESS


# ================================================================ host NUMA
def test_host_numa_placement_is_recorded_and_really_bound(env, cu, lib_sim):
    env.configure("numa=0;1:0;2:0")
    env.retain()
    va, h = env.vmm(GRAN, LOC_HOST_NUMA, 1, locs=[(LOC_DEVICE, 0), (LOC_HOST_NUMA, 1)])
    assert lib_sim.host_node_of(va) == 1 and lib_sim.host_node_of(va + GRAN - 1) == 1
    write(va, b"x")  # fault the page in
    if SYS:
        assert page_node(va) == 0  # simulated node 1 is backed by real node 0
        mode, mask = page_policy(va)
        assert mode == 2 and mask == 1  # MPOL_BIND to real node 0, on the memfd's shared policy
    dva, _ = env.vmm(GRAN)
    assert lib_sim.host_node_of(dva) == -1  # device memory
    empty = env.reserve(GRAN)
    assert lib_sim.host_node_of(empty) == -1
    assert lib_sim.live()["host_numa_bytes"] == GRAN
    # Unknown node, and HOST (no node: placed near the calling CPU).
    env.create(GRAN, LOC_HOST_NUMA, 7, expect=INVALID_VALUE)
    hva, _ = env.vmm(GRAN, LOC_HOST, 0, locs=[(LOC_DEVICE, 0), (LOC_HOST, 0)])
    assert lib_sim.host_node_of(hva) == 0
    # HOST_NUMA access needs a HOST_NUMA allocation.
    assert env.access(hva, GRAN, (LOC_HOST_NUMA, 0)) == INVALID_VALUE


def test_reject_numa_refuses_cumemcreate_and_hostalloc(env, cu):
    env.configure("numa=0;1:0,reject_numa=1")
    env.create(GRAN, LOC_HOST_NUMA, 1, expect=INVALID_VALUE)
    env.create(GRAN, LOC_HOST_NUMA, 0)
    env.retain()
    env.host_alloc(PAGE)  # the CPU's node (0) is fine
    env.stack.close()
    env.stack = contextlib.ExitStack()
    env.configure("numa=0;1:0,reject_numa=0")
    env.retain()
    p = vp()
    assert cu.cuMemHostAlloc(ctypes.byref(p), PAGE, 0) == INVALID_VALUE


def test_numa_bind_and_relocation_on_register(env, cu, lib_sim):
    env.configure("numa=0;1:0;2:0,relocate=1:2")
    env.retain()
    buf = env.pages(4 * PAGE)
    lib_sim.numa_bind(buf, 2 * PAGE, 1)
    lib_sim.numa_bind(buf + 2 * PAGE, 2 * PAGE, 0)
    assert [lib_sim.host_node_of(buf + i * PAGE) for i in range(4)] == [1, 1, 0, 0]
    write(buf, b"y")
    if SYS:
        assert page_node(buf) == 0 and page_policy(buf) == (2, 1)
    # Registering (long-term pinning) moves node-1 pages to node 2; node 0 stays.
    assert cu.cuMemHostRegister(buf, 4 * PAGE, REGISTER_DEVICEMAP) == SUCCESS
    assert [lib_sim.host_node_of(buf + i * PAGE) for i in range(4)] == [2, 2, 0, 0]
    assert read(buf, 1) == b"y"  # data survives the move
    assert cu.cuMemHostUnregister(buf) == SUCCESS
    assert lib_sim.host_node_of(buf) == 2  # moved pages stay moved
    # Errors.
    with pytest.raises(ValueError, match="page-aligned"):
        lib_sim.numa_bind(buf + 1, PAGE, 0)
    with pytest.raises(ValueError, match="not a simulated node"):
        lib_sim.numa_bind(buf, PAGE, 5)
    d = env.managed(PAGE)
    with pytest.raises(ValueError, match="owned by the simulated driver"):
        lib_sim.numa_bind(d, PAGE, 0)
    assert lib_sim.host_node_of(0x1000) == -1


def test_numa_record_is_dropped_when_the_range_is_remapped(env, lib_sim):
    if not SYS:
        pytest.skip("no syscall numbers for this architecture")
    env.configure("numa=0;3:0")
    buf = env.pages(2 * PAGE)
    lib_sim.numa_bind(buf, 2 * PAGE, 3)
    assert lib_sim.host_node_of(buf + PAGE) == 3
    # A fresh mapping at the same address (MAP_FIXED) has the default policy.
    p = libc.mmap(vp(buf), PAGE, 3, 0x22 | 0x10, -1, 0)
    assert p == buf
    assert lib_sim.host_node_of(buf) == -1
    assert lib_sim.host_node_of(buf + PAGE) == 3


# ================================================================ host alloc / register
def test_host_alloc_and_register_rules(env, cu, lib_sim):
    env.retain()
    h = env.host_alloc(10000)
    dp = u64()
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), h + 100, 0) == SUCCESS and dp.value == h + 100
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), h, 1) == INVALID_VALUE  # flags must be 0
    assert lib_sim.host_node_of(h) == 0
    assert cu.cuMemFreeHost(h + 8) == INVALID_VALUE
    assert cu.cuMemHostRegister(h, 100, 0) == ALREADY_REGISTERED  # pinned already
    nomap = env.host_alloc(PAGE, flags=0)
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), nomap, 0) == INVALID_VALUE  # no DEVICEMAP
    p = vp()
    assert cu.cuMemHostAlloc(ctypes.byref(p), PAGE, 8) == INVALID_VALUE  # unknown flag
    assert cu.cuMemHostAlloc(ctypes.byref(p), 0, 0) == INVALID_VALUE
    assert lib_sim.live()["host_allocs"] == 2

    buf = env.pages(8 * PAGE)
    assert cu.cuMemHostRegister(buf + 100, 3 * PAGE, REGISTER_DEVICEMAP | REGISTER_PORTABLE) == SUCCESS
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), buf + 200, 0) == SUCCESS and dp.value == buf + 200
    assert cu.cuMemHostRegister(buf + 2 * PAGE, PAGE, 0) == ALREADY_REGISTERED  # overlaps
    assert cu.cuMemHostRegister(buf + 3 * PAGE + 500, 10, 0) == ALREADY_REGISTERED  # shares a page
    assert cu.cuMemHostRegister(buf + 5 * PAGE, PAGE, 0) == SUCCESS  # disjoint pages
    assert cu.cuMemHostGetDevicePointer(ctypes.byref(dp), buf + 5 * PAGE, 0) == INVALID_VALUE  # no DEVICEMAP
    assert cu.cuMemHostRegister(buf + 6 * PAGE, PAGE, REGISTER_IOMEMORY) == NOT_SUPPORTED
    assert cu.cuMemHostRegister(buf + 6 * PAGE, PAGE, 0x20) == INVALID_VALUE
    assert cu.cuMemHostUnregister(buf + 100 + PAGE) == NOT_REGISTERED  # not the base
    assert cu.cuMemHostUnregister(buf) == NOT_REGISTERED
    assert lib_sim.live()["registrations"] == 2
    assert cu.cuMemHostUnregister(buf + 100) == SUCCESS
    assert cu.cuMemHostUnregister(buf + 5 * PAGE) == SUCCESS
    assert cu.cuMemHostUnregister(buf + 5 * PAGE) == NOT_REGISTERED
    # The range must be mapped; driver-owned memory cannot be registered.
    hole = env.pages(3 * PAGE)
    assert libc.munmap(vp(hole + PAGE), PAGE) == 0
    assert cu.cuMemHostRegister(hole, 3 * PAGE, 0) == INVALID_VALUE
    m = env.managed(PAGE)
    assert cu.cuMemHostRegister(m, PAGE, 0) == INVALID_VALUE
    assert lib_sim.live()["registrations"] == 0


def test_host_register_capability_attributes(env, cu):
    env.configure("attr.99=0")
    env.retain()
    buf = env.pages(PAGE)
    assert cu.cuMemHostRegister(buf, PAGE, 0) == NOT_SUPPORTED
    env.stack.close()
    env.stack = contextlib.ExitStack()
    env.configure("attr.113=0")
    env.retain()
    buf = env.pages(PAGE)
    assert cu.cuMemHostRegister(buf, PAGE, REGISTER_READ_ONLY) == NOT_SUPPORTED


def test_registered_read_only_memory_is_not_writable_by_the_device(env, cu):
    env.retain()
    buf = env.pages(2 * PAGE)
    dst = env.pages(PAGE)
    assert cu.cuMemHostRegister(buf, PAGE, REGISTER_READ_ONLY) == SUCCESS
    try:
        s = env.stream()
        assert cu.cuMemcpyAsync(dst, buf, 64, s) == SUCCESS  # pageable dst via the copy engine
        assert cu.cuMemcpyAsync(buf, dst, 64, s) == INVALID_VALUE
        assert cu.cuStreamSynchronize(s) == SUCCESS
    finally:
        assert cu.cuMemHostUnregister(buf) == SUCCESS


# ================================================================ managed memory
def _range_attr(cu, attr, ptr, count, n=1):
    out = (cint * n)(*([-99] * n))
    r = cu.cuMemRangeGetAttribute(out, 4 * n, attr, ptr, count)
    assert r == SUCCESS, r
    return list(out) if n > 1 else out[0]


def test_managed_advise_and_range_attributes(env, cu):
    env.configure("devices=2,numa=0;1:0")
    env.retain()
    size = 16 * PAGE
    m = env.managed(size)
    assert _range_attr(cu, RA_PREF_TYPE, m, size) == LOC_INVALID
    assert _range_attr(cu, RA_PREF, m, size) == DEVICE_INVALID
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_HOST_NUMA, 1)) == SUCCESS
    assert _range_attr(cu, RA_PREF_TYPE, m, size) == LOC_HOST_NUMA
    assert _range_attr(cu, RA_PREF_ID, m, size) == 1
    assert _range_attr(cu, RA_PREF, m, size) == DEVICE_CPU  # legacy form
    # Half the range preferred on device 1: the whole no longer agrees.
    assert cu.cuMemAdvise(m, size // 2, ADV_SET_PREF, Location(LOC_DEVICE, 1)) == SUCCESS
    assert _range_attr(cu, RA_PREF_TYPE, m, size) == LOC_INVALID
    assert _range_attr(cu, RA_PREF_ID, m, size) == DEVICE_INVALID
    assert _range_attr(cu, RA_PREF, m, size // 2) == 1
    assert _range_attr(cu, RA_PREF_TYPE, m + size // 2, size // 2) == LOC_HOST_NUMA
    assert cu.cuMemAdvise(m, size, ADV_UNSET_PREF, Location(LOC_INVALID, 0)) == SUCCESS
    assert _range_attr(cu, RA_PREF_TYPE, m, size) == LOC_INVALID
    # Accessed-by: devices then the CPU, CU_DEVICE_INVALID padding.
    assert cu.cuMemAdvise(m, size, ADV_SET_ACC, Location(LOC_DEVICE, 1)) == SUCCESS
    assert cu.cuMemAdvise(m, size, ADV_SET_ACC, Location(LOC_HOST, 0)) == SUCCESS
    assert cu.cuMemAdvise(m, PAGE, ADV_SET_ACC, Location(LOC_DEVICE, 0)) == SUCCESS
    assert _range_attr(cu, RA_ACCESSED_BY, m, size, n=4) == [1, DEVICE_CPU, DEVICE_INVALID, DEVICE_INVALID]
    assert _range_attr(cu, RA_ACCESSED_BY, m, PAGE, n=3) == [0, 1, DEVICE_CPU]
    assert cu.cuMemAdvise(m, size, ADV_UNSET_ACC, Location(LOC_DEVICE, 1)) == SUCCESS
    assert _range_attr(cu, RA_ACCESSED_BY, m, size, n=2) == [DEVICE_CPU, DEVICE_INVALID]
    # Read-mostly; unaligned ranges round out to pages.
    assert cu.cuMemAdvise(m + 10, 100, ADV_SET_READ_MOSTLY, Location(LOC_INVALID, 0)) == SUCCESS
    assert _range_attr(cu, RA_READ_MOSTLY, m, PAGE) == 1
    assert _range_attr(cu, RA_READ_MOSTLY, m, 2 * PAGE) == 0
    # Errors: location types per advice, devices, ranges, sizes.
    assert cu.cuMemAdvise(m, size, ADV_SET_ACC, Location(LOC_HOST_NUMA, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_DEVICE, 5)) == INVALID_DEVICE
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_HOST_NUMA, 9)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_INVALID, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size, 42, Location(LOC_HOST, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, size + PAGE, ADV_SET_ACC, Location(LOC_HOST, 0)) == INVALID_VALUE
    assert cu.cuMemAdvise(m, 0, ADV_SET_ACC, Location(LOC_HOST, 0)) == INVALID_VALUE
    plain = env.pages(PAGE)
    assert cu.cuMemAdvise(plain, PAGE, ADV_SET_ACC, Location(LOC_HOST, 0)) == INVALID_VALUE  # pageable, attr 88=0
    out = (cint * 2)()
    assert cu.cuMemRangeGetAttribute(out, 8, RA_PREF, m, size) == INVALID_VALUE  # dataSize must be 4
    assert cu.cuMemRangeGetAttribute(out, 6, RA_ACCESSED_BY, m, size) == INVALID_VALUE
    assert cu.cuMemRangeGetAttribute(out, 4, 99, m, size) == INVALID_VALUE
    assert cu.cuMemRangeGetAttribute(out, 4, RA_PREF, plain, PAGE) == INVALID_VALUE


def test_managed_prefetch_residency_vram_and_node(env, cu, lib_sim):
    env.configure("vram=48KiB,numa=0;1:0;2:0,granularity=4KiB")
    env.retain()
    size = 8 * PAGE
    m = env.managed(size)
    s = env.stream()
    write(m, pattern(size))
    assert lib_sim.host_node_of(m) == -1  # never placed
    assert cu.cuMemAdvise(m, size, ADV_SET_PREF, Location(LOC_HOST_NUMA, 1)) == SUCCESS
    assert lib_sim.host_node_of(m) == 1  # first touch follows the preferred node
    assert cu.cuMemPrefetchAsync(m, size, Location(LOC_DEVICE, 0), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size
    assert _range_attr(cu, RA_LAST_PF_TYPE, m, size) == LOC_DEVICE
    assert _range_attr(cu, RA_LAST_PF_ID, m, size) == 0
    assert _range_attr(cu, RA_LAST_PF, m, size) == 0
    assert lib_sim.host_node_of(m) == -1  # resident on the GPU
    # Prefetching again to the same device costs nothing more.
    assert cu.cuMemPrefetchAsync(m, size, Location(LOC_DEVICE, 0), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size
    # Half back to host node 2.
    assert cu.cuMemPrefetchAsync(m + size // 2, size // 2, Location(LOC_HOST_NUMA, 2), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size // 2
    assert _range_attr(cu, RA_LAST_PF_TYPE, m, size) == LOC_INVALID
    assert _range_attr(cu, RA_LAST_PF_TYPE, m + size // 2, size // 2) == LOC_HOST_NUMA
    assert _range_attr(cu, RA_LAST_PF_ID, m + size // 2, size // 2) == 2
    assert _range_attr(cu, RA_LAST_PF, m + size // 2, size // 2) == DEVICE_CPU
    assert lib_sim.host_node_of(m + size - 1) == 2
    assert cu.cuStreamSynchronize(s) == SUCCESS
    assert read(m, size) == pattern(size)  # data never moves in the simulator
    # Capacity: 48 KiB VRAM, 16 KiB in use by m; 40 KiB more does not fit, 32 KiB does.
    big = env.managed(10 * PAGE)
    assert cu.cuMemPrefetchAsync(big, 10 * PAGE, Location(LOC_DEVICE, 0), 0, s) == OUT_OF_MEMORY
    assert lib_sim.live()["device_bytes"] == size // 2  # no side effect
    assert cu.cuMemPrefetchAsync(big, 8 * PAGE, Location(LOC_DEVICE, 0), 0, s) == SUCCESS
    assert lib_sim.live()["device_bytes"] == size // 2 + 8 * PAGE
    # HOST and HOST_NUMA_CURRENT resolve to the CPU's node.
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_HOST_NUMA_CURRENT, 77), 0, s) == SUCCESS
    assert _range_attr(cu, RA_LAST_PF_TYPE, big, PAGE) == LOC_HOST_NUMA
    assert _range_attr(cu, RA_LAST_PF_ID, big, PAGE) == 0
    assert cu.cuMemPrefetchAsync(big + PAGE, PAGE, Location(LOC_HOST, 5), 0, s) == SUCCESS
    assert _range_attr(cu, RA_LAST_PF_TYPE, big + PAGE, PAGE) == LOC_HOST
    # Errors.
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_DEVICE, 3), 0, s) == INVALID_DEVICE
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_HOST_NUMA, 9), 0, s) == INVALID_VALUE
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_DEVICE, 0), 1, s) == INVALID_VALUE
    assert cu.cuMemPrefetchAsync(big, PAGE, Location(LOC_DEVICE, 0), 0, vp(0x5157000000009999)) == INVALID_HANDLE
    plain = env.pages(PAGE)
    assert cu.cuMemPrefetchAsync(plain, PAGE, Location(LOC_DEVICE, 0), 0, s) == INVALID_VALUE
    # Freeing returns the managed VRAM.
    assert cu.cuMemFree(big) == SUCCESS
    assert cu.cuMemFree(m) == SUCCESS
    assert lib_sim.live()["device_bytes"] == 0 and lib_sim.live()["managed_allocs"] == 0


def test_managed_needs_capability_attributes(env, cu):
    env.configure("attr.89=0")
    env.retain()
    m = env.managed(PAGE)
    assert cu.cuMemAdvise(m, PAGE, ADV_SET_ACC, Location(LOC_DEVICE, 0)) == INVALID_DEVICE
    assert cu.cuMemPrefetchAsync(m, PAGE, Location(LOC_DEVICE, 0), 0, None) == INVALID_DEVICE
    assert cu.cuMemAdvise(m, PAGE, ADV_SET_ACC, Location(LOC_HOST, 0)) == SUCCESS
    p = u64()
    assert cu.cuMemAllocManaged(ctypes.byref(p), PAGE, 4) == INVALID_VALUE  # SINGLE is not allowed here
    assert cu.cuMemAllocManaged(ctypes.byref(p), 0, ATTACH_GLOBAL) == INVALID_VALUE
    env.stack.close()
    env.stack = contextlib.ExitStack()
    env.configure("attr.83=0")
    env.retain()
    assert cu.cuMemAllocManaged(ctypes.byref(p), PAGE, ATTACH_HOST) == NOT_SUPPORTED


# ================================================================ pointer attributes
def _pattr(cu, attr, ptr, ctype=cint):
    v = ctype()
    r = cu.cuPointerGetAttribute(ctypes.byref(v), attr, ptr)
    return r, v.value


def test_pointer_attributes(env, cu):
    ctx = env.retain()
    d = env.mem_alloc(1000)
    m = env.managed(PAGE)
    h = env.host_alloc(PAGE)
    va, _ = env.vmm(GRAN)
    hva, _ = env.vmm(GRAN, LOC_HOST_NUMA, 0, locs=[(LOC_DEVICE, 0)])
    empty = env.reserve(GRAN)
    assert _pattr(cu, PA_MEMORY_TYPE, d + 10, cuint) == (SUCCESS, MEMTYPE_DEVICE)
    assert _pattr(cu, PA_MEMORY_TYPE, m, cuint) == (SUCCESS, MEMTYPE_DEVICE)
    assert _pattr(cu, PA_MEMORY_TYPE, h, cuint) == (SUCCESS, MEMTYPE_HOST)
    assert _pattr(cu, PA_MEMORY_TYPE, va, cuint) == (SUCCESS, MEMTYPE_DEVICE)
    assert _pattr(cu, PA_MEMORY_TYPE, hva, cuint) == (SUCCESS, MEMTYPE_HOST)
    assert _pattr(cu, PA_IS_MANAGED, m, cuint) == (SUCCESS, 1)
    assert _pattr(cu, PA_IS_MANAGED, d, cuint) == (SUCCESS, 0)
    assert _pattr(cu, PA_DEVICE_ORDINAL, d) == (SUCCESS, 0)
    assert _pattr(cu, PA_DEVICE_POINTER, h + 5, u64) == (SUCCESS, h + 5)
    assert _pattr(cu, PA_HOST_POINTER, h + 5, vp) == (SUCCESS, h + 5)
    assert _pattr(cu, PA_HOST_POINTER, d, vp)[0] == INVALID_VALUE  # device memory has no host address
    assert _pattr(cu, PA_CONTEXT, d, vp) == (SUCCESS, ctx)
    assert _pattr(cu, PA_CONTEXT, va, vp) == (SUCCESS, None)  # VMM memory belongs to no context
    assert _pattr(cu, PA_RANGE_START, va + 100, u64) == (SUCCESS, va)
    assert _pattr(cu, PA_RANGE_SIZE, va + 100, sz) == (SUCCESS, GRAN)
    assert _pattr(cu, PA_MAPPED, va, cuint) == (SUCCESS, 1)
    assert _pattr(cu, PA_MAPPED, empty, cuint) == (SUCCESS, 0)
    assert _pattr(cu, PA_MEMORY_TYPE, empty, cuint)[0] == INVALID_VALUE
    assert _pattr(cu, PA_MEMORY_TYPE, env.pages(PAGE), cuint)[0] == INVALID_VALUE  # unknown host memory
    assert _pattr(cu, 7, d)[0] == NOT_SUPPORTED  # BUFFER_ID: not modelled
    assert _pattr(cu, 99, d)[0] == INVALID_VALUE
    assert cu.cuPointerGetAttribute(None, PA_MEMORY_TYPE, d) == INVALID_VALUE
    assert cu.cuCtxSetCurrent(None) == SUCCESS
    assert _pattr(cu, PA_DEVICE_POINTER, d, u64)[0] == INVALID_CONTEXT
    assert _pattr(cu, PA_MEMORY_TYPE, d, cuint) == (SUCCESS, MEMTYPE_DEVICE)  # no context needed
    assert cu.cuCtxSetCurrent(ctx) == SUCCESS


# ================================================================ streams and events
def test_sleep_then_write_then_event_orders_on_the_stream(env, cu):
    env.retain()
    buf = env.host_alloc(PAGE)
    s, ev = env.stream(), env.event()
    never = env.event()
    assert cu.cuEventQuery(never) == SUCCESS  # never recorded
    assert cu.cuEventSynchronize(never) == SUCCESS
    t0 = time.monotonic()
    env.sim.stream_sleep(s, 150_000)
    env.sim.stream_write_u64(s, buf, 0xC0FFEE)
    assert cu.cuEventRecord(ev, s) == SUCCESS
    assert cu.cuEventQuery(ev) == NOT_READY
    assert cu.cuStreamQuery(s) == NOT_READY
    assert u64_at(buf) == 0
    assert cu.cuEventSynchronize(ev) == SUCCESS
    assert time.monotonic() - t0 >= 0.14
    assert u64_at(buf) == 0xC0FFEE
    assert cu.cuEventQuery(ev) == SUCCESS and cu.cuStreamQuery(s) == SUCCESS
    assert cu.cuEventRecord(ev, vp(0x5157000000001234)) == INVALID_HANDLE
    assert cu.cuEventQuery(vp(0x5E5E000000001234)) == INVALID_HANDLE


def test_cross_stream_wait_orders_writes(env, cu):
    env.retain()
    buf = env.host_alloc(PAGE)
    a, b = env.stream(), env.stream()
    ev = env.event()
    env.sim.stream_sleep(a, 100_000)
    env.sim.stream_write_u64(a, buf, 1)
    assert cu.cuEventRecord(ev, a) == SUCCESS
    assert cu.cuStreamWaitEvent(b, ev, 0) == SUCCESS
    env.sim.stream_write_u64(b, buf, 2)  # without the wait this would land first and be overwritten
    assert cu.cuStreamSynchronize(b) == SUCCESS
    assert u64_at(buf) == 2
    # Control: without a wait, b's write lands before a's.
    env.sim.stream_sleep(a, 100_000)
    env.sim.stream_write_u64(a, buf, 3)
    env.sim.stream_write_u64(b, buf, 4)
    assert cu.cuStreamSynchronize(b) == SUCCESS and u64_at(buf) == 4
    assert cu.cuCtxSynchronize() == SUCCESS and u64_at(buf) == 3
    assert cu.cuStreamWaitEvent(b, ev, 1) == INVALID_VALUE  # WAIT_EXTERNAL only during capture


def test_legacy_stream_orders_against_blocking_streams(env, cu):
    env.retain()
    buf = env.host_alloc(PAGE)
    blocking = env.stream(flags=0)
    nonblocking = env.stream()
    env.sim.stream_sleep(blocking, 100_000)
    env.sim.stream_write_u64(blocking, buf, 1)
    env.sim.stream_write_u64(0, buf, 2)  # NULL stream: waits for the blocking stream
    assert cu.cuStreamSynchronize(None) == SUCCESS
    assert u64_at(buf) == 2
    env.sim.stream_sleep(nonblocking, 100_000)
    env.sim.stream_write_u64(nonblocking, buf, 3)
    env.sim.stream_write_u64(0, buf, 4)  # does not wait for a non-blocking stream
    assert cu.cuStreamSynchronize(None) == SUCCESS and u64_at(buf) == 4
    assert cu.cuStreamSynchronize(nonblocking) == SUCCESS and u64_at(buf) == 3
    # cuMemcpy is synchronous and ordered after prior blocking-stream work.
    src = env.host_alloc(PAGE)
    env.sim.stream_sleep(blocking, 50_000)
    env.sim.stream_write_u64(blocking, src, 77)
    assert cu.cuMemcpy(buf, src, 8) == SUCCESS and u64_at(buf) == 77


def test_memcpy_async_runs_in_stream_order(env, cu):
    env.retain()
    va, _ = env.vmm(GRAN)
    host = env.host_alloc(GRAN)
    write(host, pattern(4096, 3))
    s = env.stream()
    env.sim.stream_sleep(s, 80_000)
    assert cu.cuMemcpyAsync(va, host, 4096, s) == SUCCESS
    assert read(va, 4096) != pattern(4096, 3)
    assert cu.cuStreamSynchronize(s) == SUCCESS
    assert read(va, 4096) == pattern(4096, 3)
    assert cu.cuMemcpyAsync(va, host, GRAN + 1, s) == INVALID_VALUE  # runs off both allocations
    assert cu.cuMemcpyAsync(va, host, 16, vp(0x42)) == INVALID_HANDLE


def test_stream_work_after_unmap_is_an_async_fault(env, cu, lib_sim):
    env.retain()
    host = env.host_alloc(PAGE)
    va = env.reserve(GRAN)
    h = env.create(GRAN)
    assert cu.cuMemMap(va, GRAN, 0, h, 0) == SUCCESS
    assert env.access(va, GRAN, (LOC_DEVICE, 0)) == SUCCESS
    s = env.stream()
    env.sim.stream_sleep(s, 80_000)
    assert cu.cuMemcpyAsync(va, host, 64, s) == SUCCESS  # valid now...
    assert cu.cuMemUnmap(va, GRAN) == SUCCESS  # ...but unmapped before the stream gets there
    assert cu.cuStreamSynchronize(s) == ILLEGAL_ADDRESS
    assert lib_sim.async_faults() == 1
    assert "not mapped" in lib_sim.last_async_fault() and "cuMemcpyAsync" in lib_sim.last_async_fault()
    # The error is sticky for the context...
    assert cu.cuCtxSynchronize() == ILLEGAL_ADDRESS
    assert cu.cuStreamQuery(s) == ILLEGAL_ADDRESS
    env.stack.close()  # ...until its last primary-context release resets it
    env.stack = contextlib.ExitStack()
    env.retain()
    assert cu.cuCtxSynchronize() == SUCCESS


def test_kernel_write_to_pageable_memory_faults(env, cu, lib_sim):
    env.retain()
    s = env.stream()
    plain = env.pages(PAGE)
    env.sim.stream_write_u64(s, plain, 5)  # not registered: the GPU cannot reach it (attr 88 = 0)
    assert cu.cuStreamSynchronize(s) == ILLEGAL_ADDRESS
    assert u64_at(plain) == 0 and "pageable" in lib_sim.last_async_fault()
    with pytest.raises(ValueError, match="not a live stream"):
        env.sim.stream_sleep(0x5157000000000777, 1)
    with pytest.raises(ValueError, match="NULL"):
        env.sim.stream_write_u64(s, 0, 1)


def test_destroying_a_busy_stream_completes_its_work(env, cu, lib_sim):
    env.retain()
    buf = env.host_alloc(PAGE)
    s = vp()
    assert cu.cuStreamCreate(ctypes.byref(s), 0) == SUCCESS
    env.sim.stream_sleep(s.value, 100_000)
    env.sim.stream_write_u64(s.value, buf, 9)
    t0 = time.monotonic()
    assert cu.cuStreamDestroy(s.value) == SUCCESS
    assert time.monotonic() - t0 < 0.05  # returns at once
    assert lib_sim.live()["streams"] == 0
    assert cu.cuStreamSynchronize(s.value) == INVALID_HANDLE
    assert cu.cuStreamDestroy(s.value) == INVALID_HANDLE
    assert cu.cuStreamDestroy(None) == INVALID_HANDLE
    assert cu.cuCtxSynchronize() == SUCCESS
    assert u64_at(buf) == 9
    assert cu.cuStreamCreate(ctypes.byref(s), 4) == INVALID_VALUE
    e = vp()
    assert cu.cuEventCreate(ctypes.byref(e), 4) == INVALID_VALUE  # INTERPROCESS needs DISABLE_TIMING
    assert cu.cuEventCreate(ctypes.byref(e), 0x10) == INVALID_VALUE


def test_events_and_streams_of_different_devices(env, cu):
    env.configure("devices=2")
    env.retain(1, make_current=False)
    env.retain(0)
    s0 = env.stream()
    ev0 = env.event()
    ctx1 = vp()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx1), 1) == SUCCESS
    assert cu.cuDevicePrimaryCtxRelease(1) == SUCCESS
    assert cu.cuCtxSetCurrent(ctx1) == SUCCESS
    s1 = vp()
    assert cu.cuStreamCreate(ctypes.byref(s1), 1) == SUCCESS
    try:
        assert cu.cuEventRecord(ev0, s1) == INVALID_HANDLE  # event and stream of different contexts
        assert cu.cuEventRecord(ev0, s0) == SUCCESS
        assert cu.cuStreamWaitEvent(s1, ev0, 0) == SUCCESS  # waiting across devices is allowed
        assert cu.cuStreamSynchronize(s1) == SUCCESS
    finally:
        assert cu.cuStreamDestroy(s1) == SUCCESS


def test_exit_with_live_streams_and_queued_work_is_clean():
    script = textwrap.dedent(
        f"""
        import ctypes, sys, time
        sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.dirname(__file__)!r})
        import test_sim_driver as t
        from cxlalloc import _sim
        s = _sim.Sim(); cu = t.Cu(s.lib); assert cu.cuInit(0) == 0
        e = t.Env(s, cu); e.retain()
        buf = e.host_alloc(4096)
        for _ in range(4):
            st = e.stream()
            s.stream_sleep(st, 10_000_000)   # 10 s of queued "kernels"
            s.stream_write_u64(st, buf, 1)
        s.stream_sleep(0, 10_000_000)
        print("exiting", flush=True)
        """
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stderr[-800:]
    assert time.monotonic() - t0 < 8


def test_fork_child_cannot_use_the_driver_and_exits_cleanly():
    script = textwrap.dedent(
        f"""
        import ctypes, os, sys
        sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.dirname(__file__)!r})
        import test_sim_driver as t
        from cxlalloc import _sim
        s = _sim.Sim(); cu = t.Cu(s.lib); assert cu.cuInit(0) == 0
        e = t.Env(s, cu); e.retain()
        st = e.stream()
        s.stream_sleep(st, 2_000_000)
        pid = os.fork()
        if pid == 0:
            n = ctypes.c_int()
            codes = (cu.cuDeviceGetCount(ctypes.byref(n)), cu.cuInit(0), cu.cuStreamQuery(st))
            print("child", codes, flush=True)
            sys.exit(0 if codes == (3, 3, 3) else 1)  # a normal exit runs the exit hooks
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        print("parent", cu.cuStreamQuery(st), flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr[-800:]
    assert "child (3, 3, 3)" in out.stdout and "child exit 0" in out.stdout
    assert f"parent {NOT_READY}" in out.stdout  # the parent's stream is still busy and usable


# ================================================================ capture
def test_capture_rules(env, cu, lib_sim):
    ctx = env.retain()
    buf = env.host_alloc(PAGE)
    s, other = env.stream(flags=0), env.stream()
    ev = env.event()
    st = cint(-1)
    lib_sim.begin_capture(s)
    assert cu.cuStreamIsCapturing(s, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_ACTIVE
    assert cu.cuStreamIsCapturing(other, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE
    # Captured work is recorded, not run.
    env.sim.stream_write_u64(s, buf, 5)
    assert cu.cuMemcpyAsync(buf + 8, buf, 8, s) == SUCCESS
    assert cu.cuEventRecord(ev, s) == SUCCESS
    # Querying an event recorded in the capture is illegal and invalidates it.
    base = lib_sim.capture_violations()
    assert cu.cuEventQuery(ev) == CAPTURE_UNSUPPORTED
    assert lib_sim.capture_violations() == base + 1
    assert cu.cuStreamIsCapturing(s, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_STATUS_INVALIDATED
    assert cu.cuMemcpyAsync(buf + 8, buf, 8, s) == CAPTURE_INVALIDATED
    lib_sim.end_capture(s)
    assert cu.cuStreamIsCapturing(s, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE
    assert cu.cuEventQuery(ev) == SUCCESS  # the captured record is gone with the capture
    assert cu.cuCtxSynchronize() == SUCCESS and u64_at(buf) == 0  # nothing captured ran

    # Synchronizing or querying the capturing stream.
    lib_sim.begin_capture(s)
    assert cu.cuStreamSynchronize(s) == CAPTURE_UNSUPPORTED
    assert cu.cuStreamQuery(s) == CAPTURE_UNSUPPORTED
    # The legacy stream depends implicitly on the capturing blocking stream.
    assert cu.cuStreamIsCapturing(None, ctypes.byref(st)) == CAPTURE_IMPLICIT
    assert cu.cuMemcpy(buf, buf + 8, 8) == CAPTURE_IMPLICIT
    assert cu.cuStreamSynchronize(None) == CAPTURE_IMPLICIT
    # Global mode: unsafe calls from any thread fail.
    p = u64()
    assert cu.cuMemAlloc(ctypes.byref(p), 1024) == CAPTURE_UNSUPPORTED
    assert cu.cuCtxSynchronize() == CAPTURE_UNSUPPORTED
    errs = []

    def other_thread():
        errs.append(cu.cuMemHostRegister(buf, 8, 0))  # no context here: that is checked first
        cu.cuCtxSetCurrent(ctx)
        errs.append(cu.cuMemHostRegister(buf, 8, 0))
        cu.cuCtxSetCurrent(None)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert errs == [INVALID_CONTEXT, CAPTURE_UNSUPPORTED]
    assert lib_sim.capture_violations() == base + 9
    # VMM calls are not capture-unsafe.
    va = env.reserve(GRAN)
    assert va
    # Non-blocking streams do not involve the legacy stream.
    lib_sim.end_capture(s)
    lib_sim.begin_capture(other)
    assert cu.cuStreamIsCapturing(None, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE
    assert cu.cuStreamSynchronize(None) == SUCCESS
    lib_sim.end_capture(other)
    assert lib_sim.capture_violations() == base + 9

    with pytest.raises(ValueError, match="legacy"):
        lib_sim.begin_capture(0)
    with pytest.raises(ValueError, match="did not|not a stream that began"):
        lib_sim.end_capture(s)
    lib_sim.begin_capture(s)
    with pytest.raises(ValueError, match="already capturing"):
        lib_sim.begin_capture(s)
    lib_sim.end_capture(s)


def test_capture_fork_join_through_events(env, cu, lib_sim):
    env.retain()
    origin, side = env.stream(), env.stream()
    fork = env.event()
    st = cint()
    lib_sim.begin_capture(origin)
    assert cu.cuEventRecord(fork, origin) == SUCCESS
    assert cu.cuStreamWaitEvent(side, fork, 0) == SUCCESS  # side joins the capture
    assert cu.cuStreamIsCapturing(side, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_ACTIVE
    assert cu.cuStreamSynchronize(side) == CAPTURE_UNSUPPORTED  # invalidates the whole capture
    assert cu.cuStreamIsCapturing(origin, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_STATUS_INVALIDATED
    with pytest.raises(ValueError):
        lib_sim.end_capture(side)  # only the origin ends it
    lib_sim.end_capture(origin)
    assert cu.cuStreamIsCapturing(side, ctypes.byref(st)) == SUCCESS and st.value == CAPTURE_NONE


# ================================================================ faults and counters
def test_injected_fault_fires_on_the_nth_call_without_side_effects(env, cu, lib_sim):
    lib_sim.fail("cuMemCreate", nth=2, error=OUT_OF_MEMORY)
    env.create(GRAN)  # 1st: fine
    before = lib_sim.live()
    h = u64(0xABCD)
    prop = env.prop()
    assert cu.cuMemCreate(ctypes.byref(h), GRAN, ctypes.byref(prop), 0) == OUT_OF_MEMORY  # 2nd
    assert h.value == 0xABCD and lib_sim.live() == before  # no handle, no accounting
    env.create(GRAN)  # 3rd: the fault is spent
    # A fault fires even on a call that would itself be invalid, and before it.
    lib_sim.fail("cuMemMap", 1, UNKNOWN)
    assert cu.cuMemMap(0, 0, 0, 0, 0) == UNKNOWN
    assert cu.cuMemMap(0, 0, 0, 0, 0) == INVALID_VALUE
    # Several faults at once, and "*".
    lib_sim.fail("cuDeviceGetCount", 1, 3)
    lib_sim.fail("*", 2, 999)
    n = cint(-1)
    assert cu.cuDeviceGetCount(ctypes.byref(n)) == 3 and n.value == -1
    assert cu.cuDriverGetVersion(ctypes.byref(n)) == 999
    assert cu.cuDriverGetVersion(ctypes.byref(n)) == SUCCESS
    lib_sim.fail("cuInit", 5)
    lib_sim.clear_faults()
    for _ in range(5):
        assert cu.cuInit(0) == SUCCESS
    with pytest.raises(ValueError, match="unknown driver function 'cuMemFoo'"):
        lib_sim.fail("cuMemFoo")
    with pytest.raises(ValueError, match="nth"):
        lib_sim.fail("cuMemMap", 0)
    with pytest.raises(ValueError, match="CUDA_SUCCESS"):
        lib_sim.fail("cuMemMap", 1, 0)
    with pytest.raises(ValueError, match="not a failing CUresult"):
        lib_sim.fail("cuMemMap", 1, 5000)


def test_faults_on_async_and_sync_paths_leave_state_intact(env, cu, lib_sim):
    env.retain()
    lib_sim.fail("cuStreamCreate", 1, OUT_OF_MEMORY)
    s = vp()
    assert cu.cuStreamCreate(ctypes.byref(s), 0) == OUT_OF_MEMORY and lib_sim.live()["streams"] == 0
    m = env.managed(PAGE)
    lib_sim.fail("cuMemPrefetchAsync", 1, 999)
    assert cu.cuMemPrefetchAsync(m, PAGE, Location(LOC_DEVICE, 0), 0, None) == 999
    assert lib_sim.live()["device_bytes"] == 0
    assert _range_attr(cu, RA_LAST_PF_TYPE, m, PAGE) == LOC_INVALID
    lib_sim.fail("cuMemFree", 1, 999)
    assert cu.cuMemFree(m) == 999 and lib_sim.live()["managed_allocs"] == 1


def test_call_counters(env, cu, lib_sim):
    lib_sim.reset_counts()
    assert lib_sim.called_functions() == []
    n = cint()
    for _ in range(3):
        cu.cuDeviceGetCount(ctypes.byref(n))
    cu.cuDeviceGetCount(None)  # failing calls count too
    lib_sim.fail("cuDriverGetVersion")
    cu.cuDriverGetVersion(ctypes.byref(n))  # so do injected failures
    assert lib_sim.call_count("cuDeviceGetCount") == 4
    assert lib_sim.call_count("cuDriverGetVersion") == 1
    assert lib_sim.call_count("cuMemCreate") == 0
    assert lib_sim.called_functions() == ["cuDeviceGetCount", "cuDriverGetVersion"]
    cu.resolve("cuInit", 2000)
    assert "cuGetProcAddress" in lib_sim.called_functions()
    with pytest.raises(ValueError, match="unknown driver function"):
        lib_sim.call_count("cuMemAlloc_v2")  # base names only
    lib_sim.reset_counts()
    assert lib_sim.call_count("cuDeviceGetCount") == 0
    assert set(lib_sim.function_names()) == {n for n, _, _ in driver_table()} | {"cuGetProcAddress"}


def test_counters_are_exact_under_concurrency(env, cu, lib_sim):
    lib_sim.reset_counts()

    def spin():
        v = cint()
        for _ in range(500):
            cu.cuDriverGetVersion(ctypes.byref(v))

    threads = [threading.Thread(target=spin) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lib_sim.call_count("cuDriverGetVersion") == 2000


# ================================================================ configuration
@pytest.mark.parametrize(
    "spec,needle",
    [
        ("bogus=1", "unknown key 'bogus' (allowed keys: devices, vram, granularity, numa"),
        ("devices=x", "bad value 'x' for key 'devices'"),
        ("devices=65", "key 'devices'"),
        ("vram=12XB", "bad value '12XB' for key 'vram': expected a size"),
        ("granularity=3000", "key 'granularity': expected a power-of-two size"),
        ("numa=0;0", "node 0 listed twice"),
        ("numa=0;1:9", "real node 9 backing simulated node 1 is not an online memory node"),
        ("numa=a", "bad value 'a' for key 'numa'"),
        ("gpu_numa=5", "gpu_numa=5 is not a simulated node"),
        ("reject_numa=4", "reject_numa: node 4 is not a simulated node"),
        ("relocate=0:0", "moves a node onto itself"),
        ("numa=0;1:0,relocate=1:7", "names a node that is not simulated"),
        ("relocate=1", "expected ';'-separated A:B node pairs"),
        ("attr.0=1", "bad key 'attr.0'"),
        ("attr.148=1", "bad key 'attr.148'"),
        ("attr.141=abc", "bad value 'abc' for key 'attr.141'"),
        ("version=abc", "key 'version'"),
        ("vram", "item 'vram' is not key=value"),
        ("devices=1,devices=2", "key 'devices' given twice"),
    ],
)
def test_configure_rejects_bad_specs(env, lib_sim, spec, needle):
    with pytest.raises(ValueError) as e:
        lib_sim.configure(spec)
    assert needle in str(e.value)


def test_configure_needs_an_idle_machine_and_keeps_the_old_config_on_error(env, cu, lib_sim):
    env.configure("vram=16MiB")
    env.retain()
    with pytest.raises(ValueError, match=r"still live \(1 primary-context retains\)"):
        lib_sim.configure("vram=32MiB")
    with pytest.raises(ValueError):
        lib_sim.configure("vram=oops")
    # Re-applying the current machine is a no-op, allowed while live.
    lib_sim.configure("vram=16777216")
    lib_sim.configure(" vram = 16MiB ,")
    total = sz()
    assert cu.cuDeviceTotalMem(ctypes.byref(total), 0) == SUCCESS and total.value == 16 * MiB


def test_sizes_parse_like_specs(lib_sim):
    assert lib_sim.parse_size("64MiB") == 64 * MiB
    assert lib_sim.parse_size("1.5GiB") == 3 << 29
    assert lib_sim.parse_size("4096") == 4096
    assert lib_sim.parse_size("2m") == 2 * MiB
    assert lib_sim.parse_size(" 8 GiB ") == 8 << 30
    for bad in ("", "1.5", "0.3KiB", "12XB", "-1", "1e3", "99999999999TiB"):
        with pytest.raises(ValueError):
            lib_sim.parse_size(bad)


def test_granularity_and_default_numa_follow_the_spec(env, cu):
    env.configure("granularity=64KiB")
    g = sz()
    prop = env.prop()
    assert cu.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0) == SUCCESS
    assert g.value == 64 * 1024
    va = env.reserve(128 * 1024)
    h = env.create(64 * 1024)
    env.map(va + 64 * 1024, 64 * 1024, h)
    env.create(GRAN + 64 * 1024)
    env.create(32 * 1024, expect=INVALID_VALUE)
    # Default nodes are this machine's memory nodes; node ids outside them fail.
    env.create(64 * 1024, LOC_HOST_NUMA, 0)
    env.create(64 * 1024, LOC_HOST_NUMA, 1000, expect=INVALID_VALUE)


def test_library_path_points_at_the_built_simulator(tmp_path, monkeypatch):
    path = _sim.library_path()
    assert os.path.isfile(path) and os.path.basename(path).startswith("_simcuda")
    monkeypatch.setattr(_sim, "__file__", str(tmp_path / "_sim.py"))
    with pytest.raises(FileNotFoundError, match="not built"):
        _sim.library_path()
    monkeypatch.undo()
    assert _sim.Sim().lib is _sim.Sim(path).lib  # one loaded instance
