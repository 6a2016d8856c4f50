"""The tier contract (:class:`cxlalloc.kvstore.tiers.Tier`), checked on every tier below a pool.

Each tier runs against its real backend (the Redis tier: a real
``redis-server`` on 127.0.0.1, started by ``tests/helpers/redis_server.py``).
A new tier joins with one entry of ``TIERS``: a function taking pytest's
``request`` and returning a :class:`Made` (the tier, and how to take its
backend away).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, NamedTuple

import pytest

from cxlalloc.kvstore.keys import namespaced_key
from cxlalloc.kvstore.tiers import STATS_KEYS, Tier
from tests.helpers.wait import wait_until
from tests.kvstore.kvutil import key


class Made(NamedTuple):
    tier: Tier
    stop_backend: Callable[[], None]   # the backend goes away (a tier must then answer misses, never raise)


def _redis(request) -> Made:
    from cxlalloc.kvstore.tiers.redis import RedisTier

    rs = request.getfixturevalue("redis_server")()
    return Made(RedisTier(rs.url, prefix="contract:", timeout=0.5), rs.stop)


TIERS = {"redis": _redis}


@pytest.fixture(params=sorted(TIERS))
def made(request):
    m = TIERS[request.param](request)
    yield m
    m.tier.close(0.5)


def _data(i: int, n: int) -> bytes:
    return bytes([(i * 7 + j) % 251 for j in range(min(n, 251))]) * (n // 251) + bytes(n % 251)


def test_a_tier_is_a_tier_and_its_stats_have_the_contract_keys(made):
    assert isinstance(made.tier, Tier)
    st = made.tier.stats()
    assert set(STATS_KEYS) <= set(st), sorted(set(STATS_KEYS) - set(st))
    assert st["kind"] == made.tier.kind and st["kind"] != "?"


@pytest.mark.parametrize("nbytes", [1, 4096, 1 << 20])
def test_what_is_put_comes_back_byte_for_byte(made, nbytes):
    t = made.tier
    keys = [key(i, b"size%d" % nbytes) for i in range(3)]
    for i, k in enumerate(keys):
        assert t.put(k, "ns", _data(i, nbytes)) is True
    assert t.flush(10)
    assert t.get_many(keys, ns="ns") == [_data(i, nbytes) for i in range(3)]
    st = t.stats()
    assert st["put_blocks"] == 3 and st["put_bytes"] == 3 * nbytes
    assert st["hit_blocks"] == 3 and st["hit_bytes"] == 3 * nbytes and st["lookup_blocks"] == 3
    assert st["up"] is True and st["hit_rate"] == 1.0


def test_a_miss_ends_the_prefix(made):
    t = made.tier
    keys = [key(i, b"prefix") for i in range(5)]
    for i in (0, 1, 3, 4):  # 2 is missing
        t.put(keys[i], "", _data(i, 64))
    assert t.flush(10)
    got = t.get_many(keys)
    assert got[:2] == [_data(0, 64), _data(1, 64)] and got[2:] == [None, None, None]
    assert t.get_many([]) == []
    assert t.stats()["hit_blocks"] == 2


def test_namespaces_never_share_and_namespaced_keys_name_the_same_blocks(made):
    t = made.tier
    k = key(1, b"ns")
    assert t.put(k, "tenant-a", b"a" * 100)
    assert t.put_ns(namespaced_key("tenant-b", k), b"b" * 100)
    assert t.flush(10)
    assert t.get_many([k], ns="tenant-a") == [b"a" * 100]
    assert t.get_many_ns([namespaced_key("tenant-b", k)]) == [b"b" * 100]
    assert t.get_many([k], ns="tenant-c") == [None]
    assert t.get_many([k]) == [None]


def test_threads_put_and_get_at_once(made):
    t = made.tier
    errors = []

    def worker(w):
        try:
            keys = [key(i, b"thread%d" % w) for i in range(20)]
            for i, k in enumerate(keys):
                t.put(k, "", _data(w * 100 + i, 512))
            assert t.flush(10)
            assert t.get_many(keys) == [_data(w * 100 + i, 512) for i in range(20)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == []
    assert t.stats()["put_blocks"] == 80


def test_a_down_tier_answers_misses_and_never_raises(made):
    t = made.tier
    k = key(1, b"down")
    assert t.put(k, "", b"x" * 64) and t.flush(10)
    made.stop_backend()
    t0 = time.monotonic()
    assert t.get_many([k, key(2, b"down")]) == [None, None]
    assert time.monotonic() - t0 < 5.0  # within the tier's own timeout, not a hang
    assert wait_until(t.down, timeout=5.0)
    t0 = time.monotonic()
    assert t.get_many([k]) == [None]  # while down: a miss at once
    assert time.monotonic() - t0 < 0.25
    assert isinstance(t.put(key(3, b"down"), "", b"y" * 64), bool)
    st = t.stats()
    assert st["up"] is False and st["last_error"]


def test_close_is_idempotent_and_later_writes_are_dropped(made):
    t = made.tier
    assert t.put(key(1, b"close"), "", b"z" * 32) and t.flush(10)
    t.close(1.0)
    t.close(1.0)
    assert t.put(key(2, b"close"), "", b"z" * 32) is False
    assert t.stats()["dropped_blocks"] >= 1
