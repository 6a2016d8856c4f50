"""Garbage collection until nothing is left to collect, before a test checks or
reconfigures the simulated driver.

One ``gc.collect()`` is not always enough: a model wrapped by cxlalloc that ran
continuous batching (``generate_batch``) is freed only by a second pass (the
first frees objects whose release drops the last reference into the model's
cycle), and until then its allocators hold simulated memory, so the simulator
refuses to be reconfigured ("simulated resources are still live")."""

import gc


def collect_all(passes: int = 5) -> int:
    """Run ``gc.collect()`` until a pass finds nothing (at most ``passes``
    passes); returns the objects collected in all."""
    total = 0
    for _ in range(passes):
        n = gc.collect()
        total += n
        if n == 0:
            break
    return total
