"""The benchmark plots (matplotlib PNGs) of :mod:`cxlalloc_apps.bench.report`:
decode tokens/s against the KV spill fraction with the link-bound ceiling,
device/host bytes over a run, right-sizing, ceilings, allocation latency; GPU
records' plots and, as ``simulation_*.png`` marked SIMULATION, simulation
records' plots, never both in one plot.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

from cxlalloc_apps.bench.fmt import GiB, _gib
from cxlalloc_apps.bench.model import SHAPES, ceiling_tokens_per_s


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _point_name(m, c, b) -> str:
    return f"{m}_ctx{c}_b{b}"


SIM_PREFIX = "simulation_"
SIM_NOTE = "SIMULATION: cxlalloc's simulated CUDA driver on a CPU; not GPU numbers"


def _is_sim_row(rec: Dict[str, Any], row: Dict[str, Any]) -> bool:
    return bool(row.get("simulated", rec.get("simulated")))


def _mark_sim(fig, axes) -> None:
    """Label a simulation figure: a note under it and SIMULATION across every axes."""
    for ax in axes:
        ax.text(0.5, 0.5, "SIMULATION", transform=ax.transAxes, fontsize=28, color="gray", alpha=0.18,
                rotation=20, ha="center", va="center", zorder=0)
    fig.text(0.5, 0.005, SIM_NOTE, ha="center", va="bottom", fontsize=7, color="dimgray")


def _file(out_dir: str, name: str, sim: bool) -> str:
    return os.path.join(out_dir, (SIM_PREFIX if sim else "") + name)


def plot_decode(rec: Dict[str, Any], out_dir: str, sim: bool = False) -> List[str]:
    plt = _plt()
    rows = [r for r in rec["results"] if r.get("variant") and _is_sim_row(rec, r) == sim]
    points = sorted({(r["model"], r["context"], r["batch"]) for r in rows})
    s = rec.get("summary") or {}
    hbm = s.get("hbm_read_gbps")
    files = []
    for (m, c, b) in points:
        rs = [r for r in rows if (r["model"], r["context"], r["batch"]) == (m, c, b)]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series: Dict[str, List] = {}
        for r in rs:
            if r["variant"] in ("cxlalloc", "policy_free", "native_limit") and r.get("status") == "ok" \
                    and r.get("decode_tokens_per_s"):
                key = r["variant"] + (f" ({r['backend']})" if r.get("backend") else "")
                series.setdefault(key, []).append((r["spill"], r["decode_tokens_per_s"]))
        for key, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=key)
        for r in rs:
            if r.get("status") == "oom":  # at the bottom of the axes (the y axis is logarithmic)
                ax.text(r["spill"] * 100, 0.02, f"OOM: {r['variant']}", transform=ax.get_xaxis_transform(),
                        color="red", ha="center", fontsize=6, rotation=90, va="bottom")
        nat = next((r for r in rs if r["variant"] == "native" and r.get("decode_tokens_per_s")), None)
        if nat:
            ax.axhline(nat["decode_tokens_per_s"], color="black", linestyle=":", label="native, no limit")
        off = next((r for r in rs if r["variant"] == "hf_offloaded" and r.get("decode_tokens_per_s")), None)
        if off:
            ax.axhline(off["decode_tokens_per_s"], color="gray", linestyle="--", label="transformers offloaded")
        # Ceiling: the best measured link (the rows carry what they used).
        links = [r["ceiling_link"]["link_read_gbps"] for r in rs
                 if r.get("ceiling_link") and r["ceiling_link"].get("link_read_gbps")]
        if hbm and links and m in SHAPES:
            sh = SHAPES[m]
            kv = sh.kv_bytes(b, c + rs[0]["new_tokens"] // 2)
            xs = [i / 20 for i in range(0, 21)]
            ys = [ceiling_tokens_per_s(b, sh.weight_bytes(), kv, x, hbm, max(links)) for x in xs]
            ax.plot([x * 100 for x in xs], ys, color="tab:red", linewidth=2, alpha=0.6,
                    label=f"link-bound ceiling ({max(links):.0f} GB/s link)")
        ax.set_xlabel("KV cache forced to the host tier (%)")
        ax.set_ylabel("decode tokens/s (all sequences)")
        ax.set_yscale("log")
        if sim:
            ax.set_title(f"SIMULATION — {m}, context {c}, batch {b} (simulated driver, CPU)")
            _mark_sim(fig, [ax])
        else:
            ax.set_title(f"{m}, context {c}, batch {b} — {rec['hardware']['gpu'].get('name', '')}")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        files.append(_save(fig, _file(out_dir, f"decode_{_point_name(m, c, b)}.png", sim)))
        tl = [r for r in rs if r.get("timeline") and r.get("status") == "ok"]
        if tl:
            files.append(plot_tiers(tl, _file(out_dir, f"tiers_{_point_name(m, c, b)}.png", sim), (m, c, b), sim))
    return files


def _save(fig, path: str, dpi: int = 110) -> str:
    """Lay out, write ``path`` (PNG) and release ``fig``; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)
    return path


def plot_tiers(rows: List[Dict[str, Any]], path: str, point, sim: bool = False) -> str:
    plt = _plt()
    rows = sorted(rows, key=lambda r: (r["variant"], r.get("backend") or "", r.get("spill") or 0))[:12]
    n = len(rows)
    cols = min(3, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
    for ax, r in zip([a for row in axes for a in row], rows):
        tl = r["timeline"]
        x = [s.get("put", i) for i, s in enumerate(tl)]
        dev = [s.get("device_bytes", 0) / GiB for s in tl]
        host = [(s.get("host_bytes") or 0) / GiB for s in tl]
        ax.stackplot(x, dev, host, labels=["device", "host"], alpha=0.7)
        if any("kv_host_bytes" in s for s in tl):
            ax.plot(x, [s.get("kv_host_bytes", 0) / GiB for s in tl], color="black", linewidth=1, label="KV on host")
        ax.set_title(f"{r['variant']} {r.get('backend') or ''} f={r.get('spill')}", fontsize=8)
        ax.set_xlabel("streamer call (0 = prompt, 1 = first token)", fontsize=7)
        ax.set_ylabel("GiB", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in [a for row in axes for a in row][n:]:
        ax.axis("off")
    axes[0][0].legend(fontsize=6)
    title = f"tier usage over a run: {point[0]}, context {point[1]}, batch {point[2]}"
    fig.suptitle(f"SIMULATION — {title}" if sim else title, fontsize=9)
    if sim:
        _mark_sim(fig, [a for row in axes for a in row][:n])
    return _save(fig, path, dpi=100)


def plot_rightsizing(rec: Dict[str, Any], out_dir: str) -> List[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in ("native_limit", "cxlalloc"):
        rs = sorted((r for r in rec["results"] if r.get("variant") == variant), key=lambda r: r["batch"])
        ok = [r for r in rs if r.get("status") == "ok" and r.get("decode_tokens_per_s")]
        ax.plot([r["batch"] for r in ok], [r["decode_tokens_per_s"] for r in ok], marker="o", label=variant)
        bad = [r for r in rs if r.get("status") in ("oom", "error")]
        ax.plot([r["batch"] for r in bad], [0.0] * len(bad), marker="x", linestyle="none", color="red")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("aggregate decode tokens/s")
    s = rec.get("summary") or {}
    ax.set_title(f"fixed budget {_gib(s.get('budget_bytes'))} (x: failed)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return [_save(fig, os.path.join(out_dir, "rightsizing.png"))]


def plot_ceilings(rec: Dict[str, Any], out_dir: str) -> List[str]:
    plt = _plt()
    s = rec.get("summary") or {}
    labels, vals = [], []
    for k, name in (("hbm_read_gbps", "HBM read"), ("device_copy_gbps", "device copy (r+w)"),
                    ("torch_pinned_h2d_gbps", "torch pinned H2D"), ("torch_pinned_d2h_gbps", "torch pinned D2H")):
        if s.get(k):
            labels.append(name)
            vals.append(s[k])
    for bk, v in sorted((s.get("link") or {}).items()):
        for k, name in (("zero_copy_read_gbps", "zero-copy read"), ("h2d_gbps", "H2D"), ("d2h_gbps", "D2H")):
            if v.get(k):
                labels.append(f"{bk} {name}")
                vals.append(v[k])
    if not vals:
        return []
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(vals) + 1.2))
    ax.barh(labels, vals)
    ax.set_xscale("log")
    ax.set_xlabel("GB/s (1e9 B/s), log scale")
    ax.set_title(f"bandwidth ceilings — {rec['hardware']['gpu'].get('name', '')}")
    return [_save(fig, os.path.join(out_dir, "ceilings.png"))]


def plot_allocation(rec: Dict[str, Any], out_dir: str, sim: bool = False) -> List[str]:
    plt = _plt()
    labels, vals = [], []
    for x in rec["results"]:
        if bool(x.get("simulated")) != sim or x.get("kind") not in ("cxlalloc", "driver"):
            continue
        if x["kind"] == "driver":
            labels.append(f"{x['call']} {x['bytes'] >> 20} MiB")
            vals.append((x.get("alloc_us") or {}).get("median"))
        else:
            labels.append(f"{x.get('tier_requested')} {x.get('backend')} {x.get('mode')} {x['bytes'] >> 20} MiB")
            vals.append((x.get("malloc_us") or {}).get("median"))
    pairs = [(l, v) for l, v in zip(labels, vals) if v]
    if not pairs:
        return []
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(pairs) + 1.2))
    ax.barh([p[0] for p in pairs], [p[1] for p in pairs])
    ax.set_xscale("log")
    ax.set_xlabel("malloc / alloc latency, µs (median), log scale")
    ax.tick_params(labelsize=7)
    if sim:
        ax.set_title("SIMULATION — allocation latency on the simulated driver (engine CPU cost only)", fontsize=9)
        _mark_sim(fig, [ax])
    return [_save(fig, _file(out_dir, "allocation.png", sim))]


def make_plots(latest: Dict[str, Dict[str, Any]], out_dir: str, sim: bool = False) -> List[str]:
    """Plots of GPU records (``sim`` False) or, as ``simulation_*.png``, of
    simulation records (``sim`` True: decode and allocation, the benchmarks a
    simulation runs).  Each plot is made from one kind only."""
    os.makedirs(out_dir, exist_ok=True)
    files: List[str] = []
    plots = (("allocation", plot_allocation), ("decode", plot_decode)) if sim else (
        ("ceilings", plot_ceilings), ("allocation", plot_allocation), ("decode", plot_decode),
        ("rightsizing", plot_rightsizing))
    for name, fn in plots:
        if name in latest:
            try:
                files += fn(latest[name], out_dir, sim=True) if sim else fn(latest[name], out_dir)
            except Exception as e:  # a plot must never stop the table
                print(f"cxlalloc bench report: plot {'simulation ' if sim else ''}{name} failed: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)
    return files


def plot_engines(rec: Dict[str, Any], path: str):
    """``bench --only engines``: left, each arm's median TTFT (IQR bars) against the prefix size (one line per
    arm and group); right, each pool arm's per-round TTFT ratio to LMCache's local CPU tier (median, IQR) with
    the 1.3x goal.  Returns ``path``, or None when the record has no comparison."""
    rows = [r for r in rec.get("results", []) if r.get("kind") == "comparison" and r.get("comparison")]
    if not rows:
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    series: Dict[str, List] = {}
    ratios: Dict[str, List] = {}
    for r in rows:
        for arm, sp in r["comparison"]["spread"].items():
            if arm == "lmcache_local_cpu_again":
                continue
            key = arm if arm not in ("no_cache", "lmcache_local_cpu") else f"{arm} ({r['group']})"
            series.setdefault(key, []).append((r["prefix_tokens"], sp))
        for g in r.get("goals", []):
            ratios.setdefault(g["arm"], []).append((r["prefix_tokens"], g["ratio"]))
    for key, pts in sorted(series.items()):
        pts.sort(key=lambda p: p[0])
        xs, med = [p[0] for p in pts], [p[1]["median"] for p in pts]
        a.errorbar(xs, med, yerr=[[m - p[1]["q1"] for m, p in zip(med, pts)], [p[1]["q3"] - m for m, p in zip(med, pts)]],
                   fmt="o-" if key.startswith("cxlalloc") else ".--", label=key, capsize=3, alpha=0.85)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("shared prefix (tokens)")
    a.set_ylabel("TTFT s (median, IQR)")
    a.set_title("vLLM time to first token")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=7)
    for arm, pts in sorted(ratios.items()):
        pts.sort(key=lambda p: p[0])
        xs, med = [p[0] for p in pts], [p[1]["median"] for p in pts]
        b.errorbar(xs, med, yerr=[[m - p[1]["q1"] for m, p in zip(med, pts)], [p[1]["q3"] - m for m, p in zip(med, pts)]],
                   fmt="o-", label=arm, capsize=3)
    goal = rec.get("parameters", {}).get("goal", 1.3)
    b.axhline(goal, color="red", linestyle=":", label=f"goal <= {goal}x")
    b.axhline(1.0, color="gray", linestyle="-", linewidth=0.5)
    b.set_xscale("log", base=2)
    b.set_xlabel("shared prefix (tokens)")
    b.set_ylabel("TTFT / LMCache local CPU, per round (median, IQR)")
    b.set_title("a pool hit in process B vs LMCache's in-process CPU tier")
    b.grid(True, alpha=0.3)
    b.legend(fontsize=7)
    fig.suptitle("vLLM CPU build, SmolLM2-135M bf16, 2-core shared machine (no GPU; not yet run on a GPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
