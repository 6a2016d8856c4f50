"""Bandwidth ceilings (GPU): the numbers every other result is measured against.

Measured, each with CUDA events, median of ``repeat`` runs after ``warmup``
(decimal GB/s, 1 GB = 1e9 bytes):

``device_copy``
    ``dst.copy_(src)`` between two device tensors (a copy-engine/kernel D2D
    copy); GB/s counted as bytes read + bytes written (METHOD.md's convention),
    and one-way.
``device_read``
    a memory-bound reduction, ``x.sum()`` over a float32 device tensor: the
    rate at which a GPU kernel reads HBM (``hbm_read_gbps``: the device term of
    the ceiling model).
``torch_pinned``
    H2D and D2H copies to/from ``torch.empty(..., pin_memory=True)`` (torch's
    ``cudaHostAlloc`` host allocator, no NUMA choice): the reference every
    offloading scheme gets.
``host_tier`` (per backend ``host-vmm`` / ``managed`` / ``pinned`` and per host NUMA node)
    a ``cuda`` tensor whose bytes live on cxlalloc's host tier
    (``cxlalloc.Allocator(device_limit=64 MiB, ...)``, class ``kv``: larger
    than the device budget, so it is placed on the host; its tier is checked):
    ``h2d_gbps`` (host tier -> device buffer copy), ``d2h_gbps`` (device buffer
    -> host tier copy) and ``zero_copy_read_gbps`` (the same ``x.sum()`` kernel
    reading the host-tier bytes directly over the link: the link term of the
    ceiling model).  Page placement (verified/misplaced bytes) is recorded.

``summary`` (for the decode and report): ``hbm_read_gbps``,
``device_copy_gbps``, ``torch_pinned_{h2d,d2h}_gbps`` and ``link[backend]``
(the node ``auto`` picks if measured, else the fastest node).

Sources of expectations: docs/sources.md#link-bandwidth (PCIe 5.0 x16 ~63 GB/s
per direction; NVIDIA/nvbandwidth#24: SM-copy H2D 35.2 GB/s on H100).
"""

from __future__ import annotations

import gc
from typing import Any, Dict, List, Optional

import cxlalloc
from cxlalloc import topology
from cxlalloc_apps.bench import guard
from cxlalloc_apps.bench.meta import RecordWriter, new_record
from cxlalloc_apps.bench.timing import cuda_time_ms, gbps, summarize

MiB = 1 << 20
GiB = 1 << 30
BACKENDS = ("host-vmm", "pinned", "managed")  # managed last: the riskiest on a shared GPU
MAX_NODES = 4


def _memory_nodes() -> List[Dict[str, Any]]:
    try:
        topo = topology.read_topology()
        return [n for n in topo.get("nodes", []) if n.get("has_memory", True) and (n.get("total_bytes") or 0) > 0]
    except Exception:
        return []


def run(ctx) -> Dict[str, Any]:
    nbytes = int(ctx.args.ceiling_bytes or ((512 * MiB) if ctx.quick else (2 * GiB)))
    repeat, warmup = (5, 2) if ctx.quick else (10, 3)
    backends = [b for b in BACKENDS if b in (ctx.args.backends or BACKENDS)]
    params = {"bytes": nbytes, "repeat": repeat, "warmup": warmup, "backends": backends,
              "timer": "torch.cuda.Event(enable_timing=True); median of repeats after warm-ups",
              "units": "GB/s = 1e9 bytes/s"}
    w = RecordWriter(ctx.out_dir, new_record("ceilings", params, ctx.simulate, ctx.argv, ctx.device))
    if ctx.simulate:
        return w.finish_skipped("all", "--simulate: bandwidth ceilings need a real GPU (a simulated driver has no link to measure)")
    ok, reason = ctx.gpu_ready()
    if not ok:
        return w.finish_skipped("all", reason)
    import torch

    dev = torch.device("cuda", ctx.device)
    torch.cuda.set_device(dev)
    free0, total = torch.cuda.mem_get_info(dev)
    nbytes = int(min(nbytes, free0 // 8)) // 4 * 4
    w.record["parameters"].update(bytes=nbytes, free_bytes_at_start=int(free0), total_bytes=int(total))
    summary: Dict[str, Any] = {"link": {}}
    dl = ctx.deadline

    # Random data, never zeros (METHOD.md): float32 values, viewed as bytes for copies.
    srcf = torch.randn(nbytes // 4, device=dev, dtype=torch.float32)
    src = srcf.view(torch.uint8)
    dst = torch.empty(nbytes, device=dev, dtype=torch.uint8)

    def timed(part: str, fn, moved: int, method: str, **extra) -> Optional[float]:
        try:
            ms = cuda_time_ms(fn, warmup=warmup, repeat=repeat, deadline=dl)
        except Exception as e:
            w.error(part, e)
            return None
        s = summarize(ms)
        rate = gbps(moved, s["median"])
        w.add(dict(extra, part=part, bytes=nbytes, bytes_counted=moved, ms=s, gbps=rate, method=method))
        return rate

    try:
        r = timed("device_copy", lambda: dst.copy_(src), 2 * nbytes, kind="device_copy",
                  method="dst.copy_(src), two cuda uint8 tensors; GB/s counts bytes read + written")
        summary["device_copy_gbps"] = r
        summary["hbm_read_gbps"] = timed(
            "device_read", lambda: srcf.sum(), nbytes, kind="device_read",
            method="x.sum() over a float32 cuda tensor in device memory (a memory-bound reduction kernel); "
                   "GB/s counts bytes read")
        if not dl.expired():
            pin = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            pin.copy_(src)
            summary["torch_pinned_h2d_gbps"] = timed(
                "torch_pinned_h2d", lambda: dst.copy_(pin, non_blocking=True), nbytes, kind="torch_pinned",
                direction="h2d", method="dst.copy_(pinned, non_blocking=True); pinned = torch.empty(pin_memory=True) "
                                        "(torch's cudaHostAlloc host allocator, no NUMA choice)")
            summary["torch_pinned_d2h_gbps"] = timed(
                "torch_pinned_d2h", lambda: pin.copy_(src, non_blocking=True), nbytes, kind="torch_pinned",
                direction="d2h", method="pinned.copy_(device, non_blocking=True)")
            del pin
    except Exception as e:
        w.error("device", e)

    nodes = _memory_nodes()[:MAX_NODES]
    node_ids = [n["id"] for n in nodes]
    for backend in backends:
        results: Dict[Any, dict] = {}
        auto_node = None
        for node in ["auto"] + node_ids:
            part = f"host_tier:{backend}:node{node}"
            if node != "auto" and node == auto_node:
                continue  # "auto" already measured this node
            if dl.expired():
                w.skip(part, "time budget used up")
                continue
            host_limit = nbytes + 64 * MiB
            if backend == "managed":
                try:
                    guard.check_managed(host_limit, int(torch.cuda.mem_get_info(dev)[0]), what=part)
                except guard.ManagedMemoryGuardError as e:
                    w.skip(part, str(e))
                    continue
            res = _host_tier(ctx, w, part, backend, node, nbytes, host_limit, src, dst, warmup, repeat, dl)
            if res is None:
                continue
            if node == "auto":
                auto_node = res.get("numa_node")
            results[node] = res
        measured = [r for r in results.values() if r.get("zero_copy_read_gbps")]
        best = results.get("auto") if results.get("auto", {}).get("zero_copy_read_gbps") else (
            max(measured, key=lambda r: r["zero_copy_read_gbps"]) if measured else None)
        if best:
            summary["link"][backend] = {k: best.get(k) for k in ("numa_node", "zero_copy_read_gbps", "h2d_gbps",
                                                                  "d2h_gbps", "requested_node")}
    src = srcf = dst = None  # release the tensors (a `del` would leave the lambdas above unbound names)
    gc.collect()
    torch.cuda.empty_cache()
    summary["model"] = ("t_step = bytes_on_device / hbm_read_gbps + bytes_on_host / link.zero_copy_read_gbps "
                        "(cxlalloc_apps.bench.model.ceiling_tokens_per_s)")
    w.record["summary"] = summary
    return w.finish()


def _host_tier(ctx, w, part, backend, node, nbytes, host_limit, src, dst, warmup, repeat, dl) -> Optional[dict]:
    import torch

    a = h = hf = None
    try:
        a = cxlalloc.Allocator(device_limit=64 * MiB, host_limit=host_limit, numa_node=node, backend=backend,
                               device=ctx.device, migration_rate=0)
        info = a.info()
        h = a.tensor((nbytes,), torch.uint8, tag="kv")
        tier = a.tier_of(h.data_ptr())
        h.copy_(src)
        torch.cuda.synchronize()
        hf = h.view(torch.float32)
        res: Dict[str, Any] = {"backend": backend, "backend_resolved": info.get("backend"),
                               "numa_node": info.get("host_node"), "node_reason": info.get("node_reason"),
                               "requested_node": node, "tier": tier}
        if tier != "host":
            w.error(part, f"the tensor landed on the {tier} tier, not the host tier; not measured")
            return None
        for name, fn, kind in (("h2d_gbps", lambda: dst.copy_(h), "copy host tier -> device (dst.copy_(h))"),
                               ("d2h_gbps", lambda: h.copy_(src), "copy device -> host tier (h.copy_(src))"),
                               ("zero_copy_read_gbps", lambda: hf.sum(),
                                "GPU kernel x.sum() reading the host-tier bytes directly (zero-copy)")):
            if dl.expired():
                w.skip(f"{part}:{name}", "time budget used up")
                continue
            ms = cuda_time_ms(fn, warmup=warmup, repeat=repeat, deadline=dl)
            s = summarize(ms)
            res[name] = gbps(nbytes, s["median"])
            res[name.replace("_gbps", "_ms")] = s
        st = a.stats()
        res["placement"] = st.get("host", {}).get("placement")
        w.add(dict(res, part=part, kind="host_tier", bytes=nbytes,
                   method=("cxlalloc.Allocator(device_limit=64MiB, backend=..., numa_node=...).tensor(kv) larger "
                           "than the device budget -> a cuda tensor on the host tier; copies with Tensor.copy_, "
                           "zero-copy read with x.sum() over its float32 view; CUDA events, median")))
        return res
    except Exception as e:
        w.error(part, e)
        return None
    finally:
        h = hf = None  # free the host-tier block before emptying the cache
        gc.collect()
        if a is not None:
            try:
                torch.cuda.synchronize()
                a.empty_cache()
            except Exception:
                pass
        a = None
        gc.collect()
