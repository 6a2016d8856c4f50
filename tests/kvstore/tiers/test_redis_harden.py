"""The Redis tier against a hostile Redis (issue 29 items 9 and 10): a RESP server trickling one
byte per 0.6 s, planted values far larger than any block, and the warning that values are not
authenticated without a key file.  Each test states the figure it measures."""

from __future__ import annotations

import logging
import socket
import threading
import time

from cxlalloc.kvstore.keys import namespaced_key
from cxlalloc.kvstore.tiers import redis as redis_tier
from cxlalloc.kvstore.tiers.redis import RedisTier
from tests.kvstore.kvutil import key

MiB = 1 << 20


class TricklingResp:
    """A RESP server on 127.0.0.1 that answers every command with ``$-1`` (a miss),
    one byte every ``every`` seconds: always under a per-recv timeout, never done."""

    def __init__(self, every: float = 0.6):
        self.every = every
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(16)
        self.port = self.ls.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.ls.settimeout(0.2)
        while not self.stop.is_set():
            try:
                c, _ = self.ls.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        c.settimeout(0.2)
        try:
            while not self.stop.is_set():
                try:
                    if not c.recv(65536):
                        return
                except socket.timeout:
                    continue
                for b in b"$-1\r\n" * 64:
                    if self.stop.is_set():
                        return
                    c.sendall(bytes([b]))
                    time.sleep(self.every)
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self.stop.set()
        self.ls.close()


def test_a_trickling_server_costs_one_miss_at_most_the_timeout():
    srv = TricklingResp(every=0.6)
    t = RedisTier(f"redis://127.0.0.1:{srv.port}/0", timeout=1.0)
    try:
        t0 = time.monotonic()
        got = t.get_many([key(i) for i in range(4)], ns="")
        took = time.monotonic() - t0
        print(f"a miss against a server trickling a byte per 0.6 s: {took:.2f} s (--redis-timeout 1)")
        assert got == [None] * 4
        assert took < 1.8, took  # the deadline, plus the close; was 14 s at --redis-timeout 2
        st = t.stats()
        assert st["deadline_expired"] == 1 and st["up"] is False and "deadline" in st["last_error"]
    finally:
        t.close(0.1)
        srv.close()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError


def test_planted_huge_values_are_never_read_whole(redis_server):
    rs = redis_server()
    t = RedisTier(rs.url, prefix="h:", max_value_bytes=1 * MiB)
    r = rs.client()
    keys = [key(i) for i in range(4)]
    for k in keys:  # 4 planted values of 64 MiB under the names of real blocks
        r.setrange("h:" + namespaced_key("", k).hex(), 64 * MiB - 1, b"x")
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    for _ in range(4):
        assert t.get_many(keys[_:], ns="") == [None] * (4 - _)
    done.set()
    th.join()
    grew = peak[0] - base
    st = t.stats()
    print(f"4 planted 64 MiB values read 4 times at --redis-max-value 1MiB: peak RSS +{grew / MiB:.1f} MiB, "
          f"too_large_values {st['too_large_values']}")
    assert st["too_large_values"] == 4 and st["bad_values"] == 4
    assert grew < 16 * MiB, grew  # at most one batch of 1 MiB reads; was +760 MiB for one 256 MiB value
    t.close()


def test_values_without_a_key_file_are_said_to_be_unauthenticated_once(redis_server, caplog, tmp_path):
    rs = redis_server()
    redis_tier._warned_unauthenticated = False
    with caplog.at_level(logging.WARNING, logger="cxlalloc.kvstore.redis"):
        a = RedisTier(rs.url)
        b = RedisTier(rs.url)
    said = [r.getMessage() for r in caplog.records if "not authenticated" in r.getMessage()]
    assert len(said) == 1 and "--redis-key-file" in said[0], said
    a.close()
    b.close()
    kf = tmp_path / "k"
    kf.write_bytes(b"0123456789abcdef0123")
    kf.chmod(0o600)
    redis_tier._warned_unauthenticated = False
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cxlalloc.kvstore.redis"):
        c = RedisTier(rs.url, key_file=str(kf))
    assert not [r for r in caplog.records if "not authenticated" in r.getMessage()]
    c.close()
