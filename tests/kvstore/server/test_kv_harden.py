"""A real kv-server process under the attacks of issue 29 that bound shared
resources: pinned tiny blocks on top of every chunk (eviction must not be
pinned away).  Each test states the figure it measures."""

from __future__ import annotations

from tests.kvstore.kvutil import RawClient, key
from tests.kvstore.server.hostile_util import PeakRss, raw_hello, rss

MiB = 1 << 20
KiB = 1 << 10


def _attacker_fills_the_pool(sp):
    """An attacker that fills the 64 MiB pool with 16,384 one-byte blocks (a 4 KiB page each), committed:
    ``(client, keys, slot offsets)``."""
    atk = RawClient(sp.socket, want_fd=False, name="attacker")
    keys = [key(i, b"atk") for i in range(16384)]
    r = atk.call("reserve", ns="a", keys=keys, nbytes=1, tokens=1)
    assert r["ok"] and sum(s is not None for s in r["slots"]) == 16384
    assert atk.call("commit", res=r["res"])["published"] == 16384
    return atk, keys, r["slots"]


def _honest_writer_fills_what_is_left(sp):
    """An honest writer of 1,024 blocks of 64 KiB (the pool's capacity), 128 a request: ``(client, keys, the
    pool's status, how many of its blocks the pool kept)``."""
    honest = RawClient(sp.socket, want_fd=False, name="honest")
    hkeys = [key(i, b"honest") for i in range(1024)]
    for i in range(0, 1024, 128):
        r = honest.call("reserve", ns="h", keys=hkeys[i:i + 128], nbytes=64 * KiB, tokens=16)
        assert r["ok"], r
        honest.call("commit", res=r["res"])
    pool = sp.status()["pool"]
    return honest, hkeys, pool, pool["namespaces"]["h"]["used_bytes"] // (64 * KiB)


def test_pinned_tiny_blocks_on_top_of_every_chunk_keep_90_percent_of_the_honest_capacity(server_proc):
    # 64 MiB pool, 16 chunks of 4 MiB.  The attacker fills it with 16,384 one-byte blocks (a 4 KiB page
    # each), then pins the top block of every chunk (one lease, kept open): 64 KiB pinned in all.
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--log-level", "error")
    atk, keys, slots = _attacker_fills_the_pool(sp)
    tops = [k for k, off in zip(keys, slots) if (off + 4 * KiB) % (4 * MiB) == 0]
    assert len(tops) == 16
    lease = atk.call("lookup", ns="a", keys=tops)
    assert lease["ok"] and len(lease["blocks"]) == 16
    # An honest writer of 64 KiB blocks: 1,024 fit the pool; 16 x 63 = 1,008 fit below the pinned tops.
    honest, hkeys, pool, kept = _honest_writer_fills_what_is_left(sp)
    capacity = 64 * MiB // (64 * KiB)
    print(f"honest capacity under the pinned-top attack: {kept}/{capacity} blocks ({kept / capacity:.1%})")
    assert kept >= 0.9 * capacity, (kept, pool)
    assert pool["pinned_blocks"] == 16
    # What was kept is served: the last 512 written are all hits.
    got = honest.call("lookup", ns="h", keys=hkeys[-512:])
    assert got["ok"] and len(got["blocks"]) == 512
    atk.close()
    honest.close()


def test_one_client_pins_up_to_max_pinned_then_is_refused_and_anothers_capacity_stays_above_90_percent(
        server_proc):
    # The fragmenting form of the attack: one pinned page in every 64 KiB span spoils that span for a 64 KiB
    # block, so a client's pins must be bounded.  --max-pinned 256KiB: 64 one-page pins at most, so an honest
    # writer of 64 KiB blocks loses at most 64 of the pool's 1,024 (93.75 % kept).  Without the bound the
    # attacker pinned one page of every span and the honest writer kept nothing.
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--max-pinned", "256KiB", "--log-level", "error")
    atk, keys, _ = _attacker_fills_the_pool(sp)
    every_span = keys[::16]  # one page in each 64 KiB span of the pool
    got = atk.call("lookup", ns="a", keys=every_span)
    assert got["ok"] and len(got["blocks"]) == 64  # cut at its budget: the other 960 answered as misses
    more = atk.call("lookup", ns="a", keys=every_span[64:])
    assert more["code"] == "limit" and "--max-pinned" in more["error"]  # at the cap: refused
    honest, _, pool, kept = _honest_writer_fills_what_is_left(sp)
    print(f"honest capacity beside a client at --max-pinned 256KiB pinning one page per 64 KiB span: {kept}/1024 "
          f"({kept / 1024:.1%}); refused lookups {pool['refused_pin_budget']}, blocks not pinned "
          f"{pool['pin_budget_blocks']}")
    assert kept >= 0.9 * 1024, (kept, pool)
    assert pool["pinned_blocks"] == 64 and pool["max_pinned_bytes"] == 256 * KiB
    assert pool["refused_pin_budget"] == 1 and pool["pin_budget_blocks"] == 960 + 960
    atk.close()
    honest.close()


def test_a_frame_of_short_strings_and_64_frames_of_8_mib_stay_within_the_stated_rss_bound(server_proc):
    import struct
    import threading

    from cxlalloc.kvstore import protocol as P

    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--max-buffered", "64MiB", "--log-level", "error")
    pid = sp.proc.pid
    base = rss(pid)
    # 2.75 M two-character strings in 42 lists of 65,552 (8.26 MB, under --max-frame 8 MiB and --max-objects):
    # refused after the second list by --max-items (before: +193 MiB of resident memory).
    body = P._msgpack().packb({"op": "lookup", "ns": "", "keys": [["ab"] * (P.MAX_KEYS + 16)] * 42})
    assert len(body) < 8 << 20
    with PeakRss(pid) as peak:
        s = raw_hello(sp.socket, timeout=20)
        s.sendall(struct.pack("!I", len(body)) + body)
        r = P.recv_msg(s)[0]
        s.close()
    assert r["code"] == "bad_request" and "--max-items" in r["error"], r
    grew = peak.peak - base
    print(f"2.75 M short strings: peak RSS +{grew / MiB:.1f} MiB")
    assert grew < 32 * MiB, grew
    # 64 connections each sending a valid 8 MiB request at once (a ping with 2,040 bins of 4 KiB): the
    # requests of all connections stay within --max-buffered 64 MiB (those past it wait for room, then
    # are answered 'busy'); the peak stays under the budget plus 48 MiB (before: +1.28 GiB).
    frame = P.encode({"op": "ping", "pad": [b"x" * 4096] * 2040})
    assert (7 << 20) < len(frame) <= (8 << 20) + 4
    codes = []
    lock = threading.Lock()

    def one():
        try:
            c = raw_hello(sp.socket, timeout=20)
            c.sendall(frame)
            got = P.recv_msg(c)[0]
            code = "ok" if got.get("ok") else got["code"]
        except (OSError, P.ProtocolError, P.ConnectionClosed) as e:
            code = type(e).__name__
        with lock:
            codes.append(code)

    base = rss(pid)
    with PeakRss(pid) as peak:
        ts = [threading.Thread(target=one) for _ in range(64)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    grew = peak.peak - base
    st = sp.status()["server"]
    print(f"64 x 8 MiB requests: peak RSS +{grew / MiB:.1f} MiB, {codes.count('ok')} answered, "
          f"{len(codes) - codes.count('ok')} refused, buffered peak {st['buffered_peak_bytes'] / MiB:.1f} MiB")
    assert len(codes) == 64 and codes.count("ok") >= 1
    assert set(codes) <= {"ok", "busy", "BrokenPipeError", "ConnectionResetError"}, codes
    assert st["buffered_peak_bytes"] <= 64 * MiB
    assert grew < 64 * MiB + 48 * MiB, grew


HOG = r"""
import sys, time
from tests.kvstore.kvutil import RawClient, key
c = RawClient(sys.argv[1], want_fd=False, name="hog")
keys = [key(i, b"hog") for i in range(65536)]
r = c.call("reserve", ns="h", keys=keys, nbytes=1, tokens=1)
assert c.call("commit", res=r["res"])["published"] == 65536
print("ready", flush=True)
fresh = [key(i, b"fresh") for i in range(65536)]
end = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:
    got = c.call("lookup", ns="h", keys=keys)
    assert len(got["blocks"]) == 65536, got.get("error")
    c.call("release", leases=[got["lease"]])
    r = c.call("reserve", ns="h", keys=fresh, nbytes=1, tokens=1)
    c.call("abort", res=r["res"])
    n += 1
print("rounds", n, flush=True)
"""


def _p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def _probe_latencies(c, seconds):
    import time

    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        r = c.call("lookup", ns="p", keys=[key(1, b"probe")])
        out.append(time.perf_counter() - t0)
        assert r["ok"] and len(r["blocks"]) == 1
        c.call("release", leases=[r["lease"]])
        time.sleep(0.002)
    return out


def test_one_clients_65536_key_requests_leave_another_served_between_slices_and_its_disconnect_is_sliced(
        server_proc):
    # The latencies are a benchmark (bench --only kvfair, benchmarks/results/kvfair-cpu-2026-12-03): on a
    # loaded 2-core CI machine a p99 threshold is the scheduler's, not the server's.  What is checked here
    # cannot depend on timing: every probe lookup beside the attacker is answered with its block, the attacker
    # keeps making progress, the server's lock was handed from one client to another (first come, first
    # served: tests/kvstore/server/test_server_state.py checks the order slice by slice), and a 65,536-pin,
    # 65,536-reservation client is dropped in slices of --slice-keys / 4 blocks.
    import subprocess
    import sys

    from tests.kvstore.kvutil import ROOT, subprocess_env

    sp = server_proc("--size", "1GiB", "--chunk", "64MiB", "--log-level", "error")
    probe = RawClient(sp.socket, want_fd=False, name="probe")
    r = probe.call("reserve", ns="p", keys=[key(1, b"probe")], nbytes=4096, tokens=16)
    probe.call("commit", res=r["res"])
    quiet = _probe_latencies(probe, 1.0)
    hog = subprocess.Popen([sys.executable, "-c", HOG, sp.socket, "4"], cwd=ROOT, env=subprocess_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert hog.stdout.readline().strip() == "ready"
        busy = _probe_latencies(probe, 3.0)  # each asserts its block was found
        out = hog.communicate(timeout=120)[0]
    finally:
        hog.kill()
    rounds = int(out.split()[-1])
    pool = sp.status()["pool"]
    print(f"probe lookup p99: quiet {_p99(quiet) * 1e3:.2f} ms, beside 65,536-key requests {_p99(busy) * 1e3:.2f} ms "
          f"({len(busy)} lookups, {rounds} attacker rounds, {pool['lock_handoffs']} lock hand-offs); longest lock "
          f"hold {pool['lock_hold_ms_max']:.2f} ms of {pool['lock_holds']} holds")
    assert rounds >= 1 and len(busy) >= 10 and pool["lock_handoffs"] >= 1
    # A client holding 65,536 pins and 65,536 reservations disconnects: the lock is held in slices.
    c = RawClient(sp.socket, want_fd=False, name="leaver")
    got = c.call("lookup", ns="h", keys=[key(i, b"hog") for i in range(65536)])
    assert len(got["blocks"]) == 65536
    r = c.call("reserve", ns="h", keys=[key(i, b"leaver") for i in range(65536)], nbytes=1, tokens=1)
    assert sum(s is not None for s in r["slots"]) == 65536
    seq = pool["last_drop"]["seq"]
    c.close()
    import time
    deadline = time.monotonic() + 60
    while sp.status()["pool"]["last_drop"]["seq"] == seq and time.monotonic() < deadline:
        time.sleep(0.05)
    pool = sp.status()["pool"]
    d = pool["last_drop"]
    print(f"disconnect of a 65,536-pin, 65,536-reservation client: {d['holds']} holds of the lock, the longest "
          f"{d['hold_ms_max']:.2f} ms, {d['wall_ms']:.0f} ms in all")
    assert pool["pinned_blocks"] == 0 and pool["writing_blocks"] == 0
    per_hold = sp.status()["server"]["limits"]["slice_keys"] // 4
    assert d["pins"] == 65536 and d["blocks"] == 65536 and d["holds"] == 2 * 65536 // per_hold
    probe.close()


def test_256_idle_connections_do_not_lock_new_clients_out(server_proc):
    import socket
    import time

    from cxlalloc.kvstore import protocol as P

    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--max-clients", "256", "--hello-timeout", "1",
                     "--idle-timeout", "2", "--log-level", "error")
    silent = []
    for _ in range(256):  # connected, never a hello
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sp.socket)
        silent.append(s)
    t0 = time.monotonic()
    while True:  # refused ('limit') while the silent ones hold every place, admitted after --hello-timeout
        try:
            c = RawClient(sp.socket, want_fd=False, name="new")
            if c.hello.get("ok"):
                break
            c.close()
        except (OSError, P.ProtocolError, P.ConnectionClosed):
            pass
        assert time.monotonic() - t0 < 10, "new clients stayed locked out"
        time.sleep(0.1)
    waited = time.monotonic() - t0
    assert c.call("ping")["ok"]
    for s in silent:
        s.settimeout(2)
        assert P.recv_msg(s)[0]["code"] == "timeout"  # each told why, then closed
        s.close()
    c.close()
    # 255 greeted connections that then idle: closed after --idle-timeout, and their places come back.
    idle = [RawClient(sp.socket, want_fd=False, name="idle") for _ in range(255)]
    assert all(i.hello["ok"] for i in idle)
    time.sleep(2.5)
    fresh = [RawClient(sp.socket, want_fd=False, name="fresh") for _ in range(100)]
    assert all(f.hello["ok"] for f in fresh)
    st = sp.status()["server"]
    print(f"256 silent connections: a new client admitted after {waited:.1f} s (--hello-timeout 1); "
          f"closed_no_hello {st['closed_no_hello']}, closed_idle {st['closed_idle']}")
    assert st["closed_no_hello"] == 256 and st["closed_idle"] >= 255
    for x in idle + fresh:
        x.close()


def test_one_user_cannot_take_every_place(server_proc, sockdir):
    import os
    import subprocess
    import sys

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--socket-mode", "0666", "--max-clients", "16",
                     "--max-clients-per-uid", "4", "--log-level", "error")
    other = (r"import os, sys" "\n"
             r"from tests.kvstore.kvutil import RawClient, key" "\n"
             r"import cxlalloc.kvstore.protocol, msgpack, mmap, hashlib" "\n"
             r"os.setgid(65534); os.setuid(65534)  # after the imports: the checkout may be unreadable to nobody" "\n"
             r"cs = [RawClient(sys.argv[1], want_fd=False) for _ in range(6)]" "\n"
             r"print(' '.join('ok' if c.hello.get('ok') else c.hello['code'] for c in cs))")
    from tests.kvstore.kvutil import ROOT, subprocess_env

    out = subprocess.run([sys.executable, "-c", other, sp.socket], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["ok"] * 4 + ["limit"] * 2, out.stdout + out.stderr
    mine = [RawClient(sp.socket, want_fd=False) for _ in range(8)]  # the server's own user: not capped
    assert all(c.hello["ok"] for c in mine)
    assert sp.status()["server"]["refused_per_uid"] == 2
    for c in mine:
        c.close()


def test_resident_bytes_per_tiny_block_are_measured_and_bounded(server_proc):
    sp = server_proc("--size", "1GiB", "--chunk", "256MiB", "--log-level", "error")
    c = RawClient(sp.socket, want_fd=False)
    c.call("ping")
    base = rss(sp.proc.pid)
    n = 0
    for part in range(4):
        r = c.call("reserve", ns="", keys=[key(part * 65536 + i, b"tiny") for i in range(65536)], nbytes=1, tokens=1)
        n += c.call("commit", res=r["res"])["published"]
    per = (rss(sp.proc.pid) - base) / n
    pool = sp.status()["pool"]
    print(f"{n} one-byte blocks: {per:.0f} B of server RSS each (index estimate {pool['index_bytes_per_block']} B)")
    assert n == 4 * 65536 and per < 400, per
    c.close()
