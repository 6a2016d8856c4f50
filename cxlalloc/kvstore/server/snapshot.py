"""The ``pool`` and ``clients`` parts of a kv-server's stats, read from its state under its lock."""

from __future__ import annotations

import time


def snapshot(st):
    """(pool stats, client list, server counters, rate counters): the
    ``pool`` and ``clients`` parts of ``KVServer.stats()`` (bytes, counts)."""
    with st.lock:
        ic = dict(vars(st.index.c))
        counters = st.counters()
        c = dict(st.c)
        used = st.index.used_bytes
        n_entries = len(st.index.entries)
        ns_bytes = {ns: b for ns, b in st.index.ns_bytes.items() if b}
        writing = st.index.writing_blocks   # running counts: stats never scan the blocks
        pinned = st.index.pinned_blocks
        slot_bytes = st.index.slot_bytes
        per_block = st.index.memory_per_block()
        clients = [{"id": o.id, "pid": o.pid, "uid": o.uid, "name": o.name, "leases": len(o.leases),
                    "reservations": len(o.reservations), "requests": o.requests,
                    "connected_s": round(time.time() - o.since, 1)} for o in st.owners.values()
                   if not o.status_only]
        quotas = dict(st.index.quotas)
        default_quota = st.index.quotas.default
        last_drop = dict(st.last_drop)
    pool = {
        "capacity_bytes": st.size, "mapped_bytes": st.arena.size, "chunk_bytes": st.chunk_bytes,
        "used_bytes": used, "slot_bytes": slot_bytes, "committed_bytes": st.committed_bytes(),
        "index_bytes_per_block": round(per_block, 1), "max_reserve_bytes": st.max_reserve_bytes,
        "refused_reserve_budget": c["refused_reserve_budget"], "reserve_budget_blocks": c["reserve_budget_blocks"],
        "max_pinned_bytes": st.max_pinned_bytes, "refused_pin_budget": c["refused_pin_budget"],
        "pin_budget_blocks": c["pin_budget_blocks"],
        "drop_ms_max": c["drop_us_max"] / 1e3, "lock_hold_ms_max": c["lock_hold_us_max"] / 1e3,
        "lock_holds": st.holds.holds, "lock_handoffs": st.lock.handoffs, "last_drop": last_drop,
        "blocks": n_entries - writing, "writing_blocks": writing, "pinned_blocks": pinned,
        "lookups": ic["lookups"], "lookup_blocks": ic["lookup_blocks"], "hit_blocks": ic["hit_blocks"],
        "hit_tokens": ic["hit_tokens"], "hit_bytes": c["hit_bytes"], "miss_blocks": ic["miss_blocks"],
        "hit_rate": ic["hit_blocks"] / ic["lookup_blocks"] if ic["lookup_blocks"] else 0.0,
        "stored_blocks": ic["stored_blocks"], "stored_bytes": ic["stored_bytes"],
        "duplicate_blocks": ic["duplicate_blocks"], "evicted_blocks": ic["evicted_blocks"],
        "evicted_bytes": ic["evicted_bytes"], "dropped_blocks": ic["dropped_blocks"],
        "aborted_blocks": ic["aborted_blocks"], "dropped_pins": ic["dropped_pins"],
        "placement_verified_bytes": c["placement_verified_bytes"],
        "placement_misplaced_bytes": c["placement_misplaced_bytes"],
        "placement_unverified_bytes": c["placement_unverified_bytes"],
        "placement_skipped_bytes": c["placement_skipped_bytes"],
        "misplaced_dropped_blocks": c["misplaced_dropped_blocks"],
        "redis_hit_blocks": c["redis_hit_blocks"], "redis_hit_bytes": c["redis_hit_bytes"],
        "redis_put_blocks": c["redis_put_blocks"], "redis_hit_tokens": c["redis_hit_tokens"],
        # blocks served to clients by where they were found: the pool itself, or read through from the tier below
        "tiers": {"pool": {"blocks": ic["hit_blocks"] - c["redis_hit_blocks"],
                           "bytes": c["hit_bytes"] - c["redis_hit_bytes"],
                           "tokens": ic["hit_tokens"] - c["redis_hit_tokens"]},
                  "remote": {"blocks": c["redis_hit_blocks"], "bytes": c["redis_hit_bytes"],
                             "tokens": c["redis_hit_tokens"]}},
        "namespaces": {ns: {"used_bytes": b, "quota_bytes": quotas.get(ns, default_quota)}
                       for ns, b in ns_bytes.items()},
        "quotas": {**quotas, **({"*": default_quota} if default_quota is not None else {})},
        "pool_file": dict(st.persist.c, path=st.persist.path) if st.persist is not None else None,
    }
    return pool, clients, c, counters
