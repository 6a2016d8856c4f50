"""vLLM (its CPU build) through LMCache's multiprocess (MP) server, with cxlalloc's L2 adapter
(:mod:`cxlalloc.kvstore.engines.lmcache_l2`) on a kv-server, on the shipped SmolLM2-135M.

A kv-server and an ``lmcache server`` (MP mode) with the L2 adapter config of docs/engines.md section 5b (only
its socket path changed) and the server flags the docs print; vLLM process A (``LMCacheMPConnector``) computes
a shared 1,280-token prefix, which LMCache keeps in its L1 and writes to its L2, the kv-server's pool.  Then
the MP server is restarted (a new, empty L1) and a new vLLM process B gets the whole prefix on its first
request from L2 -- the pool -- and generates the same tokens as A and as a run with no cache; the kv-server
counts the prefix's chunks stored once and read by B.

No stand-in: LMCache's MP mode runs on vLLM's CPU build as it is, with the docs' ``--supported-transfer-mode
auto`` (vLLM's CPU worker registers an engine-driven context; the server's default, ``lmcache_driven``,
answers "No handler registered for operation register_kv_cache_engine_driven_context").
"""

from __future__ import annotations

import json
import re

import pytest

from cxlalloc_apps.bench.engine_env import MPServer, free_port
from tests.engines.engine_util import (DOCS, DOCS_SOCKET, MAX_TOKENS, PREFIX_TOKENS, child_spec,
                                       engines_python, pool, print_runs, tide_prompts, wait_stored)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256                # the docs' --chunk-size: the prefix is 5 LMCache chunks


def _docs_section() -> str:
    text = open(DOCS).read()
    return text.split("## 5b.", 1)[1].split("## 5c.", 1)[0]


def docs_mp_server_args(l2_json: str, port: int, http_port: int):
    """The ``lmcache server`` line of docs/engines.md section 5b as argv, its L2 config the given JSON, its
    ports this test's (the docs' line leaves them at LMCache's defaults) and its L1 0.5 GB (the docs' 5 GB is
    allocated in full at start on the CPU build)."""
    import shlex

    block = re.search(r"```bash\n(.*?)```", _docs_section(), flags=re.S).group(1)
    line = " ".join(ln.rstrip("\\").strip() for ln in block.splitlines() if ln.strip())
    assert line.startswith("lmcache server "), line
    args = shlex.split(line.replace('"$(cat /etc/cxlalloc/lmcache-l2.json)"', "L2JSON"))
    assert args.count("L2JSON") == 1, args
    args = [l2_json if a == "L2JSON" else a for a in args]
    args[args.index("--l1-size-gb") + 1] = "0.5"
    # the docs' shared-memory L1 (vLLM's CPU worker reads it in place instead of a pickled copy per request), its
    # name this test's (unique per port: LMCache unlinks a segment of the same name at its start)
    assert args[args.index("--shm-name") + 1] == "cxlalloc", args
    args[args.index("--shm-name") + 1] = f"cxlalloc_test_{port}"
    return args[2:] + ["--port", str(port), "--http-port", str(http_port)]


def docs_l2_json(socket_path: str) -> str:
    blocks = [b for b in re.findall(r"```json\n(.*?)```", _docs_section(), flags=re.S) if "lmcache_l2" in b]
    assert len(blocks) == 1, blocks
    assert blocks[0].count(DOCS_SOCKET) == 1
    return json.dumps(json.loads(blocks[0].replace(DOCS_SOCKET, socket_path)))


def docs_mp_kv_transfer_config() -> dict:
    blocks = [b for b in re.findall(r"```json\n(.*?)```", _docs_section(), flags=re.S) if "LMCacheMPConnector" in b]
    assert len(blocks) == 1, blocks
    return json.loads(blocks[0])


@pytest.fixture
def start_mp_server(workdir):
    """``start_mp_server(name, args)``: an :class:`engine_env.MPServer` (``lmcache server``) in ``workdir``, ready;
    stopped after the test."""
    servers = []

    def start(name: str, args) -> MPServer:
        s = MPServer(workdir, name, args, engines_python())
        servers.append(s)
        s.wait_ready()
        return s

    yield start
    for s in servers:
        s.stop()


def test_vllm_through_lmcache_mp_finds_a_prefix_in_the_pool_after_a_server_restart(model_dir, kv_server,
                                                                                    start_mp_server, start_child):
    prompts = tide_prompts(model_dir)
    sp = kv_server
    port = free_port()
    args = docs_mp_server_args(docs_l2_json(sp.socket), port, free_port())
    assert "--supported-transfer-mode" in args and args[args.index("--chunk-size") + 1] == str(CHUNK), args
    kvt = docs_mp_kv_transfer_config()
    assert kvt["kv_connector"] == "LMCacheMPConnector"
    assert kvt["kv_connector_extra_config"] == {"lmcache.mp.port": 5555}   # LMCache's default port; this test's own
    kvt["kv_connector_extra_config"] = {"lmcache.mp.port": port}
    spec = child_spec(model_dir)
    chunks = PREFIX_TOKENS // CHUNK
    mp1 = start_mp_server("mp1", args)
    ref = start_child("ref", dict(spec, prompts=prompts[:3]))
    a = start_child("a", dict(spec, prompts=prompts[:3], kv_transfer_config=kvt))
    ref_out, a_out = ref.result(), a.result()
    want = [r["tokens"] for r in ref_out["requests"]]
    assert all(len(t) == MAX_TOKENS for t in want)
    assert [r["tokens"] for r in a_out["requests"]] == want
    assert [r["num_cached_tokens"] for r in a_out["requests"]] == [0, PREFIX_TOKENS, PREFIX_TOKENS], a_out
    pool_a = wait_stored(sp, chunks)   # L2 writes are asynchronous
    assert pool_a["stored_blocks"] == chunks and pool_a["duplicate_blocks"] == 0, (pool_a, mp1.log())

    # a new MP server (an empty L1) and a new vLLM process: the prefix comes from L2, the pool
    mp1.stop()
    mp2 = start_mp_server("mp2", args)
    b = start_child("b", dict(spec, prompts=prompts[:3], kv_transfer_config=kvt))
    b_out = b.result()
    pool_b = pool(sp)
    assert "Using shm non-GPU transfer strategy" in mp2.log(), mp2.log()   # not the pickled fallback
    assert [r["num_cached_tokens"] for r in b_out["requests"]] == [PREFIX_TOKENS] * 3, (b_out, mp2.log())
    assert [r["tokens"] for r in b_out["requests"]] == want
    assert pool_b["stored_blocks"] == chunks and pool_b["duplicate_blocks"] == 0, pool_b
    # B's first request read the prefix's chunks from the pool (LMCache's lookup-and-lock, then its load)
    assert pool_b["hit_blocks"] - pool_a["hit_blocks"] >= chunks, (pool_a, pool_b)
    print_runs({"ref": ref_out, "A": a_out, "B": b_out}, {"A": pool_a, "B": pool_b},
               ("blocks", "stored_blocks", "duplicate_blocks", "hit_blocks"))
