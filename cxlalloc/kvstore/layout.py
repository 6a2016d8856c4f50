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
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import List, Tuple

import torch

MAX_BLOCK_TOKENS = 65536


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
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_elems(self) -> int:
        return sum(h * (dk + dv) for h, dk, dv in self.slots)

    @property
    def row_bytes(self) -> int:
        """K+V bytes of one token, all layers (bytes/token)."""
        return self.row_elems * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.row_bytes

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
        """A block's bytes (1-D uint8, ``block_bytes`` long) as ``(block_tokens, row_elems)`` of ``dtype``."""
        return raw.view(self.dtype).view(self.block_tokens, self.row_elems)

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
                f" = {self.block_bytes} bytes/block")
