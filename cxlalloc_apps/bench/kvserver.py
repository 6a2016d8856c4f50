"""The shared KV server's figures (CPU; GPU sides on the simulated driver).

    python -m cxlalloc bench --only kvserver [--quick] --out DIR

Writes ``DIR/kvserver.json`` (:mod:`.meta` record) with these parts, every
process a real one (``python -m cxlalloc kv-server``, client processes):

ttft
    Time to first token (``generate(max_new_tokens=1)``, wall clock) of
    process B on a prompt whose document process A prefilled, against B
    recomputing it (``kv_reuse=False``), median of repeats; the tokens of a
    longer generation with and without the hit are compared.  Model: a Llama
    built from a config with seeded random weights (both processes build the
    same weights, so the same fingerprint), float32, on the CPU, its KV in a
    simulated-GPU CxlCache.
concurrency
    N client processes (RemoteBlockStore on simulated allocators) on one
    server, each looping: look up a document's chain of blocks (Zipf-popular
    documents, shared by all clients), copy the hits out of the pool, reserve
    and write the missing blocks, commit.  Aggregate lookups/s, inserted
    blocks/s, hit rate, bytes/s, lookup latency percentiles.
redis
    The Redis tier on a local ``redis-server`` (127.0.0.1): seconds to load
    one block (``get_many`` of one key, and per block of an 8-key batch) by
    block size; and a pool miss served from Redis through the server.
crash
    kill -9 of a writer client mid-insert (random moment) while others
    write: every block a client logged as committed is found intact, no torn
    block is visible, the killed client's reservations were aborted.  Then
    kill -9 of the server under load: a generate() client checks every
    answer against a model without reuse (mismatches must be 0), the load
    clients keep running without an exception, everyone reconnects to the
    restarted server.

Everything here is CPU time on this machine (copies are host memcpy; the
"GPU" is cxlalloc's simulated driver): the figures describe the server, the
protocol and the crash rules, not a GPU's link.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import textwrap
import time
from typing import Any, Dict

from cxlalloc_apps.bench.kvprocs import (MiB, _chosen, _last_json, _Logged, _median, _pct, _Redis,
                                      _Server, block_key, pattern, run_parts, worker_main)


# ----------------------------------------------------------------- the workers' processes
def _logged_worker(role: str, params: dict, path: str) -> _Logged:
    return _Logged([sys.executable, "-m", "cxlalloc_apps.bench.kvserver", "--worker", role, json.dumps(params)], path)


# ----------------------------------------------------------------- workers (run in their own process)
DOCS = 1024  # documents of the concurrency workload (8 blocks each)
MODEL = {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "vocab": 32000}


def _model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    h = MODEL["hidden"]
    cfg = LlamaConfig(hidden_size=h, intermediate_size=int(2.7 * h), num_hidden_layers=MODEL["layers"],
                      num_attention_heads=MODEL["heads"], num_key_value_heads=MODEL["kv_heads"],
                      vocab_size=MODEL["vocab"], max_position_embeddings=8192, head_dim=h // MODEL["heads"])
    m = LlamaForCausalLM(cfg).eval()
    m.config._attn_implementation = "sdpa"
    return m


def _prompt(doc_tokens: int, q: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    doc = torch.randint(3, MODEL["vocab"], (1, doc_tokens), generator=g)
    g2 = torch.Generator().manual_seed(99 + q)
    return torch.cat([doc, torch.randint(3, MODEL["vocab"], (1, 16), generator=g2)], 1)


def worker_ttft(p: dict) -> dict:
    import torch

    import cxlalloc.hf as hf

    torch.set_num_threads(p.get("threads", 1))
    m = _model()
    hf.wrap(m, device_limit="2GiB", host_limit="2GiB", kv_store=p["url"], block_tokens=p["block_tokens"])

    def ttft(prompt, **kw):
        t = time.perf_counter()
        m.generate(prompt, max_new_tokens=1, do_sample=False, **kw)
        return time.perf_counter() - t, hf.stats(m)["hf"]["reuse"]["last"]

    warm = torch.randint(3, 1000, (1, 8))
    m.generate(warm, max_new_tokens=1, do_sample=False, kv_reuse=False)  # first-call costs out of the way
    out: Dict[str, Any] = {"role": p["role"]}
    if p["role"] == "A":
        t, rec = ttft(_prompt(p["doc_tokens"], 0))
        out.update(first_request_s=t, stored_blocks=rec["stored_blocks"], store_ms=rec["store_ms"],
                   bytes_stored=rec["bytes_stored"])
    else:
        prompt = _prompt(p["doc_tokens"], 1)
        hit, rec_hit, miss = [], None, []
        for _ in range(p["repeats"]):
            t, rec_hit = ttft(prompt)
            hit.append(t)
            t, _ = ttft(prompt, kv_reuse=False)
            miss.append(t)
        with_hit = m.generate(prompt, max_new_tokens=p["check_tokens"], do_sample=False)
        rec = hf.stats(m)["hf"]["reuse"]["last"]
        without = m.generate(prompt, max_new_tokens=p["check_tokens"], do_sample=False, kv_reuse=False)
        st = hf.stats(m)["hf"]["reuse"]["store"]
        out.update(ttft_hit_s=hit, ttft_recompute_s=miss, hit_tokens=rec_hit["hit_tokens"],
                   prompt_tokens=int(prompt.shape[1]), load_ms=rec_hit["load_ms"], bytes_loaded=rec_hit["bytes_loaded"],
                   tokens_equal=bool(torch.equal(with_hit, without)), check_hit_tokens=rec["hit_tokens"],
                   registered_bytes=st["registered_bytes"], simulated=st["simulated"])
    return out


def worker_load(p: dict) -> dict:
    """One concurrent client: lookup / copy out / reserve / write / commit, until the deadline."""
    import numpy as np
    import torch

    import cxlalloc
    from cxlalloc.kvstore.client import RemoteBlockStore

    torch.set_num_threads(1)
    rng = random.Random(p["seed"])
    a = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=64 * MiB, device_headroom=0)
    st = RemoteBlockStore(p["url"] + "?timeout=2", a, name=f"load{p['seed']}")
    B, nb, docs = p["block_bytes"], p["blocks_per_doc"], p["docs"]
    weights = [1.0 / (d + 1) ** p["zipf"] for d in range(docs)]
    buf = torch.empty(B * nb, dtype=torch.uint8)
    fill = {}
    print("READY", flush=True)
    while not os.path.exists(p["go"]):
        time.sleep(0.005)
    deadline = time.monotonic() + p["duration"]
    c = {"lookups": 0, "lookup_blocks": 0, "hit_blocks": 0, "inserted_blocks": 0, "bytes_loaded": 0,
         "bytes_stored": 0, "errors": 0, "bad_bytes": 0}
    lat = []
    while time.monotonic() < deadline:
        d = rng.choices(range(docs), weights)[0]
        keys = [block_key(d, j) for j in range(nb)]
        try:
            t = time.perf_counter()
            lease = st.lookup("", keys)
            n = lease.blocks
            for j, v in enumerate(lease.views):
                buf[j * B:(j + 1) * B].copy_(v)
            lease.close()
            lat.append(time.perf_counter() - t)
            if n and int(buf[0]) != keys[0][0]:
                c["bad_bytes"] += 1
            c["lookups"] += 1
            c["lookup_blocks"] += nb
            c["hit_blocks"] += n
            c["bytes_loaded"] += n * B
            if n < nb:
                res = st.reserve("", keys[n:], B, 64)
                for k, v in zip(keys[n:], res.views):
                    if v is not None:
                        f = fill.get(k)
                        if f is None:
                            f = fill[k] = torch.from_numpy(np.full(B, k[0], dtype=np.uint8))
                        v.copy_(f)
                got = res.commit()
                c["inserted_blocks"] += got
                c["bytes_stored"] += got * B
        except Exception as e:  # the benchmark counts; it never stops a client
            c["errors"] += 1
            c["last_error"] = f"{type(e).__name__}: {e}"
    s = st.stats()
    c.update(latency_s=lat, server_errors=s["server_errors"], reconnects=s["reconnects"],
             server_restarts=s["server_restarts"], registered_bytes=s["registered_bytes"])
    st.close()
    return c


WRITER = textwrap.dedent("""
    # A raw-protocol client that inserts key-patterned blocks and logs each committed key.
    import mmap, socket, sys, os, json
    from cxlalloc.kvstore import protocol as P
    from cxlalloc_apps.bench.kvserver import block_key, pattern
    p = json.loads(sys.argv[1])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5); s.connect(p["socket"])
    P.send_msg(s, {"op": "hello", "v": P.PROTOCOL_VERSION, "pid": os.getpid(), "want_fd": True, "name": "writer"})
    hello, fds = P.recv_msg(s, max_fds=1)
    m = mmap.mmap(fds[0], hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    B = p["block_bytes"]
    def call(**kw):
        P.send_msg(s, kw); r, _ = P.recv_msg(s); return r
    print("READY", flush=True)
    for i in range(p["count"]):
        ks = [block_key(p["id"], i * 4 + j, b"w") for j in range(4)]
        r = call(op="reserve", ns="crash", keys=ks, nbytes=B, tokens=64)
        done = []
        for k, off in zip(ks, r["slots"]):
            if off is None:
                continue
            data = pattern(k, B)
            for q in range(0, B, 8192):   # in pieces: a kill lands mid-block
                m[off + q:off + q + 8192] = data[q:q + 8192]
            done.append(k)
        if r["res"]:
            n = call(op="commit", res=r["res"])["published"]
            print(("C " if n == len(done) else "P%d " % n) + " ".join(k.hex() for k in done), flush=True)
    print("END", flush=True)
""")


def worker_generate(p: dict) -> dict:
    """generate() in a loop against a reference without reuse, through server kills."""
    import torch

    import cxlalloc.hf as hf

    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(seed=0):
        torch.manual_seed(seed)
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096, head_dim=16)
        mm = LlamaForCausalLM(cfg).eval()
        mm.config._attn_implementation = "sdpa"
        return mm

    import warnings

    warnings.simplefilter("ignore")
    m, ref = tiny(), tiny()
    hf.wrap(m, device_limit="256MiB", host_limit="256MiB", kv_store=p["url"] + "?timeout=1", block_tokens=8)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 1000, (1, 64), generator=g) for _ in range(4)]
    want = {}
    print("READY", flush=True)
    while not os.path.exists(p["go"]):
        time.sleep(0.005)
    deadline = time.monotonic() + p["duration"]
    calls = mismatches = errors = hits = 0
    timeline = []
    i = 0
    while time.monotonic() < deadline:
        d = i % len(docs)
        q = torch.tensor([[5 + (i % 7)]])
        prompt = torch.cat([docs[d], q], 1)
        key = (d, i % 7)
        try:
            t = time.perf_counter()
            out = m.generate(prompt, max_new_tokens=4, do_sample=False)
            dt = time.perf_counter() - t
            if key not in want:
                want[key] = ref.generate(prompt, max_new_tokens=4, do_sample=False)
            ok = bool(torch.equal(out, want[key]))
            h = hf.stats(m)["hf"]["reuse"]["last"]["hit_tokens"]
            calls += 1
            mismatches += not ok
            hits += bool(h)
            timeline.append([round(time.monotonic() - deadline + p["duration"], 3), h, ok, round(dt, 4)])
        except Exception as e:
            errors += 1
            timeline.append([round(time.monotonic() - deadline + p["duration"], 3), None, str(e)[:200], 0])
        i += 1
    st = hf.stats(m)["hf"]["reuse"]["store"]
    return {"calls": calls, "mismatches": mismatches, "errors": errors, "calls_with_hit": hits, "timeline": timeline,
            "server_errors": st["server_errors"], "reconnects": st["reconnects"],
            "server_restarts": st["server_restarts"]}


WORKERS = {"ttft": worker_ttft, "load": worker_load, "generate": worker_generate}

# ----------------------------------------------------------------- parts (the parent)
def part_ttft(ctx, w, work: str) -> None:
    doc = 512 if ctx.quick else 1024
    bt = 64
    srv = _Server(work, ["--size", "1GiB", "--chunk", "64MiB"], "ttft.sock").start()
    try:
        base = {"url": srv.url, "block_tokens": bt, "doc_tokens": doc, "repeats": 3 if ctx.quick else 5,
                "check_tokens": 16, "threads": 1}
        ra = _last_json(_logged_worker("ttft", dict(base, role="A"), os.path.join(work, "ttft-a.out")).finish(600))
        rb = _last_json(_logged_worker("ttft", dict(base, role="B"), os.path.join(work, "ttft-b.out")).finish(900))
        st = srv.status()["pool"]
    finally:
        srv.stop()
    hit, miss = _median(rb["ttft_hit_s"]), _median(rb["ttft_recompute_s"])
    kv_per_token = MODEL["layers"] * 2 * MODEL["kv_heads"] * (MODEL["hidden"] // MODEL["heads"]) * 4
    w.add({"part": "ttft", "model": dict(MODEL, dtype="float32", params_note="random weights, seeded"),
           "prompt_tokens": rb["prompt_tokens"], "document_tokens": doc, "block_tokens": bt,
           "kv_bytes_per_token": kv_per_token, "hit_tokens": rb["hit_tokens"],
           "ttft_hit_s_median": hit, "ttft_recompute_s_median": miss,
           "ttft_speedup": (miss / hit) if hit else None, "ttft_hit_s": rb["ttft_hit_s"],
           "ttft_recompute_s": rb["ttft_recompute_s"], "load_ms": rb["load_ms"], "bytes_loaded": rb["bytes_loaded"],
           "tokens_equal_with_and_without_hit": rb["tokens_equal"], "check_tokens": 16,
           "process_a_first_request_s": ra["first_request_s"], "process_a_stored_blocks": ra["stored_blocks"],
           "process_a_store_ms": ra["store_ms"], "server_hit_blocks": st["hit_blocks"],
           "client_registered_bytes": rb["registered_bytes"], "simulated_gpu": rb["simulated"],
           "method": "two processes on one kv-server; B's generate(max_new_tokens=1) wall time with the document "
                     "prefilled by A (hit) vs kv_reuse=False (recompute), median of alternating repeats, after a "
                     "warm-up call; CPU float32, one thread each; tokens of a 16-token greedy generation compared"})


def part_concurrency(ctx, w, work: str) -> None:
    clients = [1, 2, 4] if ctx.quick else [1, 2, 4, 8]
    duration = 3.0 if ctx.quick else 5.0
    B = 256 << 10
    for n in clients:
        if ctx.deadline.expired():
            w.skip(f"concurrency:{n}", "time budget used up")
            continue
        srv = _Server(work, ["--size", "512MiB", "--chunk", "16MiB"], f"c{n}.sock").start()
        go = os.path.join(work, f"go{n}")
        procs = []
        try:
            for i in range(n):
                procs.append(_logged_worker("load", {"url": srv.url, "seed": 100 + i, "block_bytes": B,
                                                     "blocks_per_doc": 8, "docs": DOCS, "zipf": 1.1,
                                                     "duration": duration, "go": go},
                                            os.path.join(work, f"load{n}-{i}.out")))
            for p in procs:
                p.wait_for("READY")
            t0 = time.monotonic()
            open(go, "w").close()
            outs = [_last_json(p.finish(duration + 120)) for p in procs]
            wall = time.monotonic() - t0
            st = srv.status()
        finally:
            for p in procs:
                p.kill()
            srv.stop()
        tot = {k: sum(o[k] for o in outs) for k in ("lookups", "lookup_blocks", "hit_blocks", "inserted_blocks",
                                                       "bytes_loaded", "bytes_stored", "errors", "bad_bytes")}
        lat = [x for o in outs for x in o["latency_s"]]
        w.add({"part": "concurrency", "clients": n, "duration_s": duration, "block_bytes": B, "blocks_per_doc": 8,
               "documents": DOCS, "pool_blocks": (512 << 20) // B, **tot,
               "lookups_per_s": tot["lookups"] / duration, "inserted_blocks_per_s": tot["inserted_blocks"] / duration,
               "hit_rate": tot["hit_blocks"] / tot["lookup_blocks"] if tot["lookup_blocks"] else None,
               "load_GBps": tot["bytes_loaded"] / duration / 1e9, "store_GBps": tot["bytes_stored"] / duration / 1e9,
               "lookup_ms_p50": 1e3 * _median(lat) if lat else None, "lookup_ms_p99": 1e3 * _pct(lat, 0.99) if lat
               else None, "server_blocks": st["pool"]["blocks"], "server_hit_rate": st["pool"]["hit_rate"],
               "server_requests": st["server"]["requests"], "wall_s": wall,
               "method": "N client processes (RemoteBlockStore, simulated allocators) start together and loop for "
                         "duration_s: look up an 8-block chain of a Zipf(1.1)-chosen document of 1024 (4x the "
                         "pool's 2048 blocks: hits, misses and evictions all happen), copy the hit "
                         "blocks out of the mapped pool (host memcpy), reserve+write+commit the missing ones; "
                         "lookup latency includes the copy and the release; 2-core machine: clients share the "
                         "server's cores"})


def part_redis(ctx, w, work: str) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        w.skip("redis", "redis-server is not installed (Debian: apt-get install -y redis-server)")
        return
    try:
        import redis  # noqa: F401
    except ImportError:
        w.skip("redis", "redis-py is not installed (pip install redis)")
        return
    from cxlalloc.kvstore.tiers.redis import RedisTier

    rp = _Redis(work)
    url = rp.url + "/0"
    try:
        tier = RedisTier(url)
        for size in (64 << 10, 1 << 20, 8 << 20):
            keys = [block_key(size, j, b"r") for j in range(16)]
            for k in keys:
                tier.put(k, "", pattern(k, size))
            tier.flush(30)
            one = []
            for k in keys:
                t = time.perf_counter()
                got = tier.get_many([k])
                one.append(time.perf_counter() - t)
                assert got[0] == pattern(k, size)
            batch = []
            for i in range(0, 16, 8):
                t = time.perf_counter()
                got = tier.get_many(keys[i:i + 8])
                batch.append((time.perf_counter() - t) / 8)
                assert all(g is not None for g in got)
            w.add({"part": "redis", "block_bytes": size, "blocks": 16, "load_s_per_block_single_median": _median(one),
                   "load_s_per_block_single_p90": _pct(one, 0.9), "load_s_per_block_in_batch_of_8": _median(batch),
                   "load_GBps_single": size / _median(one) / 1e9, "load_GBps_batch": size / _median(batch) / 1e9,
                   "method": "RedisTier.get_many on a local redis-server 7 (127.0.0.1 TCP, --save ''): one key per "
                             "call, and 8 keys per call (MGET batches of 8), incl. the header/CRC-32 check; values "
                             "written first with pipelined SET"})
        tier.close()
        # A pool miss served from Redis through a server (write-through from one server, read by a fresh one).
        srv1 = _Server(work, ["--size", "256MiB", "--chunk", "16MiB", "--redis", url, "--redis-mode", "through"],
                       "r1.sock").start()
        from cxlalloc.kvstore.protocol import PROTOCOL_VERSION, recv_msg, send_msg

        def raw(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(path)
            send_msg(s, {"op": "hello", "v": PROTOCOL_VERSION, "pid": os.getpid(), "want_fd": True})
            hello, fds = recv_msg(s, max_fds=1)
            return s, fds[0], hello

        def call(s, **kw):
            send_msg(s, kw)
            return recv_msg(s)[0]

        import mmap

        B = 1 << 20
        keys = [block_key(7, j, b"srv") for j in range(8)]
        s, fd, hello = raw(srv1.socket)
        m = mmap.mmap(fd, hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        r = call(s, op="reserve", ns="", keys=keys, nbytes=B, tokens=64)
        for k, off in zip(keys, r["slots"]):
            m[off:off + B] = pattern(k, B)
        call(s, op="commit", res=r["res"])
        t = time.perf_counter()
        while srv1.status()["redis"]["put_blocks"] < 8 and time.perf_counter() - t < 10:
            time.sleep(0.01)
        t = time.perf_counter()
        hit = call(s, op="lookup", ns="", keys=keys)
        pool_hit_s = time.perf_counter() - t
        call(s, op="release", leases=[hit["lease"]])
        m.close()
        s.close()
        os.close(fd)
        srv1.stop()
        srv2 = _Server(work, ["--size", "256MiB", "--chunk", "16MiB", "--redis", url], "r2.sock").start()
        s, fd, hello = raw(srv2.socket)
        m = mmap.mmap(fd, hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ)
        t = time.perf_counter()
        got = call(s, op="lookup", ns="", keys=keys)
        miss_s = time.perf_counter() - t
        intact = all(m[off:off + n] == pattern(k, n) for k, (off, n, _) in zip(keys, got["blocks"]))
        m.close()
        s.close()
        os.close(fd)
        srv2.stop()
        w.add({"part": "redis_through_server", "block_bytes": B, "blocks": 8, "found": len(got["blocks"]),
               "intact": intact, "lookup_s_pool_hit": pool_hit_s, "lookup_s_pool_miss_from_redis": miss_s,
               "load_s_per_block_from_redis_via_server": miss_s / 8,
               "method": "one lookup of an 8-block chain: on the server that holds it (pool hit, no copy: offsets "
                         "only) vs on a fresh server whose pool misses and loads the chain from Redis into the pool "
                         "(MGET + checks + copy into the pool), then returns offsets"})
    finally:
        rp.stop()


def part_crash(ctx, w, work: str) -> None:
    B = 64 << 10
    srv = _Server(work, ["--size", "1GiB", "--chunk", "16MiB"], "crash.sock").start()
    writers = []
    try:
        for i in range(4):
            writers.append(_Logged([sys.executable, "-c", WRITER, json.dumps({"socket": srv.socket, "id": i,
                                                                               "block_bytes": B, "count": 800})],
                                   os.path.join(work, f"writer{i}.out")))
        for p in writers:
            p.wait_for("READY")
        rng = random.Random(11)
        time.sleep(rng.uniform(0.3, 0.8))
        victim = writers[0]
        victim.kill()  # SIGKILL
        outs = [p.finish(300) for p in writers]
        committed = []
        for o in outs:
            for line in o.splitlines():
                if line.startswith("C "):
                    committed += [bytes.fromhex(h) for h in line[2:].split()]
        st = srv.status()["pool"]
        # Every committed block is there and intact; nothing else of the crash namespace is visible.
        from cxlalloc.kvstore.protocol import PROTOCOL_VERSION, recv_msg, send_msg
        import mmap

        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(srv.socket)
        send_msg(s, {"op": "hello", "v": PROTOCOL_VERSION, "pid": os.getpid(), "want_fd": True})
        hello, fds = recv_msg(s, max_fds=1)
        m = mmap.mmap(fds[0], hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ)
        missing = torn = 0
        for k in committed:
            send_msg(s, {"op": "lookup", "ns": "crash", "keys": [k]})
            r = recv_msg(s)[0]
            if not r["blocks"]:
                missing += 1
                continue
            off, n, _ = r["blocks"][0]
            torn += m[off:off + n] != pattern(k, n)
            send_msg(s, {"op": "release", "leases": [r["lease"]]})
            recv_msg(s)
        m.close()
        s.close()
        os.close(fds[0])
        w.add({"part": "kill_client_mid_insert", "writers": 4, "killed": 1, "block_bytes": B,
               "committed_blocks_logged": len(committed), "committed_blocks_missing": missing,
               "committed_blocks_torn": torn, "server_blocks": st["blocks"], "server_writing_blocks_after":
               st["writing_blocks"], "server_aborted_blocks": st["aborted_blocks"],
               "victim_committed": sum(1 for line in outs[0].splitlines() if line.startswith("C ")),
               "per_writer": [{"commit_lines": sum(1 for x in o.splitlines() if x.startswith("C ")),
                               "partial_commits": sum(1 for x in o.splitlines() if x.startswith("P")),
                               "ended": "END" in o, "bytes_out": len(o)} for o in outs],
               "method": "4 raw-protocol writer processes insert key-patterned 64 KiB blocks written in 8 KiB "
                         "pieces; one gets SIGKILL at a random moment (0.3-0.8 s); afterwards every block any "
                         "writer logged as committed is looked up and compared byte for byte; the pool (1 GiB) "
                         "never evicts here"})
    finally:
        for p in writers:
            p.kill()
        srv.stop()

    # kill -9 of the server under load
    duration = 8.0 if ctx.quick else 12.0
    srv = _Server(work, ["--size", "512MiB", "--chunk", "16MiB"], "crash2.sock").start()
    go = os.path.join(work, "go-crash")
    procs = []
    try:
        procs.append(_logged_worker("generate", {"url": srv.url, "duration": duration, "go": go},
                                    os.path.join(work, "gen.out")))
        for i in range(2):
            procs.append(_logged_worker("load", {"url": srv.url, "seed": 500 + i, "block_bytes": 256 << 10,
                                                 "blocks_per_doc": 8, "docs": 64, "zipf": 1.1, "duration": duration,
                                                 "go": go}, os.path.join(work, f"crashload{i}.out")))
        for p in procs:
            p.wait_for("READY")
        open(go, "w").close()
        t0 = time.monotonic()
        time.sleep(duration * 0.3)
        srv.kill()
        killed_at = time.monotonic() - t0
        time.sleep(duration * 0.15)
        srv.start()
        restarted_at = time.monotonic() - t0
        outs = [_last_json(p.finish(duration + 300)) for p in procs]
        st = srv.status()
    finally:
        for p in procs:
            p.kill()
        srv.stop()
    g = outs[0]
    after = [t for t in g["timeline"] if t[0] > restarted_at]
    w.add({"part": "kill_server_under_load", "duration_s": duration, "killed_at_s": killed_at,
           "restarted_at_s": restarted_at, "generate_calls": g["calls"], "generate_mismatches": g["mismatches"],
           "generate_errors": g["errors"], "generate_calls_with_hit": g["calls_with_hit"],
           "generate_calls_with_hit_after_restart": sum(1 for t in after if t[1]),
           "generate_server_errors": g["server_errors"], "generate_reconnects": g["reconnects"],
           "generate_server_restarts_seen": g["server_restarts"],
           "load_client_errors": sum(o["errors"] for o in outs[1:]),
           "load_client_bad_bytes": sum(o["bad_bytes"] for o in outs[1:]),
           "load_client_reconnects": [o["reconnects"] for o in outs[1:]],
           "server_after_restart_blocks": st["pool"]["blocks"], "timeline": g["timeline"],
           "method": "a generate() client (tiny Llama, kv_store=unix://, timeout 1 s) compares every answer with "
                     "a model without reuse while 2 load clients run; the server gets SIGKILL at 30% of the run and "
                     "a new one starts on the same socket 15% later; timeline rows: [s, hit_tokens, equal, call s]"})


PARTS = {"ttft": part_ttft, "concurrency": part_concurrency, "redis": part_redis, "crash": part_crash}


def run(ctx) -> Dict[str, Any]:
    from cxlalloc_apps.bench.meta import RecordWriter, new_record

    chosen = _chosen(ctx, PARTS)
    params = {"parts": chosen, "quick": ctx.quick, "model": MODEL,
              "units": "seconds (s), bytes, blocks/s, GB/s = 1e9 bytes/s",
              "where": "CPU; the GPU side is cxlalloc's simulated driver (simulation/CPU figures, not GPU ones)"}
    w = RecordWriter(ctx.out_dir, new_record("kvserver", params, True, ctx.argv, ctx.device))
    run_parts(ctx, w, PARTS, "kvserver", chosen)
    return w.finish()


if __name__ == "__main__":
    worker_main(WORKERS, sys.argv)
    from cxlalloc_apps.bench.cli import main

    sys.exit(main(["--only", "kvserver"] + sys.argv[1:]))
