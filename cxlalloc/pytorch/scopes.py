"""``cxlalloc.kv()`` and ``cxlalloc.weights()``: the allocation class of the
allocations a block of code makes on this thread (the policy spills KV first
and demotes weights last)."""

from __future__ import annotations

import contextlib

from cxlalloc import _C
from cxlalloc.pytorch import state


@contextlib.contextmanager
def _class_scope(cls: str, pools: bool):
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
    Without :func:`enable` it only tags allocations of a direct
    :class:`cxlalloc.Allocator` that ask for the scope's class.
    """
    return _class_scope("kv", pools=True)


def weights():
    """Context manager: allocations made inside it on this thread are model
    weights (kept on the device while there is room, demoted last).  In scoped
    mode weights stay with torch's allocator (only the class is recorded)."""
    return _class_scope("weight", pools=False)
