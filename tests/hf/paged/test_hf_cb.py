"""Continuous batching of a wrapped model on cxlalloc's tiers (cxlalloc/hf/paged/).

transformers' own continuous batching (``generate_batch``, the manager of
``init_continuous_batching``) on an unwrapped copy of the same model is the
reference: tokens must be identical per request (greedy).  The wrapped model's
paged cache lives in a cxlalloc extent past a device budget smaller than the
batch's KV, so blocks sit on the host tier; a KV store keeps complete blocks
so that a later batch loads stored prefixes instead of prefilling them.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import warnings
import weakref

import pytest

from tests.helpers.hf_util import MiB, tiny_llama, tiny_qwen2_sliding, torch, wrap

import cxlalloc.hf as hf
from cxlalloc.hf.paged import ContinuousBatchingWarning, CxlPagedAttentionCache, plan_moves

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

PAGE = 64
# 4 layers x 2 (K, V) x 4 heads x 32 dims x fp32 x 64 tokens = 256 KiB per block: 8 blocks per 2 MiB chunk.
BLOCK_BYTES = 4 * 2 * 4 * 32 * 4 * PAGE
DEVICE_LIMIT = 8 * MiB  # the tiny model's weights take one segment (4 MiB); 4 MiB of VRAM left for KV


def model():
    return tiny_llama(hidden=128, layers=4, heads=4, kv_heads=4, head_dim=32)


def wrapped(make=None, **kw):
    """A model wrapped under the tests' budget: 4 MiB of VRAM for KV, 64 MiB on the host tier."""
    kw.setdefault("host_limit", 64 * MiB)
    return wrap((make or model)(), device_limit=DEVICE_LIMIT, device_headroom=0, **kw)


def greedy(n):
    return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(**kw):
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_batch_tokens", 512)
    return ContinuousBatchingConfig(**kw)


def prompts(n, base, step, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (base + step * i,), generator=g).tolist() for i in range(n)]


def reference(ps, gen):
    """Plain transformers continuous batching, with room for every block."""
    out = model().generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config(num_blocks=256))
    return [o.generated_tokens for o in out.values()]


def tokens(out):
    return [o.generated_tokens for o in out.values()]


def cb_stats(m):
    return hf.stats(m)["hf"]["continuous_batching"]


def test_plan_moves_keeps_newest_blocks_in_vram():
    # chunks 0..5 on device is full (3 slots); the hot chunks ranked 0 (newest) .. 2
    demote, promote = plan_moves({4: 0, 5: 0, 1: 2}, on_device=[0, 1, 2], device_slots=3)
    assert promote == [4, 5]
    assert sorted(demote) == [0, 2]  # cold chunks go first; chunk 1 (hot, rank 2) stays
    # nothing cold left: a hot chunk is demoted only for a hotter one
    demote, promote = plan_moves({0: 1, 1: 1, 2: 1, 7: 0}, on_device=[0, 1, 2], device_slots=3)
    assert promote == [7] and len(demote) == 1 and demote[0] in (0, 1, 2)
    # room left: promotions without demotions
    assert plan_moves({3: 0}, on_device=[0], device_slots=4) == ([], [3])
    assert plan_moves({}, on_device=[0, 1], device_slots=2) == ([], [])


def test_generate_batch_past_the_device_budget():
    """More requests in flight than the device budget's blocks: all finish with
    transformers' tokens, KV on the host tier, blocks placed per batch."""
    ps = prompts(6, 300, 17)
    gen = greedy(12)
    m = wrapped()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContinuousBatchingWarning)  # a fully tiered path says nothing
        out = m.generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config())
    assert tokens(out) == reference(ps, gen)
    s = cb_stats(m)
    c, cache = s["counters"], s["cache"]
    assert s["tiered"] is True and s["prefix_sharing"] is True
    device_blocks = (4 * MiB) // BLOCK_BYTES  # 16
    assert cache["block_bytes"] == BLOCK_BYTES
    assert cache["num_blocks"] > device_blocks  # default: the device room, and as much again on the host tier
    assert cache["kv_device_bytes"] <= 4 * MiB and cache["kv_host_bytes"] > 0
    assert c["peak_kv_host_bytes"] > 0
    per_request = -(-(300 + 12) // PAGE)  # at least 5 blocks each
    assert c["max_requests_in_flight"] * per_request > device_blocks  # more in flight than VRAM alone holds
    assert c["promoted_bytes"] > 0 and c["placement_failures"] == 0
    assert c["caches"] == 1 and c["managers"] == 1
    # sdpa: one (1, 1, M, N + M) fp32 mask, N = the cache's tokens
    assert cache["attention_mask_bytes"] == 512 * (cache["num_blocks"] * PAGE + 512) * 4
    assert hf.stats(m)["kv"]["peak_host_bytes"] > 0


def test_nothing_spilled_places_without_planning_moves(monkeypatch):
    """Every committed chunk in VRAM (the batch's KV fits the device budget): the per-batch placement plans no
    move (the profiled no-spill overhead of issue 33: ranking every block of the batch, every step); the tiers
    are still noted, and the tokens are transformers'."""
    from cxlalloc.hf.paged import placement

    def no_plan(*a, **k):
        raise AssertionError("plan_moves called with nothing on the host tier")

    monkeypatch.setattr(placement, "plan_moves", no_plan)
    ps = prompts(3, 100, 9)
    gen = greedy(6)
    m = wrap(model(), device_limit=32 * MiB, host_limit=64 * MiB, device_headroom=0)
    out = m.generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config(num_blocks=16))
    assert tokens(out) == reference(ps, gen)
    c = cb_stats(m)["counters"]
    assert c["peak_kv_host_bytes"] == 0 and c["peak_kv_device_bytes"] > 0 and c["steps"] > 0
    assert c["promoted_bytes"] == c["demoted_bytes"] == 0


def test_kv_device_limit_zero_keeps_the_paged_cache_off_vram():
    """kv_device_limit=0: no KV in VRAM, as generate() keeps it; the per-batch placement promotes nothing
    (it took 0 for 'no quota' and promoted chunks into VRAM)."""
    ps = prompts(3, 300, 17)
    gen = greedy(6)
    m = wrap(model(), device_limit=32 * MiB, kv_device_limit=0, host_limit=64 * MiB, device_headroom=0)
    assert tokens(m.generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config())) == \
        reference(ps, gen)
    c = cb_stats(m)["counters"]
    assert c["peak_kv_host_bytes"] > 0 and c["peak_kv_device_bytes"] == 0 and c["promoted_bytes"] == 0, c
    assert hf.stats(m)["kv"]["peak_device_bytes"] == 0


def test_manager_preempts_into_the_host_tier_swap_pool():
    """init_continuous_batching's manager: a cache too small for all requests
    preempts into the swap pool, which lives on the host tier, exactly sized."""
    ps = prompts(5, 150, 21, seed=3)
    gen = greedy(110)
    m = wrapped()
    gib = 4 * MiB / (1 << 30)
    manager = m.init_continuous_batching(generation_config=gen,
                                         continuous_batching_config=cb_config(num_blocks=16, cpu_offload_space=gib))
    manager.start()
    try:
        ids = manager.add_requests(inputs=ps, max_new_tokens=110)
        got = {}
        while len(got) < len(ids):
            r = manager.get_result(timeout=60)
            assert r is not None, "the manager stopped answering"
            if r.is_finished():
                got[r.request_id] = r.generated_tokens
    finally:
        manager.stop(block=True, timeout=10)
    assert [got[i] for i in ids] == reference(ps, gen)
    s = cb_stats(m)
    pool, c = s["swap_pool"], s["counters"]
    assert pool["enabled"] and pool["tier"] == "host"
    assert pool["bytes"] == pool["sectors"] * s["cache"]["sector_bytes"] == 4 * MiB
    assert pool["host_bytes"] == pool["reserved_bytes"] and pool["device_bytes"] == 0
    assert c["preemptions"] > 0 and c["swapped_requests"] == c["preemptions"] and c["reprefilled_requests"] == 0
    manager.destroy()


def test_num_blocks_beyond_both_tiers_is_refused():
    m = wrapped(host_limit=4 * MiB)
    with pytest.raises(ValueError, match=r"num_blocks=1000.*host_limit"):
        m.init_continuous_batching(generation_config=greedy(2),
                                   continuous_batching_config=cb_config(num_blocks=1000))._create_batch_processor()


def test_a_prefix_the_paged_cache_forgot_is_loaded_from_the_store():
    """One manager, requests one after another through a 16-block cache: the
    first document's blocks are evicted (their hashes forgotten, as
    transformers does under pressure) by the next four, yet its next question
    prefills only the question: the document comes back from the store."""
    docs = [torch.randint(3, 1000, (4 * PAGE,), generator=torch.Generator().manual_seed(20 + i)).tolist()
            for i in range(5)]

    def ask(d, seed):
        return docs[d] + torch.randint(3, 1000, (10,), generator=torch.Generator().manual_seed(seed)).tolist()

    seq = [ask(0, 1), ask(1, 2), ask(2, 3), ask(3, 4), ask(4, 5), ask(0, 6)]
    gen = greedy(2)
    m = wrapped(kv_store=True)
    manager = m.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config(num_blocks=16))
    manager.start()
    got = []
    try:
        for p in seq:
            rid = manager.add_request(p, max_new_tokens=2)
            r = manager.get_result(request_id=rid, timeout=60)
            while r is not None and not r.is_finished():
                r = manager.get_result(request_id=rid, timeout=60)
            assert r is not None, "the manager stopped answering"
            got.append(r.generated_tokens)
            if len(got) == 5:
                before = dict(cb_stats(m)["counters"])
    finally:
        manager.stop(block=True, timeout=10)
    assert got == reference(seq, gen)
    c = cb_stats(m)["counters"]
    assert before["stored_blocks"] == 5 * 4 and before["store_hit_tokens"] == 0
    assert c["vram_hit_tokens"] == 0  # the paged cache had forgotten the document
    assert c["store_hit_tokens"] - before["store_hit_tokens"] == 4 * PAGE
    assert c["reprefills_avoided"] == 1 and c["stored_blocks"] == before["stored_blocks"]  # nothing stored twice
    manager.destroy()


def _rag(seed, docs):
    """Six questions over three documents of 4 blocks each (the documents first)."""
    g = torch.Generator().manual_seed(seed)
    return [docs[i % 3] + torch.randint(3, 1000, (20 + i,), generator=g).tolist() for i in range(6)]


def _docs():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 1000, (4 * PAGE,), generator=g).tolist() for _ in range(3)]


def _rag_batch(store, seed, docs):
    """A fresh wrapped model (same weights: same fingerprint) and manager runs the questions of ``seed``."""
    m = wrapped(kv_store=store)
    ps, gen = _rag(seed, docs), greedy(6)
    assert tokens(m.generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config())) \
        == reference(ps, gen)
    return m


def _second_batch_hits(make_store):
    docs = _docs()
    c1 = cb_stats(_rag_batch(make_store(), 1, docs))["counters"]
    assert c1["stored_blocks"] == 12  # the three documents' complete blocks (the questions end mid-block)
    # A second model and manager: nothing of the documents is in its VRAM.
    second = _rag_batch(make_store(), 2, docs)
    c2 = cb_stats(second)["counters"]
    # No document token was prefilled again: each document loaded once from the store, its other request
    # shares those blocks in VRAM.
    assert c2["store_hit_tokens"] == 3 * 4 * PAGE and c2["store_hit_blocks"] == 12
    assert c2["reprefills_avoided"] == 3
    assert c2["store_hit_tokens"] + c2["vram_hit_tokens"] == 6 * 4 * PAGE
    assert c2["bytes_loaded"] == 12 * BLOCK_BYTES and c2["store_failures"] == 0
    # per tier: the documents' blocks from the store (its host memory, or a kv-server's pool), the rest in VRAM
    store_tiers = {t: d for t, d in c2["tiers"].items() if t != "vram_prefix"}
    assert len(store_tiers) == 1 and next(iter(store_tiers)) in ("host", "pool"), c2["tiers"]
    assert next(iter(store_tiers.values())) == {"blocks": 12, "tokens": 3 * 4 * PAGE, "bytes": 12 * BLOCK_BYTES}
    assert c2["tiers"]["vram_prefix"]["tokens"] == c2["vram_hit_tokens"]
    assert cb_stats(second)["kv_store"]["enabled"] is True
    assert c2["peak_kv_host_bytes"] > 0  # the hits landed in a cache that spans both tiers


def test_stored_prefixes_reload_from_the_in_process_store():
    from cxlalloc.kvstore import LocalBlockStore

    holder = {}

    def store():
        if "s" not in holder:
            import cxlalloc

            holder["a"] = cxlalloc.Allocator(simulate=True, device_limit=4 * MiB, host_limit=32 * MiB)
            holder["s"] = LocalBlockStore(holder["a"], limit=16 * MiB)
        return holder["s"]

    _second_batch_hits(store)


def test_stored_prefixes_reload_from_a_kv_server():
    from cxlalloc.kvstore.server import KVServer

    d = tempfile.mkdtemp(prefix="kvcb-", dir="/tmp")
    server = KVServer(32 * MiB, 0, os.path.join(d, "kv.sock"), chunk_bytes=4 * MiB).start()
    try:
        _second_batch_hits(lambda: "unix://" + server.socket_path)
    finally:
        server.stop(0.5)
        shutil.rmtree(d, ignore_errors=True)


def test_sliding_model_is_tiered_and_says_once_that_prefixes_are_not_shared():
    ps = prompts(3, 60, 13)
    gen = greedy(5)

    def qwen():
        return tiny_qwen2_sliding(window=16)

    ref = qwen().generate_batch(ps, generation_config=gen,
                                continuous_batching_config=cb_config(page_size=16, num_blocks=128))
    m = wrapped(qwen, kv_device_limit=MiB)  # below one chunk: the cache's blocks are on the host tier
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            out = m.generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config(page_size=16))
            assert tokens(out) == tokens(ref)
    said = [x for x in w if issubclass(x.category, ContinuousBatchingWarning)]
    assert len(said) == 1 and "not shared" in str(said[0].message) and "sliding_attention" in str(said[0].message)
    s = cb_stats(m)
    assert s["tiered"] is True and s["prefix_sharing"] is False
    assert "full attention" in s["prefix_sharing_off_reason"]
    assert s["cache"]["layer_kinds"] == ["full_attention", "sliding_attention"]
    assert s["counters"]["peak_kv_host_bytes"] > 0


def test_unwrap_gives_back_transformers_paged_cache():
    m = wrapped()
    assert "init_continuous_batching" in m.__dict__
    hf.unwrap(m)
    assert "init_continuous_batching" not in m.__dict__
    manager = m.init_continuous_batching(generation_config=greedy(2),
                                         continuous_batching_config=cb_config(num_blocks=8))
    bp = manager._create_batch_processor()
    assert not isinstance(bp.cache, CxlPagedAttentionCache)
    manager.destroy()


def test_a_transformers_without_the_pieces_is_left_untiered_and_says_so_once(monkeypatch):
    """Where the paged cache cannot be replaced (another transformers), the
    path runs as transformers' own, says so once, and stats() says untiered."""
    from cxlalloc.hf.paged import patching

    monkeypatch.setattr(patching, "CB_GAP", "transformers X lacks the continuous-batching modules cxlalloc uses")
    m = wrapped()
    assert cb_stats(m)["tiered"] is False
    ps = prompts(2, 20, 5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            out = m.generate_batch(ps, generation_config=greedy(3),
                                   continuous_batching_config=cb_config(num_blocks=16))
    said = [x for x in w if issubclass(x.category, ContinuousBatchingWarning)]
    assert len(said) == 1 and "is not tiered" in str(said[0].message)
    assert tokens(out) == reference(ps, greedy(3))
    s = cb_stats(m)
    assert s["tiered"] is False and "lacks" in s["untiered_reason"] and s["cache"] is None
    assert s["counters"]["caches"] == 0


def test_seeded_sampling_matches_transformers():
    """do_sample with ContinuousBatchingConfig(seed=...): the same tokens as
    transformers' own paged cache of the same size, with blocks on the host tier."""
    ps = prompts(4, 150, 30)
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=50, eos_token_id=-1,
                           pad_token_id=0)

    def run(mm):
        return tokens(mm.generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config(num_blocks=40,
                                                                                                       seed=7)))

    m = wrapped(kv_device_limit=MiB)  # below one chunk: the cache's blocks are on the host tier
    assert run(m) == run(model())
    assert cb_stats(m)["cache"]["kv_host_bytes"] > 0


def test_a_request_answered_in_one_token_still_stores_its_prompt():
    """transformers never hashes the blocks of a request that finishes on its
    first token; they are stored anyway before its blocks are freed, and the
    next request over the same document loads them."""
    doc = torch.randint(3, 1000, (2 * PAGE,), generator=torch.Generator().manual_seed(3)).tolist()
    ps = [doc + [5, 6, 7], doc + [8, 9]]
    m = wrapped(kv_store=True)
    for p in ps:  # one manager each: nothing survives in VRAM between them
        out = m.generate_batch([p], generation_config=greedy(1), continuous_batching_config=cb_config())
        assert tokens(out) == reference([p], greedy(1))
    c = cb_stats(m)["counters"]
    assert c["stored_blocks"] == 2 and c["store_hit_tokens"] == 2 * PAGE and c["reprefills_avoided"] == 1


def test_no_vram_for_kv_runs_on_the_host_tier():
    """The weights fill device_limit (no VRAM room for KV) and a sector is 1 MiB
    (page_size 256), so one 2 MiB chunk holds no sector besides the two trash
    ones: continuous batching still runs, its whole paged cache on the host
    tier, with transformers' tokens (it used to refuse: "needs at least 3.00 MiB")."""
    ps = prompts(4, 200, 30)
    gen = greedy(8)
    ref = model().generate_batch(ps, generation_config=gen,
                                 continuous_batching_config=cb_config(page_size=256, num_blocks=64))
    m = wrap(model(), device_limit=4 * MiB, device_headroom=0, host_limit=64 * MiB)  # weights: the whole 4 MiB
    out = m.generate_batch(ps, generation_config=gen, continuous_batching_config=cb_config(page_size=256))
    assert tokens(out) == tokens(ref)
    cache = cb_stats(m)["cache"]
    assert cache["block_bytes"] == 4 * MiB // 4 and cache["sector_bytes"] == MiB
    # one batch's 512 tokens are 2 blocks: the floor of 4 blocks, + 2 trash sectors = 6 MiB, all on the host tier
    assert cache["num_blocks"] == 4 and cache["cache_bytes"] == 6 * MiB
    assert cache["kv_device_bytes"] == 0 and cache["kv_host_bytes"] == cache["committed_bytes"] > 0


def test_a_wrapped_model_is_freed_by_one_gc_pass_after_generate_batch():
    """Its tiers go back with the model: a manager -> state mapping held from a
    module kept the model alive until the manager's own cycle was collected, so
    one ``gc.collect()`` did not free it (it took two; plain transformers: one)."""
    m = wrap(model())
    m.generate_batch(prompts(4, 200, 30), generation_config=greedy(8), continuous_batching_config=cb_config())
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None
