"""Right-sizing (GPU): at one fixed device budget, how large a batch runs and
how many tokens/s it gives, native transformers vs cxlalloc.

The budget emulates a small GPU: weights + the final KV cache of 8
sequences + 1.5 GiB for activations (``budget_bytes`` in the record).  Each
variant decodes ``new_tokens`` tokens at growing batch sizes until its first
failure (native: out of memory; cxlalloc: the host tier's limit, or the time
budget), in its own worker process (:mod:`cxlalloc_apps.bench.worker`):

``native_limit``  plain transformers under ``set_per_process_memory_fraction``
``cxlalloc``      global mode, ``backend="auto"``, KV-aware policy, same budget

Reported: per batch TTFT and aggregate decode tokens/s; the largest batch
each variant ran and its tokens/s, and their ratio (``summary``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List

from cxlalloc_apps.bench import guard
from cxlalloc_apps.bench.decode import HOST_MARGIN, WORKER_GRACE_S, gpu_free_bytes, prefill_chunk, run_worker
from cxlalloc_apps.bench.meta import RecordWriter, new_record
from cxlalloc_apps.bench.model import GiB, SHAPES

ACTIVATION_ALLOWANCE = 3 * GiB // 2
FIT_BATCH = 8
NATIVE_SHARE = 0.4  # of the remaining time budget; cxlalloc's worker gets the rest


def run(ctx) -> Dict[str, Any]:
    model = (ctx.args.models or ["llama-1b"])[0]
    shape = SHAPES[model]
    context = 4096 if ctx.quick else 8192
    new_tokens = int(ctx.args.new_tokens or (8 if ctx.quick else 16))
    batches = [4, 8, 16, 32, 64] if ctx.quick else [1, 2, 4, 8, 16, 32, 64]
    budget = shape.weight_bytes() + shape.kv_bytes(FIT_BATCH, context + new_tokens) + ACTIVATION_ALLOWANCE
    params = {"model": model, "shape": shape.to_dict(), "context": context, "new_tokens": new_tokens,
              "batches": batches, "budget_bytes": budget,
              "budget_rule": f"weights + KV of {FIT_BATCH} sequences at context+new_tokens + "
                             f"{ACTIVATION_ALLOWANCE >> 20} MiB",
              "variants": ["native_limit", "cxlalloc (backend auto)"],
              "method": "as the decode benchmark: generate(), greedy, fixed new tokens, one worker process per "
                        "variant, batches in increasing order, stop at the first failure"}
    w = RecordWriter(ctx.out_dir, new_record("rightsizing", params, ctx.simulate, ctx.argv, ctx.device))
    if ctx.simulate:
        return w.finish_skipped("all", "--simulate: right-sizing measures real VRAM budgets and speeds, GPU only")
    ok, reason = ctx.gpu_ready()
    if not ok:
        return w.finish_skipped("all", reason)
    free = gpu_free_bytes(ctx.device)
    w.record["parameters"]["free_bytes_at_start"] = free
    if free and budget > 0.45 * free:
        return w.finish_skipped("all", f"the budget ({budget} bytes) does not fit 45% of the free VRAM ({free} bytes)")
    kv_max = shape.kv_bytes(max(batches), context + new_tokens)
    host_limit = kv_max + HOST_MARGIN

    def cells(variant, backend):
        out = []
        for b in batches:
            kv = shape.kv_bytes(b, context + new_tokens)
            out.append({"id": f"rightsizing:{variant}|b{b}", "variant": variant, "backend": backend,
                        "model": model, "context": context, "batch": b, "new_tokens": new_tokens, "spill": None,
                        "kv_final_bytes": kv, "weight_bytes": shape.weight_bytes(), "budget_bytes": budget,
                        "budget_rule": "fixed", "activation_bytes": ACTIVATION_ALLOWANCE,
                        "managed_bytes": guard.managed_request(backend, kv, host_limit) if backend else 0,
                        "host_limit": host_limit, "cache_implementation": None,
                        "prefill_chunk": prefill_chunk(b), "timeline": False})
        return out

    groups = [("native", "native", {}, cells("native_limit", None)),
              ("cxlalloc:auto", "cxlalloc", {"backend": "auto", "host_limit": host_limit, "device_limit": budget},
               cells("cxlalloc", "auto"))]
    work = os.path.join(ctx.out_dir, "rightsizing_work")
    os.makedirs(work, exist_ok=True)
    rows: List[Dict[str, Any]] = []
    for i, (name, kind, opts, cs) in enumerate(groups):
        allowed, refused = guard.split_grid(cs, free or 0)
        for c in refused:
            r = dict(c, status="refused", reason=c.pop("refused"), method="refused by the managed-memory guard")
            rows.append(r)
            w.add(r)
        if not allowed:
            continue
        rem = ctx.deadline.remaining()
        # Native stops at its first OOM (a few small batches); cxlalloc runs the
        # large batches over the link, so it gets the larger share.
        share = rem if rem == float("inf") else max(20.0, rem * (NATIVE_SHARE if i == 0 else 1.0))
        spec = {"group": name, "kind": kind, "device": ctx.device, "device_type": "cuda",
                "deadline_unix": time.time() + share, "cxlalloc_options": opts, "free_bytes_at_start": free,
                "stop_after_failure": True, "cells": allowed}
        ctx.log(f"rightsizing: running {name} ({len(allowed)} batch sizes, time box {share:.0f} s)")
        timeout = share + WORKER_GRACE_S if share != float("inf") else 24 * 3600
        for r in run_worker(spec, work, min(timeout, max(ctx.deadline.remaining(), 10.0)), log=ctx.log):
            r.setdefault("method", "transformers generate() under a fixed device budget (see parameters.method)")
            rows.append(r)
            w.add(r)  # on disk at once
    summary: Dict[str, Any] = {"budget_bytes": budget}
    for variant in ("native_limit", "cxlalloc"):
        summary[variant] = largest_batch(rows, variant, batches)
    n, c = summary["native_limit"], summary["cxlalloc"]
    if {n["stopped_by"], c["stopped_by"]} & {"time", "refused"}:
        # A variant cut short by the clock or the guard says nothing about its capacity.
        summary["ratios"] = "not computed: a variant was stopped by the time budget or the guard, not by memory"
    elif n["largest_batch"] and c["largest_batch"]:
        summary["batch_ratio"] = c["largest_batch"] / n["largest_batch"]
        if n["tokens_per_s"] and c["tokens_per_s"]:
            summary["tokens_per_s_ratio"] = c["tokens_per_s"] / n["tokens_per_s"]
    w.record["summary"] = summary
    return w.finish(w.status_from_rows() if rows else None)


def largest_batch(rows: List[Dict[str, Any]], variant: str, batches: List[int]) -> Dict[str, Any]:
    """The largest batch ``variant`` decoded, its aggregate tokens/s, and what
    stopped it: "oom" or "error" (the first failing batch: a capacity result),
    "all_ran" (every batch in ``batches`` was ok), "refused" (the
    managed-memory guard refused the next batch: a lower bound), "time" (a
    batch was not run or its worker was killed before any failure: no
    capacity result), or "none" (no row at all)."""
    mine = sorted((r for r in rows if r.get("variant") == variant), key=lambda r: r["batch"])
    ok_rows = [r for r in mine if r.get("status") == "ok"]
    best = max(ok_rows, key=lambda r: r["batch"], default=None)
    first_bad = next((r for r in mine if r.get("status") != "ok"), None)
    if not mine:
        stopped = "none"
    elif first_bad is None:
        stopped = "all_ran" if len(ok_rows) == len(batches) else "time"
    elif first_bad.get("status") in ("oom", "error", "refused"):
        stopped = first_bad["status"]
    else:
        stopped = "time"  # not_run (deadline, killed worker) before any failure
    return {"largest_batch": best["batch"] if best else None,
            "tokens_per_s": best.get("decode_tokens_per_s") if best else None,
            "mode": best.get("mode") if best else None, "stopped_by": stopped,
            "failed_batch": first_bad["batch"] if first_bad is not None else None}
