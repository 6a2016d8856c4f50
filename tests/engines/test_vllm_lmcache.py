"""vLLM (its CPU build, from PyPI) with LMCache and the ``cxlalloc://`` plugin, on the shipped SmolLM2-135M.

A real engine on the pool, across processes: a kv-server on a unix socket started here; vLLM process A
stores a shared 1,280-token prefix through LMCache into the pool; a new process B finds it there
(``num_cached_tokens`` = the prefix) and generates the same tokens as A and as a run with no cache at all; the
server's counters say the same (what B got came from the pool; nothing was stored twice).  Then the kv-server
is killed between two requests of B's running engine, and every later request still completes, with the
no-cache run's tokens.  LMCache reads exactly the YAML block of docs/engines.md (only its socket path
changed).

The engine venv comes from scripts/install_engines.sh (.ci/run: its own stage); without it the test is skipped
with the reason, and under CI=true it fails.  LMCache has no connector for vLLM's CPU KV cache: the test-only
stand-in for its GPU copy is tests/engines/lmcache_cpu_connector.py (on a GPU, LMCache's own connector runs:
scripts/gpu_check.sh).
"""

from __future__ import annotations

import os

import pytest
import yaml

from tests.engines.engine_util import (MAX_TOKENS, PREFIX_TOKENS, check_b_then_the_server_dies, child_spec,
                                       docs_lmcache_yaml, engines_python, pool, print_runs, tide_prompts,
                                       yaml_for_socket)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256                # the docs' chunk_size: the prefix is 5 LMCache chunks


def test_vllm_processes_share_a_prefix_through_the_pool(workdir, model_dir, kv_server, start_child):
    prompts = tide_prompts(model_dir)
    sp = kv_server
    doc_yaml = docs_lmcache_yaml()
    cfg_path = os.path.join(workdir, "lmcache.yaml")
    with open(cfg_path, "w") as f:
        f.write(yaml_for_socket(doc_yaml, sp.socket))
    cfg = yaml.safe_load(open(cfg_path))
    assert cfg["pre_caching_hash_algorithm"] == "sha256_cbor" and cfg["chunk_size"] == CHUNK
    spec = child_spec(model_dir)
    # the reference (no connector, no prefix cache) and A (stores the shared prefix into the pool), side by side
    ref = start_child("ref", dict(spec, prompts=prompts))
    a = start_child("a", dict(spec, prompts=prompts[:3]), cfg_path)
    ref_out, a_out = ref.result(), a.result()
    want = [r["tokens"] for r in ref_out["requests"]]
    assert all(len(t) == MAX_TOKENS for t in want)
    assert [r["tokens"] for r in a_out["requests"]] == want[:3]
    pool_a = pool(sp)
    chunks = PREFIX_TOKENS // CHUNK
    assert pool_a["stored_blocks"] == chunks, pool_a   # the prefix's chunks, once each (no full chunk beyond it)
    assert pool_a["blocks"] == chunks and pool_a["duplicate_blocks"] == 0, pool_a

    # B, a new process: its first request finds the prefix in the pool
    b = start_child("b", dict(spec, prompts=prompts, pause_after=2), cfg_path)
    b_mid = b.wait_file(b.out + ".paused", 600)
    pool_b = pool(sp)
    got = b_mid["requests"]
    assert got[0]["num_cached_tokens"] == PREFIX_TOKENS, got[0]
    assert [r["num_cached_tokens"] for r in got] == [PREFIX_TOKENS] * 3, got
    assert [r["tokens"] for r in got] == want[:3]
    assert pool_b["stored_blocks"] == chunks and pool_b["duplicate_blocks"] == 0, pool_b  # B stored nothing new
    # what B got from the pool, by the server's count: its first request's prefix, looked up once (LMCache's
    # scheduler) and read once (its worker); its next two found the prefix in LMCache's local CPU tier.
    # Then the kv-server dies under B's running engine: B's later requests (another prefix) still complete, the
    # second finding the first's prefix in LMCache's local CPU tier: the dead pool did not switch LMCache off
    b_out = check_b_then_the_server_dies(sp, b, pool_a, pool_b, want, chunks)
    print_runs({"ref": ref_out, "A": a_out, "B": b_out}, {"A": pool_a, "B": pool_b},
               ("blocks", "stored_blocks", "duplicate_blocks", "lookups", "lookup_blocks", "hit_blocks",
                "hit_tokens", "miss_blocks"))
    print("wall s: ref", [round(r["wall_s"], 2) for r in ref_out["requests"]],
          "A", [round(r["wall_s"], 2) for r in a_out["requests"]],
          "B", [round(r["wall_s"], 2) for r in b_out["requests"]],
          "starts", round(ref_out["start_s"], 1), round(a_out["start_s"], 1), round(b_out["start_s"], 1))


def test_the_docs_install_line_resolves_in_vllms_environment(workdir):
    """docs/engines.md section 1's pip line, run from this clone with the engine venv's pip as a dry run
    (pip builds cxlalloc's metadata and resolves, downloads nothing big, installs nothing): it resolves beside
    vLLM without replacing any package vLLM's environment has, and brings what the docs then run."""
    import json
    import re
    import shlex
    import subprocess

    from tests.engines.engine_util import DOCS, ROOT

    py = engines_python()
    text = open(DOCS).read()
    section = text.split("## 1.", 1)[1].split("## 2.", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    line = next(ln for ln in block.splitlines() if ln.startswith("pip install"))
    args = shlex.split(line.split("#", 1)[0])
    assert args[:2] == ["pip", "install"] and args[2:] == [".[lmcache]"], args
    report = os.path.join(workdir, "pip-report.json")
    r = subprocess.run([py, "-m", "pip", "install", "--dry-run", "-q", "--disable-pip-version-check",
                        "--report", report, *args[2:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(report) as f:
        items = json.load(f)["install"]
    would = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in items}
    meta = next(i["metadata"] for i in items if i["metadata"]["name"] == "cxlalloc")
    extra = {re.split(r"[<>=;\[ ]", d, 1)[0].lower().replace("_", "-")
             for d in meta["requires_dist"] if 'extra == "lmcache"' in d}
    # the plugin (lmcache, msgpack) and the kv-server the docs start next (the kvserver extra's packages)
    assert {"lmcache", "msgpack", "redis", "prometheus-client", "rich"} <= extra, extra
    have = subprocess.run([py, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(have)}
    assert "cxlalloc" in would
    replaced = {n: (installed[n], v) for n, v in would.items() if n in installed and installed[n] != v}
    assert replaced == {}, f"the docs' install line would replace packages of vLLM's environment: {replaced}"
    for need in extra | {"xxhash"}:
        assert need in would or need in installed, need
