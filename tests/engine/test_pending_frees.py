"""alloc::PendingFrees on its own: stream-ordered frees on the simulated driver.

Compiles tests/engine/pending_frees_test.cpp with the sources PendingFrees
links against and runs it with the path of the built simulator
(cxlalloc/_simcuda*.so): events recorded per stream use and reused, a busy
stream (cxlsim_stream_sleep) holding its block back until waited for, the
per-tier pass, frees deferred during capture, a failing cuEventRecord
(cxlsim_fail) waiting for the stream instead, and all-or-nothing event
acquisition.
"""

import pytest

from cxlalloc import _sim
from tests.engine import cpp_unit

SOURCES = [
    "alloc/pending_frees.cpp",
    "alloc/segment.cpp",
    "backend/host_pages.cpp",
    "driver/resources.cpp",
    "driver/driver.cpp",
    "common/error.cpp",
    "common/log.cpp",
    "common/types.cpp",
    "common/units.cpp",
]


@pytest.fixture(scope="module")
def pending_frees_test(tmp_path_factory):
    return cpp_unit.build("pending_frees_test.cpp", SOURCES, tmp_path_factory.mktemp("pending_frees"))


def test_pending_frees_unit(pending_frees_test):
    assert cpp_unit.run_checks(pending_frees_test, _sim.library_path()) >= 43
