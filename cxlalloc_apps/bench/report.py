"""Plots and the results tables of ``benchmarks/README.md``, generated from benchmark JSON records.

    python -m cxlalloc_apps.bench.report --results benchmarks/results --plots benchmarks/results/plots \\
        --readme benchmarks/README.md
    python -m cxlalloc_apps.bench.report --import results.tar.gz ...   # first import a gpu_check.sh run

* reads every ``*.json`` record under ``--results`` (recursively; files that
  are not valid records are skipped with a message);
* uses only **GPU** records (``simulated`` false, status ok/partial, a GPU in
  ``hardware``) and, per benchmark, the most recent one (``date_utc``);
* writes matplotlib PNGs (:mod:`.plots`) into ``--plots``: ``decode_<point>.png`` (decode
  tokens/s vs KV spill fraction per variant, with the link-bound ceiling
  drawn), ``tiers_<point>.png`` (device/host bytes over a run, per variant),
  ``rightsizing.png``, ``ceilings.png``, ``allocation.png``;
* plots simulation records too (``bench --simulate``: the most recent one per
  benchmark), as separate files named ``simulation_*.png`` whose title and
  background say SIMULATION; a plot holds either GPU numbers or simulation
  numbers, never both, and simulation plots are never linked from the README;
* rewrites the part of ``--readme`` between ``<!-- bench:start -->`` and
  ``<!-- bench:end -->`` (appending the markers if absent) with tables made
  from the records.  Without GPU records it says the GPU numbers are pending:
  no number is ever typed by hand or taken from a simulation;
* rewrites, when that page holds ``<!-- bench-cpu:start -->`` and
  ``<!-- bench-cpu:end -->``, the CPU results between them: the latest CPU run
  of the KV reuse benchmarks (``reuse``, ``kvserver``), labelled
  simulation/CPU (real CPU compute, the GPU side on the simulated driver).

Exit status 0; 2 for bad usage.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Any, Dict, List, Optional

from cxlalloc_apps.bench.fmt import _f, _gib, _pct, _ratio
from cxlalloc_apps.bench.meta import BENCHMARKS, OPT_IN, load_records
from cxlalloc_apps.bench.plots import SIM_PREFIX, make_plots

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
# The CPU results (the KV reuse benchmarks: real CPU compute, the GPU side on
# the simulated driver), rewritten only in a page that holds these markers.
CPU_START = "<!-- bench-cpu:start -->"
CPU_END = "<!-- bench-cpu:end -->"
CPU_BENCHMARKS = ("reuse", "kvserver")


# ----------------------------------------------------------------- records
def collect(results_dir: str) -> List[Dict[str, Any]]:
    """Every ``<benchmark>.json`` record under ``results_dir`` (other JSON
    files, e.g. ``info.json``, are machine descriptions kept beside them)."""
    names = {f"{b}.json" for b in BENCHMARKS + OPT_IN}
    paths = sorted(p for p in glob.glob(os.path.join(results_dir, "**", "*.json"), recursive=True)
                   if os.path.basename(p) in names)
    return load_records(paths)


def import_tarball(tarball: str, results_dir: str) -> Optional[str]:
    """Copy the GPU records of a ``scripts/gpu_check.sh`` tarball (and its
    ``info.json``, ``README_section.md`` and ``pytest.xml``) into
    ``results_dir/<date>_<gpu>/``.  Simulation or skipped records are not
    imported.  Returns the folder, or None when the tarball held no GPU record."""
    import json
    import shutil
    import tarfile
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tarball) as tf:
            members = [m for m in tf.getmembers() if m.isfile() and not m.name.startswith(("/", ".."))
                       and ".." not in m.name.split("/")]
            try:
                tf.extractall(tmp, members=members, filter="data")
            except TypeError:  # Python without extraction filters
                tf.extractall(tmp, members=members)
        recs = [r for r in collect(tmp) if is_gpu_record(r)]
        if not recs:
            print(f"cxlalloc bench report: {tarball} holds no GPU record (nothing imported)", file=sys.stderr)
            return None
        first = min(recs, key=lambda r: r["date_utc"])
        gpu = re.sub(r"[^A-Za-z0-9]+", "-", str(first["hardware"]["gpu"].get("name", "gpu"))).strip("-").lower()
        stamp = first["date_utc"].replace(":", "").replace("-", "")
        dest = os.path.join(results_dir, f"{stamp}_{gpu}")
        os.makedirs(dest, exist_ok=True)
        for r in recs:
            src = r.pop("_path")
            with open(os.path.join(dest, os.path.basename(src)), "w") as f:
                json.dump(r, f, indent=1)
                f.write("\n")
        for extra in ("info.json", "README_section.md", "pytest.xml"):
            for p in glob.glob(os.path.join(tmp, "**", extra), recursive=True)[:1]:
                shutil.copy(p, os.path.join(dest, extra))
    print(f"cxlalloc bench report: imported {len(recs)} GPU record(s) into {dest}")
    return dest


def is_gpu_record(rec: Dict[str, Any]) -> bool:
    gpu = rec.get("hardware", {}).get("gpu", {})
    return (not rec.get("simulated") and rec.get("status") in ("ok", "partial") and bool(gpu.get("available"))
            and bool(rec.get("results")))


def is_sim_record(rec: Dict[str, Any]) -> bool:
    """A simulation record with results (``bench --simulate``): plotted, labelled, never tabled."""
    return bool(rec.get("simulated")) and rec.get("status") in ("ok", "partial") and bool(rec.get("results"))


def latest_gpu(records: List[Dict[str, Any]], keep=is_gpu_record) -> Dict[str, Dict[str, Any]]:
    """The most recent record per benchmark among those ``keep`` accepts (GPU records by default)."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in records:
        if not keep(r):
            continue
        cur = out.get(r["benchmark"])
        if cur is None or r["date_utc"] > cur["date_utc"]:
            out[r["benchmark"]] = r
    return out


# ----------------------------------------------------------------- formatting
def _run_line(rec: Dict[str, Any]) -> str:
    hw, sw = rec["hardware"], rec["software"]
    gpu = hw.get("gpu", {})
    commit = (sw.get("git_commit") or "unknown")[:10]
    return (f"{gpu.get('name', '?')}, driver {gpu.get('driver_version', '?')}, torch {sw.get('torch')}, "
            f"transformers {sw.get('transformers')}, cxlalloc {sw.get('cxlalloc')} @ {commit} "
            f"(source {sw.get('source_digest')}), {rec['date_utc']}")


def _rel(path: str, base: str) -> str:
    return os.path.relpath(path, base).replace(os.sep, "/")


# ----------------------------------------------------------------- README section
def readme_section(latest: Dict[str, Dict[str, Any]], plots: List[str], readme_dir: str) -> str:
    lines = [START, "### Benchmark results", "",
             "_Generated by `python -m cxlalloc_apps.bench.report` from the JSON records in `benchmarks/results/`; "
             "do not edit by hand. How each number is measured: \"What each benchmark measures\" below._", ""]
    latest = {b: rec for b, rec in latest.items() if b in BENCHMARKS}  # the KV reuse ones: cpu_section
    if not latest:
        lines += ["**GPU numbers pending.** No GPU benchmark run has been recorded in `benchmarks/results/` yet "
                  "(GPU test runs: `docs/verification.md`), so there are no "
                  "measured ratios (cxlalloc vs the link-bound ceiling, vs transformers' offloaded cache, vs "
                  "policy-free spill). Simulation runs (`python -m cxlalloc bench --simulate`) check the plumbing "
                  "only and are never reported here. See \"How to run on the device\" below.",
                  "", END]
        return "\n".join(lines)
    pending = [b for b in BENCHMARKS if b not in latest]
    lines += ["GPU numbers pending for: " + ", ".join(pending) + ".", ""] if pending else []
    c = latest.get("ceilings")
    if c:
        s = c.get("summary") or {}
        lines += ["#### Bandwidth ceilings", "", f"Run: {_run_line(c)}.", "",
                  "| measurement | GB/s |", "|---|---:|",
                  f"| device memory read (kernel, `x.sum()`) | {_f(s.get('hbm_read_gbps'))} |",
                  f"| device copy (read + write) | {_f(s.get('device_copy_gbps'))} |",
                  f"| torch pinned H2D / D2H | {_f(s.get('torch_pinned_h2d_gbps'))} / "
                  f"{_f(s.get('torch_pinned_d2h_gbps'))} |"]
        for bk, v in sorted((s.get("link") or {}).items()):
            lines.append(f"| host tier `{bk}` (node {v.get('numa_node')}): zero-copy read / H2D / D2H | "
                         f"{_f(v.get('zero_copy_read_gbps'))} / {_f(v.get('h2d_gbps'))} / {_f(v.get('d2h_gbps'))} |")
        lines.append("")
    d = latest.get("decode")
    if d:
        pts = (d.get("summary") or {}).get("points") or []
        lines += ["#### Decode under KV spill", "", f"Run: {_run_line(d)}.", "",
                  "Decode tokens/s of the best cxlalloc backend at each forced spill fraction, and its ratios: to "
                  "the link-bound ceiling (bytes on device / HBM read rate + bytes on host / zero-copy link rate), "
                  "to transformers' `cache_implementation=\"offloaded\"`, to the policy-free spill (first-fit, same "
                  "backend) and to plain transformers without a limit. `native+limit` is plain transformers under "
                  "the same budget.", "",
                  "| model | context | batch | KV on host (forced → measured) | cxlalloc tok/s (backend) | "
                  "vs ceiling | vs offloaded | vs policy-free | vs native | native+limit |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
        for e in pts:
            best = e.get("best_cxlalloc") or {}
            nl = e.get("native_limit") or {}
            lines.append(
                f"| {e['model']} | {e['context']} | {e['batch']} | {_pct(e['spill'])} → "
                f"{_pct(best.get('measured_host_fraction'))} | {_f(best.get('tokens_per_s'))} "
                f"({best.get('backend') or '–'}) | {_ratio(e.get('cxlalloc_vs_ceiling'))} | "
                f"{_ratio(e.get('cxlalloc_vs_offloaded'))} | {_ratio(e.get('cxlalloc_vs_policy_free'))} | "
                f"{_ratio(e.get('cxlalloc_vs_native'))} | {nl.get('status') or '–'} |")
        if not pts:
            lines.append("| – | – | – | – | no finished point | | | | | |")
        lines.append("")
    r = latest.get("rightsizing")
    if r:
        s = r.get("summary") or {}
        n, x = s.get("native_limit") or {}, s.get("cxlalloc") or {}
        lines += ["#### Right-sizing", "", f"Run: {_run_line(r)}.", "",
                  f"Fixed device budget {_gib(s.get('budget_bytes'))}, {r['parameters'].get('model')}, context "
                  f"{r['parameters'].get('context')}.", "",
                  "| variant | largest batch | decode tok/s at it | stopped by |", "|---|---:|---:|---|",
                  f"| plain transformers + limit | {_f(n.get('largest_batch'), '{}')} | {_f(n.get('tokens_per_s'))} "
                  f"| {n.get('stopped_by') or '–'} |",
                  f"| cxlalloc | {_f(x.get('largest_batch'), '{}')} | {_f(x.get('tokens_per_s'))} "
                  f"| {x.get('stopped_by') or '–'} |",
                  f"| ratio | {_ratio(s.get('batch_ratio'))} | {_ratio(s.get('tokens_per_s_ratio'))} "
                  f"| {s.get('ratios') or ''} |", ""]
    a = latest.get("allocation")
    if a:
        rows = [x for x in a["results"] if not x.get("simulated") and x.get("kind") in ("cxlalloc", "driver")]
        lines += ["#### Allocation latency", "", f"Run: {_run_line(a)}.", "",
                  "| what | bytes | malloc µs (median) | free µs (median) |", "|---|---:|---:|---:|"]
        for x in rows:
            if x["kind"] == "driver":
                what, m, fr = f"`{x['call']}`", x.get("alloc_us", {}), x.get("free_us", {})
            else:
                what = f"cxlalloc {x.get('tier_requested')} tier, {x.get('backend')}, {x.get('mode')}"
                m, fr = x.get("malloc_us", {}), x.get("free_us", {})
            lines.append(f"| {what} | {x['bytes']} | {_f(m.get('median'), '{:.2f}')} | {_f(fr.get('median'), '{:.2f}')} |")
        lines.append("")
    if plots:
        lines += ["Plots: " + ", ".join(f"[{os.path.basename(p)}]({_rel(p, readme_dir)})" for p in plots), ""]
    lines.append(END)
    return "\n".join(lines)


# ----------------------------------------------------------------- CPU results section
def is_cpu_record(rec: Dict[str, Any]) -> bool:
    """A finished CPU run of a KV reuse benchmark (``reuse``, ``kvserver``):
    its times are the CPU's own compute, its GPU side the simulated driver."""
    gpu = rec.get("hardware", {}).get("gpu", {})
    return (rec.get("benchmark") in CPU_BENCHMARKS and rec.get("status") in ("ok", "partial")
            and not gpu.get("available") and bool(rec.get("results")))


def _cpu_run_line(rec: Dict[str, Any]) -> str:
    hw, sw = rec["hardware"], rec["software"]
    cpu = hw.get("cpu", {})
    folder = os.path.basename(os.path.dirname(rec.get("_path", ""))) or "?"
    return (f"`{rec.get('command')}`, {rec['date_utc']}, {cpu.get('logical_cpus', '?')}-core {cpu.get('model', 'CPU')} "
            f"shared with other jobs, torch {sw.get('torch')}, transformers {sw.get('transformers')}, cxlalloc "
            f"{sw.get('cxlalloc')} @ {(sw.get('git_commit') or 'unknown')[:10]}; record `benchmarks/results/{folder}/`")


def _mib(x) -> str:
    """Bytes as MiB, or as KiB below one MiB."""
    if x is not None and x < (1 << 20):
        return _f(x / 1024, "{:.0f} KiB")
    return _f(None if x is None else x / (1 << 20), "{:.1f} MiB")


def cpu_section(latest: Dict[str, Dict[str, Any]]) -> str:
    """The marked CPU results section: tables of the latest ``reuse`` and
    ``kvserver`` CPU records (labelled simulation/CPU: CPU compute, simulated
    driver), or a line saying none is recorded."""
    lines = [CPU_START, "_Generated by `python -m cxlalloc_apps.bench.report` from the CPU records in "
             "`benchmarks/results/`; do not edit by hand. **Simulation/CPU**: real CPU compute on the machine named, "
             "the GPU side on the simulated driver; never GPU figures._", ""]
    if not latest:
        lines += ["No CPU run of `reuse` or `kvserver` is recorded.", "", CPU_END]
        return "\n".join(lines)
    r = latest.get("reuse")
    if r:
        pts = sorted((x for x in r["results"] if x.get("kind") == "ttft" and x.get("status") == "ok"),
                     key=lambda x: x["prefix_tokens"])
        prm = r.get("parameters", {})
        if "rounds" in prm:  # the benchmark method (method.py): spreads, per-round ratios, load
            how = (f"arms interleaved in a rotated order, {prm.get('warmup_rounds')} warm-up + {prm['rounds']} timed "
                   "rounds, median (IQR); the speed-up is the median (IQR) of the per-round ratios")
            loads = [x[k]["loadavg_1m"] for x in pts for k in ("load_before", "load_after") if x.get(k)]
            if loads:
                how += f"; load average (1 min) {min(loads):.1f}-{max(loads):.1f} on {pts[0]['load_before']['cpus']} CPUs"
        else:
            how = f"medians of {prm.get('repeat')} (recompute and hit alternating)"

        def ms(x, key):
            sp = x.get(key + "_spread_ms")
            iqr = f" ({sp['q1']:,.0f}-{sp['q3']:,.0f})" if sp else ""
            return f"{x[key + '_ms']:,.0f} ms{iqr}"

        def speed(x):
            sp, bound = x.get("speedup_spread"), x.get("bound_speedup", 0)
            if not sp:
                return f"{x['speedup']:.1f}x ({bound:,.0f}x)"
            return f"{x['speedup']:.1f}x (IQR {sp['q1']:.1f}-{sp['q3']:.1f}; bound {bound:,.0f}x)"

        lines += ["#### KV reuse: TTFT of a prefix hit vs recomputing it (`bench --only reuse`)", "",
                  f"Run: {_cpu_run_line(r)}. Model {prm.get('model')}, a {prm.get('question_tokens')}-token question "
                  f"after the prefix, {how}.", "",
                  "| prefix tokens | " + " | ".join(f"{x['prefix_tokens']:,}" for x in pts) + " |",
                  "|---|" + "---|" * len(pts),
                  "| TTFT recompute | " + " | ".join(ms(x, "recompute_ttft") for x in pts) + " |",
                  "| TTFT hit | " + " | ".join(ms(x, "hit_ttft") for x in pts) + " |",
                  "| speed-up (bound: prefill / (prefix bytes / copy GB/s)) | "
                  + " | ".join(speed(x) for x in pts) + " |",
                  "| KV loaded, load rate | " + " | ".join(f"{_mib(x['bytes_loaded'])}, {x['load_gbps']:.1f} GB/s"
                                                       for x in pts) + " |", ""]
    k = latest.get("kvserver")
    if k:
        parts: Dict[str, List[Dict[str, Any]]] = {}
        for x in k["results"]:
            parts.setdefault(x.get("part"), []).append(x)
        lines += ["#### kv-server across processes (`bench --only kvserver`)", "", f"Run: {_cpu_run_line(k)}.", "",
                  "| figure | value |", "|---|---|"]
        for t in parts.get("ttft", []):
            m = t.get("model", {})
            lines.append(f"| TTFT of process B, {t['prompt_tokens']:,}-token prompt whose {t['document_tokens']:,}-token "
                         f"document process A prefilled (Llama {m.get('layers')} layers, hidden {m.get('hidden')}, "
                         f"{m.get('dtype')}, random weights) | **{t['ttft_hit_s_median']:.3f} s** with the hit vs "
                         f"**{t['ttft_recompute_s_median']:.3f} s** recomputing ({t['ttft_speedup']:.1f}x); "
                         f"{_mib(t['bytes_loaded'])} of KV loaded in {t['load_ms']:.1f} ms; {t['check_tokens']}-token "
                         f"greedy output {'identical' if t.get('tokens_equal_with_and_without_hit') else 'DIFFERENT'} |")
        for c in sorted(parts.get("concurrency", []), key=lambda x: x["clients"]):
            lines.append(f"| {c['clients']} client process(es), {c['documents']:,} documents of {c['blocks_per_doc']} x "
                         f"{c['block_bytes'] // 1024} KiB blocks on a {c['pool_blocks']:,}-block pool | hit rate "
                         f"{c['hit_rate']:.2f}; {c['lookups_per_s']:,.0f} lookups/s + {c['inserted_blocks_per_s']:,.0f} "
                         f"inserted blocks/s ({c['load_GBps']:.1f} GB/s loaded); lookup p50 {c['lookup_ms_p50']:.1f} ms, "
                         f"p99 {c['lookup_ms_p99']:.1f} ms; {c['errors']} errors |")
        for x in sorted(parts.get("redis", []), key=lambda x: x["block_bytes"]):
            lines.append(f"| Redis tier (local redis-server), load time per {_mib(x['block_bytes'])} block | "
                         f"{x['load_s_per_block_single_median'] * 1e3:.2f} ms alone, "
                         f"{x['load_s_per_block_in_batch_of_8'] * 1e3:.2f} ms in a batch of 8 |")
        for x in parts.get("redis_through_server", []):
            lines.append(f"| a pool miss of {x['blocks']} x {_mib(x['block_bytes'])} served from Redis through the "
                         f"server | {x['lookup_s_pool_miss_from_redis'] * 1e3:.0f} ms "
                         f"({x['load_s_per_block_from_redis_via_server'] * 1e3:.0f} ms/block) vs "
                         f"{x['lookup_s_pool_hit'] * 1e3:.2f} ms for the pool hit |")
        for x in parts.get("kill_client_mid_insert", []):
            lines.append(f"| kill -9 of {x['killed']} of {x['writers']} writers mid-insert | "
                         f"{x['committed_blocks_logged']:,} committed blocks logged, {x['committed_blocks_missing']} "
                         f"missing, {x['committed_blocks_torn']} torn; {x['server_aborted_blocks']} unpublished blocks "
                         "aborted |")
        for x in parts.get("kill_server_under_load", []):
            lines.append(f"| kill -9 of the server under load (restarted "
                         f"{x['restarted_at_s'] - x['killed_at_s']:.1f} s later) | {x['generate_calls']} generate() "
                         f"calls, {x['generate_mismatches']} mismatches, {x['generate_errors']} exceptions; "
                         f"{x['generate_calls_with_hit_after_restart']} hits after the restart; load clients: "
                         f"{x['load_client_errors']} errors |")
        lines.append("")
    lines.append(CPU_END)
    return "\n".join(lines)


def update_readme(path: str, section: str, start: str = START, end: str = END) -> None:
    """Replace the section of ``path`` between ``start`` and ``end`` (or append it)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    if start in text and end in text:
        pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        text = pat.sub(lambda m: section, text, count=1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    with open(path, "w") as f:
        f.write(text)


# ----------------------------------------------------------------- entry
def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cxlalloc_apps.bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join("benchmarks", "results"), help="folder of JSON records")
    p.add_argument("--plots", default=None, help="folder for PNG plots (default RESULTS/plots)")
    p.add_argument("--readme", default=None, help="page to update between the bench markers (benchmarks/README.md; "
                   "its CPU section too when it holds the bench-cpu markers; default: none)")
    p.add_argument("--import", dest="tarball", default=None, metavar="TARBALL",
                   help="first copy the GPU records of a gpu_check.sh results.tar.gz into RESULTS/<date>_<gpu>/")
    args = p.parse_args(argv)
    if args.tarball:
        import_tarball(args.tarball, args.results)
    plots_dir = args.plots or os.path.join(args.results, "plots")
    records = collect(args.results)
    latest = latest_gpu(records)
    plots = make_plots(latest, plots_dir) if latest else []
    sims = {b: r for b, r in latest_gpu(records, keep=is_sim_record).items() if b in BENCHMARKS}
    sim_plots = make_plots(sims, plots_dir, sim=True) if sims else []
    if args.readme:  # GPU plots only: simulation plots are never linked from the README
        update_readme(args.readme, readme_section(latest, plots, os.path.dirname(os.path.abspath(args.readme))))
        with open(args.readme) as f:
            has_cpu = CPU_START in f.read()
        if has_cpu:
            update_readme(args.readme, cpu_section(latest_gpu(records, keep=is_cpu_record)), CPU_START, CPU_END)
    print(f"cxlalloc bench report: {len(records)} record(s), GPU benchmarks: {', '.join(sorted(latest)) or 'none'}; "
          f"{len(plots)} plot(s) in {plots_dir}"
          + (f"; {len(sim_plots)} SIMULATION plot(s) ({SIM_PREFIX}*.png, from {', '.join(sorted(sims))}; not in the "
             "README)" if sims else "")
          + (f"; updated {args.readme}" if args.readme else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
