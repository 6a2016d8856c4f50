"""Indexed (DSA) and attention+SSM layers in cxlalloc (cxlalloc/hf/layers/indexed.py, hybrid.py).

Oracles: transformers' DynamicIndexedLayer / DynamicCache fed the same states,
and unwrapped generate() on tiny DeepSeek-V3.2 (DynamicIndexedLayer) and
Falcon-H1 (LinearAttentionAndFullAttentionLayer) configs: tokens and scores
identical; K/V and indexer keys in extents, SSM/conv state in torch's memory
(reported as fixed-size state).  KV reuse refuses both kinds once."""

import copy
import warnings

import pytest
from tests.helpers.hf_kinds import MODES, check_modes, tiny_deepseek_v32, tiny_falcon_h1
from tests.helpers.hf_util import MiB, assert_same, gen, padded_batch, torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicIndexedLayer

import cxlalloc.hf as hf
from cxlalloc.hf import CxlCache, CxlHybridLayer, CxlIndexedLayer, CxlKVLayer, returned_cache
from cxlalloc.hf.pool import KVPool
from cxlalloc.hf.reuse import KVReuseWarning

CHUNK = 2 * MiB


def states(seed, b=2, q=3, h=1, dk=16, dv=8, di=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, q, dk, generator=g), torch.randn(b, h, q, dv, generator=g),
            torch.randn(b, q, di, generator=g))


def same_layer(ref, mine):
    assert ref.get_seq_length() == mine.get_seq_length()
    assert torch.equal(ref.keys, mine.keys) and torch.equal(ref.values, mine.values)
    assert torch.equal(ref.indexer_keys, mine.indexer_keys)


def test_indexed_layer_matches_the_stock_layer(make_alloc):
    """update + update_indexer over a prefill and decode steps, then beam
    reorder, repeat, select, crop(-n), deepcopy and reset, against DynamicIndexedLayer."""
    pool = KVPool(make_alloc(), 0, None, 2.0, 256)
    ref, mine = DynamicIndexedLayer(), CxlIndexedLayer(pool)
    for i, q in enumerate([5, 1, 1, 1]):
        k, v, ik = states(i, q=q)
        assert all(torch.equal(a, b) for a, b in zip(ref.update(k, v), mine.update(k, v)))
        assert torch.equal(ref.update_indexer(ik), mine.update_indexer(ik))
        same_layer(ref, mine)
    idx = torch.tensor([1, 0])
    ref.reorder_cache(idx)
    mine.reorder_cache(idx)
    same_layer(ref, mine)
    ref.batch_repeat_interleave(2)
    mine.batch_repeat_interleave(2)
    same_layer(ref, mine)
    sel = torch.tensor([3, 0, 1])
    ref.batch_select_indices(sel)
    mine.batch_select_indices(sel)
    same_layer(ref, mine)
    ref.crop(-2)
    mine.crop(-2)
    same_layer(ref, mine)
    twin = copy.deepcopy(mine)
    assert type(twin) is CxlIndexedLayer and twin._istore is not mine._istore
    same_layer(ref, twin)
    assert mine._istore.tier_bytes()["device"] == CHUNK  # the indexer keys live in an extent
    mine.reset()
    ref.reset()
    assert mine.indexer_keys is None and mine.get_seq_length() == 0 and mine._istore.tier_bytes()["device"] == 0
    with pytest.raises(AttributeError, match="update_indexer"):
        mine.indexer_keys = torch.zeros(1)


def test_whole_cache_ops_carry_the_indexer_keys(fresh_sim):
    """CxlCache.reorder_cache / batch_repeat_interleave / batch_select_indices /
    deepcopy move the indexer keys with the K/V (as DynamicCache does)."""
    m = tiny_deepseek_v32()
    hf.wrap(m)
    cx, ref = CxlCache(config=m.config, allocator=hf.allocator(m)), DynamicCache(config=m.config)
    for step, q in enumerate([4, 1]):
        for li in range(2):
            k, v, ik = states(10 * step + li, q=q)
            for c in (cx, ref):
                c.update(k, v, li)
                c.update_indexer(ik, li)
    for op in (lambda c: c.reorder_cache(torch.tensor([1, 0])), lambda c: c.batch_repeat_interleave(2),
               lambda c: c.batch_select_indices(torch.tensor([2, 1]))):
        op(cx)
        op(ref)
        for a, b in zip(ref.layers, cx.layers):
            same_layer(a, b)
    for a, b in zip(ref.layers, copy.deepcopy(cx).layers):
        same_layer(a, b)


@pytest.mark.parametrize("mode", list(MODES))
def test_dsa_model_generate_identical_and_tiered(fresh_sim, mode):
    m = tiny_deepseek_v32()
    inp = padded_batch(length=9)
    ref = check_modes(m, inp, modes={mode: MODES[mode]})[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.CacheCoverageWarning)  # everything is tiered: no warning
        hf.wrap(m)
        out = gen(m, **inp, **MODES[mode], max_new_tokens=10, min_new_tokens=10)
    assert_same(ref, out)
    c = returned_cache(out)
    assert [type(layer) for layer in c.layers] == [CxlIndexedLayer, CxlIndexedLayer]
    st = c.kv_stats()
    # MLA latents of both layers share one store; each layer's indexer keys have one
    assert st["stores"] == 1 and st["other_stores"] == 2 and st["kv_host_bytes"] == 0
    assert st["kv_device_bytes"] == 3 * CHUNK
    batch = out.sequences.shape[0] if mode != "beam" else 2 * 2
    for layer in c.layers:
        assert layer.indexer_keys.shape == (batch, 9 + 10 - 1, 16)
        assert layer._istore.tier_bytes()["device"] == CHUNK
    r = hf.stats(m)["hf"]["layers"]
    assert r["tiered"] == {"DynamicIndexedLayer": 2} and not r["untiered"] and not r["fixed_state"]


def test_dsa_spills_to_the_host_with_identical_tokens(fresh_sim):
    m = tiny_deepseek_v32()
    inp = padded_batch(length=9)
    ref = check_modes(m, inp, modes={"greedy": {}})["greedy"]
    hf.wrap(m, device_limit=256 * MiB, host_limit=256 * MiB, kv_device_limit=CHUNK)
    out = gen(m, **inp, max_new_tokens=10, min_new_tokens=10)
    assert_same(ref, out)
    st = returned_cache(out).kv_stats()
    assert st["kv_device_bytes"] == CHUNK and st["kv_host_bytes"] == 2 * CHUNK


@pytest.mark.parametrize("mode", ["greedy", "beam", "sample"])
def test_hybrid_model_attention_half_tiered_state_reported(fresh_sim, mode):
    m = tiny_falcon_h1()
    inp = padded_batch(length=9)
    ref = check_modes(m, inp, modes={mode: MODES[mode]})[mode]
    with pytest.warns(hf.CacheCoverageWarning) as w:
        hf.wrap(m)
    assert len(w) == 1
    assert str(w[0].message) == (
        "cxlalloc.hf tiers 2 of 2 cache layers (kinds LinearAttentionAndFullAttentionLayer x 2); left to "
        "transformers: the SSM/conv state of LinearAttentionAndFullAttentionLayer x 2 (fixed-size state); to put "
        "those in the tiers too use global mode (cxlalloc.enable() / CXLALLOC=1)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.CacheCoverageWarning)  # said once, at wrap()
        out = gen(m, **inp, **MODES[mode], max_new_tokens=10, min_new_tokens=10)
    assert_same(ref, out)
    c = returned_cache(out)
    assert [type(layer) for layer in c.layers] == [CxlHybridLayer, CxlHybridLayer]
    assert all(isinstance(layer, CxlKVLayer) for layer in c.layers)
    st = c.kv_stats()
    assert st["stores"] == 1 and st["cxl_layers"] == 2 and st["kv_device_bytes"] == CHUNK
    state = 0
    for layer in c.layers:
        for d in (layer.conv_states, layer.recurrent_states):
            for t in d.values():
                if t is not None:
                    state += t.numel() * t.element_size()
    assert state > 0
    r = hf.stats(m)["hf"]["layers"]
    assert r["tiered"] == {"LinearAttentionAndFullAttentionLayer": 2}
    assert r["fixed_state"] == {"LinearAttentionAndFullAttentionLayer": 2}
    assert r["untiered_state_bytes"] == state and r["untiered_kv_bytes"] == 0 and not r["untiered"]


@pytest.mark.parametrize("make,kind", [(tiny_deepseek_v32, "DynamicIndexedLayer"),
                                       (tiny_falcon_h1, "LinearAttentionAndFullAttentionLayer")])
def test_kv_reuse_refuses_kinds_it_cannot_restore(fresh_sim, make, kind):
    """A stored block holds full-attention K/V only: reuse is off, said once
    (naming the kind), and generate() still gives unwrapped tokens."""
    ref, m = make(), make()
    with pytest.warns(KVReuseWarning, match=kind):
        hf.wrap(m, device_limit=64 * MiB, host_limit=256 * MiB, kv_store=True, block_tokens=4)
    p = padded_batch(batch=1, length=12)["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVReuseWarning)
        for _ in range(2):
            assert torch.equal(gen(m, input_ids=p, max_new_tokens=5).sequences,
                               gen(ref, input_ids=p, max_new_tokens=5).sequences)
    r = hf.stats(m)["hf"]["reuse"]
    assert r["enabled"] is False and kind in r["off_reason"] and r["counters"]["calls_with_hit"] == 0
