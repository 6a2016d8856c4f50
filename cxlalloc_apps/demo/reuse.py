"""The main job with ``--reuse``: KV that outlives a request, shown on the default document.

The same sequence of requests runs twice on one wrapped model (same device
limit, same allocator), first with reuse off for every call
(``generate(..., kv_reuse=False)``: every prompt is prefilled in full, the
"cold" TTFT), then with reuse on:

1. the default document is asked each of :data:`QUESTIONS` in a row: every
   prompt starts with the same ~1,800-token document, so from the second
   question on its KV blocks are a hit;
2. a chat continues from the last question: each turn's prompt is the whole
   conversation re-rendered by the chat template (the previous prompt, the
   model's answer, a follow-up), so the previous turn's prompt *and answer*
   are a hit as far as the re-tokenized answer matches the generated tokens.

The report gives, per request: prompt tokens, TTFT without and with reuse,
hit tokens, bytes loaded and the NUMA node they came from, and whether the
tokens are identical to the run without reuse; then the median TTFT of the
requests with a hit against the same requests without reuse, and the largest
logit difference between the two runs (floating point: a hit reads K/V that
an earlier, longer prefill computed).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import List, Optional

from cxlalloc.config import format_bytes
from cxlalloc_apps.demo.measure import Timer

FOLLOW_UPS = [
    "Summarize your last answer in one short sentence.",
    "Which other station of the network does the report mention most often?",
]


def _chat_ids(tok, messages, device):
    import torch

    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    else:
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"
        ids = tok(text, return_tensors="pt")["input_ids"]
    return ids.to(device), torch.ones_like(ids).to(device)


def _plan(document: str, questions: List[str]):
    """(kind, user message) of each request: the questions, then the chat turns."""
    intro = "Read the report below and answer the question after it.\n\n"
    out = [("question", f"{intro}{document}\n\nQuestion: {q}\nAnswer briefly, using only the report.")
           for q in questions]
    out += [("chat", f) for f in FOLLOW_UPS]
    return out


def run_requests(model, tok, plan, args, pad_id, device, reuse: bool, progress=None) -> List[dict]:
    """Run every request of ``plan`` in order; returns one row per request.

    ``progress``: a :class:`cxlalloc_apps.demo.progress.Progress` shown per request, or None."""
    import cxlalloc.hf as hf

    rows = []
    history: Optional[list] = None
    for i, (kind, text) in enumerate(plan):
        if kind == "question":
            history = [{"role": "user", "content": text}]
        else:
            history = history + [{"role": "user", "content": text}]
        ids, mask = _chat_ids(tok, history, device)
        desc = f"{'reuse' if reuse else 'no reuse'} {i + 1}/{len(plan)}"
        timer = Timer(progress.generation(desc, int(ids.shape[1]), 1, args.max_new_tokens)
                      if progress is not None else None)
        timer.start()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=pad_id, return_dict_in_generate=True, output_scores=True, streamer=timer,
                             kv_reuse=reuse)
        wall = time.perf_counter() - timer.t0
        rec = hf.stats(model)["hf"]["reuse"]["last"] or {}
        gen_ids = out.sequences[0, ids.shape[1]:]
        answer = tok.decode(gen_ids, skip_special_tokens=True).strip()
        history = history + [{"role": "assistant", "content": answer}]
        rows.append({
            "request": i + 1, "kind": kind, "prompt_tokens": int(ids.shape[1]),
            "ttft_ms": timer.summary(int(ids.shape[1]), 1)["ttft_ms"], "wall_s": wall,
            "new_tokens": int(gen_ids.numel()), "hit_tokens": int(rec.get("hit_tokens") or 0),
            "bytes_loaded": int(rec.get("bytes_loaded") or 0), "load_ms": float(rec.get("load_ms") or 0.0),
            "stored_blocks": int(rec.get("stored_blocks") or 0), "fallback": rec.get("fallback"),
            "answer": answer, "sequences": out.sequences.cpu(), "scores": [s.cpu() for s in out.scores],
        })
    return rows


def _max_logit_diff(a: List, b: List) -> float:
    import torch

    worst = 0.0
    for x, y in zip(a, b):
        fin = torch.isfinite(x) & torch.isfinite(y)
        if fin.any():
            worst = max(worst, float((x[fin] - y[fin]).abs().max()))
    return worst


def compare(cold: List[dict], warm: List[dict]) -> dict:
    """Identical tokens per request, the largest logit difference, and TTFT
    of the requests with a hit (median, ms) with and without reuse."""
    import torch

    for c, w in zip(cold, warm):
        w["identical"] = bool(torch.equal(c["sequences"], w["sequences"]))
        w["max_logit_diff"] = _max_logit_diff(c["scores"], w["scores"]) if w["identical"] else None
        w["cold_ttft_ms"] = c["ttft_ms"]
    hit = [w for w in warm if w["hit_tokens"] > 0]
    out = {
        "identical_tokens": all(w["identical"] for w in warm),
        "max_logit_diff": max((w["max_logit_diff"] or 0.0) for w in warm),
        "requests": len(warm), "requests_with_hit": len(hit),
        "hit_ttft_ms": statistics.median(w["ttft_ms"] for w in hit) if hit else None,
        "cold_ttft_ms": statistics.median(w["cold_ttft_ms"] for w in hit) if hit else None,
    }
    out["warm_over_cold"] = (out["hit_ttft_ms"] / out["cold_ttft_ms"]) if hit and out["cold_ttft_ms"] else None
    return out


def print_report(run: dict, warm: List[dict], summary: dict, store: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console(width=None if sys.stdout.isatty() else 120)
    t = Table(title="KV reuse across requests (the same requests without and with reuse)", title_justify="left")
    for c in ("#", "request", "prompt", "TTFT no reuse", "TTFT reuse", "hit tokens", "loaded", "from",
              "identical"):
        t.add_column(c, justify="left" if c in ("request", "from") else "right")
    for w in warm:
        where = f"node {store.get('node')}" if w["bytes_loaded"] else ("miss" if not w.get("fallback") else
                                                                         "fallback: recompute")
        t.add_row(str(w["request"]), "question" if w["kind"] == "question" else "chat turn",
                  f"{w['prompt_tokens']:,}", f"{w['cold_ttft_ms']:,.0f} ms", f"{w['ttft_ms']:,.0f} ms",
                  f"{w['hit_tokens']:,}", format_bytes(w["bytes_loaded"]) if w["bytes_loaded"] else "-", where,
                  "yes" if w["identical"] else "NO")
    con.print(t)
    if run["mode"] == "simulation":
        con.print("  SIMULATION: the saved time is real prefill compute on this CPU; the load is a CPU memory copy "
                  "from the store's host arena (on a GPU it is a copy-engine transfer over the link)")
    st = Table(title="KV store", show_header=False, title_justify="left")
    st.add_column("", style="bold")
    st.add_column("")
    st.add_row("where", f"{store.get('kind')} store, NUMA node {store.get('node')} "
                        f"(placement {store.get('numa_method')}: {format_bytes(store.get('placement_verified_bytes', 0))}"
                        f" verified, {format_bytes(store.get('placement_misplaced_bytes', 0))} misplaced)")
    st.add_row("capacity / used", f"{format_bytes(store.get('capacity_bytes'))} / "
                                  f"{format_bytes(store.get('used_bytes'))} in {store.get('blocks')} blocks "
                                  f"of {run.get('block_tokens')} tokens")
    st.add_row("lookups / hit rate", f"{store.get('lookups')} / {100 * (store.get('hit_rate') or 0):.0f}% of blocks")
    rate = store.get("load_GBps")
    st.add_row("loaded", f"{format_bytes(store.get('bytes_loaded'))}" + (f" at {rate:.2f} GB/s" if rate else ""))
    con.print(st)
    if summary["hit_ttft_ms"] is not None:
        con.print(f"Warm TTFT (requests with a hit, median): {summary['hit_ttft_ms']:,.0f} ms vs "
                  f"{summary['cold_ttft_ms']:,.0f} ms without reuse: {summary['warm_over_cold']:.2f} of cold "
                  f"({1 / summary['warm_over_cold']:.1f}x faster)")
    con.print(f"Largest logit difference vs no reuse: {summary['max_logit_diff']:.2e} (floating point: a hit reads "
              "K/V an earlier, longer prefill computed)")
    con.print(f"Identical tokens: {'yes' if summary['identical_tokens'] else 'NO'}")
