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
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from tests.engines.engine_util import DOCS, DOCS_SOCKET, ROOT, Child, engines_python, smollm2_safetensors
from tests.engines.test_vllm_lmcache import _prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX_TOKENS = 1280       # 5 LMCache chunks of 256
CHUNK = 256
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="vmp-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir():
    py = engines_python()
    venv = os.path.realpath(os.path.dirname(os.path.dirname(py)))
    return smollm2_safetensors(os.path.join(venv, "cxlalloc-models", "SmolLM2-135M-Instruct-bf16"))


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MPServer:
    """``lmcache server`` from the engine venv, with this checkout on PYTHONPATH (it imports the adapter)."""

    def __init__(self, workdir: str, name: str, args):
        self.log_path = os.path.join(workdir, name + ".log")
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", DO_NOT_TRACK="1", LMCACHE_TRACK_USAGE="false")
        lmc = os.path.join(os.path.dirname(engines_python()), "lmcache")
        self.proc = subprocess.Popen([lmc, "server", *args], cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while "LMCache cache server is running" not in self.log():
            assert self.proc.poll() is None, f"lmcache server exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"lmcache server not ready after {timeout} s:\n{self.log()}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _pool(sp):
    return sp.status()["pool"]


def test_vllm_through_lmcache_mp_finds_a_prefix_in_the_pool_after_a_server_restart(workdir, model_dir):
    from tests.kvstore.conftest import ServerProcess

    prompts = _prompts(model_dir)
    sp = ServerProcess(os.path.join(workdir, "kv.sock"), ["--size", "128MiB", "--chunk", "8MiB"],
                       os.path.join(workdir, "server.log")).start()
    port = _free_port()
    args = docs_mp_server_args(docs_l2_json(sp.socket), port, _free_port())
    assert "--supported-transfer-mode" in args and args[args.index("--chunk-size") + 1] == str(CHUNK), args
    kvt = docs_mp_kv_transfer_config()
    assert kvt["kv_connector"] == "LMCacheMPConnector"
    assert kvt["kv_connector_extra_config"] == {"lmcache.mp.port": 5555}   # LMCache's default port; this test's own
    kvt["kv_connector_extra_config"] = {"lmcache.mp.port": port}
    spec = dict(model=model_dir, max_model_len=2048, max_tokens=MAX_TOKENS)
    chunks = PREFIX_TOKENS // CHUNK
    children, servers = [], []
    try:
        mp1 = MPServer(workdir, "mp1", args)
        servers.append(mp1)
        mp1.wait_ready()
        ref = Child(workdir, "ref", dict(spec, prompts=prompts[:3]))
        a = Child(workdir, "a", dict(spec, prompts=prompts[:3], kv_transfer_config=kvt))
        children += [ref, a]
        ref_out, a_out = ref.result(), a.result()
        want = [r["tokens"] for r in ref_out["requests"]]
        assert all(len(t) == MAX_TOKENS for t in want)
        assert [r["tokens"] for r in a_out["requests"]] == want
        assert [r["num_cached_tokens"] for r in a_out["requests"]] == [0, PREFIX_TOKENS, PREFIX_TOKENS], a_out
        deadline = time.monotonic() + 30   # L2 writes are asynchronous
        while _pool(sp)["stored_blocks"] < chunks and time.monotonic() < deadline:
            time.sleep(0.2)
        pool_a = _pool(sp)
        assert pool_a["stored_blocks"] == chunks and pool_a["duplicate_blocks"] == 0, (pool_a, mp1.log())

        # a new MP server (an empty L1) and a new vLLM process: the prefix comes from L2, the pool
        mp1.stop()
        mp2 = MPServer(workdir, "mp2", args)
        servers.append(mp2)
        mp2.wait_ready()
        b = Child(workdir, "b", dict(spec, prompts=prompts[:3], kv_transfer_config=kvt))
        children.append(b)
        b_out = b.result()
        pool_b = _pool(sp)
        assert [r["num_cached_tokens"] for r in b_out["requests"]] == [PREFIX_TOKENS] * 3, (b_out, mp2.log())
        assert [r["tokens"] for r in b_out["requests"]] == want
        assert pool_b["stored_blocks"] == chunks and pool_b["duplicate_blocks"] == 0, pool_b
        # B's first request read the prefix's chunks from the pool (LMCache's lookup-and-lock, then its load)
        assert pool_b["hit_blocks"] - pool_a["hit_blocks"] >= chunks, (pool_a, pool_b)
        for name, o in (("ref", ref_out), ("A", a_out), ("B", b_out)):
            print(name, "ttft s", [r["ttft_s"] and round(r["ttft_s"], 3) for r in o["requests"]],
                  "cached", [r["num_cached_tokens"] for r in o["requests"]])
        print("pool after A", {k: pool_a[k] for k in ("blocks", "stored_blocks", "duplicate_blocks", "hit_blocks")})
        print("pool after B", {k: pool_b[k] for k in ("blocks", "stored_blocks", "duplicate_blocks", "hit_blocks")})
    finally:
        for c in children:
            c.close()
        for s in servers:
            s.stop()
        sp.stop()
