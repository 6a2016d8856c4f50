"""The kv-server's pool, index and protocol, with clients in this process.

Protocol-level clients (RawClient) check the server's rules; RemoteBlockStore
clients on simulated allocators check what generate() relies on.
"""

import os
import socket
import time

import pytest
import torch

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.client import RemoteBlockStore
from cxlalloc.kvstore.local import KVStoreWarning
from cxlalloc.kvstore.server import KVServer
from cxlalloc.kvstore.server.cli import format_status, query_status
from tests.helpers.wait import wait_until
from tests.kvstore.kvutil import RawClient, key

MiB = 1 << 20
BLOCK = 64 << 10



# ----------------------------------------------------------------- pool: size, laziness, placement
def test_pool_exact_size_lazy_and_fast_even_at_one_tib(kv_server):
    t0 = time.perf_counter()
    srv = kv_server(size=1 << 40, chunk=256 * MiB)
    took = time.perf_counter() - t0
    assert took < 2.0, f"a 1 TiB pool took {took:.2f} s to start (it must not commit or register anything)"
    st = srv.stats()["pool"]
    assert st["capacity_bytes"] == 1 << 40 and st["mapped_bytes"] == 1 << 40
    assert st["committed_bytes"] < 1 * MiB  # sparse: nothing committed until written
    c = RawClient(srv.socket_path)
    assert c.hello["size"] == 1 << 40 and os.fstat(c.fd).st_size == 1 << 40
    c.close()


def test_placement_of_committed_blocks_is_verified_on_the_node(kv_server):
    srv = kv_server()
    c = RawClient(srv.socket_path)
    m = c.mapping()
    r = c.call("reserve", ns="", keys=[key(i) for i in range(3)], nbytes=BLOCK, tokens=16)
    assert r["ok"] and len([s for s in r["slots"] if s is not None]) == 3
    for off in r["slots"]:
        m[off:off + BLOCK] = bytes([7]) * BLOCK
    assert c.call("commit", res=r["res"])["published"] == 3
    wait_until(lambda: not srv.verify_pending(), timeout=5.0, interval=0.01)
    st = srv.stats()["pool"]
    assert st["placement_verified_bytes"] == 3 * BLOCK, st
    assert st["placement_misplaced_bytes"] == 0
    assert st["committed_bytes"] >= 3 * BLOCK
    assert srv.stats()["server"]["numa_method"] in ("move_pages", "get_mempolicy")
    m.close()
    c.close()


def test_strict_placement_checks_before_publishing(kv_server):
    srv = kv_server(strict_placement=True)
    c = RawClient(srv.socket_path)
    m = c.mapping()
    r = c.call("reserve", ns="", keys=[key(1)], nbytes=BLOCK, tokens=16)
    m[r["slots"][0]:r["slots"][0] + BLOCK] = b"\1" * BLOCK
    assert c.call("commit", res=r["res"])["published"] == 1
    assert srv.stats()["pool"]["placement_verified_bytes"] == BLOCK  # already, no background wait
    m.close()
    c.close()


def test_strict_placement_drops_every_misplaced_block_and_warns_once(kv_server, caplog):
    import logging

    srv = kv_server(strict_placement=True)
    real = srv.state.arena

    class Elsewhere:  # every page reports another node, as move_pages does once the node has filled up
        def __getattr__(self, name):
            return getattr(real, name)

        def verify(self, off, n):
            return {"on_node": 0, "elsewhere": n, "unpopulated": 0, "detail": f"{n} bytes on node 1"}

    srv.state.arena = Elsewhere()
    c = RawClient(srv.socket_path)
    m = c.mapping()
    caplog.set_level(logging.WARNING, logger="cxlalloc.kvstore")
    r = c.call("reserve", ns="", keys=[key(i) for i in range(3)], nbytes=BLOCK, tokens=16)
    for off in r["slots"]:
        m[off:off + BLOCK] = b"\2" * BLOCK
    assert c.call("commit", res=r["res"])["published"] == 0  # none of the three is visible
    st = srv.stats()["pool"]
    assert st["misplaced_dropped_blocks"] == 3 and st["placement_misplaced_bytes"] == 3 * BLOCK, st
    assert c.call("lookup", ns="", keys=[key(0)])["blocks"] == []
    assert len([r for r in caplog.records if "landed outside node" in r.getMessage()]) == 1
    m.close()
    c.close()


def test_bad_sizes_and_paths_name_the_option(kv_server, sockdir):
    with pytest.raises(ValueError, match="'--size'.*below one chunk"):
        KVServer(2 * MiB, 0, os.path.join(sockdir, "a.sock"), chunk_bytes=4 * MiB)
    with pytest.raises(ValueError, match="'--chunk'"):
        KVServer(64 * MiB, 0, os.path.join(sockdir, "a.sock"), chunk_bytes=4 * MiB + 1)
    with pytest.raises(ValueError, match="'--socket'.*107 bytes"):
        KVServer(64 * MiB, 0, "/tmp/" + "d" * 120 + "/kv.sock", chunk_bytes=4 * MiB)
    reg = os.path.join(sockdir, "file")
    open(reg, "w").close()
    with pytest.raises(ValueError, match="exists and is not a socket"):
        KVServer(64 * MiB, 0, reg, chunk_bytes=4 * MiB).start()
    assert os.path.exists(reg)  # never deleted
    kv_server(name="live.sock")
    with pytest.raises(ValueError, match="already listening"):
        KVServer(64 * MiB, 0, os.path.join(sockdir, "live.sock"), chunk_bytes=4 * MiB).start()


def test_stale_socket_of_a_dead_server_is_replaced(kv_server, sockdir):
    path = os.path.join(sockdir, "kv.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # a socket file nobody listens on
    srv = kv_server()
    assert query_status(srv.socket_path)["server"]["pool_id"] == srv.pool_id


def test_socket_file_mode_and_removal(kv_server):
    srv = kv_server(socket_mode=0o600)
    assert os.stat(srv.socket_path).st_mode & 0o777 == 0o600
    srv.stop()
    assert not os.path.exists(srv.socket_path)


# ----------------------------------------------------------------- write, then publish; owners
def test_written_blocks_are_invisible_until_committed(kv_server):
    srv = kv_server()
    a, b = RawClient(srv.socket_path), RawClient(srv.socket_path)
    keys = [key(i) for i in range(4)]
    r = a.call("reserve", ns="", keys=keys, nbytes=BLOCK, tokens=16)
    assert b.call("lookup", ns="", keys=keys)["blocks"] == []  # WRITING: invisible
    again = b.call("reserve", ns="", keys=keys, nbytes=BLOCK, tokens=16)
    assert again["res"] == 0 and again["slots"] == [None] * 4  # nobody else may write them either
    a.call("commit", res=r["res"])
    got = b.call("lookup", ns="", keys=keys)
    assert len(got["blocks"]) == 4
    b.call("release", leases=[got["lease"]])
    srv.check()
    a.close()
    b.close()


def test_client_gone_mid_insert_aborts_its_blocks_and_drops_its_pins(kv_server):
    srv = kv_server()
    a = RawClient(srv.socket_path)
    m = a.mapping()
    done = [key(i, b"done") for i in range(2)]
    r = a.call("reserve", ns="", keys=done, nbytes=BLOCK, tokens=16)
    a.call("commit", res=r["res"])
    lease = a.call("lookup", ns="", keys=done)  # pinned by a
    half = [key(i, b"half") for i in range(3)]
    r = a.call("reserve", ns="", keys=half, nbytes=BLOCK, tokens=16)
    m[r["slots"][0]:r["slots"][0] + BLOCK // 2] = b"\x55" * (BLOCK // 2)  # half a block written...
    assert srv.stats()["pool"]["pinned_blocks"] == 2 and srv.stats()["pool"]["writing_blocks"] == 3
    m.close()
    a.sock.close()  # ... and the client is gone (a crash looks the same to the server: EOF)
    deadline = time.monotonic() + 5
    while srv.stats()["server"]["clients"] and time.monotonic() < deadline:
        time.sleep(0.01)
    st = srv.stats()["pool"]
    assert st["aborted_blocks"] == 3 and st["dropped_pins"] == 2 and st["writing_blocks"] == 0
    assert st["pinned_blocks"] == 0
    b = RawClient(srv.socket_path)
    assert b.call("lookup", ns="", keys=half)["blocks"] == []  # nothing half-written is visible
    assert len(b.call("lookup", ns="", keys=done)["blocks"]) == 2  # committed blocks stay
    srv.check()
    b.close()
    a.close()
    assert lease["lease"]


def test_a_pinned_block_is_never_evicted_or_overwritten(kv_server):
    srv = kv_server(size=8 * MiB, chunk=1 * MiB)  # 128 blocks of 64 KiB
    a = RawClient(srv.socket_path)
    m = a.mapping()
    r = a.call("reserve", ns="", keys=[key(0)], nbytes=BLOCK, tokens=16)
    off = r["slots"][0]
    m[off:off + BLOCK] = b"\xab" * BLOCK
    a.call("commit", res=r["res"])
    lease = a.call("lookup", ns="", keys=[key(0)])
    b = RawClient(srv.socket_path)
    mb = b.mapping()
    for i in range(1, 400):  # three times the pool: everything else is evicted, some blocks twice
        r = b.call("reserve", ns="", keys=[key(i)], nbytes=BLOCK, tokens=16)
        for o in r["slots"]:
            if o is not None:
                mb[o:o + BLOCK] = b"\x00" * BLOCK
        if r["res"]:
            b.call("commit", res=r["res"])
    assert srv.stats()["pool"]["evicted_blocks"] > 200
    assert m[off:off + BLOCK] == b"\xab" * BLOCK  # untouched while pinned
    a.call("release", leases=[lease["lease"]])
    srv.check()
    m.close()
    mb.close()
    a.close()
    b.close()


# ----------------------------------------------------------------- namespaces and quotas
def test_namespaces_never_share_blocks(kv_server):
    srv = kv_server()
    c = RawClient(srv.socket_path)
    keys = [key(i) for i in range(3)]
    r = c.call("reserve", ns="tenant-a", keys=keys, nbytes=BLOCK, tokens=16)
    c.call("commit", res=r["res"])
    assert c.call("lookup", ns="tenant-b", keys=keys)["blocks"] == []  # same keys, other tenant: a miss
    assert c.call("lookup", ns="", keys=keys)["blocks"] == []
    r = c.call("reserve", ns="tenant-b", keys=keys, nbytes=BLOCK, tokens=16)  # b stores its own copy
    assert r["res"] and all(s is not None for s in r["slots"])
    c.call("commit", res=r["res"])
    a_hit = c.call("lookup", ns="tenant-a", keys=keys)
    b_hit = c.call("lookup", ns="tenant-b", keys=keys)
    assert {o for o, _, _ in a_hit["blocks"]}.isdisjoint({o for o, _, _ in b_hit["blocks"]})
    ns = srv.stats()["pool"]["namespaces"]
    assert ns["tenant-a"]["used_bytes"] == ns["tenant-b"]["used_bytes"] == 3 * BLOCK
    c.close()


def test_quotas_evict_within_the_namespace_only(kv_server):
    srv = kv_server(size=16 * MiB, chunk=1 * MiB, quotas={"small": 4 * BLOCK}, default_quota=None)
    c = RawClient(srv.socket_path)
    big = [key(i, b"big") for i in range(20)]
    r = c.call("reserve", ns="big", keys=big, nbytes=BLOCK, tokens=16)
    c.call("commit", res=r["res"])
    small = [key(i, b"small") for i in range(10)]
    for k in small:
        r = c.call("reserve", ns="small", keys=[k], nbytes=BLOCK, tokens=16)
        c.call("commit", res=r["res"])
    st = srv.stats()["pool"]
    assert st["namespaces"]["small"]["used_bytes"] == 4 * BLOCK
    assert st["namespaces"]["small"]["quota_bytes"] == 4 * BLOCK
    assert len(c.call("lookup", ns="big", keys=big)["blocks"]) == 20  # untouched by the other's quota
    assert len(c.call("lookup", ns="small", keys=small[-4:])["blocks"]) == 4  # the newest kept
    srv.check()
    c.close()


def test_default_quota_applies_to_every_unnamed_namespace(kv_server):
    srv = kv_server(size=16 * MiB, chunk=1 * MiB, default_quota=2 * BLOCK)
    c = RawClient(srv.socket_path)
    for ns in ("x", "y"):
        r = c.call("reserve", ns=ns, keys=[key(i, ns.encode()) for i in range(5)], nbytes=BLOCK, tokens=16)
        assert sum(s is not None for s in r["slots"]) == 2  # the quota: the rest is dropped, not evicted across
        c.call("commit", res=r["res"])
    assert srv.stats()["pool"]["namespaces"]["x"]["quota_bytes"] == 2 * BLOCK
    c.close()


# ----------------------------------------------------------------- bad input
def test_bad_requests_get_an_error_and_the_connection_lives(kv_server):
    srv = kv_server()
    c = RawClient(srv.socket_path)
    bad = c.call("lookup", ns="", keys=[b"short"])
    assert not bad["ok"] and bad["code"] == "bad_request" and "32 bytes" in bad["error"]
    bad = c.call("reserve", ns="", keys=[key(1)], nbytes=64 * MiB, tokens=1)
    assert bad["code"] == "too_large" and "--chunk" in bad["error"]
    bad = c.call("frobnicate")
    assert bad["code"] == "unknown_op"
    bad = c.call("commit", res=12345)
    assert bad["code"] == "bad_request"
    assert c.call("ping")["ok"]
    c.close()


def test_hello_first_and_garbage_closes_only_that_connection(kv_server):
    srv = kv_server()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(srv.socket_path)
    P.send_msg(s, {"op": "lookup", "ns": "", "keys": []})
    reply, _ = P.recv_msg(s)
    assert reply["code"] == "bad_request" and "hello" in reply["error"]
    s.sendall(b"\xff\xff\xff\xff")  # a frame of 4 GiB
    with pytest.raises((P.ConnectionClosed, OSError)):
        for _ in range(3):
            P.recv_msg(s)
    s.close()
    c = RawClient(srv.socket_path)  # the server is fine
    assert c.call("ping")["ok"]
    assert srv.stats()["server"]["protocol_errors"] == 1
    c.close()


def test_wrong_protocol_version_is_refused(kv_server):
    srv = kv_server()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(srv.socket_path)
    P.send_msg(s, {"op": "hello", "v": 99})
    reply, fds = P.recv_msg(s, max_fds=1)
    assert not reply["ok"] and "version" in reply["error"] and fds == []
    s.close()


def test_max_clients_and_allow_list_refuse_with_a_reason(kv_server):
    srv = kv_server(max_clients=1)
    a = RawClient(srv.socket_path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(srv.socket_path)
    P.send_msg(s, {"op": "hello", "v": P.PROTOCOL_VERSION})
    reply, _ = P.recv_msg(s)
    assert reply["code"] == "limit" and "--max-clients" in reply["error"]
    s.close()
    a.close()
    assert srv.stats()["server"]["refused_full"] == 1


# ----------------------------------------------------------------- RemoteBlockStore on a simulated GPU
def test_remote_store_cross_client_bytes_and_chunk_registration(kv_server, alloc, sim):
    srv = kv_server()
    a_alloc, b_alloc = alloc(), alloc()
    regs0 = sim.live()["registrations"]
    a = RemoteBlockStore(srv.url, a_alloc)
    b = RemoteBlockStore(srv.url, b_alloc)
    keys = [key(i) for i in range(3)]
    res = a.reserve("", keys, BLOCK, 16)
    assert res.slots == 3
    for i, v in enumerate(res.views):
        v.copy_(torch.full((BLOCK,), i + 1, dtype=torch.uint8))
    assert res.commit() == 3
    assert sim.live()["registrations"] > regs0  # the chunk was registered for the (simulated) GPU
    assert a.stats()["registered_bytes"] == 4 * MiB  # one chunk, not the pool
    with b.lookup("", keys + [key(99)]) as lease:
        assert lease.blocks == 3
        for i, v in enumerate(lease.views):
            assert bool((v == i + 1).all())
    st = b.stats()
    assert st["hit_blocks"] == 3 and st["connected"] and st["server"]["pool"]["hit_blocks"] == 3
    assert st["registered_bytes"] == 4 * MiB
    with pytest.raises(ValueError, match="'kv_store'.*--chunk"):
        a.check_block_bytes(8 * MiB)
    a.close()
    b.close()


def test_a_client_at_its_max_pinned_reads_a_miss_and_hits_again_once_it_releases(kv_server, alloc):
    srv = kv_server(max_pinned=2 * BLOCK)
    a = RemoteBlockStore(srv.url, alloc())
    keys = [key(i) for i in range(3)]
    res = a.reserve("", keys, BLOCK, 16)
    for v in res.views:
        v.fill_(7)
    assert res.commit(wait=True) == 3
    with a.lookup("", keys) as held:
        assert held.blocks == 2  # cut at the budget: the third is a miss
        with pytest.warns(KVStoreWarning, match="--max-pinned"), a.lookup("", keys) as refused:
            assert refused.blocks == 0  # refused 'limit' on the server: a miss here, never an error
    assert a.stats()["remote_errors"] == 1
    with a.lookup("", keys[:2]) as again:
        assert again.blocks == 2 and all(bool((v == 7).all()) for v in again.views)
    pool = srv.stats()["pool"]
    assert pool["refused_pin_budget"] == 1 and pool["pin_budget_blocks"] == 1 + 3
    a.close()


def test_remote_reservation_left_unwritten_is_aborted(kv_server, alloc):
    srv = kv_server()
    a = RemoteBlockStore(srv.url, alloc())
    with a.reserve("", [key(1)], BLOCK, 16):
        pass  # an exception or a plain exit without commit
    assert srv.stats()["pool"]["aborted_blocks"] == 1
    with a.lookup("", [key(1)]) as lease:
        assert lease.blocks == 0
    a.close()


def test_status_text_and_metrics(kv_server, tmp_path):
    from cxlalloc.kvstore.server.metrics import MetricsExporter, render

    from tests.kvstore.kvutil import free_port

    srv = kv_server(quotas={"t": 8 * MiB})
    c = RawClient(srv.socket_path)
    r = c.call("reserve", ns="t", keys=[key(1)], nbytes=BLOCK, tokens=16)
    c.call("commit", res=r["res"])
    c.call("lookup", ns="t", keys=[key(1), key(2)])
    st = query_status(srv.socket_path)
    text = format_status(st)
    assert "pool" in text and "hit rate" in text and "namespace t" in text
    prom = render(st)
    for name in ("cxlalloc_kv_capacity_bytes{tier=\"pool\"} 6.7108864e+07", "cxlalloc_kv_hit_blocks_total",
                 "cxlalloc_kv_load_bytes_total", "cxlalloc_kv_store_bytes_total", "cxlalloc_kv_evictions_total",
                 "cxlalloc_kv_clients 1.0", "cxlalloc_kv_namespace_used_bytes{namespace=\"t\"}",
                 "cxlalloc_kv_hit_ratio{tier=\"pool\"} 0.5", "cxlalloc_kv_placement_bytes_total"):
        assert name in prom, name
    path = str(tmp_path / "kv.prom")
    port = free_port()
    ex = MetricsExporter(srv.stats, port=port, path=path, interval=0.05).start()
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "cxlalloc_kv_used_bytes" in body
    time.sleep(0.2)
    assert "cxlalloc_kv_lookups_total" in open(path).read()
    ex.stop()  # first: a write in flight has its temporary file until the rename
    assert not [f for f in os.listdir(tmp_path) if f != "kv.prom"]  # atomic: no temporary left behind
    c.close()


def test_a_block_larger_than_max_pinned_is_refused_with_what_would_help(kv_server, alloc):
    """A block that alone passes --max-pinned can never be loaded by anyone: the refusal said 'this client holds 0
    bytes pinned ... release some leases'; it names the block's size and --max-pinned instead."""
    srv = kv_server(max_pinned=BLOCK // 2)
    a = RemoteBlockStore(srv.url, alloc())
    res = a.reserve("", [key(1)], BLOCK, 16)
    for v in res.views:
        v.fill_(3)
    assert res.commit(wait=True) == 1
    with pytest.warns(KVStoreWarning, match=rf"a stored block takes {BLOCK} bytes, more than a client may hold pinned "
                                            rf"\({BLOCK // 2}, --max-pinned\).*raise --max-pinned") as w:
        with a.lookup("", [key(1)]) as refused:
            assert refused.blocks == 0  # a miss, never an error
    assert "release some leases" not in str(w[0].message)
    assert "later requests still go to the server" in str(w[0].message)  # not 'continuing without it': it does not
    a.close()
