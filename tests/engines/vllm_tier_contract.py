"""cxlalloc's vLLM secondary tier driven by vLLM's own ``TieringOffloadingManager``, no engine (run in the engine
venv by tests/engines/test_vllm_offload_tier.py: ``python -m tests.engines.vllm_tier_contract SOCKET OUT.json``).

Two managers stand for two vLLM processes: each is vLLM's ``TieringOffloadingSpec`` built from the same
``kv_connector_extra_config`` (its CPU primary tier in a ``/dev/shm`` region of its own, cxlalloc's tier
created by vLLM's secondary tier factory from ``module_path``), called the way vLLM's offloading connector
calls it: ``prepare_store`` / ``complete_store`` (the cascade into the pool), ``lookup`` (which starts a
promotion), ``on_schedule_end`` (which submits it), ``lookup`` again until ``HIT``, ``prepare_load``.  The only
stand-in is the device copy: the test writes chunk bytes into the primary tier where vLLM's worker would
copy them from the device, and reads them back from there.

What it records (the test asserts it): the bytes the second manager promotes equal the first's; a chunk with
one byte changed in the pool is a miss for the second manager (its promotion fails, the server drops the
chunk); with the kv-server killed, lookups are misses and cascades fail without an exception; a bad tier
parameter is one error naming it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid


def _config(url: str, blocks: int, page: int, extra_tier=None):
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    tier = {"type": "CxlallocSecondaryTier", "module_path": "cxlalloc.kvstore.engines.vllm_tier", "url": url}
    tier.update(extra_tier or {})
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": blocks * page, "secondary_tiers": [tier]}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=False, extra_config=extra,
        engine_id="cxlalloc-contract-" + uuid.uuid4().hex[:8],
        model=OffloadingModelConfig(name="contract-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))


class Engine:
    """vLLM's tiering spec and manager of one simulated vLLM process."""

    def __init__(self, url: str, blocks: int = 16, page: int = 64 * 1024, extra_tier=None):
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        self.spec = OffloadingSpecFactory.create_spec(_config(url, blocks, page, extra_tier))
        self.m = self.spec.get_manager()
        self.tier = self.m.secondary_tiers[0]
        import numpy as np

        self.view = np.asarray(self.m.primary_tier.get_kv_memoryview()).view(np.uint8)   # (chunks, bytes)
        self.n = 0

    def req(self):
        from vllm.v1.kv_offload.base import ReqContext

        self.n += 1
        r = ReqContext(req_id=f"r{self.n}")
        self.m.on_new_request(r)
        return r

    def step(self, new=()):
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.m.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))

    def row(self, chunk_id: int) -> bytes:
        return self.view[int(chunk_id)].tobytes()

    def store(self, keys, payloads, wait: float = 20.0) -> dict:
        """prepare_store, the device copy (stand-in), complete_store (the cascade), then step until done."""
        import numpy as np

        r = self.req()
        out = self.m.prepare_store(keys, r)
        assert out is not None and list(out.keys_to_store) == list(keys), out
        for k, c in zip(out.keys_to_store, out.store_spec.block_ids):
            self.view[int(c)] = np.frombuffer(payloads[keys.index(k)], dtype=np.uint8)
        self.m.complete_store(keys, r, True)
        self.m.on_request_finished(r)
        deadline = time.monotonic() + wait
        while self.m.has_pending_work() and time.monotonic() < deadline:
            self.step()
            time.sleep(0.01)
        return self.tier.stats()

    def fetch(self, keys, wait: float = 20.0):
        """vLLM's load path for ``keys`` in order: lookup (a promotion starts), step, lookup until HIT or MISS;
        then prepare_load.  Returns (the lookup results per key, the promoted bytes of the HIT keys)."""
        from vllm.v1.kv_offload.base import LookupResult

        r = self.req()
        results = {}
        deadline = time.monotonic() + wait
        for k in keys:
            while True:
                res = self.m.lookup(k, r)
                if res in (LookupResult.HIT, LookupResult.MISS) or time.monotonic() > deadline:
                    break
                self.step([r.req_id])
                time.sleep(0.01)
            results[k] = res.name
        hits = [k for k in keys if results[k] == "HIT"]
        got = {}
        if hits:
            spec = self.m.prepare_load(hits, r)
            for k, c in zip(hits, spec.block_ids):
                got[k] = self.row(c)
            self.m.complete_load(hits, r)
        self.m.on_request_finished(r)
        self.step()
        return results, got

    def close(self):
        self.m.shutdown()


def main(argv) -> int:
    import numpy as np

    from tests.kvstore.kvutil import RawClient

    sock, out_path = argv[0], argv[1]
    url = "cxlalloc://" + sock + "?timeout=2"
    out = {}
    rng = np.random.default_rng(7)
    page = 64 * 1024
    keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(1, 7)]   # OffloadKey: block hash + group
    payloads = [rng.integers(0, 256, page, dtype=np.uint8).tobytes() for _ in keys]

    a, b = Engine(url), Engine(url)
    out["store_a"] = a.store(keys, payloads)
    res, got = b.fetch(keys[:4])   # keys 4 and 5 stay out of b's primary tier (asked again when the pool is down)
    out["fetch_b"] = {"results": [res[k] for k in keys[:4]],
                      "equal": [got.get(k) == p for k, p in zip(keys[:4], payloads)]}
    out["tier_b"] = b.tier.stats()

    # one byte of one stored chunk changed in the pool by another client: a miss for a third engine
    c = Engine(url)
    sk = c.tier.server_key(keys[2])
    raw = RawClient(sock, name="buggy")
    reply = raw.call("lookup", ns=c.tier.ns, keys=[sk])
    (off, n, _), = reply["blocks"]
    raw.call("release", leases=[reply["lease"]])
    mm = raw.mapping()
    mm[off + n // 2] ^= 0x01
    res, got = c.fetch([keys[2], keys[3]])
    out["fetch_corrupt"] = {"results": [res[keys[2]], res[keys[3]]], "equal_3": got.get(keys[3]) == payloads[3]}
    out["tier_c"] = c.tier.stats()
    # the server verified and dropped it: looked up again, a plain miss
    out["after_drop"] = c.tier.lookup(keys[2], c.req()).name
    raw.close()

    # a bad parameter: one error naming it
    errs = {}
    for bad in ({"io_threads": 0}, {"colour": "red"}, {"url": "redis://x"}, {"locality": "MOON"}):
        try:
            Engine(url, extra_tier=bad)
            errs[json.dumps(bad)] = None
        except Exception as e:  # vLLM's factory lets the tier's error through
            errs[json.dumps(bad)] = f"{type(e).__name__}: {e}"
    out["bad_params"] = errs

    # the kv-server killed: lookups miss, cascades fail, nothing raises into the manager
    os.kill(int(argv[2]), 9)
    time.sleep(0.5)
    res, _ = b.fetch([keys[4]])   # not in b's primary tier (never promoted): asks the pool
    out["down_lookup"] = res[keys[4]]
    new = [bytes([0xEE]) * 32 + (0).to_bytes(4, "big")]
    out["down_store"] = b.store(new, [payloads[0]])
    for e in (a, b, c):
        e.close()
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
