"""The placement/migration policy as pure functions (csrc/policy)."""

from cxlalloc._C import policy as P

MiB = 1 << 20


def budget(**kw):
    b = dict(device_limit=100 * MiB, device_reserved=0, host_limit=1000 * MiB, kv_device_quota=None,
             kv_device_bytes=0, device_headroom=0)
    b.update(kw)
    return b


def test_everything_prefers_the_device_while_it_has_room():
    for cls in ("kv", "weight", "other"):
        assert P.first_choice(cls, 20 * MiB, budget()) == "device"


def test_kv_goes_to_host_once_its_quota_is_used():
    b = budget(kv_device_quota=40 * MiB, kv_device_bytes=30 * MiB)
    assert P.first_choice("kv", 20 * MiB, b) == "host"
    assert P.first_choice("kv", 10 * MiB, b) == "device"
    assert P.first_choice("other", 20 * MiB, b) == "device"


def test_kv_keeps_the_activation_headroom_free():
    b = budget(device_reserved=70 * MiB, device_headroom=20 * MiB)
    assert P.first_choice("kv", 20 * MiB, b) == "host"  # 70 + 20 + 20 > 100
    assert P.first_choice("kv", 10 * MiB, b) == "device"
    assert P.first_choice("other", 20 * MiB, b) == "device"


def test_cached_free_device_bytes_count_as_available():
    b = budget(device_reserved=95 * MiB, device_cached_free=40 * MiB)
    assert P.first_choice("kv", 30 * MiB, b) == "device"


def test_private_pools_and_disabled_host_never_spill():
    assert P.first_choice("kv", 20 * MiB, budget(kv_device_quota=0), private_pool=True) == "device"
    assert not P.may_spill("other", budget(), private_pool=True)
    assert not P.may_spill("other", budget(host_limit=0))
    assert P.may_spill("kv", budget())


def test_only_non_kv_requests_demote_kv():
    assert P.may_demote_for("other")
    assert P.may_demote_for("weight")
    assert not P.may_demote_for("kv")
    assert not P.may_demote_for("other", private_pool=True)


def test_victims_are_coldest_first_and_skip_the_current_step():
    cands = [(1, 10 * MiB, 50, False), (2, 10 * MiB, 10, False), (3, 10 * MiB, 5, True), (4, 10 * MiB, 20, False)]
    assert P.choose_victims(15 * MiB, cands, 1 << 40) == [2, 4]
    assert P.choose_victims(35 * MiB, cands, 1 << 40) == []  # 3 is off limits: cannot reach 35 MiB


def test_victims_respect_the_budget_all_or_nothing():
    cands = [(1, 10 * MiB, 1, False), (2, 10 * MiB, 2, False)]
    assert P.choose_victims(15 * MiB, cands, 15 * MiB) == []
    assert P.choose_victims(15 * MiB, cands, 20 * MiB) == [1, 2]


def test_growth_fits_on_device():
    g = P.plan_extent_growth(4, 2 * MiB, budget(), [], 1 << 40)
    assert g == {"host_new": 0, "device_new": 4, "demote": []}


def test_growth_past_quota_demotes_oldest_to_keep_newest_on_device():
    b = budget(kv_device_quota=8 * MiB, kv_device_bytes=8 * MiB, device_reserved=8 * MiB)
    chunks = [(10 + i, 2 * MiB, i, False) for i in range(4)]  # seq 0..3, oldest first
    g = P.plan_extent_growth(2, 2 * MiB, b, chunks, 1 << 40)
    assert g == {"host_new": 0, "device_new": 2, "demote": [10, 11]}


def test_growth_without_budget_places_new_chunks_on_host():
    b = budget(kv_device_quota=8 * MiB, kv_device_bytes=8 * MiB, device_reserved=8 * MiB)
    chunks = [(i, 2 * MiB, i, False) for i in range(4)]
    g = P.plan_extent_growth(2, 2 * MiB, b, chunks, 0)
    assert g == {"host_new": 2, "device_new": 0, "demote": []}
    g = P.plan_extent_growth(2, 2 * MiB, b, chunks, 2 * MiB)
    assert g == {"host_new": 1, "device_new": 1, "demote": [0]}


def test_prefill_bigger_than_quota_puts_oldest_positions_on_host():
    b = budget(kv_device_quota=8 * MiB)
    g = P.plan_extent_growth(10, 2 * MiB, b, [], 1 << 40)
    assert g == {"host_new": 6, "device_new": 4, "demote": []}


def test_growth_with_host_disabled_is_all_device():
    g = P.plan_extent_growth(10, 2 * MiB, budget(kv_device_quota=4 * MiB), [], 0, True, False)
    assert g["device_new"] == 10 and g["host_new"] == 0


def test_promotions_need_repeated_use_room_and_budget():
    b = budget(device_reserved=90 * MiB)
    cands = [(1, 4 * MiB, 9, 5, True), (2, 4 * MiB, 8, 1, True), (3, 4 * MiB, 7, 3, True), (4, 4 * MiB, 6, 3, True)]
    assert P.choose_promotions(b, cands, 2, 1 << 40) == [1, 3]  # 10 MiB room: two chunks, most recent first
    assert P.choose_promotions(b, cands, 2, 4 * MiB) == [1]
    assert P.choose_promotions(budget(device_reserved=100 * MiB), cands, 2, 1 << 40) == []


def test_migration_budget_is_a_token_bucket():
    mb = P.MigrationBudget(100.0, 1000)
    assert mb.available(0.0) == 1000
    assert mb.consume(800, 0.0)
    assert not mb.consume(300, 0.0)
    assert mb.available(1.0) == 300  # refilled 100 B/s
    assert mb.available(100.0) == 1000  # capped at the burst
    off = P.MigrationBudget(0.0, 1000)
    assert off.available(0.0) == 0 and not off.consume(1, 0.0)
