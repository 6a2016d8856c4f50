"""Fixtures of the simulated-driver tests: the simulator library (``lib_sim``),
its entry points (``cu``) and a fresh machine per test that must be left with
nothing live (``env``).  The harness is tests/helpers/sim_driver.py."""

import pytest

from cxlalloc import _sim
from tests.helpers.sim_driver import SUCCESS, Cu, Env


@pytest.fixture(scope="session")
def lib_sim():
    return _sim.Sim()


@pytest.fixture(scope="session")
def cu(lib_sim):
    return Cu(lib_sim.lib)


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
