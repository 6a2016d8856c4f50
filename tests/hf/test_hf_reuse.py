"""KV reuse across generate() calls (cxlalloc.hf.wrap(model, kv_store=...)), simulation.

The oracle is transformers' own documented prompt reuse (a prefix cache built
by a forward pass, deep-copied and passed to generate()) and a full recompute
by the unwrapped model."""

import copy
import functools
import threading
import warnings

import pytest

from tests.helpers import hf_util
from tests.helpers.hf_util import MiB, assert_same_tokens, gen, padded_batch, tiny_gpt2, tiny_llama, tiny_qwen2_sliding, torch

import cxlalloc.hf as hf
from cxlalloc.hf.reuse import KVReuseWarning
from cxlalloc.kvstore import LocalBlockStore

BT = 8
N_NEW = 10


def tiny_qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(kw.pop("seed", 0))
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
    m = Qwen2ForCausalLM(cfg).eval()
    m.config._attn_implementation = "sdpa"
    return m


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2": tiny_qwen2}


# The tests' budget (tests.helpers.hf_util.wrap) with an in-process store of BT-token blocks; each keyword overridable.
wrap = functools.partial(hf_util.wrap, kv_store=True, block_tokens=BT)


def ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (1, n), generator=g)


def last(model):
    return hf.stats(model)["hf"]["reuse"]["last"]


def prompt_reuse(model, prompt, hit, **kw):
    """transformers' documented way: prefill the prefix once, deep-copy the cache per request."""
    from transformers import DynamicCache

    name = hf.cache_kwarg(model)
    prefix = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :hit], use_cache=True, **{name: prefix})
    return gen(model, input_ids=prompt, **{name: copy.deepcopy(prefix)}, **kw)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_hit_gives_the_tokens_of_transformers_prompt_reuse_and_of_recompute(fresh_sim, name, mode):
    kw = dict(max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=(mode == "sample"))
    ref = MODELS[name]()
    m = MODELS[name]()
    wrap(m)
    doc = ids(61, seed=1)
    p1, p2 = torch.cat([doc, ids(5, 2)], 1), torch.cat([doc, ids(7, 3)], 1)
    gen(m, input_ids=p1, **kw)
    assert last(m)["hit_tokens"] == 0 and last(m)["stored_blocks"] == (66 + N_NEW - 1) // BT
    out = gen(m, input_ids=p2, **kw)
    rec = last(m)
    assert rec["hit_tokens"] == 56 and rec["bytes_loaded"] > 0  # the 7 full blocks of the shared document
    # Identical tokens; scores equal to rounding: the stored K/V came from a
    # prefill of 66 tokens, transformers' prefix cache from one of 56, and
    # attention over other lengths sums in another order (measured: 7e-8 on
    # the llama, 0 against the full recompute).
    assert_same_tokens(prompt_reuse(ref, p2, 56, **kw), out, atol=1e-5)
    assert_same_tokens(gen(ref, input_ids=p2, **kw), out, atol=1e-5)


def test_multi_turn_chat_hits_the_previous_answer(fresh_sim):
    ref, m = tiny_llama(), tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    turn = ids(30, seed=5)
    prev_len = 0
    for t in range(4):
        out = gen(m, input_ids=turn, **kw).sequences
        rec = last(m)
        if t:
            # every full block of the previous prompt and answer (its cache held len-1 tokens)
            assert rec["hit_tokens"] == (prev_len - 1) // BT * BT
        assert torch.equal(out, gen(ref, input_ids=turn, **kw).sequences)
        prev_len = out.shape[1]
        turn = torch.cat([out, ids(6, seed=10 + t)], 1)
    c = hf.stats(m)["hf"]["reuse"]["counters"]
    assert c["calls"] == 4 and c["calls_with_hit"] == 3


MODES = {
    "beam4-nrs2": dict(num_beams=4, num_return_sequences=2, do_sample=False),
    "sample-nrs3": dict(do_sample=True, num_return_sequences=3),
    "beam3-sample": dict(num_beams=3, do_sample=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_beams_and_return_sequences_stay_identical(fresh_sim, mode):
    ref, m = tiny_llama(), tiny_llama()
    wrap(m)
    kw = dict(MODES[mode], max_new_tokens=N_NEW, min_new_tokens=N_NEW)
    p = ids(45, seed=4)
    for _ in range(2):
        out = gen(m, input_ids=p, **kw)
        assert torch.equal(out.sequences, gen(ref, input_ids=p, **kw).sequences)
    # the second call reuses the prompt's blocks: for beams only the prompt was stored
    assert last(m)["hit_tokens"] == 40


def test_a_padded_batch_reuses_up_to_its_shortest_row(fresh_sim):
    ref, m = tiny_llama(), tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    doc = ids(40, seed=6)
    gen(m, input_ids=torch.cat([doc, ids(3, 7)], 1), **kw)  # stores the document's 5 blocks
    # row 0: doc + 5 tokens (no pad); row 1: 4 pads, doc[:33] + 8 tokens
    r0 = torch.cat([doc, ids(5, 8)], 1)
    r1 = torch.cat([torch.zeros((1, 4), dtype=torch.long), doc[:, :33], ids(8, 9)], 1)
    batch = dict(input_ids=torch.cat([r0, r1]), attention_mask=torch.cat([torch.ones_like(r0), torch.ones_like(r1)]))
    batch["attention_mask"][1, :4] = 0
    out = gen(m, **batch, **kw)
    rec = last(m)
    assert rec["row_hit_tokens"] == [40, 32]
    assert rec["hit_tokens"] == min(0 + 40, 4 + 32)  # one cache length for the batch
    assert rec["reused_tokens"] == 36 + 32
    assert torch.equal(out.sequences, gen(ref, **batch, **kw).sequences)


def test_right_padding_and_user_caches_are_not_looked_up(fresh_sim):
    m = tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=4, do_sample=False)
    b = padded_batch()
    b["attention_mask"] = b["attention_mask"].flip(1)  # right padding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen(m, **b, **kw)
    assert last(m)["skipped"] == "the attention mask is not left padding" and last(m)["stored_blocks"] == 0
    from transformers import DynamicCache

    gen(m, input_ids=ids(20, 1), **{hf.cache_kwarg(m): DynamicCache(config=m.config)}, **kw)
    assert last(m)["skipped"] == "a cache was passed in"
    gen(m, input_ids=ids(20, 1), kv_reuse=False, **kw)
    assert last(m)["skipped"] == "kv_reuse=False"


def test_namespaces_models_dtypes_and_changed_weights_never_hit(fresh_sim):
    import cxlalloc

    kw = dict(max_new_tokens=4, do_sample=False)
    p = ids(40, seed=11)
    alloc = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=256 * MiB)
    store = LocalBlockStore(alloc, 16 * MiB)
    a, twin, other = tiny_llama(seed=0), tiny_llama(seed=0), tiny_llama(seed=1)
    wrap(a, kv_store=store)
    gen(a, input_ids=p, **kw)
    gen(a, input_ids=p, cache_salt="tenant-b", **kw)  # another namespace: no hit
    assert last(a)["hit_tokens"] == 0 and last(a)["namespace"] == "tenant-b"
    gen(a, input_ids=p, **kw)
    assert last(a)["hit_tokens"] == 32
    wrap(twin, kv_store=store)  # the same weights loaded again: a hit (positive control)
    gen(twin, input_ids=p, **kw)
    assert last(twin)["hit_tokens"] == 32
    wrap(other, kv_store=store)  # same architecture and config, other weights
    gen(other, input_ids=p, **kw)
    assert last(other)["hit_tokens"] == 0
    half = tiny_llama(seed=0).to(torch.bfloat16)
    wrap(half, kv_store=store)
    gen(half, input_ids=p, **kw)
    assert last(half)["hit_tokens"] == 0
    deeper = tiny_llama(seed=0, layers=3)
    wrap(deeper, kv_store=store)
    gen(deeper, input_ids=p, **kw)
    assert last(deeper)["hit_tokens"] == 0
    salted = tiny_llama(seed=0)
    wrap(salted, kv_store=store, cache_salt="tenant-c")
    gen(salted, input_ids=p, **kw)
    assert last(salted)["hit_tokens"] == 0
    with torch.no_grad():  # a training step in place: the fingerprint follows
        next(a.parameters()).add_(1e-3)
    gen(a, input_ids=p, **kw)
    assert last(a)["hit_tokens"] == 0


def test_eviction_under_a_small_limit_keeps_tokens_right(fresh_sim):
    ref, m = tiny_llama(), tiny_llama()
    row = 2 * 2 * 2 * 16 * 4  # layers * K,V * kv_heads * head_dim * fp32 bytes per token
    block = BT * row + 16  # the payload and its checksum trailer
    limit = 7 * 4096  # whole pages (the store's chunk unit): six blocks and their trailers
    wrap(m, kv_store_limit=limit)
    kw = dict(max_new_tokens=4, do_sample=False)
    for seed in range(5):
        p = ids(33, seed=20 + seed)
        assert torch.equal(gen(m, input_ids=p, **kw).sequences, gen(ref, input_ids=p, **kw).sequences)
        st = hf.stats(m)["hf"]["reuse"]["store"]
        assert st["used_bytes"] <= st["capacity_bytes"] == limit
    assert st["evicted_blocks"] > 0 and st["blocks"] == limit // block == 6


def test_a_failed_load_falls_back_to_recompute(fresh_sim):
    ref, m = tiny_llama(), tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=6, do_sample=False)
    p = ids(50, seed=30)
    gen(m, input_ids=p, **kw)
    # A bad block: the store hands back bytes of the wrong size.
    store = hf.stats(m)["hf"]["reuse"]["store"]
    real_lookup = m._cxlalloc_hf.reuse.store.lookup

    def short_lookup(ns, keys):
        lease = real_lookup(ns, keys)
        lease.views = [v[:-4] for v in lease.views]
        return lease

    m._cxlalloc_hf.reuse.store.lookup = short_lookup
    out = gen(m, input_ids=p, **kw)
    rec = last(m)
    assert rec["hit_tokens"] == 0 and "expected" in rec["fallback"]
    assert torch.equal(out.sequences, gen(ref, input_ids=p, **kw).sequences)
    m._cxlalloc_hf.reuse.store.lookup = real_lookup
    # The driver runs out of memory while the loaded prefix's storage is created.
    fresh_sim.fail("cuMemAddressReserve", nth=1)
    out = gen(m, input_ids=p, **kw)
    assert "out of memory" in (last(m)["fallback"] or "").lower(), last(m)
    assert torch.equal(out.sequences, gen(ref, input_ids=p, **kw).sequences)
    c = hf.stats(m)["hf"]["reuse"]["counters"]
    assert c["load_failures"] == 2
    assert hf.stats(m)["hf"]["reuse"]["store"]["load_failures"] == 2
    del store


def test_concurrent_generate_calls_share_one_store(fresh_sim):
    ref, m = tiny_llama(), tiny_llama()
    wrap(m)
    kw = dict(max_new_tokens=6, do_sample=False)
    doc = ids(48, seed=40)
    prompts = [torch.cat([doc, ids(4, 50 + i)], 1) for i in range(8)]
    expected = [gen(ref, input_ids=p, **kw).sequences for p in prompts]
    gen(m, input_ids=prompts[0], **kw)
    results, errors = {}, []

    def run(i):
        try:
            for _ in range(2):
                results[i] = gen(m, input_ids=prompts[i], **kw).sequences
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(8):
        assert torch.equal(results[i], expected[i]), i
    c = hf.stats(m)["hf"]["reuse"]["counters"]
    assert c["calls"] == 17 and c["calls_with_hit"] >= 16
    hf.stats(m)["hf"]["reuse"]["store"]
    m._cxlalloc_hf.reuse.store.check()


def test_bad_options_are_clear_errors(fresh_sim):
    for bad in (0, -3, "x", 10 ** 6, 2.5, True):
        with pytest.raises(ValueError, match="block_tokens"):
            wrap(tiny_llama(), block_tokens=bad)
    with pytest.raises(ValueError, match="kv_store_limit"):
        wrap(tiny_llama(), kv_store_limit=1024)  # smaller than one block
    with pytest.raises(ValueError, match="'kv_store'"):
        wrap(tiny_llama(), kv_store="bogus://x")
    with pytest.raises(ValueError, match="without kv_store"):
        hf.wrap(tiny_llama(), device_limit=64 * MiB, block_tokens=16)
    with pytest.raises(ValueError, match="cache_salt"):
        wrap(tiny_llama(), cache_salt=5)


def test_a_model_that_cannot_reuse_says_so_once_and_still_works(fresh_sim):
    ref, m = tiny_qwen2_sliding(), tiny_qwen2_sliding()
    with pytest.warns(KVReuseWarning, match="DynamicSlidingWindowLayer"):
        wrap(m)
    kw = dict(max_new_tokens=6, do_sample=False)
    p = ids(30, seed=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVReuseWarning)  # said once, at wrap(), not per call
        for _ in range(2):
            assert torch.equal(gen(m, input_ids=p, **kw).sequences, gen(ref, input_ids=p, **kw).sequences)
    r = hf.stats(m)["hf"]["reuse"]
    assert r["enabled"] is False and "DynamicSlidingWindowLayer" in r["off_reason"]
    assert r["last"]["skipped"] and r["counters"]["skipped_calls"] == 2


def test_every_documented_stats_path_exists(fresh_sim):
    """Each ``stats(model)[...][...]`` written in a docstring or a doc resolves
    in a real wrapped model's stats after a generate() with reuse (a docstring
    once said ``["reuse"]["last"]``, a KeyError when followed)."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "cxlalloc").rglob("*.py")) + sorted((root / "docs").glob("*.md")) + [root / "README.md"]
    paths = {}
    for f in files:
        for m in re.finditer(r"stats\(model\)((?:\[\"\w+\"\])+)", f.read_text(encoding="utf-8")):
            paths.setdefault(m.group(1), f.relative_to(root).as_posix())
    assert '["hf"]["reuse"]["last"]' in paths, paths  # the scan finds what it is for
    m = tiny_llama()
    wrap(m)
    gen(m, input_ids=ids(20, seed=1), max_new_tokens=3)
    stats = hf.stats(m)
    for path, where in paths.items():
        node = stats
        for key in re.findall(r"\"(\w+)\"", path):
            assert isinstance(node, dict) and key in node, (
                f"{where}: stats(model){path} does not exist; top keys: {json.dumps(list(stats))}")
            node = node[key]
