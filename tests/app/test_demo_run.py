"""The main job's defaults on any model: the device limit below weights + KV with
the KV cache spilling (or why it cannot be), and its progress display."""

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from cxlalloc.kvstore.layout import CHECKSUM_BYTES
from cxlalloc_apps.demo.app import default_device_limit
from tests.helpers.proc import child_env

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _demo_cmd(*args):
    return [sys.executable, "-m", "cxlalloc", "demo", "--threads", "1", "--max-new-tokens", "4", *args]


def _run(tmp_path, *args):
    out = tmp_path / "report.json"
    p = subprocess.run(_demo_cmd("--no-progress", "--json", str(out), *args), cwd=tmp_path, env=child_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p, json.loads(out.read_text())


# ----------------------------------------------------------------- the default device limit
def test_default_limit_rule():
    # 22 KV chunks: half of them on the device, below weights + KV
    limit, note = default_device_limit(footprint=6 * MiB, weights=5 * MiB, kv_need=43 * MiB + 1, chunk=2 * MiB)
    assert limit == 6 * MiB + 11 * 2 * MiB and limit < 48 * MiB
    assert "below weights + KV" in note
    # one chunk of KV: none of it on the device
    assert default_device_limit(10 * MiB, 9 * MiB, MiB, 2 * MiB)[0] == 10 * MiB
    # half the chunks would reach weights + KV: fewer on the device
    limit, _ = default_device_limit(footprint=20 * MiB, weights=10 * MiB, kv_need=14 * MiB, chunk=2 * MiB)
    assert limit < 24 * MiB and (limit - 20 * MiB) % (2 * MiB) == 0
    # the segment rounding of the weights alone exceeds weights + KV: said, all KV spills
    limit, note = default_device_limit(footprint=2 * MiB, weights=800 << 10, kv_need=700 << 10, chunk=2 * MiB)
    assert limit == 2 * MiB and "cannot be below weights + KV" in note


def test_default_limit_is_below_weights_plus_kv_and_kv_spills(kv_model_dir, tmp_path):
    p, r = _run(tmp_path, "--model", str(kv_model_dir), "--compare")
    run, c = r["run"], r["cxlalloc"]
    assert run["device_limit_below_need"] is True
    assert r["plain"]["need_bytes"] > run["device_limit"], "plain transformers would not fit"
    assert c["classes"]["kv"]["host_bytes"] > 0 and c["classes"]["kv"]["device_bytes"] > 0
    assert c["classes"]["weight"]["host_bytes"] == 0
    assert c["tiers"]["device"]["peak_reserved_bytes"] <= run["device_limit"]
    assert r["identical_tokens"] is True


def test_default_limit_says_why_it_cannot_be_below_weights_plus_kv(tiny_model_dir, tmp_path):
    """The tiny model's weights and whole KV cache (1.45 MiB) are less than the
    one 2 MiB segment that holds the weights."""
    p, r = _run(tmp_path, "--model", str(tiny_model_dir))
    run, c = r["run"], r["cxlalloc"]
    assert run["device_limit_below_need"] is False
    assert "it cannot be below weights + KV (1.45 MiB) for this model" in run["device_limit_note"]
    assert "cannot be below" in p.stdout  # in the report's table too
    assert c["classes"]["kv"]["host_bytes"] > 0 and c["classes"]["weight"]["host_bytes"] == 0


# ----------------------------------------------------------------- progress
def test_progress_outside_a_terminal_is_plain_lines(kv_model_dir, tmp_path):
    p = subprocess.run(_demo_cmd("--model", str(kv_model_dir), "--compare"), cwd=tmp_path, env=child_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr.splitlines()
    assert err and all(line.startswith("cxlalloc demo: ") for line in err), p.stderr
    assert "\r" not in p.stderr and "%|" not in p.stderr, "no redrawn (third-party) bar in a log"
    assert any(line.startswith(f"cxlalloc demo: loading {kv_model_dir} ...") for line in err)
    assert any("loading" in line and "done in" in line for line in err)
    for run in ("plain transformers", "cxlalloc"):
        assert f"cxlalloc demo: {run}: prefill of 1,388 prompt tokens x 1 ..." in err
        assert any(line.startswith(f"cxlalloc demo: {run}: first token after ") for line in err)
    assert len(err) <= 12, "a few lines per stage, not a line per token"
    assert p.stdout.splitlines()[0].startswith("SIMULATION (no GPU):")


def test_no_progress_prints_nothing_on_stderr(tiny_model_dir, tmp_path):
    p, _ = _run(tmp_path, "--model", str(tiny_model_dir))
    assert p.stderr == ""


def test_progress_on_a_terminal(kv_model_dir, tmp_path):
    """stderr on a pseudo-terminal: a spinner while loading, then the prefill
    and decode of each generate() (rich redraws them in place)."""
    master, slave = pty.openpty()
    env = dict(child_env(), TERM="xterm", COLUMNS="120")
    proc = subprocess.Popen(_demo_cmd("--model", str(kv_model_dir)), cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=600) == 0
    text = b"".join(chunks).decode("utf-8", "replace")
    assert f"loading {kv_model_dir} ..." in text and "done in" in text
    assert "cxlalloc: prefill of 1,388 prompt tokens x 1" in text
    assert "cxlalloc: decode (first token after" in text
    assert "\x1b[" in text, "drawn for a terminal"


# ----------------------------------------------------------------- the main job with --reuse
def test_reuse_main_job_hits_the_document_with_identical_tokens(kv_model_dir, tmp_path):
    """`--reuse`: the default document asked several questions, then chat turns, once
    without and once with the KV store: the first request misses and stores, every
    later one hits the document's full blocks (block-aligned, keeping the last prompt
    token to prefill), the store's placement is verified, and tokens are identical."""
    p, r = _run(tmp_path, "--model", str(kv_model_dir), "--reuse")
    assert "Identical tokens: yes" in p.stdout
    assert r["summary"]["identical_tokens"] is True
    bt = r["run"]["block_tokens"]
    assert bt == 64
    warm, cold = r["reuse"], r["no_reuse"]
    assert [row["kind"] for row in warm] == ["question"] * 4 + ["chat"] * 2
    assert warm[0]["hit_tokens"] == 0 and warm[0]["stored_blocks"] == (warm[0]["prompt_tokens"] + 4) // bt
    # every later prompt starts with the same document: its full blocks (all but the tail) hit
    shared = min(row["prompt_tokens"] for row in warm) - 1
    for row in warm[1:]:
        assert row["hit_tokens"] % bt == 0 and row["hit_tokens"] >= (shared // bt - 1) * bt, row
        assert row["bytes_loaded"] == row["hit_tokens"] * 8 * 2 * 8 * 64 * 4  # layers x K,V x heads x dim x fp32
        assert row["fallback"] is None
    assert all(row["hit_tokens"] == 0 and row["bytes_loaded"] == 0 for row in cold)
    store = r["store"]
    assert store["used_bytes"] == store["blocks"] * (bt * 8 * 2 * 8 * 64 * 4 + CHECKSUM_BYTES)  # + each checksum trailer
    assert store["placement_verified_bytes"] == store["used_bytes"] and store["placement_misplaced_bytes"] == 0
    assert store["load_failures"] == 0 and store["evicted_blocks"] == 0
