"""A test-only LMCache "GPU connector" for vLLM's CPU backend.

It stands in for LMCache's GPU copy, which needs a GPU: LMCache 0.5.6's
``CreateGPUConnector`` knows CUDA, XPU, MUSA and HPU only and stops vLLM's CPU
build at start ("No supported cpu connector found"), so the engine tests
(tests/engines/) register this class for ``torch_device_type == "cpu"``
through vLLM's own plugin seam (the ``vllm.general_plugins`` entry point
group, loaded in every vLLM process; :func:`register`).  On a GPU, LMCache's
own connector runs instead (``scripts/gpu_check.sh``); nothing of this file is
part of cxlalloc.

What it copies: vLLM's CPU attention keeps one tensor per layer,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, which its kernels
view as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]``: rows
``0..block_size-1`` of a (block, head) are the keys of the block's tokens,
rows ``block_size..2*block_size-1`` their values
(vllm/v1/attention/backends/cpu_attn.py).  A token in slot ``s`` lives at
block ``s // block_size``, row ``s % block_size``.  LMCache's memory objects
are ``KV_2LTD``: ``[2, num_layers, tokens, num_kv_heads * head_size]`` (what
its ``VLLMPagedMemGPUConnectorV2`` produces and consumes).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import List

import torch


def _connector_class():
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.memory_management import MemoryFormat

    class VLLMPagedMemCPUConnector(GPUConnectorInterface):
        """LMCache's connector contract over vLLM's CPU paged KV cache (see the module docstring)."""

        def __init__(self, num_layers: int, num_kv_heads: int, head_size: int):
            self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
            self.kvcaches: List[torch.Tensor] = []

        @classmethod
        def from_metadata(cls, metadata, use_gpu=False, device=None, layout_hints=None):
            num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
            return cls(num_layers, num_kv_heads, head_size)

        def initialize_kvcaches_ptr(self, **kwargs):
            if "kvcaches" in kwargs:
                caches = kwargs["kvcaches"]
                self.kvcaches = list(caches.values()) if isinstance(caches, dict) else list(caches)

        def _rows(self, slot_mapping: torch.Tensor, start: int, end: int):
            """(per-layer [blocks, heads, 2*block_size, head] views, block index, key row, value row) of start..end."""
            views = []
            for kv in self.kvcaches:
                nb, nh, bs, two_hd = kv.shape
                assert nh == self.num_kv_heads and two_hd == 2 * self.head_size, (kv.shape, self.num_kv_heads)
                views.append(kv.view(nb, nh, 2 * bs, self.head_size))
            bs = self.kvcaches[0].shape[2]
            slots = slot_mapping[start:end].to(device="cpu", dtype=torch.long)
            if bool((slots < 0).any()):
                raise ValueError(f"slot_mapping[{start}:{end}] holds a negative slot (a token vLLM did not place)")
            return views, slots // bs, slots % bs, slots % bs + bs

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
            """vLLM's KV of tokens start..end (their slots in ``slot_mapping``) -> ``memory_obj`` (KV_2LTD)."""
            self.initialize_kvcaches_ptr(**kwargs)
            views, blk, krow, vrow = self._rows(kwargs["slot_mapping"], start, end)
            out = memory_obj.tensor  # [2, layers, tokens, heads * head]
            n = end - start
            for layer, v in enumerate(views):
                out[0, layer, :n].copy_(v[blk, :, krow, :].reshape(n, -1))   # [tokens, heads, head]
                out[1, layer, :n].copy_(v[blk, :, vrow, :].reshape(n, -1))
            memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
            """``memory_obj`` (KV_2LTD) -> vLLM's KV slots of tokens start..end, skipping the tokens vLLM
            already holds (``vllm_cached_tokens``: its own prefix cache, which may be shared with running requests)."""
            if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
                raise ValueError(f"memory object format {memory_obj.metadata.fmt}: this connector reads KV_2LTD only")
            self.initialize_kvcaches_ptr(**kwargs)
            skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
            if skip == end - start:
                return
            views, blk, krow, vrow = self._rows(kwargs["slot_mapping"], start + skip, end)
            src = memory_obj.tensor
            n = end - start - skip
            for layer, v in enumerate(views):
                v[blk, :, krow, :] = src[0, layer, skip:skip + n].reshape(n, self.num_kv_heads, self.head_size)
                v[blk, :, vrow, :] = src[1, layer, skip:skip + n].reshape(n, self.num_kv_heads, self.head_size)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for mo, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(mo, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for mo, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(mo, s, e, **kwargs)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    return VLLMPagedMemCPUConnector


def _patch(factory) -> None:
    """Wrap ``factory.CreateGPUConnector`` (the module ``lmcache.v1.gpu_connector``) on a CPU-only LMCache."""
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    if torch_device_type != "cpu" or getattr(factory, "_cxlalloc_test_cpu", False):
        return
    original = factory.CreateGPUConnector
    cls = _connector_class()

    def create(config, metadata, engine, layout_hints=None):
        if engine == EngineType.VLLM:
            return cls.from_metadata(metadata)
        return original(config, metadata, engine, layout_hints)

    factory.CreateGPUConnector = create
    factory._cxlalloc_test_cpu = True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``lmcache.v1.gpu_connector`` right after it is imported (LMCache's connector imports it when vLLM
    creates it), not before: importing LMCache at plugin-load time, ahead of vLLM's worker set-up, breaks that
    set-up (vLLM's CPU platform rebinds Triton kernels over every loaded module and trips on LMCache's CUDA
    bindings)."""

    NAME = "lmcache.v1.gpu_connector"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def register() -> None:
    """vLLM general plugin: make LMCache's connector factory build the CPU connector on vLLM's CPU build.

    Any other device, or an engine other than vLLM, goes to LMCache's own factory unchanged.
    """
    if _PatchOnImport.NAME in sys.modules:
        _patch(sys.modules[_PatchOnImport.NAME])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
