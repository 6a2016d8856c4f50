"""``cxlalloc.kv()`` and ``cxlalloc.weights()``: the allocation class of the
allocations a block of code makes on this thread (the policy spills KV first
and demotes weights last)."""

from __future__ import annotations

import contextlib
import warnings

from cxlalloc import _C
from cxlalloc.pytorch import state

_warned_not_enabled = False


def _warn_if_not_enabled(name: str) -> None:
    """Say once per process that a scope has nothing to tag: the class reaches
    cxlalloc only through torch's allocator calls into its C ABI, which exist
    after :func:`cxlalloc.enable` (or ``CXLALLOC=...``) installs an engine."""
    global _warned_not_enabled
    if _warned_not_enabled or state.current is not None or _C.current_engine() is not None:
        return
    _warned_not_enabled = True
    warnings.warn(f"cxlalloc.{name}(): cxlalloc is not enabled in this process, so allocations in this scope are "
                  "torch's own and nothing is tagged or spilled; call cxlalloc.enable() first (or set CXLALLOC=1), "
                  f"or pass tag='{'kv' if name == 'kv' else 'weight'}' to a cxlalloc.Allocator's malloc() "
                  "(said once per process)", state.CxlallocWarning, stacklevel=4)


@contextlib.contextmanager
def _class_scope(cls: str, pools: bool):
    _warn_if_not_enabled("kv" if cls == "kv" else "weights")
    _C.push_class(cls)
    try:
        st = state.current
        if pools and st is not None and st.mode == "scoped":
            import torch

            d = torch.cuda.current_device()
            pool = st.kv_pools.get(d)
            if pool is not None:
                with torch.cuda.use_mem_pool(pool, device=d):
                    yield
                return
        yield
    finally:
        _C.pop_class()


def kv():
    """Context manager: allocations made inside it on this thread are KV cache.

    The policy spills KV first and keeps it in its own segments so it can be
    demoted alone.  In global mode the class is passed with each allocation;
    in scoped mode the allocations also go to cxlalloc's KV ``MemPool`` of the
    current GPU.  Frees may happen anywhere (inside or outside the scope).
    Without :func:`enable` (no engine in the process) nothing is tagged:
    the first such scope warns once (``CxlallocWarning``) and the block runs
    unchanged; a direct :class:`cxlalloc.Allocator` takes the class as
    ``malloc(..., tag="kv")`` instead.
    """
    return _class_scope("kv", pools=True)


def weights():
    """Context manager: allocations made inside it on this thread are model
    weights (kept on the device while there is room, demoted last).  In scoped
    mode weights stay with torch's allocator (only the class is recorded).
    Without :func:`enable` it warns once, as :func:`kv` does."""
    return _class_scope("weight", pools=False)
