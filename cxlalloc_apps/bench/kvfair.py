"""``bench --only kvfair``: fair service of the kv-server under one client's maximal requests (CPU).

    python -m cxlalloc bench --only kvfair [--quick] --out DIR

Writes ``DIR/kvfair.json`` (:mod:`.meta` record) and ``DIR/kvfair.png``.  One kv-server process
(``--size 1GiB --chunk 64MiB``), a probe client in this process that looks up one stored key and releases it,
every 2 ms, and a worker process that is, by arm:

quiet
    idle (the probe alone);
control
    burning CPU without a request to the server (what the attacker's process costs the scheduler alone);
attacker
    a client looping 65,536-key lookups, releases, 65,536-key reserves and aborts (the largest requests the
    protocol allows, ``protocol.MAX_KEYS``).

Arms interleaved in an order rotated per round (:mod:`cxlalloc_apps.bench.method`), one warm-up round, >= 5
timed rounds; per round the probe's p50 and p99, and the ratios attacker/quiet and attacker/control of the same
round, summarised as median, IQR and min-max; the 1-minute load average at each arm.

disconnect
    then, 5 times: a client pins 65,536 blocks (one lookup) and holds 65,536 reservations, and closes its socket
    while the probe loops; the server's own record of that clean-up (``pool.last_drop``: the longest hold of
    its lock, wall clock, and the number of holds) and the probe's slowest lookup around it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

from cxlalloc_apps.bench.kvprocs import _env, _Server, raw_client
from cxlalloc_apps.bench.method import MIN_ROUNDS, Spread, goal_record, interleave, machine_load

MAX_KEYS = 65536
ARMS = ("quiet", "control", "attacker")
PROBE_GAP_S = 0.002


def _key(i: int, tag: bytes) -> bytes:
    import hashlib

    return hashlib.blake2b(tag + i.to_bytes(8, "little"), digest_size=32).digest()


# ----------------------------------------------------------------- the worker (its own process)
def _worker_main(path: str) -> int:
    """Commands on stdin, one JSON line each: ``{"op": "attack"|"spin", "s": seconds}``; answers ``started``
    when it begins, then ``{"rounds": n, "cpu_s": s}`` when done."""
    sock, call = raw_client(path, "attacker")
    keys = [_key(i, b"hog") for i in range(MAX_KEYS)]
    fresh = [_key(i, b"fresh") for i in range(MAX_KEYS)]
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        print("started", flush=True)
        c0 = time.process_time()
        end = time.monotonic() + float(msg["s"])
        n = 0
        while time.monotonic() < end:
            if msg["op"] == "attack":
                got = call("lookup", ns="h", keys=keys)
                assert len(got["blocks"]) == MAX_KEYS, "the attacker's blocks were evicted"
                call("release", leases=[got["lease"]])
                r = call("reserve", ns="h", keys=fresh, nbytes=1, tokens=1)
                call("abort", res=r["res"])
            else:  # the control: the same process, busy the same time, no request
                t = time.perf_counter() + 0.05
                while time.perf_counter() < t:
                    pass
            n += 1
        print(json.dumps({"rounds": n, "cpu_s": time.process_time() - c0}), flush=True)
    sock.close()
    return 0


# ----------------------------------------------------------------- the parent
class _Probe:
    def __init__(self, path: str):
        self.sock, self.call = raw_client(path, "probe")
        r = self.call("reserve", ns="p", keys=[_key(1, b"probe")], nbytes=4096, tokens=16)
        if r["res"]:  # 0: stored by an earlier probe already
            self.call("commit", res=r["res"])

    def lookup(self) -> float:
        t0 = time.perf_counter()
        r = self.call("lookup", ns="p", keys=[_key(1, b"probe")])
        dt = time.perf_counter() - t0
        if len(r["blocks"]) != 1:
            raise RuntimeError(f"the probe's block was not found: {r}")
        self.call("release", leases=[r["lease"]])
        return dt

    def loop(self, seconds: float) -> List[float]:
        out = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            out.append(self.lookup())
            time.sleep(PROBE_GAP_S)
        return out


def _q(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def part_fair(ctx, w, srv: _Server, seconds: float, rounds: int) -> None:
    probe = _Probe(srv.socket)
    worker = subprocess.Popen([sys.executable, "-m", "cxlalloc_apps.bench.kvfair", "--worker", srv.socket],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    # The attacker's 65,536 blocks, stored once (1-byte blocks: one page each).
    _, fill = raw_client(srv.socket, "filler")
    keys = [_key(i, b"hog") for i in range(MAX_KEYS)]
    r = fill("reserve", ns="h", keys=keys, nbytes=1, tokens=1)
    if fill("commit", res=r["res"])["published"] != MAX_KEYS:
        raise RuntimeError("could not store the attacker's 65,536 blocks")
    p50: Dict[str, List[float]] = {a: [] for a in ARMS}
    loads: Dict[str, List[float]] = {a: [] for a in ARMS}
    worker_rounds: Dict[str, List[int]] = {a: [] for a in ARMS}
    lookups: Dict[str, List[int]] = {a: [] for a in ARMS}

    def arm(name: str):
        def run() -> float:
            if name != "quiet":
                worker.stdin.write(json.dumps({"op": "attack" if name == "attacker" else "spin",
                                               "s": seconds + 0.2}) + "\n")
                worker.stdin.flush()
                if worker.stdout.readline().strip() != "started":
                    raise RuntimeError(f"the worker did not start (exit {worker.poll()})")
                time.sleep(0.1)
            lat = probe.loop(seconds)
            if name != "quiet":
                done = json.loads(worker.stdout.readline())
                worker_rounds[name].append(done["rounds"])
            p50[name].append(_q(lat, 0.5))
            lookups[name].append(len(lat))
            loads[name].append(machine_load()["loadavg_1m"])
            return _q(lat, 0.99)
        return run

    try:
        cmp = interleave({a: arm(a) for a in ARMS}, rounds, warmup=1)
    finally:
        worker.stdin.write(json.dumps({"op": "quit"}) + "\n")
        worker.stdin.flush()
        worker.wait(30)
    for per_arm in (p50, loads, worker_rounds, lookups):  # the warm-up round's samples, discarded like interleave's
        for a in ARMS:
            per_arm[a] = per_arm[a][len(per_arm[a]) - cmp.rounds:]
    ratio99 = {f"{a}/{b}": cmp.ratio(a, b) for a, b in (("attacker", "quiet"), ("attacker", "control"),
                                                         ("control", "quiet"))}
    ratio50 = {}
    for a, b in (("attacker", "quiet"), ("attacker", "control")):
        ratio50[f"{a}/{b}"] = Spread.of([x / y for x, y in zip(p50[a], p50[b])]).as_dict()
    pool = srv.status()["pool"]
    w.add({"part": "fair", "rounds": cmp.rounds, "seconds_per_arm": seconds,
           "p99_ms": {a: [round(v * 1e3, 3) for v in cmp.samples[a]] for a in ARMS},
           "p50_ms": {a: [round(v * 1e3, 3) for v in p50[a]] for a in ARMS},
           "p99_ms_spread": {a: Spread.of([v * 1e3 for v in cmp.samples[a]]).as_dict() for a in ARMS},
           "p50_ms_spread": {a: Spread.of([v * 1e3 for v in p50[a]]).as_dict() for a in ARMS},
           "p99_ratio": {k: v.as_dict() for k, v in ratio99.items()}, "p50_ratio": ratio50,
           "goals": [goal_record("attacker p99 / quiet p99 <= 5", ratio99["attacker/quiet"], 5.0),
                     goal_record("attacker p99 / control p99 <= 5", ratio99["attacker/control"], 5.0)],
           "loadavg_1m": loads, "probe_lookups": lookups, "attacker_rounds": worker_rounds["attacker"],
           "control_rounds": worker_rounds["control"], "orders": cmp.orders,
           "load_before": cmp.load_before, "load_after": cmp.load_after,
           "server_lock_hold_ms_max": pool.get("lock_hold_ms_max"),
           "server_lock_holds": pool.get("lock_holds"),
           "server_lock_handoffs": pool.get("lock_handoffs"),
           "method": "probe: lookup of 1 stored key, timed round trip, then release (untimed), every 2 ms for "
                     f"{seconds} s per arm; arms quiet / control (the worker process spinning) / attacker (the "
                     "worker looping 65,536-key lookup+release+reserve+abort), interleaved and rotated "
                     "(cxlalloc_apps/bench/method.py); ratios per round, then median/IQR; loadavg_1m after each "
                     "arm"})
    probe.sock.close()


def part_disconnect(ctx, w, srv: _Server, reps: int) -> None:
    probe = _Probe(srv.socket)
    keys = [_key(i, b"hog") for i in range(MAX_KEYS)]
    rows = []
    for rep in range(reps):
        sock, call = raw_client(srv.socket, f"leaver{rep}")
        got = call("lookup", ns="h", keys=keys)
        r = call("reserve", ns="h", keys=[_key(i, b"leave%d" % rep) for i in range(MAX_KEYS)], nbytes=1, tokens=1)
        held = len(got["blocks"]), sum(s is not None for s in r["slots"])
        window: List[float] = []
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                window.append(probe.lookup())
                time.sleep(PROBE_GAP_S)

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.05)
        seq = srv.status()["pool"]["last_drop"]["seq"]
        sock.close()
        deadline = time.monotonic() + 60
        while True:
            d = srv.status()["pool"]["last_drop"]
            if d["seq"] > seq or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        time.sleep(0.05)
        stop.set()
        th.join()
        rows.append({"pins": held[0], "reservations": held[1], **d, "probe_max_ms": round(max(window) * 1e3, 3),
                     "probe_p99_ms": round(_q(window, 0.99) * 1e3, 3), "probe_lookups": len(window),
                     "loadavg_1m": machine_load()["loadavg_1m"]})
    probe.sock.close()
    w.add({"part": "disconnect", "reps": rows,
           "hold_ms_max": Spread.of([r["hold_ms_max"] for r in rows]).as_dict(),
           "hold_ms_p99": Spread.of([r["hold_ms_p99"] for r in rows]).as_dict(),
           "hold_ms_p50": Spread.of([r["hold_ms_p50"] for r in rows]).as_dict(),
           "probe_max_ms": Spread.of([r["probe_max_ms"] for r in rows]).as_dict(),
           "method": "a client pins 65,536 blocks (one lookup) and reserves 65,536 more, then closes its socket "
                     "while the probe loops; the server's record of that clean-up (pool.last_drop: the longest "
                     "hold of its lock, the median and p99 hold (wall clock), the number of holds, the whole clean-up's "
                     "wall time) and the probe's slowest lookup around it"})


def run(ctx) -> Dict[str, Any]:
    """``bench --only kvfair``: the record ``kvfair.json`` and its plot."""
    from cxlalloc_apps.bench.meta import RecordWriter, new_record

    seconds = 1.0 if ctx.quick else 3.0
    rounds = MIN_ROUNDS if ctx.quick else 7
    params = {"parts": ["fair", "disconnect"], "quick": ctx.quick, "seconds_per_arm": seconds, "rounds": rounds,
              "server_args": ["--size", "1GiB", "--chunk", "64MiB"], "units": "ms, ratios",
              "where": "CPU (the kv-server never touches a GPU); a shared 2-core machine: latencies include its noise"}
    w = RecordWriter(ctx.out_dir, new_record("kvfair", params, True, ctx.argv, ctx.device))
    work = tempfile.mkdtemp(prefix="kvfair-", dir="/tmp")
    srv = _Server(work, ["--size", "1GiB", "--chunk", "64MiB"]).start()
    try:
        for name, fn in (("fair", lambda: part_fair(ctx, w, srv, seconds, rounds)),
                         ("disconnect", lambda: part_disconnect(ctx, w, srv, 5))):
            if ctx.deadline.expired():
                w.skip(name, "time budget used up")
                continue
            try:
                fn()
            except Exception as e:
                import traceback

                w.error(name, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    return w.finish_and_plot(plot, ctx.log)


def plot(rec: Dict[str, Any], path: str) -> None:
    """The probe's p99 per round and arm, and the per-round ratios against the 5x goal (matplotlib)."""
    from cxlalloc_apps.bench.plots import _plt, _save

    rows = {r["part"]: r for r in rec["results"]}
    fair = rows.get("fair")
    if fair is None:
        return
    plt = _plt()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    for arm, mark in zip(ARMS, "os^"):
        a.plot(range(1, len(fair["p99_ms"][arm]) + 1), fair["p99_ms"][arm], mark + "-", label=f"{arm} p99")
        a.plot(range(1, len(fair["p50_ms"][arm]) + 1), fair["p50_ms"][arm], mark + ":", label=f"{arm} p50",
               alpha=0.6)
    a.set_yscale("log")
    a.set_xlabel("round")
    a.set_ylabel("probe lookup, ms")
    a.set_title("another client's lookup latency")
    a.legend(fontsize=7)
    names = ["attacker/quiet", "attacker/control"]
    b.boxplot([[x / y for x, y in zip(fair["p99_ms"][n.split("/")[0]], fair["p99_ms"][n.split("/")[1]])]
               for n in names], tick_labels=[f"p99 {n}" for n in names])
    b.axhline(5.0, color="grey", ls=":", lw=0.8)
    b.set_title("per-round ratio (goal <= 5x)")
    disc = rows.get("disconnect")
    if disc is not None:
        reps = disc["reps"]
        xs = range(1, len(reps) + 1)
        c.plot(xs, [r["hold_ms_max"] for r in reps], "D-", label="longest lock hold")
        c.plot(xs, [r["hold_ms_p99"] for r in reps], "o-", label="lock hold p99")
        c.plot(xs, [r["probe_max_ms"] for r in reps], "s--", label="probe's slowest lookup")
        c.axhline(5.0, color="grey", ls=":", lw=0.8)
        c.set_xlabel("disconnect of a 65,536-pin client")
        c.set_ylabel("ms")
        c.legend(fontsize=7)
        c.set_title("disconnect (goal < 5 ms of lock)")
    cpu = rec["hardware"].get("cpu") or {}
    fig.suptitle(f"kv-server fair service, {cpu.get('model', 'CPU')}, {rec['date_utc']} (2-core machine shared "
                 "with other jobs; CPU only)", fontsize=9)
    _save(fig, path)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2]))
    sys.exit("usage: python -m cxlalloc_apps.bench.kvfair --worker SOCKET (the benchmark runs as "
             "`python -m cxlalloc bench --only kvfair`)")
