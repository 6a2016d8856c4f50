"""Protocol 2: a hit costs one request/response pair (the lease's release is
one-way), leases never leak, and a version-1 client is still served as before.
Protocol 3: an insert costs one (the commit is pipelined, acknowledged by the
next reply), and a commit's failure surfaces on the next call."""

import os
import warnings

import pytest

import cxlalloc.kvstore.connection as conn_mod  # the one place that sends and receives
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.client import RemoteBlockStore
from tests.kvstore.kvutil import RawClient, key
from tests.helpers.wait import wait_until

BLOCK = 64 << 10


class _Counting:
    """The protocol module as the client sees it, counting frames each way."""

    def __init__(self):
        self.sent = self.received = 0

    def __getattr__(self, name):
        return getattr(P, name)

    def send_msg(self, sock, msg, fds=None):
        self.sent += 1
        return P.send_msg(sock, msg, fds)

    def recv_msg(self, sock, *a, **kw):
        self.received += 1
        return P.recv_msg(sock, *a, **kw)


def test_a_hit_is_one_request_and_one_reply_and_releases_its_pins(kv_server, alloc, monkeypatch):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    keys = [key(i) for i in range(4)]
    res = st.reserve("", keys, BLOCK, 16)
    for i, v in enumerate(res.views):
        v.fill_(i + 1)
    assert res.commit() == 4
    assert st._conn.hello["v"] == 3 == P.PROTOCOL_VERSION
    counting = _Counting()
    monkeypatch.setattr(conn_mod, "P", counting)
    for n in range(20):
        with st.lookup("", keys) as lease:
            assert lease.blocks == 4 and [int(v[0]) for v in lease.views] == [1, 2, 3, 4]
    # 20 hits: 20 lookups + 20 one-way releases sent, 20 replies waited for
    assert (counting.sent, counting.received) == (40, 20)
    # the stats request goes after the releases on the same connection: they are done by then
    assert st.server_stats()["pool"]["pinned_blocks"] == 0
    # 20 one-way releases and the pipelined commit of the blocks
    assert srv.state.c["one_way_requests"] == 21 and srv.state.c["one_way_errors"] == 0
    assert all(not o.leases for o in srv.state.owners.values())
    # a hit still pins while its lease is open, and the next request sees the release done
    lease = st.lookup("", keys)
    assert srv.stats()["pool"]["pinned_blocks"] == 4
    lease.close()
    assert st.server_stats()["pool"]["pinned_blocks"] == 0
    st.close()


def test_a_closed_connection_drops_the_leases_of_a_client_that_never_released(kv_server, alloc):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    res = st.reserve("", [key(1), key(2)], BLOCK, 16)
    res.commit()
    lease = st.lookup("", [key(1), key(2)])
    assert lease.blocks == 2 and srv.stats()["pool"]["pinned_blocks"] == 2
    st._conn.sock.close()  # as a client killed with its lease open
    assert wait_until(lambda: srv.stats()["pool"]["pinned_blocks"] == 0, timeout=5)
    assert srv.stats()["pool"]["dropped_pins"] == 2


def test_a_version_1_client_gets_every_reply_and_a_one_way_release_from_it_is_answered(kv_server, alloc):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    st.reserve("", [key(7)], BLOCK, 16).commit(wait=True)  # published before the other connection asks
    old = RawClient(srv.socket_path, want_fd=False, name="v1")
    P.send_msg(old.sock, {"op": "hello", "v": 1, "pid": os.getpid(), "want_fd": False, "name": "v1"})
    reply, _ = P.recv_msg(old.sock)
    assert reply["ok"] and reply["v"] == 1
    # a second hello on this raw connection set version 1: reply=False is not one-way for it
    lk = old.call("lookup", ns="", keys=[key(7)])
    assert lk["lease"] and len(lk["blocks"]) == 1
    rel = old.call("release", leases=[lk["lease"]], reply=False)
    assert rel["ok"] and rel["released"] == 1
    bad = old.call("hello", v=4)
    assert not bad["ok"] and bad["code"] == "bad_request" and "1, 2, 3" in bad["error"]
    old.close()
    st.close()


@pytest.mark.parametrize("ids", [["x"], [True], "7"])
def test_a_bad_one_way_release_is_counted_not_answered(kv_server, ids):
    srv = kv_server()
    c = RawClient(srv.socket_path, want_fd=False)
    P.send_msg(c.sock, {"op": "release", "leases": ids, "reply": False})
    assert c.call("ping")["ok"]  # the next reply is the ping's: nothing was sent for the bad release
    assert srv.state.c["one_way_errors"] == 1
    c.close()


def test_an_insert_is_one_waited_round_trip_and_the_next_reply_acknowledges_its_commit(kv_server, alloc, monkeypatch):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    counting = _Counting()
    monkeypatch.setattr(conn_mod, "P", counting)
    for n in range(10):
        keys = [key(100 * n + j) for j in range(4)]
        res = st.reserve("", keys, BLOCK, 16)
        for j, v in enumerate(res.views):
            v.fill_(n + j + 1)
        assert res.commit() == 4  # the slots sent
    # 10 inserts: 10 reserves + 10 pipelined commits sent, 10 replies waited for
    assert (counting.sent, counting.received) == (20, 10)
    c = st.counters.snapshot()
    assert c["pipelined_commits"] == 10 and c["committed_blocks"] == 9 * 4  # the last one is not acknowledged yet
    assert len(st._conn.pending) == 1
    assert st.flush() is True and not st._conn.pending
    assert st.counters.snapshot()["committed_blocks"] == 40 and srv.state.c["pipelined_commits"] == 10
    # published in order on this connection: a lookup right after a commit sees the bytes
    res = st.reserve("", [key(999)], BLOCK, 16)
    res.views[0].fill_(77)
    res.commit()
    with st.lookup("", [key(999)]) as lease:
        assert lease.blocks == 1 and int(lease.views[0].sum()) == 77 * BLOCK
    st.close()


def test_a_failed_pipelined_commit_is_counted_and_warned_on_the_next_call(kv_server, alloc):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    st._conn.send_one_way({"op": "commit", "res": 12345, "reply": False}, pending=3)  # no such reservation
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert st.lookup("", [key(1)]).blocks == 0  # the next call carries the failure
    c = st.counters.snapshot()
    assert c["remote_errors"] == 1 and c["committed_blocks"] == 0 and not st._conn.pending
    assert any("pipelined commit" in str(x.message) and "bad_request" in str(x.message) for x in w)
    assert srv.state.c["one_way_errors"] == 1
    st.close()


def test_a_commit_sent_before_the_connection_closes_is_published_and_one_never_sent_is_not(kv_server, alloc):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    done = st.reserve("", [key(1)], BLOCK, 16)
    done.views[0].fill_(5)
    never = st.reserve("", [key(2)], BLOCK, 16)
    never.views[0].fill_(6)
    done.commit()
    st._conn.sock.close()  # as a client killed right after sending a commit: the frame was sent, the other not
    other = RemoteBlockStore(srv.url, alloc())
    assert wait_until(lambda: srv.stats()["pool"]["writing_blocks"] == 0, timeout=5)
    with other.lookup("", [key(1)]) as lease:
        assert lease.blocks == 1 and int(lease.views[0][0]) == 5
    assert other.lookup("", [key(2)]).blocks == 0
    other.close()


def test_against_a_version_2_server_every_commit_waits(kv_server, alloc, monkeypatch):
    monkeypatch.setattr(P, "SUPPORTED_VERSIONS", (1, 2))  # the server's check: a server of before protocol 3
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    assert st._conn.hello["v"] == 2 and not st._conn.pipelined_commit
    res = st.reserve("", [key(1), key(2)], BLOCK, 16)
    assert res.commit() == 2 and st.counters.snapshot()["committed_blocks"] == 2
    assert st.counters.snapshot()["pipelined_commits"] == 0 and srv.state.c["pipelined_commits"] == 0
    st.close()
    from cxlalloc.kvstore.server.cli import query_status

    assert query_status(srv.socket_path)["pool"]["blocks"] == 2  # --status asks for version 2 after 3 is refused


def test_commit_wait_in_the_url_waits_and_a_bad_value_is_refused(kv_server, alloc):
    srv = kv_server()
    st = RemoteBlockStore(srv.url + "?commit=wait", alloc())
    res = st.reserve("", [key(1)], BLOCK, 16)
    assert res.commit() == 1 and st.counters.snapshot()["committed_blocks"] == 1
    assert st.counters.snapshot()["pipelined_commits"] == 0
    st.close()
    with pytest.raises(ValueError, match=r"commit='later'.*allowed values: pipelined.*wait"):
        RemoteBlockStore(srv.url + "?commit=later", alloc())


def test_slot_views_are_the_slots_bytes_in_runs_registered_once():
    from types import SimpleNamespace

    import torch

    from cxlalloc.kvstore.client import _slot_views

    pool = SimpleNamespace(bytes=torch.zeros(1 << 21, dtype=torch.uint8))
    slots = [0, BLOCK, 2 * BLOCK, None, 4 * BLOCK, 5 * BLOCK, 9 * BLOCK, 3 * BLOCK]
    registered = []
    views = _slot_views(pool, slots, BLOCK, lambda p, off, n: registered.append((off, n)))
    assert views[3] is None
    for off, v in zip(slots, views):
        if off is not None:
            ref = pool.bytes[off:off + BLOCK]
            assert v.data_ptr() == ref.data_ptr() and v.shape == (BLOCK,) and v.is_contiguous()
    # runs: 0-2, 4-5, then 9 and 3 alone (not after the one before)
    assert registered == [(0, 3 * BLOCK), (4 * BLOCK, 2 * BLOCK), (9 * BLOCK, BLOCK), (3 * BLOCK, BLOCK)]
    for i, v in enumerate(views):
        if v is not None:
            v.fill_(i + 1)
    assert [int(pool.bytes[off]) for off in slots if off is not None] == [1, 2, 3, 5, 6, 7, 8]
    # 5000-byte blocks: in their 8 KiB slots one run; 16 KiB apart (the stride a page or more over the block) not
    registered.clear()
    _slot_views(pool, [0, 8192, 16384], 5000, lambda p, off, n: registered.append((off, n)))
    assert registered == [(0, 2 * 8192 + 5000)]
    registered.clear()
    _slot_views(pool, [0, 16384, 32768], 5000, lambda p, off, n: registered.append((off, n)))
    assert registered == [(0, 5000), (16384, 5000), (32768, 5000)]
