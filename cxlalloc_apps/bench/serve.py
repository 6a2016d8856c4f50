"""``python -m cxlalloc bench --only serve``: ``cxlalloc serve`` vs plain ``transformers serve`` on a chat trace.

    python -m cxlalloc bench --only serve [--quick] --out DIR

Writes ``DIR/serve.json`` (:mod:`.meta` record) and ``DIR/serve.png``.  Three long-lived servers of the same
model (a saved tiny Llama with a word-level tokenizer and a chat template, random weights, fp32; built here,
nothing downloaded), all with transformers' continuous batching (on the CPU; on the GPU when there is one):

* ``plain``: ``transformers serve DIR --continuous-batching --cb-num-blocks B`` — the ``B`` blocks the device
  budget holds;
* ``plain_same_blocks``: the same with ``host_factor x B`` blocks, as many as cxlalloc's — what a device
  ``host_factor`` times larger would do (the ceiling cxlalloc's spill is measured against);
* ``cxlalloc``: ``cxlalloc serve DIR --device-limit WEIGHTS+B*block (the weights' whole 2 MiB segments) --cb-num-blocks host_factor*B --kv-store
  local`` — the same device bytes for KV, the rest of its blocks on the host tier (the simulated driver's on a
  CPU), prefixes kept in the in-process store.

The trace (:mod:`.serve_trace`, seeded; issue 28's shape by default; any field set with ``--serve-trace
KEY=VALUE,...``): ``concurrency`` session slots in a closed loop for ``window_s`` seconds; each session one of a few
shared system prompts and, for a RAG session, one of ``documents`` shared documents of ``doc_tokens`` (1-8K)
tokens, both Zipf-popular, then ``turns`` turns of the whole conversation so far plus a new question, streamed by
the real ``openai`` client, greedy, a short answer of ``max_tokens``.  What is prefilled again (the document, the
system prompt, the conversation) is decided by each server's prefix reuse: plain ``transformers serve``'s prefix
sharing (on by default; its cached blocks all go at once under memory pressure) or cxlalloc's larger tiered paged
cache and its KV store.  The model is sized by the trace (``layers``, ``hidden``, ``kv_heads``: by default 2
layers, hidden 64, so that a 4K-token prefill takes well under a second on the CPU).

Per arm and round: sessions completed (per minute of window), requests, TTFT p50/p99 (request sent to the first
streamed content chunk, ms, over every request of the round), TPOT (median over requests of (last chunk - first
chunk) / (chunks - 1), ms), output tokens/s (streamed chunks / the round's wall time incl. the drain; one chunk
is one token of the word-level tokenizer), and for cxlalloc its counters from ``/v1/cxlalloc/stats`` (KV bytes
per tier, store hits, preemptions).  Replies of the same session and turn are compared between cxlalloc and each plain arm (greedy:
the same text is expected; fp32 batches of different composition may differ in a last digit and flip a token,
which is counted, not hidden).

Every server runs torch with ``SERVER_THREADS`` (1) intra-op thread (``OMP_NUM_THREADS``): on the shared 2-core
machine, plain ``transformers serve`` with 2 threads took 100-800 ms a token for one streamed request where it
takes 3 ms with 1, while ``cxlalloc serve`` with 2 stayed at 3-30 ms (not explained yet) — a thread setting
would otherwise be measured instead of the KV cache.

Method (:mod:`.method`): the arms run one after the other in each round, the order rotated by the round number,
``warmup`` rounds discarded, at least 5 timed rounds; every ratio (cxlalloc/plain, cxlalloc/plain_same_blocks) is taken per round and
summarised as median, IQR and range; the machine's load before and after, and a noise floor (an A/A comparison
of one short request to the plain server) sit beside the figures.  Goals (issue 28): sessions completed >= 2x
plain, TTFT p99 <= 1.0x plain.  CPU only here: the "device" tier is the simulated driver's host memory, so a
spilled block costs a CPU memcpy, not a PCIe/CXL transfer; not yet run on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

from cxlalloc_apps.bench import method
from cxlalloc_apps.bench.meta import REPO_ROOT, RecordWriter, new_record
from cxlalloc_apps.bench.model import save_chat_llama
from cxlalloc_apps.bench.serve_trace import QUICK, Trace, TraceText, parse_overrides, replay, summarize

MiB = 1 << 20
SEGMENT = 2 * MiB  # the device tier's granularity: the weights take whole 2 MiB segments, KV whole 2 MiB chunks
STOP_TIMEOUT_S = 15.0  # a server's graceful shutdown, then SIGKILL
SERVER_THREADS = 1  # torch intra-op threads of every server (OMP_NUM_THREADS)
ARMS = ("plain", "plain_same_blocks", "cxlalloc")
RATIOS = (("cxlalloc", "plain"), ("cxlalloc", "plain_same_blocks"))


def block_bytes(cfg: Dict[str, Any], page: int) -> int:
    """Bytes of one paged block over every layer (K and V, fp32): 2 x layers x KV heads x head dim x 4 x page."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4 * page


def make_model_dir(path: str, t: Trace) -> Dict[str, Any]:
    """Save the benchmark's tiny Llama (``t.layers`` layers, hidden ``t.hidden``, heads of 32, ``t.kv_heads`` KV
    heads, MLP 2 x hidden, fp32, random weights, seed 0; positions for the trace's longest prompt) with a word-level
    tokenizer (words ``w0``..``w{vocab_words-1}``; one word = one token) and a ChatML-like template into ``path``
    (:func:`.model.save_chat_llama`); returns the model's config as a dict."""
    positions = 1 << max(12, math.ceil(math.log2(t.max_prompt_tokens())))
    model, _ = save_chat_llama(path, [f"w{i}" for i in range(t.vocab_words)], hidden_size=t.hidden,
                               intermediate_size=2 * t.hidden, num_hidden_layers=t.layers,
                               num_attention_heads=t.hidden // 32, num_key_value_heads=t.kv_heads, head_dim=32,
                               max_position_embeddings=positions)
    cfg = model.config.to_dict()
    cfg["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return cfg


def weight_segments(cfg: Dict[str, Any]) -> int:
    """Device bytes the model's weights take in ``cxlalloc serve``: their bytes rounded up to whole
    :data:`SEGMENT` s (all of the tiny model's tensors are small ones, packed into 2 MiB segments)."""
    return -(-int(cfg["weight_bytes"]) // SEGMENT) * SEGMENT


def model_text(t: Trace) -> str:
    """The record's one-line description of the model."""
    return (f"tiny Llama ({t.layers} layers, hidden {t.hidden}, {t.hidden // 32} heads and {t.kv_heads} KV heads x 32, "
            "fp32, random weights), word-level tokenizer (one word = one token)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def transformers_cli() -> List[str]:
    """The command that runs ``transformers`` (its console script beside this Python, else ``transformers`` on
    PATH).  Raises FileNotFoundError when neither exists."""
    here = os.path.join(os.path.dirname(sys.executable), "transformers")
    exe = here if os.access(here, os.X_OK) else shutil.which("transformers")
    if not exe:
        raise FileNotFoundError("the transformers command is not installed beside this Python nor on PATH")
    return [exe]


class Server:
    """One server subprocess (its own process group), waited for until ``/health`` answers."""

    def __init__(self, name: str, argv: List[str], work: str, env: Dict[str, str], start_timeout: float = 300.0):
        self.name = name
        self.port = _free_port()
        self.log_path = os.path.join(work, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.exited: Optional[bool] = None
        self.proc = subprocess.Popen(argv + ["--host", "127.0.0.1", "--port", str(self.port)], cwd=REPO_ROOT,
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                _get(self.base + "/health", timeout=2.0)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"{name} server did not come up (exit {self.proc.poll()}): {tail}")
                time.sleep(0.3)

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""

    def stats(self) -> Optional[Dict[str, Any]]:
        """cxlalloc serve's continuous-batching stats (``/v1/cxlalloc/stats``), None for plain or on failure."""
        try:
            s = _get(self.base + "/v1/cxlalloc/stats")
            return next(iter(s.values()))["hf"].get("continuous_batching")
        except Exception:
            return None

    def interrupt(self) -> None:
        """SIGINT to the server's group (uvicorn's graceful shutdown)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def wait_or_kill(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the server to exit, then SIGKILL its group.  True when it exited by
        itself.  (``transformers serve`` does not: after uvicorn's shutdown its continuous-batching thread keeps
        the process alive.)"""
        try:
            self.proc.wait(timeout=max(0.1, timeout))
            exited = True
        except subprocess.TimeoutExpired:
            exited = False
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()
        return exited

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """:meth:`interrupt`, then :meth:`wait_or_kill`."""
        self.interrupt()
        return self.wait_or_kill(timeout)


def _counter_delta(before: Optional[dict], after: Optional[dict]) -> Dict[str, Any]:
    if not after:
        return {}
    c0, c1 = (before or {}).get("counters") or {}, after.get("counters") or {}
    out = {}
    for k in ("store_hit_tokens", "store_hit_blocks", "reprefills_avoided", "stored_blocks", "vram_hit_tokens",
              "preemptions", "promoted_bytes", "demoted_bytes"):
        if c1.get(k) is not None:
            out[k] = c1[k] - (c0.get(k) or 0)
    for k in ("peak_kv_device_bytes", "peak_kv_host_bytes", "max_requests_in_flight"):
        out[k] = c1.get(k)  # peaks since the server started
    return out


METRICS = (("sessions_per_min", "higher"), ("ttft_p50_ms", "lower"), ("ttft_p99_ms", "lower"), ("tpot_ms", "lower"),
           ("tokens_per_s", "higher"))
GOALS = (("sessions completed at the same device budget >= 2x plain", "sessions_per_min", 2.0, "higher"),
         ("TTFT p99 no worse than plain (<= 1.0x)", "ttft_p99_ms", 1.0, "lower"))


def run(ctx) -> Dict[str, Any]:
    """``bench --only serve``: the record ``serve.json`` (and ``serve.png``)."""
    t = parse_overrides(QUICK if ctx.quick else Trace(), getattr(ctx.args, "serve_trace", None))
    for mod in ("openai", "fastapi", "uvicorn"):
        try:
            __import__(mod)
        except ImportError:
            wr = RecordWriter(ctx.out_dir, new_record("serve", dataclasses.asdict(t), True, ctx.argv, ctx.device))
            return wr.finish_skipped("serve", f"{mod} is not installed (pip install 'transformers[serving]' openai)")
    import openai

    on_gpu = ctx.gpu_ready()[0]
    device = f"cuda:{ctx.device}" if on_gpu else "cpu"
    params = dataclasses.asdict(t)
    params.update(model=model_text(t), device=device, client=f"openai {openai.__version__}",
                  server_threads=SERVER_THREADS, units="ms, tokens/s, sessions per minute of window, bytes")
    wr = RecordWriter(ctx.out_dir, new_record("serve", params, not on_gpu, ctx.argv, ctx.device))
    if on_gpu:
        wr.note("GPU run: both servers on the GPU, cxlalloc's host tier in host memory (not yet run on a GPU "
                "before this record)")
    else:
        wr.note("CPU run: both servers compute on the CPU; cxlalloc's tiers are the simulated driver's (a spilled block "
            "costs a host memcpy, not a PCIe/CXL transfer). Not yet run on a GPU.")
    wr.note("plain transformers serve runs with its prefix sharing on (ContinuousBatchingConfig.allow_block_sharing, "
            "True by default in transformers 5.24: complete blocks are hashed and a new request's prompt is matched "
            "against them; unreferenced hashed blocks stay cached until memory pressure, when evict_cached_blocks() "
            "returns all of them to the pool at once); it has no tier below its paged cache")
    lo, hi = t.doc_range()
    wr.note(f"trace: {t.concurrency} session slots, {t.window_s:g} s window, {t.turns} turns a session, "
            f"{t.system_prompts} system prompts of {t.system_words} tokens, {t.documents} documents of {lo}-{hi} tokens "
            f"(log-uniform) in {t.rag_fraction:.0%} of the sessions, Zipf exponent {t.zipf_s:g}, {t.user_words}-token "
            f"questions, {t.max_tokens}-token greedy answers")
    work = tempfile.mkdtemp(prefix="cxlalloc-bench-serve-")
    servers: Dict[str, Server] = {}
    try:
        cfg = make_model_dir(os.path.join(work, "model"), t)
        bb = block_bytes(cfg, t.page)
        budget = t.budget_blocks * bb
        wr.record["parameters"].update(block_bytes=bb, device_kv_budget_bytes=budget,
                                       cxlalloc_num_blocks=t.host_factor * t.budget_blocks,
                                       weight_bytes=cfg["weight_bytes"],
                                       cxlalloc_device_limit=weight_segments(cfg) + budget)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
                   OMP_NUM_THREADS=str(SERVER_THREADS))
        env.pop("CXLALLOC", None)
        if not on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        mdir = os.path.join(work, "model")
        cb = ["--cb-block-size", str(t.page), "--cb-max-batch-tokens", str(t.max_batch_tokens)]
        plain = transformers_cli() + ["serve", mdir, "--continuous-batching", "--device", device, *cb]
        argvs = {"plain": plain + ["--cb-num-blocks", str(t.budget_blocks)],
                 "plain_same_blocks": plain + ["--cb-num-blocks", str(t.host_factor * t.budget_blocks)],
                 "cxlalloc": [sys.executable, "-m", "cxlalloc", "serve", mdir, "--device", device, "--device-limit",
                              str(weight_segments(cfg) + budget), "--host-limit", str(512 * MiB), "--kv-store", "local",
                              "--option", "device_headroom=0", "--cb-num-blocks",
                              str(t.host_factor * t.budget_blocks), *cb]}
        wr.record["parameters"]["commands"] = {a: " ".join(v) for a, v in argvs.items()}
        for arm in ARMS:
            ctx.log(f"bench serve: starting {arm}")
            servers[arm] = Server(arm, argvs[arm], work, env)
        clients = {a: openai.OpenAI(base_url=s.base + "/v1", api_key="unused", timeout=300, max_retries=0)
                   for a, s in servers.items()}
        models = {a: c.models.list().data[0].id for a, c in clients.items()}
        text = TraceText(t)
        wr.record["parameters"]["document_tokens"] = text.doc_sizes
        loop = method.Rounds(ARMS, t.rounds, warmup=t.warmup, deadline=ctx.deadline, skip=wr.skip)
        samples: Dict[str, Dict[str, List[float]]] = {m: {a: [] for a in ARMS} for m, _ in METRICS}
        replies: Dict[str, List[Dict[Tuple[int, int], str]]] = {a: [] for a in ARMS}
        for turn in loop:
            arm = turn.arm
            ctx.log(f"bench serve: {turn.label()}")
            before = servers[arm].stats()
            res = replay(clients[arm], models[arm], text, t)
            row = summarize(res, t.window_s)
            row.update(arm=arm, round=turn.timed_round, warmup=not turn.timed, order=turn.order,
                       load=method.machine_load(), errors=res["errors"][:5])
            if arm == "cxlalloc":
                row["cxlalloc"] = _counter_delta(before, servers[arm].stats())
            if not turn.timed:
                continue
            for m, _ in METRICS:
                samples[m][arm].append(row[m])
            replies[arm].append({(q["sid"], q["turn"]): q["reply"] for q in res["requests"]})
            wr.add(dict(row, kind="round", status="ok" if not res["errors"] else "errors",
                        method="one closed-loop replay of the trace against a long-lived server"))
        load_before, load_after = loop.load_before, loop.load_after
        n = min(len(v) for v in samples["sessions_per_min"].values())
        if n == 0:
            wr.error("serve", "no timed round completed")
            return wr.finish()
        summary: Dict[str, Any] = {"metrics": {}, "goals": [], "rounds": n}
        for m, better in METRICS:
            d = loop.comparison(samples[m]).as_dict(RATIOS)
            d["better"] = better
            summary["metrics"][m] = d
        for name, m, goal, better in GOALS:
            cmp_ratio = loop.comparison(samples[m]).ratio("cxlalloc", "plain")
            summary["goals"].append(method.goal_record(name, cmp_ratio, goal, better))
        summary["replies"] = {}
        for base in ("plain", "plain_same_blocks"):
            same = total = 0
            for pr, cr in zip(replies[base], replies["cxlalloc"]):
                for key in set(pr) & set(cr):
                    total += 1
                    same += pr[key] == cr[key]
            summary["replies"][f"cxlalloc vs {base}"] = {"compared": total, "identical": same}
        summary.update(method=method.describe("rotate", n, t.warmup),
                       load_before=load_before, load_after=load_after)
        ctx.log("bench serve: noise floor (A/A, one short request to plain)")
        probe = [{"role": "user", "content": text.session(0)[2][0]}]

        def one():
            clients["plain"].chat.completions.create(model=models["plain"], messages=probe, max_tokens=4,
                                                     temperature=0)

        summary["noise_floor"] = method.noise_floor(one, rounds=method.MIN_ROUNDS).as_dict()
        wr.record["summary"] = summary
        wr.add({"kind": "summary", "status": "ok", "method": summary["method"],
                **{g["goal"]: g["verdict"] for g in summary["goals"]}})
        return wr.finish_and_plot(plot, ctx.log)
    finally:
        for s in servers.values():  # all at once: their shutdowns overlap
            s.interrupt()
        end = time.monotonic() + STOP_TIMEOUT_S
        for s in servers.values():
            s.exited = s.wait_or_kill(end - time.monotonic())
        for s in servers.values():
            if not s.exited:
                wr.note(f"{s.name} server did not exit {STOP_TIMEOUT_S:.0f} s after SIGINT (transformers serve's "
                        "continuous-batching thread outlives uvicorn's shutdown): killed")
            elif s.proc.returncode != 0:
                wr.note(f"{s.name} server exited {s.proc.returncode}: {s.log_tail(600)}")
        if isinstance(wr.record.get("summary"), dict):
            wr.record["summary"]["servers"] = {a: {"port": s.port, "pid": s.proc.pid, "exit": s.proc.returncode,
                                                   "exited_by_itself": s.exited}
                                               for a, s in servers.items()}
        wr.flush()
        shutil.rmtree(work, ignore_errors=True)


def plot(rec: Dict[str, Any], path: str) -> Optional[str]:
    """One panel per figure: each arm's median with its IQR, and the per-round ratio cxlalloc/plain in the title;
    labelled SIMULATION on the CPU."""
    s = rec.get("summary") or {}
    mets = s.get("metrics") or {}
    if not mets:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(mets), figsize=(4 * len(mets), 4))
    for ax, (m, d) in zip(axes, mets.items()):
        med = [d["spread"][a]["median"] for a in ARMS]
        err = [[d["spread"][a]["median"] - d["spread"][a]["q1"] for a in ARMS],
               [d["spread"][a]["q3"] - d["spread"][a]["median"] for a in ARMS]]
        ax.bar(["plain", "plain\nsame blocks", "cxlalloc"], med, yerr=err, capsize=6,
               color=["tab:gray", "tab:olive", "tab:blue"])
        title = [m]
        for a, b in RATIOS:
            rr = d["ratios"][f"{a}/{b}"]
            title.append(f"/{b}: {rr['median']:.2f}x (IQR {rr['q1']:.2f}-{rr['q3']:.2f})")
        ax.set_title("\n".join(title), fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    p = rec["parameters"]
    fig.suptitle(("SIMULATION (CPU): " if rec.get("simulated") else "")
                 + f"cxlalloc serve vs transformers serve, {p.get('concurrency')} sessions, documents of "
                   f"{p.get('doc_tokens', '-')} tokens, {p.get('budget_blocks')}-block device KV budget, "
                   f"n={s.get('rounds')} rounds (median, IQR)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
