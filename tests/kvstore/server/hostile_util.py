"""Helpers of the tests that attack a real kv-server process (test_kv_hostile.py, test_kv_harden.py): its
resident memory, a normal client timing its answers meanwhile, and raw protocol connections."""

from __future__ import annotations

import os
import socket
import threading
import time

from tests.kvstore.kvutil import RawClient, key


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """Samples a process's VmRSS every 5 ms in a thread; ``peak`` is the most seen (bytes)."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, rss(pid)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss(self.pid))
            self._stop.wait(0.005)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(2)
        self.peak = max(self.peak, rss(self.pid))


class Probe:
    """A normal client doing lookups in a loop; records the slowest answer (s)."""

    def __init__(self, path: str):
        self.c = RawClient(path, want_fd=False, name="probe")
        self.worst = 0.0
        self.n = 0
        self.errors = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                r = self.c.call("lookup", ns="", keys=[key(1)])
                if not r.get("ok"):
                    self.errors.append(r)
            except Exception as e:  # a timeout is what the attacks must not cause
                self.errors.append(repr(e))
                return
            self.worst = max(self.worst, time.monotonic() - t0)
            self.n += 1
            time.sleep(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)
        self.c.close()

    def check(self):
        """Asserts every lookup was answered, more than 10 of them, each within 1 s."""
        assert not self.errors, self.errors
        assert self.n > 10 and self.worst < 1.0, (self.n, self.worst)


def raw(path: str, timeout: float = 5.0) -> socket.socket:
    """A unix socket connected to the kv-server at ``path``, nothing sent; ``timeout`` in seconds."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def hello(s) -> dict:
    """Sends the protocol's hello (no fd wanted) on ``s``; returns the server's answer."""
    from cxlalloc.kvstore import protocol as P

    P.send_msg(s, {"op": "hello", "v": P.PROTOCOL_VERSION, "pid": os.getpid(), "want_fd": False, "name": "x"})
    return P.recv_msg(s)[0]


def reply_of(s) -> dict:
    """The next message the server sends on ``s``."""
    from cxlalloc.kvstore import protocol as P

    return P.recv_msg(s)[0]


def raw_hello(path: str, timeout: float = 5.0) -> socket.socket:
    """:func:`raw` after a :func:`hello` the server accepted."""
    s = raw(path, timeout)
    assert hello(s)["ok"]
    return s
