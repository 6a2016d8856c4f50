"""The kv-server as an LMCache remote-storage plugin (``cxlalloc://``), driven by
the real ``lmcache`` package (pinned, scripts/install_lmcache.sh) through the
storage backends LMCache builds from its YAML config, against real kv-servers
(in this process, or real processes that are killed) and a real redis-server.

Skipped with the reason when lmcache is not importable, except under CI=true.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading

import pytest

from tests.kvstore.kvutil import ROOT, subprocess_env
from tests.helpers.wait import wait_until
from tests.kvstore.engines.lmc import CHUNK_TOKENS, LMCACHE_VERSION, Engine, config_yaml, import_lmcache, lmcache_site, same_bytes

MiB = 1 << 20

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def lmcache():
    return import_lmcache()


@pytest.fixture
def engine(lmcache, sockdir):
    made = []

    def make(url, **kw):
        e = Engine(config_yaml(os.path.join(sockdir, f"lmcache{len(made)}.yaml"), url), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _url(srv_or_proc, opts="timeout=2"):
    return "cxlalloc://" + (srv_or_proc.socket if hasattr(srv_or_proc, "socket") else srv_or_proc.socket_path) + \
        ("?" + opts if opts else "")


def _put(eng, keys, objs):
    """LMCache's put path (batched_submit_put_task), waited for (its per-key completion callback)."""
    done = []
    eng.remote.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    assert wait_until(lambda: len(done) == len(keys), timeout=20), "put tasks did not finish"


# ----------------------------------------------------------------- discovery, round trips
def test_lmcache_discovers_the_plugin_from_its_config(engine, kv_server, lmcache):
    from cxlalloc.kvstore.engines.lmcache_plugin import CxlallocConnector

    assert lmcache.__version__ == LMCACHE_VERSION  # the pin of scripts/install_lmcache.sh
    srv = kv_server()
    eng = engine(_url(srv))
    assert "RemoteBackend-cxlalloc" in eng.backends
    assert isinstance(eng.connector, CxlallocConnector)
    assert eng.connector.store.connected()
    assert eng.connector.store.stats()["pool_id"] == srv.pool_id


def test_a_config_naming_the_old_module_path_still_loads_the_plugin(kv_server, lmcache, sockdir):
    """LMCache YAML written before the plugin moved to cxlalloc/kvstore/engines/ names
    ``cxlalloc.kvstore.engines.lmcache_plugin``: the alias module gives LMCache the same plugin."""
    import importlib

    from cxlalloc.kvstore.engines import PLUGIN_MODULE
    from cxlalloc.kvstore.engines import lmcache_plugin as moved

    assert PLUGIN_MODULE == "cxlalloc.kvstore.engines.lmcache_plugin"
    assert importlib.import_module("cxlalloc.kvstore.engines.lmcache_plugin") is moved
    srv = kv_server()
    path = config_yaml(os.path.join(sockdir, "old.yaml"), _url(srv))
    text = open(path).read()
    assert f"module_path: {PLUGIN_MODULE}" in text
    with open(path, "w") as f:
        f.write(text.replace(PLUGIN_MODULE, "cxlalloc.kvstore.engines.lmcache_plugin"))
    eng = Engine(path)
    try:
        assert isinstance(eng.connector, moved.CxlallocConnector)
        k, mo = eng.key(0), eng.chunk(0)
        eng.remote.submit_put_task(k, mo).result(10)
        got = eng.remote.get_blocking(k)
        assert same_bytes(got, mo)
        got.ref_count_down()
        mo.ref_count_down()
    finally:
        eng.close()


def test_put_get_exists_list_round_trip_byte_identical(engine, kv_server):
    srv = kv_server()
    eng = engine(_url(srv, "timeout=2&namespace=tenant-a"))
    keys = [eng.key(i) for i in range(4)]
    objs = [eng.chunk(i) for i in range(3)] + [eng.chunk(3, tokens=CHUNK_TOKENS // 2)]  # an unfull last chunk
    assert not eng.remote.contains(keys[0])
    eng.remote.submit_put_task(keys[0], objs[0]).result(10)       # put
    _put(eng, keys[1:], objs[1:])                                 # batched put
    assert all(eng.remote.contains(k) for k in keys)             # exists (async path)
    assert eng.connector.exists_sync(keys[2])
    got = eng.remote.get_blocking(keys[0])                        # get
    assert same_bytes(got, objs[0]) and got.get_shapes() == objs[0].get_shapes()
    many = eng.remote.batched_get_blocking(keys)                  # batched get
    assert all(same_bytes(g, o) for g, o in zip(many, objs))
    assert many[3].get_shapes()[0][2] == CHUNK_TOKENS // 2       # the unfull chunk keeps its token count
    assert sorted(eng.run(eng.connector.list())) == sorted(k.to_string() for k in keys)
    # in the pool: one block per chunk, in the tenant's per-model namespace
    pool = srv.stats()["pool"]
    assert pool["blocks"] == 4
    s = eng.connector.stats()
    assert s["stored_blocks"] == 4 and s["hit_blocks"] >= 5 and s["bad_blocks"] == 0
    for mo in [got, *many, *objs]:
        mo.ref_count_down()


def test_batched_contains_stops_at_the_first_miss(engine, kv_server):
    srv = kv_server()
    eng = engine(_url(srv))
    keys = [eng.key(i) for i in range(6)]
    objs = [eng.chunk(i) for i in (0, 1, 3, 4)]
    _put(eng, [keys[i] for i in (0, 1, 3, 4)], objs)
    before = srv.stats()["pool"]["lookups"]
    assert eng.remote.batched_contains(keys) == 2                 # 0, 1 stored; 2 missing; 3, 4 not counted
    assert srv.stats()["pool"]["lookups"] == before + 1           # one kv-server lookup for the whole prefix
    assert eng.run(eng.connector.batched_async_contains("l1", keys)) == 2
    assert eng.remote.batched_contains(keys[3:5]) == 2
    assert eng.remote.batched_contains(keys[2:]) == 0
    got = eng.run(eng.connector.batched_get_non_blocking("l2", keys))  # prefetch: the stored prefix only
    assert len(got) == 2 and all(same_bytes(g, o) for g, o in zip(got, objs))
    full = eng.remote.batched_get_blocking(keys)                  # a plain batched get skips the hole
    assert [g is not None for g in full] == [True, True, False, True, True, False]
    assert same_bytes(full[3], objs[2]) and same_bytes(full[4], objs[3])
    for mo in [*got, *[g for g in full if g is not None], *objs]:
        mo.ref_count_down()


def test_namespaces_separate_models_and_tenants(engine, kv_server):
    from cxlalloc.kvstore.engines.lmcache_plugin import namespace_of, server_key

    srv = kv_server()
    a = engine(_url(srv, "namespace=tenant-a"))
    b = engine(_url(srv, "namespace=tenant-b"))
    other_model = engine(_url(srv, "namespace=tenant-a"), model="other-model")
    mo = a.chunk(7)
    _put(a, [a.key(7)], [mo])
    assert a.remote.contains(a.key(7))
    assert not b.remote.contains(b.key(7))                       # same key string, another tenant
    assert not other_model.remote.contains(other_model.key(7))   # same chunk hash, another model
    assert namespace_of("tenant-a", a.key(7)) == "tenant-a/tiny-llama@1@0@bfloat16"
    assert server_key(a.key(7)) == server_key(a.key(7)) and len(server_key(a.key(7))) == 32
    mo.ref_count_down()


def test_bad_urls_name_the_option(lmcache):
    from cxlalloc.kvstore.engines.lmcache_plugin import parse_url

    assert parse_url("cxlalloc:///tmp/kv.sock?timeout=3&namespace=t1") == ("/tmp/kv.sock", 3.0, "t1")
    for url, word in [("unix:///tmp/kv.sock", "cxlalloc:///run/cxlalloc/kv.sock"),
                      ("cxlalloc:///tmp/kv.sock?fallback=1GiB", "allowed: timeout"),
                      ("cxlalloc:///tmp/kv.sock?timeout=-1", "timeout"),
                      ("cxlalloc:///tmp/kv.sock?namespace=a/b", "namespace"),
                      ("cxlalloc://", "socket path")]:
        with pytest.raises(ValueError, match=word):
            parse_url(url)


def test_the_connector_keeps_lmcaches_connector_contract(lmcache):
    """LMCache's own completeness rule for connectors: every abstract method of
    RemoteConnector is implemented, with the base class's parameter names (what
    InstrumentedRemoteConnector forwards), and every batched form it offers is announced."""
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

    from cxlalloc.kvstore.engines.lmcache_plugin import CxlallocConnector

    abstract = {n for n, f in inspect.getmembers(RemoteConnector, inspect.isfunction)
                if getattr(f, "__isabstractmethod__", False)}
    assert abstract <= set(CxlallocConnector.__dict__), abstract - set(CxlallocConnector.__dict__)
    assert not getattr(CxlallocConnector, "__abstractmethods__", set())
    for name in set(CxlallocConnector.__dict__) & set(dir(RemoteConnector)):
        if name.startswith("_") or not callable(getattr(RemoteConnector, name)):
            continue
        base = [p for p in inspect.signature(getattr(RemoteConnector, name)).parameters if p != "self"]
        ours = [p for p in inspect.signature(getattr(CxlallocConnector, name)).parameters if p != "self"]
        assert base == ours, (name, base, ours)
        if inspect.iscoroutinefunction(getattr(RemoteConnector, name)):
            assert inspect.iscoroutinefunction(getattr(CxlallocConnector, name)), name
    for form in ("batched_get", "batched_put", "batched_contains", "batched_async_contains",
                 "batched_get_non_blocking"):
        assert getattr(CxlallocConnector, "support_" + form)(None) is True
    assert CxlallocConnector.support_ping(None) is False  # LMCache's health check must not see the pool


def test_a_pool_that_is_down_never_makes_lmcache_unhealthy(engine, server_proc):
    """LMCache's own RemoteBackendHealthCheck (what its health monitor runs every 30 s; a failure switches off
    every tier, the local CPU one too) passes while the kv-server is killed: a down pool is a miss."""
    from lmcache.v1.health_monitor.checks.remote_backend_check import RemoteBackendHealthCheck

    sp = server_proc("--size", "64MiB", "--chunk", "4MiB")
    eng = engine(_url(sp, "timeout=1"))
    check = RemoteBackendHealthCheck(eng.remote)
    assert check.check() is True
    sp.kill()
    key, mo = eng.key(1), eng.chunk(1)
    _put(eng, [key], [mo])                                    # a miss, not an error
    assert not eng.remote.contains(key)
    assert check.check() is True
    mo.ref_count_down()


def test_a_wrong_url_is_one_clear_error_at_start(lmcache, sockdir, caplog):
    """A malformed URL stops the plugin's creation with one line naming the option (LMCache re-raises
    PluginConfigError: no remote backend is created, so no misleading "Connected to remote storage"); a
    well-formed URL with no kv-server behind it logs one error naming the socket, and the connector runs (misses)."""
    from lmcache.v1.exceptions import IrrecoverableException

    from cxlalloc.kvstore.engines.lmcache_plugin import PluginConfigError

    eng = Engine(config_yaml(os.path.join(sockdir, "bad.yaml"), "cxlalloc:///tmp/kv.sock?fallback=1GiB"))
    try:
        assert not any(n.startswith("RemoteBackend") for n in eng.backends)   # LMCache logged our error, went on
        assert "LocalCPUBackend" in eng.backends
    finally:
        eng.close()
    assert issubclass(PluginConfigError, IrrecoverableException) and issubclass(PluginConfigError, ValueError)
    missing = os.path.join(sockdir, "no-such.sock")
    with caplog.at_level("ERROR", logger="cxlalloc.kvstore.lmcache"):
        eng = Engine(config_yaml(os.path.join(sockdir, "down.yaml"), "cxlalloc://" + missing))
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "cxlalloc.kvstore.lmcache"]
        assert len(lines) == 1 and missing in lines[0] and "cxlalloc kv-server --socket" in lines[0], lines
        assert "RemoteBackend-cxlalloc" in eng.backends and not eng.remote.contains(eng.key(3))
    finally:
        eng.close()


# ----------------------------------------------------------------- across processes, Redis, crashes
def test_a_chunk_put_by_one_processes_lmcache_is_found_by_anothers(engine, server_proc, sockdir):
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB")
    url = _url(sp)
    cfg = config_yaml(os.path.join(sockdir, "child.yaml"), url)
    env = subprocess_env()
    env["CXLALLOC_LMCACHE_SITE"] = lmcache_site()
    out = subprocess.run([sys.executable, "-m", "tests.kvstore.engines.lmc", "put", cfg, "100", "3"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "stored 3" in out.stdout
    eng = engine(url)
    keys = [eng.key(i) for i in (100, 101, 102)]
    assert eng.remote.batched_contains(keys) == 3
    got = eng.remote.batched_get_blocking(keys)
    assert all(same_bytes(g, seed) for g, seed in zip(got, (100, 101, 102)))  # the child's seeds: its bytes
    for mo in got:
        mo.ref_count_down()


def test_chunks_evicted_to_redis_are_read_back_byte_identical(engine, kv_server, redis_server):
    from cxlalloc.kvstore.tiers.redis import RedisTier

    rs = redis_server()
    srv = kv_server(size=2 * MiB, chunk=1 * MiB, redis=RedisTier(rs.url))  # 32 KiB chunks: ~60 fit
    eng = engine(_url(srv))
    n = 100
    keys = [eng.key(i) for i in range(n)]
    for i in range(0, n, 10):  # in batches: LMCache's CPU buffer is small
        objs = [eng.chunk(j) for j in range(i, i + 10)]
        _put(eng, keys[i:i + 10], objs)
        for mo in objs:
            mo.ref_count_down()
    assert srv.stats()["pool"]["evicted_blocks"] >= 30
    assert srv.redis.flush(10)
    got = eng.remote.batched_get_blocking(keys[:10])      # the oldest: evicted, found in Redis, loaded back
    assert all(same_bytes(g, j) for j, g in enumerate(got))
    assert srv.stats()["pool"]["redis_hit_blocks"] >= 10
    for mo in got:
        mo.ref_count_down()


def test_server_killed_under_load_is_a_miss_then_recovers(engine, server_proc):
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB")
    eng = engine(_url(sp, "timeout=1"))
    errors, rounds, stop = [], [0], threading.Event()
    stored = [eng.chunk(10_000)]
    _put(eng, [eng.key(10_000)], stored)

    def load():
        i = 0
        while not stop.is_set():
            try:
                k, mo = eng.key(i), eng.chunk(i)
                eng.remote.submit_put_task(k, mo).result(10)
                mo.ref_count_down()
                g = eng.remote.get_blocking(k)
                if g is not None:
                    if not same_bytes(g, i):
                        errors.append(f"chunk {i}: wrong bytes")
                    g.ref_count_down()
                eng.remote.batched_contains([eng.key(i - 1), k])
            except Exception as e:  # nothing may reach LMCache's caller
                errors.append(f"{type(e).__name__}: {e}")
            i += 1
            rounds[0] = i

    t = threading.Thread(target=load, daemon=True)
    t.start()
    assert wait_until(lambda: rounds[0] >= 20, timeout=20)
    sp.kill()                                            # SIGKILL mid-load
    r0 = rounds[0]
    assert wait_until(lambda: rounds[0] >= r0 + 10, timeout=20)           # the load goes on: misses, not exceptions
    assert not eng.remote.contains(eng.key(10_000))      # the old pool is gone: a miss
    sp.start()                                           # restarted on the same socket, a new pool
    k, mo = eng.key(20_000), eng.chunk(20_000)
    assert wait_until(lambda: (eng.remote.submit_put_task(k, mo).result(10), eng.remote.contains(k))[1], 30)
    stop.set()
    t.join(30)
    assert errors == []
    got = eng.remote.get_blocking(k)
    assert same_bytes(got, mo)
    c = eng.connector.stats()["client"]
    assert c["server_restarts"] >= 1 and c["server_errors"] >= 1
    for m in (mo, got, *stored):
        m.ref_count_down()


def test_a_full_pool_or_an_oversized_chunk_is_a_miss(engine, kv_server):
    from cxlalloc.kvstore.engines.lmcache_plugin import namespace_of, server_key

    tiny = kv_server(size=32 * 1024, chunk=32 * 1024, name="tiny.sock")  # 32 KiB slots: chunk + header is more
    eng = engine(_url(tiny))
    mo = eng.chunk(1)
    _put(eng, [eng.key(1)], [mo])                                          # no exception into LMCache
    assert not eng.remote.contains(eng.key(1))
    assert eng.connector.stats()["put_skipped"] == 1 and eng.remote.put_failed_count == 0

    # room for a few chunks only; one client may pin all of it (the default --max-pinned, half the pool, would
    # refuse the filling lookups below before the pool is full)
    srv = kv_server(size=256 * 1024, chunk=64 * 1024, max_pinned=1.0)
    eng2 = engine(_url(srv))
    keys = [eng2.key(i) for i in range(8)]
    _put(eng2, keys[:2], [mo, mo])
    assert eng2.remote.batched_contains(keys[:2]) == 2
    ns = namespace_of(eng2.connector.tenant, keys[0])
    held = []
    i = 2
    while True:  # fill and pin every slot: nothing can be evicted
        _put(eng2, [keys[i % 8]], [mo])
        lease = eng2.connector.store.lookup(ns, [server_key(keys[i % 8])])
        if not lease.blocks:
            break
        held.append(lease)
        i += 1
        assert i < 40
    held += [eng2.connector.store.lookup(ns, [server_key(k)]) for k in keys[:2]]
    skipped = eng2.connector.stats()["put_skipped"]
    new = eng2.key(99)
    _put(eng2, [new], [mo])                                                # the pool is full and pinned: a miss
    assert not eng2.remote.contains(new) and eng2.connector.stats()["put_skipped"] == skipped + 1
    for lease in held:
        lease.close()
    _put(eng2, [new], [mo])                                                # room again (LRU eviction)
    assert eng2.remote.contains(new)
    mo.ref_count_down()


# ----------------------------------------------------------------- integrity (issue 29, item 5)
def test_a_chunk_changed_in_the_pool_is_a_miss_dropped_and_a_sound_one_cannot_be_dropped(engine, kv_server):
    """Each chunk ends in the block store's checksum trailer (XXH3-128 of its server key, header and payload),
    sealed after the copy into the pool and verified on the reader's own copy: a bit another client flips in a
    stored chunk is a miss (never returned to LMCache), dropped by the server after its own check; a client
    cannot drop a sound chunk."""
    from tests.kvstore.kvutil import RawClient
    from cxlalloc.kvstore.engines.lmcache_plugin import _names

    srv = kv_server()
    eng = engine(_url(srv))
    keys = [eng.key(i) for i in range(2)]
    objs = [eng.chunk(i) for i in range(2)]
    _put(eng, keys, objs)
    conn = eng.connector
    names = [_names(conn.tenant, k) for k in keys]
    other = RawClient(srv.socket_path, name="buggy")  # another client, its own read-write mapping of the pool
    reply = other.call("lookup", ns=names[0][0], keys=[sk for _, sk in names])
    (off0, n0, _), (off1, _, _) = reply["blocks"][:2]
    other.call("release", leases=[reply["lease"]])
    assert other.call("discard", ns=names[1][0], keys=[names[1][1]])["dropped"] == 0  # sound: not dropped
    mm = other.mapping()
    mm[off0 + n0 // 2] ^= 0x01  # one bit in the middle of chunk 0's payload
    got = eng.remote.get_blocking(keys[0])
    assert got is None  # a miss, not the changed bytes
    s = conn.stats()
    assert s["corrupt_blocks"] == 1 and s["bad_blocks"] == 1
    assert not conn.exists_sync(keys[0])  # the server verified it and dropped it: the engine recomputes it
    good = eng.remote.get_blocking(keys[1])
    assert same_bytes(good, objs[1])  # the sound chunk beside it is served byte-identical
    for mo in [good, *objs]:
        mo.ref_count_down()
    mm.close()
    other.close()


def test_get_verifies_the_bytes_it_copied_not_the_pool(engine, kv_server, monkeypatch):
    """Issue 29 item 6 on the LMCache get path: a byte changed in the pool after every check of the chunk's header
    and before the copy (layout's test hook runs there, with the pool's source view) is never returned: the get
    copies the pool once, into LMCache's own memory object, and verifies the checksum over that copy.  A check
    taken in the pool before the copy would have passed and returned the changed byte."""
    from cxlalloc.kvstore import layout

    srv = kv_server()
    eng = engine(_url(srv))
    keys = [eng.key(i) for i in range(2)]
    objs = [eng.chunk(i) for i in range(2)]
    _put(eng, keys, objs)
    seen = []

    def flip(src):  # another client's write, landing between the checks and the copy
        seen.append(src.numel())
        src[src.numel() // 2] ^= 0x01

    monkeypatch.setattr(layout, "_before_copy", flip)
    assert eng.remote.get_blocking(keys[0]) is None            # a miss, never the changed bytes
    assert seen == [objs[0].get_size()]                         # the hook ran once, on the chunk's payload
    s = eng.connector.stats()
    assert s["corrupt_blocks"] == 1 and s["hit_blocks"] == 0
    monkeypatch.setattr(layout, "_before_copy", None)
    good = eng.remote.get_blocking(keys[1])
    assert same_bytes(good, objs[1])                            # the sound chunk: byte-identical
    for mo in [good, *objs]:
        mo.ref_count_down()
