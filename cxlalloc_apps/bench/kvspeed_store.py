"""The kvspeed benchmark's store arms (:mod:`.kvspeed`): kv-server lookups against redis-py ``MGET``
(``lookup``, client processes started as ``python -m cxlalloc_apps.bench.kvspeed_store --worker lookup``) and
inserts against memcpy of the same bytes (``insert``).  Each part's method is in its docstring and its
record's ``method`` field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from cxlalloc_apps.bench.kvprocs import REPO, _env, _last_json, _Redis, _Server, block_key, pattern, worker_main
from cxlalloc_apps.bench.method import MIN_ROUNDS, Comparison, goal_record, machine_load, round_orders

KiB, MiB = 1 << 10, 1 << 20
LOOKUP_BLOCK = 64 * KiB
LOOKUP_KEYS = (1, 16, 512)
LOOKUP_CLIENTS = (1, 4, 16)
LOOKUP_ROUNDS = 7    # rounds per key count (the method: >= 5)
INSERT_SIZES = ((64 * KiB, 64), (1 * MiB, 16))   # (block bytes, blocks per reservation)

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
    return subprocess.Popen([sys.executable, "-m", "cxlalloc_apps.bench.kvspeed_store", "--worker", role, json.dumps(params)],
                            stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO), f, log




def part_lookup(ctx, w, work: str) -> None:
    import redis

    srv = _Server(work, ["--size", "256MiB", "--chunk", "16MiB"]).start()
    rs = _Redis(work)
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
                with open(log, "rb") as lf:
                    outs.append(_last_json(lf.read().decode(errors="replace")))
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
    from cxlalloc import _C
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
                """The path before reserve_ahead/write (2026-12-03b): each reserve waited, copy_ per block."""
                def arm():
                    for _ in range(INSERT_BATCHES):
                        fill(store, batch)
                    if not store.flush():  # the sample ends when every commit is acknowledged
                        raise RuntimeError("the kv-server did not acknowledge the commits")
                return arm

            def insert_ahead(store=st, batch=per):
                """The goal's path: the next reservation asked for before this one's blocks are written
                (reserve_ahead), the batch written in one streaming copy (write), the commit pipelined."""
                def arm():
                    n = INSERT_BATCHES * (per // batch)
                    pending = store.reserve_ahead("", new_keys(batch), B, 16)
                    for k in range(n):
                        res = pending.result()
                        pending = store.reserve_ahead("", new_keys(batch), B, 16) if k + 1 < n else None
                        i = (k * batch) % per
                        if res.write(src[i:i + batch]) != batch:
                            raise RuntimeError("no slot for a new block")
                        if res.commit() != batch:
                            raise RuntimeError("a block was not published")
                    if not store.flush():
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

            def memcpy_cold_stream():
                """The physical bound of writing to the pool: the same streaming copy as write(), into a
                touched pool-sized buffer, a new place each time."""
                for _ in range(INSERT_BATCHES):
                    dsts = []
                    for _s in src:
                        if at[0] + B > pool:
                            at[0] = 0
                        dsts.append(cold.data_ptr() + at[0])
                        at[0] += B
                    _C.stream_copy_many(dsts, [s_.data_ptr() for s_ in src], [B] * len(dsts), True)

            arms = {"memcpy": memcpy, "insert": insert_ahead(), "insert_reserve_waited": insert(),
                    "insert_commit_waited": insert(st_wait), "insert_one_per_reservation": insert_ahead(st, 1),
                    "memcpy_cold": memcpy_cold, "memcpy_cold_stream": memcpy_cold_stream}
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
                   "ratio_insert_reserve_waited_over_memcpy": cmp.ratio("memcpy", "insert_reserve_waited").as_dict(),
                   "ratio_insert_commit_waited_over_memcpy": cmp.ratio("memcpy", "insert_commit_waited").as_dict(),
                   "ratio_one_per_reservation_over_memcpy": cmp.ratio("memcpy", "insert_one_per_reservation").as_dict(),
                   "ratio_insert_over_memcpy_cold": cmp.ratio("memcpy_cold", "insert").as_dict(),
                   "ratio_insert_over_memcpy_cold_stream": cmp.ratio("memcpy_cold_stream", "insert").as_dict(),
                   "ratio_ahead_over_reserve_waited": cmp.ratio("insert_reserve_waited", "insert").as_dict(),
                   "ratio_pipelined_over_waited": cmp.ratio("insert_commit_waited", "insert_reserve_waited").as_dict(),
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
                   "method": f"{per} new blocks of {B} bytes per reservation; insert (the goal): the next "
                             "reservation asked for before this one's blocks are written (reserve_ahead: its reply "
                             "read when needed, so the server reserves while the client copies), the batch written "
                             "by RemoteReservation.write (one C++ call, streaming stores), commit pipelined "
                             "(protocol 3); insert_reserve_waited: the path before (each reserve waited, a torch "
                             "copy_ per block, commit pipelined); insert_commit_waited: that path with commit=wait; "
                             "insert_one_per_reservation: the goal's path with one block per reservation; "
                             f"each sample {INSERT_BATCHES} reservations' worth of blocks and a flush (every commit "
                             "acknowledged); vs memcpy: a torch copy_ of each of the same blocks into one "
                             "preallocated touched buffer (the goal's baseline; memcpy_cold: into a touched "
                             "pool-sized buffer, a new place each time, as the pool is written; memcpy_cold_stream: "
                             "the same with write()'s streaming copy: the bound of writing to the pool); the pool "
                             "was filled once before (committed pages, eviction on); ratios "
                             "are memcpy time / insert time per round (higher is better); cpu_*: the same arms interleaved "
                             "again, each "
                             "sample the CPU time of this process plus the kv-server's (/proc schedstat), which "
                             "leaves out time spent descheduled on a shared machine"})
        st.close()
        st_wait.close()
    finally:
        torch.set_num_threads(threads)
        srv.stop()


WORKERS = {"lookup": worker_lookup}


if __name__ == "__main__":
    worker_main(WORKERS, sys.argv)
    sys.exit(f"usage: python -m cxlalloc_apps.bench.kvspeed_store --worker ROLE PARAMS_JSON (roles: {', '.join(WORKERS)})")
