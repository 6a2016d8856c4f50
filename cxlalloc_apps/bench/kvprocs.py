"""The processes and helpers the kv-server benchmarks share (:mod:`.kvserver`,
:mod:`.kvspeed_store`, :mod:`.kvscale`, :mod:`.lmcache`): a ``cxlalloc kv-server``
and a local ``redis-server`` as child processes, a child whose output goes to
a file, the block keys and contents every client derives, percentiles, and
running a benchmark's parts in one temporary folder within the time budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ----------------------------------------------------------------- helpers shared with the workers
def block_key(doc: int, j: int, tag: bytes = b"doc") -> bytes:
    return hashlib.blake2b(tag + doc.to_bytes(8, "little") + j.to_bytes(8, "little"), digest_size=32).digest()


def pattern(k: bytes, n: int) -> bytes:
    seed = hashlib.blake2b(k, digest_size=64).digest()
    return (seed * (n // 64 + 1))[:n]


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CXLALLOC", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Server:
    def __init__(self, workdir: str, args: List[str], name: str = "kv.sock"):
        self.socket = os.path.join(workdir, name)
        self.url = "unix://" + self.socket
        self.args = args
        self.log = open(os.path.join(workdir, name + ".log"), "ab")
        self.proc = None

    def start(self) -> "_Server":
        from cxlalloc.kvstore.server.cli import query_status

        self.proc = subprocess.Popen([sys.executable, "-m", "cxlalloc", "kv-server", "--socket", self.socket,
                                      "--log-level", "warning", *self.args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=_env())
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kv-server exited with {self.proc.returncode}")
            try:
                query_status(self.socket, timeout=1)
                self.started_s = time.monotonic() - t0
                return self
            except Exception:
                time.sleep(0.02)
        raise RuntimeError("kv-server did not start in 30 s")

    def status(self) -> dict:
        from cxlalloc.kvstore.server.cli import query_status

        return query_status(self.socket)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


class _Redis:
    """A local redis-server on a free 127.0.0.1 port, no persistence (``url``: ``redis://127.0.0.1:PORT``)."""

    def __init__(self, work: str):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install -y redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", work], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() - t0 > 10:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)
        time.sleep(0.1)
        self.url = f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _Logged:
    """A child process whose stdout goes to a file (not a pipe: reading a pipe
    line by line and then with communicate() can lose what the first read
    buffered)."""

    def __init__(self, cmd: List[str], path: str):
        self.path = path
        self._f = open(path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._f, env=_env(), text=True)

    def text(self) -> str:
        with open(self.path) as f:
            return f.read()

    def wait_for(self, word: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while word not in self.text():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.path}: exited with {self.proc.returncode} before {word!r}: "
                                   f"{self.text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.path}: no {word!r} in {timeout} s")
            time.sleep(0.02)

    def finish(self, timeout: float) -> str:
        self.proc.wait(timeout=timeout)
        self._f.close()
        return self.text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in worker output: {text[-2000:]}")


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _median(xs):
    return _pct(xs, 0.5)


# ----------------------------------------------------------------- running parts
def _chosen(ctx, parts: Dict[str, Any]) -> List[str]:
    """The names of ``parts`` that ``--parts`` selects (all without it; none
    when it names only another benchmark's parts)."""
    only = getattr(ctx.args, "parts", None)
    return [n for n in parts if only is None or n in only]


def run_parts(ctx, w, parts: Dict[str, Any], label: str, only=None) -> None:
    """Run each ``parts[name](ctx, w, work)`` (``only``: the names to run, None
    for all) in one short temporary folder (unix socket paths hold 107 bytes),
    skipping what the time budget leaves no room for; a part that raises is
    recorded as an error of that part, and the others still run."""
    if only is not None and not only:
        w.skip(label, f"--parts names none of its parts ({', '.join(parts)})")
        return
    work = tempfile.mkdtemp(prefix=f"{label}-", dir="/tmp")
    try:
        for name, fn in parts.items():
            if only is not None and name not in only:
                continue
            if ctx.deadline.expired():
                w.skip(name, "time budget used up")
                continue
            ctx.log(f"{label}: {name}")
            try:
                fn(ctx, w, work)
            except Exception as e:
                import traceback

                w.error(name, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker_main(workers: Dict[str, Any], argv: List[str]) -> None:
    """A bench module's worker process, ``python -m MODULE --worker ROLE PARAMS_JSON``: runs
    ``workers[ROLE](params)``, prints its result as one JSON line and exits at once (``os._exit``: the
    interpreter's teardown takes seconds with torch loaded).  Returns (doing nothing) when ``argv`` is not a
    worker's command line."""
    if len(argv) != 4 or argv[1] != "--worker":
        return
    out = workers[argv[2]](json.loads(argv[3]))
    print(json.dumps(out), flush=True)
    os._exit(0)


def raw_client(path: str, name: str, timeout: float = 120.0):
    """(socket, call) of a raw-protocol kv-server client on the unix socket
    ``path`` (hello without the pool's fd: no mapping); ``call(op, **fields)``
    returns the reply dict and raises RuntimeError on an error reply (as the
    hello does).  ``timeout``: seconds per send/receive."""
    from cxlalloc.kvstore import protocol as P

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    P.send_msg(s, {"op": "hello", "v": P.PROTOCOL_VERSION, "pid": os.getpid(), "want_fd": False, "name": name})
    r, _ = P.recv_msg(s)
    if not r.get("ok"):
        raise RuntimeError(f"hello: {r}")

    def call(op, **kw):
        P.send_msg(s, dict(op=op, **kw))
        r, _ = P.recv_msg(s)
        if not r.get("ok"):
            raise RuntimeError(f"{op}: {r}")
        return r
    return s, call
