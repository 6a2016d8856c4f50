"""cxlalloc plan against the engine: for one tiny model of each layer layout
(GQA full attention, all-sliding, mixed full/sliding, alternating with eager
attention, MLA latents + indexer keys, attention + SSM hybrid), the planner's
KV bytes equal what the engine commits in class ``kv`` when ``hf.wrap`` runs
generate() on the simulated driver, and the planned fits/spills boundary is
the engine's: a KV budget in VRAM equal to the planned need spills nothing,
one chunk less spills exactly that chunk (tokens identical in both runs).

The planner reads the config as plain JSON (``config.to_dict()`` through
``json``) and from the config object; both give the same layout.
"""

import gc
import json

import pytest
from tests.helpers.hf_kinds import tiny_deepseek_v32, tiny_falcon_h1, tiny_gemma3
from tests.helpers.hf_util import MiB, _seeded, gen, padded_batch, torch

import transformers as T

import cxlalloc.hf as hf
from cxlalloc.hf import returned_cache
from cxlalloc.hf.layers.sliding import window_capacity as engine_window_capacity
from cxlalloc.plan.layout import cache_bytes, kv_bytes_per_token, read_layout, state_bytes, window_capacity

CHUNK = 2 * MiB
FP32 = 4


@_seeded
def llama_gqa():
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=8, num_key_value_heads=4, vocab_size=500))


@_seeded
def mistral_sliding():
    return T.MistralForCausalLM(T.MistralConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                                sliding_window=300))


@_seeded
def qwen2_mixed():
    return T.Qwen2ForCausalLM(T.Qwen2Config(hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                            use_sliding_window=True, sliding_window=8, max_window_layers=2))


@_seeded
def _gemma2():
    return T.Gemma2ForCausalLM(T.Gemma2Config(hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                              vocab_size=500, sliding_window=16))


def gemma2_alternating():
    return _gemma2(attn="eager")


# (maker, batch, prompt tokens, new tokens, expected layer kinds)
CASES = {
    "llama-gqa": (llama_gqa, 8, 300, 12, {"full_attention": 2}),
    # prompt longer than the sliding extent's capacity (512 rows at batch 8): w - 1 rows kept, then one per step
    "mistral-sliding": (mistral_sliding, 8, 600, 24, {"sliding_attention": 2}),
    "qwen2-mixed": (qwen2_mixed, 4, 300, 12, {"full_attention": 2, "sliding_attention": 2}),
    "gemma2-alternating": (gemma2_alternating, 4, 200, 12, {"sliding_attention": 2, "full_attention": 2}),
    "gemma3-5to1": (tiny_gemma3, 2, 9, 10, {"sliding_attention": 5, "full_attention": 1}),
    "deepseek-v32-indexed": (tiny_deepseek_v32, 2, 9, 10, {"indexed_attention": 2}),
    "falcon-h1-hybrid": (tiny_falcon_h1, 8, 520, 10, {"hybrid": 2}),
}


def _run(m, batch, prompt, new, **limits):
    hf.wrap(m, device_limit=256 * MiB, host_limit=256 * MiB, **limits)
    try:
        out = gen(m, **padded_batch(batch=batch, length=prompt, pad=0, vocab=500), max_new_tokens=new,
                  min_new_tokens=new)
        kv = dict(hf.stats(m)["kv"])
        return out, kv, returned_cache(out)
    finally:
        hf.unwrap(m)
        gc.collect()


def test_window_capacity_is_the_engines():
    for w in (2, 5, 17, 64, 300, 4096, 131072):
        assert window_capacity(w) == engine_window_capacity(w)


@pytest.mark.filterwarnings("ignore::cxlalloc.hf.CacheCoverageWarning")  # Falcon-H1's SSM state, said by its own test
@pytest.mark.parametrize("case", list(CASES))
def test_planned_kv_bytes_and_spill_boundary_match_the_engine(fresh_sim, case):
    make, batch, prompt, new, kinds = CASES[case]
    m = make()
    from_obj = read_layout(m.config)
    from_json = read_layout(json.loads(json.dumps(m.config.to_dict())))
    assert from_obj.kinds() == kinds
    assert from_json.kinds() == kinds and from_json.layers == from_obj.layers  # plain JSON reads the same layout
    tokens = prompt + new - 1  # generate() caches every token but the last
    planned = cache_bytes(from_json, batch, tokens, FP32, prompt=prompt)
    assert planned["total"] >= 2 * CHUNK, "premise: the KV spans several chunks, so one chunk less spills"

    # The planner's boundary: the need fits a KV budget in VRAM equal to it (all of it committed there) ...
    ref, kv, cache = _run(m, batch, prompt, new, kv_device_limit=planned["total"])
    assert (kv["device_bytes"], kv["host_bytes"]) == (planned["total"], 0)
    st = cache.kv_stats()
    per_tok = kv_bytes_per_token(from_json, FP32)
    shared = sum(v for k, v in per_tok.items() if k in ("full_attention", "indexed_attention", "hybrid"))
    assert st["bytes_per_token"] == batch * shared  # the shared store's row: every full/indexed/hybrid layer
    if from_json.count("hybrid"):
        held = sum(t.numel() * t.element_size() for layer in cache.layers
                   for d in (layer.conv_states, layer.recurrent_states) for t in d.values() if t is not None)
        assert held == batch * state_bytes(from_json, FP32)
    del cache

    # ... and one chunk less spills exactly one chunk to the host tier, with the same tokens.
    out, kv, _ = _run(m, batch, prompt, new, kv_device_limit=planned["total"] - CHUNK)
    assert (kv["device_bytes"], kv["host_bytes"]) == (planned["total"] - CHUNK, CHUNK)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-sliding", "qwen2-mixed", "gemma2-alternating"])
def test_planned_parameters_are_the_models(case):
    m = CASES[case][0]()
    assert read_layout(json.loads(json.dumps(m.config.to_dict()))).params == m.num_parameters()


@pytest.mark.parametrize("make", [qwen2_mixed, gemma2_alternating, tiny_gemma3, tiny_falcon_h1, mistral_sliding])
def test_configs_saved_without_layer_types_read_as_transformers_builds_them(make):
    """An older config.json has no ``layer_types``: the planner's per-class rules
    (Qwen2 max_window_layers, Gemma 2/3 alternation, Falcon-H1 hybrid, a plain
    sliding_window) give the layer kinds transformers' config class computes."""
    cfg = make().config
    d = json.loads(json.dumps(cfg.to_dict()))
    d.pop("layer_types", None)
    assert [la.kind for la in read_layout(d).layers] == [la.kind for la in read_layout(cfg).layers]


# ----------------------------------------------------------------- a 2-GPU pipeline layout
@_seeded
def _llama_stage(layers):
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=layers,
                                            num_attention_heads=8, num_key_value_heads=4, vocab_size=500))


def test_two_gpu_pipeline_plan_per_gpu_kv_and_spill_match_the_engine(fresh_sim):
    """``cxlalloc plan --gpus 2 --parallel pp`` on a 5-layer Llama GQA: GPU 0
    holds layers 0-2, GPU 1 layers 3-4, each its own cache on its own tiers.
    Each stage runs on its own simulated GPU (cuda:0 and cuda:1 of a 2-device
    simulated driver, both alive at once) as a Llama of that stage's layers:
    the planned per-GPU KV is what that GPU's engine commits in class ``kv``,
    a budget of the planned bytes spills nothing there, one chunk less spills
    exactly one chunk on that GPU's host tier and none on the other's.  (One
    device-mapped model over both GPUs is hf.wrap's multi-GPU path; here each
    stage is a model of its own: the same layers, geometry and tokens.)"""
    from cxlalloc.plan.planner import StagedModel
    from tests.helpers.sim_gpus import sim_gpus

    layout = read_layout(json.loads(json.dumps(_llama_stage(layers=5).config.to_dict())))
    batch, prompt, new = 8, 600, 12
    tokens = prompt + new - 1
    staged = StagedModel(layout, 0.0, FP32, 64 * MiB, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, CHUNK, gpus=2)
    per = staged.per_gpu(batch, tokens, 2)
    assert [x["layers"] for x in per] == [[0, 3], [3, 5]]
    planned = [int(x["kv_bytes"]) for x in per]
    assert planned == [cache_bytes(read_layout(json.loads(json.dumps(_llama_stage(layers=b - a).config.to_dict()))),
                                   batch, tokens, FP32)["total"] for a, b in ((0, 3), (3, 5))]
    assert planned[0] > planned[1] >= 2 * CHUNK  # uneven stages, several chunks each
    ids = padded_batch(batch=batch, length=prompt, pad=0, vocab=500)
    with sim_gpus(fresh_sim, 2):
        for short in (None, 0, 1):  # no GPU short, GPU 0 one chunk short, GPU 1 one chunk short
            models, outs, kvs = [], [], []
            try:
                for gpu, (a, b) in enumerate(((0, 3), (3, 5))):
                    m = _llama_stage(layers=b - a)
                    limit = planned[gpu] - (CHUNK if short == gpu else 0)
                    hf.wrap(m, device=gpu, device_limit=256 * MiB, host_limit=256 * MiB, kv_device_limit=limit)
                    models.append(m)
                for gpu, m in enumerate(models):
                    outs.append(gen(m, **ids, max_new_tokens=new, min_new_tokens=new))
                    st = hf.stats(m)
                    assert st["device"]["device"] == gpu
                    kvs.append((st["kv"]["device_bytes"], st["kv"]["host_bytes"]))
            finally:
                for m in models:
                    hf.unwrap(m)
                outs = [o.sequences for o in outs]
                gc.collect()
            want = [(planned[g] - (CHUNK if short == g else 0), CHUNK if short == g else 0) for g in (0, 1)]
            assert kvs == want
            if short is None:
                ref = outs
            else:
                assert all(torch.equal(o, r) for o, r in zip(outs, ref))  # spilling changes no token
