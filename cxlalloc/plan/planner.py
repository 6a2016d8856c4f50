"""The right-sizing plan: KV bytes, VRAM split, sequences per GPU with and
without the host/CXL tier, decode and TTFT bounds, and the GPU count.

Pure arithmetic (no torch).  Formulas, with their sources (docs/planning.md
states each and the assumptions; :func:`plan` returns them in the record):

* KV bytes: :mod:`cxlalloc.plan.layout` (the engine's own layout, exact).
* VRAM split per GPU: weights ``W / g`` (``g`` GPUs holding one copy of the
  weights, tensor-parallel), a headroom of ``max(2 GiB, 10% of VRAM)`` left to
  torch's activations (``cxlalloc.hf.wrap``'s default on a GPU), and KV in the rest.
* Decode step (one token per sequence, every byte read once, as the bench's
  ceiling model ``cxlalloc_apps/bench/model.py``)::

      t_step = (W + (1 - f) K) / (g B_hbm) + f K / (g B_read)

  ``K`` the live KV bytes of all sequences, ``f`` the share on the host tier
  (the KV-aware policy keeps the newest tokens in VRAM and spills the oldest),
  ``B_read = min(link, host node)`` the rate a GPU kernel reads host memory.
* Prefill (TTFT cold): ``(2 N_active T + sum over attention layers of 2 H_q d T
  T_w) / (g F mfu)``, ``T_w = T`` (full) or ``min(T, w)`` (sliding), ``F``
  the dense BF16 peak; the MFU is an input (default 0.4).
* TTFT warm (a prefix hit of share ``r``): load ``r T`` tokens' KV at ``g
  B_read``, then prefill the other ``(1 - r) T`` tokens against the whole context.
* GPUs: ``g * ceil(users / sequences per group)``, sequences per group the
  largest count whose KV fits (VRAM only, or VRAM + host bytes) and whose
  ``t_step`` meets the TPOT target.
* ``gpus=N`` fixes ``g``; ``parallel="tp"`` keeps the formulas above (KV heads
  split over the GPUs, or copied when ``N`` is a multiple of them: the KV
  scaled by ``N / H_kv``); ``parallel="pp"`` (:class:`StagedModel`) gives
  each GPU a run of layers with its own weights, cache and room, and sums
  ``t_step`` and prefill over the GPUs.  ``per_gpu`` / ``per_node`` in the
  record: each GPU's share at the operating point, its tier's node
  (:func:`cxlalloc.plan.hardware.gpu_tier_nodes`) and link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from cxlalloc.plan import hardware
from cxlalloc.plan.layout import (DEFAULT_CHUNK_BYTES, SHARED_KINDS, SLIDING_KINDS, Layout, cache_bytes, dtype_bytes,
                                  kv_bytes_per_token, live_kv_bytes, read_layout, split_layers, stage_layout,
                                  state_bytes)

GiB = 1 << 30
GROUPS = (1, 2, 4, 8)  # tensor-parallel group sizes tried for weights that do not fit one GPU


def default_headroom(hbm_bytes: float) -> int:
    """VRAM left to torch (activations, workspace): ``max(2 GiB, 10% of VRAM)``,
    the share ``cxlalloc.hf.wrap`` leaves on a GPU without ``device_limit``."""
    return int(max(2 * GiB, 0.10 * hbm_bytes))


class PlanModel:
    """The numbers of one plan (inputs resolved), with its step and prefill
    times (seconds) and capacity search; :mod:`cxlalloc.plan.check` uses it for
    the bounds of measured records."""

    def __init__(self, layout: Layout, weight_bytes: float, kv_elem: float, hbm: float, hbm_gbps: float,
                 read_gbps: float, tflops: float, mfu: float, headroom: float, host_bytes: float, chunk: int,
                 kv_scale: float = 1.0):
        self.layout, self.W, self.e = layout, float(weight_bytes), kv_elem
        # Tensor parallel over more GPUs than KV heads: each GPU keeps a copy of a head (vLLM's rule), so the
        # group holds kv_scale times the model's KV.
        self.kv_scale = float(kv_scale)
        # Fixed-size state (SSM/conv) of stateful layers stays in transformers' memory: VRAM, untiered.
        self.state = float(state_bytes(layout, kv_elem) or 0)
        self.hbm, self.hbm_gbps, self.read_gbps = hbm, hbm_gbps, read_gbps
        self.tflops, self.mfu, self.headroom, self.host, self.chunk = tflops, mfu, headroom, host_bytes, chunk

    def budget(self, g: int, users: int = 0) -> float:
        """KV bytes a group of ``g`` GPUs keeps in VRAM (less ``users`` sequences' fixed state)."""
        return g * (self.hbm - self.headroom) - self.W - users * self.state

    def kv(self, users: int, context: int) -> int:
        if not users:
            return 0
        return int(cache_bytes(self.layout, users, context, self.e, chunk=self.chunk)["total"] * self.kv_scale)

    def host_share(self, users: int, context: int, g: int) -> float:
        k = self.kv(users, context)
        return max(0.0, k - max(0.0, self.budget(g, users))) / k if k else 0.0

    def step_s(self, users: int, context: int, g: int, host: bool = True) -> float:
        live = users * live_kv_bytes(self.layout, context, self.e) * self.kv_scale
        f = self.host_share(users, context, g) if host else 0.0
        t = (self.W + (1 - f) * live) / (g * self.hbm_gbps * 1e9)
        return t + (f * live / (g * self.read_gbps * 1e9) if f else 0.0)

    def attn_flops(self, new: float, context: float) -> float:
        """Attention FLOPs of ``new`` tokens at the end of a ``context``-token
        prompt (QK^T and AV, causal: 2 x 2 H_q d per query-key pair)."""
        la = self.layout
        per_pair = 4 * la.attn_heads * la.head_dim
        done = context - new
        total = 0.0
        for layer in la.layers:
            if layer.kind in SHARED_KINDS:
                total += per_pair * (context * context - done * done) / 2
            elif layer.kind in SLIDING_KINDS and layer.window:
                total += per_pair * new * min(context, layer.window)
        return total

    def prefill_s(self, new: float, context: float, g: int) -> float:
        flops = 2 * self.layout.active_params * new + self.attn_flops(new, context)
        return flops / (g * self.tflops * 1e12 * self.mfu)

    def fits(self, users: int, context: int, g: int, host: bool, slo_s: Optional[float]) -> bool:
        room = self.budget(g, users)
        if room < 0 or self.kv(users, context) > room + (g * self.host if host else 0.0):
            return False
        return slo_s is None or self.step_s(users, context, g, host) <= slo_s

    def host_needed(self, users: int, context: int, g: int) -> float:
        """Host/CXL bytes the group's spilled KV takes (all GPUs)."""
        return max(0.0, self.kv(users, context) - self.budget(g, users))

    def per_gpu(self, users: int, context: int, g: int) -> List[Dict[str, Any]]:
        """Each GPU's share (tensor parallel: an equal slice of every layer's
        heads, so KV, weights and spill divide evenly): layers ``[start, end)``,
        ``weights_bytes``, ``kv_bytes`` (its cache), ``kv_vram_bytes``,
        ``host_bytes`` (its spill) and ``kv_room_bytes``."""
        kv, room = self.kv(users, context), self.budget(g, users)
        vram = min(kv, max(0.0, room))
        return [{"gpu": i, "layers": [0, len(self.layout.layers)], "weights_bytes": self.W / g,
                 "kv_bytes": kv / g, "kv_vram_bytes": vram / g, "host_bytes": (kv - vram) / g,
                 "kv_room_bytes": room / g} for i in range(g)]

    def max_users(self, context: int, g: int, host: bool, slo_s: Optional[float], limit: int = 1 << 20) -> int:
        """Largest sequence count that fits (binary search; KV grows with users)."""
        if self.budget(g) <= 0 or not self.fits(1, context, g, host, slo_s):
            return 0
        lo, hi = 1, 2
        while hi < limit and self.fits(hi, context, g, host, slo_s):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, context, g, host, slo_s) else (lo, mid)
        return lo


class StagedModel(PlanModel):
    """Pipeline parallel: GPU ``i`` holds the contiguous layers of stage ``i``
    (:func:`cxlalloc.plan.layout.split_layers`), their weights (the first
    also the input embeddings, the last the final norm and an untied
    ``lm_head``) and their KV in a cache of its own, spilling to its own
    host tier.  A sequence's decode step and prefill run through the stages
    one after another, so times add up over GPUs (no speed-up from ``g``);
    capacity holds while every GPU's KV fits its own room."""

    def __init__(self, layout: Layout, weight_bytes: float, kv_elem: float, hbm: float, hbm_gbps: float,
                 read_gbps: float, tflops: float, mfu: float, headroom: float, host_bytes: float, chunk: int,
                 gpus: int):
        super().__init__(layout, weight_bytes, kv_elem, hbm, hbm_gbps, read_gbps, tflops, mfu, headroom,
                         host_bytes, chunk)
        body = max(1, layout.params - layout.embed_in_params - layout.embed_out_params)
        per_layer = body / max(1, len(layout.layers))
        self.ranges = split_layers(len(layout.layers), gpus)
        self.stages = []
        for i, (a, b) in enumerate(self.ranges):
            params = per_layer * (b - a) + (layout.embed_in_params if i == 0 else 0) \
                + (layout.embed_out_params if i == gpus - 1 else 0)
            sub = stage_layout(layout, a, b)
            self.stages.append((sub, self.W * params / max(1, layout.params), float(state_bytes(sub, kv_elem) or 0)))

    def room(self, i: int, users: int = 0) -> float:
        sub, w, st = self.stages[i]
        return self.hbm - self.headroom - w - users * st

    def stage_kv(self, i: int, users: int, context: int) -> int:
        return cache_bytes(self.stages[i][0], users, context, self.e, chunk=self.chunk)["total"] if users else 0

    def budget(self, g: int, users: int = 0) -> float:
        return sum(self.room(i, users) for i in range(len(self.stages)))

    def kv(self, users: int, context: int) -> int:
        return sum(self.stage_kv(i, users, context) for i in range(len(self.stages)))

    def _spill(self, i: int, users: int, context: int) -> float:
        return max(0.0, self.stage_kv(i, users, context) - max(0.0, self.room(i, users)))

    def host_needed(self, users: int, context: int, g: int) -> float:
        return sum(self._spill(i, users, context) for i in range(len(self.stages)))

    def host_share(self, users: int, context: int, g: int) -> float:
        k = self.kv(users, context)
        return self.host_needed(users, context, g) / k if k else 0.0

    def step_s(self, users: int, context: int, g: int, host: bool = True) -> float:
        t = 0.0
        for i, (sub, w, _) in enumerate(self.stages):
            live = users * live_kv_bytes(sub, context, self.e)
            k = self.stage_kv(i, users, context)
            f = self._spill(i, users, context) / k if (host and k) else 0.0
            t += (w + (1 - f) * live) / (self.hbm_gbps * 1e9) + (f * live / (self.read_gbps * 1e9) if f else 0.0)
        return t

    def prefill_s(self, new: float, context: float, g: int) -> float:
        return super().prefill_s(new, context, 1)  # one prompt goes through the stages in turn

    def fits(self, users: int, context: int, g: int, host: bool, slo_s: Optional[float]) -> bool:
        for i in range(len(self.stages)):
            room = self.room(i, users)
            if room < 0 or self.stage_kv(i, users, context) > room + (self.host if host else 0.0):
                return False
        return slo_s is None or self.step_s(users, context, g, host) <= slo_s

    def per_gpu(self, users: int, context: int, g: int) -> List[Dict[str, Any]]:
        out = []
        for i, ((a, b), (sub, w, _)) in enumerate(zip(self.ranges, self.stages)):
            kv, room = self.stage_kv(i, users, context), self.room(i, users)
            vram = min(kv, max(0.0, room))
            out.append({"gpu": i, "layers": [a, b], "weights_bytes": w, "kv_bytes": kv, "kv_vram_bytes": vram,
                        "host_bytes": kv - vram, "kv_room_bytes": room})
        return out


PARALLEL = ("tp", "pp")


# What each whole-number option of `cxlalloc plan` / plan() allows (said in the error).
WHOLE = {"--context": "of tokens >= 1 (prompt + generated)", "--users": "of sequences >= 1",
         "--gpus": "of GPUs >= 1 (1, 2, 4, 8, ...)", "chunk_bytes": "of bytes >= 1 (the engine's extent chunk, 2 MiB)",
         "curve_contexts": "of tokens >= 1 in each entry", "curve_users": "of sequences >= 1 in each entry"}


def check_whole(value, option: str, allowed: str = "") -> int:
    """A whole number >= 1 for ``option``: an int, a float with no fraction
    (``2.0``), or a string of either (``"2"``, ``"2.0"``, ``"1e3"``), as the
    command line and :func:`plan` both take it.

    Raises:
        ValueError: anything else (a fraction, a bool, a non-number, < 1),
            naming ``option`` and its allowed values (``allowed``, default
            :data:`WHOLE`'s line for ``option``).
    """
    allowed = allowed or WHOLE.get(option, ">= 1")
    n = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, (float, str)):
        text = value.strip() if isinstance(value, str) else None
        if text is not None and text.isascii() and text.isdigit():
            n = int(text)
        else:
            try:
                f = float(value)
            except ValueError:
                f = None
            if f is not None and math.isfinite(f) and f.is_integer():
                n = int(f)
    if n is None or n < 1:
        raise ValueError(f"{option} takes a whole number {allowed}, got {value!r}")
    return n


def check_gpus(value) -> int:
    """``--gpus``: a whole number >= 1 (:func:`check_whole`).

    Raises:
        ValueError: a fraction, a bool, a non-number, < 1, naming ``--gpus``
            and its allowed values.
    """
    return check_whole(value, "--gpus")


def _tp_heads(layout: Layout, g: int) -> Tuple[int, float]:
    """KV heads per GPU and the group's KV multiple for tensor parallel over ``g`` GPUs.

    Raises:
        ValueError: ``g`` does not divide the attention heads, or neither
            divides nor is a multiple of the KV heads (naming ``--gpus``)."""
    heads = layout.attn_heads
    if heads % g:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"--gpus {g} with --parallel tp: tensor parallelism splits the {heads} attention heads "
                         f"evenly, so --gpus must divide {heads} (allowed: {', '.join(map(str, ok))}); "
                         f"or use --parallel pp")
    geo = layout.shared_geometry() or next((la for la in layout.layers if la.kv_elems), None)
    kvh = geo.heads if geo is not None else 1
    if kvh % g == 0:
        return kvh // g, 1.0
    if g % kvh == 0:
        return 1, g / kvh
    raise ValueError(f"--gpus {g} with --parallel tp: the {kvh} KV heads neither split evenly over {g} GPUs nor "
                     f"are copied whole to each (--gpus must divide {kvh} or be a multiple of it); "
                     f"or use --parallel pp")


def _check(name: str, value, lo=None, hi=None):
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {value!r}")
    return v


@dataclass(frozen=True)
class PlanInputs:
    """Everything :func:`plan` is asked: the model, the workload and the hardware.

    ``cxlalloc plan`` builds one from its options (``cxlalloc/plan/cli.py``);
    units and defaults as the options say (docs/planning.md, "Inputs").

    Attributes:
        model: a model directory, config.json path, config dict or transformers
            config object (:func:`cxlalloc.plan.layout.read_layout`).
        context: tokens per sequence (prompt + generated).
        users: concurrent sequences to serve (the target).
        weight_dtype / kv_dtype: element types (``bf16``, ``fp16``, ``fp8``,
            ``fp32``, ``int4`` for weights); KV defaults to the weights' type.
        reuse: share of each prompt served from the prefix reuse pool (0..1).
        gpu: preset name (``h100``, ``h200``, ``b200``, ``l40s``); ``hbm_bytes``,
            ``hbm_gbps`` (GB/s), ``bf16_tflops``, ``link_gbps`` override it.
        host_bytes: host/CXL bytes available per GPU for KV (default: from
            ``info``, else 512 GB).
        host_node: ``dram``, ``cxl-x8``, ``cxl-x16`` or a bandwidth in GB/s of
            the host/CXL memory (the GPU reads it at ``min(link, node)``).
        info: a ``cxlalloc info --json`` record (:func:`cxlalloc.plan.hardware.from_info`):
            the host/CXL node sizes, and the GPU's memory when ``hbm_bytes`` is not given.
        headroom_bytes: VRAM left to activations (default :func:`default_headroom`).
        tpot_slo_ms: decode step target in ms (None: capacity only).
        mfu: prefill's share of the dense BF16 peak (0..1].
        weight_bytes: the checkpoint's size (default: params x weight dtype).
        records: bench record files/folders; a ``ceilings`` record of this GPU
            replaces the datasheet HBM and link rates (said in ``hardware``).
        chunk_bytes: the engine's extent chunk (2 MiB).
        curve_contexts / curve_users: points of the plot's curves.
        gpus: GPUs per model copy (``--gpus``; a whole number >= 1); None:
            the smallest of 1, 2, 4, 8 that holds the weights (tensor parallel).
        parallel: how a copy is spread over ``gpus``: ``"tp"`` (tensor
            parallel, the default: every GPU holds a slice of every layer's
            heads, as vLLM's and SGLang's ``--tensor-parallel-size``) or
            ``"pp"`` (pipeline: layers split over the GPUs, as transformers'
            ``device_map="auto"``).
    """

    model: Any
    context: int = 32768
    users: int = 64
    weight_dtype: str = "bf16"
    kv_dtype: Optional[str] = None
    reuse: float = 0.0
    gpu: str = "h200"
    hbm_bytes: Optional[float] = None
    hbm_gbps: Optional[float] = None
    bf16_tflops: Optional[float] = None
    link_gbps: Optional[float] = None
    host_bytes: Optional[float] = None
    host_node: Any = "dram"
    info: Optional[Dict[str, Any]] = None
    headroom_bytes: Optional[float] = None
    tpot_slo_ms: Optional[float] = 50.0
    mfu: float = 0.4
    weight_bytes: Optional[float] = None
    records: Sequence[str] = ()
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    curve_contexts: Optional[Sequence[int]] = None
    curve_users: Optional[Sequence[int]] = None
    gpus: Optional[int] = None
    parallel: str = "tp"


def plan(inputs, **options) -> Dict[str, Any]:
    """Plan serving ``users`` concurrent sequences of ``context`` tokens.

    Args:
        inputs: a :class:`PlanInputs`, or the model (anything
            ``PlanInputs.model`` takes), then ``options`` are the other fields
            of :class:`PlanInputs` by name: ``plan(model, context=..., users=...)``
            is ``plan(PlanInputs(model, context=..., users=...))``.
        options: :class:`PlanInputs` fields; with a :class:`PlanInputs`, they
            replace its fields.

    Returns:
        A JSON-ready dict: ``model``, ``inputs``, ``hardware``, ``kv``,
        ``vram``, ``capacity``, ``decode``, ``ttft``, ``gpus``, ``host``,
        ``curves``, ``assumptions`` (see docs/planning.md for every key).

    Raises:
        ValueError: a bad input (the message names it and its allowed values),
            or weights that fit no group of up to 8 GPUs.
        TypeError: an option that is not a :class:`PlanInputs` field.
        FileNotFoundError: no config at ``model``.
    """
    p = replace(inputs, **options) if isinstance(inputs, PlanInputs) else PlanInputs(inputs, **options)
    context = check_whole(p.context, "--context")
    users = check_whole(p.users, "--users")
    chunk = check_whole(p.chunk_bytes, "chunk_bytes")
    curve_contexts = [check_whole(c, "curve_contexts") for c in (p.curve_contexts or ())]
    curve_users = [check_whole(u, "curve_users") for u in (p.curve_users or ())]
    reuse = _check("--reuse", p.reuse, 0.0, 1.0)
    mfu = _check("--mfu", p.mfu, 0.01, 1.0)
    from_info = hardware.from_info(p.info) if p.info is not None else None
    if p.host_bytes is not None:
        host_bytes, host_src = _check("--host-bytes", p.host_bytes, 0.0), "--host-bytes"
    elif from_info is not None:
        host_bytes, host_src = from_info["host_bytes_per_gpu"], from_info["source"]
    else:
        host_bytes, host_src = 512e9, "default 512 GB per GPU"
    tpot_slo_ms = p.tpot_slo_ms
    if tpot_slo_ms is not None:
        tpot_slo_ms = _check("--tpot-slo-ms", tpot_slo_ms, 0.001)
    gpus = None if p.gpus is None else check_gpus(p.gpus)
    if p.parallel not in PARALLEL:
        raise ValueError(f"--parallel must be one of {', '.join(PARALLEL)}, got {p.parallel!r}")
    if gpus is None and p.parallel == "pp":
        raise ValueError("--parallel pp needs --gpus N (the GPUs the layers are split over, allowed: 1 up to the "
                         "model's layers); without --gpus the plan picks the smallest of 1, 2, 4, 8 GPUs that holds "
                         "the weights, with tensor-parallel figures")
    if gpus is not None and from_info is not None and from_info["gpus"] and gpus > from_info["gpus"]:
        raise ValueError(f"--gpus {gpus}: the --info record lists {from_info['gpus']} GPU(s) (allowed: 1.."
                         f"{from_info['gpus']}, or leave out --info)")
    layout = read_layout(p.model)
    if gpus is not None and p.parallel == "pp" and gpus > len(layout.layers):
        raise ValueError(f"--gpus {gpus} with --parallel pp: the model has {len(layout.layers)} layers, one stage "
                         f"per GPU at least (allowed: 1..{len(layout.layers)})")
    kv_heads_per_gpu, kv_scale = _tp_heads(layout, gpus) if (gpus and p.parallel == "tp") else (None, 1.0)
    we = dtype_bytes(p.weight_dtype, "--weight-dtype")
    ke = dtype_bytes(p.kv_dtype or p.weight_dtype, "--kv-dtype")
    preset = hardware.gpu_preset(p.gpu)
    measured = hardware.measured_ceilings(preset, list(p.records)) if p.records else None
    if p.hbm_bytes:
        hbm, hbm_src = float(p.hbm_bytes), "--hbm-bytes"
    elif from_info is not None and from_info["hbm_bytes"]:
        hbm, hbm_src = from_info["hbm_bytes"], f"cxlalloc info: {from_info['gpu_name']}"
    else:
        hbm, hbm_src = preset.hbm_bytes, f"{preset.name} {preset.source}"
    if p.hbm_gbps:
        bw, bw_src = float(p.hbm_gbps), "--hbm-gbps"
    elif measured:
        bw, bw_src = measured["hbm_gbps"], f"measured HBM kernel read rate, {measured['path']} ({measured['gpu']})"
    else:
        bw, bw_src = preset.hbm_gbps, f"{preset.name} datasheet"
    if p.link_gbps:
        link, link_src = float(p.link_gbps), "--link-gbps"
    elif measured and measured.get("link_gbps"):
        link, link_src = measured["link_gbps"], (f"measured zero-copy read of the host tier "
                                                 f"({measured['link_backend']}), {measured['path']}")
    else:
        link, link_src = preset.link_gbps, f"{preset.link_name} theoretical per direction"
    if isinstance(p.host_node, (int, float)) or str(p.host_node).replace(".", "", 1).isdigit():
        node_gbps, node_src = _check("--host-node", p.host_node, 0.001), "--host-node (GB/s)"
    else:
        node_gbps, node_src = hardware.host_node(p.host_node)
    read = min(link, node_gbps)
    tflops = float(p.bf16_tflops) if p.bf16_tflops else preset.bf16_tflops
    head = float(p.headroom_bytes) if p.headroom_bytes is not None else default_headroom(hbm)
    W = float(p.weight_bytes) if p.weight_bytes else layout.params * we
    if gpus is not None and p.parallel == "pp":
        m = StagedModel(layout, W, ke, hbm, bw, read, tflops, mfu, head, host_bytes, chunk, gpus)
    else:
        m = PlanModel(layout, W, ke, hbm, bw, read, tflops, mfu, head, host_bytes, chunk, kv_scale)
    if gpus is not None:
        g = gpus
        if m.max_users(context, g, True, None) == 0:
            auto = next((n for n in GROUPS if PlanModel(layout, W, ke, hbm, bw, read, tflops, mfu, head, host_bytes,
                                                        chunk).max_users(context, n, True, None)), None)
            raise ValueError(f"--gpus {g} ({p.parallel}): the weights ({W / 1e9:.1f} GB) and one sequence of {context} "
                             f"tokens do not fit {g} {preset.name} GPU(s) (VRAM {hbm / 1e9:.0f} GB, headroom "
                             f"{head / 1e9:.1f} GB, host/CXL {host_bytes / 1e9:.0f} GB per GPU)"
                             + (f"; {auto} GPUs hold them (tensor parallel)" if auto else ""))
    else:
        g = next((n for n in GROUPS if m.budget(n) > 0 and m.max_users(context, n, True, None) > 0), None)
    if g is None:
        raise ValueError(f"the weights ({W / 1e9:.1f} GB) and one sequence of {context} tokens fit no group of up to "
                         f"{GROUPS[-1]} {preset.name} GPUs (VRAM {hbm / 1e9:.0f} GB, headroom {head / 1e9:.1f} GB)")
    slo = tpot_slo_ms / 1e3 if tpot_slo_ms is not None else None
    u_vram = m.max_users(context, g, False, slo)
    u_host = max(u_vram, m.max_users(context, g, True, slo))
    n_without = g * math.ceil(users / u_vram) if u_vram else None
    n_with = g * math.ceil(users / u_host) if u_host else None
    # Without a TPOT target (capacity only): what the host tier holds when decode speed is not bounded.
    u_cap = m.max_users(context, g, True, None)
    n_cap = g * math.ceil(users / u_cap) if u_cap else None
    u_cap_op = math.ceil(users / (n_cap // g)) if n_cap else 0
    u_vram_cap = m.max_users(context, g, False, None)
    n_without_cap = g * math.ceil(users / u_vram_cap) if u_vram_cap else None
    per_tok = kv_bytes_per_token(layout, ke)
    seq_live = live_kv_bytes(layout, context, ke)
    kv_target = m.kv(users, context)
    # Operating point with the host tier: the target's users spread over n_with GPUs.
    u_op = math.ceil(users / (n_with // g)) if n_with else 0
    host_op = m.host_needed(u_op, context, g)
    prefix_tokens = int(round(reuse * context))
    load_bytes = live_kv_bytes(layout, prefix_tokens, ke)
    cold = m.prefill_s(context, context, g)
    warm_load = load_bytes / (g * read * 1e9)
    warm = warm_load + m.prefill_s(context - prefix_tokens, context, g)
    st = state_bytes(layout, ke)
    per = m.per_gpu(u_op, context, g) if u_op else m.per_gpu(0, context, g)
    tiers = hardware.gpu_tier_nodes(p.info, g)
    link_text = link_src if link_src.startswith("measured") or link_src == "--link-gbps" else preset.link_name
    by_node: Dict[Any, Dict[str, Any]] = {}
    for x, t in zip(per, tiers):
        x["weights_bytes"], x["kv_bytes"] = float(x["weights_bytes"]), float(x["kv_bytes"])
        x.update(node=t["node"], node_kind=t["kind"], near_node=t["near_node"], link=link_text, link_gbps=link,
                 host_read_gbps=read)
        if p.parallel == "tp" and gpus is not None:
            x["kv_heads"] = kv_heads_per_gpu
        nd = by_node.setdefault(t["node"], {"node": t["node"], "gpus": [], "host_bytes": 0.0,
                                            "node_bytes": t["node_bytes"]})
        nd["gpus"].append(x["gpu"])
        nd["host_bytes"] += x["host_bytes"]
    record: Dict[str, Any] = {
        "model": {"name": layout.name, "model_type": layout.model_type, "layers": len(layout.layers),
                  "layer_kinds": layout.kinds(), "params": layout.params, "active_params": layout.active_params,
                  "params_source": layout.params_source, "notes": layout.notes},
        "inputs": {"context": context, "users": users, "weight_dtype": p.weight_dtype, "kv_dtype": p.kv_dtype or p.weight_dtype,
                   "reuse": reuse, "gpu": preset.key, "host_bytes_per_gpu": host_bytes, "tpot_slo_ms": tpot_slo_ms,
                   "mfu": mfu, "chunk_bytes": chunk},
        "hardware": {"gpu": preset.name, "hbm_bytes": hbm, "hbm_source": hbm_src, "hbm_gbps": bw, "hbm_gbps_source": bw_src,
                     "bf16_tflops": tflops, "link_gbps": link, "link_source": link_src, "host_node_gbps": node_gbps,
                     "host_node_source": node_src, "host_read_gbps": read,
                     "host_bytes_per_gpu": host_bytes, "host_bytes_source": host_src, "measured_record": measured},
        "kv": {"bytes_per_token": per_tok, "per_sequence_live_bytes": seq_live,
               "sliding_windows": sorted({la.window for la in layout.layers if la.kind in SLIDING_KINDS}),
               "state_bytes_per_sequence": st, "target_cache_bytes": kv_target,
               "target_cache_bytes_by_store": cache_bytes(layout, users, context, ke, chunk=chunk)},
        "vram": {"per_gpu_bytes": hbm, "weights_per_gpu": W / g, "headroom_per_gpu": head,
                 "kv_per_gpu": sum(x["kv_vram_bytes"] for x in per) / g, "kv_room_per_gpu": m.budget(g) / g,
                 "state_per_gpu": u_op * m.state / g},
        "parallel": {"gpus": g, "mode": p.parallel if g > 1 else "none", "gpus_given": gpus is not None,
                     "rule": ("tensor parallel: each GPU a 1/g slice of every layer's heads and weights"
                              + (f" ({kv_heads_per_gpu} KV head(s) per GPU"
                                 + (f", copied: the group holds {kv_scale:g}x the KV)" if kv_scale != 1 else ")")
                                 if kv_heads_per_gpu else ""))
                     if p.parallel == "tp" else
                     "pipeline parallel: contiguous layers per GPU (the first stages one more when uneven), "
                     "embeddings on the first, norm and lm_head on the last; times add up over the stages"},
        "per_gpu": per,
        "per_node": list(by_node.values()),
        "capacity": {"group_gpus": g, "sequences_per_group_vram_only": u_vram,
                     "sequences_per_group_with_host": u_host,
                     "sequences_per_gpu_vram_only": u_vram / g, "sequences_per_gpu_with_host": u_host / g},
        "decode": {"sequences_per_group_at_target": u_op,
                   "tpot_ms_vram_only": m.step_s(u_vram, context, g, False) * 1e3 if u_vram else None,
                   "tpot_ms_with_host": m.step_s(u_op, context, g) * 1e3 if u_op else None,
                   "host_share_with_host": m.host_share(u_op, context, g) if u_op else 0.0,
                   "bytes_per_step_hbm": (W + (1 - m.host_share(u_op, context, g)) * u_op * seq_live) if u_op else None,
                   "bytes_per_step_link": m.host_share(u_op, context, g) * u_op * seq_live if u_op else None},
        "ttft": {"cold_ms": cold * 1e3, "warm_ms": warm * 1e3, "prefix_tokens": prefix_tokens,
                 "prefix_load_bytes": load_bytes, "prefix_load_ms": warm_load * 1e3,
                 "speedup": cold / warm if warm > 0 else None},
        "gpus": {"without_host": n_without, "with_host": n_with,
                 "ratio": (n_without / n_with) if (n_without and n_with) else None,
                 "with_host_capacity_only": n_cap,
                 "without_host_capacity_only": n_without_cap,
                 "ratio_capacity_only": (n_without_cap / n_cap) if (n_without_cap and n_cap) else None,
                 "tpot_ms_capacity_only": m.step_s(u_cap_op, context, g) * 1e3 if u_cap_op else None},
        "host": {"bytes_needed_per_gpu": host_op / g, "bytes_needed_total": host_op * (n_with // g if n_with else 0),
                 "reuse_pool_bytes_upper": users * load_bytes},
        "assumptions": [
            f"weights {W / 1e9:.2f} GB ({'--weight-bytes' if p.weight_bytes else layout.params_source}), "
            f"one copy per group of {g} GPU(s), all in VRAM"
            + (f", {'layers split (pipeline)' if p.parallel == 'pp' else 'tensor parallel'} (--gpus)"
               if gpus is not None else ""),
            f"headroom {head / GiB:.1f} GiB per GPU left to activations "
            f"({'--headroom' if p.headroom_bytes is not None else 'max(2 GiB, 10% of VRAM)'})",
            "one CxlCache of all sequences per group (the engine's shared store; 2 MiB chunks)",
            "decode reads every weight and every live KV byte once per step; no compute, launch or overlap terms "
            "(a lower bound of TPOT)",
            f"KV beyond VRAM sits on the host tier, read in place at min(link, node) = {read:.0f} GB/s",
            f"prefill at {mfu:.0%} of {tflops:.0f} TFLOPS dense BF16",
            f"TPOT target {tpot_slo_ms} ms" if tpot_slo_ms is not None else "no TPOT target: capacity only",
            "reuse pool bound: one distinct prefix per user",
        ],
    }
    if m.state:
        record["assumptions"].append(f"fixed-size state of stateful layers (SSM/conv): {m.state / 1e6:.2f} MB per "
                                     f"sequence in VRAM (transformers' memory, untiered)")
    if p.records and measured is None:
        record["assumptions"].append(f"no measured ceilings record of {preset.name} in {', '.join(p.records)}: "
                                     f"datasheet rates")
    if st is None:
        record["assumptions"].append("stateful layers whose state size the config does not give: not counted")
    cc = curve_contexts or [4096, 8192, 16384, 32768, 65536, 131072]
    cu = curve_users or [2 ** i for i in range(11)]  # 1 .. 1024 sequences per model copy
    record["curves"] = {
        "contexts": cc,
        "sequences_per_group_vram_only": [m.max_users(c, g, False, slo) for c in cc],
        "sequences_per_group_with_host": [m.max_users(c, g, True, slo) for c in cc],
        "users": cu,
        "tpot_ms_vram_only": [m.step_s(u, context, g, False) * 1e3 if m.fits(u, context, g, False, None) else None
                              for u in cu],
        "tpot_ms_with_host": [m.step_s(u, context, g) * 1e3 if m.fits(u, context, g, True, None) else None
                              for u in cu],
    }
    return record
