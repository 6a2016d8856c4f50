"""Placement of the paged cache's chunks: sizing over the tiers, and per batch the
chunks of the scheduled requests' blocks promoted to VRAM (newest block first), cold ones
demoted (the decision: :func:`cxlalloc.policy.cb_moves.plan_moves`)."""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from cxlalloc.config import format_bytes
from cxlalloc.policy.cb_moves import plan_moves


class PlacementMixin:
    """Sizing and per-batch placement of :class:`~cxlalloc.hf.paged.CxlPagedAttentionCache`
    (uses its ``allocator``, ``extent``, ``chunk``, ``cache_allocators``, ``cb``)."""

    # ------------------------------------------------------------------ sizing
    def _rooms(self) -> Tuple[int, int]:
        """(device bytes KV may still take: the device limit less what is
        reserved, the headroom and ``kv_device_limit``'s rest; host bytes free)."""
        s = self.allocator.stats()
        dev, host = s["device"], s["host"]
        dev_room = int(dev.get("limit_bytes", 0)) - int(dev.get("reserved_bytes", 0)) - self._headroom
        if self._kv_cap:
            dev_room = min(dev_room, self._kv_cap - int(s["kv"]["device_bytes"]))
        host_room = int(host.get("limit_bytes", 0)) - int(host.get("reserved_bytes", 0))
        return max(0, dev_room), max(0, host_room)

    def _plan_sectors(self, asked_blocks: Optional[int]) -> int:
        bps = self.bytes_per_sector
        info = self.allocator.info()
        kv_cap, headroom = info.get("kv_device_limit"), info.get("device_headroom")
        self._kv_cap = kv_cap if isinstance(kv_cap, int) and kv_cap > 0 else 0
        self._headroom = headroom if isinstance(headroom, int) and headroom > 0 else 0
        self.movable = bool(info.get("demotion_supported", True))
        dev_room, host_room = self._rooms()
        chunk = int(info.get("device_granularity") or (2 << 20))
        # Whole chunks on each tier (the extent commits chunk by chunk), the two trash sectors included.
        room = (dev_room // chunk) * chunk + (host_room // chunk) * chunk
        if asked_blocks is not None:
            sectors = max(1, math.ceil(int(asked_blocks) * self.model_block_bytes / bps))
            if (sectors + 2) * bps > room:
                raise ValueError(
                    f"cxlalloc.hf: ContinuousBatchingConfig(num_blocks={asked_blocks}) needs "
                    f"{format_bytes((sectors + 2) * bps)} of KV, but the device tier has {format_bytes(dev_room)} "
                    f"and the host tier {format_bytes(host_room)} free; use num_blocks <= "
                    f"{max(0, room // bps - 2) * bps // self.model_block_bytes}, or raise host_limit in "
                    "cxlalloc.hf.wrap(model, ..., host_limit=...)")
            return sectors
        dev_chunks = (dev_room // chunk) * chunk
        target = min(2 * dev_chunks, dev_chunks + (host_room // chunk) * chunk)
        sectors = target // bps - 2
        if sectors < 1:
            raise ValueError(f"cxlalloc.hf: continuous batching needs at least {format_bytes(3 * bps)} of KV "
                             f"(one sector and two trash sectors); the device tier has {format_bytes(dev_room)} and "
                             f"the host tier {format_bytes(host_room)} free: raise device_limit or host_limit in "
                             "cxlalloc.hf.wrap(model, ...)")
        return sectors

    # ------------------------------------------------------------------ placement
    def tier_bytes(self) -> Tuple[int, int]:
        """(device bytes, host bytes) of this cache's extent."""
        d = h = 0
        for _off, length, tier in self.extent.tiers():
            if tier == "device":
                d += length
            elif tier == "host":
                h += length
        return d, h

    def _chunk_tiers(self) -> Dict[int, str]:
        out = {}
        for off, length, tier in self.extent.tiers():
            for c in range(off // self.chunk, (off + length) // self.chunk):
                out[c] = tier
        return out

    def place(self, states) -> None:
        """Promote the chunks of the scheduled requests' blocks (newest first)
        to VRAM, demoting cold ones to make room (:func:`plan_moves`).  With a
        backend that cannot move chunks (``pinned``) the placement stays as
        committed."""
        if not self.movable:
            self._note_tiers()
            return
        rank: Dict[int, int] = {}
        for ca in self.cache_allocators.values():  # each views the whole tensor in blocks of its own size
            size = ca.bytes_per_block
            for state in states:
                table = ca.block_table.get(state.request_id, [])
                n = len(table)
                for i, b in enumerate(table):
                    start = b * size  # block ids count from the tensor's start (trash sectors included)
                    r = n - 1 - i  # 0: the request's newest block
                    for c in range(start // self.chunk, (start + size - 1) // self.chunk + 1):
                        if r < rank.get(c, 1 << 62):
                            rank[c] = r
        tiers = self._chunk_tiers()
        on_device = [c for c, t in tiers.items() if t == "device"]
        free_chunks = self._rooms()[0] // self.chunk
        demote, promote = plan_moves(rank, on_device, len(on_device) + free_chunks)
        moved_down = moved_up = 0
        failures = 0
        base = self.extent.base
        for c in demote:
            try:
                moved_down += self.allocator.demote(base + c * self.chunk, self.chunk)
            except Exception:
                failures += 1
        for c in promote:
            try:
                moved_up += self.allocator.promote(base + c * self.chunk, self.chunk)
            except Exception:  # no room after all (another allocation took it): keep it where it is
                failures += 1
                break
        with self.cb.lock:
            k = self.cb.counters
            k.promoted_bytes += moved_up
            k.demoted_bytes += moved_down
            k.placement_failures += failures
        self._note_tiers()

    def _note_tiers(self) -> None:
        desc = self.describe()
        with self.cb.lock:
            k = self.cb.counters
            k.peak_kv_device_bytes = max(k.peak_kv_device_bytes, desc["kv_device_bytes"])
            k.peak_kv_host_bytes = max(k.peak_kv_host_bytes, desc["kv_host_bytes"])
            self.cb.last_cache = desc


__all__ = ["PlacementMixin"]
