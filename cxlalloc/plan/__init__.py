"""Right-sizing: how many GPUs, and how much host/CXL memory, a model needs at
a context length and concurrency (``cxlalloc plan``; docs/planning.md).

Imports no torch: a ``config.json`` is read as JSON.
"""

from cxlalloc.plan.layout import Layout, cache_bytes, kv_bytes_per_token, read_layout
from cxlalloc.plan.planner import PlanInputs, plan

__all__ = ["Layout", "PlanInputs", "cache_bytes", "kv_bytes_per_token", "plan", "read_layout"]
