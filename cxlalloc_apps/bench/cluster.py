"""The RESP tier on a Redis/Valkey Cluster vs one server vs redis-py's own cluster client (CPU).

    python -m cxlalloc bench --only cluster [--quick] --out DIR

Writes ``DIR/cluster.json`` (:mod:`.meta` record) and ``DIR/cluster.png``.
Everything runs on this machine: a local 3-primary + 3-replica cluster
(``scripts/redis_cluster.sh``, loopback TCP) and one ``redis-server``, the same
blocks stored in both.

reads
    N client processes (1-16) each read K keys (1-512) per call in a loop for
    a fixed time, through three arms on the same keys and bytes: cxlalloc's
    tier on the cluster (``redis+cluster://``: slot-grouped per-node
    pipelines), the same tier on one server (``redis://``: ``MGET`` in
    batches), and redis-py's ``RedisCluster.mget_nonatomic`` (one ``MGET`` per
    slot through its cluster pipeline).  Every arm checks each value's header
    and CRC-32 (the tier's check), so the arms do the same work per byte.
    Arms interleaved in a rotated order per round, >= 5 rounds; per round the
    ratios of keys/s; reported as median and IQR over the rounds, with the
    1-minute load average at each round.
writes
    Blocks put through the tier (queued, pipelined ``SET`` per node by its
    writer thread) until flushed, cluster vs one server, vs redis-py's
    ``mset_nonatomic``; blocks/s, same rounds and ratios.
failover
    4 clients read 16-key prefixes through the tier in a loop; a primary is
    killed (SIGKILL) and its replica promoted by the cluster; per-read latency
    p50/p99/max from the kill to 2 s after every read hits again, the seconds
    until then, wrong blocks loaded (must be 0); the same for redis-py's
    ``mget_nonatomic`` (its errors counted).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "redis_cluster.sh")
BLOCK = 32 << 10
NBLOCKS = 1024
ARMS = ("tier_cluster", "tier_single", "redispy_mget_nonatomic")
WRITE_ARMS = ("tier_cluster", "tier_single", "redispy_mset_nonatomic")


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _iqr(xs: List[float]) -> Dict[str, Optional[float]]:
    return {"median": _pct(xs, 0.5), "q1": _pct(xs, 0.25), "q3": _pct(xs, 0.75), "n": len(xs)}


def _nskey(i: int, tag: str = "b") -> bytes:
    import hashlib

    return hashlib.blake2b(f"{tag}{i}".encode(), digest_size=32).digest()


def _payload(nskey: bytes, n: int = BLOCK) -> bytes:
    return (nskey * (n // len(nskey) + 1))[:n]


# ----------------------------------------------------------------- the worker (its own process)
class _Worker:
    def __init__(self, cfg: dict):
        import redis

        from cxlalloc.kvstore.tiers.redis import RedisTier

        self.cfg = cfg
        self.prefix = cfg["prefix"]
        self.tiers = {"tier_cluster": RedisTier(cfg["cluster_url"], prefix=self.prefix, timeout=cfg["timeout"]),
                      "tier_single": RedisTier(cfg["single_url"], prefix=self.prefix, timeout=cfg["timeout"])}
        self.rc = redis.RedisCluster.from_url(cfg["cluster_url"].replace("redis+cluster://", "redis://"),
                                              socket_timeout=cfg["timeout"])
        self.keys = [_nskey(i) for i in range(NBLOCKS)]
        self.rkeys = [self.tiers["tier_cluster"]._rkey(k) for k in self.keys]
        self.rng = random.Random(cfg["seed"])

    def _read(self, arm: str, idx: List[int]):
        """(values or None per key, error or None)."""
        from cxlalloc.kvstore.tiers.redis import unpack_value

        ks = [self.keys[i] for i in idx]
        if arm == "redispy_mget_nonatomic":
            try:
                vals = self.rc.mget_nonatomic([self.rkeys[i] for i in idx])
            except Exception as e:
                return [None] * len(idx), f"{type(e).__name__}"
            return [unpack_value(k, v) for k, v in zip(ks, vals)], None
        return self.tiers[arm].get_many_ns(ks), None

    def reads(self, arm: str, n: int, start_at: float, duration: float) -> dict:
        while time.time() < start_at:
            time.sleep(0.0005)
        lat, ops, keys_ok = [], 0, 0
        end = time.perf_counter() + duration
        while True:
            base = self.rng.randrange(0, NBLOCKS - n + 1)
            idx = list(range(base, base + n))
            t0 = time.perf_counter()
            vals, _err = self._read(arm, idx)
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            ops += 1
            keys_ok += sum(v is not None for v in vals)
            if t1 >= end:
                break
        return {"ops": ops, "keys": keys_ok, "busy_s": sum(lat), "lat_p50": _pct(lat, 0.5), "lat_p99": _pct(lat, 0.99)}

    def writes(self, arm: str, n: int, start_at: float, rnd: int) -> dict:
        ks = [_nskey(i, f"w{rnd}:{self.cfg['seed']}:") for i in range(n)]
        data = [_payload(k) for k in ks]
        while time.time() < start_at:
            time.sleep(0.0005)
        t0 = time.perf_counter()
        if arm == "redispy_mset_nonatomic":
            from cxlalloc.kvstore.tiers.redis import pack_value

            t = self.tiers["tier_cluster"]
            self.rc.mset_nonatomic({t._rkey(k): pack_value(k, d) for k, d in zip(ks, data)})
            ok = n
        else:
            t = self.tiers[arm]
            before = t.stats()["put_blocks"]
            for k, d in zip(ks, data):
                t.put_ns(k, d)
            t.flush(60)
            ok = t.stats()["put_blocks"] - before
        return {"blocks": ok, "wall_s": time.perf_counter() - t0}

    def failover(self, arm: str, n: int, start_at: float, duration: float) -> dict:
        while time.time() < start_at:
            time.sleep(0.0005)
        rows = []
        end = time.time() + duration
        while time.time() < end:
            base = self.rng.randrange(0, NBLOCKS - n + 1)
            idx = list(range(base, base + n))
            t0 = time.perf_counter()
            vals, err = self._read(arm, idx)
            dt = time.perf_counter() - t0
            wrong = sum(1 for i, v in zip(idx, vals) if v is not None and v != _payload(self.keys[i]))
            rows.append((time.time(), dt, sum(v is not None for v in vals) == n, wrong, err))
            time.sleep(0.002)
        return {"rows": rows}


def _worker_main() -> int:
    w = None
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.pop("op")
        if op == "init":
            w = _Worker(msg)
            out: Any = {"ok": True}
        elif op == "quit":
            break
        else:
            out = getattr(w, op)(**msg)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------- the parent
class _Pool:
    """N worker processes driven in lockstep over stdin/stdout."""

    def __init__(self, n: int, cfg: dict):
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.procs = []
        for i in range(n):
            p = subprocess.Popen([sys.executable, "-m", "cxlalloc_apps.bench.cluster", "--worker"], cwd=REPO, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(p)
        self.call(dict(cfg, op="init"), per_worker=lambda i, m: dict(m, seed=i))

    def call(self, msg: dict, n: Optional[int] = None, per_worker=None) -> List[dict]:
        procs = self.procs[:n] if n else self.procs
        for i, p in enumerate(procs):
            m = per_worker(i, msg) if per_worker else msg
            p.stdin.write(json.dumps(m) + "\n")
            p.stdin.flush()
        out = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"bench worker {p.pid} exited ({p.poll()})")
            out.append(json.loads(line))
        return out

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _single_server(work: str):
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return p, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    p.kill()
    raise RuntimeError("redis-server did not start")


def _fill(url: str, prefix: str) -> None:
    from cxlalloc.kvstore.tiers.redis import RedisTier

    t = RedisTier(url, prefix=prefix, queue_bytes=1 << 30)
    for i in range(NBLOCKS):
        k = _nskey(i)
        t.put_ns(k, _payload(k))
    if not t.flush(120) or t.stats()["put_blocks"] < NBLOCKS:
        raise RuntimeError(f"filling {url} failed: {t.stats()}")
    t.close()


def _cluster_nodes(seed_port: int) -> Dict[str, Any]:
    import redis

    r = redis.Redis(port=seed_port, socket_timeout=2)
    text = r.execute_command("CLUSTER", "NODES")
    text = text.decode() if isinstance(text, bytes) else text
    out = []
    for line in text.strip().splitlines():
        f = line.split()
        out.append({"port": int(f[1].split("@")[0].rsplit(":", 1)[1]), "primary": "master" in f[2],
                    "failed": "fail" in f[2].split(",")})
    return out


def run(ctx) -> Dict[str, Any]:
    from cxlalloc_apps.bench.meta import RecordWriter, new_record

    quick = bool(getattr(ctx, "quick", False))
    keys_grid = [1, 16, 128, 512] if quick else [1, 4, 16, 64, 256, 512]
    clients_grid = [1, 4] if quick else [1, 4, 16]
    rounds = 5
    duration = 0.25 if quick else 0.4
    params = {"block_bytes": BLOCK, "blocks_stored": NBLOCKS, "keys_per_call": keys_grid, "clients": clients_grid,
              "rounds": rounds, "seconds_per_arm_and_round": duration, "arms": list(ARMS), "write_arms": list(WRITE_ARMS),
              "units": "keys/s (values read and checked per second, all clients), blocks/s, seconds",
              "where": "CPU, loopback TCP; a local 3-primary + 3-replica cluster and one server on this machine"}
    w = RecordWriter(ctx.out_dir, new_record("cluster", params, False, ctx.argv, ctx.device))
    server = shutil.which("valkey-server") or shutil.which("redis-server")
    if server is None or not os.path.exists(SCRIPT):
        return w.finish_skipped("cluster", "needs redis-server/valkey-server and scripts/redis_cluster.sh (a checkout); "
                                "Debian: apt-get install -y redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        return w.finish_skipped("cluster", "redis-py is not installed (pip install redis)")
    work = tempfile.mkdtemp(prefix="clusterbench-", dir="/tmp")
    single = None
    pool = None
    try:
        out = subprocess.run([SCRIPT, "start", os.path.join(work, "c")], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"scripts/redis_cluster.sh start failed: {out.stderr[-1500:]}")
        seed = out.stdout.strip().splitlines()[-1]
        cluster_url = seed.replace("redis://", "redis+cluster://")
        with open(os.path.join(work, "c", "server")) as f:
            w.note(f"cluster: 3 primaries + 3 replicas of {f.read().strip()} on 127.0.0.1 (scripts/redis_cluster.sh)")
        single, single_url = _single_server(work)
        prefix = "bench:"
        _fill(cluster_url, prefix)
        _fill(single_url, prefix)
        cfg = {"cluster_url": cluster_url, "single_url": single_url, "prefix": prefix, "timeout": 0.5}
        pool = _Pool(max(clients_grid), cfg)
        _reads(ctx, w, pool, keys_grid, clients_grid, rounds, duration)
        _writes(ctx, w, pool, [16, 256] if quick else [16, 128, 512], [1, 4], rounds)
        _failover(ctx, w, pool, os.path.join(work, "c"), seed)
        _plot(w, ctx.out_dir)
    except Exception as e:
        import traceback

        w.error("cluster", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    finally:
        if pool is not None:
            pool.close()
        if single is not None:
            single.kill()
            single.wait()
        subprocess.run([SCRIPT, "stop", os.path.join(work, "c")], capture_output=True, timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    return w.finish()


def _reads(ctx, w, pool, keys_grid, clients_grid, rounds, duration) -> None:
    for clients in clients_grid:
        for n in keys_grid:
            per_round: Dict[str, List[float]] = {a: [] for a in ARMS}
            p99: Dict[str, List[float]] = {a: [] for a in ARMS}
            loads = []
            for r in range(rounds):
                loads.append(os.getloadavg()[0])
                order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]  # rotated: no arm always first
                for arm in order:
                    res = pool.call({"op": "reads", "arm": arm, "n": n, "start_at": time.time() + 0.05,
                                     "duration": duration}, n=clients)
                    wall = max(x["busy_s"] for x in res)
                    per_round[arm].append(sum(x["keys"] for x in res) / wall)
                    p99[arm].append(max(x["lat_p99"] for x in res))
            ratio_rp = [a / b for a, b in zip(per_round["tier_cluster"], per_round["redispy_mget_nonatomic"])]
            ratio_single = [a / b for a, b in zip(per_round["tier_cluster"], per_round["tier_single"])]
            w.add({"part": "reads", "clients": clients, "keys_per_call": n,
                   "keys_per_s": {a: _iqr(v) for a, v in per_round.items()},
                   "call_p99_s": {a: _iqr(v) for a, v in p99.items()},
                   "ratio_cluster_tier_vs_redispy_mget_nonatomic": _iqr(ratio_rp),
                   "ratio_cluster_tier_vs_single_server_tier": _iqr(ratio_single),
                   "load_avg_1m": loads,
                   "method": "per round, each arm in rotated order: `clients` processes start together and read "
                             "`keys_per_call` consecutive stored blocks (random start) per call for the given seconds; "
                             "keys/s = values read and header/CRC-checked by all clients / the longest client's busy "
                             "time; ratios per round, then median and IQR over the rounds"})
            ctx.log(f"cluster reads: {clients} clients x {n} keys: tier/mget_nonatomic "
                    f"{_pct(ratio_rp, 0.5):.2f}, tier cluster/single {_pct(ratio_single, 0.5):.2f}")


def _writes(ctx, w, pool, keys_grid, clients_grid, rounds) -> None:
    for clients in clients_grid:
        for n in keys_grid:
            per_round: Dict[str, List[float]] = {a: [] for a in WRITE_ARMS}
            loads = []
            for r in range(rounds):
                loads.append(os.getloadavg()[0])
                order = WRITE_ARMS[r % len(WRITE_ARMS):] + WRITE_ARMS[:r % len(WRITE_ARMS)]
                for arm in order:
                    res = pool.call({"op": "writes", "arm": arm, "n": n, "start_at": time.time() + 0.05, "rnd": r},
                                    n=clients)
                    per_round[arm].append(sum(x["blocks"] for x in res) / max(x["wall_s"] for x in res))
            w.add({"part": "writes", "clients": clients, "blocks_per_client": n,
                   "blocks_per_s": {a: _iqr(v) for a, v in per_round.items()},
                   "ratio_cluster_tier_vs_redispy_mset_nonatomic": _iqr(
                       [a / b for a, b in zip(per_round["tier_cluster"], per_round["redispy_mset_nonatomic"])]),
                   "ratio_cluster_tier_vs_single_server_tier": _iqr(
                       [a / b for a, b in zip(per_round["tier_cluster"], per_round["tier_single"])]),
                   "load_avg_1m": loads,
                   "method": f"each client puts `blocks_per_client` new {BLOCK >> 10} KiB blocks and waits until "
                             "they are written (tier: put_ns then flush; redis-py: one mset_nonatomic of the packed "
                             "values); blocks/s = all blocks / the longest client's wall time; rounds rotated"})


def _failover(ctx, w, pool, cdir: str, seed: str) -> None:
    seed_port = int(seed.rsplit(":", 1)[1])
    for arm in ("tier_cluster", "redispy_mget_nonatomic"):
        nodes = _cluster_nodes(seed_port)
        victim = next(n["port"] for n in nodes if n["primary"] and not n["failed"] and n["port"] != seed_port)
        with open(os.path.join(cdir, "nodes.txt")) as f:
            pids = dict(tuple(map(int, line.split())) for line in f)
        start = time.time() + 0.3
        kill_at = start + 1.5
        window = 9.0
        # the clients run while this process kills the primary
        procs = pool.procs[:4]
        for i, p in enumerate(procs):
            p.stdin.write(json.dumps({"op": "failover", "arm": arm, "n": 16, "start_at": start, "duration": window})
                          + "\n")
            p.stdin.flush()
        time.sleep(max(0.0, kill_at - time.time()))
        os.kill(pids[victim], 9)
        kill_t = time.time()
        rows = []
        for p in procs:
            rows += json.loads(p.stdout.readline())["rows"]
        rows.sort()
        after = [r for r in rows if r[0] >= kill_t]
        miss_t = [r[0] for r in after if not r[2]]
        recovered_at = max(miss_t) if miss_t else kill_t
        win = [r for r in after if r[0] <= recovered_at + 2.0]
        lat = [r[1] for r in win]
        before = [r[1] for r in rows if r[0] < kill_t]
        w.add({"part": "failover", "arm": arm, "clients": 4, "keys_per_call": 16, "reads_in_window": len(win),
               "read_p50_s": _pct(lat, 0.5), "read_p99_s": _pct(lat, 0.99), "read_max_s": max(lat) if lat else None,
               "read_p99_s_before_kill": _pct(before, 0.99),
               "seconds_until_all_hit": recovered_at - kill_t, "wrong_blocks": sum(r[3] for r in rows),
               "errors_raised": sum(1 for r in after if r[4]), "timeout_s": 0.5,
               "method": "4 clients read 16-key prefixes in a loop (2 ms apart); one primary is SIGKILLed 1.5 s in; "
                         "its replica is promoted by the cluster (cluster-node-timeout 1000 ms); latencies of the "
                         "reads from the kill to 2 s after the last miss; wrong = a value loaded that differs from "
                         "the block written"})
        ctx.log(f"cluster failover ({arm}): p99 {_pct(lat, 0.99)}, recovered in {recovered_at - kill_t:.2f} s")
        # put the node back (it rejoins as a replica)
        nd = os.path.join(cdir, f"n{victim}")
        server = shutil.which("valkey-server") or shutil.which("redis-server")
        log = open(os.path.join(cdir, f"node-{victim}.log"), "ab")
        p = subprocess.Popen([server, "--bind", "127.0.0.1", "--port", str(victim), "--cluster-enabled", "yes",
                              "--cluster-config-file", os.path.join(nd, "nodes.conf"), "--cluster-node-timeout", "1000",
                              "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0", "--save", "",
                              "--appendonly", "no", "--dir", nd, "--daemonize", "no", "--protected-mode", "no"],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        pids[victim] = p.pid
        with open(os.path.join(cdir, "nodes.txt"), "w") as f:
            for port, pid in pids.items():
                f.write(f"{port} {pid}\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            nodes = _cluster_nodes(seed_port)
            if all(not n["failed"] for n in nodes) and sum(n["primary"] for n in nodes) == 3:
                break
            time.sleep(0.2)
        time.sleep(1.0)


def _plot(w, out_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        w.note("no plot: matplotlib is not installed")
        return
    rows = [r for r in w.record["results"] if r["part"] == "reads"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, key, title in ((axes[0], "ratio_cluster_tier_vs_redispy_mget_nonatomic", "cluster tier / redis-py mget_nonatomic"),
                           (axes[1], "ratio_cluster_tier_vs_single_server_tier", "cluster tier / one server (tier)")):
        for clients in sorted({r["clients"] for r in rows}):
            rs = [r for r in rows if r["clients"] == clients]
            xs = [r["keys_per_call"] for r in rs]
            med = [r[key]["median"] for r in rs]
            lo = [r[key]["median"] - r[key]["q1"] for r in rs]
            hi = [r[key]["q3"] - r[key]["median"] for r in rs]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=f"{clients} client(s)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("keys per read")
        ax.set_ylabel("keys/s ratio (median, IQR bars)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "cluster.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    w.note(f"plot: {os.path.basename(path)}")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--worker":
        sys.exit(_worker_main())
    from cxlalloc_apps.bench.cli import main

    sys.exit(main(["--only", "cluster"] + sys.argv[1:]))
