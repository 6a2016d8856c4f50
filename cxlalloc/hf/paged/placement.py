"""Placement of the paged cache's chunks: sizing over the tiers, and per batch the
chunks of the scheduled requests' blocks promoted to VRAM (newest block first), cold ones
demoted (the decision: :func:`cxlalloc.policy.cb_moves.plan_moves`)."""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from cxlalloc.config import format_bytes
from cxlalloc.hf.paged.tf_classes import CachePool
from cxlalloc.policy.cb_moves import plan_moves


class PlacementMixin:
    """Sizing and per-batch placement of :class:`~cxlalloc.hf.paged.CxlPagedAttentionCache`
    (uses its ``allocator``, ``extent``, ``chunk``, ``cache_allocators``, ``cb``)."""

    # ------------------------------------------------------------------ sizing
    def grow_to(self, sectors: int) -> None:
        """Commit memory for the first ``sectors`` sectors (and the two trash
        sectors before them), rounded up to whole chunks, in every GPU's extent
        (one on one GPU), zero the new bytes and point transformers' allocators
        at the longer tensor (same address, so block ids, tables and stored
        views of committed bytes stay valid).

        Raises:
            cxlalloc.OutOfMemoryError: neither tier (of a GPU) has room for the
                new chunks (the engine's message names the limits and where to
                raise them).
        """
        if sectors <= self.committed_sectors:
            return
        want = min(self.num_sectors, max(sectors, 0))
        usable = self.num_sectors
        for part in self.parts:
            bps = part.bytes_per_sector
            nbytes = min(part.extent.capacity, -(-(want + 2) * bps // part.chunk) * part.chunk)
            part.extent.grow(nbytes)
            usable = min(usable, nbytes // bps - 2)
        for part in self.parts:
            tensor = part.extent.tensor()[:(usable + 2) * part.bytes_per_sector]
            # the read-trash sector must read zeros (padding tokens), and a block's unwritten slots are read under
            # a mask (0 x NaN is NaN): new bytes are zeroed, as the stock cache is torch.zeros (from the last byte
            # zeroed, not the last committed: a chunk's bytes past the usable sectors are zeroed when they are used)
            tensor[min(part.zeroed, tensor.numel()):].zero_()
            part.zeroed = max(part.zeroed, tensor.numel())
            part.tensor = tensor
        bps = self.bytes_per_sector
        first = self.committed_sectors < 0
        if self.striped:
            # transformers' bookkeeping over the full layout (a meta tensor: no memory), then its views pointed at
            # the GPUs' extents (gpu_parts)
            tensor = torch.empty((usable + 2) * bps, dtype=torch.uint8, device="meta")
            self.cache_tensor = None
        else:
            tensor = self.parts[0].tensor
            self.cache_tensor = tensor
        for ca in self.cache_allocators.values():
            # register_cache_tensor resets its pool's free-block trees: after the first time, hand it a scratch
            # pool and give it ours back
            ca.register_cache_tensor(bps, usable * bps, tensor,
                                     self.pool if first else CachePool(1, len(self.cache_allocators)))
            ca.pool = self.pool
            if self.striped:
                self._install_views(ca)
        self.committed_sectors = usable
        self.cb.note_commit(sum(int(p.extent.committed) for p in self.parts))

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """transformers' check-and-allocate, after committing the sectors it
        would hand out; when neither tier has room for them, the sectors past
        the committed ones leave the pool (said once), so the request waits or
        is preempted as in a full cache instead of failing mid-generation."""
        if not dry_run:
            need = sum(ca.needs_new_sectors(state.request_id, state.current_len(), request_len)
                       for ca in self.cache_allocators.values())
            free = sorted(self.pool.free_sectors)
            if 0 < need <= len(free) and free[need - 1] - 1 > self.committed_sectors:
                self._commit_or_cap(free[need - 1] - 1)
        return super().can_store_request_tokens(state, request_len, dry_run)

    def _commit_or_cap(self, sectors: int) -> None:
        from cxlalloc import OutOfMemoryError

        try:
            self.grow_to(sectors)
        except OutOfMemoryError as e:
            self.pool.free_sectors = [x for x in self.pool.free_sectors if x - 1 <= self.committed_sectors]
            with self.cb.lock:
                self.cb.counters.commit_refusals += 1
            d, h = self.tier_bytes()
            self.cb.warn_once("commit", f"cxlalloc.hf: continuous batching's paged cache stopped growing at "
                              f"{self.committed_sectors} of {self.num_sectors} sectors ({format_bytes(d)} in VRAM, "
                              f"{format_bytes(h)} on the host tier): {' '.join(str(e).split())}; requests now wait "
                              "or are preempted as in a full cache", stacklevel=5)

    def _rooms(self, part=None) -> Tuple[int, int]:
        """(device bytes KV may still take: the device limit less what is
        reserved, the headroom and ``kv_device_limit``'s rest; host bytes free)
        of ``part``'s GPU (default: the first)."""
        part = part or self.parts[0]
        s = part.allocator.stats()
        dev, host = s["device"], s["host"]
        dev_room = int(dev.get("limit_bytes", 0)) - int(dev.get("reserved_bytes", 0)) - part.headroom
        if part.kv_cap is not None:  # kv_device_limit set (0 included: no KV in VRAM)
            dev_room = min(dev_room, part.kv_cap - int(s["kv"]["device_bytes"]))
        host_room = int(host.get("limit_bytes", 0)) - int(host.get("reserved_bytes", 0))
        return max(0, dev_room), max(0, host_room)

    def _plan_sectors(self, asked_blocks: Optional[int]) -> int:
        """The sectors of the cache: the fewest any GPU's tiers allow (one GPU: its own)."""
        sectors = [self._plan_part(part, asked_blocks) for part in self.parts]
        self.movable = all(part.movable for part in self.parts)
        return min(sectors)

    def _plan_part(self, part, asked_blocks: Optional[int]) -> int:
        bps = part.bytes_per_sector
        block_bytes = part.block_bytes
        info = part.allocator.info()
        kv_cap, headroom = info.get("kv_device_limit"), info.get("device_headroom")
        part.kv_cap = kv_cap if isinstance(kv_cap, int) and not isinstance(kv_cap, bool) and kv_cap >= 0 else None
        part.headroom = headroom if isinstance(headroom, int) and headroom > 0 else 0
        part.movable = bool(info.get("demotion_supported", True))
        dev_room, host_room = self._rooms(part)
        where = f"GPU {part.name}: " if self.striped else ""
        chunk = int(info.get("device_granularity") or (2 << 20))
        # Whole chunks on each tier (the extent commits chunk by chunk), the two trash sectors included.
        room = (dev_room // chunk) * chunk + (host_room // chunk) * chunk
        if asked_blocks is not None:
            sectors = max(1, math.ceil(int(asked_blocks) * block_bytes / bps))
            if (sectors + 2) * bps > room:
                raise ValueError(
                    f"cxlalloc.hf: {where}ContinuousBatchingConfig(num_blocks={asked_blocks}) needs "
                    f"{format_bytes((sectors + 2) * bps)} of KV, but the device tier has {format_bytes(dev_room)} "
                    f"and the host tier {format_bytes(host_room)} free; use num_blocks <= "
                    f"{max(0, room // bps - 2) * bps // block_bytes}, or raise host_limit in "
                    "cxlalloc.hf.wrap(model, ..., host_limit=...)")
            return sectors
        # Default capacity (a ceiling: memory is committed as sectors are used): the device tier's whole chunks for
        # KV and as much again on the host tier, at most its room; on the host tier at least the blocks of one
        # batch's tokens (max_batch_tokens, at least 4 blocks) and the two trash sectors, in whole chunks, so that
        # with no VRAM left for KV (weights filling device_limit) the paged cache lives on the host tier, as
        # generate()'s cache spills there, instead of refusing.
        dev_chunks = (dev_room // chunk) * chunk
        host_chunks = (host_room // chunk) * chunk
        page = max(1, int(getattr(self, "page_size", 0) or next(iter(self.cache_allocators.values())).tokens_per_page))
        floor_blocks = max(4, -(-int(self.max_batch_tokens) // page))
        floor = -(-(math.ceil(floor_blocks * block_bytes / bps) + 2) * bps // chunk) * chunk
        target = dev_chunks + min(max(dev_chunks, chunk, floor), host_chunks)
        sectors = target // bps - 2
        if sectors < 1:
            short = [f"the device tier has {format_bytes(dev_room)} for KV (device_limit less what is reserved"
                     + (", the headroom" if part.headroom else "") + (", kv_device_limit" if part.kv_cap is not None else "")
                     + ")", f"the host tier {format_bytes(host_room)} free of host_limit"]
            raise ValueError(f"cxlalloc.hf: {where}continuous batching needs at least {format_bytes(3 * bps)} of KV "
                             f"(one sector and two trash sectors) in whole {format_bytes(chunk)} chunks; "
                             f"{' and '.join(short)}: raise host_limit (or device_limit) in "
                             "cxlalloc.hf.wrap(model, ..., host_limit=...)")
        return sectors

    # ------------------------------------------------------------------ placement
    def tier_bytes(self) -> Tuple[int, int]:
        """(device bytes, host bytes) of this cache's extents (every GPU's)."""
        d = h = 0
        for part in self.parts:
            pd, ph = self.part_tier_bytes(part)
            d, h = d + pd, h + ph
        return d, h

    @staticmethod
    def part_tier_bytes(part) -> Tuple[int, int]:
        """(device bytes, host bytes) of one GPU's extent."""
        d = h = 0
        for _off, length, tier in part.extent.tiers():
            if tier == "device":
                d += length
            elif tier == "host":
                h += length
        return d, h

    @staticmethod
    def _chunk_tiers(part) -> Dict[int, str]:
        out = {}
        for off, length, tier in part.extent.tiers():
            for c in range(off // part.chunk, (off + length) // part.chunk):
                out[c] = tier
        return out

    def place(self, states) -> None:
        """Promote the chunks of the scheduled requests' blocks (newest first)
        to VRAM, demoting cold ones to make room (:func:`plan_moves`), on every
        GPU's extent within that GPU's budget.  With a backend that cannot move
        chunks (``pinned``) the placement stays as committed."""
        self._local.clear()  # a new batch: new index tensors
        if not self.movable:
            self._note_tiers()
            return
        moved_down = moved_up = failures = 0
        for part in self.parts:
            down, up, fail = self._place_part(part, states)
            moved_down, moved_up, failures = moved_down + down, moved_up + up, failures + fail
        with self.cb.lock:
            k = self.cb.counters
            k.promoted_bytes += moved_up
            k.demoted_bytes += moved_down
            k.placement_failures += failures
        self._note_tiers()

    def _place_part(self, part, states) -> Tuple[int, int, int]:
        tiers = self._chunk_tiers(part)
        if "host" not in tiers.values():
            # Nothing spilled: every committed chunk (and so every block of a scheduled request) is in VRAM, and
            # plan_moves would return no move; skip ranking every block of the batch (profiled: about 2/3 of this
            # method's per-step cost, issue 33).
            return 0, 0, 0
        rank = self._chunk_ranks(part, states)
        chunk = part.chunk
        on_device = [c for c, t in tiers.items() if t == "device"]
        free_chunks = self._rooms(part)[0] // chunk
        demote, promote = plan_moves(rank, on_device, len(on_device) + free_chunks)
        moved_down = moved_up = failures = 0
        base = part.extent.base
        for c in demote:
            try:
                moved_down += part.allocator.demote(base + c * chunk, chunk)
            except Exception:
                failures += 1
        for c in promote:
            try:
                moved_up += part.allocator.promote(base + c * chunk, chunk)
            except Exception:  # no room after all (another allocation took it): keep it where it is
                failures += 1
                break
        return moved_down, moved_up, failures

    def _chunk_ranks(self, part, states) -> Dict[int, int]:
        """``{chunk: rank}`` of the chunks holding the scheduled requests' blocks: the lowest ``n - 1 - i`` over
        the blocks ``i`` of a request's table of ``n`` blocks that touch the chunk (0: some request's newest
        block).  When blocks tile chunks (a chunk is a whole number of blocks: a block never straddles two), one
        dict comprehension per request keeps each chunk's newest block (about 4x fewer Python steps than the
        per-block loop, which cost about 4 % of a serving step with 4K-token prompts, profiled 2026-12-03)."""
        chunk = part.chunk
        rank: Dict[int, int] = {}
        for ca in self.cache_allocators.values():  # each views the whole tensor in blocks of its own size
            size = part.block_bytes if self.striped else ca.bytes_per_block
            tiled = size <= chunk and chunk % size == 0
            per = chunk // size if tiled else 0
            for state in states:
                table = ca.block_table.get(state.request_id)
                if not table:
                    continue
                n = len(table)
                if tiled:  # block ids count from the tensor's start (trash sectors included)
                    newest = {b // per: i for i, b in enumerate(table)}  # a later (newer) block overwrites
                    for c, i in newest.items():
                        r = n - 1 - i  # 0: the request's newest block
                        if r < rank.get(c, 1 << 62):
                            rank[c] = r
                    continue
                for i, b in enumerate(table):
                    start = b * size
                    r = n - 1 - i
                    for c in range(start // chunk, (start + size - 1) // chunk + 1):
                        if r < rank.get(c, 1 << 62):
                            rank[c] = r
        return rank

    def _note_tiers(self) -> None:
        desc = self.describe()
        with self.cb.lock:
            k = self.cb.counters
            k.peak_kv_device_bytes = max(k.peak_kv_device_bytes, desc["kv_device_bytes"])
            k.peak_kv_host_bytes = max(k.peak_kv_host_bytes, desc["kv_host_bytes"])
            for gpu, g in (desc.get("gpus") or {}).items():
                peak = k.per_gpu.setdefault(gpu, {"peak_kv_device_bytes": 0, "peak_kv_host_bytes": 0})
                peak["peak_kv_device_bytes"] = max(peak["peak_kv_device_bytes"], g["kv_device_bytes"])
                peak["peak_kv_host_bytes"] = max(peak["peak_kv_host_bytes"], g["kv_host_bytes"])
            self.cb.last_cache = desc


__all__ = ["PlacementMixin"]
