"""Sliding-window layers in a bounded cxlalloc extent (cxlalloc/hf/layers/sliding.py).

Oracle: transformers' own DynamicSlidingWindowLayer fed the same K/V (every
returned tensor, the cached window, get_seq_length and get_mask_sizes equal),
and unwrapped generate() (tokens and scores identical) on tiny sliding-window
models (Mistral, Gemma 2, Gemma 3, Cohere 2 configs with a small window)."""

import copy

import pytest
from tests.helpers.hf_kinds import (MODES, check_modes, tiny_cohere2, tiny_gemma2, tiny_gemma3, tiny_mistral)
from tests.helpers.hf_util import MiB, assert_same, gen, padded_batch, torch
from transformers.cache_utils import DynamicSlidingWindowLayer

import cxlalloc.hf as hf
from cxlalloc.hf import CxlCache, CxlSlidingLayer, returned_cache
from cxlalloc.hf.layers.sliding import window_capacity
from cxlalloc.hf.pool import KVPool

CHUNK = 2 * MiB
# B=2, H=4, D=1024 fp32: 64 KiB of K+V per token, 32 tokens per 2 MiB chunk, so
# the bounded extent is a few chunks and compaction happens within a short test.
B, H, D = 2, 4, 1024


def pool_of(alloc):
    return KVPool(alloc, 0, None, 2.0, 256)


def kv(q, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, q, D, generator=g), torch.randn(B, H, q, D, generator=g)


def assert_like(ref, mine, q=1):
    assert ref.get_seq_length() == mine.get_seq_length()
    assert ref.get_mask_sizes(q) == mine.get_mask_sizes(q)
    assert torch.equal(ref.keys, mine.keys) and torch.equal(ref.values, mine.values)


@pytest.mark.parametrize("window", [2, 5, 40])
def test_matches_the_stock_layer_step_by_step(make_alloc, window):
    """Random K/V: a prefill, decode steps past several compactions, a chunk of
    3, and a forward longer than the bounded extent (the stock cat path)."""
    a = make_alloc()
    pool = pool_of(a)
    ref, mine = DynamicSlidingWindowLayer(window), CxlSlidingLayer(pool, window)
    steps = [7, 1, 1, 3] + [1] * 70 + [150, 1, 1]
    for i, q in enumerate(steps):
        k, v = kv(q, i)
        rk, rv = ref.update(k, v)
        mk, mv = mine.update(k, v)
        assert torch.equal(rk, mk) and torch.equal(rv, mv), f"step {i}"
        assert_like(ref, mine)
    w = mine._win
    cap = w.store.capacity_tokens
    assert cap == w.store.extent.capacity // w.store.row_bytes
    assert cap >= window_capacity(window) >= window - 1 + 16
    assert w.store.extent.capacity == -(-window_capacity(window) * w.store.row_bytes // CHUNK) * CHUNK
    # Bounded: the extent never grew, and the stock layer's per-step cat of the
    # window is replaced by one compaction every (capacity - window + 1) tokens.
    assert pool.counters.regrowths == 0
    moved = pool.counters.bytes_copied_existing // w.store.row_bytes
    assert moved <= (sum(steps) // max(1, cap - (window - 1)) + 1) * (window - 1)
    if cap < sum(steps[:74]):
        assert moved > 0, "compaction was exercised"
    tiers = w.store.tier_bytes()
    assert tiers["device"] + tiers["host"] <= w.store.extent.capacity


def test_batch_ops_reorder_crop_and_copy_match_the_stock_layer(make_alloc):
    a = make_alloc()
    pool = pool_of(a)
    ref, mine = DynamicSlidingWindowLayer(6), CxlSlidingLayer(pool, 6)
    for i, q in enumerate([4, 1, 1, 1, 1, 1]):
        ref.update(*kv(q, i))
        mine.update(*kv(q, i))
    idx = torch.tensor([1, 0])
    ref.reorder_cache(idx)
    mine.reorder_cache(idx)
    assert_like(ref, mine)
    ref.batch_repeat_interleave(2)
    mine.batch_repeat_interleave(2)
    assert_like(ref, mine)
    sel = torch.tensor([0, 3, 2])
    ref.batch_select_indices(sel)
    mine.batch_select_indices(sel)
    assert_like(ref, mine)
    twin = copy.deepcopy(mine)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(3, H, 1, D, generator=g), torch.randn(3, H, 1, D, generator=g)
    assert all(torch.equal(x, y) for x, y in zip(ref.update(k, v), mine.update(k, v)))
    assert_like(ref, mine)
    assert twin._win.store is not mine._win.store and twin.get_seq_length() == mine.get_seq_length() - 1
    # crop: the stock rules and errors (past the window without past recording)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        mine.crop(-1)
    mine.reset()
    assert mine.get_seq_length() == 0 and mine.keys is None and mine._win.store.tier_bytes()["device"] == 0


def test_past_recording_and_crop_like_the_stock_layer(make_alloc):
    """Assisted decoding's rollback: record the past, crop(-n), crop(0)."""
    a = make_alloc()
    pool = pool_of(a)
    ref, mine = DynamicSlidingWindowLayer(5), CxlSlidingLayer(pool, 5)
    ref.activate_past_recording()
    mine.activate_past_recording()
    for i, q in enumerate([6, 3, 3]):
        rk, rv = ref.update(*kv(q, i))
        mk, mv = mine.update(*kv(q, i))
        assert torch.equal(rk, mk) and torch.equal(rv, mv)
        assert_like(ref, mine)
    for n in (-2, 0, -1):
        ref.crop(n)
        mine.crop(n)
        assert_like(ref, mine)
    with pytest.raises(RuntimeError, match="negative int"):
        mine.crop(3)


def test_bad_window_and_mismatched_states_say_what_to_do(make_alloc):
    pool = pool_of(make_alloc())
    with pytest.raises(ValueError, match="sliding_window must be >= 2"):
        CxlSlidingLayer(pool, 1)
    layer = CxlSlidingLayer(pool, 4)
    layer.update(*kv(2, 0))
    with pytest.raises(ValueError, match="batch_repeat_interleave"):
        layer.update(torch.zeros(3, H, 1, D), torch.zeros(3, H, 1, D))
    with pytest.raises(AttributeError, match="views of cxlalloc storage"):
        layer.keys = torch.zeros(1)


SLIDING_MODELS = {"mistral": (tiny_mistral, 2, 0), "gemma2": (tiny_gemma2, 2, 2), "gemma3": (tiny_gemma3, 5, 1),
                  "cohere2": (tiny_cohere2, 3, 1)}


@pytest.mark.parametrize("name", list(SLIDING_MODELS))
def test_generate_identical_with_windows_in_extents(fresh_sim, name):
    """Prompt 9 > window, 10 new tokens: every mode identical; each sliding layer
    is a CxlSlidingLayer whose window lives in a cxlalloc extent (device tier)."""
    make, n_sliding, n_full = SLIDING_MODELS[name]
    m = make()
    inp = padded_batch(length=9)
    modes = {k: MODES[k] for k in ("greedy", "beam", "sample")} if name != "mistral" else MODES
    refs = check_modes(m, inp, modes=modes)
    hf.wrap(m)
    for mode, kw in modes.items():
        out = gen(m, **inp, **kw, max_new_tokens=10, min_new_tokens=10)
        assert_same(refs[mode], out)
        c = returned_cache(out)
        kinds = [type(layer).__name__ for layer in c.layers]
        assert kinds.count("CxlSlidingLayer") == n_sliding and kinds.count("CxlKVLayer") == n_full, kinds
        st = c.kv_stats()
        assert st["other_stores"] == n_sliding and st["kv_host_bytes"] == 0
        assert st["kv_device_bytes"] == (n_sliding + (1 if n_full else 0)) * CHUNK
        for layer in c.layers:
            if isinstance(layer, CxlSlidingLayer):
                assert layer.keys.shape[-2] == layer.sliding_window - 1
                assert a_tier(layer) == "device"
    r = hf.stats(m)["hf"]["layers"]
    assert r["tiered"].get("DynamicSlidingWindowLayer") == n_sliding and not r["untiered"]


def a_tier(layer):
    tiers = {t for _, _, t in layer._win.store.extent.tiers() if t != "none"}
    assert len(tiers) == 1
    return tiers.pop()


def test_windows_spill_to_the_host_and_tokens_stay_identical(fresh_sim):
    """kv_device_limit of one chunk: of the two windows (one chunk each) one
    lives on the host tier; greedy and beam identical."""
    m = tiny_mistral()
    inp = padded_batch(length=9)
    refs = check_modes(m, inp, modes={k: MODES[k] for k in ("greedy", "beam")})
    hf.wrap(m, device_limit=256 * MiB, host_limit=256 * MiB, kv_device_limit=CHUNK)
    for mode in ("greedy", "beam"):
        out = gen(m, **inp, **MODES[mode], max_new_tokens=10, min_new_tokens=10)
        assert_same(refs[mode], out)
        st = returned_cache(out).kv_stats()
        assert st["kv_device_bytes"] == CHUNK and st["kv_host_bytes"] == CHUNK, st
        assert sorted(a_tier(layer) for layer in returned_cache(out).layers) == ["device", "host"]


def test_a_window_is_bounded_over_a_long_generation(fresh_sim):
    """60 decode steps with window 4: committed bytes and capacity do not change
    after the prefill; no regrowth."""
    m = tiny_mistral()
    hf.wrap(m)
    ids = padded_batch(batch=1, length=9)["input_ids"]
    short = returned_cache(gen(m, input_ids=ids, max_new_tokens=2, min_new_tokens=2)).kv_stats()
    out = gen(m, input_ids=ids, max_new_tokens=60, min_new_tokens=60)
    assert torch.equal(out.sequences, gen_unwrapped(ids, 60))
    long = returned_cache(out).kv_stats()
    assert long["kv_device_bytes"] == short["kv_device_bytes"] == 2 * CHUNK
    assert long["kv_reserved_bytes"] == short["kv_reserved_bytes"] and long["regrowths"] == 0


def gen_unwrapped(ids, new):
    return gen(tiny_mistral(), input_ids=ids, max_new_tokens=new, min_new_tokens=new).sequences


def test_cxlcache_deepcopy_and_reset_carry_the_windows(fresh_sim):
    """The prompt-cache pattern with sliding layers: prefill once, deepcopy per
    request, generate from the copy: identical to the same with DynamicCache."""
    from transformers import DynamicCache

    m = tiny_gemma2()
    hf.wrap(m)
    kw_name = hf.cache_kwarg(m)
    ids = padded_batch(batch=1, length=9)["input_ids"]
    prompt = CxlCache(config=m.config, allocator=hf.allocator(m))
    stock = DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=ids, use_cache=True, **{kw_name: prompt})
        m(input_ids=ids, use_cache=True, **{kw_name: stock})
    full = torch.cat([ids, torch.tensor([[5]])], dim=1)
    a = gen(m, input_ids=full, max_new_tokens=6, min_new_tokens=6, **{kw_name: copy.deepcopy(prompt)})
    with pytest.warns(hf.CacheCoverageWarning, match="used a DynamicCache.*DynamicSlidingWindowLayer x 2"):
        b = gen(m, input_ids=full, max_new_tokens=6, min_new_tokens=6, **{kw_name: copy.deepcopy(stock)})
    assert torch.equal(a.sequences, b.sequences)
    assert prompt.get_seq_length() == 9  # the original is untouched
    prompt.reset()
    assert prompt.kv_stats()["kv_device_bytes"] == 0


def test_assisted_decoding_with_sliding_window_models_on_both_sides(fresh_sim):
    """The assistant's cache records its past and is cropped back each round
    (transformers activates past recording on the cache it makes; the wrapper's
    CxlCache gets the same); the main model's cache is cropped too.  Tokens
    identical to the same assisted call unwrapped."""
    ids = padded_batch(batch=1, length=9)["input_ids"]
    main, helper = tiny_mistral(window=6), tiny_mistral(window=6, seed=1)
    ref = gen(main, input_ids=ids, max_new_tokens=12, min_new_tokens=12, assistant_model=helper)
    hf.wrap(main)
    hf.wrap(helper)
    out = gen(main, input_ids=ids, max_new_tokens=12, min_new_tokens=12, assistant_model=helper)
    assert torch.equal(ref.sequences, out.sequences)
    assert isinstance(returned_cache(out), CxlCache)
    assert all(type(layer) is CxlSlidingLayer for layer in returned_cache(out).layers)
    assert hf.stats(helper)["hf"]["caches_created"] >= 1


def test_one_step_per_forward_with_a_sliding_layer_first(fresh_sim):
    """Gemma 2 begins with a sliding layer (not planned before the forward):
    the planned step is not begun twice (one mark_step and one counter entry
    per forward pass)."""
    m = tiny_gemma2()
    hf.wrap(m)
    out = gen(m, **padded_batch(length=9), max_new_tokens=6, min_new_tokens=6)
    st = returned_cache(out).kv_stats()
    assert st["steps"] == 6 and len(st["step_bytes_copied"]) == 6  # prefill + 5 decode forwards
    assert st["step_context_tokens"] == [9, 10, 11, 12, 13, 14]


def test_forward_with_grad_through_windows_like_dynamic_cache(fresh_sim):
    """Every layer sliding (window 4 < 8 tokens): a forward with grad gives the
    loss and gradients DynamicCache gives; a prompt cached without grad then a
    forward with grad too; a second forward with grad through the same cache
    is refused (CxlCache stores K/V detached), nothing written."""
    from cxlalloc.hf.pool import GRAD_ACROSS_FORWARDS
    from transformers import DynamicCache

    def loss_and_grads(model, cache, ids, pos):
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            out = model(input_ids=ids, position_ids=pos, use_cache=True, **{hf.cache_kwarg(model): cache})
            loss = out.logits.float().pow(2).mean()
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    m = tiny_mistral()
    hf.wrap(m)
    g = torch.Generator().manual_seed(4)
    ids, pos = torch.randint(3, 1000, (2, 8), generator=g), torch.arange(8).expand(2, -1)
    c = CxlCache(config=m.config, allocator=hf.allocator(m))
    ref, out = loss_and_grads(m, DynamicCache(config=m.config), ids, pos), loss_and_grads(m, c, ids, pos)
    assert torch.equal(ref[0], out[0]) and ref[1].keys() == out[1].keys() and len(ref[1]) > 0
    for n in ref[1]:
        assert torch.allclose(ref[1][n], out[1][n], atol=1e-6), n
    assert not c.layers[0].keys.requires_grad
    caches = [DynamicCache(config=m.config), CxlCache(config=m.config, allocator=hf.allocator(m))]
    for cache in caches:
        with torch.no_grad():
            m(input_ids=ids, position_ids=pos, use_cache=True, **{hf.cache_kwarg(m): cache})
    ids2, pos2 = torch.tensor([[5, 6], [7, 8]]), torch.tensor([[8, 9], [8, 9]])
    r2, o2 = loss_and_grads(m, caches[0], ids2, pos2), loss_and_grads(m, caches[1], ids2, pos2)
    assert torch.equal(r2[0], o2[0])
    for n in r2[1]:
        assert torch.allclose(r2[1][n], o2[1][n], atol=1e-6), n
    with pytest.raises(RuntimeError) as e:
        loss_and_grads(m, c, ids2, pos2)
    assert str(e.value) == GRAD_ACROSS_FORWARDS and c.get_seq_length() == 8


@pytest.mark.parametrize("make", [tiny_mistral, tiny_gemma2])
def test_compiled_forward_with_windows_compiles_no_more_than_plain(fresh_sim, make):
    """Sliding-window layers plan their update before the forward too
    (CxlSlidingLayer.plan_window): a torch.compile'd forward of an all-sliding
    (Mistral) or interleaved (Gemma 2) model compiles no more often than the
    plain model's and never hits the recompile limit; tokens identical."""
    from tests.hf.test_hf_compile import _compiled_generate

    torch.manual_seed(0)
    prompts = [torch.randint(3, 900, (1, 10)), torch.randint(3, 900, (1, 14))]
    plain_tokens, plain_frames = _compiled_generate(make(), prompts)
    model = hf.wrap(make(), device_limit="64MiB", host_limit="64MiB")
    tokens, frames = _compiled_generate(model, prompts)
    assert frames <= plain_frames, (frames, plain_frames)
    assert all(torch.equal(a, b) for a, b in zip(tokens, plain_tokens))
    st = hf.stats(model)["hf"]["cache"]
    assert st["steps"] == 6 and st["kv_device_bytes"] > 0  # one step per forward; windows in the extents
