"""A real kv-server process under the attacks of issue 29 that bound shared
resources: pinned tiny blocks on top of every chunk (eviction must not be
pinned away).  Each test states the figure it measures."""

from __future__ import annotations

from tests.kvstore.kvutil import RawClient, key

MiB = 1 << 20
KiB = 1 << 10


def test_pinned_tiny_blocks_on_top_of_every_chunk_keep_90_percent_of_the_honest_capacity(server_proc):
    # 64 MiB pool, 16 chunks of 4 MiB.  The attacker fills it with 16,384 one-byte blocks (a 4 KiB page
    # each), then pins the top block of every chunk (one lease, kept open): 64 KiB pinned in all.
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--log-level", "error")
    atk = RawClient(sp.socket, want_fd=False, name="attacker")
    keys = [key(i, b"atk") for i in range(16384)]
    r = atk.call("reserve", ns="a", keys=keys, nbytes=1, tokens=1)
    assert r["ok"] and sum(s is not None for s in r["slots"]) == 16384
    assert atk.call("commit", res=r["res"])["published"] == 16384
    tops = [k for k, off in zip(keys, r["slots"]) if (off + 4 * KiB) % (4 * MiB) == 0]
    assert len(tops) == 16
    lease = atk.call("lookup", ns="a", keys=tops)
    assert lease["ok"] and len(lease["blocks"]) == 16
    # An honest writer of 64 KiB blocks: 1,024 fit the pool; 16 x 63 = 1,008 fit below the pinned tops.
    honest = RawClient(sp.socket, want_fd=False, name="honest")
    hkeys = [key(i, b"honest") for i in range(1024)]
    for i in range(0, 1024, 128):
        r = honest.call("reserve", ns="h", keys=hkeys[i:i + 128], nbytes=64 * KiB, tokens=16)
        assert r["ok"], r
        honest.call("commit", res=r["res"])
    pool = sp.status()["pool"]
    kept = pool["namespaces"]["h"]["used_bytes"] // (64 * KiB)
    capacity = 64 * MiB // (64 * KiB)
    print(f"honest capacity under the pinned-top attack: {kept}/{capacity} blocks ({kept / capacity:.1%})")
    assert kept >= 0.9 * capacity, (kept, pool)
    assert pool["pinned_blocks"] == 16
    # What was kept is served: the last 512 written are all hits.
    got = honest.call("lookup", ns="h", keys=hkeys[-512:])
    assert got["ok"] and len(got["blocks"]) == 512
    atk.close()
    honest.close()
