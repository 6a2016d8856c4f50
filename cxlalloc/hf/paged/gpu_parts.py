"""The paged cache of a model spread over several GPUs: one cxlalloc extent per GPU.

transformers lays its paged cache out as one flat tensor (``cache.py``,
``cache_allocators/full_attention.py``, 5.24): block ``b`` holds one page per
layer (a page: ``page_size`` K rows, then ``page_size`` V rows), so block ``b``
is rows ``[b * R, (b + 1) * R)`` of the ``(rows, heads, head_dim)`` view with
``R = 2 * layers * page_size``; layer ``i``'s K and V are the views shifted by
``2 * i * page_size`` and ``(2 * i + 1) * page_size`` rows, and ``update()``
writes and reads them with one row index per allocator, shared by every layer.

On a model spread over GPUs (a pipeline of decoder layers) each GPU ``g``
holds an extent of its own (from its own allocator, class ``kv``: its VRAM
budget, its host tier) with, for every block, only the pages of its own
``n_g`` layers (``R_g = 2 * n_g * page_size`` rows per block), the same
sectors and blocks as the full layout.  A shared row index ``w`` of the full
layout is translated once per batch and GPU to ``(w // R) * R_g + w % R``
(:func:`local_rows`), and the fast-path block table (in pages) likewise
(:func:`local_pages`).  Whole blocks (forks, the swap pool, the KV store) are
seen through :class:`StripedBlocks`, which gathers/scatters a block's pages
over the GPUs in layer order (the full layout's bytes).

Only full-attention models are split so (:func:`split_reason`): a sliding
window's pages are ring buffers indexed per group, not per block.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch


@dataclasses.dataclass
class GpuPart:
    """One GPU's share of a paged cache.

    Attributes:
        gpu: the GPU index (a simulated GPU's ordinal in simulation).
        allocator: that GPU's :class:`cxlalloc.Allocator`.
        layers: the decoder layers whose pages it holds (increasing layer index).
        bytes_per_sector: its bytes per sector (the full layout's, scaled by its layers).
        block_bytes: its bytes per whole-model block (its layers' pages).
        rows_per_block: ``R_g``, rows of its ``(rows, heads, head_dim)`` view per block
            (None: the part holds the full layout, one GPU).
    """

    gpu: int
    allocator: Any
    layers: List[int]
    bytes_per_sector: int
    block_bytes: int
    rows_per_block: Optional[int] = None
    extent: Any = None
    chunk: int = 0
    tensor: Optional[torch.Tensor] = None  # the committed sectors' bytes (uint8)
    copy_view: Optional[torch.Tensor] = None  # tensor as (blocks, block_bytes)
    zeroed: int = 0  # bytes zeroed from the extent's start
    kv_cap: Optional[int] = None  # kv_device_limit (None: not set)
    headroom: int = 0
    movable: bool = True

    @property
    def name(self) -> str:
        return f"cuda:{self.gpu}"

    @property
    def device(self) -> torch.device:
        return self.tensor.device if self.tensor is not None else torch.device("cpu")

    def runs(self):
        """``[(first layer, last layer + 1, first local page)]``: the part's layers as contiguous runs."""
        out = []
        for j, layer in enumerate(self.layers):
            if out and out[-1][1] == layer:
                out[-1][1] += 1
            else:
                out.append([layer, layer + 1, j])
        return [tuple(r) for r in out]


def split_reason(kinds, layer_gpu, num_layers: int) -> Optional[str]:
    """Why a spread model's paged cache cannot be split per GPU (None: it can).

    Args:
        kinds: the paged cache's layer kinds (transformers' ``group_layers_by_attn_type`` keys).
        layer_gpu: each decoder layer's GPU, by layer index.
        num_layers: the model config's ``num_hidden_layers``.
    """
    if set(kinds) != {"full_attention"}:
        return (f"its paged cache has {', '.join(sorted(kinds))} layers; cxlalloc splits a paged cache over GPUs "
                "for full-attention models only (a sliding-window group's pages are ring buffers shared by layers "
                "of several GPUs, not one page per layer per block)")
    if layer_gpu is None or len(layer_gpu) != num_layers:
        return (f"cxlalloc found {0 if layer_gpu is None else len(layer_gpu)} decoder layers with a GPU for a config "
                f"of {num_layers} (num_hidden_layers); it cannot tell which GPU holds each layer's pages")
    return None


def local_rows(index: torch.Tensor, rows: int, part_rows: int) -> torch.Tensor:
    """Full-layout row indices (``rows`` per block) as the part's (``part_rows`` per block)."""
    return torch.div(index, rows, rounding_mode="floor") * part_rows + torch.remainder(index, rows)


def local_pages(table: torch.Tensor, pages: int, part_pages: int) -> torch.Tensor:
    """A block table in pages of the full layout (``pages`` per block; negative: unused) as the part's."""
    moved = torch.div(table, pages, rounding_mode="floor") * part_pages + torch.remainder(table, pages)
    return torch.where(table >= 0, moved, table)


class StripedBlocks:
    """Whole blocks of a paged cache split over GPUs, in the full layout's bytes.

    Stands for transformers' ``allocator._copy_view`` (the cache as
    ``(blocks, bytes_per_block)`` uint8), which forks (``copy_blocks``) and the
    swap pool (``offloading_manager``) use through ``index_select(0, ids)`` and
    ``index_copy_(0, ids, rows)`` only.
    """

    def __init__(self, parts: List[GpuPart], num_layers: int, page_bytes: int, device) -> None:
        self.parts = parts
        self.num_layers = num_layers
        self.page_bytes = page_bytes
        self.device = torch.device(device)
        self.bytes_per_block = num_layers * page_bytes

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` as ``(len(ids), bytes_per_block)`` uint8 on ``device`` (pages in layer order)."""
        if dim != 0:
            raise ValueError(f"StripedBlocks.index_select: dim must be 0 (blocks), not {dim}")
        n = int(ids.numel())
        out = torch.empty((n, self.num_layers, self.page_bytes), dtype=torch.uint8, device=self.device)
        for p in self.parts:
            got = p.copy_view.index_select(0, ids.to(p.device)).view(n, len(p.layers), self.page_bytes)
            for a, b, j in p.runs():
                out[:, a:b].copy_(got[:, j:j + b - a])
        return out.view(n, self.bytes_per_block)

    def index_copy_(self, dim: int, ids: torch.Tensor, src: torch.Tensor) -> "StripedBlocks":
        """Write ``src`` (``(len(ids), bytes_per_block)`` uint8, pages in layer order) into blocks ``ids``."""
        if dim != 0:
            raise ValueError(f"StripedBlocks.index_copy_: dim must be 0 (blocks), not {dim}")
        n = int(ids.numel())
        src = src.reshape(n, self.num_layers, self.page_bytes)
        for p in self.parts:
            mine = torch.empty((n, len(p.layers), self.page_bytes), dtype=torch.uint8, device=p.device)
            for a, b, j in p.runs():
                mine[:, j:j + b - a].copy_(src[:, a:b])
            p.copy_view.index_copy_(0, ids.to(p.device), mine.view(n, p.block_bytes))
        return self


__all__ = ["GpuPart", "StripedBlocks", "local_pages", "local_rows", "split_reason"]
