"""LMCache get and retrieve: ``cxlalloc://`` vs LMCache's local CPU backend, on the benchmark method (CPU).

    python -m cxlalloc bench --only lmcache_get [--quick] --out DIR

Writes ``DIR/lmcache_get.json`` (:mod:`.meta` record) and ``DIR/lmcache_get.png``.  Issue 27's goal:
``cxlalloc://`` retrieve >= 0.8x LMCache's local CPU backend at 1-16 MiB chunks.

Per chunk size (1, 4, 16 MiB: LMCache chunks of 256 tokens, bf16), one kv-server process and, in this process,
LMCache's storage backends built from LMCache configs (the real ``lmcache`` package, scripts/install_lmcache.sh)
two ways: ``local_cpu`` (``LocalCPUBackend`` alone, the chunks in its hot cache) and ``cxlalloc`` (``RemoteBackend``
with the plugin; the chunks in the pool).  The arms, each over the same number of chunks (32 MiB a round; 16 MiB
with ``--quick``):

local_cpu_get / cxlalloc_get
    ``batched_get_blocking`` of the stored chunks (memory objects out; LMCache's local CPU get hands out a
    reference, no copy).
local_cpu_retrieve / cxlalloc_retrieve
    the get, then each memory object copied into a destination tensor (the engine's KV cache's stand-in, where
    LMCache copies a hit next).  ``cxlalloc``: pool -> LMCache's memory object (verified there) -> destination.
memcpy
    n distinct chunks of host memory copied once each into the destination, tensor to tensor: what one copy
    of the same bytes costs at that moment (the bound of a one-copy path).

Method (:mod:`.method`): every round runs every arm once, in an order rotated by the round number, after one
warm-up round; samples are GB/s (1e9 bytes/s); each ratio is taken per round, then summarised (median, IQR,
min-max); an A/A noise floor of ``local_cpu_retrieve``; the load average before and after; a verdict per goal.

Then, untimed by the method, **where a cxlalloc:// retrieve goes**: one instrumented pass per round (3) times the
kv-server lookup (the pin), the copy pool -> memory object, the XXH3-128 pass over that copy, and the copy out;
``other`` is the rest of the get (LMCache's event-loop hop, allocation, header parsing, Python).

Everything is host memory on this machine (no GPU, no CXL device): the ratios compare the paths' copies and
software, not a link.  Not yet run on a GPU.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

MiB = 1 << 20
SIZES = (1 * MiB, 4 * MiB, 16 * MiB)
ARMS = ("local_cpu_get", "cxlalloc_get", "local_cpu_retrieve", "cxlalloc_retrieve", "memcpy")
RATIOS = (("cxlalloc_get", "local_cpu_get"), ("cxlalloc_retrieve", "local_cpu_retrieve"),
          ("cxlalloc_retrieve", "memcpy"), ("local_cpu_retrieve", "memcpy"))
GOAL = 0.8   # issue 27: retrieve >= 0.8x LMCache's local CPU backend


def _breakdown(eng, keys, dst, nbytes: int, passes: int = 3) -> Dict[str, float]:
    """ms per chunk of each stage of a cxlalloc:// retrieve (medians over ``passes``), instrumented in-process."""
    import torch
    import xxhash

    from cxlalloc.kvstore.engines import lmcache_plugin as lp

    conn = eng.store.connection
    conn = getattr(conn, "_connector", conn)           # LMCache wraps connectors (InstrumentedRemoteConnector)
    acc: Dict[str, float] = {}

    def add(k, dt):
        acc[k] = acc.get(k, 0.0) + dt

    real_lookup, real_cv = conn.store.lookup, lp.copy_verified

    def lookup(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_lookup(*a, **k)
        finally:
            add("lookup_rpc", time.perf_counter() - t0)

    def copy_verified(dst_, src, key, head, want):  # the same two steps as layout.copy_verified, timed apart
        t0 = time.perf_counter()
        dst_.copy_(src)
        t1 = time.perf_counter()
        h = xxhash.xxh3_128()
        h.update(bytes(key))
        h.update(head)
        h.update(memoryview(dst_.numpy()))
        ok = h.digest() == bytes(want)
        add("copy_pool_to_memobj", t1 - t0)
        add("xxh3_of_the_copy", time.perf_counter() - t1)
        return ok

    rows: List[Dict[str, float]] = []
    conn.store.lookup, lp.copy_verified = lookup, copy_verified
    try:
        for _ in range(passes):
            acc.clear()
            t0 = time.perf_counter()
            got = eng.store.batched_get_blocking(keys)
            t1 = time.perf_counter()
            if any(g is None for g in got):
                raise RuntimeError("a stored chunk was not found")
            for g in got:
                dst.copy_(g.tensor.reshape(-1).view(torch.uint8))
            t2 = time.perf_counter()
            for g in got:
                g.ref_count_down()
            row = {k: v / len(keys) * 1e3 for k, v in acc.items()}
            row["get"] = (t1 - t0) / len(keys) * 1e3
            row["copy_out"] = (t2 - t1) / len(keys) * 1e3
            row["other"] = row["get"] - row.get("lookup_rpc", 0) - row.get("copy_pool_to_memobj", 0) \
                - row.get("xxh3_of_the_copy", 0)
            row["retrieve"] = (t2 - t0) / len(keys) * 1e3
            rows.append(row)
    finally:
        conn.store.lookup, lp.copy_verified = real_lookup, real_cv
    out = {f"{k}_ms_per_chunk": round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    out["xxh3_share_of_retrieve"] = round(out["xxh3_of_the_copy_ms_per_chunk"] / out["retrieve_ms_per_chunk"], 4)
    return out


def run(ctx) -> Dict[str, Any]:
    from cxlalloc_apps.bench.kvprocs import _Server
    from cxlalloc_apps.bench.lmcache import TOKENS, _Engine, _get, _server_args, _store, open_record
    from cxlalloc_apps.bench.method import MIN_ROUNDS, describe, goal_record, interleave, noise_floor

    quick = ctx.quick
    total = (16 if quick else 32) * MiB
    rounds = MIN_ROUNDS if quick else 7
    params = {"sizes_bytes": list(SIZES), "arms": list(ARMS), "bytes_per_sample": total, "rounds": rounds,
              "warmup_rounds": 1, "chunk_tokens": TOKENS, "dtype": "bfloat16", "quick": quick, "goal": GOAL,
              "units": "GB/s = 1e9 bytes/s", "where": "CPU host memory; no GPU, no CXL device",
              "method": describe("rotate", rounds, 1)}
    w, skipped = open_record(ctx, "lmcache_get", params)
    if skipped is not None:
        return skipped
    import torch

    torch.set_num_threads(1)  # one copy thread for every arm
    work = tempfile.mkdtemp(prefix="lmcg-", dir="/tmp")
    try:
        for nbytes in SIZES:
            if ctx.deadline.expired():
                w.skip(f"{nbytes}", "time budget used up")
                continue
            n = max(total // nbytes, 2)
            ctx.log(f"lmcache_get: {nbytes // MiB} MiB chunks x {n}, {rounds} rounds")
            srv = local = cxl = None
            try:
                src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
                dst = torch.empty(nbytes, dtype=torch.uint8)
                srv = _Server(work, _server_args(nbytes, n), f"kv-{nbytes}.sock").start()
                cpu_gb = max(0.5, 3 * n * nbytes / 1e9)
                local = _Engine("local_cpu", nbytes, work, "", None, cpu_gb)
                cxl = _Engine("cxlalloc", nbytes, work, srv.socket, None, cpu_gb)
                lkeys, ckeys = local.keys(n, 1), cxl.keys(n, 1)
                _store(local, lkeys, src)
                _store(cxl, ckeys, src)
                b = n * nbytes

                srcs = [torch.empty_like(src).copy_(src) for _ in range(n)]   # n distinct chunks, as the arms read

                def copies():
                    t0 = time.perf_counter()
                    for s in srcs:
                        dst.copy_(s)
                    return b / (time.perf_counter() - t0) / 1e9

                arms = {"local_cpu_get": lambda: b / _get(local, lkeys) / 1e9,
                        "cxlalloc_get": lambda: b / _get(cxl, ckeys) / 1e9,
                        "local_cpu_retrieve": lambda: b / _get(local, lkeys, dst) / 1e9,
                        "cxlalloc_retrieve": lambda: b / _get(cxl, ckeys, dst) / 1e9,
                        "memcpy": copies}
                cmp = interleave(arms, rounds, warmup=1)
                floor = noise_floor(arms["local_cpu_retrieve"], rounds)
                row = {"kind": "comparison", "chunk_bytes": nbytes, "chunks": n, "status": "ok",
                       "method": cmp.as_dict()["method"] + "; samples GB/s of n chunks per arm; the breakdown from "
                                 "3 instrumented passes after the rounds",
                       "comparison": cmp.as_dict(RATIOS), "noise_floor_ratio": floor.as_dict(),
                       "goal": goal_record(f"cxlalloc:// retrieve >= {GOAL}x LMCache local CPU, "
                                           f"{nbytes // MiB} MiB chunks",
                                           cmp.ratio("cxlalloc_retrieve", "local_cpu_retrieve"), GOAL, "higher"),
                       "breakdown": _breakdown(cxl, ckeys, dst, nbytes)}
                st = cxl.store.connection
                st = getattr(st, "_connector", st).stats()
                row["cxlalloc_counters"] = {k: st.get(k) for k in ("hit_blocks", "corrupt_blocks", "bad_blocks")}
                w.add(row)
            except Exception as e:
                import traceback

                w.error(f"{nbytes}", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}")
            finally:
                for eng in (local, cxl):
                    if eng is not None:
                        eng.close()
                if srv is not None:
                    srv.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec = w.finish()
    try:
        plot(rec, os.path.join(ctx.out_dir, "lmcache_get.png"))
    except Exception as e:  # a missing matplotlib never loses the record
        ctx.log(f"bench lmcache_get: no plot ({type(e).__name__}: {e})")
    return rec


def markdown(rec: Dict[str, Any]) -> str:
    """The record as a markdown table (benchmarks/README.md is pasted from it): per chunk size, each arm's median
    GB/s, the per-round ratios (median, IQR), the goal's verdict, the A/A noise floor, the load before/after and
    the XXH3 pass's share of a retrieve.  Empty when the record has no comparison."""
    rows = ["| chunk | GB/s local CPU get / retrieve | GB/s cxlalloc:// get / retrieve | GB/s one memcpy "
            "| get ratio | retrieve ratio (IQR) | goal >= 0.8x | A/A noise (IQR) | XXH3 share of retrieve "
            "| load avg 1m before/after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rec.get("results", []):
        c = r.get("comparison")
        if r.get("kind") != "comparison" or not c:
            continue
        s, q, nf = c["spread"], c["ratios"], r["noise_floor_ratio"]
        g, rr = q["cxlalloc_get/local_cpu_get"], q["cxlalloc_retrieve/local_cpu_retrieve"]
        rows.append(f"| {r['chunk_bytes'] // MiB} MiB | {s['local_cpu_get']['median']:,.1f} / "
                    f"{s['local_cpu_retrieve']['median']:.2f} | {s['cxlalloc_get']['median']:.2f} / "
                    f"{s['cxlalloc_retrieve']['median']:.2f} | {s['memcpy']['median']:.2f} | {g['median']:.4f}x "
                    f"| **{rr['median']:.3f}x** ({rr['q1']:.3f}-{rr['q3']:.3f}) | {r['goal']['verdict']} "
                    f"| {nf['q1']:.3f}-{nf['q3']:.3f} | {r['breakdown']['xxh3_share_of_retrieve'] * 100:.0f} % "
                    f"| {c['load_before'].get('loadavg_1m')} / {c['load_after'].get('loadavg_1m')} |")
    return "\n".join(rows) + "\n" if len(rows) > 2 else ""


def plot(rec: Dict[str, Any], path: str) -> Optional[str]:
    """Left: retrieve GB/s per arm by chunk size (median, IQR bars); right: where a cxlalloc:// retrieve goes."""
    rows = [r for r in rec.get("results", []) if r.get("kind") == "comparison"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.4))
    xs = [r["chunk_bytes"] // MiB for r in rows]
    for arm, style in zip(("local_cpu_retrieve", "cxlalloc_retrieve", "memcpy", "cxlalloc_get"),
                          ("o-", "s-", "^--", "x:")):
        sp = [r["comparison"]["spread"][arm] for r in rows]
        med = [p["median"] for p in sp]
        a.errorbar(xs, med, yerr=[[m - p["q1"] for m, p in zip(med, sp)], [p["q3"] - m for m, p in zip(med, sp)]],
                   fmt=style, label=arm, capsize=3)
    a.set_xscale("log", base=2)
    a.set_xlabel("chunk (MiB)")
    a.set_ylabel("GB/s (median, IQR)")
    a.set_title("retrieve = get + copy into the destination")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    stages = ("lookup_rpc", "copy_pool_to_memobj", "xxh3_of_the_copy", "other", "copy_out")
    bottom = [0.0] * len(rows)
    labels = [f"{x} MiB" for x in xs]
    for st in stages:
        v = [r["breakdown"].get(f"{st}_ms_per_chunk", 0.0) for r in rows]
        b.bar(labels, v, bottom=bottom, label=st)
        bottom = [p + q for p, q in zip(bottom, v)]
    b.set_ylabel("ms per chunk (median of 3 instrumented passes)")
    b.set_title("where a cxlalloc:// retrieve goes")
    b.legend(fontsize=8)
    fig.suptitle(f"LMCache {rec.get('parameters', {}).get('lmcache', '?')} get/retrieve, CPU host memory "
                 "(2-core shared machine; no GPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys

    from cxlalloc_apps.bench.cli import main

    sys.exit(main(["--only", "lmcache_get"] + sys.argv[1:]))
