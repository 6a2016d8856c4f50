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
    batches of new blocks (64 KiB and 1 MiB) inserted as the client does
    best: the next reservation asked for before this one is written
    (``reserve_ahead``), the batch written in one streaming copy
    (``RemoteReservation.write``), the commit pipelined; against a plain
    memcpy of the same bytes into a preallocated, already touched buffer
    (``torch.Tensor.copy_`` per block).  Ratio: memcpy time over insert time
    (1.0: inserting costs nothing beyond the copy).  Also the path before
    (each reserve waited, ``copy_`` per block), one block per reservation,
    and copies into a pool-sized buffer (plain and streaming: the bound).
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

import os
from typing import Any, Dict, Optional

from cxlalloc_apps.bench.kvprocs import _chosen, run_parts
from cxlalloc_apps.bench.kvspeed_hf import (CHAT_GOAL, CHAT_TURNS, PREFIX_GOAL, PREFIX_TOKENS,  # noqa: F401
                                            part_chat, part_prefix)
from cxlalloc_apps.bench.kvspeed_store import (INSERT_SIZES, LOOKUP_BLOCK, LOOKUP_CLIENTS, LOOKUP_KEYS, KiB, MiB,
                                               part_insert, part_lookup)
from cxlalloc_apps.bench.meta import RecordWriter, new_record

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
    ahead = any("ratio_insert_reserve_waited_over_memcpy" in r for r in ins)
    arms = [("ratio_insert_over_memcpy", "reserve ahead + streaming write" if ahead else "batched, pipelined commit"),
            ("ratio_insert_reserve_waited_over_memcpy", "reserve waited + copy_ (before)"),
            ("ratio_insert_commit_waited_over_memcpy", "batched, commit waited"),
            ("ratio_one_per_reservation_over_memcpy", "one per reservation"),
            ("cpu_ratio_insert_over_memcpy", "reserve ahead, in CPU time" if ahead else "pipelined, in CPU time")]
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



def insert_markdown(rec: Dict[str, Any]) -> str:
    """The insert figures of a record as the markdown table of benchmarks/README.md: per block size, each
    ratio (memcpy time / insert time, per round) as median, IQR and rounds, the goal's verdict, the memcpy
    arm's A/A noise floor and the load average before/after.  A record with the reserve-ahead arms
    (2026-12-03c on) gets their columns too.  Empty when the record has no insert result."""
    ins = [r for r in rec.get("results", []) if r.get("part") == "insert" and "goal" in r]
    ahead = any("ratio_insert_reserve_waited_over_memcpy" in r for r in ins)
    if ahead:
        head = ("| insert (memcpy time / insert time, per round) | reserve ahead + streaming write (goal) | each reserve "
                "waited + copy_ (before) | before, commit waited too | one block per reservation | vs copy_ into a "
                "pool-sized buffer | vs streaming copy into a pool-sized buffer (bound) | CPU time ratio (client + "
                "server) | verdict | A/A noise floor (memcpy) | load (1 min) |")
    else:
        head = ("| insert (memcpy time / insert time, per round) | pipelined commit (goal) | commit waited | one block "
                "per reservation | vs memcpy into a pool-sized buffer | CPU time ratio (client + server) | verdict "
                "| A/A noise floor (memcpy) | load (1 min) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]

    def cell(d: Dict[str, float]) -> str:
        return f"**{d['median']:.3f}x** (IQR {d['q1']:.3f}-{d['q3']:.3f}, n={d['n']})"

    for r in ins:
        ms, goal, nf, c = r["ms_per_batch_median"], r["goal"], r["noise_floor_memcpy_aa"], r["comparison"]
        cells = [f"{r['blocks_per_reservation']} x {r['block_bytes'] // KiB} KiB (memcpy {ms['memcpy']:.3f} ms, "
                 f"insert {ms['insert']:.3f} ms a batch)",
                 f"{cell(r['ratio_insert_over_memcpy'])} (≥ {goal['target']})"]
        if ahead:
            cells.append(cell(r["ratio_insert_reserve_waited_over_memcpy"]))
        cells += [cell(r["ratio_insert_commit_waited_over_memcpy"]), cell(r["ratio_one_per_reservation_over_memcpy"]),
                  cell(r["ratio_insert_over_memcpy_cold"])]
        if ahead:
            cells.append(cell(r["ratio_insert_over_memcpy_cold_stream"]))
        cells += [cell(r["cpu_ratio_insert_over_memcpy"]), goal["verdict"],
                  f"{nf['median']:.2f} (IQR {nf['q1']:.2f}-{nf['q3']:.2f})",
                  f"{c['load_before'].get('loadavg_1m')}-{c['load_after'].get('loadavg_1m')}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n" if len(rows) > 2 else ""


if __name__ == "__main__":
    import sys

    from cxlalloc_apps.bench.cli import main

    sys.exit(main(["--only", "kvspeed"] + sys.argv[1:]))
