"""Timing helpers shared by the benchmarks.

GPU work is timed with CUDA events around the timed region after warm-up
runs, repeated, and summarised by the median (the method of
``/work/.library/device/METHOD.md``: "Warm up first ... Repeat many times and
take the median").  CPU work is timed with ``time.perf_counter_ns``.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence


def summarize(samples: Sequence[float]) -> Dict[str, float]:
    """``{"n", "median", "mean", "min", "max", "p10", "p90"}`` of ``samples``
    (same unit as the samples); ``{"n": 0}`` for none."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        return {"n": 0}

    def q(p: float) -> float:
        if len(xs) == 1:
            return xs[0]
        k = p * (len(xs) - 1)
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs), "min": xs[0],
            "max": xs[-1], "p10": q(0.10), "p90": q(0.90)}


def cuda_time_ms(fn: Callable[[], object], warmup: int = 2, repeat: int = 7,
                 deadline: Optional["Deadline"] = None) -> List[float]:
    """Milliseconds per call of ``fn`` on the current CUDA stream, one sample
    per repeat, measured with ``torch.cuda.Event(enable_timing=True)`` after
    ``warmup`` untimed calls.  Stops early (at least one sample) when
    ``deadline`` has expired."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(float(a.elapsed_time(b)))
        if deadline is not None and deadline.expired():
            break
    return out


def gbps(nbytes: int, ms: float) -> float:
    """Decimal GB/s for ``nbytes`` moved in ``ms`` milliseconds (1 GB = 1e9 bytes)."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


class Deadline:
    """A wall-clock deadline (``time.monotonic``); ``None`` seconds = never."""

    def __init__(self, seconds: Optional[float]):
        self.t_end = None if seconds is None else time.monotonic() + float(seconds)

    def remaining(self) -> float:
        return float("inf") if self.t_end is None else self.t_end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def sub(self, seconds: Optional[float]) -> "Deadline":
        """A deadline no later than this one and ``seconds`` from now."""
        d = Deadline(seconds)
        if d.t_end is None or (self.t_end is not None and self.t_end < d.t_end):
            d.t_end = self.t_end
        return d
