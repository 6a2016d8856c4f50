"""The Redis tier against a real redis-server on 127.0.0.1 (no mock): values,
checks, down / full / restarted, AUTH, TLS, and below both kinds of pool."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import cxlalloc.hf as hf
from cxlalloc.kvstore.client import RemoteBlockStore
from cxlalloc.kvstore.keys import namespaced_key
from cxlalloc.kvstore.tiers.redis import HEADER_BYTES, RedisTier, redact_url
from tests.kvstore.kvutil import ROOT, generate, key, prompts, subprocess_env, tiny_llama
from tests.helpers.wait import wait_until

MiB = 1 << 20
BLOCK = 64 << 10


def _data(i, n=BLOCK):
    return bytes([i % 251]) * n


def test_put_get_prefix_ttl_and_namespaces(redis_server):
    rs = redis_server()
    t = RedisTier(rs.url, prefix="test:kv:", ttl=60)
    keys = [key(i) for i in range(5)]
    for i, k in enumerate(keys[:3]):
        assert t.put(k, "ns1", _data(i))
    assert t.flush(5)
    got = t.get_many(keys, ns="ns1")
    assert got[:3] == [_data(0), _data(1), _data(2)] and got[3:] == [None, None]
    assert t.get_many(keys, ns="ns2") == [None] * 5  # another namespace: nothing
    r = rs.client()
    rkey = "test:kv:" + namespaced_key("ns1", keys[0]).hex()
    assert r.exists(rkey) and 0 < r.ttl(rkey) <= 60
    assert len(r.get(rkey)) == HEADER_BYTES + BLOCK
    st = t.stats()
    assert st["put_blocks"] == 3 and st["hit_blocks"] == 3 and st["up"] is True
    assert st["load_seconds_per_block"] is not None
    t.close()


def test_a_prefix_stops_at_the_first_miss(redis_server):
    rs = redis_server()
    t = RedisTier(rs.url, batch_keys=2)
    keys = [key(i) for i in range(6)]
    for i in (0, 1, 3, 4):  # 2 is missing
        t.put(keys[i], "", _data(i))
    t.flush(5)
    got = t.get_many(keys)
    assert got[:2] == [_data(0), _data(1)] and got[2:] == [None] * 4
    t.close()


def test_truncated_or_foreign_values_are_refused_not_loaded(redis_server):
    rs = redis_server()
    t = RedisTier(rs.url)
    k = key(1)
    t.put(k, "", _data(1))
    t.flush(5)
    r = rs.client()
    rk = t.prefix + namespaced_key("", k).hex()
    good = r.get(rk)
    r.set(rk, good[:-10])  # truncated
    assert t.get_many([k]) == [None]
    bad = bytearray(good)
    bad[-1] ^= 0xFF  # one flipped byte: CRC
    r.set(rk, bytes(bad))
    assert t.get_many([k]) == [None]
    r.set(t.prefix + namespaced_key("", key(2)).hex(), good)  # another key's value under this key
    assert t.get_many([key(2)]) == [None]
    r.set(rk, b"hello")  # foreign
    assert t.get_many([k]) == [None]
    assert t.stats()["bad_values"] == 4
    t.close()


def test_redis_down_never_blocks_or_raises_and_a_restart_delivers_the_queue(redis_server):
    rs = redis_server()
    t = RedisTier(rs.url, timeout=0.5)
    t.put(key(0), "", _data(0))
    assert t.flush(5)
    rs.stop()
    t0 = time.perf_counter()
    for i in range(1, 21):
        t.put(key(i), "", _data(i))  # queued, never waited for
    assert time.perf_counter() - t0 < 0.25  # vs the 0.5 s timeout a waited put would cost
    t0 = time.perf_counter()
    assert t.get_many([key(0)]) == [None]  # down: a miss (one timeout at most)
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    assert t.get_many([key(0)]) == [None]  # in the backoff: at once, not another 0.5 s timeout
    assert time.perf_counter() - t0 < 0.25
    st = t.stats()
    assert st["up"] is False and st["get_errors"] + st["put_errors"] >= 1 and st["skipped_down"] >= 1
    redis_server(port=rs.port)  # restarted (empty: --save "")
    assert wait_until(lambda: t.stats()["put_blocks"] >= 21, timeout=20)  # what was queued arrived
    assert t.get_many([key(i) for i in range(1, 21)]) == [_data(i) for i in range(1, 21)]
    assert t.stats()["reconnects"] >= 1
    t.close()


def test_redis_full_is_counted_and_reads_still_work(redis_server):
    rs = redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    t = RedisTier(rs.url)
    for i in range(64):  # 4 MiB into 2 MB
        t.put(key(i), "", _data(i))
    assert t.flush(10)
    st = t.stats()
    assert st["full_errors"] > 0 and st["put_blocks"] > 0 and st["up"] is True
    assert t.get_many([key(0)]) == [_data(0)]
    t.close()


def test_a_full_queue_drops_instead_of_waiting(redis_server):
    t = RedisTier("redis://127.0.0.1:1/0", queue_bytes=3 * (BLOCK + HEADER_BYTES), timeout=0.2)
    t0 = time.perf_counter()
    ok = [t.put(key(i), "", _data(i)) for i in range(10)]
    assert time.perf_counter() - t0 < 0.1
    assert ok.count(False) >= 6
    assert t.stats()["dropped_blocks"] >= 6
    t.close(timeout=0.2)


def test_auth_and_redaction(redis_server):
    rs = redis_server("--requirepass", "s3cret")
    good = f"redis://:s3cret@127.0.0.1:{rs.port}/0"
    t = RedisTier(good)
    t.put(key(1), "", _data(1))
    assert t.flush(5) and t.get_many([key(1)]) == [_data(1)]
    assert "s3cret" not in t.stats()["url"] and "***" in t.stats()["url"]
    t.close()
    bad = RedisTier(f"redis://:wrong@127.0.0.1:{rs.port}/0")
    assert bad.get_many([key(1)]) == [None]  # an AUTH failure is a miss, counted
    s = bad.stats()
    # counted as the read's own error, or (when the tier's background check met the refusal first, as on a
    # loaded machine) as a read skipped while the tier is down
    assert s["get_errors"] + s["skipped_down"] == 1, s
    bad.close(0.2)
    assert redact_url("redis://u:p@h:1/0") == "redis://u:***@h:1/0"


def _certs(d):
    """A CA and a server certificate for 127.0.0.1 (openssl)."""
    run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days",
        "2", "-subj", "/CN=cxlalloc-test-ca")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj",
        "/CN=127.0.0.1")
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "srv.pem", "-days", "2", "-extfile", "ext.cnf")
    return {"ca": os.path.join(d, "ca.pem"), "cert": os.path.join(d, "srv.pem"), "key": os.path.join(d, "srv.key")}


def test_tls_with_a_ca_passed_through(redis_server, tmp_path):
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make the test certificates)")
    certs = _certs(str(tmp_path))
    rs = redis_server(tls=certs)
    for t in (RedisTier(f"rediss://127.0.0.1:{rs.port}/0", ssl_ca_certs=certs["ca"]),
              RedisTier(f"rediss://127.0.0.1:{rs.port}/0?ssl_ca_certs={certs['ca']}&prefix=tls:")):
        t.put(key(1), "", _data(1))
        assert t.flush(5) and t.get_many([key(1)]) == [_data(1)], t.stats()
        t.close()
    untrusted = RedisTier(f"rediss://127.0.0.1:{rs.port}/0")  # no CA: the certificate is refused, counted
    assert untrusted.get_many([key(1)]) == [None] and untrusted.stats()["get_errors"] == 1
    untrusted.close(0.2)


def test_bad_urls_name_the_option():
    with pytest.raises(ValueError, match="'--redis'.*redis://host:port/db"):
        RedisTier("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="database must be a number"):
        RedisTier("redis://127.0.0.1:6379/abc")
    with pytest.raises(ValueError, match="'--redis-ttl'"):
        RedisTier("redis://127.0.0.1:6379/0", ttl=-1)


# ----------------------------------------------------------------- below a pool
def test_below_the_server_pool_evicted_blocks_come_back_after_a_restart(redis_server, kv_server, alloc):
    rs = redis_server()
    srv = kv_server(size=2 * MiB, chunk=1 * MiB, redis=RedisTier(rs.url), name="a.sock")  # 32 blocks
    st = RemoteBlockStore(srv.url, alloc())
    keys = [key(i) for i in range(48)]
    for i, k in enumerate(keys):
        res = st.reserve("t", [k], BLOCK, 16)
        res.views[0].copy_(torch.frombuffer(bytearray(_data(i)), dtype=torch.uint8))
        assert res.commit() == 1
    assert srv.stats()["pool"]["evicted_blocks"] >= 16
    assert srv.redis.flush(5)
    assert srv.stats()["redis"]["put_blocks"] >= 16
    st.close()
    srv.stop()  # the pool is gone; Redis keeps what was evicted
    srv2 = kv_server(size=2 * MiB, chunk=1 * MiB, redis=RedisTier(rs.url), name="b.sock")
    st2 = RemoteBlockStore(srv2.url, alloc())
    with st2.lookup("t", keys[:8]) as lease:  # a pool miss, found in Redis, loaded into the pool
        assert lease.blocks == 8
        assert [bytes(v.numpy()) for v in lease.views] == [_data(i) for i in range(8)]
    with st2.lookup("other", keys[:8]) as lease:
        assert lease.blocks == 0  # never across namespaces, in Redis either
    s = srv2.stats()
    assert s["pool"]["redis_hit_blocks"] == 8 and s["redis"]["hit_blocks"] == 8
    assert s["pool"]["hit_tokens"] == 8 * 16  # the tokens written with each block came back from Redis
    assert s["pool"]["tiers"] == {"pool": {"blocks": 0, "bytes": 0, "tokens": 0},
                                  "remote": {"blocks": 8, "bytes": 8 * BLOCK, "tokens": 8 * 16}}
    with st2.lookup("t", keys[:8]) as lease:  # now in the pool
        assert lease.blocks == 8
    assert srv2.stats()["pool"]["redis_hit_blocks"] == 8
    assert srv2.stats()["pool"]["tiers"]["pool"] == {"blocks": 8, "bytes": 8 * BLOCK, "tokens": 8 * 16}
    from cxlalloc.kvstore.server.metrics import render

    text = render(srv2.stats())
    assert 'cxlalloc_kv_served_tokens_total{source="remote"} 128.0' in text
    assert 'cxlalloc_kv_served_blocks_total{source="pool"} 8.0' in text
    # the pool found 8 of the 24 blocks looked up in it (the first 8 were read through from Redis: its hits)
    assert 'cxlalloc_kv_lookup_blocks_total{tier="pool"} 24.0' in text
    assert 'cxlalloc_kv_hit_blocks_total{tier="pool"} 8.0' in text and 'cxlalloc_kv_hit_blocks_total{tier="redis"} 8.0' in text
    assert 'cxlalloc_kv_hit_ratio{tier="pool"} 0.3333333333333333' in text
    st2.close()


def test_server_with_redis_down_still_serves_its_pool(redis_server, kv_server, alloc):
    rs = redis_server()
    srv = kv_server(redis=RedisTier(rs.url, timeout=0.3))
    rs.stop()
    st = RemoteBlockStore(srv.url, alloc())
    res = st.reserve("", [key(1)], BLOCK, 16)
    res.commit()
    t0 = time.perf_counter()
    with st.lookup("", [key(1), key(2), key(3)]) as lease:
        assert lease.blocks == 1
    assert time.perf_counter() - t0 < 1.5
    with st.lookup("", [key(1), key(2), key(3)]) as lease:
        assert lease.blocks == 1
    assert srv.stats()["redis"]["up"] is False
    st.close()


def test_in_process_store_with_redis_below_identical_tokens(redis_server):
    before = set(threading.enumerate())
    rs = redis_server()
    p1, p2 = prompts()
    ref = tiny_llama()
    a = tiny_llama()
    # 28 KiB (whole pages) holds 4 blocks of 6 KiB + a 16-byte checksum (3 layers x 2 heads x 32 x 4 B x 8
    # tokens): the first 4 blocks of p1 are stored, then another document's blocks evict them to Redis.
    hf.wrap(a, device_limit="256MiB", host_limit="512MiB", kv_store=rs.url, kv_store_limit="28KiB", block_tokens=8)
    out, r = generate(a, p1)
    assert torch.equal(out, ref.generate(p1, max_new_tokens=8, do_sample=False))
    _, r = generate(a, prompts(seed=99)[0])
    lower = r["store"]["lower"]
    assert r["store"]["evicted_blocks"] >= 4 and lower["queued_blocks"] >= 4
    assert wait_until(lambda: hf.stats(a)["hf"]["reuse"]["store"]["lower"]["put_blocks"] >= 4, timeout=10)
    b = tiny_llama()  # another store (another process, in real life), the same Redis
    hf.wrap(b, device_limit="256MiB", host_limit="512MiB", kv_store=rs.url, kv_store_limit="28KiB", block_tokens=8)
    out, r = generate(b, p2)
    assert r["last"]["hit_tokens"] >= 32, r["last"]
    assert torch.equal(out, ref.generate(p2, max_new_tokens=8, do_sample=False))
    assert r["store"]["lower_hit_blocks"] >= 4
    assert r["store"]["hit_tokens"] == 8 * r["store"]["lower_hit_blocks"]  # restored blocks report their tokens
    # per-tier attribution: every reused token of this call came from the Redis tier below the store
    last = r["last"]
    assert set(last["tiers"]) == {"remote"} and last["tiers"]["remote"]["tokens"] == last["reused_tokens"] >= 32
    assert last["tiers"]["remote"]["bytes"] == last["bytes_loaded"] > 0
    assert r["counters"]["tiers"]["remote"]["tokens"] == last["reused_tokens"]
    out, r = generate(b, p2)  # again: the previous turn's cache, kept in the model (no copy)
    assert torch.equal(out, ref.generate(p2, max_new_tokens=8, do_sample=False))
    assert r["last"]["tiers"] == {"vram_prefix": {"blocks": 0, "tokens": r["last"]["reused_tokens"], "bytes": 0}}
    assert r["counters"]["tiers"]["remote"]["tokens"] == last["reused_tokens"]  # unchanged
    # unwrap closes the stores the wraps opened from the URL: no Redis writer thread outlives them
    writers = [t for t in threading.enumerate() if t.name == "cxlalloc-redis-writer" and t not in before]
    assert len(writers) == 2
    hf.unwrap(a)
    hf.unwrap(b)
    for w in writers:
        w.join(5)
    assert not [t for t in writers if t.is_alive()]


@pytest.mark.filterwarnings("ignore::cxlalloc.kvstore.local.KVStoreWarning")
def test_kv_server_process_with_redis_write_through_survives_kill_9(redis_server, server_proc):
    rs = redis_server()
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--redis", rs.url, "--redis-mode", "through")
    p1, p2 = prompts()
    ref = tiny_llama()
    m = tiny_llama()
    # kv_conversation_limit=0: p2 must come back from Redis through the restarted server, not from the
    # process's own last-conversation cache (which would continue p1's 70 shared tokens)
    hf.wrap(m, device_limit="256MiB", host_limit="512MiB", kv_store=sp.url + "?timeout=2", block_tokens=8,
            kv_conversation_limit=0)
    generate(m, p1)
    r = rs.client()
    assert wait_until(lambda: len(r.keys("cxlalloc:kv:*")) >= 9, timeout=10)
    sp.kill()
    sp.start()  # empty pool; Redis has the blocks
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        out, st = generate(m, p2)
        assert torch.equal(out, ref.generate(p2, max_new_tokens=8, do_sample=False))
        if st["last"]["hit_tokens"]:
            break
        time.sleep(0.2)
    assert st["last"]["hit_tokens"] == 64
    assert sp.status()["pool"]["redis_hit_blocks"] >= 8
    assert st["last"]["tiers"] == {"remote": {"blocks": 8, "tokens": 64, "bytes": st["last"]["bytes_loaded"]}}
    out, st = generate(m, p2)  # now in the server's pool
    assert torch.equal(out, ref.generate(p2, max_new_tokens=8, do_sample=False))
    rt = st["last"]["reused_tokens"]
    assert rt >= 64 and st["last"]["tiers"] == {"pool": {"blocks": rt // 8, "tokens": rt,
                                                         "bytes": st["last"]["bytes_loaded"]}}
    assert st["counters"]["tiers"]["pool"]["tokens"] >= 64 and st["counters"]["tiers"]["remote"]["tokens"] >= 64


# ----------------------------------------------------------------- configuration and log volume
def test_a_redis_not_configured_as_a_cache_is_warned_about_once(redis_server, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="cxlalloc.kvstore")
    bare = redis_server()  # redis-server's defaults: noeviction, no maxmemory
    t = RedisTier(bare.url)
    try:
        warnings = t.check_config()
        assert len(warnings) == 2 and "noeviction" in warnings[0] and "no maxmemory" in warnings[1]
        assert t.check_config() == warnings  # once: not again
        assert sum("noeviction" in r.getMessage() for r in caplog.records) == 1
        assert t.stats()["config_warnings"] == warnings
    finally:
        t.close(0.5)
    cache = redis_server("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    t = RedisTier(cache.url)
    try:
        assert t.check_config() == []
    finally:
        t.close(0.5)
    locked = redis_server("--rename-command", "CONFIG", "")  # managed services often disable CONFIG
    t = RedisTier(locked.url)
    try:
        (w,) = t.check_config()
        assert "CONFIG GET refused" in w
    finally:
        t.close(0.5)


def test_up_down_changes_are_logged_at_most_once_per_window_with_a_count(redis_server, caplog, monkeypatch):
    import logging

    import cxlalloc.kvstore.tiers.redis as rt

    caplog.set_level(logging.WARNING, logger="cxlalloc.kvstore")
    monkeypatch.setattr(rt, "STATE_LOG_EVERY_S", 0.5)
    rs = redis_server()
    t = RedisTier(rs.url)
    try:
        caplog.clear()
        for _ in range(35):  # a flapping link: 70 transitions
            t._failed(ConnectionError("flap"), "put")
            t._ok()
        lines = [m for m in (r.getMessage() for r in caplog.records) if f"Redis {t.url} " in m and "reach" in m]
        assert len(lines) == 1 and "unreachable" in lines[0], lines
        time.sleep(0.6)
        t._failed(ConnectionError("flap"), "put")
        lines = [m for m in (r.getMessage() for r in caplog.records) if f"Redis {t.url} " in m and "reach" in m]
        assert len(lines) == 2 and "69 more up/down changes" in lines[1], lines
        assert t.stats()["state_changes_not_logged"] == 69
        t._ok()
    finally:
        t.close(0.5)


WORKER = r"""
import json, sys
import torch
import cxlalloc.hf as hf
from tests.kvstore.kvutil import generate, prompts, tiny_llama

url, which = sys.argv[1], int(sys.argv[2])
m = tiny_llama()
hf.wrap(m, device_limit="256MiB", host_limit="512MiB", kv_store=url, block_tokens=8)
out, r = generate(m, prompts()[which])
ref = tiny_llama().generate(prompts()[which], max_new_tokens=8, do_sample=False)
print(json.dumps({"same": bool(torch.equal(out, ref)), "hit_tokens": r["last"]["hit_tokens"],
                  "lower_hit_blocks": r["store"]["lower_hit_blocks"], "put": r["store"]["lower_put_blocks"]}))
"""  # exits without unwrap(): what is queued for Redis is sent at interpreter exit


def test_two_processes_share_through_an_in_process_redis_tier(redis_server):
    """Worker A, then worker B, each with ``kv_store="redis://..."`` (an
    in-process store over one Redis): A's committed blocks are written through
    (not only when evicted), so B hits them: 64 of its 75 prompt tokens, same
    tokens as without reuse.  (Writing only on eviction, B had 0 hits and
    Redis 0 keys.)"""
    rs = redis_server()

    def worker(which):
        p = subprocess.run([sys.executable, "-c", WORKER, rs.url, str(which)], capture_output=True, text=True,
                           env=subprocess_env(), cwd=ROOT, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    a = worker(0)
    assert a["same"] and a["hit_tokens"] == 0 and a["put"] >= 8
    assert len(rs.client().keys("cxlalloc:kv:*")) == a["put"]  # every committed block, sent before A exited
    b = worker(1)
    assert b["same"] and b["hit_tokens"] == 64 and b["lower_hit_blocks"] == 8, b
