"""Planned vs measured: the planner's decode and prefix-load bounds against the
records one ``cxlalloc bench`` run wrote (``scripts/gpu_check.sh``'s ``plan`` step).

    python -m cxlalloc.plan.check RESULTS_DIR [--out plan_check.json]

For each measured row it computes what the planner's formulas give from the
same run's measured ceilings (``ceilings.json``: HBM read rate, host-tier
zero-copy read rate) and the row's own bytes, and the error
``measured / planned - 1`` (positive: slower than the bound):

* ``decode.json`` rows (``status`` ok): TPOT = ``batch / decode_tokens_per_s``
  against ``t_step = (W + (1 - f) K) / B_hbm + f K / B_link`` with ``W`` the
  row's ``weight_bytes``, ``K`` its live KV bytes (``kv_final_bytes``) and ``f``
  its ``spill`` share (:mod:`cxlalloc.plan.planner`);
* ``reuse.json`` ``ttft`` rows: the prefix load ``load_ms`` against
  ``bytes_loaded / link_gbps`` (the row's measured H2D rate); and, for the
  GPU run's ``llama-8b`` shape on a GPU with a preset, the cold TTFT
  (``recompute_ttft_ms``) against the planner's prefill bound at
  ``DEFAULT_MFU``, with the MFU the measurement implies.

Rows without the numbers needed are listed under ``skipped`` with the reason.
Writes JSON; never needs a GPU (it reads records).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from cxlalloc.plan import hardware
from cxlalloc.plan.layout import read_layout
from cxlalloc.plan.planner import PlanModel

DEFAULT_MFU = 0.4
# The models the reuse benchmark runs, by the label its record carries, as configs
# (cxlalloc_apps/bench/model.py's ``llama-8b`` shape: Llama-3.1-8B with a 32,000-token vocabulary).
RECORD_MODELS = {
    "llama-8b shape": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                       "head_dim": 128, "vocab_size": 32000, "tie_word_embeddings": False},
}


def _prefill_model(rec: Dict[str, Any]) -> Optional[PlanModel]:
    label = str((rec.get("parameters") or {}).get("model") or "")
    cfg = next((c for k, c in RECORD_MODELS.items() if label.startswith(k)), None)
    name = str(((rec.get("hardware") or {}).get("gpu") or {}).get("name") or "")
    gpu = next((g for g in hardware.GPUS.values() if g.match.lower() in name.lower()), None)
    if cfg is None or gpu is None or rec.get("simulated"):
        return None
    return PlanModel(read_layout(cfg), 0, 2, gpu.hbm_bytes, gpu.hbm_gbps, gpu.link_gbps, gpu.bf16_tflops, 1.0, 0, 0,
                  2 << 20)


def _load(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _link(ceil: Optional[Dict[str, Any]]) -> Optional[float]:
    rates = [v.get("zero_copy_read_gbps") for v in ((ceil or {}).get("summary", {}).get("link") or {}).values()
             if isinstance(v, dict) and v.get("zero_copy_read_gbps")]
    return max(rates) if rates else None


def compare(results: str) -> Dict[str, Any]:
    """Planned vs measured for the records in folder ``results`` (see the module docstring)."""
    ceil = _load(os.path.join(results, "ceilings.json"))
    hbm = ((ceil or {}).get("summary") or {}).get("hbm_read_gbps")
    link = _link(ceil)
    out: Dict[str, Any] = {"results": results, "hbm_read_gbps": hbm, "link_read_gbps": link,
                           "decode": [], "reuse": [], "skipped": []}
    dec = _load(os.path.join(results, "decode.json"))
    for r in (dec or {}).get("results", []):
        rid = r.get("id") or f"{r.get('variant')}|{r.get('model')}|{r.get('context')}|{r.get('batch')}"
        if r.get("status") != "ok" or not r.get("decode_tokens_per_s"):
            continue
        f = float(r.get("spill") or 0.0)
        W, K, b = r.get("weight_bytes"), r.get("kv_final_bytes"), r.get("batch")
        if not (hbm and W and K and b) or (f > 0 and not link):
            out["skipped"].append({"id": rid, "why": "no measured HBM/link rate or no weight/KV bytes in the row"})
            continue
        planned = (W + (1 - f) * K) / (hbm * 1e9) + (f * K / (link * 1e9) if f else 0.0)
        measured = b / r["decode_tokens_per_s"]
        out["decode"].append({"id": rid, "variant": r.get("variant"), "backend": r.get("backend"),
                              "context": r.get("context"), "batch": b, "spill": f,
                              "planned_tpot_ms": planned * 1e3, "measured_tpot_ms": measured * 1e3,
                              "error": measured / planned - 1})
    reu = _load(os.path.join(results, "reuse.json"))
    pm = _prefill_model(reu or {})
    for r in (reu or {}).get("results", []):
        if r.get("kind") != "ttft" or r.get("status") != "ok":
            continue
        if not (r.get("bytes_loaded") and r.get("link_gbps") and r.get("load_ms")):
            out["skipped"].append({"id": r.get("part"), "why": "no bytes_loaded / link_gbps / load_ms"})
            continue
        planned = r["bytes_loaded"] / (r["link_gbps"] * 1e9)
        out["reuse"].append({"id": r.get("part"), "prefix_tokens": r.get("prefix_tokens"),
                             "planned_load_ms": planned * 1e3, "measured_load_ms": r["load_ms"],
                             "error": r["load_ms"] / 1e3 / planned - 1,
                             "measured_hit_ttft_ms": r.get("hit_ttft_ms"),
                             "measured_recompute_ttft_ms": r.get("recompute_ttft_ms")})
        if pm is not None and r.get("prompt_tokens") and r.get("recompute_ttft_ms"):
            peak_s = pm.prefill_s(r["prompt_tokens"], r["prompt_tokens"], 1)  # at 100% of the dense peak
            row = out["reuse"][-1]
            row["planned_cold_ttft_ms"] = peak_s / DEFAULT_MFU * 1e3
            row["cold_ttft_error"] = r["recompute_ttft_ms"] / row["planned_cold_ttft_ms"] - 1
            row["implied_mfu"] = peak_s * 1e3 / r["recompute_ttft_ms"]
    for key in ("decode", "reuse"):
        errs = [abs(x["error"]) for x in out[key]]
        out[f"{key}_max_abs_error"] = max(errs) if errs else None
    out["simulated"] = bool((dec or {}).get("simulated") or (reu or {}).get("simulated"))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cxlalloc.plan.check",
                                description="planned vs measured decode/prefix-load times of one bench run")
    p.add_argument("results", help="folder holding the run's ceilings.json, decode.json, reuse.json")
    p.add_argument("--out", default=None, help="write the comparison here (default: RESULTS/plan_check.json)")
    a = p.parse_args(argv)
    if not os.path.isdir(a.results):
        p.error(f"results: {a.results!r} is not a folder")
    rec = compare(a.results)
    path = a.out or os.path.join(a.results, "plan_check.json")
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"plan check: {len(rec['decode'])} decode rows (max |error| {rec['decode_max_abs_error']}), "
          f"{len(rec['reuse'])} reuse rows (max |error| {rec['reuse_max_abs_error']}), "
          f"{len(rec['skipped'])} skipped; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
