"""KV reuse speed against what users would pick instead, side by side in one run.

Four parts, each a ratio of two things measured in the same process and run,
alternating, so load on a shared machine slows both sides:

``lookup``
    kv-server hits (``RemoteBlockStore.lookup`` of ``n`` 64 KiB blocks, each
    copied out of the pool into a destination tensor, the lease released)
    against redis-py ``MGET`` of the same ``n`` keys and bytes from a real
    local ``redis-server`` (each value copied into the same destination), for
    1, 16 and 512 keys and 1, 4 and 16 client processes.  Ratio: kv-server
    requests/s over Redis requests/s (> 1: the kv-server is faster).
``insert``
    ``reserve`` + write + ``commit`` of a batch of new blocks (64 KiB and
    1 MiB) against a plain memcpy of the same bytes into a preallocated,
    already touched buffer (``torch.Tensor.copy_`` per block).  Ratio: memcpy
    time over insert time (1.0: inserting costs nothing beyond the copy).
    Also one block per reservation (the fixed cost of two round trips).
``chat``
    a 20-turn conversation (each user turn new tokens, a greedy answer) on the
    wrapped model (``kv_store=True``: the last conversation's cache continues)
    against the cache a user keeps by hand (transformers' ``DynamicCache``
    passed to every ``generate()`` of the unwrapped model), and the wrapped
    model with ``kv_conversation_limit=0`` (whole blocks from the store only).
    Per turn: time to the first logits (the prefill).  Ratio: summed prefill
    time over the by-hand cache's (< 1: faster); tokens compared.
``prefix``
    in-process hits on a shared 1,024-token document with different questions
    against transformers' documented recipe (prefill the prefix once,
    ``copy.deepcopy`` the cache per request:
    https://huggingface.co/docs/transformers/kv_cache, "Prompt caching /
    re-use a cache").  Ratio: TTFT over the recipe's (< 1: faster).

Machine and units are in the record (CPU; the GPU side is cxlalloc's
simulated driver, so these are CPU figures, not GPU ones).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from cxlalloc_apps.bench.kvprocs import REPO, _chosen, _env, _Server, block_key, pattern, run_parts
from cxlalloc_apps.bench.meta import RecordWriter, new_record
from cxlalloc_apps.bench.method import MIN_ROUNDS, Comparison, goal_record, machine_load, round_orders

KiB, MiB = 1 << 10, 1 << 20
LOOKUP_BLOCK = 64 * KiB
LOOKUP_KEYS = (1, 16, 512)
LOOKUP_CLIENTS = (1, 4, 16)
LOOKUP_ROUNDS = 7    # rounds per key count (the method: >= 5)
INSERT_SIZES = ((64 * KiB, 64), (1 * MiB, 16))   # (block bytes, blocks per reservation)
CHAT_TURNS = 20
CHAT_USER_TOKENS = 24
CHAT_ANSWER_TOKENS = 8
PREFIX_TOKENS = 1024
QUESTION_TOKENS = 16


def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------- redis
class _Redis:
    def __init__(self, work: str):
        self.binary = shutil.which("redis-server")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.work = work
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "_Redis":
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.work], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() - t0 > 10:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)
        time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ----------------------------------------------------------------- lookup worker (a client process)
def worker_lookup(p: dict) -> dict:
    """Phases at fixed times: for each key count and round, the systems in
    that round's order, ``phase_s`` each; requests completed per phase.
    Systems: ``kv-server``, ``redis`` (redis-py as users run it: with its C
    parser, hiredis, when installed) and ``redis_python`` (redis-py's pure
    Python RESP2 parser)."""
    import redis
    import redis.utils
    import torch
    from redis._parsers import _RESP2Parser

    import cxlalloc
    from cxlalloc.kvstore.client import RemoteBlockStore

    torch.set_num_threads(1)
    alloc = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=256 * MiB)
    st = RemoteBlockStore(p["url"], alloc, timeout=30)
    r = redis.Redis.from_url(p["redis"], socket_timeout=30)  # redis-py's default parser: hiredis when installed
    r_py = redis.Redis.from_url(p["redis"], socket_timeout=30, parser_class=_RESP2Parser)
    keys = [bytes.fromhex(k) for k in p["keys"]]
    B = p["block"]
    dst = torch.empty((max(p["counts"]), B), dtype=torch.uint8)
    # warm: map the pool, register its chunks, open the Redis connection
    with st.lookup("", keys) as lease:
        assert lease.blocks == len(keys)
    assert r.mget(keys[:1])[0] is not None and r_py.mget(keys[:1])[0] is not None
    open(p["ready"], "w").close()  # the parent starts the phases once every client is here
    while not os.path.exists(p["go"]):
        time.sleep(0.005)
    with open(p["go"]) as f:
        t0 = float(f.read())

    def kv(n):
        with st.lookup("", keys[:n]) as lease:
            if lease.blocks != n:
                raise RuntimeError(f"kv-server hit {lease.blocks} of {n} blocks")
            for i, v in enumerate(lease.views):
                dst[i].copy_(v)

    def mget(client):
        def rd(n):
            vals = client.mget(keys[:n])
            for i, v in enumerate(vals):
                dst[i].copy_(torch.frombuffer(v, dtype=torch.uint8))
        return rd

    fns = {"kv-server": kv, "redis": mget(r), "redis_python": mget(r_py)}
    out = []
    for ph in p["phases"]:
        fn = fns[ph["system"]]
        n = ph["keys"]
        while time.time() < t0 + ph["start"]:
            time.sleep(0.001)
        done, t1 = 0, time.perf_counter()
        while done == 0 or time.time() < t0 + ph["end"]:  # at least one request (a slow one may overrun)
            fn(n)
            done += 1
        out.append({"system": ph["system"], "keys": n, "round": ph["round"], "requests": done,
                    "seconds": time.perf_counter() - t1})
    st.close()
    return {"phases": out, "hiredis": bool(redis.utils.HIREDIS_AVAILABLE), "redis_py": redis.__version__}


def _spawn(role: str, params: dict, log: str):
    f = open(log, "wb")
    return subprocess.Popen([sys.executable, "-m", "cxlalloc_apps.bench.kvspeed", "--worker", role, json.dumps(params)],
                            stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO), f, log


def _last_json(path: str) -> dict:
    with open(path, "rb") as f:
        lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.startswith("{")]
    if not lines:
        with open(path, "rb") as f:
            raise RuntimeError(f"worker printed no result: {f.read().decode(errors='replace')[-1500:]}")
    return json.loads(lines[-1])


def part_lookup(ctx, w, work: str) -> None:
    import redis

    srv = _Server(work, ["--size", "256MiB", "--chunk", "16MiB"]).start()
    rs = _Redis(work).start()
    try:
        import cxlalloc
        from cxlalloc.kvstore.client import RemoteBlockStore

        keys = [block_key(7, j, b"lk") for j in range(max(LOOKUP_KEYS))]
        alloc = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=256 * MiB)
        st = RemoteBlockStore(srv.url, alloc)
        res = st.reserve("", keys, LOOKUP_BLOCK, 16)
        import torch

        for k, v in zip(keys, res.views):
            v.copy_(torch.frombuffer(bytearray(pattern(k, LOOKUP_BLOCK)), dtype=torch.uint8))
        assert res.commit() == len(keys)
        st.close()
        r = redis.Redis.from_url(rs.url)
        r.mset({k: pattern(k, LOOKUP_BLOCK) for k in keys})
        r.close()
        phase_s = 0.5 if ctx.quick else 0.8
        rounds = MIN_ROUNDS if ctx.quick else LOOKUP_ROUNDS
        systems = ["kv-server", "redis", "redis_python"]
        for clients in LOOKUP_CLIENTS:
            if ctx.deadline.expired():
                w.skip(f"lookup clients={clients}", "time budget used up")
                continue
            t = 0.3  # seconds after every client is ready
            phases = []
            orders = {}
            for n in LOOKUP_KEYS:
                orders[n] = round_orders(systems, rounds, "rotate")  # the method: rotated order per round
                for rnd, seq in enumerate(orders[n]):
                    for system in seq:
                        phases.append({"system": system, "keys": n, "round": rnd, "start": t, "end": t + phase_s})
                        t += phase_s + 0.1
            go = os.path.join(work, f"go-{clients}")
            params = {"url": srv.url, "redis": rs.url, "keys": [k.hex() for k in keys], "block": LOOKUP_BLOCK,
                      "counts": list(LOOKUP_KEYS), "phases": phases, "go": go}
            load_before = machine_load()
            procs = [_spawn("lookup", dict(params, ready=os.path.join(work, f"ready-{clients}-{i}")),
                            os.path.join(work, f"lookup-{clients}-{i}.log")) for i in range(clients)]
            deadline = time.monotonic() + 300
            while not all(os.path.exists(os.path.join(work, f"ready-{clients}-{i}")) for i in range(clients)):
                if time.monotonic() > deadline or any(pr.poll() is not None for pr, _, _ in procs):
                    raise RuntimeError(f"a lookup client did not start: {open(procs[0][2], 'rb').read()[-800:]!r}")
                time.sleep(0.05)
            with open(go + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.replace(go + ".tmp", go)
            outs = []
            for proc, f, log in procs:
                proc.wait(timeout=t + 120)
                f.close()
                outs.append(_last_json(log))
            load_after = machine_load()
            hiredis = all(o.get("hiredis") for o in outs)
            for n in LOOKUP_KEYS:
                # requests/s per system and round, summed over the clients (a sample of the method)
                samples = {sy: [sum(o["requests"] / o["seconds"] for out in outs for o in out["phases"]
                                    if o["system"] == sy and o["keys"] == n and o["round"] == rnd)
                                for rnd in range(rounds)] for sy in systems}
                cmp = Comparison(systems, samples, orders[n], "rotate", 0, load_before, load_after)
                vs_hiredis = cmp.ratio("kv-server", "redis")
                vs_python = cmp.ratio("kv-server", "redis_python")
                med = {sy: cmp.spread(sy).median for sy in systems}
                row = {"part": "lookup", "clients": clients, "keys": n, "block_bytes": LOOKUP_BLOCK,
                       "redis_py": outs[0].get("redis_py"), "redis_parser": "hiredis" if hiredis else "python",
                       "kvserver_requests_per_s": round(med["kv-server"], 1),
                       "redis_mget_requests_per_s": round(med["redis"], 1),
                       "redis_python_parser_mget_requests_per_s": round(med["redis_python"], 1),
                       "kvserver_GBps": round(med["kv-server"] * n * LOOKUP_BLOCK / 1e9, 3),
                       "redis_GBps": round(med["redis"] * n * LOOKUP_BLOCK / 1e9, 3),
                       "ratio_kvserver_over_redis": vs_hiredis.as_dict(),
                       "ratio_kvserver_over_redis_python_parser": vs_python.as_dict(),
                       "phase_s": phase_s, "comparison": cmp.as_dict([("kv-server", "redis"),
                                                                      ("kv-server", "redis_python")]),
                       "method": "each client process (RemoteBlockStore; redis-py, 1 connection per parser) runs "
                                 "timed phases at the same wall-clock times: kv-server = lookup of n keys "
                                 "(protocol 2: one waited round trip, one-way release) + copy of each 64 KiB block "
                                 "into a tensor; redis = MGET of the same n keys with redis-py's default parser "
                                 "(hiredis when installed: 'redis_parser') + copy of each value into the same "
                                 "tensor; redis_python = the same with redis-py's pure-Python RESP2 parser; "
                                 f"{rounds} rounds per key count, the three systems in an order rotated per round; "
                                 "requests/s summed over clients per phase; ratios per round, then median/IQR"}
                if n in (1, 16):
                    row["goal"] = goal_record(f"lookup {n} keys, {clients} client(s) >= 1.0x redis-py MGET "
                                              f"({'hiredis' if hiredis else 'python parser'})", vs_hiredis, 1.0,
                                              "higher")
                w.add(row)
    finally:
        srv.stop()
        rs.stop()


# ----------------------------------------------------------------- insert
INSERT_BATCHES = 8   # reservations per timed sample of an arm (a sample of one 64 KiB batch is ~1 ms: too noisy)
INSERT_GOALS = {64 * KiB: 0.6, 1 * MiB: 0.8}   # memcpy time / insert time, issue 33


def _proc_cpu_ns(pid: int) -> int:
    """Nanoseconds process ``pid`` has run on a CPU, all its threads (Linux ``/proc/PID/task/*/schedstat``)."""
    total = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended between the listing and the read
            pass
    return total


def _cpu_seconds(fn, server_pid: int):
    """An arm that runs ``fn`` and returns the CPU seconds this process and process ``server_pid`` spent."""
    me = os.getpid()

    def arm():
        t0 = _proc_cpu_ns(me) + _proc_cpu_ns(server_pid)
        fn()
        return (_proc_cpu_ns(me) + _proc_cpu_ns(server_pid) - t0) / 1e9
    return arm


def part_insert(ctx, w, work: str) -> None:
    """Insert vs memcpy with the benchmark method (:mod:`.method`): per block size, the arms run interleaved
    in rotated order for >= 5 timed rounds, each sample ``INSERT_BATCHES`` reservations; the ratio memcpy /
    insert is taken per round and summarised with its spread, against its goal."""
    import torch

    import cxlalloc
    from cxlalloc.kvstore.client import RemoteBlockStore
    from cxlalloc_apps.bench.method import goal_record, interleave, noise_floor

    pool = 128 * MiB
    srv = _Server(work, ["--size", "128MiB", "--chunk", "16MiB"], name="kvi.sock").start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both sides copy on one thread (no pool wake-ups on a loaded 2-core machine)
    try:
        alloc = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=256 * MiB)
        st = RemoteBlockStore(srv.url, alloc, timeout=30)                   # pipelined commits (protocol 3)
        st_wait = RemoteBlockStore(srv.url, alloc, timeout=30, commit="wait")  # every commit waited (before)
        if not st._conn.pipelined_commit:
            raise RuntimeError("the kv-server does not speak protocol 3 (pipelined commits)")
        rounds = 7 if ctx.quick else 25
        serial = [0]

        def new_keys(n):
            serial[0] += 1
            return [block_key(serial[0], j, b"ins") for j in range(n)]

        for B, per in INSERT_SIZES:
            src = [torch.full((B,), j % 251, dtype=torch.uint8) for j in range(per)]
            dst = torch.empty(per * B, dtype=torch.uint8)
            dst.fill_(1)  # touched: memcpy into committed memory, as the pool is after the warm-up below
            # the same bytes written where the pool writes them: a pool-sized touched buffer, a new place each time
            cold = torch.empty(pool, dtype=torch.uint8)
            cold.fill_(1)
            at = [0]

            def fill(store, batch):
                for i in range(0, per, batch):
                    res = store.reserve("", new_keys(batch), B, 16)
                    for v, s_ in zip(res.views, src[i:i + batch]):
                        if v is None:
                            raise RuntimeError("no slot for a new block")
                        v.copy_(s_)
                    if res.commit() != batch:
                        raise RuntimeError("a block was not published")

            # warm-up: fill the whole pool once, so its pages are committed (eviction reuses them)
            for _ in range(pool // (per * B) + 2):
                fill(st, per)
            st.flush()

            def insert(store=st, batch=per):
                def arm():
                    for _ in range(INSERT_BATCHES):
                        fill(store, batch)
                    if not store.flush():  # the sample ends when every commit is acknowledged
                        raise RuntimeError("the kv-server did not acknowledge the commits")
                return arm

            def memcpy():
                for _ in range(INSERT_BATCHES):
                    for j, s_ in enumerate(src):
                        dst[j * B:(j + 1) * B].copy_(s_)

            def memcpy_cold():
                for _ in range(INSERT_BATCHES):
                    for s_ in src:
                        if at[0] + B > pool:
                            at[0] = 0
                        cold[at[0]:at[0] + B].copy_(s_)
                        at[0] += B

            arms = {"memcpy": memcpy, "insert": insert(), "insert_commit_waited": insert(st_wait),
                    "insert_one_per_reservation": insert(st, 1), "memcpy_cold": memcpy_cold}
            cmp = interleave(arms, rounds, warmup=1)
            # The same arms, each sample the CPU seconds this process and the kv-server spent (not the wall
            # time): on a shared machine, time spent descheduled is left out (the wake-up latencies too).
            cpu = interleave({a: _cpu_seconds(fn, srv.proc.pid) for a, fn in arms.items()}, rounds, warmup=1)
            floor = noise_floor(memcpy, rounds)
            ratio = cmp.ratio("memcpy", "insert")
            goal = INSERT_GOALS[B]
            total = INSERT_BATCHES * per * B
            med = {a: cmp.spread(a).median for a in cmp.arms}
            w.add({"part": "insert", "block_bytes": B, "blocks_per_reservation": per, "batches_per_sample": INSERT_BATCHES,
                   "ms_per_batch_median": {a: round(v / INSERT_BATCHES * 1e3, 3) for a, v in med.items()},
                   "GBps_median": {a: round(total / v / 1e9, 3) for a, v in med.items()},
                   "ratio_insert_over_memcpy": ratio.as_dict(),
                   "ratio_insert_commit_waited_over_memcpy": cmp.ratio("memcpy", "insert_commit_waited").as_dict(),
                   "ratio_one_per_reservation_over_memcpy": cmp.ratio("memcpy", "insert_one_per_reservation").as_dict(),
                   "ratio_insert_over_memcpy_cold": cmp.ratio("memcpy_cold", "insert").as_dict(),
                   "ratio_pipelined_over_waited": cmp.ratio("insert_commit_waited", "insert").as_dict(),
                   "cpu_ms_per_batch_median": {a: round(cpu.spread(a).median / INSERT_BATCHES * 1e3, 3)
                                               for a in cpu.arms},
                   "cpu_ratio_insert_over_memcpy": cpu.ratio("memcpy", "insert").as_dict(),
                   "cpu_ratio_insert_commit_waited_over_memcpy": cpu.ratio("memcpy", "insert_commit_waited").as_dict(),
                   "cpu_comparison": cpu.as_dict(),
                   "fixed_us_per_block_median": round((med["insert"] - med["memcpy"]) / (INSERT_BATCHES * per) * 1e6,
                                                      2),
                   "goal": goal_record(f"insert {B // KiB} KiB batch >= {goal}x memcpy", ratio, goal, "higher"),
                   "noise_floor_memcpy_aa": floor.as_dict(),
                   "comparison": cmp.as_dict(),
                   "method": f"{per} new blocks of {B} bytes per reservation: reserve of all {per} keys, a torch "
                             "copy_ of each block into its slot in the mapped pool, commit (pipelined: protocol 3, "
                             "acknowledged by the next reply; insert_commit_waited: commit=wait, the old path); "
                             f"each sample {INSERT_BATCHES} reservations and a flush (every commit acknowledged); vs "
                             "memcpy: a torch copy_ of each of the same blocks into one preallocated touched buffer "
                             "(memcpy_cold: into a touched pool-sized buffer, a new place each time, as the pool "
                             "is written); the pool was filled once before (committed pages, eviction on); ratios "
                             "are memcpy time / insert time per round (higher is better); cpu_*: the same arms interleaved "
                             "again, each "
                             "sample the CPU time of this process plus the kv-server's (/proc schedstat), which "
                             "leaves out time spent descheduled on a shared machine"})
        st.close()
        st_wait.close()
    finally:
        torch.set_num_threads(threads)
        srv.stop()


# ----------------------------------------------------------------- models
def _model():
    import torch

    from cxlalloc_apps.bench.reuse import _cpu_model

    torch.manual_seed(0)
    return _cpu_model()


class _FirstLogits:
    def __init__(self):
        self.t = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            self.t = time.perf_counter()
        return scores


def _wrap(base, **opts):
    """A copy of ``base`` wrapped with KV reuse (tiers sized as the reuse benchmark does on the CPU)."""
    import cxlalloc.hf as hf

    m = copy.deepcopy(base)
    wb = sum(p.numel() * p.element_size() for p in m.parameters())
    return hf.wrap(m, kv_store=True, device_limit=wb + 512 * MiB, host_limit=1 << 30, **opts)


def _timed_generate(model, **kw):
    """(output, ms to the first logits)."""
    import torch
    from transformers import LogitsProcessorList

    stamp = _FirstLogits()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(logits_processor=LogitsProcessorList([stamp]), do_sample=False, pad_token_id=0, **kw)
    return out, (stamp.t - t0) * 1e3


CHAT_GOAL = 1.1     # wrapped prefill / by-hand DynamicCache prefill (issue 33)
PREFIX_GOAL = 1.0   # wrapped hit TTFT / transformers' deepcopy recipe (issue 33)


def _rounds(ctx, full: int) -> int:
    from cxlalloc_apps.bench.method import MIN_ROUNDS

    return MIN_ROUNDS if ctx.quick else full


def part_chat(ctx, w, work: str) -> None:
    """A 20-turn chat per round and arm (new user turns each round, the same for every arm of a round);
    the sample is the conversation's summed prefill; arms interleaved by cxlalloc_apps/bench/method.py."""
    import torch
    from transformers import DynamicCache

    import cxlalloc.hf as hf
    from cxlalloc_apps.bench import method

    base, name = _model()
    vocab = int(base.config.vocab_size)
    turns = 8 if ctx.quick else CHAT_TURNS
    models = {"by_hand_dynamic_cache": base, "wrapped_kv_store": _wrap(base),
              "wrapped_blocks_only": _wrap(base, kv_conversation_limit=0),
              "wrapped_full_fingerprint": _wrap(base, kv_store_fingerprint="full")}
    calls = {a: 0 for a in models}
    per_turn = {a: [] for a in models}
    hits = {a: [] for a in models}
    finals = {}

    def conversation(arm):
        k = calls[arm]
        calls[arm] += 1
        g = torch.Generator().manual_seed(1000 + k)  # round k: the same turns for every arm
        hist = torch.randint(3, vocab, (1, 64), generator=g)
        user = [torch.randint(3, vocab, (1, CHAT_USER_TOKENS), generator=g) for _ in range(turns)]
        m = models[arm]
        cache = DynamicCache(config=base.config) if arm == "by_hand_dynamic_cache" else None
        kw = dict(max_new_tokens=CHAT_ANSWER_TOKENS, min_new_tokens=CHAT_ANSWER_TOKENS)
        ms_turns, hit_turns = [], []
        for t in range(turns):
            ids = torch.cat([hist, user[t]], 1)
            if cache is not None:
                out, ms = _timed_generate(m, input_ids=ids, **{hf.cache_kwarg(m): cache}, **kw)
            else:
                out, ms = _timed_generate(m, input_ids=ids, **kw)
                hit_turns.append(hf.stats(m)["hf"]["reuse"]["last"]["hit_tokens"])
            ms_turns.append(round(ms, 3))
            hist = out
        per_turn[arm].append(ms_turns)
        hits[arm].append(hit_turns)
        finals.setdefault(k, {})[arm] = hist
        return sum(ms_turns)

    cmp = method.interleave({a: (lambda a=a: conversation(a)) for a in models}, _rounds(ctx, 5), warmup=1)
    equal = all(torch.equal(f["by_hand_dynamic_cache"], f[a]) for f in finals.values() for a in f)
    ref = "by_hand_dynamic_cache"
    ratios = [(a, ref) for a in models if a != ref]
    g0 = torch.randint(3, vocab, (1, 64 + CHAT_USER_TOKENS), generator=torch.Generator().manual_seed(1))
    noise = method.noise_floor(lambda: _timed_generate(base, input_ids=g0, max_new_tokens=1)[1])
    wrapped = cmp.ratio("wrapped_kv_store", ref)
    timed = {a: v[1:] for a, v in per_turn.items()}  # the warm-up round is not a sample
    w.add({"part": "chat", "model": name, "turns": turns, "user_tokens_per_turn": CHAT_USER_TOKENS,
           "answer_tokens_per_turn": CHAT_ANSWER_TOKENS, "final_tokens": int(64 + turns * (CHAT_USER_TOKENS
                                                                                             + CHAT_ANSWER_TOKENS)),
           "comparison": cmp.as_dict(ratios), "unit": "ms (a conversation's summed prefill)",
           "prefill_ms_total_median": {a: round(cmp.spread(a).median, 1) for a in models},
           "ratio_wrapped_over_by_hand": round(wrapped.median, 3),
           "goal": method.goal_record("chat: wrapped / by-hand DynamicCache prefill", wrapped, CHAT_GOAL),
           "noise_floor_ratio": noise.as_dict(), "ttft_ms_per_turn": timed, "hit_tokens_per_turn": hits,
           "tokens_equal": bool(equal),
           "reuse_counters": hf.stats(models["wrapped_kv_store"])["hf"]["reuse"]["counters"],
           "method": "each round runs one 20-turn conversation per arm (new user turns each round, the same for "
                     "every arm of that round), the arms interleaved in rotated order (method.py); by hand = the "
                     "unwrapped model with one transformers DynamicCache passed to every generate(); wrapped = "
                     "hf.wrap(kv_store=True) (defaults: the last conversation's cache continues, "
                     "kv_store_fingerprint='guarded'); blocks only = kv_conversation_limit=0; full fingerprint = "
                     "kv_store_fingerprint='full'; sample = summed ms from each generate() call to its first "
                     "logits (a logits processor stamps it); noise floor = an A/A ratio of a 1-token generate()"})
    for a, m in models.items():
        if a != ref:
            hf.unwrap(m)


def part_prefix(ctx, w, work: str) -> None:
    """Hits on a shared 1,024-token document, one new question per round and arm, against transformers'
    deepcopy recipe; arms interleaved by cxlalloc_apps/bench/method.py."""
    import torch
    from transformers import DynamicCache

    import cxlalloc.hf as hf
    from cxlalloc_apps.bench import method

    base, name = _model()
    vocab = int(base.config.vocab_size)
    rounds = _rounds(ctx, 9)
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, vocab, (1, PREFIX_TOKENS), generator=g)
    qs = [torch.randint(3, vocab, (1, QUESTION_TOKENS), generator=g) for _ in range(rounds + 2)]
    prefix = DynamicCache(config=base.config)
    with torch.no_grad():
        base(doc, use_cache=True, **{hf.cache_kwarg(base): prefix})
    wrapped = {"wrapped_kv_store": _wrap(base), "wrapped_blocks_only": _wrap(base, kv_conversation_limit=0),
               "wrapped_full_fingerprint": _wrap(base, kv_store_fingerprint="full")}
    for m in wrapped.values():  # the first request stores the document's blocks
        _timed_generate(m, input_ids=torch.cat([doc, qs[0]], 1), max_new_tokens=1)
    calls = {a: 0 for a in ("deepcopy_recipe", "recompute", *wrapped)}
    outs, hit = {}, {a: [] for a in wrapped}

    def request(arm):
        k = calls[arm]
        calls[arm] += 1
        ids = torch.cat([doc, qs[1 + k]], 1)
        if arm == "deepcopy_recipe":
            t0 = time.perf_counter()
            c = copy.deepcopy(prefix)
            dc_ms = (time.perf_counter() - t0) * 1e3
            out, ms = _timed_generate(base, input_ids=ids, **{hf.cache_kwarg(base): c}, max_new_tokens=1)
            ms += dc_ms
        elif arm == "recompute":
            out, ms = _timed_generate(base, input_ids=ids, max_new_tokens=1)
        else:
            out, ms = _timed_generate(wrapped[arm], input_ids=ids, max_new_tokens=1)
            hit[arm].append(hf.stats(wrapped[arm])["hf"]["reuse"]["last"]["hit_tokens"])
        outs.setdefault(k, {})[arm] = out
        return ms

    cmp = method.interleave({a: (lambda a=a: request(a)) for a in calls}, rounds, warmup=1)
    equal = all(torch.equal(o["deepcopy_recipe"], o[a]) for o in outs.values() for a in o)
    ref = "deepcopy_recipe"
    ratios = [(a, ref) for a in calls if a != ref]

    def recipe_once():
        c = copy.deepcopy(prefix)
        return _timed_generate(base, input_ids=torch.cat([doc, qs[0]], 1), **{hf.cache_kwarg(base): c},
                               max_new_tokens=1)[1]

    noise = method.noise_floor(recipe_once)
    r = cmp.ratio("wrapped_kv_store", ref)
    w.add({"part": "prefix", "model": name, "prefix_tokens": PREFIX_TOKENS, "question_tokens": QUESTION_TOKENS,
           "comparison": cmp.as_dict(ratios), "unit": "ms (TTFT)",
           "ttft_ms_median": {a: round(cmp.spread(a).median, 2) for a in calls}, "hit_tokens": hit,
           "ratio_wrapped_over_recipe": round(r.median, 3),
           "goal": method.goal_record("prefix hits: wrapped / transformers' deepcopy recipe TTFT", r, PREFIX_GOAL),
           "noise_floor_ratio": noise.as_dict(), "tokens_equal": bool(equal),
           "method": "a 1,024-token document prefilled once into a DynamicCache; each round sends one request "
                     "(document + a new 16-token question) to every arm, interleaved in rotated order "
                     "(method.py): recipe = copy.deepcopy of that cache + generate() of the unwrapped model "
                     "(time of both); wrapped = hf.wrap(kv_store=True) (the previous request's cache continues, "
                     "cropped to the document); blocks only = kv_conversation_limit=0 (the document's blocks "
                     "loaded from the in-process store); full fingerprint = kv_store_fingerprint='full'; "
                     "recompute = the unwrapped model without a cache; TTFT to the first logits; noise floor = "
                     "an A/A ratio of the recipe"})
    for m in wrapped.values():
        hf.unwrap(m)


PARTS = {"lookup": part_lookup, "insert": part_insert, "chat": part_chat, "prefix": part_prefix}


def run(ctx) -> Dict[str, Any]:
    chosen = _chosen(ctx, PARTS)
    params = {"parts": chosen, "quick": ctx.quick, "lookup_block_bytes": LOOKUP_BLOCK,
              "lookup_keys": list(LOOKUP_KEYS), "lookup_clients": list(LOOKUP_CLIENTS),
              "insert_sizes": [list(x) for x in INSERT_SIZES], "chat_turns": CHAT_TURNS,
              "prefix_tokens": PREFIX_TOKENS, "torch_threads": 1,
              "units": "ms, requests/s, GB/s = 1e9 bytes/s; ratios as named (see each result's method)",
              "goals": {"lookup_1_16_keys": ">= 1.0 (kv-server / redis MGET)",
                        "insert_1MiB": ">= 0.8 (memcpy time / insert time)", "insert_64KiB": ">= 0.6",
                        "chat": "<= 1.1 (wrapped prefill / by-hand cache prefill)",
                        "prefix": "<= 1.0 (wrapped hit TTFT / deepcopy recipe TTFT)"},
              "where": "CPU; the GPU side is cxlalloc's simulated driver (CPU figures, not GPU ones)"}
    w = RecordWriter(ctx.out_dir, new_record("kvspeed", params, True, ctx.argv, ctx.device))
    w.note("CPU run on the machine in 'hardware' (shared with other work): the tiers are cxlalloc's simulated "
           "driver; kv-server and redis-server run as local processes; not yet run on a GPU")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:
        pass
    import torch

    # One compute thread for every side: on a loaded 2-core machine a second OpenMP thread spins and gets
    # descheduled (measured: a 4 MiB copy_ at 1.5 s instead of 1 ms), which would slow whichever side ran then.
    torch.set_num_threads(1)
    run_parts(ctx, w, PARTS, "kvspeed", chosen)
    rec = w.finish()
    try:
        plot(rec, os.path.join(ctx.out_dir, "kvspeed.png"))
    except Exception as e:  # a missing matplotlib never loses the record
        ctx.log(f"bench kvspeed: no plot ({type(e).__name__}: {e})")
    return rec


def plot(rec: Dict[str, Any], path: str) -> Optional[str]:
    """The four ratios against their goals (a dashed line at the goal)."""
    res = rec.get("results", [])
    if not res:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    lk = [r for r in res if r.get("part") == "lookup"]
    a = axes[0]
    for n in LOOKUP_KEYS:
        rows = sorted((r for r in lk if r["keys"] == n), key=lambda r: r["clients"])
        if not rows or not isinstance(rows[0].get("ratio_kvserver_over_redis"), dict):
            continue
        med = [r["ratio_kvserver_over_redis"]["median"] for r in rows]
        err = [[m - r["ratio_kvserver_over_redis"]["q1"] for m, r in zip(med, rows)],
               [r["ratio_kvserver_over_redis"]["q3"] - m for m, r in zip(med, rows)]]
        line = a.errorbar([r["clients"] for r in rows], med, yerr=err, fmt="o-", capsize=3,
                          label=f"{n} keys vs {rows[0].get('redis_parser', '?')}")
        a.plot([r["clients"] for r in rows], [r["ratio_kvserver_over_redis_python_parser"]["median"] for r in rows],
               ":", color=line[0].get_color(), label=f"{n} keys vs python parser")
    a.axhline(1.0, color="k", ls="--", lw=1)
    if lk:  # a record of other parts only (--parts chat,prefix) has no lookup rows to scale
        a.set_xscale("log", base=2)
    a.set_xlabel("client processes")
    a.set_ylabel("kv-server / redis MGET (requests/s)")
    a.set_title("lookup (64 KiB blocks; median, IQR)")
    a.legend(fontsize=7)
    ins = [r for r in res if r.get("part") == "insert"]
    a = axes[1]
    x = [f"{r['block_bytes'] // KiB} KiB" for r in ins]
    arms = [("ratio_insert_over_memcpy", "batched, pipelined commit"),
            ("ratio_insert_commit_waited_over_memcpy", "batched, commit waited"),
            ("ratio_one_per_reservation_over_memcpy", "one per reservation"),
            ("cpu_ratio_insert_over_memcpy", "pipelined, in CPU time")]
    width = 0.8 / len(arms)
    for k, (field, label) in enumerate(arms):
        rows = [r[field] for r in ins if isinstance(r.get(field), dict)]
        if len(rows) != len(ins):
            continue
        med = [d["median"] for d in rows]
        err = [[m - d["q1"] for m, d in zip(med, rows)], [d["q3"] - m for m, d in zip(med, rows)]]
        a.bar([i + (k - (len(arms) - 1) / 2) * width for i in range(len(ins))], med, width, yerr=err, capsize=3,
              label=label)
    a.set_xticks(range(len(ins)), x)
    for i, goal in enumerate([0.6 if r["block_bytes"] < MiB else 0.8 for r in ins]):
        a.hlines(goal, i - 0.45, i + 0.45, colors="k", linestyles="--", lw=1)
    a.set_ylabel("memcpy time / insert time (median, IQR)")
    a.set_title("insert vs memcpy")
    a.legend(fontsize=7)
    for a, part in ((axes[2], "chat"), (axes[3], "prefix")):
        rows = [r for r in res if r.get("part") == part and "comparison" in r]
        if not rows:
            continue
        c = rows[0]["comparison"]
        names = list(c["ratios"])
        vals = [c["ratios"][k] for k in names]
        med = [v["median"] for v in vals]
        lo = [v["median"] - v["q1"] for v in vals]
        hi = [v["q3"] - v["median"] for v in vals]
        a.bar(range(len(names)), med, yerr=[lo, hi], capsize=4)
        a.set_xticks(range(len(names)), [k.split("/")[0].replace("_", "\n") for k in names], fontsize=7)
        goal = rows[0]["goal"]
        a.axhline(goal["target"], color="k", ls="--", lw=1)
        ref = names[0].split("/")[1]
        a.set_ylabel(f"ratio to {ref} (median, IQR)")
        a.set_title(f"{part}: {goal['verdict']} (goal <= {goal['target']})")
    sim = rec.get("simulated", False)
    fig.suptitle(("SIMULATION (CPU compute, simulated tiers): " if sim else "") + "KV reuse speed side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(rec: Dict[str, Any]) -> str:
    """The chat and prefix figures of a record as a markdown table (benchmarks/README.md is pasted from it):
    per ratio its median, IQR and min-max over the rounds, the goal's verdict, the A/A noise floor and the
    load average before/after.  Empty when the record has neither part measured with method.py."""
    rows = ["| part | ratio (per round) | median | IQR | min-max | rounds | goal | verdict | A/A noise (IQR) "
            "| load avg 1m before/after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rec.get("results", []):
        c = r.get("comparison")
        if r.get("part") not in ("chat", "prefix") or not c:
            continue
        goal, nf = r["goal"], r["noise_floor_ratio"]
        load = f"{c['load_before'].get('loadavg_1m')} / {c['load_after'].get('loadavg_1m')}"
        for name, v in c["ratios"].items():
            main = name.startswith("wrapped_kv_store/")
            rows.append(f"| {r['part']} | `{name}` | {'**' if main else ''}{v['median']:.3f}x{'**' if main else ''} "
                        f"| {v['q1']:.3f}-{v['q3']:.3f} | {v['min']:.3f}-{v['max']:.3f} | {v['n']} "
                        f"| {'<= ' + str(goal['target']) if main else ''} | {goal['verdict'] if main else ''} "
                        f"| {nf['q1']:.3f}-{nf['q3']:.3f} | {load} |")
    return "\n".join(rows) + "\n" if len(rows) > 2 else ""


WORKERS = {"lookup": worker_lookup}


def _worker_main(role: str, params: str) -> int:
    out = WORKERS[role](json.loads(params))
    print(json.dumps(out), flush=True)
    os._exit(0)  # skip the interpreter's teardown (seconds with torch loaded)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2], sys.argv[3]))
    from cxlalloc_apps.bench.cli import main

    sys.exit(main(["--only", "kvspeed"] + sys.argv[1:]))
