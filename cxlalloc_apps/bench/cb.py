"""Continuous batching: a stream of requests over long documents, plain vs tiered.

One process, one run, the same model and the same request stream for every
variant (side by side):

``plain``
    transformers' own continuous batching (``init_continuous_batching``) with
    a paged cache of ``budget // block_bytes`` blocks: what fits in the device
    budget for KV.
``plain same blocks``
    transformers' own with ``host_factor`` x the budget's blocks: as many as
    the wrapped arms have, all in "VRAM" (a device that large): the baseline
    the spill case is measured against (issue 33: "the same number of blocks").
``wrapped``
    the same model wrapped (:func:`cxlalloc.hf.wrap`, ``device_limit`` = its
    weights' segment + the same KV budget, the host tier behind it) with
    ``num_blocks`` = ``host_factor`` (4) x the budget's blocks: the rest on
    the host tier.
``wrapped+store``
    as ``wrapped`` with ``kv_store=True`` (the in-process store): complete
    blocks are written through, and a prefix the paged cache forgot is loaded
    instead of prefilled.

The stream (seeded): ``documents`` long documents (``doc_tokens`` each) picked
with Zipf popularity (``P(rank k) ~ 1 / k**zipf_s``); ``rag`` requests (a
document + a ``question_tokens`` question, all arriving at once) and ``chats``
two-turn conversations (turn 2 = turn 1's prompt + its reply + a new
question, submitted when turn 1 finishes).  Greedy, ``new_tokens`` each.

Method (:mod:`.method`, its arm loop ``Rounds``): one warm-up round (discarded), then ``ROUNDS`` (9) timed
rounds; each round runs every arm once, in an order rotated by the round number,
so that load on a shared machine and order effects fall on every arm; every
ratio is taken per round and summarised as median, IQR and range, with the
machine's load before and after and per round; a verdict per goal (met, missed,
within noise) from the IQR.  ``--quick``: one round, a smoke run, not a figure.
On the CPU torch runs one intra-op thread (``CPU_THREADS``): on a shared 2-core
machine a second thread mostly waits on the other jobs, which made earlier
rounds of the same arm differ 2.6x.  Besides wall-clock tokens/s (the figure
the goals name), tokens per CPU second of the process (``time.process_time``:
the generation thread's work and the caller's) are recorded with their own
verdicts: the other jobs of a loaded machine stretch wall time, not CPU time.  Rows ``kind="round"`` hold each run, rows
``kind="variant"`` each arm's median and spread.  Per variant: requests in flight (most at once: overlapping
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
when nothing spills.  Goals (issue 33): wrapped no-spill >= 0.97x plain
no-spill, wrapped (spilling) >= 0.9x plain same blocks, tokens/s.

CPU (simulation): a tiny Llama (4 layers, fp32, random weights), 1,024-token
documents; the tiers are the simulated driver's and compute is the CPU's.  On
a GPU the same workload runs on it (not yet run on a GPU).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from cxlalloc_apps.bench import method
from cxlalloc_apps.bench.meta import RecordWriter, new_record

MiB = 1 << 20
WEIGHT_SEGMENT = 4 * MiB  # the tiny model's weights fill one 4 MiB device segment of the wrapped model
CHUNK = 2 * MiB  # cxlalloc's placement granule (extent chunk)


@dataclasses.dataclass
class Workload:
    """The request stream and the budget (tokens, blocks of ``page`` tokens; ``zipf_s``: popularity exponent)."""

    documents: int = 4
    doc_tokens: int = 1024
    question_tokens: int = 16
    new_tokens: int = 16
    rag: int = 10
    chats: int = 2
    zipf_s: float = 1.1
    page: int = 64
    budget_blocks: int = 24  # the device KV budget, in blocks (plain's num_blocks): one document + 8 blocks = 6 MiB
    host_factor: int = 4  # the wrapped variants' num_blocks = host_factor x budget_blocks (the rest on the host tier)
    max_batch_tokens: int = 512
    seed: int = 0


QUICK = Workload(documents=3, doc_tokens=1024, new_tokens=8, rag=6, chats=2, budget_blocks=24)
ROUNDS = 9  # timed rounds (>= method.MIN_ROUNDS; a run takes seconds, its spread on a shared machine is wide) of every arm (order rotated per round), full workload
WARMUP_ROUNDS = 1  # discarded (one-time costs: kernels, threads, the simulated driver's first mappings)
QUICK_ROUNDS = 1  # a smoke run (not a figure)
CPU_THREADS = 1  # torch intra-op threads on the CPU: on a shared 2-core machine a second thread mostly waits


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
    t0, c0 = time.perf_counter(), time.process_time()
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
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        mgr.stop(block=True, timeout=60)
    return {"outs": outs, "meta": meta, "wall_s": wall, "cpu_s": cpu}


def summarize(res: Dict[str, Any]) -> Dict[str, Any]:
    outs = list(res["outs"].values())
    ttft = [(o.timestamps[0] - o.created_time) * 1e3 for o in outs if o.timestamps]
    spans = [tuple(o.lifespan) for o in outs if o.lifespan[0] > 0 and o.lifespan[1] > 0]
    tokens = sum(len(o.generated_tokens) for o in outs)
    return {"requests": len(outs), "generated_tokens": tokens, "wall_s": round(res["wall_s"], 3),
            "tokens_per_s": round(tokens / res["wall_s"], 2), "cpu_s": round(res["cpu_s"], 3),
            "tokens_per_cpu_s": round(tokens / max(res["cpu_s"], 1e-9), 2), "ttft_p50_ms": round(_percentile(ttft, 0.5), 2),
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
             probe_docs: bool, num_blocks: Optional[int] = None, device: str = "cpu") -> Dict[str, Any]:
    import cxlalloc.hf as hf
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _model(device)
    bb = block_bytes(model, w.page)
    kw = dict(page_size=w.page, max_batch_tokens=w.max_batch_tokens)
    if wrapped:
        # no-spill: 2 chunks more, for the paged extent's rounding to 2 MiB chunks and its spare sectors, so that
        # every block is in VRAM; under the budget plain and wrapped get exactly the same device bytes for KV.
        slack = 2 * CHUNK if num_blocks == budget_blocks else 0
        opts = dict(device_limit=WEIGHT_SEGMENT + budget_blocks * bb + slack, host_limit=512 * MiB,
                    device_headroom=0)
        if store:
            opts["kv_store"] = True
        model = hf.wrap(model, **opts)
    # plain: the blocks the device budget holds; wrapped: num_blocks (None: cxlalloc's default sizing)
    kw["num_blocks"] = num_blocks if wrapped else budget_blocks
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


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def aggregate(rounds: List[dict]) -> Dict[str, Any]:
    """One variant over its rounds: the spread (:class:`.method.Spread`: median, IQR, range) of tokens/s, TTFT
    p50/p99 and wall time, the largest in-flight count, every probe sample."""
    out = {"variant": rounds[0]["variant"], "rounds": len(rounds), "num_blocks": rounds[0]["num_blocks"],
           "budget_blocks": rounds[0]["budget_blocks"]}
    for k in ("tokens_per_s", "tokens_per_cpu_s", "ttft_p50_ms", "ttft_p99_ms", "wall_s"):
        sp = method.Spread.of([r[k] for r in rounds])
        out[k] = round(sp.median, 3)
        out[k + "_spread"] = sp.as_dict(3)
        out[k + "_range"] = [sp.lo, sp.hi]
    for k in ("max_in_flight", "preemptions", "reset_and_reprefilled"):
        out[k] = max(r[k] for r in rounds)
    probes = [x for r in rounds for x in r.get("probe_ttft_ms", [])]
    if probes:
        out["probe_ttft_ms_median"] = _median(probes)
        out["probe_ttft_ms_min"] = round(min(probes), 2)
    if "cxlalloc" in rounds[0]:
        out["store_hit_tokens"] = max(r["cxlalloc"]["store_hit_tokens"] or 0 for r in rounds)
        out["reprefills_avoided"] = max(r["cxlalloc"]["reprefills_avoided"] or 0 for r in rounds)
        out["peak_kv_host_bytes"] = max(r["cxlalloc"]["peak_kv_host_bytes"] or 0 for r in rounds)
    return out


# (arm, device budget: "budget" | "same_blocks" | "all", wrapped, kv_store, restart probe, wrapped num_blocks)
ARMS = (("plain", "budget", False, False, True, None),
        ("plain same blocks", "same_blocks", False, False, False, None),
        ("wrapped", "budget", True, False, False, "same_blocks"),
        ("wrapped+store", "budget", True, True, True, "same_blocks"),
        ("plain no-spill", "all", False, False, False, None),
        ("wrapped no-spill", "all", True, False, False, "all"))
# (goal, numerator arm, denominator arm, target, better): issue 33's continuous-batching goals on tokens/s
GOALS = (("no-spill throughput >= 0.97x plain (same blocks, all in VRAM)", "wrapped no-spill", "plain no-spill",
          0.97, "higher"),
         ("spill throughput >= 0.9x plain with the same number of blocks", "wrapped", "plain same blocks", 0.9,
          "higher"))
RATIOS = (("wrapped", "plain"), ("wrapped+store", "plain"), ("wrapped", "plain same blocks"),
          ("wrapped+store", "plain same blocks"), ("wrapped no-spill", "plain no-spill"))


def run(ctx) -> Dict[str, Any]:
    """``bench --only cb``: the record ``cb.json`` (and ``cb.png``)."""
    import torch
    from transformers import GenerationConfig

    w = QUICK if ctx.quick else Workload()
    rounds = QUICK_ROUNDS if ctx.quick else ROUNDS
    on_gpu = ctx.gpu_ready()[0]
    threads = max(1, min(4, os.cpu_count() or 1)) if on_gpu else CPU_THREADS
    torch.set_num_threads(threads)
    device = f"cuda:{ctx.device}" if on_gpu else "cpu"
    params = dataclasses.asdict(w)
    params.update(model="tiny Llama (4 layers, hidden 128, 4 KV heads x 32, fp32, random weights)", device=device,
                  rounds=rounds, warmup_rounds=WARMUP_ROUNDS, torch_threads=threads, units="ms, tokens/s, bytes",
                  timer="time.perf_counter (transformers' GenerationOutput created_time / timestamps / lifespan)")
    wr = RecordWriter(ctx.out_dir, new_record("cb", params, not on_gpu, ctx.argv, ctx.device))
    if not on_gpu:
        wr.note("CPU run: the simulated CUDA driver holds the tiers and the model computes on the CPU; throughput "
                "and TTFT are CPU compute, not GPU figures")
    if rounds < method.MIN_ROUNDS:
        wr.note(f"--quick: {rounds} round(s), a smoke run; its ratios are not figures (method.py asks for "
                f">= {method.MIN_ROUNDS})")
    model = _model()
    vocab = int(model.config.vocab_size)
    docs, reqs = make_stream(w, vocab)
    bb = block_bytes(model, w.page)
    del model
    per_request = -(-(w.doc_tokens + 2 * w.question_tokens + 2 * w.new_tokens) // w.page)
    all_blocks = per_request * (len(reqs) + w.chats) + 8
    same_blocks = w.host_factor * w.budget_blocks
    blocks = {"budget": w.budget_blocks, "same_blocks": same_blocks, "all": all_blocks}
    wr.record["parameters"].update(no_spill_budget_blocks=all_blocks, block_bytes=bb, batch_kv_bytes=all_blocks * bb,
                                   requests=len(reqs) + w.chats, wrapped_num_blocks=same_blocks)
    gen = GenerationConfig(max_new_tokens=w.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    plan = {name: (blocks[budget], wrapped, store, probe_docs, None if nb is None else blocks[nb])
            for name, budget, wrapped, store, probe_docs, nb in ARMS}
    names = list(plan)
    warmup = 0 if ctx.quick else WARMUP_ROUNDS
    loop = method.Rounds(names, rounds, warmup=warmup, deadline=ctx.deadline, skip=wr.skip)
    per: Dict[str, List[dict]] = {}
    for turn in loop:
        name = turn.arm
        budget, wrapped, store, probe_docs, num_blocks = plan[name]
        ctx.log(f"bench cb: {turn.label()} ({budget} blocks of device budget)")
        # the restart probe runs once per arm (first timed round): it is not part of the throughput
        probe_now = probe_docs and turn.timed and name not in per
        try:
            row = _variant(name, w, budget, docs, reqs, gen, wrapped=wrapped, store=store, probe_docs=probe_now,
                           num_blocks=num_blocks, device=device)
        except Exception as e:
            wr.error(f"{name} round {turn.round}", e)
            continue
        if not turn.timed:
            continue
        row.update(load=method.machine_load(), order=turn.order)
        per.setdefault(name, []).append(row)
        wr.add(dict({k: v for k, v in row.items() if k != "tokens"}, kind="round", round=turn.timed_round,
                    status="ok", method="one ContinuousBatchingManager per arm and round, the same seeded "
                    "request stream; arms in an order rotated per round"))
    load_before, load_after = loop.load_before, loop.load_after
    summary: Dict[str, Any] = {"variants": {}}
    ref = {"plain": per.get("plain", [{}])[0].get("tokens"), "no-spill": per.get("plain no-spill", [{}])[0].get(
        "tokens")}
    for name, rows in per.items():
        agg = aggregate(rows)
        base = ref["no-spill" if "no-spill" in name else "plain"]
        agg["tokens_identical_to_plain"] = base is not None and all(r["tokens"] == base for r in rows)
        summary["variants"][name] = agg
        wr.add(dict(agg, kind="variant", status="ok", method=f"median and spread over {len(rows)} interleaved "
                    "rounds"))
    n = min((len(v) for v in per.values()), default=0)
    if per and n and len(per) == len(names):
        cmps = {}
        for key in ("tokens_per_s", "tokens_per_cpu_s", "ttft_p50_ms", "ttft_p99_ms", "max_in_flight"):
            c = loop.comparison({a: [row[key] for row in per[a]] for a in names})
            cmps[key] = c
            summary.setdefault("comparison", {})[key] = c.as_dict(RATIOS)
        tps = cmps["tokens_per_s"]
        summary["goals"] = [method.goal_record(g, tps.ratio(a, b), target, better)
                            for g, a, b, target, better in GOALS]
        # the same goals on tokens per CPU second of the process: what a shared, loaded machine's other jobs
        # cannot take from one arm and not the other (wall tokens/s stays the figure the goals name)
        summary["goals_cpu_time"] = [method.goal_record(g + " (tokens per CPU second)",
                                                        cmps["tokens_per_cpu_s"].ratio(a, b), target, better)
                                     for g, a, b, target, better in GOALS]
        summary["method"] = method.describe("rotate", n, warmup)

        def med(key, a, b):
            return round(cmps[key].ratio(a, b).median, 3)

        summary.update(
            in_flight_ratio_wrapped_vs_plain=med("max_in_flight", "wrapped", "plain"),
            in_flight_ratio_store_vs_plain=med("max_in_flight", "wrapped+store", "plain"),
            throughput_ratio_wrapped_vs_plain=med("tokens_per_s", "wrapped", "plain"),
            throughput_ratio_store_vs_plain=med("tokens_per_s", "wrapped+store", "plain"),
            throughput_ratio_wrapped_vs_plain_same_blocks=med("tokens_per_s", "wrapped", "plain same blocks"),
            throughput_ratio_no_spill=med("tokens_per_s", "wrapped no-spill", "plain no-spill"),
            cpu_throughput_ratio_wrapped_vs_plain_same_blocks=med("tokens_per_cpu_s", "wrapped", "plain same blocks"),
            cpu_throughput_ratio_no_spill=med("tokens_per_cpu_s", "wrapped no-spill", "plain no-spill"),
            ttft_p50_ratio_store_vs_plain=med("ttft_p50_ms", "wrapped+store", "plain"),
            ttft_p99_ratio_store_vs_plain=med("ttft_p99_ms", "wrapped+store", "plain"))
        summary["no_spill_overhead"] = round(1 - summary["throughput_ratio_no_spill"], 3)
        p, st = summary["variants"]["plain"], summary["variants"]["wrapped+store"]
        if p.get("probe_ttft_ms_median") and st.get("probe_ttft_ms_median"):
            summary["probe_ttft_ratio_store_vs_plain"] = round(st["probe_ttft_ms_median"] / p["probe_ttft_ms_median"],
                                                               3)
    summary["all_tokens_identical"] = bool(per) and all(a["tokens_identical_to_plain"]
                                                        for a in summary["variants"].values())
    summary["load_before"], summary["load_after"] = load_before, load_after
    wr.record["summary"] = summary
    return wr.finish_and_plot(plot, ctx.log)


def plot(rec: Dict[str, Any], path: str) -> Optional[str]:
    """Requests in flight, tokens/s (median, IQR), TTFT p50/p99 per arm, the per-round throughput ratios against
    their goals, and the probe's TTFT (full prefill vs store load); labelled SIMULATION on the CPU."""
    rows = [r for r in rec.get("results", []) if r.get("kind") == "variant"]
    if not rows:
        return None
    order = [a[0] for a in ARMS]
    rows.sort(key=lambda r: order.index(r["variant"]) if r["variant"] in order else len(order))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.6))
    axes[0].bar(names, [r["max_in_flight"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("requests in flight (most at once)")

    def err(key):
        return [[r[key] - r[key + "_spread"]["q1"] for r in rows], [r[key + "_spread"]["q3"] - r[key] for r in rows]]

    axes[1].bar(names, [r["tokens_per_s"] for r in rows], yerr=err("tokens_per_s"), capsize=4, color="tab:blue")
    axes[1].set_ylabel("throughput (tokens/s; median, IQR)")
    x = range(len(rows))
    axes[2].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in rows], 0.4, yerr=err("ttft_p50_ms"), capsize=3,
                label="p50")
    axes[2].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in rows], 0.4, yerr=err("ttft_p99_ms"), capsize=3,
                label="p99")
    axes[2].set_xticks(list(x))
    axes[2].set_xticklabels(names)
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].legend()
    comp = (rec.get("summary") or {}).get("comparison") or {}
    for j, (key, color) in enumerate((("tokens_per_s", "tab:blue"), ("tokens_per_cpu_s", "tab:orange"))):
        ratios = comp.get(key, {}).get("ratios", {})
        if not ratios:
            continue
        keys = list(ratios)
        # a box from the five numbers: its quartiles are exactly q1/median/q3, its whiskers min/max
        bp = axes[3].boxplot([[ratios[k]["min"], ratios[k]["q1"], ratios[k]["median"], ratios[k]["q3"],
                               ratios[k]["max"]] for k in keys], whis=(0, 100),
                             positions=[i + 1 + (j - 0.5) * 0.35 for i in range(len(keys))], widths=0.3,
                             patch_artist=True)
        for box in bp["boxes"]:
            box.set_facecolor(color)
        axes[3].plot([], [], color=color, lw=6, label="wall tokens/s" if j == 0 else "tokens per CPU s")
        axes[3].set_xticks(range(1, len(keys) + 1))
        axes[3].set_xticklabels([k.replace("/", "\n/ ") for k in keys], fontsize=7)
    if comp:
        for g in (rec.get("summary") or {}).get("goals", []):
            axes[3].axhline(g["target"], ls="--", lw=0.8, color="tab:red")
        axes[3].set_ylabel("ratio per round (median, IQR, range; goals dashed)")
        axes[3].legend(fontsize=7)
    probes = [(r["variant"], r["probe_ttft_ms_median"]) for r in rows if r.get("probe_ttft_ms_median")]
    if probes:
        axes[4].bar([n for n, _ in probes], [v for _, v in probes], color="tab:green")
        axes[4].set_ylabel(f"TTFT after a restart (ms), {rec['parameters'].get('doc_tokens')}-token prefix")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
        if ax is not axes[3]:
            ax.tick_params(axis="x", rotation=30)
    sim = rec.get("simulated", False)
    p = rec["parameters"]
    fig.suptitle(("SIMULATION (CPU compute, simulated tiers): " if sim else "")
                 + f"continuous batching, {p.get('budget_blocks')}-block device budget, "
                   f"{p.get('rounds')} interleaved rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
