"""Tenants the kv-server keeps apart, tested with two real uids (issue 31).

A real ``cxlalloc kv-server`` (run as root, as in CI) serves two tenants bound
to uids 65534 (``a``) and 65533 (``b``) by ``--tenant``; forked children drop
to those uids (``setgid``/``setuid``: no account is needed for a uid) and
speak the raw protocol.  Tenant ``b`` cannot read, overwrite, release,
discard, evict or time-probe ``a``'s blocks: it receives another memfd (its
own pool), and every key it sends is named inside its own tenant, so it
cannot address ``a``'s blocks at all.
"""

from __future__ import annotations

import json
import mmap
import os
import stat

import pytest

from cxlalloc.kvstore.keys import namespaced_key, namespaced_keys, redis_key
from tests.kvstore.kvutil import RawClient, key

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run children as two other uids")

UID_A, UID_B, UID_NONE, GID = 65534, 65533, 65532, 65534
BLOCK = 64 * 1024
KEYS = [key(i, b"tenant-doc") for i in range(4)]
A_BYTES = [bytes([0xA0 + i]) * BLOCK for i in range(4)]


def _as(uid, fn, gid=GID):
    """Run ``fn()`` in a forked child as ``uid``/``gid`` (no other groups);
    returns what it returned (JSON), or {'error': ...}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent runs no threads of ours; no server in this process
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001
                out = {"error": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return json.loads(f.read())


def _pool(c):
    return mmap.mmap(c.fd, c.hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _write(c, ns, keys, payloads):
    r = c.call("reserve", ns=ns, keys=keys, nbytes=BLOCK, tokens=16)
    m = _pool(c)
    for off, data in zip(r["slots"], payloads):
        m[off:off + BLOCK] = data
    m.close()
    return c.call("commit", res=r["res"])["published"]


def _read(c, ns, keys):
    """The bytes of the blocks a lookup finds (released after), as hex digests of their first bytes."""
    r = c.call("lookup", ns=ns, keys=keys)
    m = _pool(c)
    got = [bytes(m[off:off + n]) for off, n, _ in r["blocks"]]
    m.close()
    if r["lease"]:
        c.call("release", leases=[r["lease"]])
    return got


@pytest.fixture
def tenant_server(server_proc, sockdir):
    sub = os.path.join(sockdir, "run")  # the server makes the directory: 0750, group GID
    return server_proc("--size", "32MiB", "--chunk", "1MiB", "--group", str(GID), "--socket-mode", "0660",
                       "--tenant", f"a:{UID_A}:8MiB", "--tenant", f"b:{UID_B}", "--shared-namespace", "public=a",
                       socket_name="run/kv.sock"), sub


def test_tenant_b_cannot_read_overwrite_release_discard_or_evict_tenant_a_blocks(tenant_server):
    sp, sub = tenant_server
    st = os.stat(sub)
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == GID

    def a_writes():
        c = RawClient(sp.socket, name="a")
        out = {"tenant": c.hello["tenant"], "mapped": c.hello["mapped"], "ino": os.fstat(c.fd).st_ino,
               "published": _write(c, "doc", KEYS, A_BYTES)}
        out["read"] = [d == want for d, want in zip(_read(c, "doc", KEYS), A_BYTES)]
        lease = c.call("lookup", ns="doc", keys=KEYS)  # a holds a pin while b tries to release it
        out["lease"] = lease["lease"]
        c.close()
        return out

    a = _as(UID_A, a_writes)
    assert a["tenant"] == "a" and a["published"] == 4 and a["read"] == [True] * 4, a
    assert a["mapped"] == 8 << 20  # a maps its own 8 MiB pool, not the 32 MiB of the whole server

    def b_attacks():
        c = RawClient(sp.socket, name="b")
        m = _pool(c)
        out = {"tenant": c.hello["tenant"], "mapped": c.hello["mapped"], "ino": os.fstat(c.fd).st_ino,
               # a's bytes appear nowhere in the memory b maps
               "a_bytes_in_b_pool": any(m.find(d[:4096]) >= 0 for d in A_BYTES)}
        m.close()
        out["lookup"] = c.call("lookup", ns="doc", keys=KEYS)["blocks"]  # read: a miss
        out["release"] = c.call("release", leases=list(range(1, 64)))["released"]  # a's lease ids mean nothing here
        out["discard"] = c.call("discard", ns="doc", keys=KEYS)["dropped"]
        # "overwrite": b stores the same keys in the same namespace: its own blocks, in its own pool
        out["overwrite"] = _write(c, "doc", KEYS, [b"\xbb" * BLOCK] * 4)
        out["own_read"] = [d == b"\xbb" * BLOCK for d in _read(c, "doc", KEYS)]
        # evict: b writes 3x its pool (24 MiB of fresh blocks): it evicts only its own
        n = 0
        for batch in range(6):
            ks = [key(i, b"flood%d" % batch) for i in range(64)]
            n += _write(c, "flood", ks, [b"\x11" * BLOCK] * 64)
        out["flooded"] = n
        s = c.call("stats")["stats"]
        out["stats_tenants"] = sorted(s["tenants"])
        out["stats_uids"] = sorted({cl["uid"] for cl in s["clients"]})
        out["stats_ns"] = sorted(s["pool"]["namespaces"])
        out["stats_capacity"] = s["pool"]["capacity_bytes"]
        c.close()
        return out

    b = _as(UID_B, b_attacks)
    assert b["tenant"] == "b" and b["ino"] != a["ino"], b  # another memfd
    assert b["mapped"] == 24 << 20  # what --size leaves after a's 8 MiB
    assert b["a_bytes_in_b_pool"] is False
    assert b["lookup"] == [] and b["release"] == 0 and b["discard"] == 0
    assert b["overwrite"] == 4 and b["own_read"] == [True] * 4
    assert b["flooded"] == 6 * 64
    assert b["stats_tenants"] == ["b"] and b["stats_uids"] == [UID_B] and b["stats_capacity"] == 24 << 20
    assert "flood" in b["stats_ns"] and set(b["stats_ns"]) <= {"doc", "flood"}

    def a_reads():
        c = RawClient(sp.socket, name="a")
        got = _read(c, "doc", KEYS)
        c.close()
        return {"same": [d == want for d, want in zip(got, A_BYTES)], "n": len(got)}

    again = _as(UID_A, a_reads)
    assert again == {"same": [True] * 4, "n": 4}  # every block of a intact, byte for byte

    # the operator (root, the server's uid) sees both tenants; a sees only itself
    s = sp.status()
    assert sorted(s["tenants"]) == ["a", "b"] and s["server"]["tenant"] is None
    assert s["tenants"]["a"]["blocks"] == 4 and s["tenants"]["a"]["evicted_blocks"] == 0
    assert s["tenants"]["b"]["evicted_blocks"] > 0

    def a_stats():
        c = RawClient(sp.socket, want_fd=False, name="a")
        s = c.call("stats")["stats"]
        c.close()
        return {"tenants": sorted(s["tenants"]), "ns": sorted(s["pool"]["namespaces"])}

    assert _as(UID_A, a_stats) == {"tenants": ["a"], "ns": ["doc"]}


def test_a_uid_bound_to_no_tenant_is_refused(tenant_server):
    sp, _ = tenant_server

    def stranger():
        try:
            c = RawClient(sp.socket, want_fd=False, name="x")
        except Exception as e:  # noqa: BLE001
            return {"error": str(e)}
        return {"hello": c.hello}

    got = _as(UID_NONE, stranger)
    assert got.get("hello", {}).get("code") == "denied" and "--tenant" in got["hello"]["error"], got
    # the operator may ask for stats but may not map a pool of a tenant
    c = RawClient(sp.socket, want_fd=True, name="root")
    assert c.hello.get("code") == "denied" and c.fd is None
    c.close()


def test_a_block_name_includes_its_tenant_down_to_redis():
    k = KEYS[0]
    names = {namespaced_key("doc", k), namespaced_key("doc", k, "a"), namespaced_key("doc", k, "b")}
    assert len(names) == 3
    assert namespaced_keys("doc", [k], "a") == [namespaced_key("doc", k, "a")]
    # no tenant/namespace split collides: ("ab", "c") and ("a", "bc") are two names
    assert namespaced_key("c", k, "ab") != namespaced_key("bc", k, "a")
    assert redis_key("p:", namespaced_key("doc", k, "a")) != redis_key("p:", namespaced_key("doc", k, "b"))


def test_tenant_options_are_checked():
    from cxlalloc.kvstore.server.tenants import Tenancy, parse_tenant, split_sizes

    s = parse_tenant("team-a:0,@0:8MiB")
    assert (s.name, s.uids, s.gids, s.size) == ("team-a", [0], [0], 8 << 20)
    for bad in ("a", "a:", "a: ", "bad name:1", "a:1:2:3", "a:no-such-user-xyz"):
        with pytest.raises(ValueError, match="--tenant"):
            parse_tenant(bad)
    with pytest.raises(ValueError, match="bound to two tenants"):
        Tenancy([parse_tenant("a:7"), parse_tenant("b:7")])
    # each error names the option, the value, the field at fault and what it allows (user trial: 'a:65534:0'
    # was "kv store: the arena size must be > 0 bytes")
    for bad, field, allowed in (("a:65534:0", "SIZE '0'", "allowed: a positive size"),
                                ("a:65534:lots", "SIZE 'lots'", "allowed: a positive size"),
                                ("a:65534:-1", "SIZE '-1'", "allowed: a positive size"),
                                ("bad name:1", "NAME 'bad name'", "allowed: 1-64 of A-Z a-z 0-9 _ . -"),
                                ("a:no-such-user-xyz", "USERS names no user 'no-such-user-xyz'", "allowed: user names"),
                                ("a:1,@no-such-group-xyz", "USERS names no group 'no-such-group-xyz'", "allowed: group"),
                                ("a:99999999999", "USERS has user id 99999999999", "allowed: 0..4294967294"),
                                ("a:1:2:3", "has 4 field(s)", "allowed: 2 or 3")):
        with pytest.raises(ValueError) as e:
            parse_tenant(bad)
        text = str(e.value)
        assert text.startswith(f"cxlalloc option '--tenant': {bad!r}") and field in text and allowed in text, text
        assert "NAME:USERS[:SIZE]" in text
    with pytest.raises(ValueError, match="tenant 'a' has SIZE 100 B, under one page"):
        split_sizes([parse_tenant("a:7:100")], 4 << 20, 4096)
    with pytest.raises(ValueError, match="more than --size"):
        split_sizes([parse_tenant("a:7:8MiB")], 4 << 20, 4096)
    assert split_sizes([parse_tenant("a:7:8MiB"), parse_tenant("b:8"), parse_tenant("c:9")], 32 << 20, 4096) == \
        {"a": 8 << 20, "b": 12 << 20, "c": 12 << 20}
    t = Tenancy([parse_tenant("a:7,@100"), parse_tenant("b:8")], operator_uid=0)
    assert (t.resolve(7, 5), t.resolve(9, 100), t.resolve(8, 100), t.resolve(9, 9)) == ("a", "a", "b", None)
    assert Tenancy().resolve(1234, 1234) == ""  # no --tenant: one tenant for everyone (single-tenant default)


def test_the_tenant_names_redis_values_and_an_in_process_store_carries_it_the_same_way(kv_server, redis_server):
    """A kv-server tenant's blocks reach Redis under names (and MACs) of that tenant: an
    in-process tier with ``?tenant=`` of the same name reads them, another tenant's or none does not."""
    from cxlalloc.kvstore.server.tenants import parse_tenant
    from cxlalloc.kvstore.tiers.redis import RedisTier

    rs = redis_server()
    keyfile = os.path.join(rs.workdir, "mac.key")
    with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(os.urandom(32))
    me = os.geteuid()  # the test's own uid is bound to tenant "a": no second user needed here
    srv = kv_server(tenants=[parse_tenant(f"a:{me}")], redis=RedisTier(rs.url, key_file=keyfile),
                    redis_mode="through")
    c = RawClient(srv.socket_path)
    assert c.hello["tenant"] == "a"
    assert _write(c, "doc", KEYS, A_BYTES) == 4
    c.close()
    assert srv.redis.flush(5)
    names = sorted(k.decode() for k in rs.client().keys("cxlalloc:kv:*"))
    assert names == sorted(redis_key("cxlalloc:kv:", k) for k in namespaced_keys("doc", KEYS, "a"))

    mine = RedisTier(rs.url + "?tenant=a", key_file=keyfile)
    assert mine.tenant == "a" and mine.get_many(KEYS, ns="doc") == A_BYTES
    for other in (RedisTier(rs.url, key_file=keyfile), RedisTier(rs.url + "?tenant=b", key_file=keyfile)):
        assert other.get_many(KEYS, ns="doc") == [None] * 4
        other.close()
    # a tenant's value copied under another tenant's name is refused (its header and MAC cover the name)
    r = rs.client()
    r.set(redis_key("cxlalloc:kv:", namespaced_key("doc", KEYS[0], "b")), r.get(names[0]))
    b = RedisTier(rs.url + "?tenant=b", key_file=keyfile)
    assert b.get_many(KEYS[:1], ns="doc") == [None]
    assert b.stats()["bad_values"] + b.stats()["forged_values"] == 1
    b.close()
    mine.close()
    with pytest.raises(ValueError, match=r"\?tenant"):
        RedisTier(rs.url + "?tenant=bad/name")


def test_the_client_store_reports_the_tenant_the_server_bound_it_to(kv_server, alloc):
    from cxlalloc.kvstore.client import RemoteBlockStore
    from cxlalloc.kvstore.server.tenants import parse_tenant

    srv = kv_server(tenants=[parse_tenant(f"a:{os.geteuid()}:16MiB"), parse_tenant("b:65533")])
    st = RemoteBlockStore(srv.url + "?timeout=2", alloc())
    res = st.reserve("doc", KEYS[:2], BLOCK, 16)
    for v in res.views:
        v.fill_(5)
    assert res.commit() == 2
    s = st.stats()
    assert s["tenant"] == "a" and s["capacity_bytes"] == 16 << 20 and s["blocks"] == 2
    st.close()
    assert srv.stats("b")["pool"]["blocks"] == 0 and srv.stats("a")["pool"]["blocks"] == 2


def test_status_and_metrics_of_the_operator_show_every_tenant(kv_server):
    from cxlalloc.kvstore.server import metrics
    from cxlalloc.kvstore.server.cli import format_status
    from cxlalloc.kvstore.server.tenants import parse_tenant

    srv = kv_server(size=32 << 20, tenants=[parse_tenant(f"a:{os.geteuid()}:8MiB"), parse_tenant("b:65533")])
    c = RawClient(srv.socket_path)
    assert _write(c, "doc", KEYS, A_BYTES) == 4
    c.close()
    st = srv.stats()  # the operator's view
    assert st["pool"]["capacity_bytes"] == 32 << 20 and st["pool"]["blocks"] == 4
    assert st["pool"]["namespaces"] == {"a/doc": {"used_bytes": 4 * BLOCK, "quota_bytes": None}}
    text = format_status(st)
    assert "tenant a" in text and "tenant b" in text
    prom = metrics.render(st)
    assert 'cxlalloc_kv_namespace_used_bytes{namespace="a/doc"} 262144.0' in prom


def test_a_namespace_the_operator_shares_is_read_by_every_tenant_and_written_by_its_writers_only(tenant_server):
    sp, _ = tenant_server
    pub = [key(i, b"system-prompt") for i in range(3)]
    data = [bytes([0x50 + i]) * BLOCK for i in range(3)]

    def a_publishes():
        c = RawClient(sp.socket, name="a")
        n = _write(c, "public", pub, data)
        c.close()
        return {"published": n}

    assert _as(UID_A, a_publishes) == {"published": 3}

    def b_reads():
        c = RawClient(sp.socket, name="b")
        got = _read(c, "public", pub)   # copied from a's pool into b's own
        again = _read(c, "public", pub)  # now a hit in b's own pool
        r = c.call("reserve", ns="public", keys=[key(9, b"poison")], nbytes=BLOCK, tokens=16)
        c.close()
        return {"same": [g == d for g, d in zip(got, data)], "again": [g == d for g, d in zip(again, data)],
                "reserve": r.get("code")}

    assert _as(UID_B, b_reads) == {"same": [True] * 3, "again": [True] * 3, "reserve": "denied"}
    s = sp.status()
    assert s["tenants"]["a"]["blocks"] == 3 and s["tenants"]["b"]["blocks"] == 3


def test_a_shared_namespace_must_name_writers_that_are_tenants(kv_server):
    from cxlalloc.kvstore.server.tenants import parse_tenant

    with pytest.raises(ValueError, match="--shared-namespace.*zz, not a --tenant"):
        kv_server(tenants=[parse_tenant("a:65534")], shared={"public": ["zz"]})
    with pytest.raises(ValueError, match="--shared-namespace.*shared by everyone already"):
        kv_server(shared={"public": ["a"]})
