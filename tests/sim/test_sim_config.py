"""Configuring the simulated machine (devices, VRAM, NUMA nodes, granularity) and locating the library.

The harness (constants, ctypes layouts, ``Cu``, ``Env``) is tests/helpers/sim_driver.py; the
fixtures are in tests/sim/conftest.py.  Each test starts from a freshly configured machine and
must leave nothing live.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from cxlalloc import _sim
from tests.helpers.sim_driver import (
    GRAN, INVALID_VALUE, LOC_HOST_NUMA, MiB, SUCCESS, sz,
)


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
