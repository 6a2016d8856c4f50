"""vLLM's own KV offloading (``OffloadingConnector`` + ``TieringOffloadingSpec``) with cxlalloc's secondary tier
(:mod:`cxlalloc.kvstore.engines.vllm_tier`), no LMCache, on vLLM's CPU build and the shipped SmolLM2-135M.

Across processes: a kv-server on a unix socket started here; vLLM process A computes a shared 1,280-token
prefix, vLLM's CPU primary tier takes its chunks and cascades them into the pool; a new process B finds them
there on its first request (``num_cached_tokens`` = the prefix, promoted pool -> B's primary tier -> B's KV
cache) and generates the same tokens as A and as a run with no cache; the server counts each chunk stored once.
A chunk whose bytes are changed in the pool is a miss for a third process C (checksum on its own copy), which
recomputes it and still generates the reference tokens.  Then the kv-server is killed under B's running
engine and every later request completes.  vLLM reads exactly the ``--kv-transfer-config`` JSON of
docs/engines.md (only its socket path changed).

vLLM's worker half of the offloading copy refuses the CPU platform; the test-only stand-in for that copy is
tests/engines/vllm_offload_cpu_worker.py (on a GPU, vLLM's own worker runs: scripts/gpu_check.sh).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.engines.engine_util import (DOCS_SOCKET, MAX_TOKENS, PREFIX_TOKENS, ROOT, check_b_then_the_server_dies,
                                       child_env, child_spec, docs_offload_config, engines_python, pool, print_runs,
                                       start_kv_server, tide_prompts, wait_stored)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 128                # vLLM CPU block: the prefix is 10 offloaded chunks (block_size unset: one block each)


def _for_socket(conf: dict, socket_path: str) -> dict:
    text = json.dumps(conf)
    assert text.count(DOCS_SOCKET) == 1, "the docs' JSON names the kv-server socket once"
    return json.loads(text.replace(DOCS_SOCKET, socket_path))


def test_vllm_offloading_shares_a_prefix_through_the_pool(model_dir, kv_server, start_child):
    conf = docs_offload_config()
    extra = conf["kv_connector_extra_config"]
    assert conf["kv_connector"] == "OffloadingConnector" and extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["secondary_tiers"][0]["module_path"] == "cxlalloc.kvstore.engines.vllm_tier"
    prompts = tide_prompts(model_dir)
    sp = kv_server
    kvt = _for_socket(conf, sp.socket)
    spec = child_spec(model_dir)
    chunks = PREFIX_TOKENS // BLOCK
    ref = start_child("ref", dict(spec, prompts=prompts))
    a = start_child("a", dict(spec, prompts=prompts[:3], kv_transfer_config=kvt))
    ref_out, a_out = ref.result(), a.result()
    want = [r["tokens"] for r in ref_out["requests"]]
    assert all(len(t) == MAX_TOKENS for t in want)
    assert [r["tokens"] for r in a_out["requests"]] == want[:3]
    # A's later requests of the prefix came from its own CPU primary tier (vLLM's prefix cache is off)
    assert [r["num_cached_tokens"] for r in a_out["requests"]] == [0, PREFIX_TOKENS, PREFIX_TOKENS], a_out
    pool_a = wait_stored(sp, chunks)   # a cascade finishes on vLLM's copy thread
    assert pool_a["stored_blocks"] == chunks, pool_a    # the prefix's chunks, once each
    assert pool_a["blocks"] == chunks and pool_a["duplicate_blocks"] == 0, pool_a

    # B, a new process: its first request finds the prefix in the pool
    b = start_child("b", dict(spec, prompts=prompts, pause_after=2, kv_transfer_config=kvt))
    b_mid = b.wait_file(b.out + ".paused", 600)
    pool_b = pool(sp)
    got = b_mid["requests"]
    assert [r["num_cached_tokens"] for r in got] == [PREFIX_TOKENS] * 3, got
    assert [r["tokens"] for r in got] == want[:3]
    assert pool_b["stored_blocks"] == chunks and pool_b["duplicate_blocks"] == 0, pool_b  # B stored nothing
    # by the server's count: B's scheduler looked each chunk up once and its tier's promotion read each once;
    # B's next two requests found the prefix in its own CPU primary tier.  Then the kv-server dies under B's
    # running engine: B's later requests (another prefix) still complete, the second finding the first's prefix
    # in B's CPU primary tier
    b_out = check_b_then_the_server_dies(sp, b, pool_a, pool_b, want, chunks)
    print_runs({"ref": ref_out, "A": a_out, "B": b_out}, {"A": pool_a, "B": pool_b},
               ("blocks", "stored_blocks", "duplicate_blocks", "hit_blocks", "hit_tokens"))


def test_the_tier_under_vllms_own_tiering_manager(workdir):
    """tests/engines/vllm_tier_contract.py in the engine venv: the tier as vLLM's ``TieringOffloadingManager``
    drives it (two managers = two processes), a chunk changed in the pool, bad parameters, the kv-server killed."""
    sp = start_kv_server(workdir, "kvc", size="16MiB", chunk="1MiB")
    out = os.path.join(workdir, "contract.json")
    try:
        r = subprocess.run([engines_python(), "-m", "tests.engines.vllm_tier_contract", sp.socket, out,
                            str(sp.proc.pid)], cwd=ROOT, env=child_env(workdir), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    finally:
        sp.stop()
    with open(out) as f:
        got = json.load(f)
    print(json.dumps(got, indent=1)[:3000])
    # A stored 6 chunks once each; B promoted the first 4, byte for byte
    assert got["store_a"]["stored_chunks"] == 6 and got["store_a"]["store_failures"] == 0, got["store_a"]
    assert got["fetch_b"] == {"results": ["HIT"] * 4, "equal": [True] * 4}, got["fetch_b"]
    assert got["tier_b"]["loaded_chunks"] == 4 and got["tier_b"]["corrupt_chunks"] == 0, got["tier_b"]
    # one byte changed in the pool: that chunk is a miss (never the changed bytes), the next one still loads
    assert got["fetch_corrupt"] == {"results": ["MISS", "HIT"], "equal_3": True}, got["fetch_corrupt"]
    assert got["tier_c"]["corrupt_chunks"] == 1 and got["tier_c"]["loaded_chunks"] == 1, got["tier_c"]
    assert got["after_drop"] == "MISS"
    # bad parameters: one error each, naming the parameter
    bad = got["bad_params"]
    for param, word in (('{"io_threads": 0}', "io_threads"), ('{"colour": "red"}', "colour"),
                        ('{"url": "redis://x"}', "url"), ('{"locality": "MOON"}', "locality")):
        assert bad[param] and "TierConfigError" in bad[param] and word in bad[param], (param, bad[param])
    # the kv-server gone: a miss, and a cascade that failed (counted), never an exception
    assert got["down_lookup"] == "MISS"
    assert got["down_store"]["store_failures"] >= 1 and got["down_store"]["stored_chunks"] == 0, got["down_store"]
