"""``bench --only kvscale``: the kv-server's costs at 10^4, 10^5 and 10^6 stored
blocks (lookup latency, the stall a disconnect causes to other clients, index
bytes per block).  The benchmark lives with the other kv-server figures, in
:mod:`cxlalloc_apps.bench.kvserver` (``part_scale``); this module names it for
``--only``."""

from cxlalloc_apps.bench.kvserver import run_scale as run

__all__ = ["run"]
