#!/usr/bin/env python
"""Coverage matrix of cxlalloc.hf over every generative architecture of the installed transformers.

For each entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES`` (transformers
``models/auto/modeling_auto.py``) this builds a tiny random model (the config
class's defaults, shrunk: hidden 64, 2 layers or as many as the layer pattern
needs, 4 heads, vocab 512, sliding window 8), runs ``generate()`` four ways --
greedy, beam search (``num_beams=2``), seeded sampling and a left-padded batch
of two prompts -- first unwrapped (plain transformers), then wrapped with
:func:`cxlalloc.hf.wrap` on the simulated driver with a device budget of the
weights plus one KV chunk (so the KV cache spills and demotes to the host
tier), and records:

* per run: identical tokens (and scores) to plain transformers, the error if any;
* the cache class and its layers by kind, tiered (a cxlalloc layer class) or
  untiered, and whether each untiered layer's memory grows with the context
  (measured: its bytes after a longer run exceed those after a shorter one);
* KV bytes per tier (the allocator's ``kv`` class: device / host) and the
  bytes of untiered layers (torch memory);
* the warnings cxlalloc emitted during wrap/generate;
* ``silent``: cxlalloc said nothing and a layer whose KV grows is untiered,
  or the tiers held 0 B of KV although KV grows or ``hf.stats()`` lists
  tiered layers (:func:`judge`: bytes held, not the stats' claims) -- the
  case the matrix exists to rule out.  ``--rejudge`` applies it to a saved
  JSON without running anything.

Architectures run in worker processes (``--jobs N`` at a time, a fresh
process every ``--per-process K`` architectures, ``--timeout`` seconds each);
a crash or a hang kills only that worker and is one row, not the run.
The JSON (``--out``) is written after every architecture; a rerun skips the
architectures already in it unless ``--force``.  ``--markdown`` writes the
table for the docs.

    python scripts/coverage_matrix.py                      # everything (make coverage)
    python scripts/coverage_matrix.py --sample             # the CI sample
    python scripts/coverage_matrix.py --arch llama --arch causal/t5 --force

The simulated GPU's VMM granularity is set to 4 KiB (it is 2 MiB on current
GPUs) so that a tiny model's KV spans several chunks and spills; placement and
demotion are the real engine's.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- settings
KINDS = ("causal", "seq2seq", "speech")
MAPPINGS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}
# The CI sample (tests/hf/test_coverage_sample.py): one of each cache layer kind.
SAMPLE = ("causal/llama", "causal/gpt2", "causal/mistral", "causal/gemma2", "causal/gemma3_text", "causal/qwen3",
          "causal/falcon_h1", "causal/mamba", "causal/deepseek_v32", "causal/minimax", "seq2seq/t5", "seq2seq/bart")

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
VOCAB = 512
LAYERS = 2
WINDOW = 8  # sliding window / attention chunk: below the prompt length, so windows are exercised
EXPERTS = 4
MAX_PARAMS = 20_000_000  # above this a "tiny" model is not tiny: a row with the reason instead of a slow run
PROMPT = 12
NEW_TOKENS = 10
SHORT = (10, 2)  # (prompt, new tokens) of the shorter run that tells growing layers from bounded ones
CHUNK = 4096  # the simulated VMM granularity = KV extent chunk
KV_DEVICE_CHUNKS = 1  # device budget = the weights + this many KV chunks: a KV cache of 2+ chunks spills
SIM_VRAM = 16 << 30
RUNS = ("greedy", "beam", "sample", "padded")
DEFAULT_TIMEOUT = 300

# Config keys shrunk when present: (target, keys); a value above the target becomes the target.
SHRINK = (
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "dim", "model_dim", "embed_dim", "hidden_dim", "word_embed_proj_dim",
             "n_embed", "emb_dim")),
    (HEADS, ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
            "n_heads", "decoder_num_attention_heads", "num_decoder_attention_heads", "linear_num_heads")),
    (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_groups")),
    (HEAD_DIM, ("head_dim", "attention_head_dim", "d_kv", "v_head_dim", "qk_nope_head_dim", "kv_channels",
               "index_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim")),
    (8, ("qk_rope_head_dim", "rotary_dim")),
    (32, ("kv_lora_rank", "q_lora_rank")),
    (INTERMEDIATE, ("intermediate_size", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                   "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                   "expert_intermediate_size", "mlp_dim", "decoder_intermediate_size", "moe_ffn_hidden_size",
                   "dense_intermediate_size")),
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")),
    (2, ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "index_n_heads", "linear_num_key_heads",
         "moe_k", "num_experts_per_token")),
    (1, ("n_shared_experts", "n_group", "topk_group", "num_shared_experts", "first_k_dense_replace",
         "moe_num_shared_experts", "num_expert_group")),
    (16, ("state_size", "ssm_state_size", "mamba_d_state", "d_state", "index_topk_tokens")),
    (VOCAB, ("vocab_size",)),
    (WINDOW, ("sliding_window", "attention_chunk_size", "window_size", "attention_window_size", "index_topk")),
    (2048, ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length")),
    (64, ("max_source_positions",)),
)
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "num_encoder_layers", "decoder_num_layers")
# Per-architecture config changes where the generic shrink is not enough (applied last, to the top config).
OVERRIDES: Dict[str, dict] = {
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_dt_rank=8),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16),
    "mamba": dict(time_step_rank=8),
    "falcon_mamba": dict(time_step_rank=8),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "bamba": dict(attn_layer_indices=[1]),  # the default config has no attention layer
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),  # likewise
    "recurrent_gemma": dict(num_hidden_layers=3),  # block_types cycles recurrent, recurrent, attention
}


# ----------------------------------------------------------------------------- architecture list
def architectures() -> List[str]:
    """Row ids ``"<kind>/<model_type>"`` of every entry of the three mappings of
    the installed transformers, in mapping order (kind: causal, seq2seq, speech)."""
    from transformers.models.auto import modeling_auto

    out = []
    for kind in KINDS:
        for arch in getattr(modeling_auto, MAPPINGS[kind]):
            out.append(f"{kind}/{arch}")
    return out


def select(ids: Iterable[str], patterns: Optional[List[str]]) -> List[str]:
    """``ids`` matching ``--arch`` values (a full id ``kind/arch`` or a bare
    model type, which selects it in every mapping)."""
    ids = list(ids)
    if not patterns:
        return ids
    out = [i for i in ids if i in patterns or i.split("/", 1)[1] in patterns]
    unknown = [p for p in patterns if not any(p == i or p == i.split("/", 1)[1] for i in ids)]
    if unknown:
        raise SystemExit(f"coverage_matrix: --arch {', '.join(unknown)}: not an architecture of transformers' "
                         f"generative mappings; use a model type such as 'llama' or an id such as 'seq2seq/t5' "
                         f"(--list shows all {len(ids)})")
    return out


# ----------------------------------------------------------------------------- tiny configs
def _shrink_dict(d: dict, depth: int = 0) -> None:
    heads0 = d.get("num_attention_heads")
    mha = heads0 is not None and d.get("num_key_value_heads") == heads0  # keep multi-head (MLA needs it)
    rope_head = d.get("head_dim") is not None and d.get("head_dim") == d.get("qk_rope_head_dim")  # MLA's rope dim
    for target, keys in SHRINK:
        for k in keys:
            v = d.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > target:
                d[k] = target
    if mha:
        d["num_key_value_heads"] = d["num_attention_heads"]
    if rope_head:
        d["head_dim"] = d["qk_rope_head_dim"]
    _shrink_layers(d)
    _fix_token_ids(d)
    for k, v in list(d.items()):
        if isinstance(v, dict) and depth < 3 and ("model_type" in v or k.endswith("_config") or k in (
                "encoder", "decoder")):
            _shrink_dict(v, depth + 1)


def _shrink_layers(d: dict) -> None:
    """Fewest layers that keep every layer kind: the first layer of each kind
    of the per-layer pattern (``layer_types`` or a similar list), and at least
    ``LAYERS``; every per-layer list is cut at the same indices."""
    keys = [k for k in LAYER_KEYS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)]
    n = max((d[k] for k in keys), default=None)
    lists = {}
    if n:
        for k, v in d.items():
            if (isinstance(v, (list, str)) and len(v) == n and n > 1 and k not in ("architectures",)
                    and ((n >= 6 and isinstance(v, list))
                         or any(w in k for w in ("layer", "block", "types", "pattern")))):
                lists[k] = v
    primary = next((lists[k] for k in ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types")
                    if k in lists), None)
    if primary is None and lists:
        primary = next(iter(lists.values()))
    if primary is not None:
        first: Dict[Any, int] = {}
        for i, kind in enumerate(primary):
            first.setdefault(kind, i)
        idx = sorted(first.values())
        i = 0
        while len(idx) < min(LAYERS, n):
            if i not in idx:
                idx.append(i)
            i += 1
        idx.sort()
        for k, v in lists.items():
            cut = [v[j] for j in idx]
            d[k] = "".join(cut) if isinstance(v, str) else cut
        per = d.get("per_layer_config")
        if isinstance(per, dict) and per:  # {layer index: overrides}: the same layers, renumbered
            d["per_layer_config"] = {new: per[old] for new, old in enumerate(idx) if old in per or str(old) in per
                                     for old in [old if old in per else str(old)]}
        for k in keys:
            if d[k] == n:
                d[k] = len(idx)
    else:
        for k in keys:
            if d[k] > LAYERS:
                d[k] = LAYERS


def _fix_token_ids(d: dict) -> None:
    vocab = d.get("vocab_size")
    if not isinstance(vocab, int):
        return
    fixed = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
    spare = vocab - 1
    for k, v in list(d.items()):
        if not (k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("_token_ids")):
            continue
        if isinstance(v, list):
            kept = [x for x in v if isinstance(x, int) and x < vocab]
            d[k] = kept or [fixed.get(k, 2)]
        elif isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
            if k in fixed:
                d[k] = fixed[k]
            else:
                d[k], spare = spare, spare - 1
    for k in ("begin_suppress_tokens", "suppress_tokens"):
        if isinstance(d.get(k), list):
            d[k] = [x for x in d[k] if isinstance(x, int) and x < vocab]


def tiny_config(arch: str, whole: bool = False):
    """The config class's defaults for model type ``arch``, shrunk to a tiny model
    (see the module docstring), with ``OVERRIDES[arch]``.  The constructor gets
    the changed keys only (it derives the rest as it does by default), or with
    ``whole`` every key of the default config's ``to_dict()``."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[arch]
    default = cls().to_dict()
    d = copy.deepcopy(default)
    _shrink_dict(d)
    d.update(OVERRIDES.get(arch, {}))
    if d.get("is_encoder_decoder") is not True and "is_decoder" in d:
        d["is_decoder"] = True  # BERT-like models in the causal-LM mapping need it to generate
    # Only the changed keys (a sub-config as a whole dict): the constructor derives the rest as it does by default.
    if whole:
        for k in ("architectures", "transformers_version", "_name_or_path", "model_type", "auto_map"):
            d.pop(k, None)
        return cls(**d)
    return cls(**{k: v for k, v in d.items() if k not in default or v != default[k]})


def model_class(row_id: str):
    import transformers
    from transformers.models.auto import modeling_auto

    kind, arch = row_id.split("/", 1)
    name = getattr(modeling_auto, MAPPINGS[kind])[arch]
    if isinstance(name, (list, tuple)):
        name = name[0]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(f"transformers has no class {name} (optional dependency missing?)")
    return cls


def build(row_id: str, seed: int = 0):
    """A tiny random model for ``row_id`` in eval mode (float32, CPU, sdpa where
    supported).  Raises with the reason when it cannot be built tiny."""
    import torch

    cls = model_class(row_id)
    arch = row_id.split("/", 1)[1]
    try:
        cfg = tiny_config(arch)
        with torch.device("meta"):
            meta = cls(cfg)
    except Exception as first:
        try:
            cfg = tiny_config(arch, whole=True)
            with torch.device("meta"):
                meta = cls(cfg)
        except Exception:
            raise first from None
    n = sum(p.numel() for p in meta.parameters())
    del meta
    if n > MAX_PARAMS:
        raise ValueError(f"not tiny after shrinking the config: {n / 1e6:.1f}M parameters (limit "
                         f"{MAX_PARAMS / 1e6:.0f}M); needs an entry in OVERRIDES")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    return model, n


# ----------------------------------------------------------------------------- inputs and runs
def _inputs(model, kind: str, batch: int, length: int, padded: bool) -> dict:
    import torch

    cfg = model.config
    g = torch.Generator().manual_seed(1 + length)
    if kind == "speech" or getattr(model, "main_input_name", "input_ids") == "input_features":
        enc = getattr(cfg, "encoder", cfg)
        bins = getattr(cfg, "num_mel_bins", None) or getattr(enc, "num_mel_bins", None) or getattr(
            cfg, "feature_size", 80)
        frames = 2 * (getattr(cfg, "max_source_positions", None) or 32)
        feats = torch.randn(batch, bins, frames, generator=g)
        return {"input_features": feats}
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    vocab = min(getattr(text, "vocab_size", None) or VOCAB, VOCAB)
    ids = torch.randint(3, max(4, vocab - 16), (batch, length), generator=g)
    am = torch.ones_like(ids)
    if padded and batch > 1:
        am[1, :4] = 0
        ids[1, :4] = _pad_id(model)
    return {"input_ids": ids, "attention_mask": am}


def _pad_id(model) -> int:
    for c in (model.generation_config, model.config):
        v = getattr(c, "pad_token_id", None)
        if isinstance(v, int):
            return v
    return 0


def _generate(model, kind: str, run: str, prompt: int = PROMPT, new: int = NEW_TOKENS):
    import torch

    batch = 2 if run == "padded" else 1
    inp = _inputs(model, kind, batch, prompt, run == "padded")
    kw = dict(max_new_tokens=new, min_new_tokens=new, return_dict_in_generate=True, output_scores=True,
              pad_token_id=_pad_id(model), do_sample=False, num_beams=1)
    if run == "beam":
        kw["num_beams"] = 2
    elif run == "sample":
        kw.update(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    if getattr(model.config, "is_encoder_decoder", False) and getattr(model.generation_config,
                                                                      "decoder_start_token_id", None) is None:
        kw["decoder_start_token_id"] = getattr(model.config, "decoder_start_token_id", None) or _pad_id(model)
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(**inp, **kw)


def _same(ref, out) -> Tuple[bool, bool]:
    import torch

    tokens = ref.sequences.shape == out.sequences.shape and torch.equal(ref.sequences, out.sequences)
    scores = tokens and len(ref.scores) == len(out.scores) and all(
        torch.equal(a, b) for a, b in zip(ref.scores, out.scores))
    return bool(tokens), bool(scores)


def _err(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:400]


# ----------------------------------------------------------------------------- cache inspection
def _tensor_bytes(obj, depth: int = 0) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if obj.device.type != "meta" else 0
    if depth < 2 and isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, depth + 1) for x in obj)
    if depth < 2 and isinstance(obj, dict):
        return sum(_tensor_bytes(x, depth + 1) for x in obj.values())
    return 0


def kv_in_tiers(row: dict) -> bool:
    """Whether the allocator's KV class held bytes during the wrapped greedy run
    (its peak: the tiered layers' extents, even if the cache was dropped after)."""
    return (row.get("kv_peak_bytes") or 0) > 0


def judge(row: dict) -> dict:
    """Set ``silent``, ``coverage`` and ``spilled`` of a row from the bytes
    the tiers actually held, never from what ``hf.stats()`` claims.

    Silent (no cxlalloc warning, and): a layer whose KV grows is untiered; or
    KV grows and the allocator's KV class held 0 bytes; or ``hf.stats()``
    reports tiered layers while the tiers held 0 bytes of KV (the model kept
    its KV elsewhere: its returned cache may show nothing, as MPT's is None).
    Used by every run and by ``--rejudge`` on a saved JSON."""
    growing_untiered = (row.get("layers") or {}).get("untiered_growing") or {}
    tiered = (row.get("layers") or {}).get("tiered") or {}
    rep = row.get("reported_layers") if isinstance(row.get("reported_layers"), dict) else {}
    claimed = sum((rep.get("tiered") or {}).values()) if isinstance(rep.get("tiered"), dict) else 0
    held = kv_in_tiers(row)
    unbacked = row.get("status") == "ok" and not held and (bool(row.get("kv_grows")) or claimed > 0)
    row["silent"] = (bool(growing_untiered) or unbacked) and not row.get("warned")
    row["spilled"] = (row.get("kv_host_bytes") or 0) > 0
    if unbacked:
        row["coverage"] = "untiered"
        note = (f"judged on bytes: 0 B of KV in the tiers although hf.stats() reports {claimed} tiered layers"
                if claimed else "judged on bytes: KV grows and 0 B of it was in the tiers")
        if note not in row.setdefault("notes", []):
            row["notes"].append(note)
    else:
        row["coverage"] = ("none-needed" if not row.get("kv_grows") else "all-tiered" if not growing_untiered
                           else "partly-tiered" if tiered else "untiered")
    return row


def cache_layers(cache) -> List[Tuple[str, Any]]:
    """``(role, layer)`` of every layer of a generate() cache: role ``""`` for a
    decoder-only cache, ``"self"``/``"cross"`` for an ``EncoderDecoderCache``;
    a cache without ``layers`` (model-specific) is one entry of itself."""
    if cache is None:
        return []
    if hasattr(cache, "self_attention_cache") and hasattr(cache, "cross_attention_cache"):
        return ([("self", x) for _, x in cache_layers(cache.self_attention_cache)]
                + [("cross", x) for _, x in cache_layers(cache.cross_attention_cache)])
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)):
        return [("", x) for x in layers]
    if isinstance(cache, (list, tuple)):  # legacy tuple of (k, v) per layer
        return [("", x) for x in cache]
    return [("", cache)]


def is_tiered(layer) -> bool:
    """A layer whose memory lives in cxlalloc: a layer class of the cxlalloc package."""
    return type(layer).__module__.startswith("cxlalloc.")


def layer_kind(role: str, layer) -> str:
    name = type(layer).__name__
    return f"{role}:{name}" if role else name


def layer_bytes(layer) -> int:
    """Bytes of the tensors an untiered layer holds (torch memory)."""
    if isinstance(layer, (list, tuple)):
        return _tensor_bytes(layer)
    return _tensor_bytes(getattr(layer, "__dict__", {}), 0)


def growth(long_cache, short_cache) -> List[bool]:
    """Per layer: its bytes after the longer run exceed those after the shorter
    one (KV that grows with the context; a sliding window, a recurrent state or
    an empty layer does not)."""
    a, b = cache_layers(long_cache), cache_layers(short_cache)
    out = []
    for i, (_, layer) in enumerate(a):
        short = layer_bytes(b[i][1]) if i < len(b) else 0
        out.append(layer_bytes(layer) > short)
    return out


# ----------------------------------------------------------------------------- one architecture
def configure_sim() -> None:
    """Configure the simulated GPU for the matrix (VRAM 16 GiB, 4 KiB VMM
    granularity).  Call before any simulated allocator exists in the process.

    Raises:
        ValueError: simulated resources are alive.
    """
    from cxlalloc import _sim, engine

    _sim.Sim().configure(f"vram={SIM_VRAM},granularity={CHUNK}")
    engine._sim_vram = SIM_VRAM  # ensure_sim() keeps this configuration (as tests/conftest.py does)


def weight_footprint(model) -> int:
    """Device bytes reserved for the model's weights in a simulated allocator."""
    import cxlalloc.hf as hf

    hf.wrap(model, device_limit=512 << 20, host_limit=64 << 20)
    try:
        return int(hf.stats(model)["device"]["reserved_bytes"])
    finally:
        hf.unwrap(model)
        gc.collect()


def _cxl_warnings(records) -> List[dict]:
    out, seen = [], set()
    for w in records:
        cat = w.category
        msg = str(w.message)
        if not (cat.__module__.startswith("cxlalloc") or msg.startswith("cxlalloc")):
            continue
        key = (cat.__name__, msg)
        if key not in seen:
            seen.add(key)
            out.append({"category": cat.__name__, "message": msg[:600]})
    return out


def run_arch(row_id: str) -> dict:
    """Everything the matrix records for one architecture (see the module
    docstring); never raises for a model that fails: the failure is in the row
    (``status``: ``ok``, ``mismatch``, ``wrapped-error``, ``not-built`` or
    ``fails-unwrapped``).  The simulated GPU must be configured
    (:func:`configure_sim`) before the first call in a process."""
    import torch
    from transformers.utils import logging as hf_logging

    import cxlalloc.hf as hf

    hf_logging.set_verbosity_error()
    kind, arch = row_id.split("/", 1)
    row: Dict[str, Any] = {"id": row_id, "kind": kind, "arch": arch, "status": "ok", "runs": {}, "notes": [],
                           "date": _now(), "transformers": versions()["transformers"]}
    t0 = time.perf_counter()
    try:
        cls = model_class(row_id)
        row["class"] = cls.__name__
        model, n = build(row_id)
        row["params"] = n
    except Exception as e:
        row.update(status="not-built", reason=_err(e), seconds=round(time.perf_counter() - t0, 1))
        return row
    # Plain transformers: the reference outputs, and the longer/shorter runs that tell growing layers apart.
    # sdpa first (what most users run), eager when the model's sdpa path fails (e.g. softcapping).
    for attn in ("sdpa", "eager"):
        refs: Dict[str, Any] = {}
        row["runs"] = {}
        try:
            model.set_attn_implementation(attn)
        except Exception:  # this model has no such path (no attention, or sdpa unsupported): the next one
            continue
        row["attention"] = attn
        for run in RUNS:
            try:
                refs[run] = _generate(model, kind, run)
            except Exception as e:
                row["runs"][run] = {"ran": False, "error": "transformers itself: " + _err(e)}
        if "greedy" in refs:
            break
    if "greedy" not in refs:
        row.update(status="fails-unwrapped", reason=row["runs"]["greedy"]["error"],
                   seconds=round(time.perf_counter() - t0, 1))
        return row
    ref_cache = hf.returned_cache(refs["greedy"])
    row["cache_unwrapped"] = type(ref_cache).__name__ if ref_cache is not None else None
    try:
        short_cache = hf.returned_cache(_generate(model, kind, "greedy", *SHORT))
        grows = growth(ref_cache, short_cache)
        del short_cache
    except Exception as e:
        grows = [layer_bytes(x) > 0 for _, x in cache_layers(ref_cache)]
        row["notes"].append(f"growth from bytes > 0 (the shorter run failed: {_err(e)})")

    # Wrapped: weights + one KV chunk of device budget, so the KV spills.
    records: List[Any] = []
    wrapped_cache = None
    try:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            fp = weight_footprint(model)
            row["device_limit"] = fp + KV_DEVICE_CHUNKS * CHUNK
            hf.wrap(model, device_limit=fp + KV_DEVICE_CHUNKS * CHUNK, host_limit=256 << 20)
            for run in RUNS:
                if run not in refs:
                    continue
                try:
                    out = _generate(model, kind, run)
                except Exception as e:
                    row["runs"][run] = {"ran": True, "tokens_identical": False, "error": "wrapped: " + _err(e)}
                    continue
                tokens, scores = _same(refs[run], out)
                row["runs"][run] = {"ran": True, "tokens_identical": tokens, "scores_identical": scores}
                if run == "greedy":
                    wrapped_cache = hf.returned_cache(out)
                    s = hf.stats(model)
                    # Where the KV bytes live: the allocator's kv class (every tiered layer's extents)...
                    row["kv_device_bytes"] = int(s["kv"]["device_bytes"])
                    row["kv_host_bytes"] = int(s["kv"]["host_bytes"])
                    row["kv_peak_bytes"] = int(s["kv"].get("peak_device_bytes", 0)) + int(
                        s["kv"].get("peak_host_bytes", 0))
                    row["spilled_bytes"] = int(s.get("spilled_bytes", 0))
                    row["demoted_bytes"] = int(s.get("demoted_bytes", 0))
                    # ... and the cache's own account of its extents' chunks (they must agree).
                    ks = wrapped_cache.kv_stats() if hasattr(wrapped_cache, "kv_stats") else None
                    if ks is not None:
                        row["cache_kv_bytes"] = {"device": int(ks["kv_device_bytes"]), "host": int(ks["kv_host_bytes"])}
                        if (row["cache_kv_bytes"]["device"], row["cache_kv_bytes"]["host"]) != (
                                row["kv_device_bytes"], row["kv_host_bytes"]):
                            row["notes"].append(f"the cache's kv_stats() {row['cache_kv_bytes']} differ from the "
                                                f"allocator's kv class bytes")
                    reported = (s.get("hf") or {}).get("layers")
                    if reported is not None:
                        row["reported_layers"] = reported
                del out
    except Exception as e:
        row["status"] = "wrapped-error"
        row["reason"] = "wrap: " + _err(e)
    row["warnings"] = _cxl_warnings(records)
    row["cache_wrapped"] = type(wrapped_cache).__name__ if wrapped_cache is not None else None

    # Layers of the wrapped greedy run's cache (the unwrapped one's when wrap failed).
    layers = cache_layers(wrapped_cache if wrapped_cache is not None else ref_cache)
    tiered: Dict[str, int] = {}
    untiered: Dict[str, int] = {}
    growing_untiered: Dict[str, int] = {}
    untiered_bytes = growing_bytes = 0
    for i, (role, layer) in enumerate(layers):
        k = layer_kind(role, layer)
        if is_tiered(layer):
            tiered[k] = tiered.get(k, 0) + 1
            continue
        untiered[k] = untiered.get(k, 0) + 1
        nb = layer_bytes(layer)
        untiered_bytes += nb
        if i < len(grows) and grows[i]:
            growing_untiered[k] = growing_untiered.get(k, 0) + 1
            growing_bytes += nb
    rep = row.get("reported_layers")
    if (wrapped_cache is not None and not type(wrapped_cache).__name__.startswith("Cxl") and isinstance(rep, dict)
            and isinstance(rep.get("tiered"), dict) and not rep.get("untiered")
            and sum(rep["tiered"].values()) == len(layers) and kv_in_tiers(row)):
        # The model's own generate() handed back a transformers copy of the cache it generated on
        # (Whisper re-stacks the returned EncoderDecoderCache): during generation every layer was
        # cxlalloc's, as hf.stats() and the allocator's KV bytes say; the copy is transformers' memory.
        row["notes"].append(f"generate() returned a {type(wrapped_cache).__name__} built from the tiered cache it "
                            f"generated on (hf.stats(): {sum(rep['tiered'].values())} layers tiered); that copy is "
                            "transformers' memory")
        tiered, untiered, growing_untiered = dict(rep["tiered"]), {}, {}
        untiered_bytes = growing_bytes = 0
    row["layers"] = {"tiered": tiered, "untiered": untiered, "untiered_growing": growing_untiered}
    row["untiered_bytes"] = untiered_bytes
    row["untiered_growing_bytes"] = growing_bytes
    row["kv_grows"] = bool(any(grows))
    row["warned"] = bool(row["warnings"])
    judge(row)
    if isinstance(rep, dict) and isinstance(rep.get("tiered"), dict):
        if sum(rep["tiered"].values()) != sum(tiered.values()):
            row["notes"].append(f"hf.stats() reports {sum(rep['tiered'].values())} tiered layers, the cache has "
                                f"{sum(tiered.values())}")
    if row["status"] == "ok":
        bad = [r for r, v in row["runs"].items() if v.get("ran") and not v.get("tokens_identical")]
        if any("error" in row["runs"][r] for r in bad):
            row["status"] = "wrapped-error"
            row["reason"] = "; ".join(f"{r}: {row['runs'][r]['error']}" for r in bad if "error" in row["runs"][r])
        elif bad:
            row["status"] = "mismatch"
            row["reason"] = "tokens differ: " + ", ".join(bad)
    del wrapped_cache, ref_cache, refs, layers
    try:
        if hf.is_wrapped(model):
            hf.unwrap(model)
    except Exception:
        pass
    del model
    gc.collect()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    if torch.get_num_threads() != 1:
        row["notes"].append(f"torch threads: {torch.get_num_threads()}")
    return row


# ----------------------------------------------------------------------------- the driver
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "cxlalloc"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _serve() -> int:
    """The worker process: one architecture id per stdin line, one JSON row per
    line on the protocol stream (the original stdout; anything a model prints
    goes to stderr)."""
    import torch

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)  # tiny models gain nothing from intra-op threads on a shared machine
    configure_sim()
    for line in sys.stdin:
        row_id = line.strip()
        if row_id:
            proto.write(json.dumps(run_arch(row_id)) + "\n")
            proto.flush()
    return 0


class Worker:
    """A child process running :func:`run_arch` for one architecture after
    another (``per_process`` of them, then a fresh process).  A crash or a hang
    is that architecture's row (``crashed`` / ``timeout``, the process is
    killed) and the next architecture gets a fresh process: no architecture
    can stop the run or see another's crash."""

    def __init__(self, per_process: int = 1):
        self.per_process = max(1, int(per_process))
        self.proc: Optional[subprocess.Popen] = None
        self.done = 0
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.err = None

    def _start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=env, cwd=REPO)
        self.lines = queue.Queue()
        self.done = 0
        out, lines = self.proc.stdout, self.lines

        def pump():
            for line in out:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.err is not None:
            self.err.close()
            self.err = None

    def _stderr_tail(self) -> str:
        try:
            self.err.seek(0)
            tail = [x for x in self.err.read().strip().splitlines() if x.strip()][-3:]
        except (OSError, ValueError, AttributeError):
            tail = []
        return " | ".join(tail)[-400:]

    def run(self, row_id: str, timeout: float) -> dict:
        if self.proc is None or self.done >= self.per_process:
            self.stop()
            self._start()
        kind, arch = row_id.split("/", 1)
        base = {"id": row_id, "kind": kind, "arch": arch, "runs": {}, "notes": []}
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(row_id + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            return dict(base, status="timeout", reason=f"no result within {timeout:g} s",
                        seconds=round(time.perf_counter() - t0, 1))
        except OSError:
            line = None
        if line is None:  # the process died
            self.proc.wait()
            reason = f"exit status {self.proc.returncode}: {self._stderr_tail()}"
            self.stop()
            return dict(base, status="crashed", reason=reason, seconds=round(time.perf_counter() - t0, 1))
        self.done += 1
        return json.loads(line)


def run_one_subprocess(row_id: str, timeout: float) -> dict:
    """:func:`run_arch` in a child process of its own (a crash or a hang is this
    row's status: ``crashed`` / ``timeout``)."""
    w = Worker(1)
    try:
        return w.run(row_id, timeout)
    finally:
        w.stop()


def load(path: str) -> dict:
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def save(path: str, doc: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- summary and markdown
def summarize(rows: Dict[str, dict]) -> dict:
    """Counts over the rows: archs, ran, all-tiered, partly-tiered, untiered,
    none-needed (no KV that grows), warned, silent (growing KV untiered and no
    cxlalloc warning), token mismatches/errors, not built, failing in
    transformers itself, crashed/timeout."""
    s = {"archs": len(rows), "ran": 0, "all_tiered": 0, "partly_tiered": 0, "untiered": 0, "none_needed": 0,
         "warned": 0, "silent_untiered": 0, "tokens_identical": 0, "mismatch": 0, "wrapped_error": 0,
         "not_built": 0, "fails_unwrapped": 0, "crashed": 0, "timeout": 0}
    for r in rows.values():
        st = r.get("status")
        if st in ("not-built", "fails-unwrapped", "crashed", "timeout"):
            s[st.replace("-", "_")] += 1
            continue
        s["ran"] += 1
        cov = r.get("coverage")
        if cov:
            s[cov.replace("-", "_")] += 1
        s["warned"] += bool(r.get("warned"))
        s["silent_untiered"] += bool(r.get("silent"))
        if st == "ok":
            s["tokens_identical"] += 1
        elif st == "mismatch":
            s["mismatch"] += 1
        else:
            s["wrapped_error"] += 1
    return s


def _fmt_kinds(d: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(d.items())) if d else "-"


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = int(n)
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _run_cell(v: Optional[dict]) -> str:
    if not v:
        return "-"
    if not v.get("ran"):
        return "n/a"
    if "error" in v:
        return "error"
    return "yes" if v.get("tokens_identical") else "**no**"


def markdown(doc: dict) -> str:
    """The docs page: versions, the summary, one row per architecture, then the
    reasons of the rows that did not run."""
    meta, rows = doc.get("meta", {}), doc.get("archs", {})
    s = summarize(rows)
    v = meta.get("versions", {})
    lines = [
        "# Coverage matrix: cxlalloc.hf over transformers' generative architectures",
        "",
        "Generated by `scripts/coverage_matrix.py` (`make coverage`); do not edit by hand.  For every entry of",
        "transformers' causal-LM, seq2seq and speech-seq2seq model mappings, a tiny random model (its config's",
        "defaults shrunk: hidden 64, 2 layers or one of each layer kind, vocab 512, sliding window 8) runs",
        f"`generate()` greedy, beam (2), seeded sampling and a left-padded batch of 2 ({PROMPT}-token prompts,",
        f"{NEW_TOKENS} new tokens), unwrapped and wrapped with `cxlalloc.hf.wrap` on the simulated driver with a",
        f"device budget of the weights + {KV_DEVICE_CHUNKS} KV chunk ({CHUNK // 1024} KiB), so the KV cache spills to the host",
        "tier.  *tokens identical*: the wrapped run's tokens equal plain transformers'.  *grows*: a layer's bytes",
        f"after {PROMPT}+{NEW_TOKENS} tokens exceed those after {SHORT[0]}+{SHORT[1]} (a sliding window, a recurrent",
        "state or an empty layer does not grow).  *silent*: cxlalloc emitted no warning and a growing layer is",
        "untiered, or the tiers held 0 B of KV while KV grows or hf.stats() lists tiered layers (judged on bytes",
        "held, never on the stats' claims) -- it must be 0.",
        "",
        f"transformers {v.get('transformers')}, torch {v.get('torch')}, cxlalloc {v.get('cxlalloc')}, "
        f"{meta.get('date', '?')} (last run: {meta.get('archs_last_run', '?')} architectures in "
        f"{meta.get('elapsed_s_last_run', '?')} s; each row has its own date).",
        "",
        "## Summary",
        "",
        "| | count |",
        "|---|---|",
        f"| architectures (mapping entries) | {s['archs']} |",
        f"| built and ran | {s['ran']} |",
        f"| all growing KV tiered | {s['all_tiered']} |",
        f"| partly tiered (some growing layers untiered) | {s['partly_tiered']} |",
        f"| growing KV untiered | {s['untiered']} |",
        f"| no KV that grows (recurrent state, windows only) | {s['none_needed']} |",
        f"| cxlalloc warned | {s['warned']} |",
        f"| **silent untiered** (growing KV untiered, no warning) | **{s['silent_untiered']}** |",
        f"| tokens identical in every run | {s['tokens_identical']} |",
        f"| tokens differ | {s['mismatch']} |",
        f"| error only when wrapped | {s['wrapped_error']} |",
        f"| not built tiny | {s['not_built']} |",
        f"| fails in plain transformers (with the tiny config) | {s['fails_unwrapped']} |",
        f"| crashed / timed out | {s['crashed']} / {s['timeout']} |",
        "",
        "## Architectures",
        "",
        "| id | class | cache | greedy | beam | sample | padded | tiered layers | untiered layers (growing) | "
        "KV device / host | untiered bytes | warnings | silent |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failed = []
    for rid in sorted(rows):
        r = rows[rid]
        if r.get("status") in ("not-built", "fails-unwrapped", "crashed", "timeout"):
            failed.append(r)
            continue
        lay = r.get("layers", {})
        grow = lay.get("untiered_growing", {})
        unt = ", ".join(f"{k} x{n}" + (f" ({grow[k]})" if k in grow else "") for k, n in
                        sorted(lay.get("untiered", {}).items())) or "-"
        warns = "; ".join(f"{w['category']}" for w in r.get("warnings", [])) or "-"
        runs = r.get("runs", {})
        lines.append(
            f"| {rid} | {r.get('class', '')} | {r.get('cache_wrapped') or r.get('cache_unwrapped') or '-'} | "
            + " | ".join(_run_cell(runs.get(x)) for x in RUNS)
            + f" | {_fmt_kinds(lay.get('tiered', {}))} | {unt} | "
            f"{_fmt_bytes(r.get('kv_device_bytes'))} / {_fmt_bytes(r.get('kv_host_bytes'))} | "
            f"{_fmt_bytes(r.get('untiered_bytes'))} | {warns} | {'**yes**' if r.get('silent') else 'no'} |")
    problems = [r for r in rows.values() if r.get("status") in ("mismatch", "wrapped-error")
                or any(not x.get("ran") for x in r.get("runs", {}).values())]
    if problems:
        lines += ["", "## Runs that did not run or differ", "", "| id | status | detail |", "|---|---|---|"]
        for r in sorted(problems, key=lambda r: r["id"]):
            detail = r.get("reason") or "; ".join(f"{k}: {x['error']}" for k, x in r.get("runs", {}).items()
                                                  if "error" in x)
            lines.append(f"| {r['id']} | {r.get('status')} | {_cell(detail)} |")
    noted = [r for r in rows.values() if r.get("notes")]
    if noted:
        lines += ["", "## Notes", "", "| id | note |", "|---|---|"]
        for r in sorted(noted, key=lambda r: r["id"]):
            for note in r["notes"]:
                lines.append(f"| {r['id']} | {_cell(note)} |")
    warned = [r for r in rows.values() if r.get("warnings")]
    if warned:
        lines += ["", "## Warnings", "", "| id | category | message |", "|---|---|---|"]
        for r in sorted(warned, key=lambda r: r["id"]):
            for w in r["warnings"]:
                lines.append(f"| {r['id']} | {w['category']} | {_cell(w['message'])} |")
    if failed:
        lines += ["", "## Not run", "", "| id | status | reason |", "|---|---|---|"]
        for r in sorted(failed, key=lambda r: r["id"]):
            lines.append(f"| {r['id']} | {r.get('status')} | {_cell(r.get('reason', ''))} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:300]


# ----------------------------------------------------------------------------- CLI
def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", action="append", metavar="ID",
                   help="only this architecture: a model type ('llama') or an id ('seq2seq/t5'); repeatable")
    p.add_argument("--sample", action="store_true", help=f"the CI sample ({len(SAMPLE)} architectures)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="architectures at a time (subprocesses)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds per architecture (default {DEFAULT_TIMEOUT})")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "coverage.json"), help="JSON results (resumable)")
    p.add_argument("--markdown", default=os.path.join(REPO, "docs", "coverage.md"), metavar="PATH",
                   help="markdown table ('' for none)")
    p.add_argument("--force", action="store_true", help="rerun architectures already in the JSON")
    p.add_argument("--rejudge", action="store_true", help="run nothing: judge every row of the JSON again "
                   "(silent / coverage, on bytes held) and rewrite it and the markdown")
    p.add_argument("--list", action="store_true", help="print the architecture ids and exit")
    p.add_argument("--per-process", type=int, default=8, metavar="K",
                   help="architectures per worker process before a fresh one (default 8; 1: one each; a crash or "
                        "a hang always costs only its own row)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        return _serve()
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1, not {a.jobs}")
    if a.per_process < 1:
        p.error(f"--per-process must be at least 1, not {a.per_process}")
    if a.timeout <= 0:
        p.error(f"--timeout must be positive seconds, not {a.timeout:g}")
    ids = architectures()
    if a.list:
        print("\n".join(ids))
        return 0
    chosen = select(ids, a.arch)
    if a.sample:
        chosen = [i for i in chosen if i in SAMPLE]
    doc = load(a.out)
    rows = doc.setdefault("archs", {})
    if a.rejudge:
        for row in rows.values():
            if "layers" in row:  # a row that got as far as the wrapped run
                judge(row)
        save(a.out, doc)
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(markdown(doc))
        print(json.dumps(summarize(rows)), flush=True)
        return 0
    todo = [i for i in chosen if a.force or i not in rows]
    doc["meta"] = {"versions": versions(), "date": _now(), "archs_last_run": len(todo), "settings": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "vocab": VOCAB,
                                             "window": WINDOW, "prompt": PROMPT, "new_tokens": NEW_TOKENS,
                                             "chunk": CHUNK, "runs": list(RUNS)},
                   "architectures_in_transformers": len(ids)}
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(todo), unit="arch")
    t0 = time.perf_counter()
    pending: "queue.Queue[str]" = queue.Queue()
    for i in todo:
        pending.put(i)
    results: "queue.Queue[dict]" = queue.Queue()

    def job():
        w = Worker(a.per_process)
        try:
            while True:
                try:
                    rid = pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    results.put(w.run(rid, a.timeout))
                except Exception as e:  # a garbled reply: the row says so, the worker starts afresh
                    w.stop()
                    kind, arch = rid.split("/", 1)
                    results.put({"id": rid, "kind": kind, "arch": arch, "runs": {}, "notes": [],
                                 "status": "crashed", "reason": "worker reply: " + _err(e)})
        finally:
            w.stop()

    threads = [threading.Thread(target=job, daemon=True) for _ in range(min(a.jobs, len(todo)))]
    for t in threads:
        t.start()
    for n in range(1, len(todo) + 1):
        row = results.get()
        rows[row["id"]] = row
        doc["meta"]["elapsed_s_last_run"] = round(time.perf_counter() - t0, 1)
        save(a.out, doc)
        msg = f"{row['id']}: {row.get('status')} {row.get('coverage', '')} ({row.get('seconds', '?')} s)"
        if bar is not None:
            bar.set_postfix_str(msg[:60])
            bar.update(1)
        else:
            print(f"[{n}/{len(todo)}] {msg}", file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    save(a.out, doc)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(doc))
    s = summarize(rows)
    print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
