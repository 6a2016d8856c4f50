"""LocalBlockStore: exact-size lazily committed arena on the host node, placement
verified, eviction holding the limit, concurrent readers and writers."""

import os
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

from cxlalloc.kvstore import KVStoreWarning, LocalBlockStore  # noqa: E402

MiB = 1 << 20
KiB = 1 << 10


def keys(n, start=0):
    return [(start + i).to_bytes(32, "little") for i in range(n)]


def write(store, ks, nbytes=64 * KiB, fill=None, ns=""):
    with store.reserve(ns, ks, nbytes, 16) as res:
        for i, v in enumerate(res.views):
            if v is not None:
                v.fill_((fill if fill is not None else i) % 251)
        return res.commit()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_store_is_exact_size_lazily_committed_and_starts_at_once(make_alloc):
    a = make_alloc()
    before = rss_bytes()
    s = LocalBlockStore(a, "64GiB")  # far more than this machine's memory
    assert s.capacity_bytes == 64 << 30 and s._arena.size == 64 << 30  # exact, not a power-of-two rounding
    assert rss_bytes() - before < 64 * MiB  # nothing committed up front
    assert write(s, keys(4)) == 4
    st = s.stats()
    assert st["used_bytes"] == 4 * 64 * KiB and st["blocks"] == 4
    # Only the chunk that received blocks is registered for the GPU.
    assert st["registered_bytes"] == 256 * MiB


def test_blocks_read_back_byte_for_byte(make_alloc):
    s = LocalBlockStore(make_alloc(), 4 * MiB)
    write(s, keys(3), fill=None)
    with s.lookup("", keys(5)) as lease:
        assert lease.blocks == 3
        for i, v in enumerate(lease.views):
            assert v.numel() == 64 * KiB and int(v.min()) == int(v.max()) == i
    st = s.stats()
    assert st["lookup_blocks"] == 5 and st["hit_blocks"] == 3 and st["miss_blocks"] == 2
    assert st["hit_rate"] == pytest.approx(0.6)


def test_limit_defaults_to_a_quarter_of_the_host_tier_and_fractions_resolve(make_alloc):
    a = make_alloc(host_limit=256 * MiB)
    assert LocalBlockStore(a).capacity_bytes == 64 * MiB
    assert LocalBlockStore(a, 0.5).capacity_bytes == 128 * MiB
    assert LocalBlockStore(a, "10%").capacity_bytes == int(0.1 * 256 * MiB)
    with pytest.raises(ValueError, match="kv_store_limit"):
        LocalBlockStore(a, "lots")
    with pytest.raises(ValueError, match="kv_store_limit"):
        LocalBlockStore(a, 0)
    with pytest.raises(ValueError, match="kv_store_limit.*host_limit is 0"):
        LocalBlockStore(make_alloc(host_limit=0), 0.5)


def test_full_store_under_constant_inserts_holds_its_limit(make_alloc):
    s = LocalBlockStore(make_alloc(), 1 * MiB)  # 16 blocks of 64 KiB
    for round_ in range(20):
        write(s, keys(8, start=round_ * 8))
        st = s.stats()
        assert st["used_bytes"] <= s.capacity_bytes
    st = s.stats()
    assert st["blocks"] == 16 and st["evicted_blocks"] == 20 * 8 - 16 and st["dropped_blocks"] == 0
    with s.lookup("", keys(8, start=19 * 8)) as lease:  # the newest survive
        assert lease.blocks == 8
    s.check()


def test_aborted_or_failed_writes_are_never_visible(make_alloc):
    s = LocalBlockStore(make_alloc(), 1 * MiB)
    with pytest.raises(RuntimeError):
        with s.reserve("", keys(2), 64 * KiB, 16) as res:
            res.views[0].fill_(1)
            raise RuntimeError("the writer died half-way")
    with s.lookup("", keys(2)) as lease:
        assert lease.blocks == 0
    assert s.stats()["used_bytes"] == 0 and s.stats()["aborted_blocks"] == 2


def test_placement_on_the_cxl_machine_is_verified(cxl_machine, make_alloc):
    cxl_machine()
    a = make_alloc(device_limit=16 * MiB)
    assert a.info()["host_node"] == 1
    s = LocalBlockStore(a, 8 * MiB)
    write(s, keys(4))
    st = s.stats()
    assert st["node"] == 1 and st["numa_method"] == "simulated"
    assert st["placement_verified_bytes"] == 4 * 64 * KiB and st["placement_misplaced_bytes"] == 0


def test_misplaced_pages_are_reported_or_refused(cxl_machine, make_alloc):
    cxl_machine(",relocate=1:0")
    a = make_alloc(device_limit=16 * MiB, numa_node=1)
    s = LocalBlockStore(a, 8 * MiB)
    with pytest.warns(KVStoreWarning, match="outside NUMA node 1"):
        assert write(s, keys(2)) == 2
    assert s.stats()["placement_misplaced_bytes"] == 2 * 64 * KiB
    strict = LocalBlockStore(a, 8 * MiB, strict_placement=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KVStoreWarning)
        assert write(strict, keys(2)) == 0
    assert strict.stats()["blocks"] == 0 and strict.stats()["used_bytes"] == 0


def test_concurrent_readers_and_writers(make_alloc):
    s = LocalBlockStore(make_alloc(), 2 * MiB)  # 32 blocks: eviction runs constantly
    errors = []

    def worker(t):
        try:
            for i in range(60):
                ks = keys(4, start=(t * 7 + i) % 50)
                write(s, ks, fill=t)
                with s.lookup("", ks) as lease:
                    for v in lease.views:  # pinned: nobody overwrites it under us
                        lo, hi = int(v.min()), int(v.max())
                        assert lo == hi, "a block changed while it was read"
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    s.check()
    st = s.stats()
    assert st["used_bytes"] <= s.capacity_bytes and st["stored_blocks"] > 0 and st["evicted_blocks"] > 0
