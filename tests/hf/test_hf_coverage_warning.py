"""Never a silent no-op: CacheCoverageWarning and hf.stats()["hf"]["layers"]
(cxlalloc/hf/coverage.py).  One warning per wrapped model when cache layers
are left to transformers (at wrap() when the config tells, else at the first
generate()), none when everything is tiered; the stats carry the same facts,
with bytes measured from the cache generate() used."""

import warnings

import pytest
from tests.helpers.hf_kinds import tiny_mamba, tiny_minimax, tiny_mistral
from tests.helpers.hf_util import gen, padded_batch, tiny_llama, torch
from transformers import DynamicCache

import cxlalloc.hf as hf
from cxlalloc.config import format_bytes
from cxlalloc.hf import CacheCoverageWarning, returned_cache
from cxlalloc.hf.coverage import layer_report

HINT = "to put those in the tiers too use global mode (cxlalloc.enable() / CXLALLOC=1)"


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def strict():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", CacheCoverageWarning)
    return ctx


@pytest.mark.parametrize("make", [tiny_llama, tiny_mistral])
def test_no_warning_when_everything_is_tiered(fresh_sim, make):
    m = make()
    ctx = strict()
    try:
        hf.wrap(m)
        assert hf.stats(m)["hf"]["layers"]["untiered"] == {}  # predicted from the config at wrap()
        gen(m, **padded_batch(), max_new_tokens=4)
    finally:
        ctx.__exit__(None, None, None)
    r = hf.stats(m)["hf"]["layers"]
    assert r["cache_class"] == "CxlCache" and r["tiered_layers"] == r["layers"] == 2
    assert r["untiered"] == r["fixed_state"] == {} and r["untiered_kv_bytes"] == r["untiered_state_bytes"] == 0


def test_fixed_state_model_is_told_at_wrap_with_bytes_in_stats(fresh_sim):
    m = tiny_mamba()
    with pytest.warns(CacheCoverageWarning) as w:
        hf.wrap(m)
    assert [str(x.message) for x in w] == [
        f"cxlalloc.hf tiers 0 of 2 cache layers; left to transformers: LinearAttentionLayer x 2 (fixed-size state); "
        f"{HINT}"]
    ctx = strict()
    try:
        out = gen(m, input_ids=torch.randint(3, 1000, (1, 6)), max_new_tokens=4)
    finally:
        ctx.__exit__(None, None, None)
    c = returned_cache(out)
    state = sum(nbytes(*layer.conv_states.values(), *layer.recurrent_states.values()) for layer in c.layers)
    r = hf.stats(m)["hf"]["layers"]
    assert r["fixed_state"] == {"LinearAttentionLayer": 2} and r["untiered"] == {} and r["tiered_layers"] == 0
    assert r["untiered_state_bytes"] == state > 0


def test_model_specific_cache_is_tiered_and_its_state_told_at_the_first_generate_once(fresh_sim):
    """MiniMax makes its own MiniMaxCache inside forward(): generate() gets a
    CxlMiniMaxCache (a MiniMaxCache whose full-attention layers are CxlKVLayers);
    only a generate() shows the lightning-attention state it keeps (fixed size):
    said then, once, with its bytes.  Tokens identical in every mode."""
    from tests.helpers.hf_kinds import MODES, check_modes
    from tests.helpers.hf_util import assert_same
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    from cxlalloc.hf import CxlKVLayer

    m = tiny_minimax()
    inp = padded_batch(length=7)
    modes = {k: MODES[k] for k in ("greedy", "beam", "sample")}
    refs = check_modes(m, inp, new=6, modes=modes)
    ctx = strict()
    try:
        hf.wrap(m)  # the config cannot tell: nothing said yet
    finally:
        ctx.__exit__(None, None, None)
    assert hf.stats(m)["hf"]["layers"] is None
    with pytest.warns(CacheCoverageWarning) as w:
        out = gen(m, **inp, max_new_tokens=6, min_new_tokens=6)
    assert_same(refs["greedy"], out)
    c = returned_cache(out)
    assert isinstance(c, MiniMaxCache) and type(c).__name__ == "CxlMiniMaxCache"
    assert [type(layer) for layer in c.layers] == [CxlKVLayer] * len(c.layers) and len(c.layers) >= 1
    assert c.kv_stats()["kv_device_bytes"] == 2 * 1024 * 1024
    state = nbytes(*[t for t in c.linear_cache if torch.is_tensor(t)])
    assert state > 0
    assert [str(x.message) for x in w] == [
        f"cxlalloc.hf tiers {len(c.layers)} of {len(c.layers)} cache layers (kinds DynamicLayer x {len(c.layers)}); "
        f"left to transformers: MiniMaxCache (state outside its layers) x 1 (fixed-size state, "
        f"{format_bytes(state)}); {HINT}"]
    r = hf.stats(m)["hf"]["layers"]
    assert r["cache_class"] == "CxlMiniMaxCache" and r["tiered"] == {"DynamicLayer": len(c.layers)}
    assert r["untiered"] == {} and r["untiered_state_bytes"] == state and r["untiered_kv_bytes"] == 0
    ctx = strict()
    try:  # the same situation: not said again
        for mode in ("beam", "sample"):
            assert_same(refs[mode], gen(m, **inp, **modes[mode], max_new_tokens=6, min_new_tokens=6))
    finally:
        ctx.__exit__(None, None, None)


def test_a_cache_passed_in_or_configured_is_named(fresh_sim):
    m = tiny_llama()
    hf.wrap(m)
    inp = padded_batch()
    with pytest.warns(CacheCoverageWarning, match=r"used a DynamicCache: one passed in.*DynamicLayer x 2 \(~"):
        out = gen(m, **inp, max_new_tokens=3, **{hf.cache_kwarg(m): DynamicCache(config=m.config)})
    c = returned_cache(out)
    assert hf.stats(m)["hf"]["layers"]["untiered_kv_bytes"] == sum(nbytes(x.keys, x.values) for x in c.layers)
    with pytest.warns(CacheCoverageWarning, match=r"used a StaticCache.*StaticLayer x 2"):
        gen(m, **inp, max_new_tokens=3, cache_implementation="static")
    ctx = strict()
    try:  # back to the CxlCache it makes: nothing to say; use_cache=False: no cache, nothing to say
        gen(m, **inp, max_new_tokens=3)
        gen(m, **inp, max_new_tokens=3, use_cache=False)
    finally:
        ctx.__exit__(None, None, None)
    assert hf.stats(m)["hf"]["layers"]["cache_class"] == "CxlCache"


def test_report_of_caches_that_are_not_a_transformers_cache():
    none = layer_report(None, "SomeModel")
    assert none["untiered"] == {"no Cache (SomeModel returned none)": 1} and none["cache_class"] is None
    kvs = [torch.zeros(1, 2, 5, 4) for _ in range(4)]
    legacy = layer_report(((kvs[0], kvs[1]), (kvs[2], kvs[3])))
    assert legacy["untiered"] == {"tuple of (key, value) per layer": 2}
    assert legacy["untiered_kv_bytes"] == nbytes(*kvs) == 4 * 160
    assert layer_report(((kvs[0], kvs[0]),))["untiered_kv_bytes"] == 160  # a tensor held twice counts once
    state = layer_report([torch.zeros(3, 4), torch.zeros(3, 4)])
    assert state["fixed_state"] == {"list of 2 state tensors": 1} and state["untiered_state_bytes"] == 96


@pytest.mark.parametrize("name", ["xlnet", "rwkv"])
def test_a_model_without_a_transformers_cache_is_told_with_what_grows(fresh_sim, name):
    """XLNet's mems grow with the context (reported as untiered KV); RWKV's
    recurrent state does not (fixed-size state): told at the first generate(),
    tokens unchanged."""
    from tests.helpers.hf_kinds import tiny_rwkv, tiny_xlnet

    make = {"xlnet": tiny_xlnet, "rwkv": tiny_rwkv}[name]
    ref, m = make(), make()
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(2))
    hf.wrap(m)
    with pytest.warns(CacheCoverageWarning) as w:
        out = gen(m, input_ids=ids, max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(out.sequences, gen(ref, input_ids=ids, max_new_tokens=5, min_new_tokens=5).sequences)
    r = hf.stats(m)["hf"]["layers"]
    assert len(w) == 1 and r["tiered_layers"] == 0
    if name == "xlnet":
        assert r["cache_class"] == "tuple" and r["untiered"] == {"tuple of 2 state tensors": 1}
        assert r["untiered_kv_bytes"] > 0 and "KV at this length" in str(w[0].message)
    else:
        assert r["cache_class"] == "list" and r["fixed_state"] == {"list of 5 state tensors": 1}
        assert r["untiered_state_bytes"] > 0 and r["untiered"] == {} and "fixed-size state" in str(w[0].message)


def test_a_model_whose_generate_keeps_no_cache_says_so_once(fresh_sim):
    """transformers' MPT generates with use_cache=False: nothing can be tiered,
    and wrap() says so once instead of listing tiered layers that hold 0 B."""
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    m = MptForCausalLM(MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=1000, max_seq_len=512)).eval()
    hf.wrap(m, device_limit=64 << 20, host_limit=256 << 20)
    ids = torch.randint(3, 1000, (1, 40))
    with pytest.warns(CacheCoverageWarning, match=r"MptForCausalLM's generate\(\) ran \d+ forward passes with "
                                                  r"use_cache=False"):
        gen(m, input_ids=ids, max_new_tokens=5)
    assert hf.stats(m)["kv"]["peak_device_bytes"] + hf.stats(m)["kv"]["peak_host_bytes"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(m, input_ids=ids, max_new_tokens=5)  # once
        gen(m, input_ids=ids, max_new_tokens=5, use_cache=False)  # asked for: nothing to say
