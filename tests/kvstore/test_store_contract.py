"""The BlockStore contract (cxlalloc.kvstore.store), run over every store.

Each store is one entry of ``STORES``: a function ``(request, alloc, capacity)
-> (store, close)`` that builds it on real components (a simulated allocator, a
real KVServer on a temp socket, a real redis-server on 127.0.0.1).  A new store
is its module plus one entry here; every test below then runs on it.

Blocks are 64 KiB and the stores hold 1 MiB (16 blocks), so eviction starts at
the 17th block in every store.
"""

import weakref

import pytest
import torch

from cxlalloc.kvstore.client import RemoteBlockStore
from cxlalloc.kvstore.local import LocalBlockStore
from cxlalloc.kvstore.open import open_store
from cxlalloc.kvstore.store import TRANSFER_FIELDS, BlockLease, BlockReservation, BlockStore
from tests.kvstore.kvutil import key

MiB = 1 << 20
BLOCK = 64 << 10
CAPACITY = 1 * MiB  # 16 blocks


def _local(request, alloc, capacity):
    return LocalBlockStore(alloc(), capacity), lambda: None


def _server(request, alloc, capacity):
    srv = request.getfixturevalue("kv_server")(size=capacity, chunk=capacity)
    st = RemoteBlockStore(srv.url, alloc())
    ref = weakref.ref(st)  # the closer must not keep the store (and its mapping of the pool) alive
    return st, lambda: ref() is not None and ref().close()


def _redis_backed(request, alloc, capacity):
    from cxlalloc.kvstore.tiers.redis import RedisTier

    rs = request.getfixturevalue("redis_server")()
    lower = RedisTier(rs.url)
    return LocalBlockStore(alloc(), capacity, lower=lower), lambda: lower.close(1.0)


STORES = {"local": _local, "server": _server, "redis": _redis_backed}
SIZE_OPTION = {"local": "kv_store_limit", "server": "--chunk", "redis": "kv_store_limit"}  # named by "never fits"


@pytest.fixture(params=sorted(STORES))
def make_store(request, alloc):
    """``make_store()`` -> the parameter's store.  A factory, so the test's own
    reference is the last one: the store's arena and registrations are gone
    before the simulator's leak check of ``fresh_sim``."""
    closers = []

    def make():
        st, close = STORES[request.param](request, alloc, CAPACITY)
        closers.append(close)
        return st

    make.size_option = SIZE_OPTION[request.param]

    yield make
    for close in closers:
        close()


def _write(store, keys, fill=None, ns=""):
    """Reserve, fill block i with (fill or i + 1), commit; returns blocks published."""
    with store.reserve(ns, keys, BLOCK, 16) as res:
        assert isinstance(res, BlockReservation)
        for i, v in enumerate(res.views):
            if v is not None:
                v.fill_(fill if fill is not None else (i + 1) % 251)
        return res.commit()


def test_every_store_implements_the_contract_and_open_store_takes_it(make_store):
    store = make_store()
    assert isinstance(store, BlockStore)
    assert open_store(store, allocator=None) is store  # a store object is used as it is


def test_an_object_that_is_only_part_of_a_store_is_refused_naming_what_it_lacks():
    class Half:
        kind = "half"

        def lookup(self, ns, keys):
            return None

    with pytest.raises(ValueError, match="'kv_store'.*Half.*reserve.*record_load"):
        open_store(Half(), allocator=None)


def test_a_miss_is_an_empty_lease(make_store):
    store = make_store()
    with store.lookup("", [key(i) for i in range(4)]) as lease:
        assert isinstance(lease, BlockLease)
        assert lease.blocks == 0 and list(lease.views) == []


def test_committed_blocks_read_back_byte_for_byte(make_store):
    store = make_store()
    keys = [key(i) for i in range(3)]
    assert _write(store, keys) == 3
    with store.lookup("", keys + [key(98), key(99)]) as lease:
        assert lease.blocks == 3
        for i, v in enumerate(lease.views):
            assert v.dtype == torch.uint8 and v.numel() == BLOCK and int(v.min()) == int(v.max()) == i + 1
    st = store.stats()
    assert st["lookup_blocks"] == 5 and st["hit_blocks"] == 3 and st["hit_rate"] == pytest.approx(0.6)
    assert _write(store, keys) == 0  # stored already: no slots


def test_aborted_or_failed_writes_are_never_visible(make_store):
    store = make_store()
    with pytest.raises(RuntimeError):
        with store.reserve("", [key(1), key(2)], BLOCK, 16) as res:
            res.views[0].fill_(1)
            raise RuntimeError("the writer died half-way")
    res = store.reserve("", [key(3)], BLOCK, 16)
    res.abort()
    assert res.commit() == 0  # nothing to publish after an abort
    with store.lookup("", [key(1), key(2), key(3)]) as lease:
        assert lease.blocks == 0
    st = store.stats()
    assert st["used_bytes"] == 0 and st["blocks"] == 0


def test_a_pinned_block_survives_eviction_and_release_gives_its_room_back(make_store):
    store = make_store()
    keep = [key(i, b"pinned") for i in range(2)]
    assert _write(store, keep, fill=7) == 2
    lease = store.lookup("", keep)
    assert lease.blocks == 2
    for r in range(4):  # 32 more blocks through a 16-block store
        _write(store, [key(r * 8 + i) for i in range(8)], fill=r)
        assert all(bool((v == 7).all()) for v in lease.views)  # never overwritten under the reader
    with store.reserve("", [key(100 + i) for i in range(16)], BLOCK, 16) as res:
        assert res.slots == 14  # the two pinned blocks hold their room
    lease.close()
    with store.reserve("", [key(200 + i) for i in range(16)], BLOCK, 16) as res:
        assert res.slots == 16  # released: every block may be evicted again


def test_eviction_holds_the_limit_and_keeps_the_newest(make_store):
    store = make_store()
    for r in range(3):
        assert _write(store, [key(r * 8 + i) for i in range(8)]) == 8
        st = store.stats()
        assert st["used_bytes"] <= st["capacity_bytes"] == CAPACITY
    st = store.stats()
    assert st["blocks"] == 16 and st["evicted_blocks"] == 8 and st["stored_blocks"] == 24
    with store.lookup("", [key(16 + i) for i in range(8)]) as lease:
        assert lease.blocks == 8


def test_a_block_that_can_never_fit_is_a_clear_error(make_store):
    store = make_store()
    option = make_store.size_option
    with pytest.raises(ValueError, match="'kv_store.*" + option):
        store.check_block_bytes(2 * CAPACITY)
    with pytest.raises(ValueError, match="'kv_store.*" + option):
        store.reserve("", [key(1)], 2 * CAPACITY, 16)


def test_stats_accounting_is_the_same_in_every_store(make_store):
    store = make_store()
    keys = [key(i) for i in range(4)]
    store.lookup("", keys).close()  # 4 misses
    assert _write(store, keys[:3]) == 3
    store.record_store(3 * BLOCK, 0.001)
    with store.lookup("", keys) as lease:  # 3 hits, 1 miss
        assert lease.blocks == 3
    store.record_load(3 * BLOCK, 0.002)
    store.record_failure()
    st = store.stats()
    assert set(TRANSFER_FIELDS) <= set(st)
    got = {k: st[k] for k in ("lookup_blocks", "hit_blocks", "hit_rate", "blocks", "used_bytes", "stored_blocks",
                              "evicted_blocks", "capacity_bytes", *TRANSFER_FIELDS)}
    assert got == {"lookup_blocks": 8, "hit_blocks": 3, "hit_rate": 3 / 8, "blocks": 3, "used_bytes": 3 * BLOCK,
                   "stored_blocks": 3, "evicted_blocks": 0, "capacity_bytes": CAPACITY,
                   "bytes_loaded": 3 * BLOCK, "load_seconds": 0.002, "loads": 1, "bytes_stored": 3 * BLOCK,
                   "store_seconds": 0.001, "load_failures": 1}
    assert st["load_GBps"] == pytest.approx(3 * BLOCK / 0.002 / 1e9)
    assert st["store_GBps"] == pytest.approx(3 * BLOCK / 0.001 / 1e9)
