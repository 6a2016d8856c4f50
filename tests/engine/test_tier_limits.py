"""alloc::TierLimits on its own: the tier budget DeviceAllocator owns.

Compiles tests/engine/tier_limits_test.cpp with tier_limits.cpp alone (pure
arithmetic, no driver) and runs it: the effective device limit (external VRAM
use taken off), fits / over_by / room on both tiers including a size that
wraps around, a disabled host tier, and the policy's TierBudget snapshot with
and without the KV quota and headroom (kv_aware).
"""

import pytest

from tests.engine import cpp_unit


@pytest.fixture(scope="module")
def tier_limits_test(tmp_path_factory):
    return cpp_unit.build("tier_limits_test.cpp", ["alloc/tier_limits.cpp", "common/types.cpp"],
                          tmp_path_factory.mktemp("tier_limits"))


def test_tier_limits_unit(tier_limits_test):
    # every case ran (a case that returned early would check fewer)
    assert cpp_unit.run_checks(tier_limits_test) >= 37
