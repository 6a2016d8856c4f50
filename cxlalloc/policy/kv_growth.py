"""The KV storage growth decision: how many tokens a cache layer's storage is re-created for.

Pure (no torch, no I/O): :class:`cxlalloc.hf.pool.KVPool` and the sliding-window layer ask it
when a cache outgrows its capacity, and do the copy themselves.
"""

from __future__ import annotations

import math


def grown_capacity(need: int, current: int, growth: float = 2.0, round_tokens: int = 256) -> int:
    """Capacity (tokens) for a regrowth: at least ``need``, ``growth`` times the
    current one, rounded up to ``round_tokens`` (amortised O(1) copy per token)."""
    cap = max(int(need), int(math.ceil(current * growth)))
    return -(-cap // round_tokens) * round_tokens


__all__ = ["grown_capacity"]
