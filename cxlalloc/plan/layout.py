"""A model's KV layout from its config, and the bytes cxlalloc's engine commits for it.

Pure arithmetic on plain values: no torch, no transformers (a ``config.json`` is
read as JSON).  What each layer kind stores follows what :mod:`cxlalloc.hf`'s
layer classes allocate (docs/planning.md#kv-bytes says it per kind, with the
code it mirrors):

========================  =====================================================  ==========================
layer kind (transformers)  stored by cxlalloc.hf                                  bytes per token, per seq.
========================  =====================================================  ==========================
``full_attention``        ``CxlKVLayer``: one slot of the shared store            ``H_kv (D_k + D_v) e``
``indexed_attention``     ``CxlIndexedLayer``: a shared-store slot + indexer      ``H_kv (D_k + D_v) e
                          keys in a store of its own                              + D_idx e``
``hybrid``                ``CxlHybridLayer``: a shared-store slot; its            ``H_kv (D_k + D_v) e``
                          conv/recurrent state stays transformers' (fixed)        (+ fixed state)
``sliding_attention`` /   ``CxlSlidingLayer``: a bounded store of its own,        ``H_kv (D_k + D_v) e``,
``chunked_attention``     ``window_capacity(w)`` tokens (1.25x the window)        at most that many tokens
``hybrid_sliding``        ``CxlHybridSlidingLayer``: as sliding (+ fixed state)   as sliding
``linear_attention`` /    transformers' ``LinearAttentionLayer``: fixed state,    0 (fixed state, untiered)
``conv``                  untiered
``dummy`` (KV shared,     nothing                                                 0
``moe``/``mlp``)
========================  =====================================================  ==========================

``e`` is the KV dtype's size.  The shared store holds every full/indexed/hybrid
layer, so its row is ``n_shared * B * H_kv * (D_k + D_v) * e`` bytes per token
(``cxlalloc/hf/storage.py``), and the engine commits whole extent chunks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

# Bytes per element of the dtypes a config or the command line may name.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1, "int4": 0.5}

# Layer kinds by where their bytes go (transformers 5.24 ``DYNAMIC_LAYER_TYPE_MAPPING`` names).
SHARED_KINDS = ("full_attention", "indexed_attention", "hybrid")
SLIDING_KINDS = ("sliding_attention", "chunked_attention", "hybrid_sliding")
STATE_KINDS = ("hybrid", "hybrid_sliding", "linear_attention", "conv")
NO_KV_KINDS = ("linear_attention", "conv", "dummy")
KNOWN_KINDS = SHARED_KINDS + SLIDING_KINDS + NO_KV_KINDS

# cxlalloc.hf.layers.sliding.window_capacity: rows a bounded sliding extent holds beyond the window
# (keep // EXTRA_DIVISOR, at least MIN_EXTRA_TOKENS).  Mirrored here (that module imports torch);
# tests/plan/test_plan_vs_engine.py asserts the two agree.
EXTRA_DIVISOR = 4
MIN_EXTRA_TOKENS = 16

DEFAULT_CHUNK_BYTES = 2 << 20  # the CUDA VMM granularity cxlalloc's extents use (and the simulator's)


def window_capacity(sliding_window: int) -> int:
    """Tokens a sliding-window layer's bounded extent asks for (before rounding
    to whole chunks): ``w - 1 + max((w - 1) // 4, 16)``, as
    ``cxlalloc.hf.layers.sliding.window_capacity``."""
    keep = int(sliding_window) - 1
    return keep + max(keep // EXTRA_DIVISOR, MIN_EXTRA_TOKENS)


def dtype_bytes(name: str, option: str = "dtype") -> float:
    """Bytes per element of ``name`` (``bf16``, ``float16``, ``fp8``, ...).

    Raises:
        ValueError: an unknown name (the message names ``option`` and the choices).
    """
    key = str(name).lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"{option} must be one of {', '.join(sorted(DTYPE_BYTES))}, got {name!r}")
    return DTYPE_BYTES[key]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One decoder layer's cache: its kind, K/V geometry (per sequence), window and extras."""

    kind: str
    heads: int = 0          # KV heads (1 for MLA latents)
    k_dim: int = 0
    v_dim: int = 0
    window: Optional[int] = None   # sliding/chunked window (tokens)
    index_dim: int = 0             # indexer key dim (indexed attention)

    @property
    def kv_elems(self) -> int:
        """K + V elements per token per sequence (0 for kinds without per-token K/V)."""
        if self.kind in NO_KV_KINDS or self.kind not in KNOWN_KINDS:
            return 0
        return self.heads * (self.k_dim + self.v_dim)


@dataclasses.dataclass
class Layout:
    """A model's cache layout and weight count, read from its config.

    Attributes:
        name: the config's ``_name_or_path``/``model_type`` (for display).
        layers: one :class:`Layer` per decoder layer, in order.
        params: weight parameter count (``params_source`` says how it was found).
        active_params: parameters used per token (MoE: the routed top-k only).
        state_elems: fixed-size state elements per sequence per stateful layer
            (Mamba-2 conv + recurrent), or None when the config has no such fields.
        attn_heads / head_dim: query heads and their dim (prefill FLOPs).
        notes: how fields were found (printed with the plan).
    """

    name: str
    model_type: str
    layers: List[Layer]
    params: int
    active_params: int
    params_source: str
    state_elems: Optional[int]
    attn_heads: int
    head_dim: int
    notes: List[str]
    config_dtype: Optional[str] = None
    embed_in_params: int = 0    # input embeddings (on the first pipeline stage)
    embed_out_params: int = 0   # final norm + an untied lm_head (on the last pipeline stage)

    def count(self, *kinds: str) -> int:
        return sum(1 for la in self.layers if la.kind in kinds)

    def kinds(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for la in self.layers:
            out[la.kind] = out.get(la.kind, 0) + 1
        return out

    def shared_geometry(self) -> Optional[Layer]:
        """The geometry of the shared store's slots (the first full/indexed/hybrid layer's)."""
        return next((la for la in self.layers if la.kind in SHARED_KINDS), None)


# ---------------------------------------------------------------------------- reading configs
PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")


def presets() -> List[str]:
    """Names of the configs shipped under ``cxlalloc/plan/presets/`` (package data), e.g. ``llama-3.1-8b``."""
    return sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".json"))


def load_config(source: Any) -> Dict[str, Any]:
    """A config as a plain dict: ``source`` is a model directory (its
    ``config.json``), a path to a JSON file, a preset name (:func:`presets`,
    when no such path exists), a dict, or a transformers config object (its
    decoder text config's ``to_dict()``, which carries the ``layer_types`` its
    class computes).

    Raises:
        FileNotFoundError: no such file, or a directory without ``config.json``.
        ValueError: the file is not a JSON object.
    """
    if isinstance(source, dict):
        return dict(source)
    if hasattr(source, "to_dict") and not isinstance(source, (str, os.PathLike)):
        cfg = source.get_text_config(decoder=True) if hasattr(source, "get_text_config") else source
        d = cfg.to_dict()
        lt = getattr(cfg, "layer_types", None)
        if lt is not None:
            d["layer_types"] = list(lt)
        d.setdefault("model_type", getattr(cfg, "model_type", None))
        return d
    path = os.fspath(source)
    if not os.path.exists(path) and path in presets():
        path = os.path.join(PRESETS_DIR, path + ".json")
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--model: no config.json at {path!r} (give a model directory, a config.json, or a "
                                f"preset name: {', '.join(presets())})")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model: {path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"--model: {path} holds a JSON {type(d).__name__}, not a config object")
    return d


def _first(d: Dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        v = d.get(k)
        if v is not None:
            return v
    return default


def _layer_types(d: Dict[str, Any], n_layers: int, notes: List[str]) -> List[str]:
    """transformers' ``get_layer_types_and_kwargs`` (cache_utils.py, 5.24) on a plain dict, plus the
    ``layer_types`` rules of config classes whose saved config.json may predate that field."""
    # layers_block_type: the name some classes keep it under (FalconH1Config's attribute_map)
    lt = d.get("layer_types") or d.get("layers_block_type")
    mt = str(d.get("model_type") or "")
    if lt is None:
        sw = d.get("sliding_window")
        if mt.startswith("qwen") and not d.get("use_sliding_window", False):
            sw = None  # Qwen2/3 configs: the window applies only with use_sliding_window
        if sw is not None and mt.startswith("qwen") and d.get("max_window_layers") is not None:
            m = int(d["max_window_layers"])
            lt = ["sliding_attention" if i >= m else "full_attention" for i in range(n_layers)]
            notes.append(f"layer_types from use_sliding_window/max_window_layers={m} (Qwen2Config's rule)")
        elif sw is not None and mt == "gemma2":
            lt = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
            notes.append("layer_types alternate sliding/full (Gemma2Config's rule)")
        elif sw is not None and mt.startswith("gemma3"):
            p = int(d.get("sliding_window_pattern") or 6)
            lt = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n_layers)]
            notes.append(f"layer_types: sliding, a full layer every {p} (Gemma3 sliding_window_pattern)")
        elif mt == "falcon_h1":
            lt = ["hybrid"] * n_layers  # FalconH1Config.layers_block_type: attention + Mamba-2 in every layer
            notes.append("layer_types: every layer attention + Mamba-2 (FalconH1Config's rule)")
        elif sw is not None:
            lt = ["sliding_attention"] * n_layers
        elif d.get("attention_chunk_size") is not None:
            lt = ["chunked_attention"] * n_layers
        else:
            lt = ["full_attention"] * n_layers
    lt = [str(t) for t in lt][:n_layers]
    modes = d.get("kv_sharing_modes")
    if modes is not None:
        lt = ["dummy" if m == "reuse" else t for t, m in zip(lt, modes)]
    return ["dummy" if t in ("moe", "mlp") else t for t in lt]


def _params(d: Dict[str, Any], hidden: int, n_layers: int, heads: int, kv_heads: int, head_dim: int,
            vocab: int, notes: List[str]) -> Tuple[int, int, str]:
    """Parameter count of a Llama-family decoder (LlamaForCausalLM's modules): per layer
    q/k/v/o projections, a gated MLP (3 matrices) or routed experts, two RMSNorms; embeddings,
    the final norm, and an untied lm_head.  Exact for Llama/Mistral/Qwen2-shaped configs without
    biases; an estimate otherwise (said in ``params_source``)."""
    inter = int(_first(d, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden))
    kv_lora = d.get("kv_lora_rank")
    if kv_lora and d.get("qk_rope_head_dim"):
        q_lora = d.get("q_lora_rank")
        qk = int(d.get("qk_nope_head_dim", 0)) + int(d["qk_rope_head_dim"])
        vdim = int(d.get("v_head_dim", head_dim))
        q = (hidden * q_lora + q_lora + q_lora * heads * qk) if q_lora else hidden * heads * qk
        attn = (q + hidden * (kv_lora + int(d["qk_rope_head_dim"])) + kv_lora
                + kv_lora * heads * (int(d.get("qk_nope_head_dim", 0)) + vdim) + heads * vdim * hidden)
        exact = False
    else:
        attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        mt = str(d.get("model_type") or "")
        if d.get("attention_bias"):  # LlamaConfig.attention_bias: q, k, v and o projections have biases
            attn += heads * head_dim + 2 * kv_heads * head_dim + hidden
        elif mt in ("qwen2", "qwen2_moe"):  # Qwen2: q, k, v biases always
            attn += heads * head_dim + 2 * kv_heads * head_dim
        if mt.startswith("gemma2") or mt.startswith("gemma3"):
            attn += 2 * hidden  # pre/post feed-forward norms besides the two of every layer
        exact = True
    experts = _first(d, "n_routed_experts", "num_local_experts", "num_experts")
    dense_mlp = 3 * hidden * inter
    total = active = 0
    if experts:
        moe_inter = int(_first(d, "moe_intermediate_size", default=inter))
        topk = int(_first(d, "num_experts_per_tok", "top_k", default=1))
        shared = int(_first(d, "n_shared_experts", default=0))
        first_dense = int(_first(d, "first_k_dense_replace", default=0))
        expert = 3 * hidden * moe_inter
        moe_layer = int(experts) * expert + shared * expert + hidden * int(experts)
        moe_active = topk * expert + shared * expert + hidden * int(experts)
        for i in range(n_layers):
            mlp, mlp_a = (dense_mlp, dense_mlp) if i < first_dense else (moe_layer, moe_active)
            total += attn + mlp + 2 * hidden
            active += attn + mlp_a + 2 * hidden
        exact = False
    else:
        total = active = n_layers * (attn + dense_mlp + 2 * hidden)
    tied = bool(d.get("tie_word_embeddings", False))
    emb = vocab * hidden * (1 if tied else 2) + hidden
    total += emb
    active += emb
    src = ("formula: Llama-family layout (exact for bias-free Llama/Mistral/Qwen-shaped configs)" if exact else
           "formula: estimate (MoE experts or MLA projections; pass --weight-bytes for the checkpoint's size)")
    return int(total), int(active), src


def read_layout(source: Any) -> Layout:
    """The :class:`Layout` of a model config (see :func:`load_config` for ``source``).

    Fields used (transformers config names, with their aliases): ``num_hidden_layers``
    (``n_layer``, ``num_layers``), ``hidden_size`` (``n_embd``, ``d_model``),
    ``num_attention_heads`` (``n_head``, ``num_heads``), ``num_key_value_heads``
    (default: the attention heads), ``head_dim`` (default ``hidden_size //
    num_attention_heads``), ``layer_types`` / ``sliding_window`` /
    ``attention_chunk_size`` (per-layer kinds), ``kv_lora_rank`` +
    ``qk_rope_head_dim`` (multi-head latent attention: the cache holds the
    single-head latents, as ``cxlalloc.hf.wrap``'s geometry does), ``index_head_dim``
    (indexer keys), ``mamba_*`` (hybrid state), ``vocab_size``,
    ``intermediate_size``, expert counts, ``tie_word_embeddings``.

    Raises:
        ValueError: the config has no layer count, hidden size or head count.
    """
    d = load_config(source)
    if isinstance(d.get("text_config"), dict):
        d = {**d, **d["text_config"]}
    notes: List[str] = []
    n_layers = _first(d, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    hidden = _first(d, "hidden_size", "n_embd", "d_model", "dim")
    heads = _first(d, "num_attention_heads", "n_head", "num_heads", "n_heads")
    if not (n_layers and hidden and heads):
        raise ValueError("--model: the config has no num_hidden_layers / hidden_size / num_attention_heads "
                         "(or their n_layer / n_embd / n_head aliases); cxlalloc plan needs all three")
    n_layers, hidden, heads = int(n_layers), int(hidden), int(heads)
    kv_heads = int(_first(d, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads))
    head_dim = int(_first(d, "head_dim", default=hidden // heads))
    if d.get("kv_lora_rank") and d.get("qk_rope_head_dim"):
        geo = (1, int(d["kv_lora_rank"]), int(d["qk_rope_head_dim"]))
        notes.append(f"multi-head latent attention: the cache holds latents (1 head, K {geo[1]} = kv_lora_rank, "
                     f"V {geo[2]} = qk_rope_head_dim), as cxlalloc.hf caches them")
    else:
        geo = (kv_heads, head_dim, head_dim)
    index_dim = int(d.get("index_head_dim") or 0)
    sw = d.get("sliding_window")
    chunk = d.get("attention_chunk_size")
    layers = []
    for t in _layer_types(d, n_layers, notes):
        window = None
        if t in ("sliding_attention", "hybrid_sliding"):
            window = int(sw) if sw else None
        elif t == "chunked_attention":
            window = int(chunk) if chunk else None
        if t in SLIDING_KINDS and (window is None or window < 2):
            notes.append(f"a {t} layer without a usable window: counted as full attention")
            t = "full_attention"
        if t not in KNOWN_KINDS:
            notes.append(f"layer kind {t!r} is not tiered by cxlalloc.hf: no KV counted for it")
        layers.append(Layer(t, *geo, window=window, index_dim=index_dim if t == "indexed_attention" else 0))
    state = None
    if d.get("mamba_d_state") is not None:
        d_ssm = int(_first(d, "mamba_d_ssm", default=int(_first(d, "mamba_expand", default=2)) * hidden))
        groups = int(_first(d, "mamba_n_groups", default=1))
        d_state = int(d["mamba_d_state"])
        d_conv = int(_first(d, "mamba_d_conv", default=4))
        m_heads = int(_first(d, "mamba_n_heads", default=heads))
        m_head = int(_first(d, "mamba_d_head", default=d_ssm // max(1, m_heads)))
        state = (d_ssm + 2 * groups * d_state) * d_conv + m_heads * m_head * d_state
        notes.append("hybrid state: Mamba-2 conv (d_ssm + 2 n_groups d_state) x d_conv + recurrent "
                     "n_heads x d_head x d_state elements per sequence per layer")
    if d.get("is_encoder_decoder"):
        notes.append("encoder-decoder: the decoder's self-attention cache is planned; the cross-attention K/V "
                     "(encoder length, fixed) is not")
    vocab = int(_first(d, "vocab_size", default=32000))
    params, active, src = _params(d, hidden, n_layers, heads, kv_heads, head_dim, vocab, notes)
    name = str(_first(d, "_name_or_path", "name", default="") or d.get("model_type") or "model")
    tied = bool(d.get("tie_word_embeddings", False))
    return Layout(name=name, model_type=str(d.get("model_type") or ""), layers=layers, params=params,
                  active_params=active, params_source=src, state_elems=state, attn_heads=heads,
                  head_dim=head_dim, notes=notes, config_dtype=_first(d, "torch_dtype", "dtype"),
                  embed_in_params=vocab * hidden, embed_out_params=(0 if tied else vocab * hidden) + hidden)


def split_layers(n_layers: int, stages: int) -> List[Tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges of ``stages`` pipeline stages,
    as even as whole layers allow (the first ``n_layers % stages`` stages hold
    one more): how ``cxlalloc plan --parallel pp`` splits a model over GPUs."""
    base, extra = divmod(int(n_layers), int(stages))
    out, start = [], 0
    for i in range(int(stages)):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def stage_layout(layout: Layout, start: int, end: int) -> Layout:
    """The layers ``[start, end)`` of ``layout`` as a layout of their own (one
    pipeline stage: what that GPU's cache holds)."""
    return dataclasses.replace(layout, layers=list(layout.layers[start:end]), notes=list(layout.notes))


# ---------------------------------------------------------------------------- bytes
def _chunks(nbytes: float, chunk: int) -> int:
    return int(math.ceil(nbytes / chunk)) * chunk if nbytes > 0 else 0


def kv_bytes_per_token(layout: Layout, kv_elem: float) -> Dict[str, int]:
    """K/V bytes one token of one sequence adds, per layer kind (summed over that
    kind's layers), plus ``"indexer"`` (indexer keys) and ``"total"``.  A
    sliding layer adds these bytes only up to its window (see :func:`cache_bytes`)."""
    out: Dict[str, int] = {}
    for la in layout.layers:
        if la.kv_elems:
            out[la.kind] = out.get(la.kind, 0) + int(la.kv_elems * kv_elem)
        if la.index_dim:
            out["indexer"] = out.get("indexer", 0) + int(la.index_dim * kv_elem)
    out["total"] = sum(out.values())
    return out


def sliding_capacity_tokens(window: int, row_bytes: int, chunk: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens a sliding layer's extent holds: ``window_capacity(w)`` rounded up to whole chunks."""
    return _chunks(window_capacity(window) * row_bytes, chunk) // row_bytes


def cache_bytes(layout: Layout, batch: int, tokens: int, kv_elem: float, prompt: Optional[int] = None,
                chunk: int = DEFAULT_CHUNK_BYTES) -> Dict[str, int]:
    """Bytes the engine commits (class ``kv``) for one ``CxlCache`` of ``batch``
    sequences holding ``tokens`` tokens each, after a prefill of ``prompt``
    tokens and one token per decode step (default: the most it reaches, as
    after a short prompt decoded to ``tokens``).

    * shared store (full, indexed, hybrid layers): ``ceil(tokens * row / chunk)``
      chunks, ``row = n_shared * batch * H_kv * (D_k + D_v) * e``;
    * each indexed layer's indexer keys: ``ceil(tokens * batch * D_idx * e / chunk)`` chunks;
    * each sliding layer: its rows written so far, at most the extent's
      capacity (:func:`sliding_capacity_tokens`); a prefill longer than the
      capacity keeps ``w - 1`` rows, then one row per step.

    Returns ``{"shared": .., "indexer": .., "sliding": .., "total": ..}`` in bytes.
    """
    prompt = 1 if prompt is None else int(prompt)
    geo = layout.shared_geometry()
    n_shared = layout.count(*SHARED_KINDS)
    shared = _chunks(tokens * n_shared * batch * geo.kv_elems * kv_elem, chunk) if geo is not None else 0
    indexer = sum(_chunks(tokens * batch * la.index_dim * kv_elem, chunk) for la in layout.layers if la.index_dim)
    sliding = 0
    for la in layout.layers:
        if la.kind in SLIDING_KINDS and la.kv_elems:
            row = int(batch * la.kv_elems * kv_elem)
            cap = sliding_capacity_tokens(la.window, row, chunk)
            end = min(tokens, cap) if prompt <= cap else min(la.window - 1 + (tokens - prompt), cap)
            sliding += _chunks(end * row, chunk)
    return {"shared": shared, "indexer": indexer, "sliding": sliding, "total": shared + indexer + sliding}


def live_kv_bytes(layout: Layout, tokens: int, kv_elem: float) -> int:
    """K/V bytes attention reads for one sequence at ``tokens`` of context in one
    decode step: every token of full/indexed/hybrid layers (and indexer keys),
    at most ``w - 1`` tokens of a sliding layer."""
    total = 0.0
    for la in layout.layers:
        if not la.kv_elems and not la.index_dim:
            continue
        t = min(tokens, la.window - 1) if la.kind in SLIDING_KINDS else tokens
        total += t * (la.kv_elems + la.index_dim) * kv_elem
    return int(total)


def state_bytes(layout: Layout, kv_elem: float) -> Optional[int]:
    """Fixed-size (untiered) state bytes per sequence: stateful layers x state elements."""
    n = layout.count(*STATE_KINDS)
    if n == 0:
        return 0
    return None if layout.state_elems is None else int(n * layout.state_elems * kv_elem)
