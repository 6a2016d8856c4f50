"""cxlalloc.hf on tiny random models (simulation): generate() through a wrapped
model gives the same tokens and scores as plain transformers, and the cache
supports everything generate() and users do with a DynamicCache."""

import copy
import gc

import pytest

from tests.helpers.hf_util import (wrap, MiB, assert_same, assert_same_tokens, gen, kv_bytes_per_token, padded_batch,
                                   tiny_gpt2, tiny_llama, tiny_qwen2_sliding, torch)

import cxlalloc
import cxlalloc.hf as hf
from cxlalloc.hf import CxlCache, CxlKVLayer, cache_kwarg, returned_cache
from cxlalloc.hf.compat import POSITIVE_CROP_RAISES

MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2-sliding": tiny_qwen2_sliding}
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True),
    "sample-nrs3": dict(do_sample=True, num_return_sequences=3),
    "beam4-nrs2": dict(num_beams=4, num_return_sequences=2, do_sample=False),
    "beam3-sample": dict(num_beams=3, do_sample=True),
}
N_NEW = 12


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_wrapped_generate_is_identical(fresh_sim, name, attn):
    m = MODELS[name](attn=attn)
    inp = padded_batch()
    refs = {mode: gen(m, **inp, **kw, max_new_tokens=N_NEW, min_new_tokens=N_NEW) for mode, kw in MODES.items()}
    wrap(m)
    for mode, kw in MODES.items():
        out = gen(m, **inp, **kw, max_new_tokens=N_NEW, min_new_tokens=N_NEW)
        assert_same(refs[mode], out)
        c = returned_cache(out)
        assert isinstance(c, CxlCache), mode
        kinds = [type(layer).__name__ for layer in c.layers]
        if name == "qwen2-sliding":  # sliding layers: a bounded extent each (tests/hf/test_hf_sliding.py)
            assert kinds == ["CxlKVLayer", "CxlKVLayer", "CxlSlidingLayer", "CxlSlidingLayer"]
        else:
            assert kinds == ["CxlKVLayer"] * len(c.layers)
        st = c.kv_stats()
        expand = max(kw.get("num_beams", 1), kw.get("num_return_sequences", 1))
        assert st["live_tokens"] == inp["input_ids"].shape[1] + N_NEW - 1  # the last token is never forwarded
        assert st["bytes_per_token"] == kv_bytes_per_token(m, batch=2 * expand)
        assert st["kv_device_bytes"] > 0 and st["kv_host_bytes"] == 0
        assert st["regrowths"] == 0 and st["stores"] == 1
        if "beam" in mode:
            assert st["reorders"] > 0
    s = hf.stats(m)
    assert s["hf"]["hook"] == "prepare" and s["hf"]["caches_created"] == len(MODES)
    assert s["weight"]["device_bytes"] >= s["hf"]["weight_bytes"] > 0


def test_capacity_from_generate_hint_no_copy_stable_addresses(fresh_sim):
    m = tiny_llama()
    inp = padded_batch(length=9)
    wrap(m)
    ptrs = set()
    orig = CxlKVLayer.update

    def spy(self, *a, **k):
        r = orig(self, *a, **k)
        ptrs.add((r[0].data_ptr(), r[1].data_ptr()))
        return r

    CxlKVLayer.update = spy
    try:
        out = gen(m, **inp, max_new_tokens=20, min_new_tokens=20)
    finally:
        CxlKVLayer.update = orig
    c = returned_cache(out)
    st = c.kv_stats()
    assert len(ptrs) == 2, "each layer's K/V views keep one address for the whole generation"
    assert st["capacity_tokens"] >= 9 + 20 - 1
    assert st["regrowths"] == 0 and st["bytes_copied_existing"] == 0


def test_decode_step_copies_only_the_new_token(fresh_sim):
    m = tiny_llama()
    inp = padded_batch(length=9)
    wrap(m)
    out = gen(m, **inp, max_new_tokens=30, min_new_tokens=30)
    st = returned_cache(out).kv_stats()
    per_token = kv_bytes_per_token(m, batch=2)
    assert st["step_bytes_copied"][0] == 9 * per_token  # prefill writes the prompt once
    assert st["step_bytes_copied"][1:] == [per_token] * 29  # flat: independent of the context length
    assert st["step_context_tokens"] == list(range(9, 9 + 30))
    assert st["bytes_copied"] == st["bytes_copied_new"] == (9 + 29) * per_token


def test_continuation_from_returned_cache_equals_one_long_generation(fresh_sim):
    m = tiny_llama()
    inp = padded_batch()
    long_ref = gen(m, **inp, max_new_tokens=16, min_new_tokens=16)
    wrap(m)
    first = gen(m, **inp, max_new_tokens=6, min_new_tokens=6)
    c = returned_cache(first)
    am = torch.cat([inp["attention_mask"], torch.ones(2, 6, dtype=torch.long)], 1)
    second = gen(m, input_ids=first.sequences, attention_mask=am, max_new_tokens=10, min_new_tokens=10,
                 **{cache_kwarg(m): c})
    assert returned_cache(second) is c
    assert torch.equal(second.sequences, long_ref.sequences)
    for a, b in zip(long_ref.scores[6:], second.scores):
        assert torch.equal(a, b)
    # The continuation reserved its capacity up front: no regrowth, no copy of cached tokens.
    assert c.kv_stats()["regrowths"] == 0 and c.kv_stats()["bytes_copied_existing"] == 0


def test_continuation_with_new_user_tokens(fresh_sim):
    m = tiny_gpt2()
    inp = padded_batch()
    wrap(m)
    c = returned_cache(gen(m, **inp, max_new_tokens=5, min_new_tokens=5))
    seq = gen(m, **inp, max_new_tokens=5, min_new_tokens=5).sequences
    new = torch.randint(3, 1000, (2, 3), generator=torch.Generator().manual_seed(7))
    ids2 = torch.cat([seq, new], 1)
    am2 = torch.cat([inp["attention_mask"], torch.ones(2, ids2.shape[1] - 9, dtype=torch.long)], 1)
    o2 = gen(m, input_ids=ids2, attention_mask=am2, max_new_tokens=5, min_new_tokens=5, **{cache_kwarg(m): c})
    hf.unwrap(m)
    ref = gen(m, input_ids=ids2, attention_mask=am2, max_new_tokens=5, min_new_tokens=5)
    # Same tokens; scores only to rounding: the fresh run prefills 17 tokens in one
    # matmul where the continuation processes 4 (different reduction shapes).
    assert_same_tokens(ref, o2)


def test_crop_both_signs_and_regenerate(fresh_sim):
    m = tiny_llama()
    inp = padded_batch()
    wrap(m)
    out = gen(m, **inp, max_new_tokens=8, min_new_tokens=8)
    c = returned_cache(out)
    assert c.get_seq_length() == 9 + 8 - 1
    c.crop(-3)
    assert c.get_seq_length() == 13
    if POSITIVE_CROP_RAISES:  # 5.24: a positive crop is refused, as by DynamicCache, and changes nothing
        with pytest.raises(ValueError, match="positive value"):
            c.crop(11)
        assert c.get_seq_length() == 13
        c.crop(-2)
    else:  # 5.17: keep the first 11; keeping more than there is changes nothing
        c.crop(11)
        c.crop(50)
    assert c.get_seq_length() == 11
    # Regenerating from the cropped cache equals a fresh run on the same ids.
    ids = out.sequences[:, :12]
    am = torch.cat([inp["attention_mask"], torch.ones(2, 3, dtype=torch.long)], 1)
    o = gen(m, input_ids=ids, attention_mask=am, max_new_tokens=6, min_new_tokens=6, **{cache_kwarg(m): c})
    hf.unwrap(m)
    assert_same_tokens(gen(m, input_ids=ids, attention_mask=am, max_new_tokens=6, min_new_tokens=6), o)


def test_crop_releases_whole_chunks(fresh_sim):
    m = tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4)  # 16 KiB per token at batch 2: 128 tokens a chunk
    inp = padded_batch(length=300)
    wrap(m)
    c = returned_cache(gen(m, **inp, max_new_tokens=2, min_new_tokens=2))
    assert c.kv_stats()["kv_device_bytes"] == 6 * MiB  # 301 tokens x 16 KiB -> 3 chunks of 2 MiB
    c.crop(-(301 - 100))
    assert c.get_seq_length() == 100
    assert c.kv_stats()["kv_device_bytes"] == 2 * MiB


def test_reset_then_reuse_and_batch_change(fresh_sim):
    m = tiny_qwen2_sliding()
    inp = padded_batch()
    wrap(m)
    c = CxlCache(config=m.config, allocator=hf.allocator(m))
    kw = {cache_kwarg(m): c}
    o1 = gen(m, **inp, max_new_tokens=5, min_new_tokens=5, **kw)
    c.reset()
    assert c.get_seq_length() == 0 and c.kv_stats()["kv_device_bytes"] == 0
    o2 = gen(m, **inp, max_new_tokens=5, min_new_tokens=5, **kw)
    assert torch.equal(o1.sequences, o2.sequences)
    c.reset()
    inp3 = padded_batch(batch=3, seed=5)
    o3 = gen(m, **inp3, max_new_tokens=5, min_new_tokens=5, **kw)
    assert o3.sequences.shape[0] == 3 and c.kv_stats()["bytes_per_token"] == kv_bytes_per_token(m, batch=3)
    hf.unwrap(m)
    assert torch.equal(gen(m, **inp3, max_new_tokens=5, min_new_tokens=5).sequences, o3.sequences)


def test_deepcopy_prompt_cache(fresh_sim):
    """The docs' prompt-cache pattern: fill a cache with a forward, deepcopy it per
    request, generate from the copy.  Oracle: the same steps with DynamicCache."""
    from transformers import DynamicCache

    m = tiny_llama()
    inp = padded_batch()
    new = torch.randint(3, 1000, (2, 3), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([inp["input_ids"], new], 1)
    am = torch.cat([inp["attention_mask"], torch.ones(2, 3, dtype=torch.long)], 1)
    wrap(m)
    a = hf.allocator(m)

    def run(pc):
        with torch.no_grad():
            m(**inp, use_cache=True, **{cache_kwarg(m): pc})
        c2 = copy.deepcopy(pc)
        o = gen(m, input_ids=ids, attention_mask=am, max_new_tokens=5, min_new_tokens=5, **{cache_kwarg(m): c2})
        return pc, c2, o

    _, _, ref = run(DynamicCache(config=m.config))
    kv0 = a.stats()["kv"]["device_bytes"]
    pc, c2, out = run(CxlCache(config=m.config, allocator=a))
    assert_same(ref, out)
    assert pc.get_seq_length() == 9, "the source cache is untouched"
    assert c2.get_seq_length() == 9 + 3 + 5 - 1
    assert isinstance(c2.layers[0], CxlKVLayer) and c2.kv_stats()["bytes_copied_existing"] == 9 * kv_bytes_per_token(m, 2)
    # both caches' storage comes from the allocator
    assert a.stats()["kv"]["device_bytes"] == kv0 + pc.kv_stats()["kv_device_bytes"] + c2.kv_stats()["kv_device_bytes"]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "pickle", "deepcopy-parent"])
def test_wrapped_model_copies_come_back_unwrapped(fresh_sim, how, tmp_path):
    """deepcopy/pickle/torch.save of a wrapped model give a plain model (weights in
    torch's memory, transformers' own cache) with one warning; the original stays
    wrapped, and state_dict()/save_pretrained keep working."""
    import io
    import pickle

    from transformers import DynamicCache, LlamaForCausalLM

    m = tiny_llama()
    inp = padded_batch()
    ref = gen(m, **inp, max_new_tokens=5)
    hf.wrap(m, simulate=True, device_limit="4MiB", host_limit="64MiB")
    a = hf.allocator(m)
    before = a.stats()["weight"]
    cxl_ptrs = {p.data_ptr() for p in m.parameters()}

    def roundtrip(obj):
        if how.startswith("deepcopy"):
            return copy.deepcopy(obj)
        if how == "pickle":
            return pickle.loads(pickle.dumps(obj))
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    with pytest.warns(hf.UnwrappedCopyWarning, match=r"unwrapped copy .*cxlalloc\.hf\.wrap\(\) on the copy") as rec:
        if how == "deepcopy-parent":  # the wrapped model inside a user's module
            c = roundtrip(torch.nn.ModuleDict({"lm": m}))["lm"]
        else:
            c = roundtrip(m)
    assert len([w for w in rec if w.category is hf.UnwrappedCopyWarning]) == 1
    assert rec[0].filename == __file__, "the warning points at the caller's line"
    assert type(c) is LlamaForCausalLM and c is not m
    assert not hf.is_wrapped(c) and "generate" not in c.__dict__ and "__getstate__" not in c.__dict__
    assert not {p.data_ptr() for p in c.parameters()} & cxl_ptrs, "the copy's weights are torch's, not cxlalloc's"
    assert a.stats()["weight"] == before
    out = gen(c, **inp, max_new_tokens=5)
    assert_same(ref, out)
    assert type(returned_cache(out)) is DynamicCache
    # the original is still wrapped and unchanged
    assert hf.is_wrapped(m) and hf.allocator(m) is a
    out = gen(m, **inp, max_new_tokens=5)
    assert_same(ref, out)
    assert isinstance(returned_cache(out), CxlCache)
    del out
    # state_dict() and save_pretrained() of the wrapped model still work, no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnwrappedCopyWarning)
        sd = m.state_dict()
        m.save_pretrained(tmp_path / "saved")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # the copy wraps like any model
    hf.wrap(c, device_limit="4MiB", host_limit="64MiB")
    assert hf.allocator(c) is not a
    assert_same(ref, gen(c, **inp, max_new_tokens=5))
    hf.unwrap(c)
    hf.unwrap(m)
    del a, sd, c
    gc.collect()


def test_cxl_cache_pickle_is_a_clear_error_copy_works(fresh_sim):
    import io
    import pickle

    m = tiny_llama()
    wrap(m)
    c = returned_cache(gen(m, **padded_batch(), max_new_tokens=3))
    assert isinstance(c, CxlCache)
    for dump in (pickle.dumps, lambda obj: torch.save(obj, io.BytesIO())):
        with pytest.raises(TypeError, match=r"a CxlCache cannot be pickled .*copy\.deepcopy\(cache\)"):
            dump(c)
        with pytest.raises(TypeError, match="a CxlKVLayer cannot be pickled"):
            dump(c.layers[0])
    # what the message suggests works
    kv = pickle.loads(pickle.dumps([(layer.keys.clone(), layer.values.clone()) for layer in c.layers]))
    assert torch.equal(kv[0][0], c.layers[0].keys)
    # copy.copy is still the shallow copy it was (shares the layers), deepcopy a real copy
    s = copy.copy(c)
    assert type(s) is CxlCache and s.layers is c.layers and s.get_seq_length() == c.get_seq_length()
    d = copy.deepcopy(c)
    assert d.layers[0]._store is not c.layers[0]._store and torch.equal(d.layers[0].keys, c.layers[0].keys)
    hf.unwrap(m)
    del c, s, d
    gc.collect()


@pytest.mark.parametrize("op", ["repeat", "select"])
def test_batch_ops_match_dynamic_cache(fresh_sim, op):
    from transformers import DynamicCache

    m = tiny_llama()
    inp = padded_batch()
    wrap(m)

    def run(cache):
        o = gen(m, **inp, max_new_tokens=4, min_new_tokens=4, **{cache_kwarg(m): cache})
        am = torch.cat([inp["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1)
        if op == "repeat":
            cache.batch_repeat_interleave(3)
            return gen(m, input_ids=o.sequences, attention_mask=am, max_new_tokens=4, min_new_tokens=4,
                       do_sample=True, num_return_sequences=3, seed=11, **{cache_kwarg(m): cache})
        idx = torch.tensor([1])
        cache.batch_select_indices(idx)
        return gen(m, input_ids=o.sequences[idx], attention_mask=am[idx], max_new_tokens=4, min_new_tokens=4,
                   **{cache_kwarg(m): cache})

    out = run(CxlCache(config=m.config, allocator=hf.allocator(m)))
    ref = run(DynamicCache(config=m.config))
    assert_same(ref, out)


def test_regrowth_without_hint_is_amortised_and_counted(fresh_sim):
    m = tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4)  # 16 KiB per token at batch 2
    inp = padded_batch(length=200)
    ref = gen(m, **inp, max_new_tokens=60, min_new_tokens=60)
    wrap(m, hook="generate")  # the fallback path: no capacity hint
    out = gen(m, **inp, max_new_tokens=60, min_new_tokens=60)
    assert_same(ref, out)
    st = returned_cache(out).kv_stats()
    per_token = kv_bytes_per_token(m, 2)
    # The prefill reserves 256 tokens (200 rounded up); token 257 regrows to 512,
    # copying the 256 cached rows once; every other step copies only its token.
    assert st["regrowths"] == 1 and st["capacity_tokens"] == 512
    assert st["bytes_copied_existing"] == 256 * per_token
    steps = st["step_bytes_copied"]
    assert sorted(set(steps[1:])) == [per_token, per_token + 256 * per_token]
    assert hf.stats(m)["hf"]["hook"] == "generate"


def test_cache_without_config_gives_each_layer_its_own_storage(fresh_sim):
    m = tiny_gpt2()
    inp = padded_batch()
    ref = gen(m, **inp, max_new_tokens=6, min_new_tokens=6)
    wrap(m)
    c = CxlCache(allocator=hf.allocator(m))
    out = gen(m, **inp, max_new_tokens=6, min_new_tokens=6, **{cache_kwarg(m): c})
    assert_same(ref, out)
    assert c.kv_stats()["stores"] == 2 and all(isinstance(layer, CxlKVLayer) for layer in c.layers)


def test_assisted_decoding_prompt_lookup_uses_crop(fresh_sim):
    m = tiny_llama()
    ids = torch.randint(3, 50, (1, 20), generator=torch.Generator().manual_seed(2))
    ref = gen(m, input_ids=ids, max_new_tokens=10, min_new_tokens=10)
    wrap(m)
    out = gen(m, input_ids=ids, max_new_tokens=10, min_new_tokens=10, prompt_lookup_num_tokens=3)
    assert torch.equal(ref.sequences, out.sequences)
    assert isinstance(returned_cache(out), CxlCache)


def test_cache_freed_when_dropped(fresh_sim):
    m = tiny_llama()
    wrap(m)
    a = hf.allocator(m)
    out = gen(m, **padded_batch(), max_new_tokens=4)
    assert a.stats()["kv"]["device_bytes"] > 0
    del out
    gc.collect()
    assert a.stats()["kv"]["device_bytes"] == 0
    # stats() keeps the counters of the last generate() call
    assert hf.stats(m)["hf"]["cache"]["steps"] == 4


def test_unwrap_restores_plain_transformers(fresh_sim):
    from transformers import DynamicCache

    m = tiny_llama()
    p0 = next(m.parameters()).detach().clone()
    wrap(m)
    assert hf.stats(m)["weight"]["device_bytes"] > 0
    hf.unwrap(m)
    assert not hf.is_wrapped(m)
    assert torch.equal(next(m.parameters()), p0)
    assert type(returned_cache(gen(m, **padded_batch(), max_new_tokens=2))) is DynamicCache
    with pytest.raises(ValueError, match="not wrapped"):
        hf.stats(m)


def test_generate_function_wraps_on_first_use(fresh_sim):
    m = tiny_llama()
    inp = padded_batch()
    ref = gen(m, **inp, max_new_tokens=5)
    torch.manual_seed(0)
    out = hf.generate(m, **inp, max_new_tokens=5, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    assert hf.is_wrapped(m) and hf.stats(m)["hf"]["simulated"]
    assert_same(ref, out)
    hf.unwrap(m)


def test_user_cache_implementation_is_left_alone(fresh_sim):
    m = tiny_llama()
    wrap(m)
    out = gen(m, **padded_batch(), max_new_tokens=3, cache_implementation="static")
    assert not isinstance(returned_cache(out), CxlCache)
    out = gen(m, **padded_batch(), max_new_tokens=3, use_cache=False)
    assert hf.stats(m)["hf"]["caches_created"] == 0


def test_wrap_errors(fresh_sim):
    m = tiny_llama()
    with pytest.raises(ValueError, match="simulate=False"):
        hf.wrap(m, simulate=False)
    with pytest.raises(ValueError, match="device_limit"):
        hf.wrap(m, device_limit="lots")
    with pytest.raises(ValueError, match="unknown option"):
        hf.wrap(m, devcie_limit="1GiB")
    with pytest.raises(ValueError, match="hook"):
        hf.wrap(m, hook="sideways")
    with pytest.raises(TypeError, match=r"model must be a transformers model with generate\(\).*not object"):
        hf.wrap(object())
    with pytest.raises(TypeError, match="not Linear"):
        hf.wrap(torch.nn.Linear(2, 2))
    assert not hf.is_wrapped(m)
    wrap(m)
    assert hf.wrap(m) is m  # idempotent without options
    with pytest.raises(ValueError, match="already wrapped"):
        hf.wrap(m, device_limit=32 * MiB)
    with pytest.raises(ValueError, match="allocator"):
        CxlCache(config=m.config)  # no allocator and no process-wide engine


def test_rewrap_compares_option_values_not_spellings(fresh_sim):
    m = tiny_llama()
    hf.wrap(m, device_limit="4MiB", host_limit="64MiB")
    a = hf.allocator(m)
    # the same values in other spellings (and the CPU model's default simulate=True) are the same wrap
    assert hf.wrap(m, device_limit=4 << 20, host_limit="64MiB") is m
    assert hf.wrap(m, device_limit="4194304", host_limit=64 * MiB, simulate=True) is m
    assert hf.wrap(m, device_limit="4 MiB", host_limit="65536KiB", numa_node="auto") is m
    assert hf.allocator(m) is a, "no new allocator"
    # other values still raise, naming what differs
    differ = r"already wrapped .*device_limit: 4\.00 MiB \(wrapped\) vs 8\.00 MiB \(asked\)"
    with pytest.raises(ValueError, match=differ):
        hf.wrap(m, device_limit=8 << 20, host_limit="64MiB")
    # a left-out option is its default, not "anything"
    with pytest.raises(ValueError, match=r"host_limit: 64\.00 MiB \(wrapped\) vs default \(asked\)"):
        hf.wrap(m, device_limit="4MiB")
    # 1.0 is 100% of VRAM, not 1 byte
    with pytest.raises(ValueError, match=r"device_limit: 4\.00 MiB \(wrapped\) vs 100% \(asked\)"):
        hf.wrap(m, device_limit=1.0, host_limit="64MiB")
    # options that are not sizes are shown as they are
    with pytest.raises(ValueError, match=r"promote_after: 2 \(wrapped\) vs 3 \(asked\)"):
        hf.wrap(m, device_limit="4MiB", host_limit="64MiB", promote_after=3)
    with pytest.raises(ValueError, match="'device_limit': 'lots' is not a size"):
        hf.wrap(m, device_limit="lots", host_limit="64MiB")
    hf.unwrap(m)
    del a
    gc.collect()


def test_layer_shape_mismatch_is_a_clear_error(fresh_sim):
    m = tiny_llama()
    wrap(m)
    c = returned_cache(gen(m, **padded_batch(), max_new_tokens=3))
    with pytest.raises(ValueError, match="batch_repeat_interleave"):
        gen(m, **padded_batch(batch=4), max_new_tokens=3, **{cache_kwarg(m): c})


def test_cache_kwarg_is_the_one_forward_uses(fresh_sim):
    # On 5.17 forward(cache=...) is silently ignored: the name must be right.
    m = tiny_llama()
    wrap(m)
    c = CxlCache(config=m.config, allocator=hf.allocator(m))
    with torch.no_grad():
        m(**padded_batch(), use_cache=True, **{cache_kwarg(m): c})
    assert c.get_seq_length() == 9


def test_allocator_from_engine_shares_the_engine(make_alloc):
    a = make_alloc()
    b = cxlalloc.Allocator.from_engine(a._engine, 0)
    p = b.malloc(1 << 20, tag="kv")
    assert a.stats()["kv"]["device_bytes"] == 1 << 20 and b.simulated
    b.free(p)
    with pytest.raises(ValueError, match="no configuration"):
        cxlalloc.Allocator.from_engine(a._engine, 3)


def test_wrap_uses_the_process_wide_engine(make_alloc):
    """With a process-wide engine (cxlalloc.enable() / CXLALLOC), wrap() allocates
    the KV cache from it and leaves the weights where they are."""
    from cxlalloc import _C

    a = make_alloc(device_limit=64 * MiB)
    m = tiny_llama()
    inp = padded_batch()
    ref = gen(m, **inp, max_new_tokens=5)
    _C.set_current_engine(a._engine)
    try:
        with pytest.raises(ValueError, match="process-wide"):
            hf.wrap(m, device_limit=32 * MiB)
        hf.wrap(m)
        out = gen(m, **inp, max_new_tokens=5)
        assert_same(ref, out)
        s = hf.stats(m)
        assert s["hf"]["mode"] == "global" and not s["hf"]["weights_placed"]
        assert a.stats()["kv"]["device_bytes"] == returned_cache(out).kv_stats()["kv_device_bytes"] > 0
        assert a.stats()["weight"]["device_bytes"] == 0
        c = CxlCache(config=m.config)  # no allocator: the process-wide engine's
        assert c.allocator._engine is a._engine
        hf.unwrap(m)
        del out, c
    finally:
        _C.set_current_engine(None)


def test_capacity_hint_beyond_memory_is_clamped(fresh_sim):
    """A generation config may ask for max_length far beyond memory: the reservation
    is clamped to what both tiers could hold instead of failing."""
    m = tiny_llama()
    inp = padded_batch()
    ref = gen(m, **inp, max_new_tokens=4)
    wrap(m)  # 64 MiB + 256 MiB
    a = hf.allocator(m)
    c = CxlCache(config=m.config, allocator=a, max_cache_len=10 ** 9)
    out = gen(m, **inp, max_new_tokens=4, **{cache_kwarg(m): c})
    assert_same(ref, out)
    st = c.kv_stats()
    assert st["capacity_tokens"] * st["bytes_per_token"] <= 320 * MiB
    assert st["kv_device_bytes"] == 2 * MiB  # only the live tokens' chunk is committed
