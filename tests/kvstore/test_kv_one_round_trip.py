"""Protocol 2: a hit costs one request/response pair (the lease's release is
one-way), leases never leak, and a version-1 client is still served as before."""

import os

import pytest

import cxlalloc.kvstore.client as client_mod
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
    assert st._conn.hello["v"] == 2 == P.PROTOCOL_VERSION
    counting = _Counting()
    monkeypatch.setattr(client_mod, "P", counting)
    for n in range(20):
        with st.lookup("", keys) as lease:
            assert lease.blocks == 4 and [int(v[0]) for v in lease.views] == [1, 2, 3, 4]
    # 20 hits: 20 lookups + 20 one-way releases sent, 20 replies waited for
    assert (counting.sent, counting.received) == (40, 20)
    # the stats request goes after the releases on the same connection: they are done by then
    assert st.server_stats()["pool"]["pinned_blocks"] == 0
    assert srv.state.c["one_way_requests"] == 20 and srv.state.c["one_way_errors"] == 0
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
    st.reserve("", [key(7)], BLOCK, 16).commit()
    old = RawClient(srv.socket_path, want_fd=False, name="v1")
    P.send_msg(old.sock, {"op": "hello", "v": 1, "pid": os.getpid(), "want_fd": False, "name": "v1"})
    reply, _ = P.recv_msg(old.sock)
    assert reply["ok"] and reply["v"] == 1
    # a second hello on this raw connection set version 1: reply=False is not one-way for it
    lk = old.call("lookup", ns="", keys=[key(7)])
    assert lk["lease"] and len(lk["blocks"]) == 1
    rel = old.call("release", leases=[lk["lease"]], reply=False)
    assert rel["ok"] and rel["released"] == 1
    bad = old.call("hello", v=3)
    assert not bad["ok"] and bad["code"] == "bad_request" and "1, 2" in bad["error"]
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
