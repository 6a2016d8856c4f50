"""``bench --only serve`` in small: both servers (plain ``transformers serve`` and ``cxlalloc serve``) come up on
the benchmark's tiny chat model, the ``openai`` client replays the closed-loop chat trace against each, and the
record holds real figures of both arms (not speed: sessions, requests, tokens, TTFT, the tiers' bytes), the same
greedy replies from both, the per-round ratios and a verdict per goal; no server is left running."""

import json
import os
import socket
import subprocess
import sys

import pytest

from cxlalloc_apps.bench import meta, method
from cxlalloc_apps.bench import serve as sb
from tests.helpers.proc import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_bench_smoke_records_both_arms_with_real_values(tmp_path):
    for mod in ("openai", "fastapi", "uvicorn"):
        pytest.importorskip(mod)
    assert "serve" in meta.OPT_IN and "serve" not in meta.BENCHMARKS
    env = child_env(keep_cxlalloc=False, unbuffered=True)
    p = subprocess.Popen([sys.executable, "-m", "cxlalloc", "bench", "--only", "serve", "--quick", "--out",
                          str(tmp_path), "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    rec = json.loads((tmp_path / "serve.json").read_text())
    servers = rec["summary"]["servers"]
    assert sorted(servers) == sorted(sb.ARMS)
    assert servers["cxlalloc"]["exit"] == 0 and servers["cxlalloc"]["exited_by_itself"] is True, servers
    for s in servers.values():  # every server stopped and gone (transformers serve may need its SIGKILL)
        assert not _alive(s["pid"]), servers
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", s["port"]), timeout=2).close()
    assert meta.validate_record(rec) == [] and rec["status"] == "ok", (rec["errors"], rec["notes"])
    q = sb.QUICK
    rounds = [r for r in rec["results"] if r["kind"] == "round"]
    assert sorted(r["arm"] for r in rounds) == sorted(sb.ARMS)
    for r in rounds:
        assert r["failed_requests"] == 0 and r["errors"] == []
        assert r["sessions_completed"] >= 1 and r["requests"] >= q.turns * r["sessions_completed"]
        # each streamed chunk is one token of the word-level tokenizer: max_tokens each unless EOS came first
        assert 0 < r["output_tokens"] <= q.max_tokens * r["requests"]
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["load"]["cpus"] >= 1
    cx = next(r for r in rounds if r["arm"] == "cxlalloc")["cxlalloc"]
    p = rec["parameters"]
    # the same device KV budget as plain's blocks; the rest of cxlalloc's blocks on the host tier
    assert p["device_kv_budget_bytes"] == q.budget_blocks * p["block_bytes"]
    assert p["cxlalloc_num_blocks"] == q.host_factor * q.budget_blocks
    assert 0 < cx["peak_kv_device_bytes"] <= p["device_kv_budget_bytes"] + 2 * (1 << 20)
    assert cx["peak_kv_host_bytes"] > 0 and cx["max_requests_in_flight"] >= 1
    s = rec["summary"]
    for pair in ("cxlalloc vs plain", "cxlalloc vs plain_same_blocks"):  # greedy: the same replies
        assert 0 < s["replies"][pair]["compared"] == s["replies"][pair]["identical"], s["replies"]
    for m, _ in sb.METRICS:
        d = s["metrics"][m]
        for arm in sb.ARMS:
            assert d["samples"][arm] == [next(r for r in rounds if r["arm"] == arm)[m]]
        for base in ("plain", "plain_same_blocks"):
            ratio = d["samples"]["cxlalloc"][0] / d["samples"][base][0]
            assert d["ratios"][f"cxlalloc/{base}"]["median"] == pytest.approx(ratio, rel=1e-3)
    assert [g["verdict"] in method.VERDICTS for g in s["goals"]] == [True, True]
    assert s["noise_floor"]["n"] == method.MIN_ROUNDS and s["noise_floor"]["median"] > 0
    assert (tmp_path / "serve.png").stat().st_size > 10_000
