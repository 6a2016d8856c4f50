"""Harness of the simulated-driver tests (tests/sim/): CUDA constants of cuda.h,
the ctypes layouts, the driver table read from csrc/driver/driver.h, ``Cu``
(every entry point resolved through cuGetProcAddress_v2 the way
csrc/driver/driver.cpp resolves it) and ``Env`` (per-test resources released at
teardown), plus raw page queries (move_pages, get_mempolicy).

The fixtures built on it (``lib_sim``, ``cu``, ``env``) are in tests/sim/conftest.py.
Child-process scripts import this module as ``tests.helpers.sim_driver``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
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


def write(addr, data: bytes):
    ctypes.memmove(addr, data, len(data))


def read(addr, n) -> bytes:
    return ctypes.string_at(addr, n)


def u64_at(addr):
    return ctypes.c_uint64.from_address(addr).value


def pattern(n, seed=1):
    return bytes((i * 131 + seed * 7) & 0xFF for i in range(n))


def range_attr(cu, attr, ptr, count, n=1):
    out = (cint * n)(*([-99] * n))
    r = cu.cuMemRangeGetAttribute(out, 4 * n, attr, ptr, count)
    assert r == SUCCESS, r
    return list(out) if n > 1 else out[0]
