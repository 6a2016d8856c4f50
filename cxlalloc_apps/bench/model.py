"""Llama-shaped models with random weights, their byte counts, the
link-bound ceiling model, and a saved tiny chat Llama for the servers.

Shapes follow the public Llama 3.2 1B / 3B and Llama 3.1 8B configurations
(hidden size, layers, heads, KV heads, head dim, MLP width), with a 32,000
token vocabulary (Llama 2's) instead of 128,256: the vocabulary only sizes
the embedding and the logits, and a smaller one keeps the prefill's logits
out of the way.  Weights are random (``std`` 0.02, transformers' default
init) in bf16; no checkpoint is downloaded (the device machine has no
network).  ``tiny`` is a 2-layer toy for the CPU simulation.

The ceiling model (one decode step, every byte read once)::

    t_step  = bytes_on_device / hbm_read_bw + bytes_on_host / link_read_bw   [s]
    bytes_on_device = weights + (1 - f) * kv      bytes_on_host = f * kv
    ceiling tokens/s = batch / t_step

``f`` is the fraction of the KV cache on the host tier, ``kv`` the live KV
bytes at mid-decode (batch x (context + new/2) tokens), ``hbm_read_bw`` the
measured GPU-kernel read rate of device memory and ``link_read_bw`` the
measured GPU-kernel (zero-copy) read rate of host-tier memory (ceilings
benchmark).  It ignores compute, launch and framework overhead, so measured
tokens/s sit below it; the gap is what overheads and placement cost.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama-architecture shape (``LlamaConfig`` fields)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 32000
    tie_embeddings: bool = True

    def params(self) -> int:
        """Parameter count (embeddings tied unless ``tie_embeddings`` is False)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        mlp = 3 * h * self.intermediate
        norms = 2 * h
        emb = self.vocab * h * (1 if self.tie_embeddings else 2)
        return self.layers * (attn + mlp + norms) + emb + h

    def weight_bytes(self, elem: int = 2) -> int:
        """Bytes of all weights at ``elem`` bytes per parameter (bf16: 2)."""
        return self.params() * elem

    def kv_bytes_per_token(self, elem: int = 2) -> int:
        """K + V bytes of one token over all layers (one sequence)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def kv_bytes(self, batch: int, tokens: int, elem: int = 2) -> int:
        return batch * tokens * self.kv_bytes_per_token(elem)

    def to_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d["params"] = self.params()
        d["weight_bytes_bf16"] = self.weight_bytes()
        d["kv_bytes_per_token_bf16"] = self.kv_bytes_per_token()
        return d


SHAPES: Dict[str, Shape] = {
    # Llama 3.2 1B shapes (head_dim 64), ~1.1B params with a 32k vocabulary.
    "llama-1b": Shape("llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192),
    # Llama 3.2 3B shapes, ~3.2B params.
    "llama-3b": Shape("llama-3b", hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, intermediate=8192),
    # Llama 3.1 8B shapes (untied embeddings), ~7.5B params with a 32k vocabulary.
    "llama-8b": Shape("llama-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                      tie_embeddings=False),
    # CPU simulation toy.
    # CPU simulation toy: 4 layers, ~2.8M params; at fp32 its KV is 8 KiB per token, so a 4 x 512 context
    # spans several 2 MiB extent chunks and spill fractions are meaningful.
    "tiny": Shape("tiny", hidden=256, layers=4, heads=4, kv_heads=4, head_dim=64, intermediate=512, vocab=512),
}


def llama_config(shape: Shape, max_positions: int = 65536):
    """A ``transformers.LlamaConfig`` of ``shape`` (sdpa attention)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                       max_position_embeddings=max_positions, tie_word_embeddings=shape.tie_embeddings,
                       rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       attn_implementation="sdpa")


def build_model(shape: Shape, device: str = "cuda", dtype=None, seed: int = 0, max_positions: int = 65536):
    """A ``LlamaForCausalLM`` of ``shape`` with random weights, built directly on
    ``device`` (weights are created there, so in cxlalloc's global mode they
    come from cxlalloc), in eval mode.  ``dtype`` defaults to bf16."""
    import torch
    from transformers import LlamaForCausalLM

    dtype = dtype or torch.bfloat16
    torch.manual_seed(seed)
    cfg = llama_config(shape, max_positions)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.to(dtype)
    model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # never stop early: every run decodes the same number of tokens
    return model


CHAT_SPECIAL = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
"""The special tokens of :func:`save_chat_llama`'s tokenizer, ids 0-3 (pad, unknown, begin, end of a turn)."""

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
"""The ChatML-like chat template of :func:`save_chat_llama`'s tokenizer (words separated by spaces)."""


def save_chat_llama(path: str, words: Sequence[str], *, newline: bool = False, **config):
    """Save a tiny Llama (random weights after ``torch.manual_seed(0)``, fp32) with a word-level tokenizer and a
    chat template into ``path`` (``save_pretrained``; nothing downloaded), for ``transformers serve`` and
    ``cxlalloc serve``.

    The vocabulary: :data:`CHAT_SPECIAL` (ids 0-3), then ``"\\n"`` if ``newline``, then ``user``, ``assistant``,
    ``system``, then ``words`` in order.  Word-level: one whitespace-separated word is one token, and every token
    decodes to a whole word, so streamed text and decoded tokens compare exactly; a word not in the vocabulary is
    ``<unk>``.  ``config``: ``LlamaConfig`` fields (sizes, ``max_position_embeddings``...); ``vocab_size`` and the
    pad/bos/eos ids are set here.  The model's generation config is greedy.

    Returns ``(model, tokenizer)``: the ``LlamaForCausalLM`` saved (training mode, as built) and its
    ``PreTrainedTokenizerFast``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(list(CHAT_SPECIAL) + (["\n"] if newline else [])
                                        + ["user", "assistant", "system"] + list(words))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, vocab_size=len(vocab), pad_token_id=0, bos_token_id=2,
                                         eos_token_id=3))
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def ceiling_tokens_per_s(batch: int, weight_bytes: int, kv_bytes: int, host_fraction: float,
                         hbm_gbps: Optional[float], link_gbps: Optional[float]) -> Optional[float]:
    """Link-bound decode ceiling in tokens/s (see the module docstring).

    Args:
        batch: sequences decoded per step (tokens per step).
        weight_bytes: bytes of weights read per step (all on the device).
        kv_bytes: live KV bytes read per step.
        host_fraction: fraction of ``kv_bytes`` on the host tier (0..1).
        hbm_gbps: device-memory read rate, GB/s (1e9 bytes/s).
        link_gbps: host-tier read rate over the link, GB/s.

    Returns:
        tokens/s, or None when a needed bandwidth is unknown.
    """
    if not hbm_gbps or hbm_gbps <= 0:
        return None
    f = min(max(float(host_fraction), 0.0), 1.0)
    t = (weight_bytes + (1.0 - f) * kv_bytes) / (hbm_gbps * 1e9)
    if f > 0:
        if not link_gbps or link_gbps <= 0:
            return None
        t += f * kv_bytes / (link_gbps * 1e9)
    return batch / t if t > 0 else None
