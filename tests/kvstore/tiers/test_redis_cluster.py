"""The RESP tier on a real local Redis/Valkey Cluster (3 primaries + 3 replicas,
scripts/redis_cluster.sh, started once per session): blocks spread over every
slot, shared by two processes, a primary killed under load, a slot migrated
mid-run (ASK and MOVED), a node full, MAC'd values; no mock."""

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import cxlalloc.hf as hf
from cxlalloc.kvstore.keys import namespaced_key
from cxlalloc.kvstore.tiers.redis import RedisTier
from tests.kvstore.kvutil import ROOT, generate, key, prompts, subprocess_env, tiny_llama

BLOCK = 16 << 10


def _data(i, n=BLOCK):
    return bytes([i % 251]) * (n - 4) + i.to_bytes(4, "little")


def _prefix():
    return f"t{uuid.uuid4().hex[:8]}:"


def _slot(t, k, ns=""):
    from redis.crc import key_slot

    return key_slot(t._rkey(namespaced_key(ns, k)).encode())


def _fill(t, n, ns=""):
    keys = [key(i) for i in range(n)]
    for i, k in enumerate(keys):
        assert t.put(k, ns, _data(i))
    assert t.flush(20)
    assert t.stats()["put_blocks"] >= n
    return keys


def test_blocks_spread_over_every_primary_and_come_back_in_one_round(redis_cluster_up):
    t = RedisTier(redis_cluster_up.cluster_url, prefix=_prefix(), timeout=1.0)
    try:
        keys = _fill(t, 96)
        owners = {redis_cluster_up.port_of_slot(_slot(t, k)) for k in keys}
        assert owners == set(redis_cluster_up.primaries())  # no hash tags: every primary holds some
        before = t.stats()["cluster"]["node_pipelines"]
        assert t.get_many(keys) == [_data(i) for i in range(96)]
        st = t.stats()
        assert st["cluster"]["node_pipelines"] - before == 3  # one pipeline per primary, not one per key
        assert st["hit_blocks"] == 96 and st["hit_bytes"] == 96 * BLOCK and st["kind"] == "redis-cluster"
        assert st["cluster"]["primaries"] == 3 and st["cluster"]["slots_covered"] == 16384
        assert t.get_many(keys, ns="other") == [None] * 96  # namespaces stay apart
    finally:
        t.close()


def test_mac_values_on_the_cluster(redis_cluster_up, tmp_path):
    kf = tmp_path / "mac.key"
    kf.write_bytes(os.urandom(32))
    kf.chmod(0o600)
    prefix = _prefix()
    t = RedisTier(redis_cluster_up.cluster_url + f"?redis_key_file={kf}&prefix={prefix}")
    plain = RedisTier(redis_cluster_up.cluster_url, prefix=prefix)  # a writer without the key
    try:
        keys = _fill(t, 8)
        assert t.get_many(keys) == [_data(i) for i in range(8)] and t.stats()["authenticated"]
        plain.put(keys[3], "", b"forged" * 100)
        assert plain.flush(10)
        got = t.get_many(keys)
        assert got[:3] == [_data(i) for i in range(3)] and got[3:] == [None] * 5  # refused, never loaded
        assert t.stats()["forged_values"] == 1
    finally:
        t.close()
        plain.close()


def test_cluster_url_errors_and_one_server_behind_a_cluster_url(redis_server):
    with pytest.raises(ValueError, match="cluster has database 0 only"):
        RedisTier("redis+cluster://127.0.0.1:7000/3")
    with pytest.raises(ValueError, match="redis\\+cluster://host:port"):
        RedisTier("valkey://127.0.0.1:7000")
    rs = redis_server()  # no cluster mode: the same tier, every slot on that server
    t = RedisTier(f"redis+cluster://127.0.0.1:{rs.port}")
    try:
        keys = _fill(t, 5)
        assert t.get_many(keys) == [_data(i) for i in range(5)]
        assert t.stats()["cluster"]["standalone"] is True
    finally:
        t.close()


def _dead_port():
    import socket

    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_several_seeds_a_dead_first_seed_is_skipped(redis_cluster_up, alloc):
    """``redis+cluster://h1:p1,h2:p2``: every seed is given to redis-py (``startup_nodes``), so a URL whose
    first seed is dead reaches the cluster through the next one; in a ``kv_store=`` URL too (user trial)."""
    live = redis_cluster_up.primaries()[0]
    url = f"redis+cluster://127.0.0.1:{_dead_port()},127.0.0.1:{live}"
    t = RedisTier(url, prefix=_prefix(), timeout=1.0)
    try:
        keys = _fill(t, 24)
        assert t.get_many(keys) == [_data(i) for i in range(24)]
        st = t.stats()
        assert st["cluster"]["primaries"] == 3 and st["cluster"]["slots_covered"] == 16384
        assert st["url"] == url and st["kind"] == "redis-cluster"
    finally:
        t.close()
    from cxlalloc.kvstore.open import open_store

    store = open_store(f"redis+cluster://127.0.0.1:{_dead_port()},[::1]:{_dead_port()},127.0.0.1:{live}"
                       f"?prefix={_prefix()}", alloc(), limit=16 << 20)
    try:
        assert store.lower.get_many(keys) == [None] * 24  # another prefix: reached, and nothing of t's
    finally:
        store.close()


@pytest.mark.parametrize("url, needle", [
    ("redis+cluster://127.0.0.1:7000?bogus=1", "unknown query option 'bogus'; allowed: prefix, ttl, queue"),
    ("redis://127.0.0.1:6379/0?bogus=1&prefix=p", "unknown query option 'bogus'; allowed: prefix, ttl, queue"),
    ("redis+cluster://127.0.0.1:7000?db=0", "unknown query option 'db'"),  # a cluster has database 0 only
    ("redis://127.0.0.1:6379/0?ssl_ca_certs=/x", "unknown query option 'ssl_ca_certs'"),  # TLS options: rediss://
    ("redis+cluster://127.0.0.1:x", "seed '127.0.0.1:x' has port 'x'; allowed: 1..65535; use "
                                    "'redis+cluster://host:port[,host:port...]'"),
    ("redis+cluster://127.0.0.1:7000,:7001", "seed ':7001' has no host; use 'redis+cluster://host:port[,host"),
    ("redis+cluster://127.0.0.1:7000,127.0.0.1:99999", "has port '99999'"),
    ("redis+cluster://u:secret@127.0.0.1:7000,127.0.0.1:7001/2", "'redis+cluster://u:***@127.0.0.1:7000,127.0.0.1"
                                                                ":7001/2': a cluster has database 0 only"),
])
def test_url_errors_name_the_option_and_the_form_given(url, needle):
    """Unknown query options are refused naming the option and the allowed ones (one server and cluster URLs:
    ``?bogus=1`` used to be accepted silently); a bad cluster URL's error shows the cluster form, never the
    one-server form; a password never appears."""
    with pytest.raises(ValueError) as e:
        RedisTier(url, option="kv_store")
    text = str(e.value)
    assert text.startswith("cxlalloc option 'kv_store': ") and needle in text, text
    assert "secret" not in text
    if "+cluster" in url:
        assert "redis://host:port/db" not in text, text
    else:
        assert "redis+cluster://" not in text, text
    RedisTier("rediss://127.0.0.1:6390/0?ssl_ca_certs=/x&socket_timeout=2&prefix=p", timeout=0.2).close()  # allowed


def test_a_node_down_is_misses_for_its_slots_only_then_its_replica_serves(redis_cluster_up):
    c = redis_cluster_up
    t = RedisTier(c.cluster_url, prefix=_prefix(), timeout=0.5)
    stop = threading.Event()
    wrong, lat = [], []
    try:
        keys = _fill(t, 120)
        c.wait_ok()  # replicas have every value
        victim = c.primaries()[0]
        on_victim = {i for i, k in enumerate(keys) if c.port_of_slot(_slot(t, k)) == victim}
        assert 0 < len(on_victim) < 120

        def load():  # readers and writers keep going through the failover
            j = 1000
            while not stop.is_set():
                i = j % 120
                t0 = time.perf_counter()
                (v,) = t.get_many([keys[i]])
                lat.append(time.perf_counter() - t0)
                if v is not None and v != _data(i):
                    wrong.append(i)
                t.put(key(j), "", _data(j))
                j += 1

        th = threading.Thread(target=load)
        th.start()
        c.kill(victim)
        got = [t.get_many([k])[0] for k in keys]  # at once, before any failover
        hits = {i for i, v in enumerate(got) if v is not None}
        assert hits >= set(range(120)) - on_victim and not (hits & on_victim) or hits == set(range(120))
        assert all(got[i] == _data(i) for i in hits)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the replica is promoted; the tier learns it by itself
            got = t.get_many(keys)
            if all(v is not None for v in got):
                break
            time.sleep(0.1)
        stop.set()
        th.join(10)
        assert got == [_data(i) for i in range(120)]  # identical bytes from the promoted replica
        assert not wrong and t.stats()["bad_values"] == 0
        assert max(lat) < 2.0, max(lat)  # no read stalls (timeout 0.5 s; slack for a loaded 2-core machine)
        st = t.stats()["cluster"]
        assert st["node_errors"] >= 1 and st["topology_refreshes"] >= 1 and victim not in c.primaries()
    finally:
        stop.set()
        t.close()
        if c.pids.get(victim) == 0:
            c.restart(victim)  # it rejoins as a replica
        c.wait_ok()


def test_a_slot_migrated_mid_run_ask_then_moved(redis_cluster_up):
    c = redis_cluster_up
    t = RedisTier(c.cluster_url, prefix=_prefix(), timeout=1.0)
    stop = threading.Event()
    wrong, reads = [], [0]
    try:
        keys = _fill(t, 64)
        k0 = keys[0]
        slot = _slot(t, k0)
        src = c.port_of_slot(slot)
        dst = next(p for p in c.primaries() if p != src)
        rk0 = t._rkey(namespaced_key("", k0))

        def reader():
            while not stop.is_set():
                got = t.get_many(keys)
                reads[0] += 1
                wrong.extend(i for i, v in enumerate(got) if v is not None and v != _data(i))

        th = threading.Thread(target=reader)
        th.start()
        s, d = c.client(src), c.client(dst)
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", c.node_id(src))
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", c.node_id(dst))
        s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", rk0)  # k0 now on dst only
        assert t.get_many([k0]) == [_data(0)], t.stats()  # ASK followed (ASKING + GET on the importing node)
        assert t.stats()["cluster"]["ask"] >= 1, t.stats()
        c.migrate_slot(slot, dst)  # the rest, then SETSLOT NODE on both
        c.wait_ok()
        assert t.get_many(keys) == [_data(i) for i in range(64)], t.stats()  # MOVED followed
        st = t.stats()["cluster"]
        assert st["moved"] >= 1, st
        stop.set()
        th.join(10)
        assert not wrong and reads[0] > 0 and t.stats()["bad_values"] == 0, (wrong, reads, t.stats())
        t.put(k0, "", _data(7))  # writes go to the new owner too
        assert t.flush(10) and d.get(rk0) is not None and s.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    finally:
        stop.set()
        t.close()


def test_a_full_node_refuses_its_writes_only(redis_cluster_up):
    c = redis_cluster_up
    t = RedisTier(c.cluster_url, prefix=_prefix(), timeout=1.0)
    full = c.primaries()[1]
    r = c.client(full)
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", used + (64 << 10))
    try:
        keys = [key(i) for i in range(150)]
        for i, k in enumerate(keys):
            t.put(k, "", _data(i))
        assert t.flush(20)
        st = t.stats()
        on_full = {i for i, k in enumerate(keys) if c.port_of_slot(_slot(t, k)) == full}
        assert st["full_errors"] > 0 and st["put_blocks"] >= 150 - len(on_full)
        assert st["up"] is True
        for i, k in enumerate(keys):  # every other node took its blocks; nothing wrong comes back
            (v,) = t.get_many([k])
            assert v == _data(i) or (v is None and i in on_full)
    finally:
        r.config_set("maxmemory", 0)
        t.close()


def test_planted_huge_values_on_the_cluster_are_never_read_whole(redis_cluster_up):
    """The size cap of the one-server read holds on the cluster's per-node pipelines too (GETRANGE)."""
    c = redis_cluster_up
    t = RedisTier(c.cluster_url, prefix=_prefix(), timeout=1.0, max_value_bytes=BLOCK + 1024)
    try:
        keys = _fill(t, 8)
        r = c.client(c.port_of_slot(_slot(t, keys[5])))
        r.setrange(t._rkey(namespaced_key("", keys[5])), 8 << 20, b"x")  # the 6th grown to 8 MiB

        def getranges():
            return r.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0)

        before = getranges()
        assert t.get_many(keys) == [_data(i) for i in range(5)] + [None] * 3
        assert getranges() > before  # read up to the cap on that node (GETRANGE), never GET of 8 MiB
        st = t.stats()
        assert st["too_large_values"] == 1 and st["bad_values"] == 1 and st["hit_blocks"] == 5
    finally:
        t.close()


_CHILD = """
import sys, torch
import cxlalloc.hf as hf
from tests.kvstore.kvutil import generate, prompts, tiny_llama
url = sys.argv[1]
p1 = prompts()[0]
a = tiny_llama()
hf.wrap(a, device_limit="256MiB", host_limit="512MiB", kv_store=url, kv_store_limit="28KiB", block_tokens=8)
generate(a, p1)
_, r = generate(a, prompts(seed=99)[0])  # another document evicts p1's blocks to the cluster
hf.unwrap(a)  # closes the store: what was queued is sent
print("evicted", r["store"]["evicted_blocks"])
"""


def test_two_processes_share_blocks_through_the_cluster_identical_tokens(redis_cluster_up):
    url = redis_cluster_up.cluster_url + f"?prefix={_prefix()}"
    out = subprocess.run([sys.executable, "-c", _CHILD, url], cwd=ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert int(out.stdout.split("evicted")[1]) >= 4
    _, p2 = prompts()
    ref = tiny_llama()
    b = tiny_llama()
    hf.wrap(b, device_limit="256MiB", host_limit="512MiB", kv_store=url, kv_store_limit="28KiB", block_tokens=8)
    try:
        got, r = generate(b, p2)
        assert torch.equal(got, ref.generate(p2, max_new_tokens=8, do_sample=False))
        assert r["store"]["lower_hit_blocks"] >= 4 and r["last"]["hit_tokens"] >= 32, r["last"]
        lower = r["store"]["lower"]
        assert lower["kind"] == "redis-cluster" and lower["bad_values"] == 0
    finally:
        hf.unwrap(b)
