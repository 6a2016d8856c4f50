"""The benchmark method (cxlalloc_apps/bench/method.py) on synthetic arms with a known ratio.

No real timing: the arms advance a fake clock by a known cost, times a load factor that changes from round to
round (a busy machine), plus a penalty for whichever arm runs first in a round (a cold cache).  The method
must recover the known ratio within its stated spread, and the order the arms are listed in must not change
the summary.
"""

import pytest

from cxlalloc_apps.bench import method

KNOWN = 2.0          # arm "slow" costs KNOWN x arm "fast"
FIRST_PENALTY = 0.1  # whichever arm runs first in a round costs 10 % more (a cold cache)
LOADS = [1.0, 3.0, 1.5, 2.2, 1.1, 4.0, 1.3, 2.8, 1.0, 1.7]  # per-round load factor (machine noise)


class FakeRun:
    def __init__(self):
        self.t = 0.0
        self.round = -1
        self.ran_in_round = 0
        self.calls = []

    def clock(self):
        return self.t

    def arm(self, name, cost, n_arms):
        def fn():
            if self.ran_in_round % n_arms == 0:
                self.round += 1
            load = LOADS[self.round % len(LOADS)]
            first = self.ran_in_round % n_arms == 0
            self.t += cost * load * ((1 + FIRST_PENALTY) if first else 1.0)
            self.ran_in_round += 1
            self.calls.append(name)
        return fn


def run(listing, rounds=8, order="rotate"):
    f = FakeRun()
    costs = {"fast": 1.0, "slow": KNOWN}
    arms = {n: f.arm(n, costs[n], len(listing)) for n in listing}
    return method.interleave(arms, rounds, warmup=1, order=order, clock=f.clock), f


def test_known_ratio_is_recovered_within_the_stated_spread():
    cmp, _ = run(["fast", "slow"])
    r = cmp.ratio("slow", "fast")
    assert r.n == 8
    assert r.q1 <= KNOWN <= r.q3, r
    assert abs(r.median - KNOWN) < 0.1, r
    # no single round gives the truth: a fixed order (one arm always first) would report a biased ratio
    # (KNOWN / 1.1 or KNOWN * 1.1) with no spread at all
    assert all(abs(x - KNOWN) > 0.15 for x in cmp.ratios("slow", "fast"))


def test_the_listing_order_of_the_arms_changes_nothing():
    a, _ = run(["fast", "slow"])
    b, _ = run(["slow", "fast"])
    assert sorted(a.ratios("slow", "fast")) == pytest.approx(sorted(b.ratios("slow", "fast")))
    ra, rb = a.ratio("slow", "fast"), b.ratio("slow", "fast")
    assert (ra.median, ra.q1, ra.q3) == pytest.approx((rb.median, rb.q1, rb.q3))


def test_rotation_lets_each_arm_lead_equally_often_and_warmup_is_discarded():
    cmp, f = run(["fast", "slow"], rounds=6)
    leads = [o[0] for o in cmp.orders]
    assert leads.count("fast") == leads.count("slow") == 3
    assert len(f.calls) == 2 * (6 + 1)          # one warm-up round ran
    assert all(len(v) == 6 for v in cmp.samples.values())
    three = method.round_orders(["a", "b", "c"], 3)
    assert [o[0] for o in three] == ["a", "b", "c"]


def test_random_order_is_seeded_and_recovers_the_ratio():
    a, _ = run(["fast", "slow"], rounds=10, order="random")
    b, _ = run(["fast", "slow"], rounds=10, order="random")
    assert a.orders == b.orders
    r = a.ratio("slow", "fast")
    assert r.q1 <= KNOWN * 1.06 and r.q3 >= KNOWN * 0.94, r


def test_verdicts_follow_the_spread():
    s = method.Spread.of([1.9, 2.0, 2.0, 2.1, 2.2])
    assert method.verdict(s, 2.5) == "met"
    assert method.verdict(s, 1.5) == "missed"
    assert method.verdict(s, 2.05) == "within noise"
    assert method.verdict(s, 1.5, better="higher") == "met"
    assert method.verdict(s, 3.0, better="higher") == "missed"
    rec = method.goal_record("wrapped <= 1.1x", s, 1.1)
    assert rec["verdict"] == "missed" and rec["ratio"]["median"] == 2.0


def test_bad_input_names_the_option():
    f = FakeRun()
    with pytest.raises(ValueError, match="rounds=3"):
        method.interleave({"a": f.arm("a", 1, 2), "b": f.arm("b", 1, 2)}, 3)
    with pytest.raises(ValueError, match="at least two arms"):
        method.interleave({"a": f.arm("a", 1, 1)})
    with pytest.raises(ValueError, match="order='fixed'"):
        method.round_orders(["a", "b"], 5, "fixed")
    with pytest.raises(ValueError, match="better="):
        method.verdict(method.Spread.of([1.0]), 1.0, better="up")
    with pytest.raises(ValueError, match="no samples"):
        method.Spread.of([])


def test_record_form_and_noise_floor():
    cmp, _ = run(["fast", "slow"])
    d = cmp.as_dict(ratios=[("slow", "fast")])
    assert d["rounds"] == 8 and "slow/fast" in d["ratios"] and "rotated" in d["method"]
    assert set(d["load_before"]) == {"loadavg_1m", "loadavg_5m", "cpus"}
    f = FakeRun()
    nf = method.noise_floor(f.arm("x", 1.0, 2), clock=f.clock)
    assert nf.lo > 0 and nf.q1 <= 1.0 + FIRST_PENALTY  # the A/A ratio sits around 1 within the order penalty


class CountDown:
    """A deadline that expires after ``n`` checks (``expired()`` calls)."""

    def __init__(self, n):
        self.n = n

    def expired(self):
        self.n -= 1
        return self.n < 0


def test_rounds_is_the_arm_loop_rotated_with_warmup_a_deadline_and_a_comparison():
    skipped = []
    loop = method.Rounds(["a", "b", "c"], 5, warmup=1, deadline=CountDown(14),
                         skip=lambda part, why: skipped.append((part, why)))
    turns = list(loop)
    rotated = [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [t.arm for t in turns] == [a for r in range(6) for a in rotated[r % 3]][:14]
    assert [(t.round, t.timed, t.timed_round) for t in turns[2:4]] == [(0, False, -1), (1, True, 0)]
    assert turns[0].label() == "round 1/6 (warm-up): a" and turns[3].label() == "round 2/6: b"
    assert turns[3].order == ["b", "c", "a"]
    # the deadline expired during round 4: its last turn and all of round 5 were skipped, each said
    assert skipped == [("a round 4", "time budget"), ("c round 5", "time budget"), ("a round 5", "time budget"),
                       ("b round 5", "time budget")]
    assert set(loop.load_before) == set(loop.load_after) == {"loadavg_1m", "loadavg_5m", "cpus"}
    # a ran in timed rounds 0-2, b and c in 0-3: the comparison keeps the first 3 of each, their orders
    cmp = loop.comparison({"a": [1.0, 2.0, 3.0], "b": [2.0, 4.0, 6.0, 99.0], "c": [3.0, 6.0, 9.0, 99.0]})
    assert cmp.rounds == 3 and cmp.orders == [["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert cmp.ratios("b", "a") == [2.0, 2.0, 2.0] and cmp.ratio("c", "a").median == 3.0
    assert cmp.warmup == 1 and cmp.load_before == loop.load_before
    assert len(list(method.Rounds(["x", "y"], 2, warmup=0))) == 4  # no deadline: every turn; a smoke run allowed
    with pytest.raises(ValueError, match="warmup=-1"):
        method.Rounds(["a", "b"], 5, warmup=-1)
    with pytest.raises(ValueError, match="order='fixed'"):
        method.Rounds(["a", "b"], 5, order="fixed")
