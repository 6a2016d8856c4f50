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
from typing import List, Optional

import torch

from cxlalloc import _C
from cxlalloc.allocator import Allocator
from cxlalloc.config import format_bytes, make_config
from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.compat import TRANSFORMERS_VERSION, cache_kwarg
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


def _options_config(options: dict, device: torch.device):
    """``options`` as values: a :class:`cxlalloc.config.Config` with the
    defaults wrap() applies (``simulate`` from the model's device, ``device``
    from a CUDA model's index), so that ``"4MiB"``, ``4 << 20`` and
    ``"4194304"`` compare equal.

    Raises:
        ValueError: an unknown option or a bad value (naming it).
    """
    eff = dict(options)
    if eff.get("simulate") is None:
        eff["simulate"] = device.type == "cpu"
    if device.type == "cuda" and eff.get("device") is None:
        eff["device"] = device.index or 0
    return make_config(**eff)


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


def _model_device(model) -> torch.device:
    devices = {p.device for p in model.parameters() if p.device.type != "meta"}
    if not devices:
        raise ValueError("cxlalloc.hf: the model has no parameters on a real device (all on 'meta')")
    if len(devices) > 1:
        raise ValueError(f"cxlalloc.hf: the model is spread over {sorted(map(str, devices))}; wrap() supports a model "
                         "on one device (one GPU, or the CPU in simulation)")
    return devices.pop()


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


def _place_weights(model, allocator, device: torch.device):
    """Move every parameter into ``allocator`` (class ``weight``), bytes
    unchanged.  Returns (bytes, params)."""
    total = n = since = 0
    with torch.no_grad():
        for p in model.parameters():  # tied parameters are visited once
            if p.numel() == 0:
                continue
            t = allocator.tensor(p.shape, p.dtype, tag="weight")
            t.copy_(p.data)
            p.data = t
            nbytes = t.numel() * t.element_size()
            total += nbytes
            since += nbytes
            n += 1
            if device.type == "cuda" and since >= (512 << 20):
                torch.cuda.empty_cache()  # give torch's cached copies back before cxlalloc maps more VRAM
                since = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return total, n


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
            device, or on the CPU for simulation.  Cache layers left to
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
            CPU model.  On a GPU without ``device_limit``: free VRAM + the
            weights moved in - max(2 GiB, 10% of VRAM) left to torch.

    A wrapped model can be deep-copied, pickled and ``torch.save``'d: the copy
    is unwrapped (:class:`UnwrappedCopyWarning`).

    Raises:
        ValueError: a bad option; a CPU model with ``simulate=False`` (or a CUDA
            model with ``simulate=True``); a model spread over several devices;
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
            diff = _option_differences(st.config, _options_config(options, st.device))
            if reuse_opts != st.reuse_options:
                diff.append(f"kv reuse: {st.reuse_options} (wrapped) vs {reuse_opts} (asked)")
            if diff:
                raise ValueError(f"cxlalloc.hf.wrap: the model is already wrapped with {st.options} and other "
                                 f"values are asked ({'; '.join(diff)}); call cxlalloc.hf.unwrap(model) first to "
                                 "change options")
        return model
    device = _model_device(model)
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

    config = _options_config(dict(options, simulate=simulate), device)  # validates every option
    allocator = _global_allocator(device, simulate)
    if allocator is not None:
        if options:
            raise ValueError(f"cxlalloc.hf.wrap: the process-wide cxlalloc engine (cxlalloc.enable()) serves {device}; "
                             f"configure it there, not with wrap() options {sorted(options)}")
        mode = "global"
        if place_weights is None:
            place_weights = False
    else:
        mode = "scoped"
        if place_weights is None:
            place_weights = True
        kw = dict(options)
        if not simulate:
            kw.setdefault("device", device.index or 0)
            if kw.get("device_limit") is None:
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info(device)
                weights = sum(p.numel() * p.element_size() for p in model.parameters()) if place_weights else 0
                reserve = max(ACTIVATION_RESERVE_MIN, int(ACTIVATION_RESERVE_FRACTION * total))
                kw["device_limit"] = max(256 << 20, free + weights - reserve)
        allocator = Allocator(simulate=simulate, _made_by='cxlalloc.hf.wrap(model, ..., host_limit="64GiB")', **kw)

    st = WrapState(allocator=allocator, mode=mode, device=device, cache_kw=cache_kwarg(model),
                   hook="prepare" if (hook != "generate" and _prepare_hook_ok(model)) else "generate",
                   options=given, config=config)
    if hook == "prepare" and st.hook != "prepare":
        raise ValueError("cxlalloc.hf.wrap: hook='prepare' but this transformers version has no "
                         "_prepare_cache_for_generation with the expected signature; use hook='auto'")
    if place_weights:
        st.weight_bytes, st.weight_params = _place_weights(model, allocator, device)
        st.weights_placed = True
    if reuse_opts is not None:
        st.reuse_options = reuse_opts
        st.reuse = PrefixReuse(model, allocator, reuse_opts, st.cache_kw)

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
    """The :class:`cxlalloc.Allocator` behind a wrapped model."""
    return _state(model).allocator


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
    bytes, ...) plus ``"hf"``: ``mode`` ("scoped"/"global"), ``simulated``,
    ``device``, ``transformers`` (version), ``hook``, ``weights_placed``,
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
    d = st.allocator.stats()
    live = st.last_cache()
    d["hf"] = {
        "mode": st.mode,
        "simulated": bool(st.allocator.simulated),
        "device": str(st.device),
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
