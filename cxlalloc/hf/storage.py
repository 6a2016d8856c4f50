"""Token-major KV storage in one cxlalloc extent (the memory behind :class:`CxlKVLayer`).

Layout
------
A :class:`KVStorage` holds ``n_slots`` cache layers ("slots") that share a batch size,
head count, head dims, dtype and device.  Its extent is a 2-D array of elements of
``dtype``::

    storage[token, row]         shape (capacity_tokens, row_elems)
    row = [K_0 (B, H, Dk) | V_0 (B, H, Dv) | K_1 (B, H, Dk) | V_1 (B, H, Dv) | ...]

so layer ``s``'s keys are the strided view ``(capacity_tokens, B, H, Dk)`` at element
offset ``s * slot_elems``, handed to attention as ``(B, H, L, Dk)`` (the
``[:L].permute(1, 2, 0, 3)`` view of a token-major buffer; last-dim stride 1, as
every SDPA backend requires).

Why token-major and one extent for all layers: a range of tokens is one contiguous
byte range, so cxlalloc's KV policy can keep the newest tokens' chunks in VRAM and
demote the oldest tokens' chunks to the host tier while attention still reads one
contiguous virtual view; growth commits new chunks at a fixed address
(:meth:`cxlalloc.Extent.grow`) and never copies the cache.  Sharing one extent across
layers makes the tiering granularity ``chunk_bytes / row_bytes`` tokens (for
SmolLM2-135M in fp32 at batch 1, 2 MiB / 45 KiB = 45 tokens) instead of one chunk per
layer per K/V (2 MiB = 2,730 tokens of one SmolLM2 layer), and commits one chunk per
step at most instead of ``2 * n_layers``.

Nothing here knows transformers; :mod:`cxlalloc.hf.layers` builds the layers on it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch

# Largest temporary (bytes) used by a batch gather (beam reorder): the gather runs in
# token blocks so its transient stays bounded whatever the context length.
GATHER_BLOCK_BYTES = 32 << 20


@dataclasses.dataclass
class KVCounters:
    """Counters of one :class:`cxlalloc.hf.CxlCache` (bytes, counts).

    Attributes:
        steps: forward passes seen (prefill = step 0, then one per decode step).
        bytes_copied: every byte written into KV storage: the new tokens' K/V
            (``bytes_copied_new``) plus copies of tokens already cached
            (``bytes_copied_existing``: capacity regrowth, beam reorders,
            batch repeat/select, deepcopy).
        step_bytes_copied: ``bytes_copied`` per forward pass, in order (index 0
            is the prefill).  transformers' ``DynamicLayer`` copies the whole
            cache every step (``torch.cat``); here a greedy/sampling decode step
            copies only the new token's K/V, a constant.
        step_context_tokens: live tokens after each forward pass (same order).
        regrowths: capacity exceeded and storage re-created larger (copy).
        trims_deferred: crops/resets whose chunk release waited because a
            tensor handed out earlier (a K/V view) still pointed into the
            chunks (released at a later step once no such tensor is alive).
        reorders / reorder_rows: beam reorders applied / batch rows moved.
        demoted_bytes / demotions: bytes and moves the allocator demoted to the
            host tier while this cache lived (its counters' delta: with several
            caches or other KV on one allocator, theirs are included).
    """

    steps: int = 0
    bytes_copied: int = 0
    bytes_copied_new: int = 0
    bytes_copied_existing: int = 0
    step_bytes_copied: List[int] = dataclasses.field(default_factory=list)
    step_context_tokens: List[int] = dataclasses.field(default_factory=list)
    regrowths: int = 0
    trims_deferred: int = 0
    reorders: int = 0
    reorder_rows: int = 0
    demoted_bytes: int = 0
    demotions: int = 0

    def add_new(self, nbytes: int) -> None:
        self.bytes_copied_new += nbytes
        self._add(nbytes)

    def add_existing(self, nbytes: int) -> None:
        self.bytes_copied_existing += nbytes
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self.bytes_copied += nbytes
        if self.step_bytes_copied:
            self.step_bytes_copied[-1] += nbytes

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Shape of one slot: batch ``B``, KV heads ``H``, key/value head dims, dtype, device."""

    batch: int
    heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(key_states: torch.Tensor, value_states: torch.Tensor) -> "Geometry":
        b, h, _, dk = key_states.shape
        bv, hv, _, dv = value_states.shape
        if (b, h) != (bv, hv) or key_states.dtype != value_states.dtype:
            raise ValueError(f"cxlalloc.hf: key states {tuple(key_states.shape)} {key_states.dtype} and value states "
                             f"{tuple(value_states.shape)} {value_states.dtype} disagree on batch/heads/dtype")
        return Geometry(b, h, dk, dv, key_states.dtype, key_states.device)

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def slot_elems(self) -> int:
        return self.batch * self.heads * (self.k_dim + self.v_dim)


class KVStorage:
    """KV storage of ``n_slots`` layers in one cxlalloc extent (class ``kv``).

    Args:
        allocator: a :class:`cxlalloc.Allocator` (its device must be the tensors' device).
        geometry: the slots' :class:`Geometry`.
        n_slots: number of layers stored.
        capacity_tokens: tokens reserved (address space only; memory is committed
            as tokens are written).
        counters: the owning cache's :class:`KVCounters`.

    Raises:
        cxlalloc.OutOfMemoryError: the capacity exceeds both tiers together.
    """

    def __init__(self, allocator, geometry: Geometry, n_slots: int, capacity_tokens: int, counters: KVCounters):
        self.allocator = allocator
        self.g = geometry
        self.n_slots = int(n_slots)
        self.counters = counters
        self.row_elems = self.n_slots * geometry.slot_elems
        self.row_bytes = self.row_elems * geometry.elem
        self.live_tokens = 0  # max live length over the slots (rows that hold data)
        self._pending: Optional[torch.Tensor] = None  # beam reorder not yet applied
        self._open(max(1, int(capacity_tokens)))

    # ------------------------------------------------------------------ storage
    def _open(self, capacity_tokens: int) -> None:
        self.extent = self.allocator.extent(capacity_tokens * self.row_bytes, tag="kv")
        self.capacity_tokens = self.extent.capacity // self.row_bytes  # the extent rounds up to whole chunks
        self._backed_bytes = 0
        self._trim_to: Optional[int] = None  # a trim that waits for outstanding views
        self._take_view()

    def _take_view(self) -> None:
        """(Re-)take ``flat``, the view of the committed prefix (the engine's views
        cover committed memory only, so it is re-taken after every grow and trim),
        and count its storage's own references (see :meth:`views_outstanding`)."""
        self.flat = self.extent.tensor(self.g.dtype)
        self._own_refs = _storage_refs(self.flat)

    def views_outstanding(self) -> bool:
        """True while a tensor other than this store's own points into its memory
        (a K/V view handed to attention or to the caller)."""
        n = _storage_refs(self.flat)
        return n is None or n > self._own_refs

    def ensure(self, tokens: int) -> None:
        """Commit memory for rows ``[0, tokens)`` (no copy; raises if beyond capacity).

        Raises:
            ValueError: ``tokens`` exceeds ``capacity_tokens`` (use :meth:`regrow`).
            cxlalloc.OutOfMemoryError: neither tier has room for a new chunk.
        """
        need = tokens * self.row_bytes
        if need > self._backed_bytes:
            if tokens > self.capacity_tokens:
                raise ValueError(f"cxlalloc.hf: {tokens} tokens exceed the store's capacity of "
                                 f"{self.capacity_tokens} tokens")
            self.extent.grow(need)
            chunk = self.extent.chunk_bytes
            self._backed_bytes = min(self.extent.capacity, -(-need // chunk) * chunk)
            self._take_view()  # a view covers committed memory only

    def regrow(self, capacity_tokens: int) -> None:
        """Re-create the storage with a larger capacity, copying the live rows
        (one contiguous copy of ``live_tokens * row_bytes`` bytes; counted as
        ``bytes_copied_existing`` and ``regrowths``)."""
        self.apply_pending()
        old_flat, n = self.flat, self.live_tokens
        self._open(capacity_tokens)
        if n:
            self.ensure(n)
            self.flat[: n * self.row_elems].copy_(old_flat[: n * self.row_elems])
            self.counters.add_existing(n * self.row_bytes)
        self.counters.regrowths += 1

    def trim(self, tokens: int) -> None:
        """Release committed chunks wholly beyond row ``tokens`` (crop/reset).

        While a tensor handed out earlier still points into this storage (a
        view kept by the caller or by attention), releasing chunks would leave
        it reading unmapped memory (a crash on a GPU and in the simulator), so
        the release is deferred (``trims_deferred``) and retried by
        :meth:`retry_trim` at the next step; the rows stay committed meanwhile.
        """
        self.live_tokens = min(self.live_tokens, tokens)
        keep = int(tokens) * self.row_bytes
        if keep >= self._backed_bytes:
            return
        if self.views_outstanding():
            if self._trim_to is None:
                self.counters.trims_deferred += 1
            self._trim_to = int(tokens) if self._trim_to is None else min(self._trim_to, int(tokens))
            return
        self._trim_to = None
        self.flat = None  # the engine keeps chunks under a live view committed: drop our own view first
        self.extent.trim(keep)
        self._take_view()
        chunk = self.extent.chunk_bytes
        self._backed_bytes = -(-keep // chunk) * chunk

    def retry_trim(self) -> None:
        """Carry out a deferred :meth:`trim` (rows written since are kept)."""
        if self._trim_to is not None and not self.views_outstanding():
            tokens, self._trim_to = max(self._trim_to, self.live_tokens), None
            self.trim(tokens)

    def tier_bytes(self) -> dict:
        """``{"device": bytes, "host": bytes}`` committed by this store's extent."""
        out = {"device": 0, "host": 0}
        for _, length, tier in self.extent.tiers():
            if tier in out:
                out[tier] += length
        return out

    def touch(self) -> None:
        self.extent.touch()

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Token rows ``[start, stop)`` as one contiguous ``(stop-start, row_elems)``
        view: for a batch-1 store this is the byte format of a stored KV block
        (:mod:`cxlalloc.kvstore.layout`)."""
        return self.flat[start * self.row_elems:stop * self.row_elems].view(stop - start, self.row_elems)

    # ------------------------------------------------------------------ views
    def _base(self) -> int:
        return self.flat.storage_offset()

    def key_view(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Keys of ``slot`` for tokens ``[start, stop)``: ``(B, H, stop-start, Dk)``, strided."""
        g = self.g
        off = self._base() + slot * g.slot_elems + start * self.row_elems
        return self.flat.as_strided((g.batch, g.heads, stop - start, g.k_dim),
                                    (g.heads * g.k_dim, g.k_dim, self.row_elems, 1), off)

    def value_view(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Values of ``slot`` for tokens ``[start, stop)``: ``(B, H, stop-start, Dv)``, strided."""
        g = self.g
        off = self._base() + slot * g.slot_elems + g.batch * g.heads * g.k_dim + start * self.row_elems
        return self.flat.as_strided((g.batch, g.heads, stop - start, g.v_dim),
                                    (g.heads * g.v_dim, g.v_dim, self.row_elems, 1), off)

    def write(self, slot: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write ``q`` new tokens of ``slot`` at ``[start, start+q)`` in place (rows must be committed)."""
        q = key_states.shape[-2]
        self.key_view(slot, start, start + q).copy_(key_states)
        self.value_view(slot, start, start + q).copy_(value_states)
        self.counters.add_new(q * self.g.batch * self.g.heads * (self.g.k_dim + self.g.v_dim) * self.g.elem)
        self.live_tokens = max(self.live_tokens, start + q)

    # ------------------------------------------------------------------ batch ops
    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Record a beam reorder ``new[b] = old[beam_idx[b]]`` for every slot
        (``beam_idx``: 1-D long tensor of ``batch`` rows in ``[0, batch)``).

        Applied lazily (composed with earlier pending reorders) at the next
        :meth:`apply_pending`: generate() reorders after its last step too, and
        that gather is skipped if the cache is not used again.
        """
        idx = beam_idx.to(device=self.g.device, dtype=torch.long)
        self._pending = idx if self._pending is None else self._pending.index_select(0, idx)

    def apply_pending(self) -> None:
        """Apply a pending beam reorder in place: only rows whose source differs
        are written, in token blocks of at most ``GATHER_BLOCK_BYTES`` of temporary."""
        idx, self._pending = self._pending, None
        if idx is None or self.live_tokens == 0:
            return
        g = self.g
        if idx.numel() != g.batch:
            raise ValueError(f"cxlalloc.hf: beam index of {idx.numel()} rows for a cache of batch {g.batch}")
        ar = torch.arange(g.batch, device=idx.device)
        dst = (idx != ar).nonzero().flatten()
        if dst.numel() == 0:
            return
        src = idx.index_select(0, dst)
        n = self.live_tokens
        base = self._base()
        parts = [(base, g.heads * g.k_dim), (base + g.batch * g.heads * g.k_dim, g.heads * g.v_dim)]
        moved_row_bytes = dst.numel() * self.n_slots * g.heads * (g.k_dim + g.v_dim) * g.elem
        block = max(1, GATHER_BLOCK_BYTES // max(1, moved_row_bytes))
        for off, width in parts:
            # (tokens, slots, B, H*D) view of this part of every slot
            full = self.flat.as_strided((n, self.n_slots, g.batch, width),
                                        (self.row_elems, g.slot_elems, width, 1), off)
            for t0 in range(0, n, block):
                blk = full[t0:t0 + block]
                blk.index_copy_(2, dst, blk.index_select(2, src))
        self.counters.add_existing(n * moved_row_bytes)
        self.counters.reorders += 1
        self.counters.reorder_rows += int(dst.numel())

    def rebuilt(self, batch: int, transform: Callable[[torch.Tensor], torch.Tensor],
                slots: Optional[List[int]] = None) -> "KVStorage":
        """A new store with batch ``batch`` holding ``transform(view)`` of each
        slot's live tokens (repeat_interleave / select on dim 0); same capacity.
        ``slots``: the slots to carry (default all, same slot numbers)."""
        self.apply_pending()
        slots = list(range(self.n_slots)) if slots is None else slots
        new = KVStorage(self.allocator, dataclasses.replace(self.g, batch=int(batch)), len(slots),
                      self.capacity_tokens, self.counters)
        n = self.live_tokens
        if n:
            new.ensure(n)
            for i, s in enumerate(slots):
                new.key_view(i, 0, n).copy_(transform(self.key_view(s, 0, n)))
                new.value_view(i, 0, n).copy_(transform(self.value_view(s, 0, n)))
            new.live_tokens = n
            self.counters.add_existing(n * new.row_bytes)
        return new

    def clone(self, counters: KVCounters) -> "KVStorage":
        """A copy through the same allocator: same capacity (address space only),
        the live rows copied (one contiguous copy)."""
        self.apply_pending()
        new = KVStorage(self.allocator, self.g, self.n_slots, self.capacity_tokens, counters)
        n = self.live_tokens
        if n:
            new.ensure(n)
            new.flat[: n * self.row_elems].copy_(self.flat[: n * self.row_elems])
            new.live_tokens = n
            counters.add_existing(n * self.row_bytes)
        return new


def _storage_refs(t: torch.Tensor) -> Optional[int]:
    """How many tensors share ``t``'s storage (each view holds one reference;
    the temporary storage object made here adds one, the same every call), or
    None if torch cannot say.  torch has no public call for it;
    ``torch._C._storage_Use_Count`` exists since torch 2.1.  Without it every
    store counts as viewed, so a crop releases no chunk before the store is
    dropped (memory kept, never a read of released memory)."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    return None if fn is None else int(fn(t.untyped_storage()._cdata))
