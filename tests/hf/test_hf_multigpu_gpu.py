"""cxlalloc.hf.wrap()'s per-GPU code path on real GPUs (marked ``gpu``: skipped without CUDA; not yet run on a GPU).

scripts/gpu_check.sh runs these as their own steps (the pytest-gpu step leaves this file out):
``hf-per-gpu`` runs the per-GPU path on the one GPU of the machine (accelerate's dispatch onto ``cuda:0``, per-GPU
options as lists of one), and ``hf-multi-gpu`` runs a real accelerate dispatch over two GPUs only where
``torch.cuda.device_count() > 1``.  Memory asked: tiny models, device budgets of at most 64 MiB per GPU and host
tiers of 256 MiB, far under any card's free memory.  The same paths run in CI on simulated GPUs
(tests/hf/test_hf_multigpu.py).
"""

import gc

import pytest

from tests.helpers.hf_util import MiB, padded_batch, tiny_llama, torch

import cxlalloc.hf as hf
from cxlalloc.hf import returned_cache

pytestmark = pytest.mark.gpu


def _model():
    # 8 heads x 32 dims x K+V x fp32 x 4 layers: 8 KiB per token per sequence
    return tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4, vocab=256)


def _generate(model, inp, n):
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(**inp, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True)


def _inputs(device, batch=4, length=300):
    inp = padded_batch(batch=batch, length=length, vocab=256)
    return {k: v.to(device) for k, v in inp.items()}


def test_per_gpu_path_on_one_gpu():
    from accelerate import dispatch_model

    m = dispatch_model(_model(), device_map={"": 0})  # what from_pretrained(device_map={"": 0}) leaves
    inp = _inputs("cuda:0")
    ref = _generate(m, inp, 100).sequences.cpu()
    # KV 4 x 399 x 8 KiB = ~12.5 MiB: more than the 4 MiB of VRAM KV may take
    hf.wrap(m, device_limit=["64MiB"], kv_device_limit=["4MiB"], host_limit={"cuda:0": "256MiB"})
    out = _generate(m, inp, 100)
    assert torch.equal(out.sequences.cpu(), ref)
    s = hf.stats(m)
    assert s["hf"]["gpus"] == ["cuda:0"] and list(s["gpus"]) == ["cuda:0"]
    assert s["gpus"]["cuda:0"]["kv"]["host_bytes"] > 0 and 0 < s["gpus"]["cuda:0"]["kv"]["device_bytes"] <= 4 * MiB
    c = returned_cache(out)
    assert c.kv_stats()["kv_host_bytes"] > 0
    del out, c
    hf.unwrap(m)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layers_on_several_gpus():
    from accelerate import dispatch_model

    from tests.helpers.sim_dispatch import accelerate_device_map

    m = _model()
    dm = accelerate_device_map(m, 2)
    m = dispatch_model(m, device_map=dm)  # real dispatch: each layer's weights on its cuda:i
    layer_gpus = [f"cuda:{dm[f'model.layers.{i}']}" for i in range(4)]
    assert sorted(set(layer_gpus)) == ["cuda:0", "cuda:1"], dm
    inp = _inputs("cuda:0")
    ref = _generate(m, inp, 100).sequences.cpu()
    hf.wrap(m, device_limit=["64MiB", "64MiB"], kv_device_limit=["2MiB", "2MiB"], host_limit="256MiB")
    out = _generate(m, inp, 100)
    assert torch.equal(out.sequences.cpu(), ref)
    s = hf.stats(m)
    assert s["hf"]["layer_gpus"] == layer_gpus
    for g in ("cuda:0", "cuda:1"):
        assert s["gpus"][g]["kv"]["host_bytes"] > 0 and s["gpus"][g]["kv"]["device_bytes"] <= 2 * MiB, g
    c = returned_cache(out)
    for i, layer in enumerate(c.kv_layers()):
        assert str(layer.keys.device) == layer_gpus[i]
    del out, c
    hf.unwrap(m)
    gc.collect()
    torch.cuda.empty_cache()


def _cb_prompts(n=4, base=200, step=13):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (base + step * i,), generator=g).tolist() for i in range(n)]


def _greedy(model, ps, n, device):
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device=device), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in ps]


def _generate_batch(model, ps, n):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gcfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=128, max_batch_tokens=256)
    out = model.generate_batch(ps, generation_config=gcfg, continuous_batching_config=cfg)
    return [o.generated_tokens for o in out.values()]


def test_continuous_batching_per_gpu_path_on_one_gpu():
    """generate_batch on a model dispatched onto cuda:0, per-GPU options as lists of one: its paged cache past a
    2 MiB KV budget on the host tier, tokens those of the unwrapped model's greedy generate()."""
    from accelerate import dispatch_model

    m = dispatch_model(_model(), device_map={"": 0})
    ps = _cb_prompts()
    ref = _greedy(m, ps, 8, "cuda:0")
    hf.wrap(m, device_limit=["64MiB"], kv_device_limit=["2MiB"], host_limit={"cuda:0": "256MiB"})
    assert _generate_batch(m, ps, 8) == ref
    cb = hf.stats(m)["hf"]["continuous_batching"]
    assert cb["tiered"] is True
    assert cb["counters"]["peak_kv_host_bytes"] > 0 and 0 < cb["counters"]["peak_kv_device_bytes"] <= 2 * MiB
    hf.unwrap(m)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_continuous_batching_on_several_gpus():
    """generate_batch on a model dispatched over 2 GPUs: one paged-cache extent per GPU, each spilling to its
    own host tier past a 2 MiB KV budget; tokens those of the unwrapped model's greedy generate()."""
    from accelerate import dispatch_model

    from tests.helpers.sim_dispatch import accelerate_device_map

    m = _model()
    dm = accelerate_device_map(m, 2)
    m = dispatch_model(m, device_map=dm)
    ps = _cb_prompts()
    ref = _greedy(m, ps, 8, "cuda:0")
    hf.wrap(m, device_limit=["64MiB", "64MiB"], kv_device_limit=["2MiB", "2MiB"], host_limit="256MiB")
    assert _generate_batch(m, ps, 8) == ref
    cb = hf.stats(m)["hf"]["continuous_batching"]
    assert cb["tiered"] is True and sorted(cb["cache"]["gpus"]) == ["cuda:0", "cuda:1"]
    for g in ("cuda:0", "cuda:1"):
        peak = cb["counters"]["per_gpu"][g]
        assert peak["peak_kv_host_bytes"] > 0 and 0 < peak["peak_kv_device_bytes"] <= 2 * MiB, (g, peak)
    hf.unwrap(m)
    gc.collect()
    torch.cuda.empty_cache()
