"""A real ``redis-server`` on 127.0.0.1 for the tests (no mock), the one launcher of the test suite.

``RedisProcess(workdir, extra_args).start()`` runs the Debian ``redis-server``
binary on a free loopback port (``--save "" --appendonly no``; TLS with
``tls={"cert", "key", "ca"}``) and waits until it answers PING;
:func:`require_redis_server` skips a test without the binary (fails it under
CI, which installs it: ``.ci/run``).  ``tests/kvstore/conftest.py``'s
``redis_server`` fixture makes them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from tests.helpers.net import free_port


def require_redis_server() -> None:
    """Skip the calling test without ``redis-server`` or redis-py (fail it under ``CI=true``)."""
    if shutil.which("redis-server") is None:
        msg = "redis-server is not installed (Debian: apt-get install -y redis-server; .ci/run does this)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + " -- CI must run the Redis tests")
        pytest.skip(msg)
    pytest.importorskip("redis")


class RedisProcess:
    def __init__(self, workdir: str, extra=(), port=None, tls=None):
        self.binary = shutil.which("redis-server")
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = list(extra)
        self.tls = tls
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        cmd = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.workdir,
               "--daemonize", "no", "--protected-mode", "no"]
        if self.tls:
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                    "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                    "--tls-auth-clients", "no"]
        else:
            cmd += ["--port", str(self.port)]
        cmd += self.extra
        self._log = open(os.path.join(self.workdir, f"redis-{self.port}.log"), "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.02)
        else:
            raise RuntimeError("redis-server did not start")
        if not self.tls:
            import redis

            r = redis.Redis.from_url(self.url + "", socket_timeout=2, **self._auth())
            deadline = time.monotonic() + 10
            while True:
                try:
                    r.ping()
                    break
                except redis.exceptions.BusyLoadingError:
                    time.sleep(0.02)
                except redis.exceptions.AuthenticationError:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server does not answer PING")
            r.close()
        return self

    def _auth(self):
        if "--requirepass" in self.extra:
            return {"password": self.extra[self.extra.index("--requirepass") + 1]}
        return {}

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2, **self._auth())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None:
            self._log.close()
        self.proc = None
