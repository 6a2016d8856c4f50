"""The byte format of one stored KV block.

A block holds ``block_tokens`` consecutive tokens of one sequence, for every
KV-bearing layer of the model, token-major::

    block[t] = [K_0 (H_0, Dk_0) | V_0 (H_0, Dv_0) | K_1 (H_1, Dk_1) | V_1 ... ]     (dtype elements)

This is exactly one row of the in-extent KV storage of a batch-1
:class:`cxlalloc.hf.CxlCache` (``cxlalloc.hf.storage``), so loading a hit into
a batch-1 cache, or storing from one, is **one contiguous copy per block**
(on a GPU: one DMA of ``block_bytes`` on the copy engines).  Other batch sizes
copy per layer with strided views.  The layout is part of every block's key
(:meth:`BlockLayout.signature`), so bytes are never read with another layout.

A stored block is the payload followed by a 16-byte **checksum trailer**:
XXH3-128 of the block's key and its payload, written by the writer after its
copies landed (:meth:`BlockLayout.seal`) and checked by every reader before
the bytes are used (:meth:`BlockLayout.verify`).  It catches a bit flipped in
a shared pool (every kv-server client maps the pool read-write: one buggy
client could otherwise corrupt every later reader's hit), a torn or truncated
copy, and a block served under another key.  It is not a MAC: anyone who can
write the pool can also write a matching trailer (docs/kv-server.md, threat
model).  XXH3 (https://xxhash.com) runs at memory speed: measured 2.5 GB/s on
one core of the shared 2-core CI machine while BLAKE2b ran at 0.19 GB/s and
CRC-32 (zlib) at 0.65 GB/s; 64 KiB in ~25 us.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, List, Tuple

import xxhash

if TYPE_CHECKING:  # torch is imported where a tensor is made: the kv-server (verify_stored) runs without it
    import torch

MAX_BLOCK_TOKENS = 65536
CHECKSUM_BYTES = 16  # the XXH3-128 trailer of every stored block


def block_checksum(key: bytes, *payload) -> bytes:
    """XXH3-128 of a block's key and payload (any buffers, hashed in order as
    one byte string): its 16-byte trailer."""
    h = xxhash.xxh3_128()
    h.update(bytes(key))
    for part in payload:
        h.update(part)
    return h.digest()


# A test hook (tests only): called with the pool's source view right before copy_verified copies it, so a test
# can change the pool's bytes after every check of the block's header and before the copy (tests/kvstore/engines).
_before_copy = None


def copy_verified(dst: "torch.Tensor", src: "torch.Tensor", key: bytes, head, want: bytes) -> bool:
    """Copy a stored block's payload out of the shared pool ONCE and verify that copy against its trailer.

    The pool is mapped read-write by every kv-server client, so its bytes may change at any moment: a checksum
    taken in the pool and a copy made after it may see different bytes.  This reads the pool once (the copy
    into ``dst``) and checks ``block_checksum(key, head, dst)`` over ``dst`` itself, so the bytes it vouches
    for are exactly the bytes the caller keeps.  The hash pass reads ``dst`` again (its cache-hot tail first):
    XXH3 runs at 20-30 GB/s on one core of the CI machine, 5-15 % of the copy's time at 1-16 MiB
    (benchmarks/results/lmcache-get-cpu-2026-12-03/).

    Args:
        dst: the private destination, 1-D uint8, ``src.numel()`` bytes (a CPU destination is verified in place;
            another device's through one private host copy, then copied there).
        src: the payload in the pool (1-D uint8 view of the mapping).
        key: the block's 32-byte server key; ``head``: the header bytes the caller already copied and parsed
            (they are in the checksum too); ``want``: the 16-byte trailer, copied out of the pool.

    Returns:
        True when the copy matches the trailer; False otherwise (``dst`` then holds bytes the caller must not
        use).
    """
    if _before_copy is not None:
        _before_copy(src)
    if dst.device.type == "cpu":
        dst.copy_(src)
        body = dst
    else:
        body = src.clone()
    h = xxhash.xxh3_128()
    h.update(bytes(key))
    h.update(head)
    h.update(memoryview(body.numpy()))
    if h.digest() != bytes(want):
        return False
    if body is not dst:
        dst.copy_(body)
    return True


def verify_stored(raw, key: bytes) -> bool:
    """True when ``raw`` (a stored block's bytes: any buffer, payload then
    trailer) ends in the checksum of ``key`` and its payload.  Needs no layout,
    so the kv-server checks a block a client reports with it."""
    mv = memoryview(raw).cast("B")
    if len(mv) < CHECKSUM_BYTES:
        return False
    return bytes(mv[-CHECKSUM_BYTES:]) == block_checksum(key, mv[:-CHECKSUM_BYTES])


def check_block_tokens(value) -> int:
    """Validate the ``block_tokens`` option: an int in [1, 65536].

    Raises:
        ValueError: naming the option and its allowed values.
    """
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and isinstance(value, str) and value.strip().isdigit():
        value, ok = int(value.strip()), True
    if not ok or not 1 <= value <= MAX_BLOCK_TOKENS:
        raise ValueError(f"cxlalloc option 'block_tokens': {value!r} is not allowed; use an int from 1 to "
                         f"{MAX_BLOCK_TOKENS} (tokens per stored block; 16-256 is usual)")
    return value


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Geometry of one block: ``slots`` = ((H, Dk, Dv), ...) per KV layer in
    the model's layer order, element ``dtype``, ``block_tokens`` tokens."""

    block_tokens: int
    dtype: torch.dtype
    slots: Tuple[Tuple[int, int, int], ...]

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def row_elems(self) -> int:
        return sum(h * (dk + dv) for h, dk, dv in self.slots)

    @property
    def row_bytes(self) -> int:
        """K+V bytes of one token, all layers (bytes/token)."""
        return self.row_elems * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (its K/V)."""
        return self.block_tokens * self.row_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of one stored block: the payload and its checksum trailer."""
        return self.block_bytes + CHECKSUM_BYTES

    def checksum(self, raw: torch.Tensor, key: bytes) -> bytes:
        """XXH3-128 of ``key`` and the payload of ``raw`` (a stored block:
        1-D uint8 CPU tensor of :attr:`stored_bytes`), 16 bytes."""
        return block_checksum(key, memoryview(raw[:self.block_bytes].numpy()))

    def seal(self, raw: torch.Tensor, key: bytes) -> None:
        """Write the checksum trailer of a written block (after its payload copies completed)."""
        import torch

        raw[self.block_bytes:self.stored_bytes].copy_(torch.frombuffer(bytearray(self.checksum(raw, key)),
                                                                       dtype=torch.uint8))

    def verify(self, raw: torch.Tensor, key: bytes) -> bool:
        """True when the trailer of ``raw`` matches its key and payload."""
        if raw.numel() != self.stored_bytes:
            return False
        return raw[self.block_bytes:].numpy().tobytes() == self.checksum(raw, key)

    def offsets(self) -> List[Tuple[int, int]]:
        """Element offsets of (K, V) of each slot within a row."""
        out, off = [], 0
        for h, dk, dv in self.slots:
            out.append((off, off + h * dk))
            off += h * (dk + dv)
        return out

    def signature(self) -> bytes:
        text = f"{self.block_tokens}|{self.dtype}|" + ";".join(f"{h},{dk},{dv}" for h, dk, dv in self.slots)
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def rows(self, raw: torch.Tensor) -> torch.Tensor:
        """A block's payload (1-D uint8, ``block_bytes`` or ``stored_bytes`` long) as
        ``(block_tokens, row_elems)`` of ``dtype``."""
        return raw[:self.block_bytes].view(self.dtype).view(self.block_tokens, self.row_elems)

    def key_part(self, rows: torch.Tensor, slot: int) -> torch.Tensor:
        """``(n, H, Dk)`` view of slot ``slot``'s keys in ``rows`` (``(n, row_elems)``)."""
        h, dk, _ = self.slots[slot]
        k0, _ = self.offsets()[slot]
        return rows[:, k0:k0 + h * dk].unflatten(1, (h, dk))

    def value_part(self, rows: torch.Tensor, slot: int) -> torch.Tensor:
        h, _, dv = self.slots[slot]
        _, v0 = self.offsets()[slot]
        return rows[:, v0:v0 + h * dv].unflatten(1, (h, dv))

    def describe(self) -> str:
        kinds = sorted(set(self.slots))
        geo = ", ".join(f"{sum(1 for s in self.slots if s == k)}x(H={k[0]}, Dk={k[1]}, Dv={k[2]})" for k in kinds)
        return (f"{self.block_tokens} tokens x {len(self.slots)} layers [{geo}] {str(self.dtype).replace('torch.', '')}"
                f" = {self.block_bytes} bytes/block (+{CHECKSUM_BYTES} checksum)")
