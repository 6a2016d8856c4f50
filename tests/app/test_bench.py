"""CPU tests of the benchmark harness: records, skips, dry run,
report, managed-memory guard, worker protocol.  No timing is asserted: the
benchmarks produce numbers, the tests check plumbing."""

import json
import os
import statistics
import subprocess
import sys
import tarfile

import pytest

from cxlalloc_apps.bench import decode, guard, meta, report, rightsizing
from cxlalloc_apps.bench import plots as report_plots
from cxlalloc_apps.bench.model import SHAPES, ceiling_tokens_per_s
from tests.helpers.proc import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1 << 30
MiB = 1 << 20
STEPS = ("env", "wheels", "build", "adapter", "info", "ceilings", "allocation", "pytest-gpu", "hf-per-gpu",
         "hf-multi-gpu", "kvserver", "reuse",
         "lmcache", "vllm", "vllm-offload", "cb", "serve", "decode", "plan", "rightsizing", "report", "pack")


def _bench(args, timeout=120):
    env = child_env(hide_gpus=False, keep_cxlalloc=False, unbuffered=True)
    return subprocess.run([sys.executable, "-m", "cxlalloc", "bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _has_cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# ----------------------------------------------------------------- bench --simulate
def test_simulate_writes_valid_records_and_skips_gpu_parts(tmp_path):
    out = tmp_path / "sim"
    p = _bench(["--simulate", "--out", str(out), "--no-progress", "--fractions", "0,0.5", "--backends", "host-vmm"])
    assert p.returncode == 0, p.stdout + p.stderr
    for name in meta.BENCHMARKS:
        rec = json.loads((out / f"{name}.json").read_text())
        assert meta.validate_record(rec) == [], name
        assert rec["simulated"] is True
        assert rec["command"].startswith("python -m cxlalloc bench --simulate")
        assert rec["date_utc"].endswith("Z")
        hw, sw = rec["hardware"], rec["software"]
        assert hw["gpu"]["simulated"] is True and hw["gpu"]["available"] is False
        assert "model" in hw["cpu"] and isinstance(hw["numa_nodes"], list)
        for k in ("torch", "transformers", "cxlalloc", "git_commit", "source_digest", "python"):
            assert k in sw
        assert sw["source_digest"] == meta.source_digest(ROOT)
        assert isinstance(rec["parameters"], dict) and rec["parameters"]
    for name in ("ceilings", "rightsizing"):
        rec = json.loads((out / f"{name}.json").read_text())
        assert rec["status"] == "skipped" and rec["results"] == []
        assert "--simulate" in rec["skipped"][0]["reason"]
    alloc = json.loads((out / "allocation.json").read_text())
    assert alloc["status"] == "ok"
    assert any(s["part"] == "gpu" and "--simulate" in s["reason"] for s in alloc["skipped"])
    assert alloc["results"] and all(r["simulated"] for r in alloc["results"])
    assert {r["kind"] for r in alloc["results"]} >= {"cxlalloc", "driver", "throughput"}
    assert all(r["method"].startswith("SIMULATED driver") for r in alloc["results"])
    dec = json.loads((out / "decode.json").read_text())
    assert dec["status"] in ("ok", "partial")
    assert any("SIMULATION" in n for n in dec["notes"])
    assert dec["results"] and all(r["simulated"] and "SIMULATION" in r["method"] for r in dec["results"])
    native = [r for r in dec["results"] if r["variant"] == "native"]
    assert native and native[0]["status"] == "ok" and native[0]["decode_tokens_per_s"] > 0
    try:
        import cxlalloc.hf as hf
        have_wrap = hasattr(hf, "wrap")
    except Exception:
        have_wrap = False
    cxl = [r for r in dec["results"] if r["variant"] in ("cxlalloc", "policy_free")]
    if have_wrap:
        assert cxl and all(r["status"] == "ok" for r in cxl)
        spilled = [r for r in cxl if r["spill"] == 0.5]
        assert spilled and all(r["measured_host_fraction"] > 0.25 for r in spilled)
    else:
        assert not cxl and any("cxlalloc.hf.wrap" in s["reason"] for s in dec["skipped"])


@pytest.mark.parametrize("args, flag, message", [
    (["--models", "llama-1b"], "--models", "llama-1b cannot run with --simulate"),
    (["--models", "tiny,llama-8b"], "--models", "llama-8b cannot run with --simulate"),
    (["--contexts", "100000"], "--contexts/--batches", "more than --simulate runs on a CPU"),
    (["--batches", "64", "--contexts", "512"], "--contexts/--batches", "batch 64 x (context 512 + 8 new tokens)"),
])
def test_simulate_refuses_a_grid_it_cannot_run(tmp_path, args, flag, message):
    """Refused in one line (exit status 2) rather than run something else under the given names."""
    p = _bench(["--simulate", "--out", str(tmp_path), "--only", "decode"] + args)
    assert p.returncode == 2, p.stdout + p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"python -m cxlalloc bench: error: {flag}: ") and message in line, line
    assert not (tmp_path / "decode.json").exists()


def test_simulate_honours_contexts_batches_models_and_records_what_ran(tmp_path):
    p = _bench(["--simulate", "--out", str(tmp_path), "--only", "decode", "--no-progress", "--models", "tiny",
                "--contexts", "64,128", "--batches", "1,2", "--fractions", "0", "--backends", "host-vmm",
                "--new-tokens", "2"], timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads((tmp_path / "decode.json").read_text())
    prm = rec["parameters"]
    assert prm["points"] == [["tiny", 64, 1], ["tiny", 64, 2], ["tiny", 128, 1], ["tiny", 128, 2]]
    assert (prm["models"], prm["contexts"], prm["batches"]) == (["tiny"], [64, 128], [1, 2])
    assert prm["requested"] == {"models": ["tiny"], "contexts": [64, 128], "batches": [1, 2]}
    assert prm["new_tokens"] == 2
    ran = {(r["model"], r["context"], r["batch"]) for r in rec["results"]}
    assert ran == {tuple(x) for x in prm["points"]}
    assert all(r["status"] == "ok" and r["simulated"] for r in rec["results"])
    # Without grid flags: the default simulation point, recorded as such.
    assert decode.grid_points(False, True) == [("tiny", 512, 4)]
    assert decode.effective_grid(decode.grid_points(False, True))["contexts"] == [512]


@pytest.mark.skipif(_has_cuda(), reason="checks the no-GPU path")
def test_without_gpu_the_gpu_benchmarks_are_recorded_as_skipped(tmp_path):
    from cxlalloc_apps.bench import cli

    assert cli.main(["--out", str(tmp_path), "--no-progress", "--only", "ceilings,rightsizing,decode"]) == 0
    for name in ("ceilings", "rightsizing", "decode"):
        rec = json.loads((tmp_path / f"{name}.json").read_text())
        assert meta.validate_record(rec) == []
        assert rec["status"] == "skipped" and rec["simulated"] is False
        assert rec["skipped"][0]["reason"].startswith("no GPU run")


def test_bad_benchmark_name_is_a_usage_error(tmp_path):
    p = _bench(["--out", str(tmp_path), "--only", "nonsense"])
    assert p.returncode == 2 and "unknown benchmark" in p.stderr


@pytest.mark.parametrize("args,message", [
    (["--fractions", "nan"], "nan is not a finite number"),
    (["--fractions", "0.5,inf"], "inf is not a finite number"),
    (["--new-tokens", "-1"], "-1 is below 2"),
    (["--new-tokens", "1"], "1 is below 2"),
    (["--time-budget", "0"], "--time-budget: 0.0 must be a positive number of seconds"),
    (["--ceiling-bytes", "100"], "--ceiling-bytes: 100 is below 1 MiB"),
    (["--parts", "insert,warp"], "'warp' is not one of ttft, concurrency"),
    (["--engine-groups", "lmcache_mp,warp"], "'warp' is not one of lmcache, lmcache_mp, vllm_tier"),
    (["--prefixes", "1024,9000"], "9000 is outside [256, 7936]"),
    (["--prefixes", "1000"], "--prefixes: 1000 not a multiple of 256 tokens"),
])
def test_bad_bench_arguments_are_usage_errors(tmp_path, args, message):
    p = _bench(["--simulate", "--out", str(tmp_path), "--only", "allocation"] + args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "allocation.json").exists()


def test_parts_option_names_every_part_of_the_kv_benchmarks():
    from cxlalloc_apps.bench import kvserver, kvspeed
    from cxlalloc_apps.bench.cli import PART_NAMES

    assert sorted(PART_NAMES) == sorted(list(kvserver.PARTS) + list(kvspeed.PARTS))


def test_engine_groups_option_names_every_group_of_the_engines_benchmark():
    from cxlalloc_apps.bench import engines
    from cxlalloc_apps.bench.cli import ENGINE_GROUPS

    assert ENGINE_GROUPS == tuple(g for g, _ in engines.GROUPS)


def test_engines_mp_servers_run_the_docs_line_with_lmcaches_l1_in_shared_memory():
    """The bench's lmcache servers run docs/engines.md section 5b's line (the same options), with ``--shm-name``:
    without it LMCache 0.5.6 pickles every retrieve for vLLM's CPU worker through its message queue (0.4-1.3 s of a
    4,096-token hit, L1 or L2, on 2 cores; with it the worker reads LMCache's L1 in place)."""
    from cxlalloc_apps.bench import engines
    from tests.engines.test_vllm_lmcache_mp import docs_mp_server_args

    docs = docs_mp_server_args("{}", 5556, 5557)
    bench = engines.mp_server_args("/tmp/kv.sock", 5556, 5557, "cxlalloc_engb_a")
    assert sorted(a for a in bench if a.startswith("--")) == sorted(a for a in docs if a.startswith("--"))
    assert bench[bench.index("--shm-name") + 1] == "cxlalloc_engb_a"
    assert json.loads(bench[bench.index("--l2-adapter") + 1])["adapter_params"] == {"url": "cxlalloc:///tmp/kv.sock"}


def test_parts_of_another_benchmark_only_are_a_recorded_skip(tmp_path):
    p = _bench(["--simulate", "--out", str(tmp_path), "--only", "kvserver", "--parts", "insert", "--no-progress"])
    assert p.returncode == 0, p.stderr
    with open(tmp_path / "kvserver.json") as f:
        rec = json.load(f)
    assert rec["results"] == [] and rec["parameters"]["parts"] == []
    assert rec["skipped"] == [{"part": "kvserver", "reason": "--parts names none of its parts "
                                                             "(ttft, concurrency, redis, crash)"}]


def test_unwritable_out_folder_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = _bench(["--simulate", "--out", str(blocker / "sub"), "--only", "allocation"])
    assert p.returncode == 2 and "--out: cannot write to" in p.stderr and "Traceback" not in p.stderr, p.stderr


# ----------------------------------------------------------------- gpu_check.sh
def test_gpu_check_dry_run_lists_every_step(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stdout.splitlines() if l[:3].strip().rstrip(".").isdigit()]
    assert [l.split()[1] for l in lines] == list(STEPS)
    text = p.stdout
    assert "pytest -m gpu -q" in text and "--timeout=" in text
    assert "python3 -m cxlalloc info --json" in text or "-m cxlalloc info --json" in text
    assert "--only decode" in text and "--quick" in text
    assert "cxlalloc_apps.bench.report" in text
    assert "-m cxlalloc.plan.check" in text and "plan_check.json" in text
    assert "results.tar.gz" in text and "summary.json" in text and "log.txt" in text
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    p2 = subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True, text=True)
    assert p2.returncode == 0, p2.stderr


def test_gpu_check_rejects_unknown_arguments():
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--bogus"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unknown argument" in p.stderr


# ----------------------------------------------------------------- managed-memory guard
def test_managed_guard_refuses_over_budget_grid():
    free = 10 * GiB
    assert guard.managed_cap(free) == 5 * GiB
    assert guard.managed_request("managed", kv_bytes=2 * GiB, host_limit=3 * GiB) == 5 * GiB
    assert guard.managed_request("auto", kv_bytes=GiB, host_limit=GiB) == 2 * GiB
    assert guard.managed_request("host-vmm", kv_bytes=GiB, host_limit=GiB) == 0
    guard.check_managed(5 * GiB, free)  # exactly half: allowed
    with pytest.raises(guard.ManagedMemoryGuardError, match="half of the card's free memory"):
        guard.check_managed(5 * GiB + 1, free)
    # A real grid: at 40 GiB free, the 32k x 64 point's managed request is far over the 20 GiB cap.
    pts = [("llama-1b", 32768, 64), ("llama-1b", 4096, 1)]
    groups = decode.plan(pts, (0.0, 0.5), ("host-vmm", "managed"), 16)
    cells = [c for g in groups.values() for c in g["cells"]]
    with pytest.raises(guard.ManagedMemoryGuardError, match="grid is refused"):
        guard.check_grid(cells, 40 * GiB)
    ok, refused = guard.split_grid(cells, 40 * GiB)
    assert refused and all(c["backend"] == "managed" for c in refused)
    assert all("managed-memory guard" in c["refused"] for c in refused)
    assert all(c["managed_bytes"] <= 20 * GiB for c in ok)
    assert any(c["backend"] == "host-vmm" and c["context"] == 32768 for c in ok)  # host-vmm requests no managed memory
    # The host tier's limit is per worker process (the largest cell's KV + margin), so a grid of only the small
    # point passes.
    small = [c for g in decode.plan(pts[1:], (0.0, 0.5), ("managed",), 16).values() for c in g["cells"]]
    assert guard.check_grid(small, 40 * GiB) == small


def test_worker_refuses_a_managed_cell_over_the_cap():
    from cxlalloc_apps.bench.worker import Worker

    w = Worker({"cells": [], "free_bytes_at_start": 8 * GiB}, None)
    assert w._guard({"id": "x", "managed_bytes": 0}) is None
    assert w._guard({"id": "x", "managed_bytes": 4 * GiB}) is None
    assert "managed-memory guard" in w._guard({"id": "x", "managed_bytes": 4 * GiB + 1})
    w2 = Worker({"cells": [], "free_bytes_at_start": None}, None)
    assert "unknown" in w2._guard({"id": "x", "managed_bytes": 1})


# ----------------------------------------------------------------- model, plan, analysis
def test_ceiling_model_and_budgets():
    s = SHAPES["llama-1b"]
    assert 1.0e9 < s.params() < 1.3e9
    assert s.kv_bytes_per_token() == 2 * 16 * 8 * 64 * 2
    w, kv = 2 * 10**9, 2 * 10**9
    # No spill: (w + kv) bytes at 1000 GB/s -> 4 ms per step -> 250 steps/s x batch 4.
    assert ceiling_tokens_per_s(4, w, kv, 0.0, 1000.0, None) == pytest.approx(1000.0)
    # Half on the host at 50 GB/s: 3 ms + 20 ms per step.
    assert ceiling_tokens_per_s(4, w, kv, 0.5, 1000.0, 50.0) == pytest.approx(4 / 0.023)
    assert ceiling_tokens_per_s(4, w, kv, 0.5, 1000.0, None) is None
    assert decode.budget_from_peak(10 * GiB, 4 * GiB, 0.25) == 10 * GiB + decode.BUDGET_SLACK - GiB
    pts = decode.grid_points(True, False)
    assert {c for _, c, _ in pts} == {4096, 32768}
    groups = decode.plan(pts, decode.FRACTIONS, decode.BACKENDS, 12)
    assert list(groups)[0] == "native" and "policy_free:host-vmm" in groups
    variants = {c["variant"] for g in groups.values() for c in g["cells"]}
    assert variants == {"native", "native_limit", "hf_offloaded", "policy_free", "cxlalloc"}
    assert groups["policy_free:host-vmm"]["options"].get("policy") == "first-fit" or \
        groups["policy_free:host-vmm"]["options"].get("migration_rate") == 0
    ids = [c["id"] for g in groups.values() for c in g["cells"]]
    assert len(ids) == len(set(ids))


def _synthetic_decode_rows():
    rows = []
    for (m, c, b) in (("llama-1b", 4096, 16),):
        kv = SHAPES[m].kv_bytes(b, c + 12)
        base = dict(model=m, context=c, batch=b, new_tokens=12, kv_final_bytes=kv, status="ok", backend=None,
                    method="synthetic", simulated=False)
        rows.append(dict(base, id="n", variant="native", spill=0.0, decode_tokens_per_s=900.0, ttft_s=0.3,
                         peak_reserved_bytes=6 * GiB, tokens_digest="aa"))
        rows.append(dict(base, id="o", variant="hf_offloaded", spill=0.75, decode_tokens_per_s=120.0, ttft_s=0.9))
        for f, tps in ((0.0, 880.0), (0.25, 600.0), (0.5, 420.0), (0.75, 300.0)):
            tl = [{"put": i, "device_bytes": 4 * GiB, "host_bytes": int(f * kv), "kv_device_bytes": int((1 - f) * kv),
                   "kv_host_bytes": int(f * kv)} for i in range(4)]
            rows.append(dict(base, id=f"c{f}", variant="cxlalloc", backend="host-vmm", spill=f,
                             decode_tokens_per_s=tps, ttft_s=0.4, measured_host_fraction=f, timeline=tl,
                             tokens_digest="aa"))
            if f:
                rows.append(dict(base, id=f"p{f}", variant="policy_free", backend="host-vmm", spill=f,
                                 decode_tokens_per_s=tps * 0.8, measured_host_fraction=f))
                rows.append(dict(base, id=f"l{f}", variant="native_limit", spill=f, status="oom",
                                 error="torch.OutOfMemoryError: CUDA out of memory"))
    return rows


def test_record_status_is_judged_by_its_rows(tmp_path):
    def status(*row_statuses):
        w = meta.RecordWriter(str(tmp_path), meta.new_record("decode", {}, simulated=False, argv=[]))
        w.record["summary"] = {}
        for i, st in enumerate(row_statuses):
            w.add({"id": str(i), "status": st, "method": "synthetic"})
        return w.finish(w.status_from_rows()), w.record["summary"]["row_status_counts"]

    assert status("error", "error")[0]["status"] == "error"           # no ok row: never "ok"
    assert status("not_run", "oom")[0]["status"] == "error"
    assert status("ok", "not_run")[0]["status"] == "partial"          # killed or out of time
    assert status("ok", "error")[0]["status"] == "partial"
    rec, counts = status("ok", "oom", "refused")                        # measured OOM, guard refusal
    assert rec["status"] == "ok" and counts == {"ok": 1, "oom": 1, "refused": 1}


def test_rightsizing_capacity_only_from_a_memory_stop():
    def rows(variant, statuses):
        return [{"variant": variant, "batch": b, "status": st, "decode_tokens_per_s": 10.0 * b}
                for b, st in zip((4, 8, 16, 32), statuses)]

    lb = rightsizing.largest_batch
    assert lb(rows("cxlalloc", ["ok", "ok", "oom", "not_run"]), "cxlalloc", [4, 8, 16, 32]) == {
        "largest_batch": 8, "tokens_per_s": 80.0, "mode": None, "stopped_by": "oom", "failed_batch": 16}
    cut = lb(rows("cxlalloc", ["ok", "not_run", "not_run", "not_run"]), "cxlalloc", [4, 8, 16, 32])
    assert cut["stopped_by"] == "time" and cut["largest_batch"] == 4
    assert lb(rows("cxlalloc", ["ok", "ok"]), "cxlalloc", [4, 8, 16, 32])["stopped_by"] == "time"  # worker killed
    assert lb(rows("cxlalloc", ["ok"] * 4), "cxlalloc", [4, 8, 16, 32])["stopped_by"] == "all_ran"
    assert lb(rows("cxlalloc", ["ok", "refused"]), "cxlalloc", [4, 8, 16, 32])["stopped_by"] == "refused"
    assert lb([], "cxlalloc", [4])["stopped_by"] == "none"


def test_native_limit_ceiling_puts_nothing_on_the_host():
    kv = SHAPES["llama-1b"].kv_bytes(16, 4096 + 12)
    base = dict(model="llama-1b", context=4096, batch=16, new_tokens=12, kv_final_bytes=kv, status="ok",
                backend=None, method="synthetic", decode_tokens_per_s=500.0)
    rows = [dict(base, id="n", variant="native", spill=0.0),
            dict(base, id="l", variant="native_limit", spill=0.5),   # fit after all: plain torch spills nothing
            dict(base, id="c", variant="cxlalloc", backend="host-vmm", spill=0.5)]
    ceil = {"hbm_read_gbps": 3500.0, "link": {"host-vmm": {"zero_copy_read_gbps": 45.0}}}
    decode.analyse(rows, ceil)
    by = {r["id"]: r for r in rows}
    assert by["l"]["ceiling_host_fraction"] == 0.0 and by["c"]["ceiling_host_fraction"] == 0.5
    assert by["l"]["ceiling_tokens_per_s"] == by["n"]["ceiling_tokens_per_s"] > by["c"]["ceiling_tokens_per_s"]


def _gpu_record(name, results, summary, tmpdir):
    rec = meta.new_record(name, {"synthetic": True}, simulated=False, argv=["--quick"])
    rec["hardware"]["gpu"] = {"available": True, "simulated": False, "name": "Synthetic GPU", "driver_version": "0"}
    rec["results"] = results
    rec["summary"] = summary
    rec["status"] = "ok"
    meta.write_json(os.path.join(tmpdir, f"{name}.json"), rec)
    return rec


def test_report_builds_plots_and_readme_table_from_synthetic_records(tmp_path):
    res = tmp_path / "results" / "run1"
    res.mkdir(parents=True)
    ceil = {"hbm_read_gbps": 3500.0, "device_copy_gbps": 4200.0, "torch_pinned_h2d_gbps": 50.0,
            "torch_pinned_d2h_gbps": 52.0,
            "link": {"host-vmm": {"numa_node": 0, "zero_copy_read_gbps": 45.0, "h2d_gbps": 50.0, "d2h_gbps": 51.0}}}
    _gpu_record("ceilings", [{"part": "device_copy", "method": "synthetic", "gbps": 4200.0}], ceil, str(res))
    rows = _synthetic_decode_rows()
    summary = decode.analyse(rows, ceil)
    _gpu_record("decode", rows, summary, str(res))
    rs_rows = [dict(id=f"r{b}", variant=v, batch=b, status="ok" if (v == "cxlalloc" or b <= 8) else "oom",
                    decode_tokens_per_s=100.0 * b, method="synthetic")
               for v in ("native_limit", "cxlalloc") for b in (4, 8, 16)]
    _gpu_record("rightsizing", rs_rows, {"budget_bytes": 5 * GiB, "native_limit": {"largest_batch": 8,
                "tokens_per_s": 800.0}, "cxlalloc": {"largest_batch": 16, "tokens_per_s": 1600.0},
                "batch_ratio": 2.0, "tokens_per_s_ratio": 2.0}, str(res))
    _gpu_record("allocation", [{"kind": "driver", "call": "cuMemAlloc", "bytes": 2 * MiB, "alloc_us": {"median": 50.0},
                                "free_us": {"median": 30.0}, "simulated": False, "method": "synthetic"}], {}, str(res))
    # A simulation record beside them must never reach the table.
    sim = meta.new_record("decode", {}, simulated=True, argv=["--simulate"])
    sim["status"] = "ok"
    sim["results"] = [{"method": "SIMULATION", "decode_tokens_per_s": 12345.0}]
    meta.write_json(str(tmp_path / "results" / "sim" / "decode.json"), sim)
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nintro\n\n<!-- bench:start -->\nold\n<!-- bench:end -->\n\nfooter\n")
    plots = tmp_path / "plots"
    rc = report.main(["--results", str(tmp_path / "results"), "--plots", str(plots), "--readme", str(readme)])
    assert rc == 0
    pngs = sorted(p.name for p in plots.iterdir())
    for name in ("ceilings.png", "rightsizing.png", "allocation.png", "decode_llama-1b_ctx4096_b16.png",
                 "tiers_llama-1b_ctx4096_b16.png"):
        assert name in pngs
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = readme.read_text()
    assert text.startswith("# Project\n\nintro\n") and text.rstrip().endswith("footer")
    assert "old" not in text and text.count("<!-- bench:start -->") == 1
    assert "Synthetic GPU" in text and "pending" not in text.lower().split("### benchmark results")[1][:200]
    assert "12345" not in text  # simulation numbers never appear
    row = next(l for l in text.splitlines() if l.startswith("| llama-1b | 4096 | 16 | 50 %"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4].startswith("420.0")
    assert cells[6] == f"{420.0 / 120.0:.2f}×"  # vs offloaded
    assert cells[7] == "1.25×"  # vs policy-free (0.8x)
    assert cells[9] == "oom"
    assert cells[5].endswith("×")  # vs ceiling, from the synthetic bandwidths


def _sim_decode_record(tps=12345.0):
    rec = meta.new_record("decode", {}, simulated=True, argv=["--simulate"])
    rec["status"] = "ok"
    rows = []
    for f in (0.0, 0.5):
        tl = [{"put": i, "device_bytes": 4 * MiB, "host_bytes": int(f * 8 * MiB), "kv_host_bytes": int(f * 8 * MiB)}
              for i in range(3)]
        rows.append(dict(id=f"c{f}", variant="cxlalloc", backend="host-vmm", model="tiny", context=512, batch=4,
                         new_tokens=8, spill=f, status="ok", decode_tokens_per_s=tps, timeline=tl, simulated=True,
                         method="SIMULATION"))
    rows.append(dict(id="n", variant="native", model="tiny", context=512, batch=4, new_tokens=8, spill=0.0,
                     status="ok", decode_tokens_per_s=tps * 2, simulated=True, method="SIMULATION", timeline=[]))
    rec["results"] = rows
    rec["summary"] = {"simulated": True, "points": []}
    return rec


def _figure_texts(fig):
    out = [t.get_text() for t in fig.texts]
    if fig._suptitle is not None:
        out.append(fig._suptitle.get_text())
    for ax in fig.axes:
        out.append(ax.get_title())
        out += [t.get_text() for t in ax.texts]
    return " | ".join(out)


def _figure_values(fig):
    vals = set()
    for ax in fig.axes:
        for line in ax.get_lines():
            vals.update(float(y) for y in line.get_ydata())
    return vals


def test_report_plots_simulation_records_labelled_and_apart(tmp_path, monkeypatch):
    """Simulation records get their own plots (simulation_*.png), labelled
    SIMULATION; no plot holds both kinds of numbers; the README table and its
    plot links stay GPU-only."""
    res = tmp_path / "results"
    (res / "gpu").mkdir(parents=True)
    rows = _synthetic_decode_rows()
    _gpu_record("decode", rows, decode.analyse(rows, None), str(res / "gpu"))
    meta.write_json(str(res / "sim" / "decode.json"), _sim_decode_record())
    alloc = meta.new_record("allocation", {}, simulated=True, argv=["--simulate"])
    alloc["status"] = "ok"
    alloc["results"] = [{"kind": "cxlalloc", "tier_requested": "device", "backend": "host-vmm", "mode": "cached",
                         "bytes": 2 * MiB, "malloc_us": {"median": 1.5}, "simulated": True, "method": "SIMULATED"}]
    meta.write_json(str(res / "sim" / "allocation.json"), alloc)
    saved = {}
    real_save = report_plots._save

    def save(fig, path, dpi=110):
        saved[os.path.basename(path)] = (_figure_texts(fig), _figure_values(fig))
        return real_save(fig, path, dpi)

    monkeypatch.setattr(report_plots, "_save", save)
    readme = tmp_path / "README.md"
    readme.write_text("# P\n")
    plots = tmp_path / "plots"
    assert report.main(["--results", str(res), "--plots", str(plots), "--readme", str(readme)]) == 0
    names = sorted(p.name for p in plots.iterdir())
    for name in ("simulation_decode_tiny_ctx512_b4.png", "simulation_tiers_tiny_ctx512_b4.png",
                 "simulation_allocation.png", "decode_llama-1b_ctx4096_b16.png"):
        assert name in names, names
    for name, (texts, values) in saved.items():
        if name.startswith("simulation_"):
            assert "SIMULATION" in texts, name
            assert not values & {900.0, 880.0, 600.0, 420.0, 300.0}, f"{name} holds GPU numbers"
        else:
            assert "SIMULATION" not in texts, name
            assert not values & {12345.0, 24690.0}, f"{name} holds simulation numbers"
    assert 12345.0 in saved["simulation_decode_tiny_ctx512_b4.png"][1]
    text = readme.read_text()
    assert "simulation_" not in text and "12345" not in text and "Synthetic GPU" in text


def test_report_says_pending_without_gpu_records(tmp_path):
    (tmp_path / "results").mkdir()
    sim = meta.new_record("decode", {}, simulated=True, argv=["--simulate"])
    sim["status"] = "ok"
    sim["results"] = [{"method": "SIMULATION"}]
    meta.write_json(str(tmp_path / "results" / "decode.json"), sim)
    readme = tmp_path / "README.md"
    readme.write_text("# P\n")
    assert report.main(["--results", str(tmp_path / "results"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "<!-- bench:start -->" in text and "<!-- bench:end -->" in text
    assert "GPU numbers pending" in text
    assert report.main(["--results", str(tmp_path / "results"), "--readme", str(readme)]) == 0
    assert readme.read_text() == text  # idempotent


def test_report_imports_a_gpu_check_tarball(tmp_path):
    work = tmp_path / "work"
    (work / "results").mkdir(parents=True)
    (work / "logs").mkdir()
    rows = _synthetic_decode_rows()
    _gpu_record("decode", rows, decode.analyse(rows, None), str(work / "results"))
    sim = meta.new_record("ceilings", {}, simulated=True, argv=["--simulate"])
    sim["skipped"] = [{"part": "all", "reason": "sim"}]
    sim["status"] = "skipped"
    meta.write_json(str(work / "results" / "ceilings.json"), sim)
    (work / "results" / "info.json").write_text("{}")
    tb = tmp_path / "results.tar.gz"
    with tarfile.open(tb, "w:gz") as tf:
        tf.add(work / "results", arcname="results")
        tf.add(work / "logs", arcname="logs")
    dest = report.import_tarball(str(tb), str(tmp_path / "bench_results"))
    assert dest and sorted(os.listdir(dest)) == ["decode.json", "info.json"]
    assert "synthetic-gpu" in os.path.basename(dest)
    assert meta.validate_record(json.load(open(os.path.join(dest, "decode.json")))) == []


# ----------------------------------------------------------------- worker protocol (CPU)
def test_worker_process_protocol_on_cpu(tmp_path):
    cell = {"variant": "native", "model": "tiny", "context": 32, "batch": 2, "new_tokens": 4, "spill": 0.0,
            "budget_bytes": None, "budget_rule": None, "backend": None, "managed_bytes": 0,
            "cache_implementation": None, "prefill_chunk": 16, "timeline": True, "kv_final_bytes": 1,
            "weight_bytes": 1}
    cells = [dict(cell, id="a"), dict(cell, id="b", model="no-such-model"), dict(cell, id="c"),
             dict(cell, id="d", managed_bytes=1)]
    spec = {"group": "native", "kind": "native", "device": 0, "device_type": "cpu", "deadline_unix": None,
            "free_bytes_at_start": None, "stop_after_failure": False, "cells": cells}
    rows = decode.run_worker(spec, str(tmp_path), timeout_s=120, log=lambda *_: None)
    by = {r["id"]: r for r in rows}
    a = by["a"]
    assert a["status"] == "ok", a
    assert a["ttft_s"] > 0 and a["decode_tokens_per_s"] > 0 and a["decode_steps"] == 3
    assert a["generated_tokens"] == 8 and len(a["tokens_digest"]) == 16 and len(a["timeline"]) == 5
    assert by["b"]["status"] == "error" and "no-such-model" in by["b"]["error"]
    assert by["c"]["status"] == "ok" and by["c"]["tokens_digest"] == a["tokens_digest"]
    assert by["d"]["status"] == "refused" and "managed-memory guard" in by["d"]["reason"]
    assert all(r["group"] == "native" for r in rows)
    # A worker past its deadline starts nothing; one that is killed leaves its unfinished cells as not_run.
    import io

    from cxlalloc_apps.bench.worker import Worker

    buf = io.StringIO()
    Worker(dict(spec, deadline_unix=1.0, cells=[dict(cell, id="z")]), buf).run()
    z = json.loads(buf.getvalue())
    assert z["status"] == "not_run" and "time budget" in z["reason"]
    (k,) = decode.run_worker(dict(spec, cells=[dict(cell, id="k")]), str(tmp_path), timeout_s=0.2,
                             log=lambda *_: None)
    assert k["status"] == "not_run" and "killed" in k["reason"]


# ----------------------------------------------------------------- decode orchestration (GPU path, faked workers)
def test_decode_orchestration_budgets_guard_and_ratios(tmp_path, monkeypatch):
    """decode.run's GPU path with the worker processes replaced by a fake: the
    native group runs first, cxlalloc groups get budgets from its peaks,
    managed cells over the guard are refused, rows reach the record as they
    come, and the summary holds the ratios."""
    from cxlalloc_apps.bench import cli

    specs = []

    def fake_worker(spec, work_dir, timeout_s, log=print):
        specs.append(spec)
        rows = []
        for c in spec["cells"]:
            r = dict(c, group=spec["group"], status="ok", ttft_s=0.5, tokens_digest="x")
            if c["variant"] == "native":
                r.update(decode_tokens_per_s=1000.0, peak_reserved_bytes=8 * GiB)
            elif c["variant"] == "native_limit" and c["spill"] > 0:
                r.update(status="oom", error="torch.OutOfMemoryError: CUDA out of memory")
            elif c["variant"] == "hf_offloaded":
                r.update(decode_tokens_per_s=100.0)
            else:
                r.update(decode_tokens_per_s=1000.0 * (1 - c["spill"]) + 50, measured_host_fraction=c["spill"])
            rows.append(r)
        return rows

    monkeypatch.setattr(decode, "run_worker", fake_worker)
    monkeypatch.setattr(decode, "gpu_free_bytes", lambda device=0: 40 * GiB)
    ceil = {"hbm_read_gbps": 3000.0, "link": {"host-vmm": {"zero_copy_read_gbps": 40.0},
                                              "pinned": {"zero_copy_read_gbps": 30.0}}}
    monkeypatch.setattr(decode, "load_ceilings", lambda out_dir: ceil)
    args = cli.make_parser().parse_args(["--quick", "--out", str(tmp_path), "--contexts", "4096,32768",
                                         "--batches", "16"])
    ctx = cli.BenchContext(args, ["--quick"])
    monkeypatch.setattr(ctx, "gpu_ready", lambda: (True, ""))
    rec = decode.run(ctx)
    assert meta.validate_record(rec) == []
    assert [s["group"] for s in specs][0] == "native"
    by_group = {s["group"]: s for s in specs}
    assert set(by_group) >= {"native", "cxlalloc:host-vmm", "policy_free:host-vmm", "cxlalloc:pinned"}
    cx = by_group["cxlalloc:host-vmm"]
    for c in cx["cells"]:
        assert c["budget_rule"] == "native_peak"
        assert c["budget_bytes"] == decode.budget_from_peak(8 * GiB, c["kv_final_bytes"], c["spill"])
    assert cx["cxlalloc_options"]["device_limit"] == cx["cells"][0]["budget_bytes"]
    assert cx["cxlalloc_options"]["host_limit"] >= max(c["kv_final_bytes"] for c in cx["cells"])
    assert by_group["policy_free:host-vmm"]["cxlalloc_options"].get("policy") == "first-fit" or \
        by_group["policy_free:host-vmm"]["cxlalloc_options"].get("migration_rate") == 0
    # 40 GiB free -> 20 GiB managed cap: the 32k x 16 point's managed cells (16 GiB KV + host limit) are refused.
    refused = [r for r in rec["results"] if r["status"] == "refused"]
    assert refused and all(r["backend"] == "managed" for r in refused)
    assert all("managed-memory guard" in r["reason"] for r in refused)
    assert all(c["managed_bytes"] <= 20 * GiB for c in by_group.get("cxlalloc:managed", {"cells": []})["cells"])
    pts = rec["summary"]["points"]
    e = next(p for p in pts if p["context"] == 4096 and p["spill"] == 0.5)
    assert e["best_cxlalloc"]["backend"] == "host-vmm"
    assert e["cxlalloc_vs_offloaded"] == pytest.approx(550.0 / 100.0)
    assert e["cxlalloc_vs_policy_free"] == pytest.approx(1.0)
    assert e["cxlalloc_vs_native"] == pytest.approx(0.55)
    assert 0 < e["cxlalloc_vs_ceiling"] < 10
    assert e["native_limit"]["status"] == "oom"
    on_disk = json.loads((tmp_path / "decode.json").read_text())
    assert on_disk["status"] == "ok" and len(on_disk["results"]) == len(rec["results"])


def test_bench_switches_off_transformers_progress_bars(tmp_path, monkeypatch):
    """The bench reports its own progress: transformers' GGUF de-quantization bar
    (plain tqdm) must not redraw into a log."""
    import functools

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from cxlalloc_apps.bench import cli

    monkeypatch.setattr(gguf_utils, "tqdm", gguf_utils.tqdm if not isinstance(gguf_utils.tqdm, functools.partial)
                        else gguf_utils.tqdm.func)
    assert cli.main(["--out", str(tmp_path), "--no-progress", "--only", "ceilings"]) == 0
    assert isinstance(gguf_utils.tqdm, functools.partial) and gguf_utils.tqdm.keywords == {"disable": True}


def test_reuse_bench_records_hit_vs_recompute_and_the_bound(tmp_path, monkeypatch):
    """`bench --simulate --only reuse` on a tiny model: every prefix row hits the
    whole document, loads exactly its KV bytes, and carries the bound
    prefill / (prefix bytes / link GB/s) computed from the same run."""
    import torch
    from cxlalloc_apps.bench import cli, reuse
    from cxlalloc_apps.bench.model import SHAPES, build_model

    monkeypatch.setattr(reuse, "_cpu_model", lambda: (build_model(SHAPES["tiny"], device="cpu", dtype=torch.float32),
                                                      "tiny (fp32, random weights)"))
    monkeypatch.setattr(reuse, "BLOCK_SWEEP", (32, 64))
    assert cli.main(["--simulate", "--only", "reuse", "--quick", "--contexts", "128,256", "--out", str(tmp_path),
                     "--no-progress"]) == 0
    rec = json.loads((tmp_path / "reuse.json").read_text())
    assert meta.validate_record(rec) == [] and rec["status"] == "ok" and rec["simulated"] is True
    from cxlalloc_apps.bench.model import llama_config

    cfg = llama_config(SHAPES["tiny"], 65536)
    row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    ttft = {r["prefix_tokens"]: r for r in rec["results"] if r.get("kind") == "ttft"}
    assert sorted(ttft) == [128, 256]
    for P, r in ttft.items():
        assert r["hit_tokens"] == P and r["bytes_loaded"] == P * row == P * r["kv_bytes_per_token"]
        assert len(r["recompute_samples_ms"]) == len(r["hit_samples_ms"]) == 3
        # the method: arms in a rotated order, the speed-up a ratio per round (never a ratio of medians)
        assert r["orders"] == [["hit", "recompute"], ["recompute", "hit"], ["hit", "recompute"]]
        per_round = [a / b for a, b in zip(r["recompute_samples_ms"], r["hit_samples_ms"])]
        assert r["speedup"] == pytest.approx(statistics.median(per_round))
        assert r["speedup_spread"]["n"] == 3 and r["speedup_spread"]["min"] == pytest.approx(min(per_round), abs=1e-3)
        assert r["hit_ttft_ms"] == pytest.approx(statistics.median(r["hit_samples_ms"]))
        assert set(r["load_before"]) == {"loadavg_1m", "loadavg_5m", "cpus"}
        assert r["bound_speedup"] == pytest.approx(r["recompute_ttft_ms"] * 1e-3 / (r["bytes_loaded"]
                                                                                 / (r["link_gbps"] * 1e9)))
    sweep = {r["block_tokens"]: r for r in rec["results"] if r.get("kind") == "block_sweep"}
    assert sorted(sweep) == [32, 64] and all(r["hit_tokens"] == 128 for r in sweep.values())
    assert all(len(r["hit_samples_ms"]) == 3 and r["hit_ttft_spread_ms"]["n"] == 3 for r in sweep.values())
    assert rec["parameters"]["rounds"] == 3 and any("smoke run" in n for n in rec["notes"])


def test_report_writes_the_cpu_section_from_the_kv_reuse_records(tmp_path):
    """The CPU results of benchmarks/README.md come from the committed reuse and
    kvserver records, labelled simulation/CPU, between their own markers; a
    page without those markers gets no CPU section."""
    results = os.path.join(ROOT, "benchmarks", "results")
    page = tmp_path / "page.md"
    page.write_text("intro\n\n<!-- bench-cpu:start -->\nold\n<!-- bench-cpu:end -->\n\nfooter\n")
    plain = tmp_path / "plain.md"
    plain.write_text("intro\n")
    for target in (page, plain):
        assert report.main(["--results", results, "--plots", str(tmp_path / "plots"), "--readme", str(target)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n") and "<!-- bench-cpu:end -->\n\nfooter\n" in text and "\nold\n" not in text
    cpu = text.split("<!-- bench-cpu:start -->")[1].split("<!-- bench-cpu:end -->")[0]
    assert "**Simulation/CPU**" in cpu
    # the reuse record of 2026-12-03 (method.py): medians with their IQR, per-round speed-ups, the load
    assert ("| TTFT recompute | 6,252 ms (4,140-6,546) | 8,724 ms (5,842-8,916) | 7,164 ms (6,070-9,183) | "
            "11,400 ms (11,014-12,207) |") in cpu
    assert "| TTFT hit | 1,570 ms (1,289-2,468) | 2,562 ms (2,232-2,574) | 1,267 ms (1,255-2,090) |" in cpu
    assert "| 4.8x (IQR 3.9-5.7; bound 505x) |" in cpu and "load average (1 min) 5.1-7.9 on 2 CPUs" in cpu
    assert "**0.070 s** with the hit vs **1.016 s** recomputing (14.5x)" in cpu
    assert "| kill -9 of 1 of 4 writers mid-insert | 11,064 committed blocks logged, 0 missing, 0 torn" in cpu
    assert "<!-- bench-cpu:start -->" not in plain.read_text()
    assert "GPU numbers pending" in plain.read_text()


def test_lmcache_bench_chunk_shapes_have_the_sizes_it_reports():
    import math

    from cxlalloc_apps.bench import lmcache as lb

    for nbytes in lb.SIZES:
        layers, kv, tokens, heads, dim = lb._shape(nbytes)
        assert (kv, tokens, dim) == (2, lb.TOKENS, 128) and heads in (2, 4, 8)
        assert math.prod((layers, kv, tokens, heads, dim)) * 2 == nbytes  # bf16
    assert "lmcache" in meta.OPT_IN


def test_kvfair_runs_only_when_named_and_its_record_interleaves_arms_and_plots(tmp_path):
    from cxlalloc_apps.bench import kvfair

    assert "kvfair" in meta.OPT_IN and "kvfair" not in meta.BENCHMARKS
    with open(os.path.join(meta.REPO_ROOT, "benchmarks/results/kvfair-cpu-2026-12-03/kvfair.json")) as f:
        rec = json.load(f)
    assert meta.validate_record(rec) == []
    fair = next(r for r in rec["results"] if r["part"] == "fair")
    assert fair["rounds"] >= 5 and set(fair["p99_ms"]) == set(kvfair.ARMS)
    assert all(len(v) == fair["rounds"] for v in fair["p99_ms"].values())
    assert [o[0] for o in fair["orders"][:3]] != [fair["orders"][0][0]] * 3  # rotated, not always one arm first
    assert {"attacker/quiet", "attacker/control"} <= set(fair["p99_ratio"])
    disc = next(r for r in rec["results"] if r["part"] == "disconnect")
    assert all(d["pins"] == 65536 and d["blocks"] == 65536 for d in disc["reps"])
    out = tmp_path / "kvfair.png"
    kvfair.plot(rec, str(out))
    assert out.stat().st_size > 10_000


def test_kvscale_runs_only_when_named_and_its_record_plots(tmp_path):
    from cxlalloc_apps.bench import kvscale

    assert "kvscale" in meta.OPT_IN and "kvscale" not in meta.BENCHMARKS
    assert kvscale.run is kvscale.run_scale
    assert kvscale.SCALE_SIZES == (10_000, 100_000, 1_000_000)
    with open(os.path.join(meta.REPO_ROOT, "benchmarks/results/kvscale-cpu-2026-12-02/kvscale.json")) as f:
        rec = json.load(f)
    assert meta.validate_record(rec) == []
    assert [r["blocks"] for r in rec["results"]] == [10_000, 100_000, 1_000_000]
    out = tmp_path / "kvscale.png"
    kvscale.plot_scale(rec, str(out))
    assert out.stat().st_size > 10_000


def test_cb_bench_records_every_variant_side_by_side(tmp_path, monkeypatch):
    """`bench --simulate --only cb` on a small stream: all six arms answer
    every request with plain continuous batching's tokens; the wrapped ones run
    on the tiers (KV on the host tier under the budget), the store variant loads
    the documents back after a restart (probe), and the summary has the per-round
    ratios (method.py), a verdict per goal and the machine's load."""
    from cxlalloc_apps.bench import cb, cli, method

    small = cb.Workload(documents=2, doc_tokens=256, question_tokens=8, new_tokens=4, rag=3, chats=1, page=32,
                        budget_blocks=12, max_batch_tokens=256)
    monkeypatch.setattr(cb, "QUICK", small)
    assert cli.main(["--simulate", "--only", "cb", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    rec = json.loads((tmp_path / "cb.json").read_text())
    assert meta.validate_record(rec) == [] and rec["status"] == "ok", rec["errors"]
    rows = {r["variant"]: r for r in rec["results"] if r["kind"] == "round"}
    assert list(rows) == [a[0] for a in cb.ARMS]  # one round: the arms in their listed order
    s = rec["summary"]
    assert s["all_tokens_identical"] is True and sorted(s["variants"]) == sorted(rows), s
    assert all(r["requests"] == 3 + 2 * 1 and r["generated_tokens"] == 5 * 4 for r in rows.values())
    assert rows["plain"]["num_blocks"] == 12 and rows["wrapped"]["num_blocks"] == 4 * 12
    assert rows["plain same blocks"]["num_blocks"] == rows["wrapped"]["num_blocks"]
    for name in ("wrapped", "wrapped+store"):
        assert rows[name]["tiered"] is True and rows[name]["cxlalloc"]["peak_kv_host_bytes"] > 0
    store = rows["wrapped+store"]["cxlalloc"]
    # the probe's fresh manager finds every document the stream asked about in the store (256 tokens each)
    asked = {r["doc"] for r in cb.make_stream(small, 1000)[1]}
    assert store["store_hit_tokens"] >= 256 * len(asked) and store["reprefills_avoided"] >= len(asked)
    assert len(rows["plain"]["probe_ttft_ms"]) == len(rows["wrapped+store"]["probe_ttft_ms"]) == 2
    assert rows["wrapped no-spill"]["cxlalloc"]["peak_kv_host_bytes"] == 0  # nothing spills at the larger budget
    for k in ("in_flight_ratio_wrapped_vs_plain", "probe_ttft_ratio_store_vs_plain", "no_spill_overhead",
              "throughput_ratio_wrapped_vs_plain_same_blocks", "throughput_ratio_no_spill"):
        assert isinstance(s[k], float), k
    tps = s["comparison"]["tokens_per_s"]
    for a, b in cb.RATIOS:  # one round: the ratio is that round's quotient
        want = rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
        assert tps["ratios"][f"{a}/{b}"]["median"] == pytest.approx(want, rel=1e-3)
    assert [g["verdict"] in method.VERDICTS for g in s["goals"]] == [True] * len(cb.GOALS)
    assert s["load_before"]["cpus"] >= 1 and rec["parameters"]["torch_threads"] == cb.CPU_THREADS
    assert any("smoke run" in n for n in rec["notes"])
    assert (tmp_path / "cb.png").stat().st_size > 0


def _kvspeed_compared(part, ref, goal):
    """A chat/prefix result as kvspeed writes it, from method.interleave over arms with known values
    (wrapped 0.9x the reference in every round)."""
    from cxlalloc_apps.bench import method

    cmp = method.interleave({ref: lambda: 10.0, "wrapped_kv_store": lambda: 9.0}, 5)
    r = cmp.ratio("wrapped_kv_store", ref)
    return {"part": part, "comparison": cmp.as_dict([("wrapped_kv_store", ref)]),
            "goal": method.goal_record(part, r, goal)}


def test_kvspeed_is_opt_in_and_plots_its_ratios(tmp_path):
    from cxlalloc_apps.bench import kvspeed as ks

    assert "kvspeed" in meta.OPT_IN and set(ks.PARTS) == {"lookup", "insert", "chat", "prefix"}
    def spread(m):  # a ratio as the method records it (cxlalloc_apps/bench/method.py)
        return {"n": 5, "median": m, "q1": m - 0.05, "q3": m + 0.05, "min": m - 0.1, "max": m + 0.1}

    rec = {"simulated": True, "results": [
        *({"part": "lookup", "clients": c, "keys": n, "redis_parser": "hiredis",
           "ratio_kvserver_over_redis": spread(1.0 + c / 10 + n / 1000),
           "ratio_kvserver_over_redis_python_parser": spread(1.2 + c / 10)}
          for c in ks.LOOKUP_CLIENTS for n in ks.LOOKUP_KEYS),
        *({"part": "insert", "block_bytes": b, "ratio_insert_over_memcpy": spread(0.5),
           "ratio_insert_commit_waited_over_memcpy": spread(0.4),
           "ratio_one_per_reservation_over_memcpy": spread(0.1)} for b in (64 << 10, 1 << 20)),
        *(_kvspeed_compared(part, ref, goal) for part, ref, goal in (
            ("chat", "by_hand_dynamic_cache", ks.CHAT_GOAL), ("prefix", "deepcopy_recipe", ks.PREFIX_GOAL)))]}
    chat = rec["results"][-2]
    assert chat["goal"]["verdict"] == "met" and chat["comparison"]["ratios"]["wrapped_kv_store/" + "by_hand_dynamic_cache"][
        "median"] == 0.9
    for r in rec["results"][-2:]:
        r["noise_floor_ratio"] = {"q1": 0.99, "q3": 1.01}
    table = ks.markdown(rec)
    assert "| chat | `wrapped_kv_store/by_hand_dynamic_cache` | **0.900x** | 0.900-0.900 |" in table
    assert table.count("| met |") == 2 and ks.markdown({"results": []}) == ""
    out = ks.plot(rec, str(tmp_path / "kvspeed.png"))
    assert out and os.path.getsize(out) > 10_000
    assert ks.plot({"results": []}, str(tmp_path / "none.png")) is None
    assert ks.plot({"results": rec["results"][-2:]}, str(tmp_path / "chat-prefix.png"))  # --parts chat,prefix


def test_kvspeed_insert_table_is_generated_from_the_record():
    """benchmarks/README.md's insert table is kvspeed.insert_markdown(record): its figures are the record's."""
    from cxlalloc_apps.bench import kvspeed as ks

    path = os.path.join(ROOT, "benchmarks", "results", "kvspeed-insert-cpu-2026-12-03", "kvspeed.json")
    with open(path) as f:
        rec = json.load(f)
    table = ks.insert_markdown(rec)
    assert "| 64 x 64 KiB (memcpy 0.497 ms, insert 1.977 ms a batch) | **0.297x** (IQR 0.198-0.316, n=25) (≥ 0.6) |" \
        in table
    assert table.count("\n") == 4 and "| missed |" in table and "| within noise |" in table
    assert ks.insert_markdown({"results": [r for r in rec["results"] if r.get("part") != "insert"]}) == ""
    # a record with the reserve-ahead arms (2026-12-03c on) gets their columns; the figures are still the record's
    path = os.path.join(ROOT, "benchmarks", "results", "kvspeed-insert-cpu-2026-12-03c", "kvspeed.json")
    with open(path) as f:
        rec = json.load(f)
    table = ks.insert_markdown(rec)
    assert "| reserve ahead + streaming write (goal) | each reserve waited + copy_ (before) |" in table
    r = rec["results"][0]["ratio_insert_reserve_waited_over_memcpy"]
    assert f"| **{r['median']:.3f}x** (IQR {r['q1']:.3f}-{r['q3']:.3f}, n=25) |" in table
    assert table.count("\n") == 4 and table.splitlines()[1].count("---") == 11
    # the quiet-machine runs (2026-12-03e): every row of benchmarks/README.md's tables is the record's markdown
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    folder = os.path.join(ROOT, "benchmarks", "results", "kvspeed-insert-cpu-2026-12-03e")
    for name in ("kvspeed.json", "kvspeed-run-2.json", "kvspeed-run-3.json", "kvspeed-run-4.json"):
        with open(os.path.join(folder, name)) as f:
            rec = json.load(f)
        rows = ks.insert_markdown(rec).strip().splitlines()[2:]
        assert len(rows) == 2 and all(row in readme for row in rows), name
        assert [r["goal"]["verdict"] for r in rec["results"] if r.get("part") == "insert"] == ["met", "met"], name


def test_engines_runs_only_when_named_and_says_why_it_skips(tmp_path):
    """``bench --only engines`` (vLLM's TTFT, six arms) without the engine venv: a skipped record naming
    scripts/install_engines.sh, never a silent nothing."""
    assert "engines" in meta.OPT_IN and "engines" not in meta.BENCHMARKS
    env = child_env(hide_gpus=False, keep_cxlalloc=False, unbuffered=True)
    env["CXLALLOC_ENGINES_VENV"] = str(tmp_path / "no-venv")
    p = subprocess.run([sys.executable, "-m", "cxlalloc", "bench", "--only", "engines", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    with open(tmp_path / "engines.json") as f:
        rec = json.load(f)
    assert meta.validate_record(rec) == [] and rec["status"] == "skipped"
    assert "scripts/install_engines.sh" in rec["skipped"][0]["reason"]


ENGINES_RECORD = "benchmarks/results/engines-cpu-2026-12-03b/engines.json"


def test_engines_record_is_on_the_method_and_the_docs_tables_are_its_markdown(tmp_path):
    """The shipped engines record (docs/engines.md's and benchmarks/README.md's table): every group at every prefix
    size on >= 5 timed rounds of the method, a verdict per pool arm, every request that made a comparison got the
    cached tokens its arm must (the whole prefix, none for no_cache); the tables are ``engines.markdown(record)``
    and the record plots."""
    from cxlalloc_apps.bench import engines as eng
    from cxlalloc_apps.bench.method import MIN_ROUNDS
    from cxlalloc_apps.bench.plots import plot_engines

    with open(os.path.join(ROOT, ENGINES_RECORD)) as f:
        rec = json.load(f)
    assert meta.validate_record(rec) == [] and rec["parameters"]["quick"] is False
    comps = [r for r in rec["results"] if r["kind"] == "comparison"]
    assert {(r["group"], r["prefix_tokens"]) for r in comps} == {(g, s) for g, _ in eng.GROUPS for s in eng.SIZES}
    for r in comps:
        if "comparison" not in r:   # the one cell that failed (docs/engines.md says why): no usable round
            assert (r["group"], r["prefix_tokens"], r["status"]) == ("lmcache_mp", 7936, "error"), r
            continue
        assert r["comparison"]["rounds"] >= MIN_ROUNDS and len(r["round_loads"]) >= MIN_ROUNDS, r["group"]
        assert {g["verdict"] for g in r["goals"]} <= {"met", "missed", "within noise"} and len(r["goals"]) == 1
    reqs = [r for r in rec["results"] if r["kind"] == "request"]
    assert {r["arm"] for r in reqs} == set(eng.ARMS)
    # every request got the cached tokens its arm must (the whole prefix; none for no_cache), but B's of MP mode
    # at 7,936 tokens, which found nothing (process A's MP server could not allocate the prefix in its L1)
    bad = [r for r in reqs if r["cached_tokens"] != (0 if r["arm"] == "no_cache" else r["prefix_tokens"])]
    assert {(r["arm"], r["prefix_tokens"], r["cached_tokens"], r["status"]) for r in bad} == {
        ("cxlalloc_lmcache_mp", 7936, 0, "error")}
    table = eng.markdown(rec)
    assert table.count("| met |") + table.count("| missed |") + table.count("| within noise |") == 11
    for doc in ("docs/engines.md", "benchmarks/README.md"):
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        block = text.split("<!-- engines-results:start -->", 1)[1].split("<!-- engines-results:end -->", 1)[0]
        assert table in block, doc
    assert eng.markdown({"results": []}) == ""
    out = plot_engines(rec, str(tmp_path / "engines.png"))
    assert out and os.path.getsize(out) > 10_000
    assert plot_engines({"results": []}, str(tmp_path / "none.png")) is None


ENGINES_MP_RECORD = "benchmarks/results/engines-mp-cpu-2026-12-03c/engines.json"


def test_engines_mp_rerun_record_is_on_the_method_and_docs_quote_its_table():
    """The rerun of the MP group with ``--shm-name`` (docs/engines.md): only that group, every prefix size on >= 5
    timed rounds, each hit got its whole prefix (7,936 included), and the docs carry ``engines.markdown`` of it."""
    from cxlalloc_apps.bench import engines as eng
    from cxlalloc_apps.bench.method import MIN_ROUNDS

    with open(os.path.join(ROOT, ENGINES_MP_RECORD)) as f:
        rec = json.load(f)
    assert meta.validate_record(rec) == [] and rec["status"] == "ok" and rec["parameters"]["lmcache_mp_shm"] is True
    comps = [r for r in rec["results"] if r["kind"] == "comparison"]
    assert {(r["group"], r["prefix_tokens"]) for r in comps} == {("lmcache_mp", s) for s in eng.SIZES}
    assert all(r["comparison"]["rounds"] >= MIN_ROUNDS for r in comps)
    reqs = [r for r in rec["results"] if r["kind"] == "request"]
    assert reqs and all(r["cached_tokens"] == (0 if r["arm"] == "no_cache" else r["prefix_tokens"]) for r in reqs)
    with open(os.path.join(ROOT, "docs", "engines.md")) as f:
        assert eng.markdown(rec) in f.read()


ENGINES_QUIET_RECORD = "benchmarks/results/engines-cpu-2026-12-04/engines.json"


def test_engines_quiet_rerun_record_is_on_the_method_and_docs_quote_its_table():
    """The quiet rerun of the connector and vLLM-offloading groups (docs/engines.md, benchmarks/README.md): those two
    groups at every prefix size on >= 5 timed rounds, each hit got its whole prefix, the pool hit's first token is
    LMCache's local CPU hit's in every round, the verdicts are the ones the docs state, and both docs carry
    ``engines.markdown`` of it."""
    from cxlalloc_apps.bench import engines as eng
    from cxlalloc_apps.bench.method import MIN_ROUNDS

    with open(os.path.join(ROOT, ENGINES_QUIET_RECORD)) as f:
        rec = json.load(f)
    assert meta.validate_record(rec) == [] and rec["status"] == "ok" and rec["parameters"]["quick"] is False
    comps = [r for r in rec["results"] if r["kind"] == "comparison"]
    assert {(r["group"], r["prefix_tokens"]) for r in comps} == {(g, s) for g in ("lmcache", "vllm_tier")
                                                                 for s in eng.SIZES}
    assert all(r["comparison"]["rounds"] >= MIN_ROUNDS for r in comps)
    assert {(r["group"], r["prefix_tokens"]): r["goals"][0]["verdict"] for r in comps} == {
        ("lmcache", 1024): "met", ("lmcache", 2048): "met", ("lmcache", 4096): "within noise",
        ("lmcache", 7936): "missed", **{("vllm_tier", s): "met" for s in eng.SIZES}}
    reqs = [r for r in rec["results"] if r["kind"] == "request"]
    assert reqs and all(r["cached_tokens"] == (0 if r["arm"] == "no_cache" else r["prefix_tokens"]) for r in reqs)
    first = {}
    for r in reqs:
        first.setdefault((r["group"], r["prefix_tokens"], r["round"]), {})[r["arm"]] = r["first_token"]
    same = [a.get("cxlalloc_lmcache", a.get("cxlalloc_vllm_tier")) == a["lmcache_local_cpu"] for a in first.values()]
    assert len(same) == 48 and all(same)
    for doc in ("docs/engines.md", "benchmarks/README.md"):
        with open(os.path.join(ROOT, doc)) as f:
            assert eng.markdown(rec) in f.read(), doc


def test_lmcache_get_record_table_and_plot_from_per_round_ratios(tmp_path):
    """bench --only lmcache_get: the README table comes from the method's per-round ratios (a retrieve at half the
    local CPU backend's rate in every round is 0.5x and misses the 0.8x goal), and the record plots."""
    from cxlalloc_apps.bench import lmcache_get as lg
    from cxlalloc_apps.bench.method import Comparison, goal_record

    assert "lmcache_get" in meta.OPT_IN and "lmcache_get" not in meta.BENCHMARKS
    rows = []
    for nbytes, fast in ((1 << 20, 1.0), (16 << 20, 2.0)):
        samples = {"local_cpu_get": [200.0] * 5, "cxlalloc_get": [1.0 * fast] * 5,
                   "local_cpu_retrieve": [2.0 * fast, 2.0 * fast, 4.0 * fast, 2.0 * fast, 2.0 * fast],
                   "cxlalloc_retrieve": [1.0 * fast, 1.0 * fast, 2.0 * fast, 1.0 * fast, 1.0 * fast],
                   "memcpy": [2.0 * fast] * 5}
        cmp = Comparison(list(lg.ARMS), samples, [list(lg.ARMS)] * 5, "rotate", 1, {"loadavg_1m": 1.5},
                         {"loadavg_1m": 2.0})
        stages = {"lookup_rpc": 0.1, "copy_pool_to_memobj": 1.0, "xxh3_of_the_copy": 0.1, "other": 0.3,
                  "copy_out": 1.0, "get": 1.5, "retrieve": 2.5}
        rows.append({"kind": "comparison", "chunk_bytes": nbytes, "comparison": cmp.as_dict(lg.RATIOS),
                     "noise_floor_ratio": {"q1": 0.97, "q3": 1.03},
                     "goal": goal_record("retrieve", cmp.ratio("cxlalloc_retrieve", "local_cpu_retrieve"), lg.GOAL,
                                         "higher"),
                     "breakdown": {**{f"{k}_ms_per_chunk": v for k, v in stages.items()},
                                   "xxh3_share_of_retrieve": 0.04}})
    rec = {"parameters": {"lmcache": "0.5.6"}, "results": rows}
    table = lg.markdown(rec)
    assert "| 1 MiB | 200.0 / 2.00 | 1.00 / 1.00 | 2.00 | 0.0050x | **0.500x** (0.500-0.500) | missed |" in table
    assert "| 16 MiB |" in table and "| 4 % | 1.5 / 2.0 |" in table and lg.markdown({"results": []}) == ""
    out = lg.plot(rec, str(tmp_path / "lmcache_get.png"))
    assert out and os.path.getsize(out) > 10_000 and lg.plot({"results": []}, str(tmp_path / "x.png")) is None


def test_chat_and_prefix_tables_of_the_quiet_and_memo_records_are_generated():
    """benchmarks/README.md's 2026-12-03e/f chat and prefix rows are kvspeed.markdown(record) of the records, and
    the records say what the README says of them (chat within noise before the state memo, met after; prefix met)."""
    from cxlalloc_apps.bench import kvspeed as ks

    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    res = os.path.join(ROOT, "benchmarks", "results")
    verdicts = {}
    for rel in ("kvspeed-cpu-2026-12-03e/kvspeed.json", "kvspeed-cpu-2026-12-03f/kvspeed.json",
                "kvspeed-cpu-2026-12-03f/kvspeed-memo-only.json", "kvspeed-cpu-2026-12-03f/kvspeed-prefix.json"):
        with open(os.path.join(res, rel)) as f:
            rec = json.load(f)
        rows = ks.markdown(rec).strip().splitlines()[2:]
        assert rows and all(row in readme for row in rows), rel
        verdicts[rel] = {r["part"]: r["goal"]["verdict"] for r in rec["results"] if r.get("part") in ("chat", "prefix")}
    assert verdicts == {"kvspeed-cpu-2026-12-03e/kvspeed.json": {"chat": "within noise", "prefix": "met"},
                        "kvspeed-cpu-2026-12-03f/kvspeed.json": {"chat": "met"},
                        "kvspeed-cpu-2026-12-03f/kvspeed-memo-only.json": {"chat": "met"},
                        "kvspeed-cpu-2026-12-03f/kvspeed-prefix.json": {"prefix": "met"}}
