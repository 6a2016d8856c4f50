"""The one benchmark method every comparison uses: interleaved arms, repeated rounds, per-round ratios.

Why (issue 33, re-measured 2026-12-03): arms run in a fixed order (the baseline always first) carry the order's
bias into the ratio; one sample per cell has no spread; a ratio of minima pairs the fastest samples of
*different* rounds; a figure taken at load average 13-23 hides a fixed per-call cost inside slow compute.  So:

- **Interleave.**  Every round runs every arm once, in an order rotated by the round number (round r starts at
  arm ``r mod k``) or shuffled per round (``order="random"``, seeded).  An order effect (a warm cache, a cold
  one, a thermal step) then falls on every arm equally often.
- **Repeat.**  At least 5 rounds (``MIN_ROUNDS``), after warm-up rounds that are run in the same rotation and
  discarded.
- **Ratio per round, then summarise.**  ``ratio(a, b)`` divides a's sample by b's sample *of the same round*
  and summarises those quotients (median, interquartile range, min/max): never a quotient of two summaries.
- **Record the load and the noise floor.**  ``machine_load()`` reads ``os.getloadavg`` and the CPU count
  before and after; ``noise_floor()`` times one arm against itself (an A/A comparison), whose ratio's spread
  is what "within noise" means on that machine at that moment.
- **A verdict per goal** from the spread (``verdict``): *met* when the whole interquartile range is on the
  goal's side, *missed* when the whole range is on the other side, *within noise* when the range straddles
  the goal.

``interleave`` runs arms that are plain callables; a benchmark whose arm is more (a server replayed against, a
model built per round, a row recorded per run) iterates ``Rounds`` instead: the same rotated plan, warm-up and
load record, one loop for every such benchmark.

The module is pure Python with an injectable clock so that its own test (``tests/app/test_bench_method.py``)
checks it on a synthetic pair of arms with a known ratio and an order penalty.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence

MIN_ROUNDS = 5
"""Fewest timed rounds a comparison may report (issue 33: ">= 5 rounds")."""

ORDERS = ("rotate", "random")


def quantile(xs: Sequence[float], p: float) -> float:
    """The ``p``-quantile (0..1) of ``xs`` by linear interpolation between order statistics (numpy's default,
    "type 7"); NaN for no samples."""
    s = sorted(float(x) for x in xs)
    if not s:
        return float("nan")
    k = p * (len(s) - 1)
    lo, hi = math.floor(k), math.ceil(k)
    if s[lo] == s[hi] or k == lo:  # also keeps an infinite sample (a ratio over a zero) from turning into NaN
        return s[lo]
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class Spread:
    """Median and spread of a set of samples (same unit as the samples; a ratio has none).

    ``q1``/``q3`` are the 25th/75th percentiles (the interquartile range), ``lo``/``hi`` the minimum and
    maximum, ``n`` the number of samples."""

    n: int
    median: float
    q1: float
    q3: float
    lo: float
    hi: float

    @classmethod
    def of(cls, xs: Sequence[float]) -> "Spread":
        """The spread of ``xs``. Raises ValueError for an empty sequence."""
        xs = [float(x) for x in xs]
        if not xs:
            raise ValueError("Spread.of: no samples")
        return cls(len(xs), statistics.median(xs), quantile(xs, 0.25), quantile(xs, 0.75), min(xs), max(xs))

    def as_dict(self, digits: int = 4) -> Dict[str, float]:
        """The JSON form ``{"n", "median", "q1", "q3", "min", "max"}``, rounded to ``digits`` places."""
        r = lambda v: round(v, digits)  # noqa: E731
        return {"n": self.n, "median": r(self.median), "q1": r(self.q1), "q3": r(self.q3),
                "min": r(self.lo), "max": r(self.hi)}

    def text(self, unit: str = "x", digits: int = 3) -> str:
        """``"1.02x (IQR 0.98-1.05, range 0.95-1.10, n=5)"``: how a record's prose states a figure."""
        f = f"{{:.{digits}f}}"
        return (f"{f.format(self.median)}{unit} (IQR {f.format(self.q1)}-{f.format(self.q3)}, "
                f"range {f.format(self.lo)}-{f.format(self.hi)}, n={self.n})")


@dataclass
class Comparison:
    """The samples of an interleaved run: ``samples[arm][r]`` is arm's value in timed round ``r``, and
    ``orders[r]`` the order the arms ran in that round.  Values are whatever the arm returned (seconds when
    the arm is timed by ``interleave``)."""

    arms: List[str]
    samples: Dict[str, List[float]]
    orders: List[List[str]]
    order: str
    warmup: int
    load_before: Dict[str, float] = field(default_factory=dict)
    load_after: Dict[str, float] = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        """Number of timed rounds."""
        return len(self.orders)

    def spread(self, arm: str) -> Spread:
        """Median and spread of one arm's samples. KeyError for an unknown arm."""
        return Spread.of(self.samples[arm])

    def ratios(self, a: str, b: str) -> List[float]:
        """``a / b`` per round (same round's samples; a round where b is 0 gives inf)."""
        return [(x / y) if y else float("inf") for x, y in zip(self.samples[a], self.samples[b])]

    def ratio(self, a: str, b: str) -> Spread:
        """The spread of the per-round ratios ``a / b`` (never a ratio of two medians or of minima)."""
        return Spread.of(self.ratios(a, b))

    def as_dict(self, ratios: Sequence[Sequence[str]] = ()) -> Dict[str, object]:
        """JSON form: method, rounds, the order of each round, every sample, each arm's spread, and each
        requested ratio ``(a, b)`` as ``"a/b"`` with its spread."""
        return {"method": describe(self.order, self.rounds, self.warmup), "rounds": self.rounds,
                "warmup_rounds": self.warmup, "orders": self.orders,
                "samples": {a: [round(v, 6) for v in vs] for a, vs in self.samples.items()},
                "spread": {a: self.spread(a).as_dict(6) for a in self.arms},
                "ratios": {f"{a}/{b}": self.ratio(a, b).as_dict() for a, b in ratios},
                "load_before": self.load_before, "load_after": self.load_after}


def describe(order: str, rounds: int, warmup: int) -> str:
    """One sentence for a record's ``method`` field."""
    how = "rotated by the round number" if order == "rotate" else "shuffled per round (seeded)"
    return (f"arms interleaved, order {how}; {warmup} warm-up round(s) discarded, {rounds} timed rounds; "
            "each ratio computed per round from that round's samples, then summarised as median, "
            "interquartile range and min-max (cxlalloc_apps/bench/method.py)")


def round_orders(arms: Sequence[str], rounds: int, order: str = "rotate", seed: int = 0) -> List[List[str]]:
    """The order of the arms in each of ``rounds`` rounds.

    ``"rotate"``: round r is the arm list rotated left by ``r mod k`` (each arm leads equally often over any
    k consecutive rounds); ``"random"``: a seeded shuffle per round.  Raises ValueError for another order."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: allowed values are {', '.join(ORDERS)}")
    arms = list(arms)
    if order == "rotate":
        k = len(arms)
        return [arms[r % k:] + arms[:r % k] for r in range(rounds)]
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        o = arms[:]
        rng.shuffle(o)
        out.append(o)
    return out


def machine_load() -> Dict[str, float]:
    """``{"loadavg_1m", "loadavg_5m", "cpus"}`` of this machine now (Linux ``os.getloadavg``)."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        one = five = float("nan")
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "cpus": os.cpu_count() or 0}


def interleave(arms: Mapping[str, Callable[[], Optional[float]]], rounds: int = MIN_ROUNDS, *, warmup: int = 1,
               order: str = "rotate", seed: int = 0, clock: Callable[[], float] = time.perf_counter,
               allow_fewer: bool = False) -> Comparison:
    """Run every arm once per round, in the rotated (or shuffled) order, and keep one sample per arm per round.

    ``arms`` maps a name to a callable.  If it returns a number, that number is the sample (the arm timed
    itself, e.g. a TTFT stamped inside ``generate()``); if it returns None, the sample is the ``clock()``
    seconds the call took.  ``warmup`` whole rounds run first, in the same rotation, and are discarded.

    Raises ValueError for fewer than two arms, for ``rounds < MIN_ROUNDS`` (unless ``allow_fewer``, for a
    quick smoke run that must then not be reported as a figure), or for an unknown ``order``."""
    names = list(arms)
    if len(names) < 2:
        raise ValueError("interleave needs at least two arms to compare")
    if rounds < MIN_ROUNDS and not allow_fewer:
        raise ValueError(f"rounds={rounds}: a reported comparison needs at least {MIN_ROUNDS} rounds")
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: must be >= 0")
    plan = round_orders(names, warmup + rounds, order, seed)
    samples: Dict[str, List[float]] = {a: [] for a in names}
    before = machine_load()
    for r, seq in enumerate(plan):
        for a in seq:
            t0 = clock()
            v = arms[a]()
            dt = clock() - t0
            if r >= warmup:
                samples[a].append(float(dt if v is None else v))
    return Comparison(names, samples, plan[warmup:], order, warmup, before, machine_load())


@dataclass(frozen=True)
class Turn:
    """One arm's run in one round of :class:`Rounds`: ``round`` counts from 0 over every round, the ``warmup``
    rounds first; ``order`` is that round's order of the arms; ``total`` the number of rounds, warm-up
    included."""

    arm: str
    round: int
    warmup: int
    order: List[str]
    total: int

    @property
    def timed(self) -> bool:
        """False in a warm-up round (run it, then discard what it measured)."""
        return self.round >= self.warmup

    @property
    def timed_round(self) -> int:
        """The round's number among the timed rounds (negative in warm-up)."""
        return self.round - self.warmup

    def label(self) -> str:
        """``"round 2/6: plain"`` (``" (warm-up)"`` after the count in a warm-up round), for progress lines."""
        return f"round {self.round + 1}/{self.total}{'' if self.timed else ' (warm-up)'}: {self.arm}"


class Rounds:
    """The arm loop: ``for turn in Rounds(arms, rounds, warmup=1)`` yields a :class:`Turn` for every arm of every
    round, ``warmup`` rounds first, each round's arms in the order :func:`round_orders` gives (rotated by the
    round number, or shuffled); the caller runs ``turn.arm`` and keeps what it measured when ``turn.timed``.

    The machine's load is read into ``load_before`` when the loop starts and ``load_after`` when it ends.  With
    a ``deadline`` (an object whose ``expired()`` is true once the time budget is spent), every turn after it
    expires is not yielded but passed to ``skip(part, reason)`` as ``("ARM round R", "time budget")``.

    ``rounds`` are timed rounds; fewer than :data:`MIN_ROUNDS` is allowed here (a ``--quick`` smoke run), and
    the caller says such a run is not a figure.  Raises ValueError for a negative ``warmup``, for no arms or for
    an unknown ``order``."""

    def __init__(self, arms: Sequence[str], rounds: int, *, warmup: int = 1, order: str = "rotate", seed: int = 0,
                 deadline=None, skip: Optional[Callable[[str, str], None]] = None):
        if warmup < 0:
            raise ValueError(f"warmup={warmup}: must be >= 0")
        self.arms = list(arms)
        if not self.arms:
            raise ValueError("Rounds needs at least one arm")
        self.warmup = warmup
        self.order = order
        self.orders = round_orders(self.arms, warmup + rounds, order, seed)
        self.deadline = deadline
        self.skip = skip
        self.load_before: Dict[str, float] = {}
        self.load_after: Dict[str, float] = {}

    def __iter__(self) -> Iterator[Turn]:
        self.load_before = machine_load()
        for r, seq in enumerate(self.orders):
            for arm in seq:
                if self.deadline is not None and self.deadline.expired():
                    if self.skip is not None:
                        self.skip(f"{arm} round {r}", "time budget")
                    continue
                yield Turn(arm, r, self.warmup, seq, len(self.orders))
        self.load_after = machine_load()

    def comparison(self, samples: Mapping[str, Sequence[float]]) -> Comparison:
        """A :class:`Comparison` of ``samples`` (arm -> its timed rounds' values, in order; every arm of the loop):
        each arm's list cut to the shortest one's length ``n``, with the orders of the first ``n`` timed rounds
        and the loads of the loop.  Raises KeyError for an arm without samples."""
        n = min(len(samples[a]) for a in self.arms)
        return Comparison(self.arms, {a: list(samples[a][:n]) for a in self.arms},
                          self.orders[self.warmup:self.warmup + n], self.order, self.warmup, self.load_before,
                          self.load_after)


def noise_floor(fn: Callable[[], Optional[float]], rounds: int = MIN_ROUNDS, *, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> Spread:
    """An A/A comparison: ``fn`` against itself, interleaved like any pair of arms.  The spread of its ratio
    (ideally 1.0) is the machine's noise for that work at that moment; record it beside the figures."""
    cmp = interleave({"a": fn, "a_again": fn}, rounds, warmup=warmup, clock=clock, allow_fewer=True)
    return cmp.ratio("a", "a_again")


VERDICTS = ("met", "missed", "within noise")


def verdict(ratio: Spread, goal: float, better: str = "lower") -> str:
    """Whether a ratio meets a goal, from its spread.

    ``better="lower"``: the goal is ``ratio <= goal`` (e.g. "wrapped <= 1.1x the by-hand cache");
    ``better="higher"``: ``ratio >= goal`` (e.g. "insert >= 0.6x memcpy").  "met" when the whole interquartile
    range is on the goal's side, "missed" when it is wholly on the other side, "within noise" when it straddles
    the goal.  Raises ValueError for another ``better``."""
    if better == "lower":
        good, bad = ratio.q3 <= goal, ratio.q1 > goal
    elif better == "higher":
        good, bad = ratio.q1 >= goal, ratio.q3 < goal
    else:
        raise ValueError(f"better={better!r}: allowed values are lower, higher")
    return "met" if good else "missed" if bad else "within noise"


def goal_record(name: str, ratio: Spread, goal: float, better: str = "lower") -> Dict[str, object]:
    """A record's entry for one goal: the ratio's spread, the goal, its direction and the verdict."""
    return {"goal": name, "target": goal, "better": better, "ratio": ratio.as_dict(),
            "verdict": verdict(ratio, goal, better)}
