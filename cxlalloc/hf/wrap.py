"""``cxlalloc.hf.wrap(model)``: HuggingFace generate() with its KV cache in cxlalloc.

After ``wrap``, ``model.generate(...)`` (any call the user already makes) allocates
its KV cache as a :class:`cxlalloc.hf.CxlCache` (a :class:`CxlEncoderDecoderCache`
for an encoder-decoder model): full-attention K/V in cxlalloc
extents of class ``kv``, placed by the KV-aware policy (newest tokens in VRAM,
oldest demoted to the host tier once the device budget is used), grown without
copying.  Nothing else about the call changes.

Which allocator:
    * the process-wide engine (``cxlalloc.enable()`` / ``CXLALLOC=...``) when one
      exists for the model's device ("global" mode): weights are already
      allocated through it;
    * otherwise a :class:`cxlalloc.Allocator` of its own built from ``**options``
      ("scoped" mode).  Its budget then covers the model's **weights too**: they
      are moved into it (class ``weight``) so that ``device_limit`` bounds
      weights + KV as it would in global mode.  torch's activations stay in
      torch's allocator and are not counted (in simulation they are ordinary CPU
      memory and not modelled at all).

Copies: ``copy.deepcopy(model)``, ``pickle``, ``torch.save(model)`` work on a
wrapped model and give a plain, **unwrapped** model (weights copied into torch's
own memory, transformers' own generate()), with one
:class:`UnwrappedCopyWarning`; call :func:`wrap` on the copy to tier it.
``model.state_dict()`` and ``save_pretrained`` are unaffected (plain tensors).

Simulation (no GPU): a model on the CPU with ``simulate=True`` (the default for a
CPU model) runs on the CPU as usual while its weights and KV live in cxlalloc's
simulated device/host tiers (host memory pretending to be VRAM), so placement,
spills, demotions and copies are the real engine's; speeds are not a GPU's.

How generate() is intercepted: an instance-level override of transformers'
``GenerationMixin._prepare_cache_for_generation(generation_config, model_kwargs,
generation_mode, batch_size, max_cache_length)`` (same signature in 5.17 and 5.24)
swaps the ``DynamicCache`` it builds for a ``CxlCache`` sized ``max_cache_length``
(= ``max_length - 1``).  If that private method is missing or its signature
changed, the wrapper falls back to injecting a ``CxlCache`` into the generate()
call (capacity then grows geometrically).  Passing a ``CxlCache`` yourself under
:func:`cxlalloc.hf.cache_kwarg` is the public path and always works.

A forward pre-hook plans each forward's cache update before the forward runs
(:meth:`CxlCache.prepare_forward`: the engine calls happen there), so that a
``torch.compile``'d ``model.forward`` traces the update as tensor operations,
without a graph break, and compiles no more often than with ``DynamicCache``.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Dict, List, Optional

import torch

from cxlalloc import _C
from cxlalloc.allocator import Allocator
from cxlalloc.config import format_bytes, make_config
from cxlalloc.engine import ensure_sim
from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.compat import TRANSFORMERS_VERSION, cache_kwarg
from cxlalloc.hf.devices import (TP_WEIGHTS, GpuLayout, TensorParallelWarning, model_layout, per_gpu_options,
                                 sum_stats, tp_size)
from cxlalloc.hf.model_caches import own_cache_class
from cxlalloc.hf.reuse import PrefixReuse, parse_reuse_options
from cxlalloc.hf.generate_hooks import make_generate, make_pre_forward, make_prepare_hook, predicted_report, warn_once
from cxlalloc.hf.wrap_state import (INSTANCE_ATTRS, STATE_ATTR, GetState, UnwrappedCopyWarning,  # noqa: F401
                                    WrapState, _state, is_wrapped)
from cxlalloc.hf import paged

HOOK_PARAMS = ("generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length")
# Scoped mode on a GPU without a device_limit: VRAM left to torch's own allocator
# (activations, logits, cuBLAS workspaces) = max(2 GiB, 10% of VRAM).  Not yet
# measured on a GPU.
ACTIVATION_RESERVE_MIN = 2 << 30
ACTIVATION_RESERVE_FRACTION = 0.10


def _options_config(options: dict, device: torch.device, gpu: Optional[int] = None):
    """``options`` as values: a :class:`cxlalloc.config.Config` with the
    defaults wrap() applies (``simulate`` from the model's device, ``device``
    from a CUDA model's index, or ``gpu``: one simulated GPU of a model spread
    over several), so that ``"4MiB"``, ``4 << 20`` and ``"4194304"`` compare equal.

    Raises:
        ValueError: an unknown option or a bad value (naming it).
    """
    eff = dict(options)
    if eff.get("simulate") is None:
        eff["simulate"] = device.type == "cpu"
    if eff.get("device") is None:
        if gpu is not None:
            eff["device"] = gpu
        elif device.type == "cuda":
            eff["device"] = device.index or 0
    return make_config(**eff)


def _options_configs(options: dict, device: torch.device, layout: GpuLayout) -> Dict[int, object]:
    """``{gpu: Config}``: :func:`_options_config` of each GPU's options
    (:func:`cxlalloc.hf.devices.per_gpu_options`)."""
    per = per_gpu_options(options, layout.gpus)
    if layout.multi:
        return {g: _options_config(per[g], device, g) for g in layout.gpus}
    return {g: _options_config(per[g], device) for g in layout.gpus}


# Config fields that hold bytes (int) or a fraction (float); shown as sizes/percentages.
_SIZE_FIELDS = ("device_limit", "host_limit", "kv_device_limit", "device_headroom", "extent_chunk", "sim_vram",
                "spill_reserve")


def _show_option(name: str, value) -> str:
    if value is None:
        return "default"
    if name in _SIZE_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        return format_bytes(value)
    if name in _SIZE_FIELDS and isinstance(value, float):
        return f"{value * 100:g}%"
    if name == "migration_rate":
        return f"{format_bytes(int(value))}/s"
    return repr(value)


def _option_differences(old, new) -> List[str]:
    """``"name: A (wrapped) vs B (asked)"`` for each option whose value differs
    (type-aware: 1 byte is not 1.0 = 100%)."""
    out = []
    olds, news = vars(old), vars(new)  # Config: a frozen dataclass, its fields in __dict__
    for f in dataclasses.fields(old):
        a, b = olds[f.name], news[f.name]
        if type(a) is not type(b) or a != b:
            out.append(f"{f.name}: {_show_option(f.name, a)} (wrapped) vs {_show_option(f.name, b)} (asked)")
    return out


def _model_device(model, layout: GpuLayout) -> torch.device:
    """The device the model runs on: the CPU in simulation, else its first GPU."""
    dev = next(p.device for p in model.parameters() if p.device.type != "meta")
    return dev if dev.type != "cuda" else torch.device("cuda", layout.gpus[0])


def _global_allocator(device: torch.device, simulate: bool):
    try:
        engine = _C.current_engine()
    except Exception:
        return None
    if engine is None or bool(engine.simulated) != simulate:
        return None
    idx = 0 if device.type == "cpu" else (device.index or 0)
    if not engine.has_config(idx):
        return None
    return Allocator.from_engine(engine, idx)


def _place_weights(model, allocators: Dict[int, Allocator], layout: GpuLayout, device: torch.device):
    """Move every parameter into the allocator of its GPU (class ``weight``),
    bytes unchanged.  Returns (bytes, params, {gpu: bytes})."""
    total = n = since = 0
    gpu_of = layout.param_gpu(model) if layout.multi else {}
    per_gpu = {g: 0 for g in allocators}
    with torch.no_grad():
        for p in model.parameters():  # tied parameters are visited once
            if p.numel() == 0:
                continue
            gpu = gpu_of.get(id(p), layout.gpus[0])
            t = allocators[gpu].tensor(p.shape, p.dtype, tag="weight")
            t.copy_(p.data)
            p.data = t
            nbytes = t.numel() * t.element_size()
            per_gpu[gpu] += nbytes
            total += nbytes
            since += nbytes
            n += 1
            if device.type == "cuda" and since >= (512 << 20):
                torch.cuda.empty_cache()  # give torch's cached copies back before cxlalloc maps more VRAM
                since = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return total, n, per_gpu


def _prepare_hook_ok(model) -> bool:
    fn = getattr(type(model), "_prepare_cache_for_generation", None)
    if fn is None:
        return False
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(params[1:6]) == HOOK_PARAMS


def wrap(model, *, place_weights: Optional[bool] = None, hook: str = "auto", **options):
    """Make ``model.generate()`` keep its KV cache in cxlalloc.  Returns ``model``.

    Args:
        model: a transformers ``PreTrainedModel`` with ``generate()`` (decoder-only,
            or encoder-decoder: a :class:`CxlEncoderDecoderCache`), on one CUDA
            device, or on the CPU for simulation.  A decoder-only model spread
            over several GPUs (accelerate's ``device_map="auto"``/``"balanced"``
            /a dict) gets one allocator per GPU: each decoder layer's KV lives
            in its GPU's allocator, spilling to that GPU's host tier, and each
            parameter is placed in its GPU's allocator
            (:mod:`cxlalloc.hf.devices`; in simulation a CPU model's
            ``hf_device_map`` names simulated GPUs).  Cache layers left to
            transformers are said once (:class:`CacheCoverageWarning`, here when
            the config tells, else at the first generate()) and counted in
            ``stats(model)["hf"]["layers"]``.
        place_weights: move the parameters into the allocator (class ``weight``)
            so ``device_limit`` covers weights + KV.  Default: True with an
            allocator of its own ("scoped"), False with the process-wide engine
            (weights are already allocated through it).
        hook: ``"auto"`` (default), ``"prepare"`` (override
            ``_prepare_cache_for_generation``; capacity = ``max_length - 1``) or
            ``"generate"`` (inject a growing ``CxlCache`` into each call).
        **options: :class:`cxlalloc.Allocator` options: ``device_limit``,
            ``host_limit``, ``simulate``, ``kv_device_limit``,
            ``device_headroom``, ``numa_node``, ``backend``, ... (sizes in bytes
            or strings like ``"512MiB"``).  ``simulate`` defaults to True for a
            CPU model.  ``device_limit``, ``kv_device_limit``, ``host_limit`` and
            ``numa_node`` take one value for every GPU, a list of one value per
            GPU of the model (in increasing GPU index) or a mapping
            ``{GPU index or "cuda:i": value}`` (a GPU left out: the default);
            ``numa_node="auto"`` picks each GPU's own nearest node
            (:func:`cxlalloc.topology.choose_host_node` with that GPU's
            ``HOST_NUMA_ID``).  On a GPU without ``device_limit``: free VRAM + the
            weights moved in - max(2 GiB, 10% of VRAM) left to torch.

    A wrapped model can be deep-copied, pickled and ``torch.save``'d: the copy
    is unwrapped (:class:`UnwrappedCopyWarning`).

    Raises:
        ValueError: a bad option; a CPU model with ``simulate=False`` (or a CUDA
            model with ``simulate=True``); a model spread over the CPU and GPUs
            (accelerate's offload), a per-GPU option of the wrong shape or
            naming a GPU the model does not use, ``device`` given for a model
            on several GPUs, an encoder-decoder model on several GPUs;
            options given while the process-wide engine serves the device; the
            model is already wrapped with other options.  Wrapping a wrapped
            model again returns it unchanged when no options are given or when
            they have the same values (``device_limit="4MiB"`` and
            ``device_limit=4 << 20`` are the same; an option left out counts
            as its default).
        TypeError: ``model`` has no ``generate()``/``parameters()`` (not a
            transformers model).
        cxlalloc.OutOfMemoryError: the weights fit in neither tier.
    """
    if not (callable(getattr(model, "generate", None)) and callable(getattr(model, "parameters", None))):
        raise TypeError(f"cxlalloc.hf.wrap: model must be a transformers model with generate() (a torch.nn.Module "
                        f"with transformers' GenerationMixin), not {type(model).__name__}; for any other PyTorch "
                        "code use cxlalloc.enable() (or CXLALLOC=1)")
    if hook not in ("auto", "prepare", "generate"):
        raise ValueError(f"cxlalloc.hf.wrap: hook must be 'auto', 'prepare' or 'generate', not {hook!r}")
    given = dict(options)
    reuse_opts = parse_reuse_options(options)  # pops kv_store, block_tokens, ... (validated)
    if is_wrapped(model):
        st = _state(model)
        if given:
            old, new = st.configs, _options_configs(options, st.device, st.layout)
            diff = []
            for g in st.layout.gpus:
                where = f"cuda:{g} " if st.layout.multi else ""
                diff += [where + d for d in _option_differences(old[g], new[g])]
            if reuse_opts != st.reuse_options:
                diff.append(f"kv reuse: {st.reuse_options} (wrapped) vs {reuse_opts} (asked)")
            if diff:
                raise ValueError(f"cxlalloc.hf.wrap: the model is already wrapped with {st.options} and other "
                                 f"values are asked ({'; '.join(diff)}); call cxlalloc.hf.unwrap(model) first to "
                                 "change options")
        return model
    layout = model_layout(model)
    device = _model_device(model, layout)
    simulate = options.pop("simulate", None)
    if device.type == "cpu":
        if simulate is False:
            raise ValueError("cxlalloc.hf.wrap: the model is on the CPU and simulate=False; cxlalloc tiers GPU memory. "
                             "Move the model to a GPU, or pass simulate=True to run the tiers on cxlalloc's "
                             "simulated driver (no GPU needed)")
        simulate = True
    elif device.type == "cuda":
        if simulate:
            raise ValueError("cxlalloc.hf.wrap: simulate=True needs the model on the CPU (the simulated tiers are "
                             f"host memory), but it is on {device}")
        simulate = False
    else:
        raise ValueError(f"cxlalloc.hf.wrap: the model is on {device}; cxlalloc supports CUDA devices (or the CPU "
                         "with simulate=True)")
    if layout.multi:
        if options.get("device") is not None:
            raise ValueError(f"cxlalloc.hf.wrap option 'device': the model is spread over GPUs {layout.gpus} (its "
                             "device map says which GPU each layer's KV uses); leave 'device' out")
        if getattr(model.config, "is_encoder_decoder", False) or own_cache_class(model) is not None:
            raise ValueError(f"cxlalloc.hf.wrap: the model is spread over GPUs {layout.gpus}; wrap() tiers a "
                             "decoder-only model with transformers' cache layers over several GPUs, not an "
                             f"encoder-decoder model or a model with its own cache class ({type(model).__name__}); "
                             "load it on one GPU")
    tp = tp_size(model)
    if tp > 1:
        if place_weights:
            raise ValueError(TP_WEIGHTS.format(tp=tp) + "; place_weights=True cannot apply: leave it out")
        place_weights = False
        warnings.warn(TP_WEIGHTS.format(tp=tp), TensorParallelWarning, stacklevel=2)
    configs = _options_configs(dict(options, simulate=simulate), device, layout)  # validates every option
    per_gpu = per_gpu_options(options, layout.gpus)
    found = {g: _global_allocator(device if simulate and not layout.multi else torch.device("cuda", g), simulate)
             for g in layout.gpus}
    if all(a is not None for a in found.values()):
        if options:
            raise ValueError(f"cxlalloc.hf.wrap: the process-wide cxlalloc engine (cxlalloc.enable()) serves {device}; "
                             f"configure it there, not with wrap() options {sorted(options)}")
        mode = "global"
        allocators = found
        if place_weights is None:
            place_weights = False
    elif any(a is not None for a in found.values()):
        served = [g for g, a in found.items() if a is not None]
        raise ValueError(f"cxlalloc.hf.wrap: the process-wide cxlalloc engine serves GPU(s) {served} of the model's "
                         f"GPUs {layout.gpus}, not all; configure every GPU the model uses there (or none)")
    else:
        mode = "scoped"
        if place_weights is None:
            place_weights = True
        allocators = {}
        gpu_of = layout.param_gpu(model) if layout.multi else {}
        if simulate and layout.multi:
            for g in layout.gpus:  # a simulated machine with the GPUs the device map names
                ensure_sim(configs[g], devices=layout.gpus[-1] + 1)
        for g in layout.gpus:
            kw = dict(per_gpu[g])
            if layout.multi or not simulate:
                kw.setdefault("device", g)
            if not simulate and kw.get("device_limit") is None:
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info(torch.device("cuda", g))
                weights = sum(p.numel() * p.element_size() for p in model.parameters()
                              if gpu_of.get(id(p), g) == g) if place_weights else 0
                reserve = max(ACTIVATION_RESERVE_MIN, int(ACTIVATION_RESERVE_FRACTION * total))
                kw["device_limit"] = max(256 << 20, free + weights - reserve)
            try:
                allocators[g] = Allocator(simulate=simulate, _made_by='cxlalloc.hf.wrap(model, ..., host_limit="64GiB")',
                                          **kw)
            except ValueError as e:
                if simulate and layout.multi and "not a CUDA device ordinal" in str(e):
                    raise ValueError(f"cxlalloc.hf.wrap: the model's hf_device_map places layers on simulated GPUs "
                                     f"{layout.gpus}, but the simulated driver has fewer GPUs ({e}); it gains GPUs "
                                     "only while no simulated allocator is alive: wrap this model first, or free the "
                                     "others") from None
                if layout.multi:  # which GPU's value is at fault (a per-GPU list or mapping names several)
                    raise ValueError(f"cxlalloc.hf.wrap, GPU cuda:{g} of the model's {['cuda:%d' % x for x in layout.gpus]}: "
                                     f"{e}") from None
                raise
    allocator = allocators[layout.gpus[0]]

    st = WrapState(allocator=allocator, mode=mode, device=device, cache_kw=cache_kwarg(model),
                   hook="prepare" if (hook != "generate" and _prepare_hook_ok(model)) else "generate",
                   options=given, config=configs[layout.gpus[0]], configs=configs, layout=layout,
                   allocators=allocators)
    if hook == "prepare" and st.hook != "prepare":
        raise ValueError("cxlalloc.hf.wrap: hook='prepare' but this transformers version has no "
                         "_prepare_cache_for_generation with the expected signature; use hook='auto'")
    if place_weights:
        st.weight_bytes, st.weight_params, st.weight_bytes_per_gpu = _place_weights(model, allocators, layout, device)
        st.weights_placed = True
    if reuse_opts is not None:
        st.reuse_options = reuse_opts
        st.reuse = PrefixReuse(model, allocator, reuse_opts, st.cache_kw, layer_allocators=st.layer_allocators())

    st.orig_generate = model.generate
    if st.hook == "prepare":
        st.orig_prepare = model._prepare_cache_for_generation
        model.__dict__["_prepare_cache_for_generation"] = make_prepare_hook(model, st)
    model.__dict__["generate"] = make_generate(model, st)
    if callable(getattr(model, "init_continuous_batching", None)):
        st.cb = paged.install(model, st)
    model.__dict__["__getstate__"] = GetState(model)
    model.__dict__[STATE_ATTR] = st
    st.pre_hook = model.register_forward_pre_hook(make_pre_forward(model, st), with_kwargs=True)
    st.layer_report = predicted_report(model, st)
    if st.layer_report is not None:
        warn_once(st, st.layer_report, measured=False, stacklevel=3)
    return model


def unwrap(model):
    """Undo :func:`wrap`: remove the hooks and copy the weights back into torch's
    own memory.  Caches already created keep their storage until dropped; a
    block store the wrap opened from a ``kv_store`` spec is closed (its Redis
    writer thread, its kv-server connection).  Returns ``model``."""
    st = _state(model)
    if st.reuse is not None:
        st.reuse.close()
    if st.pre_hook is not None:
        st.pre_hook.remove()
    for name in INSTANCE_ATTRS:
        model.__dict__.pop(name, None)
    if st.weights_placed:
        with torch.no_grad():
            for p in model.parameters():
                if p.numel():
                    p.data = p.data.clone()
    return model


def generate(model, *args, **kwargs):
    """``model.generate(*args, **kwargs)`` with the KV cache in cxlalloc: wraps
    the model first (default options: simulation for a CPU model) if it is not
    wrapped yet.  Returns what generate() returns."""
    if not is_wrapped(model):
        wrap(model)
    return model.generate(*args, **kwargs)


def allocator(model):
    """The :class:`cxlalloc.Allocator` behind a wrapped model (for a model on
    several GPUs, its first GPU's: :func:`allocators` gives each GPU's)."""
    return _state(model).allocator


def allocators(model) -> dict:
    """``{"cuda:i": cxlalloc.Allocator}``: the allocator of each GPU of a wrapped
    model (one entry for a model on one device; in simulation the simulated
    GPU's ordinal).

    Raises:
        ValueError: the model is not wrapped.
    """
    st = _state(model)
    found = st.allocators or {st.allocator.device: st.allocator}
    return {f"cuda:{g}": a for g, a in sorted(found.items())}


def forget_conversation(model) -> None:
    """Release the previous turn's cache that ``kv_store`` reuse keeps for the
    next turn of the same conversation (``kv_conversation_limit``), freeing
    its KV memory now; the next generate() starts from the block store.
    Nothing happens for a model without ``kv_store``."""
    st = _state(model)
    if st.reuse is not None:
        st.reuse.forget_conversation()


def kv_cache(model) -> Optional[CxlCache]:
    """The most recent :class:`CxlCache` of a wrapped model if it is still alive
    (e.g. returned by ``generate(..., return_dict_in_generate=True)``), else None."""
    return _state(model).last_cache()


def stats(model) -> dict:
    """The allocator's stats dict (:meth:`cxlalloc.Allocator.stats`: per tier
    and per class ``kv``/``weight``/``other`` bytes, spilled/demoted/promoted
    bytes, ...; for a model spread over several GPUs the totals over its GPUs'
    allocators: numbers summed, peaks as the sum of each GPU's peak, names such
    as ``device``/``numa_node`` listed per GPU), ``"gpus"``: each GPU's own
    stats dict by ``"cuda:i"`` (a simulated GPU's ordinal in simulation; one
    entry for a model on one device), plus ``"hf"``: ``mode``
    ("scoped"/"global"), ``simulated``, ``device`` (the first GPU, or the CPU in
    simulation), ``gpus`` (``["cuda:i", ...]``), ``layer_gpus`` (each decoder
    layer's GPU by layer index; None on one GPU), ``weight_bytes_per_gpu``,
    ``transformers`` (version), ``hook``, ``weights_placed``,
    ``weight_bytes``, ``weight_params``, ``caches_created``, ``cache``: the
    :meth:`CxlCache.kv_stats` of the most recent cache (live, or as it was when
    its generate() call returned; None before the first call), and ``layers``:
    which cache layers are tiered and which are left to transformers
    (:func:`cxlalloc.hf.coverage.layer_report`: ``tiered`` / ``untiered`` /
    ``fixed_state`` / ``no_storage`` as ``{kind: layers}``,
    ``untiered_kv_bytes``, ``untiered_state_bytes``, ``cache_class``; of the
    last generate(), or predicted from the config before one; None when
    unknown), ``reuse`` (KV reuse of generate()), and ``continuous_batching``:
    the paged cache of ``generate_batch`` / ``init_continuous_batching``
    (:meth:`cxlalloc.hf.paged.CBState.stats`: ``tiered``, ``cache`` with
    blocks and KV bytes per tier, ``swap_pool``, ``kv_store``, ``counters``;
    docs/huggingface.md#continuous-batching).

    Raises:
        ValueError: the model is not wrapped.
    """
    st = _state(model)
    allocators = st.allocators or {st.allocator.device: st.allocator}
    per_gpu = {f"cuda:{g}": a.stats() for g, a in sorted(allocators.items())}
    d = sum_stats(list(per_gpu.values())) if len(per_gpu) > 1 else dict(next(iter(per_gpu.values())))
    d["gpus"] = per_gpu
    live = st.last_cache()
    d["hf"] = {
        "mode": st.mode,
        "simulated": bool(st.allocator.simulated),
        "device": str(st.device),
        "gpus": [f"cuda:{g}" for g in sorted(allocators)],
        "layer_gpus": [f"cuda:{g}" for g in st.layout.layer_gpu] if st.multi else None,
        "weight_bytes_per_gpu": {f"cuda:{g}": b for g, b in sorted(st.weight_bytes_per_gpu.items())},
        "transformers": TRANSFORMERS_VERSION,
        "hook": st.hook,
        "weights_placed": st.weights_placed,
        "weight_bytes": st.weight_bytes,
        "weight_params": st.weight_params,
        "caches_created": st.caches_created,
        "cache": live.kv_stats() if live is not None else st.last_stats,
        "layers": st.layer_report,
        "reuse": st.reuse.stats() if st.reuse is not None else {"enabled": False, "off_reason": "kv_store not set"},
        "continuous_batching": st.cb.stats() if st.cb is not None else None,
    }
    return d
