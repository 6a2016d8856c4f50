"""Inserts without a round trip on the copy's path: a reservation asked for ahead of its use
(``RemoteBlockStore.reserve_ahead``) and ``RemoteReservation.write`` (one streaming copy of a batch)."""

import pytest
import torch

import cxlalloc.kvstore.connection as conn_mod
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.client import RemoteBlockStore
from tests.kvstore.kvutil import key

BLOCK = 64 << 10


def _blocks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _writing(srv) -> int:
    return srv.stats()["pool"]["writing_blocks"]


def test_pipelined_reservations_publish_every_batch_with_its_bytes(kv_server, alloc):
    """Batch N+1 is reserved before batch N is written and committed; every block ends up stored with
    exactly its bytes, readable by another client."""
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    batches = [[key(100 * b + j) for j in range(4)] for b in range(5)]
    data = [_blocks(4, b) for b in range(5)]
    pending = st.reserve_ahead("", batches[0], BLOCK, 16)
    for b in range(5):
        res = pending.result()
        pending = st.reserve_ahead("", batches[b + 1], BLOCK, 16) if b + 1 < 5 else None
        assert res.slots == 4
        assert res.write(data[b]) == 4
        assert res.commit() == 4
    assert st.flush()
    assert st.counters["committed_blocks"] == 20 and st.counters["reserves"] == 5
    other = RemoteBlockStore(srv.url, None)
    for b in range(5):
        with other.lookup("", batches[b]) as lease:
            assert lease.blocks == 4
            for v, d in zip(lease.views, data[b]):
                assert torch.equal(v, d)
    assert _writing(srv) == 0
    st.close()
    other.close()


def test_a_request_sent_while_a_reply_is_unread_gets_its_own_reply(kv_server, alloc, monkeypatch):
    """Replies are read in the order sent: a lookup sent after a reserve_ahead reads the reserve's reply
    first (kept for result()), then its own; no extra frame is sent for it."""
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    st.reserve("", [key(1)], BLOCK, 16).commit(wait=True)
    sent = []

    class _Ops:  # the protocol module as the client's connection sees it, noting each op sent
        def __getattr__(self, name):
            return getattr(P, name)

        def send_msg(self, sock, msg, fds=None):
            sent.append(msg["op"])
            return P.send_msg(sock, msg, fds)

    monkeypatch.setattr(conn_mod, "P", _Ops())
    pending = st.reserve_ahead("", [key(2), key(3)], BLOCK, 16)
    with st.lookup("", [key(1)]) as lease:
        assert lease.blocks == 1
    res = pending.result()
    assert res.slots == 2 and res.commit(wait=True) == 2
    assert sent[:3] == ["reserve", "lookup", "release"]
    with st.lookup("", [key(2), key(3)]) as lease:
        assert lease.blocks == 2
    st.close()


def test_a_reservation_asked_ahead_and_never_used_is_aborted(kv_server, alloc):
    """Closing a pending reservation without result() frees its slots on the server (no WRITING block
    left), and its keys can be reserved again."""
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    with st.reserve_ahead("", [key(7), key(8)], BLOCK, 16):
        pass
    assert _writing(srv) == 0
    res = st.reserve("", [key(7), key(8)], BLOCK, 16)
    assert res.slots == 2  # not held by the aborted one
    res.abort()
    pending = st.reserve_ahead("", [key(9)], BLOCK, 16)
    res = pending.result()
    pending.close()  # after result(): the caller owns it, nothing is aborted
    assert _writing(srv) == 1
    assert res.write(_blocks(1, 3)) == 1 and res.commit(wait=True) == 1
    with pytest.raises(ValueError, match="already called"):
        pending.result()
    st.close()


def test_reserve_ahead_while_the_server_is_away_gives_an_empty_reservation(server_proc, alloc):
    sp = server_proc(start=False)
    with pytest.warns(Warning):
        st = RemoteBlockStore(sp.url + "?timeout=1", alloc())
    pending = st.reserve_ahead("", [key(1), key(2)], BLOCK, 16)
    res = pending.result()
    assert res.views == [None, None] and res.slots == 0 and res.commit() == 0
    assert res.write([None, None]) == 0
    with pytest.raises(ValueError, match="2 slots"):
        res.write([None])
    st.close()


def test_write_copies_any_source_bit_exactly_and_refuses_a_wrong_size(kv_server, alloc):
    """write(): CPU contiguous sources go through the streaming copy, others (non-contiguous, another dtype
    and shape) through copy_; the stored bytes are the sources' either way."""
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    base = _blocks(3, 11)
    strided = torch.empty(2 * BLOCK, dtype=torch.uint8)[::2]   # non-contiguous: copy_
    strided.copy_(base[1])
    halves = base[2].view(torch.float16).view(256, -1)          # 2-D float16, contiguous: raw bytes
    sources = [base[0], strided, halves, None]
    res = st.reserve("", [key(20 + j) for j in range(4)], BLOCK, 16)
    assert res.write(sources) == 3
    assert res.commit(wait=True) == 4  # the 4th slot was reserved and published as it was (the caller's choice)
    with st.lookup("", [key(20), key(21), key(22)]) as lease:
        for v, d in zip(lease.views, base):
            assert torch.equal(v, d)
    res = st.reserve("", [key(30)], BLOCK, 16)
    with pytest.raises(ValueError, match="source 0 has 65535 bytes, its slot 65536"):
        res.write([base[0][:-1]])
    res.abort()
    st.close()


def test_a_reservation_asked_ahead_on_a_connection_the_server_closed_dials_again(kv_server, alloc):
    """The connection closed by --idle-timeout before the reserve went out: result() reads a closed socket,
    dials once more (as reserve() does) and returns slots on the new connection; nothing is lost or warned."""
    import warnings

    from cxlalloc.kvstore.local import KVStoreWarning
    from tests.helpers.wait import wait_until

    srv = kv_server(idle_timeout=0.5)
    st = RemoteBlockStore(srv.url, alloc())
    assert wait_until(lambda: srv.stats()["server"]["closed_idle"] >= 1, timeout=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVStoreWarning)
        res = st.reserve_ahead("", [key(40), key(41)], BLOCK, 16).result()
        assert res.slots == 2
        assert res.write(_blocks(2, 5)) == 2 and res.commit(wait=True) == 2
    assert st.counters["reconnects"] == 1 and srv.stats()["pool"]["blocks"] == 2
    st.close()
