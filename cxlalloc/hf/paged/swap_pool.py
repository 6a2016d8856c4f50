"""The continuous-batching swap pool on cxlalloc's host tier (transformers' own is pinned CPU memory)."""

from __future__ import annotations

from typing import Optional

from cxlalloc.config import format_bytes
from cxlalloc.hf.paged.stats import CBState
from cxlalloc.hf.paged.tf_classes import CachePool

GiB = 1 << 30


def host_swap_pool(cb: CBState, bp, gib: Optional[float]) -> None:
    """Give ``bp.offloading_manager`` a swap pool of ``gib`` GiB on cxlalloc's
    host tier (transformers' own: ``torch.empty(..., pin_memory=True)``).
    ``None`` (transformers: size from free RAM) is the cache's own size."""
    om = bp.offloading_manager
    cache = bp.cache
    if gib is not None and gib <= 0:
        cb.swap_pool = {"enabled": False, "off_reason": "cpu_offload_space=0 (transformers' default): preempted "
                        "requests are reset and re-prefilled"}
        return
    want = cache.num_sectors * cache.bytes_per_sector if gib is None else int(gib * GiB)
    sectors = want // cache.bytes_per_sector
    if sectors == 0:
        cb.swap_pool = {"enabled": False, "off_reason": f"cpu_offload_space={gib} GiB is below one sector "
                        f"({format_bytes(cache.bytes_per_sector)})"}
        return
    alloc = cb.wrap_state.allocator
    nbytes = sectors * cache.bytes_per_sector
    ext = alloc.extent(nbytes, tag="kv")
    # Chunk by chunk, each demoted as soon as it is committed: a committed KV chunk goes to VRAM first (and
    # would push the cache's older chunks out); so at most one of them moves to the host tier, and comes back
    # at the next batch's placement.
    chunk = ext.chunk_bytes
    for end in range(chunk, ext.capacity + chunk, chunk):
        ext.grow(min(end, nbytes))
        try:
            alloc.demote(ext.base + end - chunk, 1)
        except Exception:  # a backend that cannot move chunks (pinned): the pool stays where it was committed
            pass
        if end >= nbytes:
            break
    tensor = ext.tensor()[:nbytes]
    om._swap_extent = ext
    om._num_cpu_sectors = sectors
    om._cpu_tensor = tensor
    om._cpu_pool = CachePool(sectors, len(cache.cache_allocators), num_reserved_sectors=0)
    om._cpu_views = {}
    for name, ca in cache.cache_allocators.items():
        om._cpu_pool.set_blocks_per_sector(ca.index, ca.blocks_per_sector)
        om._cpu_views[name] = tensor.view(-1, ca.bytes_per_block)
    d = h = 0
    for _off, length, tier in ext.tiers():
        d += length if tier == "device" else 0
        h += length if tier == "host" else 0
    cb.swap_pool = {"enabled": True, "tier": "host", "sectors": sectors, "bytes": nbytes,
                    "reserved_bytes": int(ext.capacity), "device_bytes": d, "host_bytes": h,
                    "numa_node": alloc.stats()["host"].get("numa_node")}



__all__ = ["host_swap_pool"]
