"""RemoteBlockStore when the server is away, dies, hangs or restarts: never an
exception into generate(), never a pin dropped under a reader, reconnects."""

import signal
import time
import warnings

import pytest
import torch

from cxlalloc.kvstore.client import RemoteBlockStore
from cxlalloc.kvstore.local import KVStoreWarning
from tests.kvstore.kvutil import key
from tests.helpers.wait import wait_until

MiB = 1 << 20
BLOCK = 64 << 10


def _store(store, keys, fill=1):
    res = store.reserve("", keys, BLOCK, 16)
    for v in res.views:
        if v is not None:
            v.fill_(fill)
    return res.commit()


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_no_server_yet_warns_once_then_connects_when_it_comes(server_proc, alloc):
    sp = server_proc(start=False)
    with pytest.warns(KVStoreWarning, match="not available"):
        st = RemoteBlockStore(sp.url + "?timeout=1", alloc())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert st.lookup("", [key(1)]).blocks == 0
        res = st.reserve("", [key(1)], BLOCK, 16)
        assert res.views == [None] and res.commit() == 0
    assert st.stats()["connected"] is False
    sp.start()
    assert wait_until(lambda: _store(st, [key(1)]) == 1, timeout=15)
    with st.lookup("", [key(1)]) as lease:
        assert lease.blocks == 1
    assert st.counters["server_errors"] >= 1
    st.close()


def test_server_killed_leases_stay_readable_and_a_restarted_server_is_remapped(server_proc, alloc):
    sp = server_proc()
    st = RemoteBlockStore(sp.url + "?timeout=2", alloc())
    assert _store(st, [key(1), key(2)], fill=9) == 2
    lease = st.lookup("", [key(1), key(2)])
    assert lease.blocks == 2
    first_pool = st.stats()["pool_id"]
    sp.kill()  # SIGKILL while a lease is open
    assert all(bool((v == 9).all()) for v in lease.views)  # the memory outlives the server
    with pytest.warns(KVStoreWarning):
        lease.close()  # no exception
    assert st.lookup("", [key(1)]).blocks == 0
    assert st.reserve("", [key(3)], BLOCK, 16).views == [None]
    sp.start()  # a new server on the same socket: a new, empty pool
    assert wait_until(lambda: _store(st, [key(1)], fill=3) == 1, timeout=15)
    s = st.stats()
    assert s["pool_id"] != first_pool and s["server_restarts"] == 1 and s["reconnects"] >= 1
    with st.lookup("", [key(1)]) as lease:
        assert lease.blocks == 1 and bool((lease.views[0] == 3).all())
    st.close()


def test_a_hung_server_costs_one_timeout_then_nothing_until_backoff(server_proc, alloc):
    sp = server_proc()
    st = RemoteBlockStore(sp.url + "?timeout=0.5", alloc())
    assert _store(st, [key(1)]) == 1
    sp.proc.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: _state(sp.proc.pid) == "T", timeout=5)  # stopped, not just signalled
    try:
        t0 = time.perf_counter()
        with pytest.warns(KVStoreWarning, match="not available") as said:
            assert st.lookup("", [key(1)]).blocks == 0
        assert time.perf_counter() - t0 < 2.0
        assert "_Broken" not in str(said[0].message)  # the cause, in the OS's words, not our class names
        t0 = time.perf_counter()
        assert st.lookup("", [key(1)]).blocks == 0  # within the backoff: no wait at all
        assert time.perf_counter() - t0 < 0.25  # vs the 0.5 s timeout
        assert st.counters["timeouts"] == 1
    finally:
        sp.proc.send_signal(signal.SIGCONT)
    assert wait_until(lambda: st.lookup("", [key(1)]).blocks == 1, timeout=15)
    st.close()


def test_a_failed_connection_stays_open_while_its_leases_are_read(kv_server, alloc):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    _store(st, [key(1), key(2)])
    lease = st.lookup("", [key(1), key(2)])
    conn = st._conn
    conn.abandon()  # as after a timeout on another thread's request
    time.sleep(0.2)
    assert srv.stats()["pool"]["pinned_blocks"] == 2  # closing now would let the server reuse the slots
    lease.close()
    wait_until(lambda: srv.stats()["pool"]["pinned_blocks"] == 0, timeout=5)
    assert srv.stats()["pool"]["pinned_blocks"] == 0 and srv.stats()["pool"]["dropped_pins"] == 2
    assert st.lookup("", [key(1)]).blocks in (0, 1)  # a new connection (or the backoff): no exception
    st.close()


def test_local_fallback_tier_while_the_server_is_away(server_proc, alloc):
    sp = server_proc(start=False)
    with pytest.warns(KVStoreWarning):
        st = RemoteBlockStore(sp.url + "?timeout=1&fallback=16MiB", alloc())
    assert _store(st, [key(5)], fill=4) == 1  # into the local tier
    with st.lookup("", [key(5)]) as lease:
        assert lease.blocks == 1 and bool((lease.views[0] == 4).all())
    assert st.stats()["fallback"]["blocks"] == 1 and st.counters["fallback_lookups"] == 1


def test_bad_urls_name_the_option(alloc):
    a = alloc()
    with pytest.raises(ValueError, match="'kv_store'.*unix:///path"):
        RemoteBlockStore("http://localhost/kv", a)
    with pytest.raises(ValueError, match="unknown URL option"):
        RemoteBlockStore("unix:///tmp/x.sock?frob=1", a)
    with pytest.raises(ValueError, match="timeout"):
        RemoteBlockStore("unix:///tmp/x.sock?timeout=-3", a)
    # inf and values past time_t were accepted, then every request failed with OverflowError as 'server down'
    for bad in ("inf", "1e12", "nan", "abc"):
        with pytest.raises(ValueError, match=r"'kv_store': timeout='.*' must be a finite number of seconds in \(0, 1e\+09\]"):
            RemoteBlockStore(f"unix:///tmp/x.sock?timeout={bad}", a)
    with pytest.raises(ValueError, match="finite number of seconds"):
        RemoteBlockStore("unix:///tmp/x.sock", a, timeout=float("inf"))
    with pytest.raises(ValueError, match="fallback"):
        RemoteBlockStore("unix:///tmp/x.sock?fallback=lots", a)
    from cxlalloc.kvstore.open import open_store

    with pytest.raises(ValueError, match="'kv_store_limit'.*--size.*fallback=SIZE"):
        open_store("unix:///tmp/x.sock", a, limit="8MiB")
    with pytest.raises(ValueError, match="'kv_store'.*not allowed"):
        open_store("tcp://127.0.0.1:1", a)


def test_views_are_cpu_uint8_of_the_block_size(kv_server, alloc):
    srv = kv_server()
    st = RemoteBlockStore(srv.url, alloc())
    res = st.reserve("ns", [key(1)], BLOCK, 16)
    v = res.views[0]
    assert v.dtype == torch.uint8 and v.device.type == "cpu" and v.numel() == BLOCK
    res.abort()
    st.close()


def test_a_lookup_cut_by_the_pin_budget_is_said_once_and_counted(kv_server, alloc):
    # --max-pinned 256 KiB = 4 blocks of 64 KiB: a lookup of 8 stored blocks gets 4, the other 4 are misses the
    # client is told about (budget_cut), warned of once (naming --max-pinned) and counts; before, silent misses
    srv = kv_server(max_pinned=256 * 1024)
    st = RemoteBlockStore(srv.url, alloc())
    keys = [key(i) for i in range(8)]
    assert _store(st, keys) == 8
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lease = st.lookup("", keys)
        assert lease.blocks == 4
        lease.close()
        lease = st.lookup("", keys)
        lease.close()
    said = [str(x.message) for x in w if issubclass(x.category, KVStoreWarning) and "--max-pinned" in str(x.message)]
    assert len(said) == 1 and "answered 4 stored blocks as misses" in said[0], said
    assert st.counters.snapshot()["pin_budget_misses"] == 8
    assert srv.stats()["pool"]["pin_budget_blocks"] == 8
    st.close()


def test_a_connection_closed_for_idleness_before_its_first_request_is_dialled_again(kv_server, alloc):
    """A store connects when it is made (at wrap()), often long before its first lookup: a server with
    --idle-timeout closes that greeted, never-used connection.  Its first lookup used to miss (no second dial:
    'established' counted requests, not the hello), put the server 'down' for the backoff and warn 'not
    available'; now it dials once more, hits, and says nothing."""
    srv = kv_server(idle_timeout=0.5)
    a = alloc()
    writer = RemoteBlockStore(srv.url, a)
    assert _store(writer, [key(1), key(2)]) == 2
    writer.close()
    st = RemoteBlockStore(srv.url, a)  # greeted, no request yet
    assert st.connected()
    assert wait_until(lambda: srv.stats()["server"]["closed_idle"] >= 1, timeout=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVStoreWarning)  # nothing to say: the server is there
        lease = st.lookup("", [key(1), key(2)])
        assert lease.blocks == 2
        lease.close()
    assert st.counters["reconnects"] == 1 and st.counters["skipped_down"] == 0
    st.close()


def test_an_insert_after_an_idle_close_dials_again_and_is_stored(kv_server, alloc):
    """The same for reserve(): the first insert after --idle-timeout closed the store's connection used to be
    lost (no second dial) and the server marked down; now it dials once more and the blocks are stored."""
    srv = kv_server(idle_timeout=0.5)
    st = RemoteBlockStore(srv.url, alloc())
    assert st.connected()
    assert wait_until(lambda: srv.stats()["server"]["closed_idle"] >= 1, timeout=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVStoreWarning)
        assert _store(st, [key(7), key(8)]) == 2
    # the commit is pipelined (protocol 3): the server publishes the blocks when it reads the frame
    assert wait_until(lambda: srv.stats()["pool"]["blocks"] == 2, timeout=10), srv.stats()["pool"]
    assert st.counters["reconnects"] == 1 and st.counters["skipped_down"] == 0
    st.close()

