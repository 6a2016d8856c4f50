"""Encoder-decoder models: both halves of EncoderDecoderCache in cxlalloc
(cxlalloc/hf/encdec.py).  Oracle: unwrapped generate() on tiny T5, BART and
Whisper configs (tokens and scores identical, greedy / beam / sampling)."""

import copy
import pickle
import warnings

import pytest
from tests.helpers.hf_kinds import MODES, check_modes, tiny_bart, tiny_t5, tiny_whisper
from tests.helpers.hf_util import MiB, assert_same, gen, padded_batch, torch

import cxlalloc.hf as hf
from cxlalloc.hf import CxlCache, CxlEncoderDecoderCache, returned_cache

CHUNK = 2 * MiB


def whisper_input():
    g = torch.Generator().manual_seed(3)
    return dict(input_features=torch.randn(2, 8, 32, generator=g))


MODELS = {"t5": (tiny_t5, lambda: padded_batch(length=9), 9),
          "bart": (tiny_bart, lambda: padded_batch(length=9), 9),
          "whisper": (tiny_whisper, whisper_input, 16)}  # 32 frames -> 16 encoder positions (stride-2 conv)


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_identical_with_both_caches_in_extents(fresh_sim, name):
    make, inputs, enc_len = MODELS[name]
    m = make()
    inp = inputs()
    modes = MODES if name != "whisper" else {k: MODES[k] for k in ("greedy", "beam")}
    refs = check_modes(m, inp, new=8, modes=modes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.CacheCoverageWarning)  # everything tiered: no warning
        hf.wrap(m)
        outs = {k: gen(m, **inp, **kw, max_new_tokens=8, min_new_tokens=8) for k, kw in modes.items()}
    for mode, out in outs.items():
        assert_same(refs[mode], out)
        c = returned_cache(out)
        if name == "whisper":
            # Whisper's generate() re-stacks the returned cache per batch row into a new transformers
            # EncoderDecoderCache (models/whisper/generation_whisper.py, _postprocess_outputs): generation ran
            # on the CxlEncoderDecoderCache, whose counters hf.stats() kept.
            assert type(c).__name__ == "EncoderDecoderCache"
            st = hf.stats(m)["hf"]["cache"]
            assert st["kv_device_bytes"] == 2 * CHUNK and st["cross_attention"]["live_tokens"] == enc_len
            continue
        assert type(c) is CxlEncoderDecoderCache
        self_c, cross_c = c.self_attention_cache, c.cross_attention_cache
        assert type(self_c) is CxlCache and type(cross_c) is CxlCache
        a, b = self_c.kv_stats(), cross_c.kv_stats()
        assert b["live_tokens"] == enc_len, "the cross-attention cache holds the encoder output, written once"
        assert a["live_tokens"] >= 7  # the decoder's tokens (start token + generated - 1)
        assert a["kv_device_bytes"] == CHUNK and b["kv_device_bytes"] == CHUNK
        assert a["regrowths"] == 0  # reserved for max_length - 1 up front
        st = c.kv_stats()
        assert st["kv_device_bytes"] == 2 * CHUNK and st["cross_attention"] == b and st["self_attention"] == a
    r = hf.stats(m)["hf"]["layers"]
    assert r["cache_class"] == "CxlEncoderDecoderCache" and not r["untiered"]
    n = m.config.get_text_config(decoder=True).num_hidden_layers
    assert r["tiered"] == {"DynamicLayer": n, "DynamicLayer (cross-attention)": n}
    assert hf.stats(m)["hf"]["cache"]["kv_device_bytes"] == 2 * CHUNK


def test_encoder_decoder_spills_to_the_host(fresh_sim):
    """kv_device_limit of one chunk: one of the two caches' chunks is on the
    host tier; greedy and beam identical."""
    m = tiny_t5()
    inp = padded_batch(length=9)
    refs = check_modes(m, inp, new=8, modes={k: MODES[k] for k in ("greedy", "beam")})
    hf.wrap(m, device_limit=256 * MiB, host_limit=256 * MiB, kv_device_limit=CHUNK)
    for mode in ("greedy", "beam"):
        out = gen(m, **inp, **MODES[mode], max_new_tokens=8, min_new_tokens=8)
        assert_same(refs[mode], out)
        st = returned_cache(out).kv_stats()
        assert st["kv_device_bytes"] == CHUNK and st["kv_host_bytes"] == CHUNK


def test_copy_and_pickle(fresh_sim):
    m = tiny_bart()
    hf.wrap(m)
    out = gen(m, **padded_batch(length=9), max_new_tokens=4, min_new_tokens=4)
    c = returned_cache(out)
    twin = copy.deepcopy(c)
    assert type(twin) is CxlEncoderDecoderCache
    for a, b in zip(c.cross_attention_cache.layers, twin.cross_attention_cache.layers):
        assert torch.equal(a.keys, b.keys) and a._store is not b._store
    assert twin.is_updated == c.is_updated
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(c)


def test_kv_reuse_refuses_encoder_decoder_models_once(fresh_sim):
    from cxlalloc.hf.reuse import KVReuseWarning

    ref, m = tiny_t5(), tiny_t5()
    with pytest.warns(KVReuseWarning, match="T5ForConditionalGeneration is an encoder-decoder model"):
        hf.wrap(m, device_limit=64 * MiB, host_limit=256 * MiB, kv_store=True, block_tokens=4)
    inp = padded_batch(length=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVReuseWarning)
        for _ in range(2):
            assert torch.equal(gen(m, **inp, max_new_tokens=4).sequences, gen(ref, **inp, max_new_tokens=4).sequences)
    r = hf.stats(m)["hf"]
    assert r["reuse"]["enabled"] is False and r["layers"]["cache_class"] == "CxlEncoderDecoderCache"


def test_t5gemma_cross_attention_stays_full_attention(sim):
    """T5Gemma's decoder config declares sliding layers, but its own
    _prepare_cache_for_generation makes the cross-attention cache full
    attention: the CxlEncoderDecoderCache mirrors the layer kinds it made
    (a sliding cross-attention layer would drop encoder tokens).  The coverage
    matrix's tiny T5Gemma / T5Gemma2: every run identical, all tiered."""
    import gc
    import importlib.util
    import os

    import cxlalloc.engine

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "coverage_matrix.py")
    spec = importlib.util.spec_from_file_location("coverage_matrix", path)
    cm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cm)
    gc.collect()
    cm.configure_sim()
    try:
        for rid in ("seq2seq/t5gemma", "seq2seq/t5gemma2"):
            r = cm.run_arch(rid)
            assert r["status"] == "ok", (rid, r.get("reason"), r["runs"])
            assert all(v["tokens_identical"] and v["scores_identical"] for v in r["runs"].values()), rid
            assert r["cache_wrapped"] == "CxlEncoderDecoderCache" and r["coverage"] == "all-tiered", rid
            assert not any("cross:" in k and "Sliding" in k for k in r["layers"]["tiered"]), r["layers"]
    finally:
        gc.collect()
        sim.configure("vram=1GiB")
        cxlalloc.engine._sim_vram = 1 << 30
