"""The simulator's export table and loader: every function of csrc/driver/driver.h at its ABI version,
cuGetProcAddress rules, versioned symbols, error names and strings.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from cxlalloc import _sim
from tests.helpers.sim_driver import (
    ARGTYPES, CAPTURE_IMPLICIT, GPA_SYMBOL_NOT_FOUND, GPA_VERSION_NOT_SUFFICIENT, GRAN, INVALID_CONTEXT, INVALID_VALUE,
    LOC_HOST, OUT_OF_MEMORY, P, SUCCESS, cint, cuda_min_codes, driver_table, sz, u64, vp,
)


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
