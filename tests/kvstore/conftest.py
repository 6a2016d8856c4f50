"""Fixtures of the kv-server tests: servers (in this process or as real
processes), simulated allocators, a real redis-server on 127.0.0.1, tiny models.

Nothing here mocks Redis: the ``redis_server`` fixture starts the Debian
``redis-server`` binary (``tests/helpers/redis_server.py``) on a free loopback port (``--save "" --appendonly no``)
and stops it after the test.  Without the binary the Redis tests are skipped
with the reason, except under CI (``CI=true``), where that is a failure:
``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest


MiB = 1 << 20


from tests.helpers.redis_server import RedisProcess, require_redis_server  # noqa: E402
from tests.kvstore.kvutil import ROOT, free_port, subprocess_env as _env  # noqa: E402,F401


@pytest.fixture
def sockdir():
    # Short paths: a unix socket path holds at most 107 bytes (pytest's tmp_path may be longer).
    d = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class ServerProcess:
    """``python -m cxlalloc kv-server ...`` as a real process."""

    def __init__(self, socket_path: str, args, log_path: str):
        self.socket = socket_path
        self.url = "unix://" + socket_path
        self.args = list(args)
        self.log_path = log_path
        self.proc = None

    def start(self, wait: float = 20.0) -> "ServerProcess":
        cmd = [sys.executable, "-m", "cxlalloc", "kv-server", "--socket", self.socket, *self.args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kv-server exited with {self.proc.returncode}: {self.log()}")
            if self.ready():
                return self
            time.sleep(0.02)
        raise RuntimeError(f"kv-server did not come up in {wait} s: {self.log()}")

    def ready(self) -> bool:
        from cxlalloc.kvstore.server.cli import query_status

        try:
            query_status(self.socket, timeout=1.0)
            return True
        except Exception:
            return False

    def status(self) -> dict:
        from cxlalloc.kvstore.server.cli import query_status

        return query_status(self.socket)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def server_proc(sockdir):
    """Factory: ``server_proc("--size", "64MiB", ...)`` -> a started ServerProcess."""
    made = []

    def make(*args, socket_name="kv.sock", start=True):
        args = list(args) or ["--size", "64MiB", "--chunk", "4MiB"]
        sp = ServerProcess(os.path.join(sockdir, socket_name), args, os.path.join(sockdir, f"server{len(made)}.log"))
        made.append(sp)
        return sp.start() if start else sp

    yield make
    for sp in made:
        sp.stop()


@pytest.fixture
def kv_server(sockdir):
    """Factory of in-process KVServers (started), stopped after the test."""
    from cxlalloc.kvstore.server import KVServer

    made = []

    def make(size=64 * MiB, chunk=4 * MiB, name="kv.sock", **kw):
        s = KVServer(size, 0, os.path.join(sockdir, name), chunk_bytes=chunk, **kw).start()
        s.url = "unix://" + s.socket_path
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop(0.5)


@pytest.fixture
def alloc(make_alloc):
    """Simulated allocators (tests/conftest.py's make_alloc); its fresh_sim
    fixture fails a passing test that leaves any simulated driver resource
    behind, host registrations of the store's arena included."""
    return make_alloc


# ----------------------------------------------------------------- redis
@pytest.fixture
def redis_server(tmp_path):
    """Factory: ``redis_server(extra_args...)`` -> a started RedisProcess on 127.0.0.1."""
    require_redis_server()
    made = []

    def make(*extra, port=None, tls=None):
        rp = RedisProcess(str(tmp_path), extra, port=port, tls=tls).start()
        made.append(rp)
        return rp

    yield make
    for rp in made:
        rp.stop()


# ----------------------------------------------------------------- models
@pytest.fixture(scope="session")
def tiny_model_factory():
    from tests.kvstore.kvutil import tiny_llama

    return tiny_llama
