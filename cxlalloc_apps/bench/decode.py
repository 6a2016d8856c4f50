"""Decode under spill: transformers generate() on a Llama-shaped model with its
KV cache partly forced to the host tier, every alternative side by side.

Variants (one run of the benchmark runs all of them on the same grid):

``native``
    plain transformers, no memory limit: the upper bound.
``native_limit``
    plain transformers with the device budget applied through
    ``torch.cuda.set_per_process_memory_fraction(budget / VRAM)``; above 0 %
    spill it is expected to run out of memory, which is recorded.
``hf_offloaded``
    transformers' own offloading, ``generate(cache_implementation="offloaded")``
    (every layer's K/V copied to pinned host memory after use and back before
    the next use; transformers cache_utils.py, DynamicLayer offloading), under the
    tightest budget of the grid.  Its placement does not depend on the budget,
    so one run per point stands for every spill fraction.
``policy_free``
    cxlalloc's engine and KV storage with the KV policy neutralised
    (``policy="first-fit"``: no KV quota, no headroom, no demotion or
    promotion; :func:`policy_free_options`): first-come placement, whatever
    overflows the budget goes to the host tier, activations included.  Same backend as the ``cxlalloc``
    row it is compared with.
``cxlalloc``
    cxlalloc with its KV-aware policy (defaults), one row per host backend
    (``host-vmm``, ``managed``, ``pinned``).

cxlalloc variants run in global mode (``cxlalloc.enable()`` in a fresh
process, model wrapped with ``cxlalloc.hf.wrap``) so the budget covers weights,
KV and activations as it does for ``native_limit``; where global mode is not
available they fall back to scoped mode (own Allocator for weights + KV,
``device_limit`` = budget minus the activations measured natively), and each
row says which mode ran.

The budget: the native run of each point (model, context, batch) measures
its peak reserved device memory P (prefill chunked so that activations stay
small next to the KV cache); the budget that forces a fraction f of the final
KV bytes K to the host is ``P + 256 MiB - f * K`` (:func:`cxlalloc_apps.bench.worker.budget_from_peak`).
The fraction actually on the host during decode is measured from cxlalloc's
per-class statistics and reported (``measured_host_fraction``).

Reported per run: TTFT (s, prefill + first token), decode tokens/s (all
sequences, steps after the first token), the link-bound ceiling at that spill
fraction (:func:`cxlalloc_apps.bench.model.ceiling_tokens_per_s`, from the
bandwidths the ``ceilings`` benchmark measured in the same output folder) and
the ratio to it, and ratios to the other variants at the same point.

Managed memory: every managed (or ``auto``) cell's request is checked against
half of the card's free memory (:mod:`cxlalloc_apps.bench.guard`) before any cell
runs; offending cells are refused and recorded.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from cxlalloc_apps.bench import guard
from cxlalloc_apps.bench.meta import RecordWriter, new_record
from cxlalloc_apps.bench.model import GiB, MiB, SHAPES, ceiling_tokens_per_s
# The budget rule lives in the worker, the lower module: it also applies it to
# cells whose native peak it measured itself (budget_bytes None).
from cxlalloc_apps.bench.worker import BUDGET_SLACK, Worker, budget_from_peak  # noqa: F401
from cxlalloc.config import OPTION_NAMES

BACKENDS = ("host-vmm", "managed", "pinned")
FRACTIONS = (0.0, 0.25, 0.5, 0.75)
HOST_MARGIN = 2 << 30
PREFILL_TOKENS_PER_CHUNK = 16384  # batch x chunk tokens per prefill forward
WORKER_GRACE_S = 45.0

# Quick grid (scripts/gpu_check.sh): both points hold 2 GiB of KV (about the 1B model's weights), so 75 % spill
# moves ~1.5 GiB over the link per decode step; the ends of the 4k-32k context range, ~1.5 s per run.
QUICK = {"models": ["llama-1b"], "points": [(4096, 16), (32768, 2)], "new_tokens": 12, "fractions": (0.0, 0.5)}
FULL = {"models": ["llama-1b", "llama-3b", "llama-8b"], "contexts": [4096, 8192, 16384, 32768],
        "batches": [1, 8, 32, 64], "new_tokens": 32, "max_kv_bytes": 40 * GiB}
SIM = {"models": ["tiny"], "points": [(512, 4)], "new_tokens": 8}
# --simulate runs the toy on the CPU: these models only, and at most this many tokens (batch x (context + new)) per
# grid point (the tiny model's KV is 8 KiB per token in fp32: 128 MiB; beyond it a CPU takes minutes per point).
SIM_MODELS = ("tiny",)
SIM_MAX_TOKENS = 16384


def sim_grid_error(models=None, contexts=None, batches=None, new_tokens=None) -> Optional[str]:
    """Why ``--simulate`` cannot run this grid (``--models``/``--contexts``/
    ``--batches``/``--new-tokens`` as given, None for the defaults), or None.
    The simulation honours every value it can run; it refuses the rest rather
    than run something else under their name."""
    bad = [m for m in (models or []) if m not in SIM_MODELS]
    if bad:
        return (f"--models: {', '.join(bad)} cannot run with --simulate (a CPU runs only {', '.join(SIM_MODELS)}, the "
                "toy model; the Llama shapes need a GPU)")
    new = int(new_tokens or SIM["new_tokens"])
    cs = contexts or [c for c, _ in SIM["points"]]
    bs = batches or [b for _, b in SIM["points"]]
    worst = max(bs) * (max(cs) + new)
    if worst > SIM_MAX_TOKENS:
        return (f"--contexts/--batches: batch {max(bs)} x (context {max(cs)} + {new} new tokens) = {worst:,} tokens is "
                f"more than --simulate runs on a CPU (at most {SIM_MAX_TOKENS:,} per point)")
    return None


def effective_grid(points) -> Dict[str, Any]:
    """What a run's grid really is, for its record: the (model, context, batch)
    points and the values of each axis."""
    return {"points": [list(p) for p in points], "models": sorted({p[0] for p in points}),
            "contexts": sorted({p[1] for p in points}), "batches": sorted({p[2] for p in points})}


def analytic_budget(model: str, context: int, batch: int, new_tokens: int, spill: float) -> int:
    """Budget when no native run measured the peak: weights + KV + an activation
    allowance of max(1 GiB, 10 % of KV) + slack - spill x KV (an estimate,
    recorded as ``budget_rule: analytic``)."""
    s = SHAPES[model]
    kv = s.kv_bytes(batch, context + new_tokens)
    return int(s.weight_bytes() + kv + max(GiB, kv // 10) + BUDGET_SLACK - spill * kv)


def prefill_chunk(batch: int) -> int:
    """Prefill chunk (tokens per sequence): ~16k tokens per forward, a multiple of 256."""
    return max(256, (PREFILL_TOKENS_PER_CHUNK // max(batch, 1)) // 256 * 256)


def grid_points(quick: bool, simulate: bool, models=None, contexts=None, batches=None,
                free_bytes: Optional[int] = None) -> List[Tuple[str, int, int]]:
    """(model, context, batch) points of the grid.

    Full grid points are kept when weights + final KV fit in 45 % of the free
    VRAM (the native run must fit with room to spare)."""
    if simulate:
        g = SIM
        if contexts or batches:  # honoured (sim_grid_error refuses what a CPU cannot run)
            cs = contexts or sorted({c for c, _ in g["points"]})
            bs = batches or sorted({b for _, b in g["points"]})
            pts = [(m, c, b) for m in (models or g["models"]) for c in cs for b in bs]
        else:
            pts = [(m, c, b) for m in (models or g["models"]) for c, b in g["points"]]
    elif quick and not (contexts or batches):
        g = QUICK
        pts = [(m, c, b) for m in (models or g["models"]) for c, b in g["points"]]
    else:
        g = FULL
        pts = [(m, c, b) for m in (models or g["models"]) for c in (contexts or g["contexts"])
               for b in (batches or g["batches"])]
        pts = [p for p in pts if SHAPES[p[0]].kv_bytes(p[2], p[1]) <= g["max_kv_bytes"]]
    if free_bytes:
        pts = [p for p in pts if SHAPES[p[0]].weight_bytes() + SHAPES[p[0]].kv_bytes(p[2], p[1]) <= 0.45 * free_bytes]
    return pts


def plan(points, fractions, backends, new_tokens: int, policy_free_backend: str = "host-vmm",
         simulate: bool = False) -> Dict[str, Dict[str, Any]]:
    """Worker groups -> {"kind", "backend", "options", "cells"} (cells without budgets
    for the cxlalloc groups: they are filled in after the native group ran)."""
    groups: Dict[str, Dict[str, Any]] = {}
    native: List[Dict[str, Any]] = []
    fmax = max(fractions) if fractions else 0.0

    elem = 4 if simulate else 2  # simulation runs the toy in float32 on the CPU; GPU runs are bf16

    def base(model, ctx, batch, variant, spill, backend=None):
        s = SHAPES[model]
        kv = s.kv_bytes(batch, ctx + new_tokens, elem)
        return {"id": f"{variant}{':' + backend if backend else ''}|{model}|ctx{ctx}|b{batch}|f{spill:g}",
                "variant": variant, "backend": backend, "model": model, "context": ctx, "batch": batch,
                "new_tokens": new_tokens, "spill": spill, "kv_final_bytes": kv, "weight_bytes": s.weight_bytes(elem),
                "budget_bytes": None, "budget_rule": None, "managed_bytes": 0, "cache_implementation": None,
                "prefill_chunk": None if simulate else prefill_chunk(batch), "timeline": True}

    for (m, c, b) in points:
        native.append(base(m, c, b, "native", 0.0))
        if simulate:
            continue
        for f in fractions:
            cell = base(m, c, b, "native_limit", f)
            cell["budget_rule"] = "native_peak"
            cell["timeline"] = False
            native.append(cell)
        off = base(m, c, b, "hf_offloaded", fmax)
        off["budget_rule"] = "native_peak"
        off["cache_implementation"] = "offloaded"
        native.append(off)
    groups["native"] = {"kind": "native", "backend": None, "options": {}, "cells": native}

    def cxl_group(name, variant, backend, options):
        cells = []
        for (m, c, b) in points:
            for f in fractions:
                if variant == "policy_free" and f == 0.0 and not simulate:
                    continue  # nothing overflows at 0 %: identical to cxlalloc at 0 %
                cells.append(base(m, c, b, variant, f, backend))
        host_limit = max((x["kv_final_bytes"] for x in cells), default=0) + (64 * MiB if simulate else HOST_MARGIN)
        for x in cells:
            x["host_limit"] = host_limit
            x["managed_bytes"] = guard.managed_request(backend, x["kv_final_bytes"], host_limit)
        opts = dict(options, backend=backend, host_limit=host_limit)
        groups[name] = {"kind": "cxlalloc", "backend": backend, "options": opts, "cells": cells}

    pf_opts = policy_free_options()
    order = [b for b in backends if b == policy_free_backend] + [b for b in backends if b != policy_free_backend]
    for i, bk in enumerate(order):
        cxl_group(f"cxlalloc:{bk}", "cxlalloc", bk, {})
        if i == 0:
            cxl_group(f"policy_free:{policy_free_backend}", "policy_free", policy_free_backend, pf_opts)
    if policy_free_backend not in backends:
        cxl_group(f"policy_free:{policy_free_backend}", "policy_free", policy_free_backend, pf_opts)
    return groups


def policy_free_options() -> Dict[str, Any]:
    """cxlalloc options of the policy-free baseline: ``policy="first-fit"``
    (the engine's own switch: no KV quota, no headroom, no demotion or
    promotion; VRAM first come, first served, then the host tier), or, on
    builds without that option, the same effect by ``migration_rate=0`` (no
    migration) and ``device_headroom=0``."""
    if "policy" in OPTION_NAMES:
        return {"policy": "first-fit"}
    return {"migration_rate": 0, "device_headroom": 0}


def assign_budgets(cells: List[Dict[str, Any]], native_rows: List[Dict[str, Any]], simulate: bool = False) -> None:
    """Fill ``budget_bytes`` / ``budget_rule`` / ``activation_bytes`` of cxlalloc cells."""
    peaks = {}
    for r in native_rows:
        if r.get("variant") == "native" and r.get("status") == "ok":
            peaks[(r["model"], r["context"], r["batch"])] = r
    for c in cells:
        key = (c["model"], c["context"], c["batch"])
        if simulate:
            # Simulation (scoped mode, CPU activations not modelled): weights + kept KV + one chunk of slack.
            c["budget_bytes"] = int(c["weight_bytes"] + (1 - c["spill"]) * c["kv_final_bytes"] + 2 * MiB)
            c["budget_rule"] = "weights_plus_kept_kv"
            c["activation_bytes"] = 0
            continue
        r = peaks.get(key)
        if r and r.get("peak_reserved_bytes"):
            c["budget_bytes"] = budget_from_peak(int(r["peak_reserved_bytes"]), c["kv_final_bytes"], c["spill"])
            c["budget_rule"] = "native_peak"
            c["activation_bytes"] = max(int(r["peak_reserved_bytes"]) - c["weight_bytes"] - c["kv_final_bytes"], 0)
        else:
            c["budget_bytes"] = analytic_budget(c["model"], c["context"], c["batch"], c["new_tokens"], c["spill"])
            c["budget_rule"] = "analytic"
            c["activation_bytes"] = max(GiB, c["kv_final_bytes"] // 10)


from cxlalloc_apps.bench.decode_workers import (_install_sigterm, _kill_workers, gpu_free_bytes,  # noqa: E402,F401
                                                 run_inprocess, run_worker)


# ----------------------------------------------------------------- analysis
def load_ceilings(out_dir: str) -> Optional[Dict[str, Any]]:
    """The ``summary`` of ``<out_dir>/ceilings.json`` if it holds GPU measurements."""
    p = os.path.join(out_dir, "ceilings.json")
    try:
        with open(p) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if rec.get("simulated") or rec.get("status") not in ("ok", "partial"):
        return None
    s = rec.get("summary") or {}
    return s if s.get("hbm_read_gbps") else None


def link_for(row: Dict[str, Any], ceilings: Optional[Dict[str, Any]]) -> Tuple[Optional[float], Optional[str]]:
    """(link read GB/s, which measurement) for a row: its backend's zero-copy
    read rate; for the native variants the best host backend's."""
    if not ceilings:
        return None, None
    links = ceilings.get("link") or {}
    bk = row.get("backend")
    if bk and bk in links and links[bk].get("zero_copy_read_gbps"):
        return float(links[bk]["zero_copy_read_gbps"]), f"{bk} zero-copy read"
    best = max(((v.get("zero_copy_read_gbps") or 0, k) for k, v in links.items()), default=(0, None))
    if best[0]:
        return float(best[0]), f"{best[1]} zero-copy read (best backend)"
    return None, None


def analyse(rows: List[Dict[str, Any]], ceilings: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Add ceiling and ratio fields to each ok row; return the per-point summary."""
    hbm = ceilings.get("hbm_read_gbps") if ceilings else None
    by_point: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        by_point.setdefault((r["model"], r["context"], r["batch"]), []).append(r)
    summary = []
    for (m, c, b), rs in sorted(by_point.items()):
        s = SHAPES[m]
        kv_live = s.kv_bytes(b, c + rs[0]["new_tokens"] // 2)
        native = next((r for r in rs if r["variant"] == "native" and r.get("status") == "ok"), None)
        offl = next((r for r in rs if r["variant"] == "hf_offloaded" and r.get("status") == "ok"), None)
        for r in rs:
            if r.get("status") != "ok" or not r.get("decode_tokens_per_s"):
                continue
            f = r.get("measured_host_fraction")
            # Plain transformers never places anything on the host tier, whatever the budget.
            r["ceiling_host_fraction"] = f if f is not None else (
                0.0 if r["variant"] in ("native", "native_limit") else r["spill"])
            r["ceiling_host_fraction_source"] = "measured" if f is not None else "planned"
            if r["variant"] == "hf_offloaded":
                # All but ~2 layers' K/V live on the host; they are copied both ways every step.
                # The ceiling stays the same physical bound for KV on the host (each host byte
                # crosses the link once per step, read in place): the second copy is the
                # offloaded design's cost and shows in its ratio, by intent.
                r["ceiling_host_fraction"] = 1.0
                r["ceiling_host_fraction_source"] = "offloaded cache (all layers on the host)"
            link, src = link_for(r, ceilings)
            ceil = ceiling_tokens_per_s(b, s.weight_bytes(), kv_live, r["ceiling_host_fraction"], hbm, link)
            r["ceiling_tokens_per_s"] = ceil
            r["ceiling_link"] = {"hbm_read_gbps": hbm, "link_read_gbps": link, "link_source": src}
            r["ratio_to_ceiling"] = r["decode_tokens_per_s"] / ceil if ceil else None
            if native and native.get("decode_tokens_per_s"):
                r["ratio_to_native"] = r["decode_tokens_per_s"] / native["decode_tokens_per_s"]
                r["tokens_match_native"] = r.get("tokens_digest") == native.get("tokens_digest")
        for f in sorted({r["spill"] for r in rs if r["variant"] in ("cxlalloc", "policy_free", "native_limit")}):
            entry: Dict[str, Any] = {"model": m, "context": c, "batch": b, "spill": f, "kv_live_bytes": kv_live}
            for r in rs:
                if r["variant"] == "cxlalloc" and r["spill"] == f:
                    entry[f"cxlalloc:{r['backend']}"] = _brief(r)
                elif r["variant"] == "policy_free" and r["spill"] == f:
                    entry[f"policy_free:{r['backend']}"] = _brief(r)
                elif r["variant"] == "native_limit" and r["spill"] == f:
                    entry["native_limit"] = _brief(r)
            entry["native"] = _brief(native) if native else None
            entry["hf_offloaded"] = _brief(offl) if offl else None
            best = max((v for k, v in entry.items() if k.startswith("cxlalloc:") and v and v.get("tokens_per_s")),
                       key=lambda v: v["tokens_per_s"], default=None)
            if best:
                entry["best_cxlalloc"] = best
                t = best["tokens_per_s"]
                if offl and offl.get("decode_tokens_per_s"):
                    entry["cxlalloc_vs_offloaded"] = t / offl["decode_tokens_per_s"]
                pf = entry.get(f"policy_free:{best['backend']}")
                if pf and pf.get("tokens_per_s"):
                    entry["cxlalloc_vs_policy_free"] = t / pf["tokens_per_s"]
                if native and native.get("decode_tokens_per_s"):
                    entry["cxlalloc_vs_native"] = t / native["decode_tokens_per_s"]
                entry["cxlalloc_vs_ceiling"] = best.get("ratio_to_ceiling")
            summary.append(entry)
    return {"points": summary, "hbm_read_gbps": hbm, "ceilings_available": bool(ceilings)}


def _brief(r: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if not r:
        return None
    return {"status": r.get("status"), "backend": r.get("backend"), "tokens_per_s": r.get("decode_tokens_per_s"),
            "ttft_s": r.get("ttft_s"), "ratio_to_ceiling": r.get("ratio_to_ceiling"),
            "measured_host_fraction": r.get("measured_host_fraction"), "mode": r.get("mode")}


# ----------------------------------------------------------------- entry
def run(ctx) -> Dict[str, Any]:
    """The decode benchmark (see the module docstring).  ``ctx`` is a
    :class:`cxlalloc_apps.bench.cli.BenchContext`."""
    simulate = ctx.simulate
    # The quick grid keeps two spill fractions: its time box holds ~20 cells in 5 worker processes.
    fractions = tuple(ctx.args.fractions or (QUICK["fractions"] if ctx.quick and not simulate else FRACTIONS))
    backends = tuple(ctx.args.backends or BACKENDS)
    g = SIM if simulate else (QUICK if ctx.quick else FULL)
    new_tokens = int(ctx.args.new_tokens or g["new_tokens"])
    params = {"simulate": simulate, "quick": ctx.quick, "fractions": list(fractions), "backends": list(backends),
              "new_tokens": new_tokens,
              # as asked (None: the default grid); what ran is points/models/contexts/batches, set below
              "requested": {"models": ctx.args.models, "contexts": ctx.args.contexts, "batches": ctx.args.batches},
              "policy_free_backend": ctx.args.policy_free_backend, "budget_slack_bytes": BUDGET_SLACK,
              "prefill_tokens_per_chunk": PREFILL_TOKENS_PER_CHUNK, "dtype": "float32 (CPU)" if simulate else "bf16",
              "time_budget_s": ctx.deadline.remaining() if ctx.deadline.t_end else None,
              "variants": ["native", "native_limit", "hf_offloaded", "policy_free", "cxlalloc"],
              "method": ("transformers generate(), greedy, min_new_tokens = max_new_tokens; random prompt ids; "
                         "TTFT = time from generate() call to the first generated token reaching the streamer; "
                         "decode tokens/s = batch x (steps after the first token) / their wall time; timestamps "
                         "taken in a streamer after each step's token was copied to the CPU (a synchronisation)")}
    w = RecordWriter(ctx.out_dir, new_record("decode", params, simulate, ctx.argv, ctx.device))
    if simulate:
        w.note("SIMULATION: cxlalloc's simulated CUDA driver, a tiny model on the CPU; this checks the plumbing "
               "(placement, spill, records). Speeds are the CPU's and NOT comparable to any GPU number.")
        return _run_sim(ctx, w, fractions, backends, new_tokens)
    ok, reason = ctx.gpu_ready()
    if not ok:
        return w.finish_skipped("decode (GPU)", reason)
    free = gpu_free_bytes(ctx.device)
    w.record["parameters"]["free_bytes_at_start"] = free
    points = grid_points(ctx.quick, False, ctx.args.models, ctx.args.contexts, ctx.args.batches, free)
    if not points:
        return w.finish_skipped("decode (GPU)", f"no grid point fits 45% of the free VRAM ({free} bytes)")
    w.record["parameters"].update(effective_grid(points))
    w.record["parameters"]["shapes"] = {m: SHAPES[m].to_dict() for m in {p[0] for p in points}}
    groups = plan(points, fractions, backends, new_tokens, ctx.args.policy_free_backend)
    # Managed-memory guard before anything runs: refuse offending cells (recorded).
    for gname, grp in groups.items():
        allowed, refused = guard.split_grid(grp["cells"], free or 0)
        if free is None:
            allowed, refused = [c for c in grp["cells"] if not c["managed_bytes"]], [
                dict(c, refused="managed-memory guard: free VRAM unknown") for c in grp["cells"] if c["managed_bytes"]]
        for c in refused:
            w.add(dict(c, status="refused", reason=c.pop("refused"), group=gname,
                       method="not run: refused by the managed-memory guard before the run"))
        grp["cells"] = allowed
    work = os.path.join(ctx.out_dir, "decode_work")
    os.makedirs(work, exist_ok=True)
    rows: List[Dict[str, Any]] = []
    names = [n for n in groups if groups[n]["cells"]]
    total_cells = sum(len(groups[n]["cells"]) for n in names)
    left = total_cells
    for name in names:
        grp = groups[name]
        if grp["kind"] == "cxlalloc":
            assign_budgets(grp["cells"], rows)
        rem = ctx.deadline.remaining()
        share = rem if rem == float("inf") else max(30.0, rem * len(grp["cells"]) / max(left, 1))
        left -= len(grp["cells"])
        if rem != float("inf") and rem < 20:
            for c in grp["cells"]:
                r = dict(c, status="not_run", reason="time budget of the decode benchmark used up", group=name,
                         method="not run")
                rows.append(r)
                w.add(r)
            continue
        opts = dict(grp["options"])
        if grp["kind"] == "cxlalloc":
            first = next((c["budget_bytes"] for c in grp["cells"] if c.get("budget_bytes")), None)
            if first:
                opts["device_limit"] = int(first)
        spec = {"group": name, "kind": grp["kind"], "device": ctx.device, "device_type": "cuda",
                "deadline_unix": time.time() + share, "cxlalloc_options": opts, "free_bytes_at_start": free,
                "cells": grp["cells"]}
        ctx.log(f"decode: running {name} ({len(grp['cells'])} cells, time box {share:.0f} s)")
        timeout = share + WORKER_GRACE_S if share != float("inf") else 24 * 3600
        timeout = min(timeout, max(ctx.deadline.remaining(), 10.0))
        for r in run_worker(spec, work, timeout, log=ctx.log):
            if r.get("status") == "ok":
                r.pop("traceback", None)
            r.setdefault("method", "transformers generate() in a worker process per variant group "
                                   "(see parameters.method)")
            rows.append(r)
            w.add(r)  # on disk at once: a run cut short keeps every finished cell
    # Analysis fills ceiling and ratio fields into the same row dicts (they are the record's results).
    summary = analyse(rows, load_ceilings(ctx.out_dir))
    if not summary["ceilings_available"]:
        w.note("no GPU ceilings.json in the output folder: ratios to the link-bound ceiling are not computed "
               "(run the ceilings benchmark first, in the same --out folder)")
    w.record["summary"] = summary
    return w.finish(w.status_from_rows())


def _run_sim(ctx, w, fractions, backends, new_tokens) -> Dict[str, Any]:
    try:
        import transformers  # noqa: F401
    except Exception as e:
        return w.finish_skipped("decode (simulation)", f"transformers is not importable: {e}")
    args = ctx.args
    err = sim_grid_error(args.models, args.contexts, args.batches, new_tokens)
    if err:  # the command line refuses it first; a direct call is refused here
        return w.finish_skipped("decode (simulation)", err)
    points = grid_points(False, True, args.models, args.contexts, args.batches)
    w.record["parameters"].update(effective_grid(points))
    w.record["parameters"]["shapes"] = {m: SHAPES[m].to_dict() for m in {p[0] for p in points}}
    groups = plan(points, fractions, backends, new_tokens, ctx.args.policy_free_backend, simulate=True)
    try:
        import cxlalloc.hf as hf

        have_wrap = hasattr(hf, "wrap")
    except Exception:
        have_wrap = False
    rows: List[Dict[str, Any]] = []
    import torch

    threads = torch.get_num_threads()  # the in-process worker sets 1; restored below
    try:
        _sim_groups(ctx, w, groups, have_wrap, rows)
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        r = dict(r)
        r["simulated"] = True
        r.setdefault("method", "SIMULATION: transformers generate() on the CPU (one torch thread), weights and KV "
                               "in cxlalloc's simulated tiers (cxlalloc.hf.wrap(model, simulate=True)); not a GPU "
                               "measurement")
        w.add(r)
    w.record["summary"] = {"simulated": True, "points": [], "note": "simulation: no ratios are computed"}
    return w.finish(w.status_from_rows() if rows else None)


def _sim_groups(ctx, w, groups, have_wrap, rows) -> None:
    for name, grp in groups.items():
        if ctx.deadline.expired():
            w.skip(name, "time budget used up")
            continue
        if grp["kind"] == "cxlalloc" and not have_wrap:
            w.skip(name, "cxlalloc.hf.wrap is not in this build (branch 'hf' not merged): the simulated cxlalloc "
                         "decode needs it")
            continue
        if grp["kind"] == "cxlalloc":
            assign_budgets(grp["cells"], rows, simulate=True)
        opts = dict(grp["options"])
        spec = {"group": name, "kind": grp["kind"], "global": False, "device": 0, "device_type": "cpu",
                "deadline_unix": time.time() + max(ctx.deadline.remaining(), 1) if ctx.deadline.t_end else None,
                "cxlalloc_options": opts, "free_bytes_at_start": None, "cells": grp["cells"]}
        for c in spec["cells"]:
            c["managed_bytes"] = 0  # simulated memory: no GPU to protect
        try:
            got = run_inprocess(spec)
        except Exception as e:
            w.error(name, e)
            continue
        rows.extend(got)
