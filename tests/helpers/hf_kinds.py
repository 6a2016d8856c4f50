"""Tiny random models of each cache layer kind (transformers 5.24 configs), for
the layer-kind tests (tests/hf/test_hf_sliding.py, test_hf_layer_kinds.py,
test_hf_encdec.py, test_hf_coverage_warning.py)."""

from __future__ import annotations

import warnings

from tests.helpers.hf_util import _seeded, assert_same, gen, padded_batch, torch  # noqa: F401

import transformers as T  # noqa: E402

# generate() modes every kind is checked under (tokens and scores identical to unwrapped).
MODES = {"greedy": {}, "beam": dict(num_beams=2), "sample": dict(do_sample=True, top_k=20),
         "beam_return2": dict(num_beams=2, num_return_sequences=2)}


@_seeded
def tiny_mistral(window=4, layers=2):
    """Every layer sliding (window 4): DynamicSlidingWindowLayer x layers."""
    return T.MistralForCausalLM(T.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, sliding_window=window))


def tiny_gemma2(attn="eager", **kw):
    """[sliding, full, sliding, full] (eager attention: Gemma 2's softcap is not in sdpa)."""
    return _gemma2(attn=attn, **kw)


@_seeded
def _gemma2(window=5):
    return T.Gemma2ForCausalLM(T.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=1000, sliding_window=window))


@_seeded
def tiny_gemma3(window=4):
    """Gemma 3 text: 5 sliding layers then 1 full (sliding_window_pattern 6)."""
    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=1000, sliding_window=window))


@_seeded
def tiny_cohere2(window=4):
    """Cohere2: sliding layers with a full layer every 4th."""
    return T.Cohere2ForCausalLM(T.Cohere2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, sliding_window=window))


@_seeded
def tiny_deepseek_v32():
    """DeepSeek-V3.2 (DSA): DynamicIndexedLayer x 2 (MLA latents + indexer keys)."""
    return T.DeepseekV32ForCausalLM(T.DeepseekV32Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=1000, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_n_heads=2,
        index_head_dim=16, index_topk=4, first_k_dense_replace=1))


@_seeded
def tiny_falcon_h1():
    """Falcon-H1: LinearAttentionAndFullAttentionLayer x 2 (attention + Mamba-2 in each layer)."""
    return T.FalconH1ForCausalLM(T.FalconH1Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16))


@_seeded
def tiny_minimax():
    """MiniMax (lightning attention): its own MiniMaxCache, made inside forward()."""
    return T.MiniMaxForCausalLM(T.MiniMaxConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, num_local_experts=2, num_experts_per_tok=1, head_dim=16))


@_seeded
def tiny_mamba():
    """Mamba: LinearAttentionLayer x 2 (fixed-size SSM/conv state only)."""
    return T.MambaForCausalLM(T.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=1000, state_size=8))


@_seeded
def tiny_t5():
    return T.T5ForConditionalGeneration(T.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=1000, decoder_start_token_id=0))


@_seeded
def tiny_bart():
    return T.BartForConditionalGeneration(T.BartConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000))


@_seeded
def tiny_whisper():
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100, num_mel_bins=8, max_source_positions=16,
        max_target_positions=64, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None))


def check_modes(model, inp, new=10, modes=MODES):
    """generate() in every mode unwrapped (references) — call before wrap()."""
    return {k: gen(model, **inp, **kw, max_new_tokens=new, min_new_tokens=new) for k, kw in modes.items()}


def no_cxlalloc_warnings():
    """A context in which any cxlalloc.hf warning is an error."""
    from cxlalloc.hf import CacheCoverageWarning

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", CacheCoverageWarning)
    return ctx


@_seeded
def tiny_xlnet():
    """XLNet: its own memory (mems, a tuple of per-layer hidden states that grows)."""
    return T.XLNetLMHeadModel(T.XLNetConfig(d_model=32, n_layer=2, n_head=2, d_inner=64, vocab_size=1000))


@_seeded
def tiny_rwkv():
    """RWKV: its own recurrent state (a list of 5 fixed-size tensors)."""
    return T.RwkvForCausalLM(T.RwkvConfig(hidden_size=32, num_hidden_layers=2, vocab_size=1000,
                                          attention_hidden_size=32, intermediate_size=64, context_length=64))
