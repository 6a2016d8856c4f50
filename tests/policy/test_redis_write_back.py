"""When a block is written to the tier below (cxlalloc.policy.redis_write_back): a pure decision."""

from __future__ import annotations

import pytest

from cxlalloc.policy import redis_write_back as wb


def test_evict_writes_on_eviction_only_and_through_on_commit_only():
    assert wb.MODES == ("evict", "through")
    assert wb.write_on_evict("evict") and not wb.write_on_commit("evict")
    assert wb.write_on_commit("through") and not wb.write_on_evict("through")


@pytest.mark.parametrize("mode", ["", "write-back", "EVICT", None])
def test_a_bad_mode_names_the_option_and_the_allowed_values(mode):
    with pytest.raises(ValueError, match=r"'--redis-mode'.*allowed: evict, through"):
        wb.check_mode(mode)
    assert wb.check_mode("through") == "through"
