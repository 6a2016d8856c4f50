"""cuPointerGetAttribute on every kind of simulated memory.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import ctypes

from tests.helpers.sim_driver import (
    GRAN, INVALID_CONTEXT, INVALID_VALUE, LOC_DEVICE, LOC_HOST_NUMA, MEMTYPE_DEVICE, MEMTYPE_HOST, NOT_SUPPORTED, PAGE,
    PA_CONTEXT, PA_DEVICE_ORDINAL, PA_DEVICE_POINTER, PA_HOST_POINTER, PA_IS_MANAGED, PA_MAPPED, PA_MEMORY_TYPE,
    PA_RANGE_SIZE, PA_RANGE_START, SUCCESS, cint, cuint, sz, u64, vp,
)


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
