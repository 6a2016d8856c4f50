"""Continuous batching: a stream of requests over long documents, plain vs tiered.

One process, one run, the same model and the same request stream for every
variant (side by side):

``plain``
    transformers' own continuous batching (``init_continuous_batching``) with
    a paged cache of ``budget // block_bytes`` blocks: what fits in the device
    budget for KV.
``wrapped``
    the same model wrapped (:func:`cxlalloc.hf.wrap`, ``device_limit`` = its
    weights' segment + the same KV budget, the host tier behind it) with
    ``num_blocks`` left to cxlalloc (device room + as much again on the host
    tier).
``wrapped+store``
    as ``wrapped`` with ``kv_store=True`` (the in-process store): complete
    blocks are written through, and a prefix the paged cache forgot is loaded
    instead of prefilled.

The stream (seeded): ``documents`` long documents (``doc_tokens`` each) picked
with Zipf popularity (``P(rank k) ~ 1 / k**zipf_s``); ``rag`` requests (a
document + a ``question_tokens`` question, all arriving at once) and ``chats``
two-turn conversations (turn 2 = turn 1's prompt + its reply + a new
question, submitted when turn 1 finishes).  Greedy, ``new_tokens`` each.

Per variant: requests in flight (most at once: overlapping
``GenerationOutput.lifespan`` intervals, the same for every variant),
throughput (generated tokens / wall seconds), TTFT p50/p99 (first token's
``timestamps[0]`` - ``created_time``; ms), preemptions (requests evicted:
swapped or reset, counted at transformers' ``OffloadingManager``), prefix
tokens found in the paged cache (``search_prefix_match``), and for the wrapped
variants cxlalloc's counters (``hf.stats()["hf"]["continuous_batching"]``:
store hits, re-prefills avoided, KV bytes per tier).

``probe``: after the stream, a fresh manager (what a restart or another
process sees) answers one question per document, one at a time: TTFT of
plain's full prefill of the ``doc_tokens`` prefix vs the wrapped+store
variant's load from the store.

A larger budget (everything fits in the device tier; ``no-spill``) runs
``plain`` and ``wrapped`` again: the throughput ratio is cxlalloc's overhead
when nothing spills (goal <= 3 %).

CPU (simulation): a tiny Llama (4 layers, fp32, random weights), 2,048-token
documents; the tiers are the simulated driver's and compute is the CPU's.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from cxlalloc_apps.bench.meta import RecordWriter, new_record

MiB = 1 << 20
WEIGHT_SEGMENT = 4 * MiB  # the tiny model's weights fill one 4 MiB device segment of the wrapped model


@dataclasses.dataclass
class Workload:
    documents: int = 6
    doc_tokens: int = 2048
    question_tokens: int = 16
    new_tokens: int = 8
    rag: int = 14
    chats: int = 3
    zipf_s: float = 1.1
    page: int = 64
    budget_blocks: int = 48  # the device KV budget, in blocks (plain's num_blocks)
    max_batch_tokens: int = 512
    seed: int = 0


QUICK = Workload(documents=3, doc_tokens=1024, rag=6, chats=2, budget_blocks=24)


def _model(device: str = "cpu", vocab: int = 1000):
    """The benchmark's tiny Llama (random weights, fp32) on ``device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        head_dim=32, vocab_size=vocab, max_position_embeddings=8192)).eval().to(device)


def block_bytes(model, page: int) -> int:
    """Bytes of one paged-cache block over every layer: 2 (K, V) x layers x KV heads x head dim x dtype x page."""
    c = model.config
    elem = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elem * page


def make_stream(w: Workload, vocab: int) -> Tuple[List[List[int]], List[dict]]:
    """(documents, requests): each request is ``{"kind": "rag"|"chat", "doc": i,
    "prompt": ids}`` (a chat's ``"follow_up"``: its second question)."""
    import random

    rng = random.Random(w.seed)
    docs = [[rng.randrange(3, vocab) for _ in range(w.doc_tokens)] for _ in range(w.documents)]
    weights = [1.0 / (k + 1) ** w.zipf_s for k in range(w.documents)]

    def question():
        return [rng.randrange(3, vocab) for _ in range(w.question_tokens)]

    reqs = []
    for kind, n in (("rag", w.rag), ("chat", w.chats)):
        for _ in range(n):
            d = rng.choices(range(w.documents), weights)[0]
            r = {"kind": kind, "doc": d, "prompt": docs[d] + question()}
            if kind == "chat":
                r["follow_up"] = question()
            reqs.append(r)
    rng.shuffle(reqs)
    return docs, reqs


class _Counts:
    """Class-level counters on transformers' continuous-batching internals
    (the same for plain and wrapped): preempted requests and prefix tokens the
    paged cache matched.  Installed for one run; outermost calls only."""

    def __init__(self):
        self.preempted = 0
        self.swapped = 0
        self.prefix_hit_tokens = 0
        self._tls = threading.local()
        self._undo: List[Tuple[Any, str, Any]] = []

    def install(self, classes) -> None:
        from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

        counts = self

        def wrap_offload(orig):
            def _offload_to_cpu(self, offloaded, tables):
                got = orig(self, offloaded, tables)
                counts.preempted += len(offloaded)
                counts.swapped += len(got or ())
                return got
            return _offload_to_cpu

        def wrap_search(orig):
            def search_prefix_match(self, request_id, prompt_ids):
                depth = getattr(counts._tls, "depth", 0)
                counts._tls.depth = depth + 1
                try:
                    n = orig(self, request_id, prompt_ids)
                finally:
                    counts._tls.depth = depth
                if depth == 0:
                    counts.prefix_hit_tokens += int(n or 0)
                return n
            return search_prefix_match

        self._patch(OffloadingManager, "_offload_to_cpu", wrap_offload)
        for cls in classes:
            if "search_prefix_match" in cls.__dict__:
                self._patch(cls, "search_prefix_match", wrap_search)

    def _patch(self, cls, name, make) -> None:
        orig = cls.__dict__[name]
        self._undo.append((cls, name, orig))
        setattr(cls, name, make(orig))

    def remove(self) -> None:
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)
        self._undo.clear()


def _cache_classes():
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    import cxlalloc.hf as hf

    tiered = getattr(hf, "CxlPagedAttentionCache", None)  # the wrapped model's paged cache, where cxlalloc has one
    return [PagedAttentionCache] + ([tiered] if tiered is not None else [])


def _percentile(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _max_in_flight(spans: List[Tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def run_stream(model, cb_config, gen, reqs: List[dict], timeout: float = 600.0) -> Dict[str, Any]:
    """Serve ``reqs`` on one manager; returns per-request outputs and the wall time."""
    mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
    mgr.start()
    outs: Dict[str, Any] = {}
    meta: Dict[str, dict] = {}
    t0 = time.perf_counter()
    try:
        for i, r in enumerate(reqs):
            rid = mgr.add_request(r["prompt"], request_id=f"r{i}", max_new_tokens=gen.max_new_tokens,
                                  record_timestamps=True)
            meta[rid] = dict(r, turn=1)
        expected = len(reqs) + sum(1 for r in reqs if r["kind"] == "chat")
        deadline = time.monotonic() + timeout
        while len(outs) < expected:
            res = mgr.get_result(timeout=max(1.0, deadline - time.monotonic()))
            if res is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"continuous batching answered {len(outs)} of {expected} requests in "
                                       f"{timeout:.0f} s")
                continue
            if res.error:
                raise RuntimeError(f"request {res.request_id} failed: {res.error}")
            outs[res.request_id] = res
            m = meta[res.request_id]
            if m["kind"] == "chat" and m["turn"] == 1:
                prompt = m["prompt"] + list(res.generated_tokens) + m["follow_up"]
                rid = mgr.add_request(prompt, request_id=res.request_id + "t2", max_new_tokens=gen.max_new_tokens,
                                      record_timestamps=True)
                meta[rid] = dict(m, prompt=prompt, turn=2)
        wall = time.perf_counter() - t0
    finally:
        mgr.stop(block=True, timeout=60)
    return {"outs": outs, "meta": meta, "wall_s": wall}


def summarize(res: Dict[str, Any]) -> Dict[str, Any]:
    outs = list(res["outs"].values())
    ttft = [(o.timestamps[0] - o.created_time) * 1e3 for o in outs if o.timestamps]
    spans = [tuple(o.lifespan) for o in outs if o.lifespan[0] > 0 and o.lifespan[1] > 0]
    tokens = sum(len(o.generated_tokens) for o in outs)
    return {"requests": len(outs), "generated_tokens": tokens, "wall_s": round(res["wall_s"], 3),
            "tokens_per_s": round(tokens / res["wall_s"], 2), "ttft_p50_ms": round(_percentile(ttft, 0.5), 2),
            "ttft_p99_ms": round(_percentile(ttft, 0.99), 2), "max_in_flight": _max_in_flight(spans),
            "prompt_tokens": sum(len(res["meta"][o.request_id]["prompt"]) for o in outs)}


def probe(model, cb_config, gen, docs: List[List[int]], question_tokens: int, seed: int) -> List[float]:
    """TTFT (ms) of one question per document on a fresh manager, one request at a time."""
    import random

    rng = random.Random(seed + 7)
    vocab = int(model.config.vocab_size)
    mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
    mgr.start()
    out = []
    try:
        for i, d in enumerate(docs):
            prompt = d + [rng.randrange(3, vocab) for _ in range(question_tokens)]
            rid = mgr.add_request(prompt, request_id=f"p{i}", max_new_tokens=2, record_timestamps=True)
            res = mgr.get_result(request_id=rid, timeout=300)
            if res is None or res.error or not res.timestamps:
                raise RuntimeError(f"probe request {rid} did not finish: {getattr(res, 'error', 'timeout')}")
            out.append((res.timestamps[0] - res.created_time) * 1e3)
    finally:
        mgr.stop(block=True, timeout=60)
    return out


def _variant(name: str, w: Workload, budget_blocks: int, docs, reqs, gen, *, wrapped: bool, store: bool,
             probe_docs: bool, fixed_blocks: bool = False, device: str = "cpu") -> Dict[str, Any]:
    import cxlalloc.hf as hf
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _model(device)
    bb = block_bytes(model, w.page)
    kw = dict(page_size=w.page, max_batch_tokens=w.max_batch_tokens)
    if wrapped:
        opts = dict(device_limit=WEIGHT_SEGMENT + budget_blocks * bb, host_limit=512 * MiB, device_headroom=0)
        if store:
            opts["kv_store"] = True
        model = hf.wrap(model, **opts)
    if not wrapped or fixed_blocks:  # no-spill: the wrapped cache gets plain's blocks, all of them in VRAM
        kw["num_blocks"] = budget_blocks
    counts = _Counts()
    counts.install(_cache_classes())
    try:
        res = run_stream(model, ContinuousBatchingConfig(**kw), gen, reqs)
        row = summarize(res)
        row.update(preemptions=counts.preempted, swapped=counts.swapped, reset_and_reprefilled=counts.preempted
                   - counts.swapped, vram_prefix_hit_tokens=counts.prefix_hit_tokens)
        if probe_docs:
            row["probe_ttft_ms"] = [round(x, 2) for x in probe(model, ContinuousBatchingConfig(**kw), gen, docs,
                                                                 w.question_tokens, w.seed)]
    finally:
        counts.remove()
    row.update(variant=name, budget_blocks=budget_blocks, block_bytes=bb, budget_bytes=budget_blocks * bb,
               tokens={rid: list(o.generated_tokens) for rid, o in res["outs"].items()})
    if wrapped:
        s = hf.stats(model)["hf"].get("continuous_batching") or {}
        c, cache = s.get("counters") or {}, s.get("cache") or {}
        row["tiered"] = s.get("tiered")
        row["cxlalloc"] = {k: c.get(k) for k in ("max_requests_in_flight", "preemptions", "store_hit_tokens",
                                                 "store_hit_blocks", "reprefills_avoided", "stored_blocks",
                                                 "vram_hit_tokens", "peak_kv_device_bytes", "peak_kv_host_bytes",
                                                 "promoted_bytes", "demoted_bytes")}
        row["num_blocks"] = cache.get("num_blocks")
    else:
        row["num_blocks"] = budget_blocks
    return row


def run(ctx) -> Dict[str, Any]:
    """``bench --only cb``: the record ``cb.json`` (and ``cb.png``)."""
    import torch
    from transformers import GenerationConfig

    w = QUICK if ctx.quick else Workload()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    on_gpu = ctx.gpu_ready()[0]
    params = dataclasses.asdict(w)
    params.update(model="tiny Llama (4 layers, hidden 128, 4 KV heads x 32, fp32, random weights)",
                  no_spill_budget_blocks=None, units="ms, tokens/s, bytes",
                  timer="time.perf_counter (transformers' GenerationOutput created_time / timestamps / lifespan)")
    device = f"cuda:{ctx.device}" if on_gpu else "cpu"
    params["device"] = device
    wr = RecordWriter(ctx.out_dir, new_record("cb", params, not on_gpu, ctx.argv, ctx.device))
    if not on_gpu:
        wr.note("CPU run: the simulated CUDA driver holds the tiers and the model computes on the CPU; throughput "
                "and TTFT are CPU compute, not GPU figures")
    model = _model()
    docs, reqs = make_stream(w, int(model.config.vocab_size))
    bb = block_bytes(model, w.page)
    per_request = -(-(w.doc_tokens + 2 * w.question_tokens + 2 * w.new_tokens) // w.page)
    all_blocks = per_request * (len(reqs) + w.chats) + 8
    wr.record["parameters"].update(no_spill_budget_blocks=all_blocks, block_bytes=bb, batch_kv_bytes=all_blocks * bb,
                                   requests=len(reqs) + w.chats)
    del model
    gen = GenerationConfig(max_new_tokens=w.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    plan = [("plain", w.budget_blocks, False, False, True), ("wrapped", w.budget_blocks, True, False, False),
            ("wrapped+store", w.budget_blocks, True, True, True),
            ("plain no-spill", all_blocks, False, False, False), ("wrapped no-spill", all_blocks, True, False, False)]
    # Warm-up (not recorded): the first manager of a process pays one-time costs (kernels, threads, the
    # simulated driver's first mappings) that would otherwise land on whichever variant runs first.
    ctx.log("bench cb: warm-up")
    warm = dataclasses.replace(w, documents=1, rag=2, chats=0)
    _variant("warm-up", warm, all_blocks, *make_stream(warm, 1000), gen, wrapped=False, store=False, probe_docs=False,
             device=device)
    _variant("warm-up", warm, w.budget_blocks, *make_stream(warm, 1000), gen, wrapped=True, store=True,
             probe_docs=False, device=device)
    rows: Dict[str, dict] = {}
    for name, budget, wrapped, store, probe_docs in plan:
        if ctx.deadline.expired():
            wr.skip(name, "time budget")
            continue
        ctx.log(f"bench cb: {name} ({budget} blocks of device budget)")
        try:
            row = _variant(name, w, budget, docs, reqs, gen, wrapped=wrapped, store=store, probe_docs=probe_docs,
                           fixed_blocks="no-spill" in name, device=device)
        except Exception as e:
            wr.error(name, e)
            continue
        rows[name] = row
        wr.add(dict({k: v for k, v in row.items() if k != "tokens"}, kind="variant", status="ok",
                    method="one ContinuousBatchingManager per variant, the same seeded request stream"))
    ref = rows.get("plain", {}).get("tokens")
    summary: Dict[str, Any] = {}
    for name, row in rows.items():
        if ref is not None and name != "plain":
            base = rows["plain no-spill"]["tokens"] if "no-spill" in name and "plain no-spill" in rows else ref
            summary[f"{name}: tokens identical to plain"] = row["tokens"] == base
    p, t, s = rows.get("plain"), rows.get("wrapped"), rows.get("wrapped+store")
    if p and t:
        summary["in_flight_ratio_wrapped_vs_plain"] = round(t["max_in_flight"] / max(1, p["max_in_flight"]), 2)
        summary["throughput_ratio_wrapped_vs_plain"] = round(t["tokens_per_s"] / p["tokens_per_s"], 3)
    if p and s:
        summary["in_flight_ratio_store_vs_plain"] = round(s["max_in_flight"] / max(1, p["max_in_flight"]), 2)
        summary["throughput_ratio_store_vs_plain"] = round(s["tokens_per_s"] / p["tokens_per_s"], 3)
        summary["ttft_p50_ratio_store_vs_plain"] = round(s["ttft_p50_ms"] / p["ttft_p50_ms"], 3)
        if p.get("probe_ttft_ms") and s.get("probe_ttft_ms"):
            summary["probe_ttft_ms_plain_median"] = round(statistics.median(p["probe_ttft_ms"]), 2)
            summary["probe_ttft_ms_store_median"] = round(statistics.median(s["probe_ttft_ms"]), 2)
            summary["probe_ttft_ratio_store_vs_plain"] = round(
                summary["probe_ttft_ms_store_median"] / summary["probe_ttft_ms_plain_median"], 3)
    pn, tn = rows.get("plain no-spill"), rows.get("wrapped no-spill")
    if pn and tn:
        summary["no_spill_overhead"] = round(1 - tn["tokens_per_s"] / pn["tokens_per_s"], 3)
    wr.record["summary"] = summary
    wr.flush()
    rec = wr.finish()
    try:
        plot(rec, os.path.join(ctx.out_dir, "cb.png"))
    except Exception as e:  # a missing matplotlib never loses the record
        ctx.log(f"bench cb: no plot ({type(e).__name__}: {e})")
    return rec


def plot(rec: Dict[str, Any], path: str) -> Optional[str]:
    """Requests in flight, tokens/s, TTFT p50/p99 per variant, and the probe's
    TTFT (full prefill vs store load); labelled SIMULATION on the CPU."""
    rows = [r for r in rec.get("results", []) if r.get("kind") == "variant"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = [("max_in_flight", "requests in flight (most at once)"), ("tokens_per_s", "throughput (tokens/s)")]
    for ax, (key, label) in zip(axes[:2], panels):
        ax.bar(names, [r[key] for r in rows], color="tab:blue")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30)
    x = range(len(rows))
    axes[2].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
    axes[2].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], 0.4, label="p99")
    axes[2].set_xticks(list(x))
    axes[2].set_xticklabels(names, rotation=30)
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].legend()
    probes = [(r["variant"], statistics.median(r["probe_ttft_ms"])) for r in rows if r.get("probe_ttft_ms")]
    if probes:
        axes[3].bar([n for n, _ in probes], [v for _, v in probes], color="tab:green")
        axes[3].set_ylabel(f"TTFT after a restart (ms), {rec['parameters'].get('doc_tokens')}-token prefix")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    sim = rec.get("simulated", False)
    fig.suptitle(("SIMULATION (CPU compute, simulated tiers): " if sim else "")
                 + f"continuous batching, {rec['parameters'].get('budget_blocks')}-block device budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
