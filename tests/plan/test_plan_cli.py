"""`cxlalloc plan` as a user runs it (subprocesses): the JSON record for the
shipped Llama-3.1 configs, a model directory, one-line usage errors with exit
status 2, the plot, measured records replacing datasheet rates, no torch
imported; and `python -m cxlalloc.plan.check` on records."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plan(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "cxlalloc", "plan", *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=cwd or ROOT)


def test_llama_8b_at_32k_for_64_users_on_h200(tmp_path):
    p = plan("--model", "llama-3.1-8b", "--context", "32768", "--users", "64", "--gpu", "h200", "--json",
             "--no-records", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    # 32 layers x 8 KV heads x (128 + 128) x 2 bytes: the public Llama-3.1-8B config's numbers
    assert r["kv"]["bytes_per_token"] == {"full_attention": 131072, "total": 131072}
    assert r["model"]["params"] == 8_030_261_248  # Llama-3.1-8B's published parameter count
    assert r["kv"]["per_sequence_live_bytes"] == 32768 * 131072
    room = r["vram"]["kv_room_per_gpu"]
    assert room == pytest.approx(141e9 - max(2 << 30, 14.1e9) - 8_030_261_248 * 2)
    n = r["capacity"]["sequences_per_gpu_vram_only"]
    assert n == int(room // (32768 * 131072))  # whole chunks of 2 MiB: 4 GiB per sequence is a whole number
    assert r["gpus"]["without_host"] == -(-64 // n)
    assert r["gpus"]["with_host"] <= r["gpus"]["without_host"]
    assert r["gpus"]["with_host_capacity_only"] < r["gpus"]["without_host_capacity_only"]
    assert r["hardware"]["hbm_gbps"] == 4800 and "datasheet" in r["hardware"]["hbm_gbps_source"]
    assert r["ttft"]["cold_ms"] > 0 and r["assumptions"]


def test_table_70b_128k_and_plot(tmp_path):
    png = tmp_path / "plan.png"
    p = plan("--model", "llama-3.1-70b", "--context", "131072", "--users", "64", "--gpu", "h200", "--reuse", "0.5",
             "--plot", str(png), "--no-records")
    assert p.returncode == 0, p.stderr
    assert "GPUs per model copy" in p.stdout and "Assumptions:" in p.stdout and "docs/planning.md" in p.stdout
    assert png.stat().st_size > 10_000


def test_model_directory_and_measured_record(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "cxlalloc", "plan", "presets", "llama-3.1-8b.json")))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    rec = tmp_path / "res" / "ceilings.json"
    rec.parent.mkdir()
    rec.write_text(json.dumps({"benchmark": "ceilings", "simulated": False, "date_utc": "2026-12-01T00:00:00Z",
                               "hardware": {"gpu": {"name": "NVIDIA H200"}},
                               "summary": {"hbm_read_gbps": 4100.0,
                                           "link": {"host-vmm": {"zero_copy_read_gbps": 51.0}}}}))
    p = plan("--model", str(model), "--json", "--records", str(tmp_path / "res"))
    assert p.returncode == 0, p.stderr
    hw = json.loads(p.stdout)["hardware"]
    assert hw["hbm_gbps"] == 4100.0 and hw["link_gbps"] == 51.0 and hw["host_read_gbps"] == 51.0
    assert "measured" in hw["hbm_gbps_source"] and str(rec) in hw["hbm_gbps_source"]
    p = plan("--model", str(model), "--json", "--records", str(tmp_path / "res"), "--gpu", "h100")
    assert json.loads(p.stdout)["hardware"]["hbm_gbps"] == 3350  # an H200 record is not an H100's


@pytest.mark.parametrize("args,needle", [
    (["--gpu", "a100"], "--gpu: invalid choice: 'a100' (choose from 'b200', 'h100', 'h200', 'l40s')"),
    (["--reuse", "1.5"], "--reuse takes a share in [0, 1], got '1.5'"),
    (["--context", "0"], "--context takes a whole number of tokens >= 1 (prompt + generated), got '0'"),
    (["--context", "1.5"], "--context takes a whole number of tokens >= 1 (prompt + generated), got '1.5'"),
    (["--users", "2.5"], "--users takes a whole number of sequences >= 1, got '2.5'"),
    (["--host-bytes", "12XB"], "--host-bytes takes a size such as 512GB"),
    (["--host-node", "optane"], "--host-node must be one of dram, cxl-x8, cxl-x16 or a bandwidth in GB/s"),
    (["--kv-dtype", "fp6"], "--kv-dtype: invalid choice: 'fp6'"),
])
def test_bad_options_are_one_line_and_exit_2(args, needle):
    p = plan("--model", "llama-3.1-8b", *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cxlalloc plan: error: " in lines[0] and needle in lines[0], p.stderr


def test_missing_model_and_weights_that_fit_no_group(tmp_path):
    p = plan("--model", str(tmp_path / "nothing"))
    assert p.returncode == 2 and "--model: no config.json at" in p.stderr and len(p.stderr.splitlines()) == 1
    p = plan("--model", "llama-3.1-70b", "--gpu", "l40s", "--hbm-bytes", "16GB")  # 141 GB of weights, 8 x 14 GB
    assert p.returncode == 2 and "fit no group of up to 8" in p.stderr, p.stderr


def test_plan_imports_no_torch():
    code = ("import sys; from cxlalloc.plan.cli import main; import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['--model', 'llama-3.1-8b', '--json', '--no-records'])\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_plan_check_compares_records(tmp_path):
    (tmp_path / "ceilings.json").write_text(json.dumps({"summary": {
        "hbm_read_gbps": 4000.0, "link": {"host-vmm": {"zero_copy_read_gbps": 50.0}}}}))
    (tmp_path / "decode.json").write_text(json.dumps({"results": [
        {"id": "a", "status": "ok", "variant": "cxlalloc", "batch": 4, "spill": 0.5, "weight_bytes": 2e9,
         "kv_final_bytes": 1e9, "decode_tokens_per_s": 100.0},
        {"id": "b", "status": "failed"}]}))
    (tmp_path / "reuse.json").write_text(json.dumps({"results": [
        {"part": "ttft P=1024", "kind": "ttft", "status": "ok", "bytes_loaded": 1e9, "link_gbps": 50.0,
         "load_ms": 25.0, "prefix_tokens": 1024}]}))
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "cxlalloc.plan.check", str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.load(open(tmp_path / "plan_check.json"))
    d = out["decode"][0]
    planned = (2e9 + 0.5 * 1e9) / 4000e9 + 0.5 * 1e9 / 50e9  # 10.625 ms
    assert d["planned_tpot_ms"] == pytest.approx(planned * 1e3) and d["measured_tpot_ms"] == pytest.approx(40.0)
    assert d["error"] == pytest.approx(0.040 / planned - 1)
    assert out["reuse"][0]["planned_load_ms"] == pytest.approx(20.0) and out["reuse"][0]["error"] == pytest.approx(0.25)


def test_host_and_vram_from_cxlalloc_info():
    """The H200 machine's `cxlalloc info --json` (2026-11-30): one 8.95 GB host node, 150.1 GB of VRAM."""
    info = os.path.join(ROOT, "benchmarks", "results", "gpu-smoke-h200-2026-11-30", "info.json")
    p = plan("--model", "llama-3.1-8b", "--json", "--no-records", "--info", info)
    assert p.returncode == 0, p.stderr
    hw = json.loads(p.stdout)["hardware"]
    assert hw["host_bytes_per_gpu"] == 8_954_298_368 and "host node 0" in hw["host_bytes_source"]
    assert hw["hbm_bytes"] == 150_109_880_320 and "NVIDIA H200" in hw["hbm_source"]
    cxl = {"gpu": {"devices": [{"name": "G", "total_bytes": 80e9}] * 2},
           "numa": {"auto_node": {"node": 0}, "topology": {"nodes": [
               {"id": 0, "has_cpu": True, "total_bytes": 500e9},
               {"id": 2, "has_cpu": False, "cxl": True, "total_bytes": 256e9},
               {"id": 3, "has_cpu": False, "cxl": True, "total_bytes": 256e9}]}}}
    from cxlalloc.plan.hardware import from_info
    got = from_info(cxl)
    assert got["host_bytes_per_gpu"] == 256e9 and got["host_nodes"] == [2, 3] and got["gpus"] == 2


def test_fixed_state_takes_vram_and_sliding_layers_count_their_whole_extent():
    from cxlalloc.plan import plan
    from cxlalloc.plan.layout import cache_bytes, read_layout, state_bytes

    base = {"model_type": "falcon_h1", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 65536}
    mamba = dict(base, mamba_d_ssm=4096, mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128, mamba_d_conv=4,
                 mamba_n_groups=1)
    lay = read_layout(mamba)
    # per layer (4096 + 2 x 128) x 4 conv + 64 x 64 x 128 recurrent elements, bf16, 32 layers
    assert state_bytes(lay, 2) == 32 * ((4096 + 256) * 4 + 64 * 64 * 128) * 2
    r = plan(mamba, context=32768, users=64, tpot_slo_ms=None, records=())
    room = r["vram"]["kv_room_per_gpu"]
    n = max(u for u in range(1, 64) if cache_bytes(lay, u, 32768, 2)["total"] + u * state_bytes(lay, 2) <= room)
    assert r["capacity"]["sequences_per_group_vram_only"] == n
    assert r["vram"]["state_per_gpu"] == r["decode"]["sequences_per_group_at_target"] * state_bytes(lay, 2)
    # A 4096-token window at 32K context: every sliding layer holds its whole extent (1.25x the window)
    sw = plan(dict(base, model_type="mistral", sliding_window=4096), context=32768, users=8, records=())
    per_layer = 8 * 8 * 256 * 2  # 8 sequences x 8 KV heads x (128 + 128) x bf16
    rows = -(-(4095 + 1023) * per_layer // (2 << 20)) * (2 << 20)
    assert sw["kv"]["target_cache_bytes"] == 32 * rows


def test_plan_check_cold_ttft_of_the_gpu_reuse_record(tmp_path):
    from cxlalloc.plan.check import compare

    (tmp_path / "reuse.json").write_text(json.dumps({
        "simulated": False, "hardware": {"gpu": {"name": "NVIDIA H200"}},
        "parameters": {"model": "llama-8b shape (bf16, random weights)"},
        "results": [{"part": "ttft P=8192", "kind": "ttft", "status": "ok", "bytes_loaded": 1e9, "link_gbps": 50.0,
                     "load_ms": 25.0, "prefix_tokens": 8192, "prompt_tokens": 8208, "recompute_ttft_ms": 500.0}]}))
    row = compare(str(tmp_path))["reuse"][0]
    # 2 x params x T + 32 layers x 2 x 32 heads x 128 x T^2, at 989 TFLOPS
    params = 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    T = 8208
    peak_ms = (2 * params * T + 32 * 2 * 32 * 128 * T * T) / 989e12 * 1e3
    assert row["implied_mfu"] == pytest.approx(peak_ms / 500.0)
    assert row["planned_cold_ttft_ms"] == pytest.approx(peak_ms / 0.4)


def test_plot_without_matplotlib_is_one_line_naming_the_bench_extra(tmp_path):
    """``--plot`` where matplotlib is missing (an empty module path shadows it):
    one line naming the extra, exit 2, nothing written; not a traceback."""
    shadow = tmp_path / "shadow"
    (shadow / "matplotlib").mkdir(parents=True)
    (shadow / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), ROOT, env.get("PYTHONPATH", "")])
    out = tmp_path / "plan.png"
    p = subprocess.run([sys.executable, "-m", "cxlalloc", "plan", "--model", "llama-3.1-8b", "--plot", str(out)],
                       env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--plot needs matplotlib" in lines[0] and "pip install matplotlib" in lines[0] and "cxlalloc[" not in lines[0], p.stderr
    assert not out.exists()


def test_plan_function_takes_the_preset_names_its_error_lists():
    """``cxlalloc.plan.plan("llama-3.1-8b")``: the preset the CLI accepts and the
    error message invites is accepted by the function too; an unknown name's
    error lists the presets."""
    from cxlalloc import plan as plan_mod
    from cxlalloc.plan.layout import PRESETS_DIR

    rec = plan_mod.plan("llama-3.1-8b", context=4096, users=4)
    assert rec == plan_mod.plan(os.path.join(PRESETS_DIR, "llama-3.1-8b.json"), context=4096, users=4)
    assert rec["kv"]["bytes_per_token"]["total"] == 131072  # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    with pytest.raises(FileNotFoundError, match="preset name: llama-3.1-70b, llama-3.1-8b"):
        plan_mod.plan("llama-3.1-9b")


# ----------------------------------------------------------------- --gpus N: per-GPU figures
def test_gpus_2_h200_70b_128k_prints_per_gpu_figures():
    """The issue's command (docs/planning.md runs it): a table with one row per GPU and per NUMA node."""
    p = plan("--model", "llama-3.1-70b", "--gpus", "2", "--gpu", "h200", "--context", "131072", "--users", "16")
    assert p.returncode == 0, p.stderr  # exactly as docs/planning.md writes it (records: benchmarks/results)
    out = " ".join(p.stdout.split())
    assert "GPU 0: layers 0-79, 4 KV heads" in out and "GPU 1: layers 0-79, 4 KV heads" in out
    assert out.count("weights 70.55 GB, KV 42.95 GB (VRAM 42.95 GB, host/CXL 0 B)") == 2  # 2 sequences per copy
    assert "NUMA node unknown: GPUs 0, 1" in out and "tier on node unknown (give --info) via " in out


def test_gpus_tensor_and_pipeline_parallel_records():
    from cxlalloc.plan import plan as plan_fn
    from cxlalloc.plan.cli import resolve_model
    from cxlalloc.plan.layout import cache_bytes, read_layout, split_layers, stage_layout

    model = resolve_model("llama-3.1-70b")
    lay = read_layout(model)
    kw = dict(gpus=2, gpu="h200", context=131072, users=16, tpot_slo_ms=None)
    tp = plan_fn(model, **kw)
    pp = plan_fn(model, parallel="pp", **kw)
    W = lay.params * 2
    for r in (tp, pp):
        assert r["capacity"]["group_gpus"] == 2 and len(r["per_gpu"]) == 2
        assert sum(x["weights_bytes"] for x in r["per_gpu"]) == pytest.approx(W)
        u = r["decode"]["sequences_per_group_at_target"]
        assert u > 1
        # per-GPU KV adds up to the copy's cache; VRAM + host per GPU is its KV; the host part is the spill
        assert sum(x["kv_bytes"] for x in r["per_gpu"]) == pytest.approx(r["per_gpu"][0]["kv_bytes"] * 2)
        for x in r["per_gpu"]:
            assert x["kv_vram_bytes"] + x["host_bytes"] == pytest.approx(x["kv_bytes"])
            assert x["kv_vram_bytes"] <= x["kv_room_bytes"] + 1
        assert sum(x["host_bytes"] for x in r["per_gpu"]) == pytest.approx(r["host"]["bytes_needed_per_gpu"] * 2)
        assert r["per_node"] == [{"node": None, "gpus": [0, 1], "node_bytes": None,
                                  "host_bytes": pytest.approx(sum(x["host_bytes"] for x in r["per_gpu"]))}]
    # tensor parallel: every layer on both GPUs, half of each layer's 8 KV heads, half of the one cache
    u = tp["decode"]["sequences_per_group_at_target"]
    assert [x["layers"] for x in tp["per_gpu"]] == [[0, 80], [0, 80]]
    assert [x["kv_heads"] for x in tp["per_gpu"]] == [4, 4]
    assert tp["per_gpu"][0]["kv_bytes"] == cache_bytes(lay, u, 131072, 2)["total"] / 2
    assert tp["parallel"]["mode"] == "tp" and tp["parallel"]["gpus_given"]
    # pipeline: 40 layers each, each GPU's cache exactly its stage's; the 70B spills past VRAM at capacity
    u = pp["decode"]["sequences_per_group_at_target"]
    assert split_layers(80, 2) == [(0, 40), (40, 80)] and [x["layers"] for x in pp["per_gpu"]] == [[0, 40], [40, 80]]
    for x, (a, b) in zip(pp["per_gpu"], split_layers(80, 2)):
        assert x["kv_bytes"] == cache_bytes(stage_layout(lay, a, b), u, 131072, 2)["total"]
        assert x["host_bytes"] > 0  # capacity only: the host tier holds most of the KV
    # the first GPU holds the input embeddings, the last the lm_head: equal here (untied, 128256 x 8192 each)
    assert pp["per_gpu"][0]["weights_bytes"] == pytest.approx(pp["per_gpu"][1]["weights_bytes"] - 2 * 8192, rel=1e-9)
    # a pipeline step runs the stages in turn: twice the tensor-parallel step at the same sequences
    assert pp["ttft"]["cold_ms"] == pytest.approx(2 * tp["ttft"]["cold_ms"])


def test_gpus_nodes_and_links_from_cxlalloc_info():
    """Two GPUs on two sockets, a CXL expander near each: each GPU's tier on its own CXL node."""
    from cxlalloc.plan import plan as plan_fn
    from cxlalloc.plan.cli import resolve_model

    info = {"gpu": {"devices": [{"name": "NVIDIA H200", "total_bytes": 141e9, "host_numa_id": 0},
                                {"name": "NVIDIA H200", "total_bytes": 141e9, "host_numa_id": 1}]},
            "numa": {"auto_node": {"node": 2}, "topology": {"nodes": [
                {"id": 0, "has_cpu": True, "total_bytes": 500e9, "distance": {"0": 10, "1": 21, "2": 14, "3": 24}},
                {"id": 1, "has_cpu": True, "total_bytes": 500e9, "distance": {"0": 21, "1": 10, "2": 24, "3": 14}},
                {"id": 2, "has_cpu": False, "cxl": True, "total_bytes": 256e9, "distance": {"0": 14, "1": 24}},
                {"id": 3, "has_cpu": False, "cxl": True, "total_bytes": 256e9, "distance": {"0": 24, "1": 14}}]}}}
    r = plan_fn(resolve_model("llama-3.1-70b"), gpus=2, parallel="pp", context=131072, users=16, info=info,
                tpot_slo_ms=None)
    assert [(x["node"], x["node_kind"], x["near_node"]) for x in r["per_gpu"]] == [(2, "cxl", 0), (3, "cxl", 1)]
    assert [(n["node"], n["gpus"], n["node_bytes"]) for n in r["per_node"]] == [(2, [0], 256e9), (3, [1], 256e9)]
    assert [n["host_bytes"] for n in r["per_node"]] == [x["host_bytes"] for x in r["per_gpu"]]
    assert all(x["link"] == "PCIe 5.0 x16" and x["host_read_gbps"] == 63.0 for x in r["per_gpu"])
    with pytest.raises(ValueError, match=r"--gpus 4: the --info record lists 2 GPU\(s\) \(allowed: 1..2"):
        plan_fn(resolve_model("llama-3.1-70b"), gpus=4, info=info)


@pytest.mark.parametrize("gpus", [0, -2, 2.5, "two", True, None.__class__])
def test_plan_function_rejects_bad_gpus(gpus):
    from cxlalloc.plan import plan as plan_fn
    from cxlalloc.plan.cli import resolve_model

    with pytest.raises(ValueError, match=r"^--gpus takes a whole number of GPUs >= 1 \(1, 2, 4, 8, ...\), got "):
        plan_fn(resolve_model("llama-3.1-8b"), gpus=gpus)


def test_plan_function_takes_gpus_as_the_command_line_does():
    """gpus=2.0 is 2, as "2" is (and "2.0"): a whole number in any spelling; a fraction is refused either way."""
    from cxlalloc.plan import plan as plan_fn
    from cxlalloc.plan.cli import resolve_model

    model = resolve_model("llama-3.1-70b")
    kw = dict(context=8192, users=4, tpot_slo_ms=None, parallel="pp")
    two = plan_fn(model, gpus=2, **kw)
    for spelt in (2.0, "2", "2.0"):
        r = plan_fn(model, gpus=spelt, **kw)
        assert r["parallel"] == two["parallel"] and r["per_gpu"] == two["per_gpu"], spelt
    for bad in (2.5, "2.5", float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^--gpus takes a whole number of GPUs >= 1 \(1, 2, 4, 8, ...\), got "):
            plan_fn(model, gpus=bad, **kw)
    r = plan("--model", "llama-3.1-70b", "--no-records", "--gpus", "2.0", "--parallel", "pp", "--json")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("option,bad,needle", [
    ("context", 1.5, "--context takes a whole number of tokens >= 1 (prompt + generated), got 1.5"),
    ("context", "1.5", "--context takes a whole number of tokens >= 1 (prompt + generated), got '1.5'"),
    ("users", 63.9, "--users takes a whole number of sequences >= 1, got 63.9"),
    ("users", True, "--users takes a whole number of sequences >= 1, got True"),
    ("chunk_bytes", 2097152.5, "chunk_bytes takes a whole number of bytes >= 1 (the engine's extent chunk, 2 MiB), "
                               "got 2097152.5"),
    ("curve_contexts", [4096, 8192.5], "curve_contexts takes a whole number of tokens >= 1 in each entry, got 8192.5"),
    ("curve_users", [1, 0], "curve_users takes a whole number of sequences >= 1 in each entry, got 0"),
])
def test_plan_function_refuses_a_fraction_of_every_whole_number_option(option, bad, needle):
    """plan(context=1.5) used to plan for 1 token (int() truncated it): every whole-number field is checked as
    --gpus is, and a whole number in any spelling (2.0, "2") still counts."""
    from cxlalloc.plan import plan as plan_fn
    from cxlalloc.plan.cli import resolve_model

    model = resolve_model("llama-3.1-8b")
    with pytest.raises(ValueError) as e:
        plan_fn(model, records=(), **{option: bad})
    assert str(e.value) == needle
    same = plan_fn(model, context=8192.0, users="16", chunk_bytes=float(2 << 20), curve_contexts=["4096", 8192.0],
                   curve_users=[1.0, 2])
    assert same["inputs"]["context"] == 8192 and same["inputs"]["users"] == 16
    assert same["curves"]["contexts"] == [4096, 8192] and same["curves"]["users"] == [1, 2]
    assert same["kv"] == plan_fn(model, context=8192, users=16, curve_contexts=[4096, 8192], curve_users=[1, 2])["kv"]


def test_parallel_pp_without_gpus_is_refused_naming_gpus():
    from cxlalloc.plan import plan as plan_fn
    from cxlalloc.plan.cli import resolve_model

    p = plan("--model", "llama-3.1-8b", "--no-records", "--parallel", "pp")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--parallel pp needs --gpus N" in lines[0], p.stderr
    with pytest.raises(ValueError, match=r"^--parallel pp needs --gpus N"):
        plan_fn(resolve_model("llama-3.1-8b"), parallel="pp")
    assert plan("--model", "llama-3.1-8b", "--no-records", "--parallel", "tp").returncode == 0  # the default


@pytest.mark.parametrize("args,needle", [
    (["--gpus", "0"], "--gpus takes a whole number of GPUs >= 1 (1, 2, 4, 8, ...), got '0'"),
    (["--gpus=-1"], "--gpus takes a whole number of GPUs >= 1 (1, 2, 4, 8, ...), got '-1'"),
    (["--gpus", "1.5"], "--gpus takes a whole number of GPUs >= 1 (1, 2, 4, 8, ...), got '1.5'"),
    (["--gpus", "3"], "--gpus 3 with --parallel tp: tensor parallelism splits the 64 attention heads evenly, so "
                      "--gpus must divide 64 (allowed: 1, 2, 4, 8, 16, 32, 64); or use --parallel pp"),
    (["--gpus", "81", "--parallel", "pp"], "--gpus 81 with --parallel pp: the model has 80 layers, one stage per "
                                           "GPU at least (allowed: 1..80)"),
    (["--gpus", "1"], "--gpus 1 (tp): the weights (141.1 GB) and one sequence of 32768 tokens do not fit 1 NVIDIA "
                      "H200 SXM 141 GB GPU(s)"),
    (["--gpus", "2", "--parallel", "dp"], "--parallel: invalid choice: 'dp' (choose from 'tp', 'pp')"),
])
def test_bad_gpus_is_one_line_naming_gpus(args, needle):
    p = plan("--model", "llama-3.1-70b", "--no-records", *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_gpus_sharing_one_cxl_node_and_kv_heads_copied_past_their_count():
    from cxlalloc.plan import plan as plan_fn
    from cxlalloc.plan.cli import resolve_model
    from cxlalloc.plan.layout import cache_bytes, read_layout

    model = resolve_model("llama-3.1-70b")
    # both GPUs near node 0, one CXL expander: both tiers on node 2, its bytes summed there
    info = {"gpu": {"devices": [{"name": "NVIDIA H200", "total_bytes": 141e9, "host_numa_id": 0}] * 2},
            "numa": {"topology": {"nodes": [
                {"id": 0, "has_cpu": True, "total_bytes": 500e9, "distance": {"0": 10, "2": 14}},
                {"id": 2, "has_cpu": False, "cxl": True, "total_bytes": 256e9, "distance": {"0": 14}}]}}}
    r = plan_fn(model, gpus=2, parallel="pp", context=131072, users=16, info=info, tpot_slo_ms=None)
    assert [x["node"] for x in r["per_gpu"]] == [2, 2]
    assert len(r["per_node"]) == 1 and r["per_node"][0]["gpus"] == [0, 1]
    spilled = sum(x["host_bytes"] for x in r["per_gpu"])
    assert spilled > 0 and r["per_node"][0]["host_bytes"] == pytest.approx(spilled)
    assert r["per_node"][0]["node_bytes"] == 256e9 and r["hardware"]["host_bytes_per_gpu"] == 128e9  # shared by 2
    # tensor parallel over 16 GPUs, 8 KV heads: each GPU keeps one head, the copy holds the KV twice (vLLM's rule)
    r = plan_fn(model, gpus=16, context=32768, users=64, tpot_slo_ms=None)
    u = r["decode"]["sequences_per_group_at_target"]
    assert {x["kv_heads"] for x in r["per_gpu"]} == {1}
    assert r["per_gpu"][0]["kv_bytes"] == pytest.approx(2 * cache_bytes(read_layout(model), u, 32768, 2)["total"] / 16)
    assert "copied: the group holds 2x the KV" in r["parallel"]["rule"]
