"""One home for KV store I/O: load a run of stored blocks into KV rows, store KV rows as blocks.

Both users of a :class:`cxlalloc.kvstore.store.BlockStore` go through here:
``generate()``'s prefix reuse (:mod:`cxlalloc.hf.reuse`, rows of a :class:`~cxlalloc.hf.CxlCache`)
and continuous batching's paged cache (:mod:`cxlalloc.hf.paged`, blocks of the paged tensor).
They differ only in where the rows live, which they say with a copy function; the sequences are
the same:

* **load**: look up the keys, check each block's size and (``kv_store_verify``) checksum from the
  first block the caller lacks — on a private copy of the block, the bytes then copied into the KV rows, so
  a writer changing the pool between the check and the copy cannot slip bytes past it — stop at the first
  corrupt one; copy the good blocks in (timed,
  synchronised with the device); close the lease; drop the corrupt blocks (so this caller's
  store step writes them again, recomputed); record the load in the store's counters.
* **store**: reserve the keys; copy each reserved block out of the KV rows; synchronise; seal
  (the checksum trailer over the bytes that landed — for a store whose pool other processes map
  read-write, over a private copy, then copied into the pool whole); commit; abort what was not committed;
  record the store.

Nothing here knows transformers or the cache classes.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from cxlalloc.kvstore.layout import BlockLayout
from cxlalloc.kvstore.store import BlockLease, BlockStore


def sync(device) -> None:
    """Wait for the copies queued on ``device``'s current stream (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def discard(store: BlockStore, ns: str, keys: Sequence[bytes]) -> None:
    """Ask ``store`` to drop ``keys`` of namespace ``ns`` (best effort: a
    store that cannot, or fails to, keeps them; the caller's answer is right
    either way)."""
    try:
        store.discard(ns, keys)
    except Exception:  # dropping is best effort: the answer is already right
        pass


class BlockReader:
    """The load sequence, as a context manager (leaving it closes every lease
    and drops the corrupt blocks found).

    Args:
        store: the block store.
        ns: the namespace (``cache_salt`` or ``""``).
        layout: the stored block format (:class:`~cxlalloc.kvstore.layout.BlockLayout`).
        verify: check each block's checksum (``kv_store_verify``).
        on_corrupt: called as ``on_corrupt(ns, keys)`` with the keys whose
            checksum failed, after the leases are closed.
    """

    def __init__(self, store: BlockStore, ns: str, layout: BlockLayout, verify: bool,
                 on_corrupt: Callable[[str, List[bytes]], None]):
        self.store, self.ns, self.layout, self.verify = store, ns, layout, verify
        self.on_corrupt = on_corrupt
        self.leases: List[BlockLease] = []
        self.corrupt: List[bytes] = []
        self.seconds = 0.0

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc) -> None:
        for lease in self.leases:
            lease.close()
        if self.corrupt:
            self.on_corrupt(self.ns, self.corrupt)

    def lookup(self, keys: Sequence[bytes], first: int = 0, strict: bool = True) -> Tuple[BlockLease, Optional[int]]:
        """Look ``keys`` up; returns ``(lease, good)``: ``good`` leading blocks
        are usable (checked from block ``first`` on; the first corrupt one
        ends the run and is dropped on exit).  A block whose size is not
        ``layout.stored_bytes`` (another format under the same key) raises
        with ``strict``, else gives ``good = None`` (use nothing).

        Raises:
            ValueError: ``strict`` and a stored block's size is not the layout's.
        """
        lease = self.store.lookup(self.ns, keys)
        self.leases.append(lease)
        good = lease.blocks
        for j in range(first, lease.blocks):
            v = lease.views[j]
            if v.numel() != self.layout.stored_bytes:
                if not strict:
                    return lease, None
                raise ValueError(f"a stored block of {v.numel()} bytes, expected {self.layout.stored_bytes}")
            if self.verify:
                # Verify the bytes that will be copied, not the pool: another client mapping the pool could change
                # them between a check in place and the copy (issue 29 item 6).  One copy into private memory,
                # checked there; the KV rows are filled from that copy.
                v = v.clone()
                if not self.layout.verify(v, keys[j]):
                    # A bit flipped in the pool (another client's bug, a bad DIMM) or bytes under the wrong key:
                    # use the blocks before it, drop it, recompute from there.
                    self.corrupt.append(keys[j])
                    good = j
                    break
                lease.views[j] = v
        return lease, good

    def copy(self, copy_in: Callable[[], Tuple[int, object]]) -> int:
        """Run ``copy_in()`` (returns ``(bytes copied, device)``), wait for the
        device, and time both (``seconds``).  Returns the bytes copied."""
        t0 = time.perf_counter()
        nbytes, device = copy_in()
        sync(device)
        self.seconds = time.perf_counter() - t0
        return nbytes

    def record(self, nbytes: int) -> None:
        """Count the load in the store's counters (call after the context)."""
        self.store.record_load(nbytes, self.seconds)


class BlockWriter:
    """The store sequence over one or more runs of keys; :meth:`finish` records it.

    Args:
        store: the block store.
        ns: the namespace.
        layout: the stored block format.
        block_tokens: tokens per block.
    """

    def __init__(self, store: BlockStore, ns: str, layout: BlockLayout, block_tokens: int):
        self.store, self.ns, self.layout, self.block_tokens = store, ns, layout, block_tokens
        self.t0 = time.perf_counter()
        self.stored = 0
        self.nbytes = 0
        self.seconds: Optional[float] = None

    def write(self, keys: Sequence[bytes], copy_out: Callable[[int, torch.Tensor], None], device) -> int:
        """Reserve ``keys``; for each reserved one (a key the store already
        holds is skipped) call ``copy_out(i, view)`` to fill ``view`` (the
        block's bytes, ``layout.stored_bytes`` uint8) from the KV rows of
        ``keys[i]``; wait for ``device``; seal; commit; abort the rest.
        Returns the blocks committed.  Errors propagate (nothing committed is
        half written: an unsealed block is aborted)."""
        res = self.store.reserve(self.ns, list(keys), self.layout.stored_bytes, self.block_tokens)
        # A store whose views other processes map read-write (a kv-server's pool) is sealed over a private copy:
        # a checksum taken over the pool could cover bytes another client changed between the copy and the seal,
        # and a reader would then accept them (issue 29 item 6, the writer's side; the reader's is BlockReader).
        staged = bool(getattr(self.store, "views_shared", False))
        try:
            written = []
            for i, (k, view) in enumerate(zip(keys, res.views)):
                if view is None:  # already stored
                    continue
                src = torch.empty_like(view, pin_memory=view.is_pinned()) if staged else view
                copy_out(i, src)
                written.append((k, view, src))
                self.nbytes += self.layout.block_bytes
            sync(device)
            for k, view, src in written:  # after the copies landed: the checksum covers the bytes readers get
                if src is view:
                    self.layout.seal(view, k)
                else:
                    self.layout.seal(src, k)
                    view.copy_(src)
            stored = res.commit()
        finally:
            res.abort()
        self.stored += stored
        return stored

    def finish(self) -> float:
        """Record the store (when any byte was written); returns its seconds."""
        self.seconds = time.perf_counter() - self.t0
        if self.nbytes:
            self.store.record_store(self.nbytes, self.seconds)
        return self.seconds


# --------------------------------------------------------------------------- where reused tokens came from
# The tiers a reused token can come from, end to end (``tiers`` in hf.stats: reuse counters, each call's record, the
# continuous-batching counters):
#   vram_prefix  already in the model's cache: the kept conversation, the paged cache's own prefix (nothing copied)
#   host         an in-process store's host/CXL memory (kv_store=True / "local", the store of "redis://...")
#   pool         a kv-server's pool (kv_store="unix://...")
#   remote       the Redis/Valkey tier below either (one server or a Cluster), restored on a miss
#   store        a store object that does not say (a user's BlockStore)
TIERS = ("vram_prefix", "host", "pool", "remote", "store")


def lease_tiers(lease) -> List[str]:
    """The tier of each block of ``lease``, in order (a lease's ``tiers``:
    ``[(tier, blocks), ...]``; ``"store"`` for a store that does not say)."""
    runs = getattr(lease, "tiers", None) or [("store", lease.blocks)]
    return [t for t, n in runs for _ in range(int(n))]


def attribute(leases, pads: List[int], hits: List[int], C: int, expand: int, bt: int, nbytes: int,
              reused: int) -> Dict[str, Dict[str, int]]:
    """``{tier: {"blocks", "tokens", "bytes"}}`` of a load: row ``r`` uses its
    first ``min(hits[r], C - pads[r])`` tokens, block ``j`` of its lease
    covering tokens ``[j*bt, (j+1)*bt)`` from the tier the lease names; counts
    times ``expand`` (cache rows per prompt row); the loaded ``nbytes`` split
    in proportion to the tokens (``reused`` = their sum)."""
    out: Dict[str, Dict[str, int]] = {}
    for lease, p, h in zip(leases, pads, hits):
        used = max(0, min(h, C - p))
        for j, tier in enumerate(lease_tiers(lease)):
            t = max(0, min(bt, used - j * bt))
            if t <= 0:
                break
            d = out.setdefault(tier, {"blocks": 0, "tokens": 0, "bytes": 0})
            d["blocks"] += expand
            d["tokens"] += t * expand
    for d in out.values():
        d["bytes"] = int(nbytes * d["tokens"] / reused) if reused else 0
    return out


def add_tiers(total: Dict[str, Dict[str, int]], part: Dict[str, Dict[str, int]]) -> None:
    """Add ``part``'s per-tier counts into ``total``."""
    for tier, d in part.items():
        agg = total.setdefault(tier, {"blocks": 0, "tokens": 0, "bytes": 0})
        for k, v in d.items():
            agg[k] += v


# --------------------------------------------------------------------------- KV rows of a CxlCache <-> blocks
def _batch1_contiguous(places) -> bool:
    """One batch-1 storage whose slots are exactly ``places`` in order: a
    block is then one contiguous run of storage rows (the stored format)."""
    storage = places[0][0]
    return (storage.g.batch == 1 and len({id(s) for s, _ in places}) == 1 and storage.n_slots == len(places)
            and [slot for _, slot in places] == list(range(len(places))))


def copy_rows_in(layout: BlockLayout, bt: int, places, leases, pads: List[int], C: int, expand: int) -> int:
    """Write leased blocks into the token rows ``[0, C)`` of a cache's
    :class:`~cxlalloc.hf.storage.KVStorage` slots.

    Args:
        layout: the stored block format; ``bt``: tokens per block.
        places: ``[(storage, slot)]`` per cache layer, in layer order.
        leases: one lease per prompt row (its blocks in order).
        pads: each prompt row's left padding (those positions get zero K/V).
        C: the cache length every row is filled to.
        expand: cache rows per prompt row (beams / return sequences).

    Returns the bytes copied from the store (non-blocking copies: sync the device after).
    """
    nbytes = 0
    if len(leases) == 1 and expand == 1 and pads[0] == 0 and _batch1_contiguous(places):
        storage = places[0][0]  # one contiguous copy per block: the block format is a batch-1 storage row
        for j, view in enumerate(leases[0].views):
            t0 = j * bt
            if t0 >= C:
                break
            n = min(bt, C - t0)
            storage.rows(t0, t0 + n).copy_(layout.rows(view)[:n], non_blocking=True)
            nbytes += n * layout.row_bytes
        return nbytes
    for r, lease in enumerate(leases):
        pad = pads[r]
        real = max(0, C - pad)
        for e in range(r * expand, (r + 1) * expand):
            for storage, slot in places:
                if pad:
                    storage.key_view(slot, 0, min(pad, C))[e].zero_()
                    storage.value_view(slot, 0, min(pad, C))[e].zero_()
        for j, view in enumerate(lease.views):
            t0 = j * bt
            if t0 >= real:
                break
            n = min(bt, real - t0)
            rows = layout.rows(view)[:n]
            for s, (storage, slot) in enumerate(places):
                k_src = layout.key_part(rows, s).permute(1, 0, 2)   # (H, n, Dk)
                v_src = layout.value_part(rows, s).permute(1, 0, 2)
                a, b = pad + t0, pad + t0 + n
                for e in range(r * expand, (r + 1) * expand):
                    storage.key_view(slot, a, b)[e].copy_(k_src, non_blocking=True)
                    storage.value_view(slot, a, b)[e].copy_(v_src, non_blocking=True)
            nbytes += n * layout.row_bytes
    return nbytes


def copy_rows_out(layout: BlockLayout, bt: int, places, row: int, start: int, view: torch.Tensor) -> None:
    """Fill ``view`` (one block's bytes) with cache row ``row``'s K/V of tokens
    ``[start, start + bt)`` of every ``(storage, slot)`` in ``places`` (non-blocking)."""
    rows = layout.rows(view)
    if _batch1_contiguous(places):
        rows.copy_(places[0][0].rows(start, start + bt), non_blocking=True)
        return
    for s, (st, slot) in enumerate(places):
        layout.key_part(rows, s).copy_(st.key_view(slot, start, start + bt)[row].permute(1, 0, 2), non_blocking=True)
        layout.value_part(rows, s).copy_(st.value_view(slot, start, start + bt)[row].permute(1, 0, 2),
                                         non_blocking=True)


__all__ = ["BlockReader", "BlockWriter", "TIERS", "add_tiers", "attribute", "copy_rows_in", "copy_rows_out", "discard",
           "lease_tiers", "sync"]
