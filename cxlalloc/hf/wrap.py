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
import functools
import inspect
import sys
import threading
import warnings
import weakref
from typing import Any, List, Optional

import torch
from torch._dynamo.eval_frame import skip_code
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache

from cxlalloc import _C
from cxlalloc.allocator import Allocator
from cxlalloc.config import format_bytes, make_config
from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.coverage import (CacheCoverageWarning, layer_report, needs_warning, signature, tensor_bytes,
                                  warning_text)
from cxlalloc.hf.encdec import CxlEncoderDecoderCache
from cxlalloc.hf.model_caches import cxl_cache_for, own_cache_class
from cxlalloc.hf.storage import Geometry
from cxlalloc.hf.compat import TRANSFORMERS_VERSION, cache_kwarg, returned_cache
from cxlalloc.hf.reuse import PrefixReuse, parse_reuse_options
from cxlalloc.hf import paged

STATE_ATTR = "_cxlalloc_hf"
# Instance attributes wrap() sets on the model (unwrap() and copies drop them).
INSTANCE_ATTRS = ("_prepare_cache_for_generation", "generate", "init_continuous_batching", "__getstate__", STATE_ATTR)
# forward() keywords under which models without a transformers Cache pass their own
# state back in (XLNet / Transfo-XL "mems", RWKV "state", Reformer "past_buckets_states").
OWN_STATE_KWARGS = ("mems", "state", "past_buckets_states")
HOOK_PARAMS = ("generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length")
# Scoped mode on a GPU without a device_limit: VRAM left to torch's own allocator
# (activations, logits, cuBLAS workspaces) = max(2 GiB, 10% of VRAM).  Not yet
# measured on a GPU.
ACTIVATION_RESERVE_MIN = 2 << 30
ACTIVATION_RESERVE_FRACTION = 0.10


class UnwrappedCopyWarning(UserWarning):
    """A wrapped model was deep-copied or pickled: the copy is a plain model."""


COPY_WARNING = ("cxlalloc.hf: copying/pickling a wrapped model gives an unwrapped copy (transformers' own generate(); "
                "a deep copy or a pickle has its weights in torch's memory); call cxlalloc.hf.wrap() on the copy to "
                "tier it")


_COPY_MODULES = ("copy", "copyreg", "pickle", "torch.serialization")


def _caller_level() -> int:
    """``stacklevel`` that points a warning raised in ``_GetState.__call__`` at
    the user's deepcopy/pickle/torch.save line, past the copy machinery."""
    level, f = 2, sys._getframe(2)  # level 2: the frame that called __call__
    while f is not None and f.f_globals.get("__name__") in _COPY_MODULES:
        level, f = level + 1, f.f_back
    return level


class _GetState:
    """``model.__getstate__`` of a wrapped model (an instance attribute, found
    before the class's by ``copy``/``pickle``): the model class's state without
    what wrap() attached (the allocator, the hooks: not picklable, and bound to
    this model), so that deepcopy/pickle/torch.save give a plain model."""

    def __init__(self, model):
        self._model = weakref.ref(model)

    def __call__(self):
        model = self._model()
        if model is None:  # cannot happen while the model is being copied
            raise TypeError("cxlalloc.hf: the wrapped model is gone")
        warnings.warn(COPY_WARNING, UnwrappedCopyWarning, stacklevel=_caller_level())
        base = getattr(type(model), "__getstate__", None)
        state = dict(base(model) if base is not None else model.__dict__)
        for name in INSTANCE_ATTRS:
            state.pop(name, None)
        st = model.__dict__.get(STATE_ATTR)
        hook_id = getattr(getattr(st, "pre_hook", None), "id", None)
        for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):  # the copy's dicts, not the model's
            if hook_id is not None and isinstance(state.get(name), dict) and hook_id in state[name]:
                state[name] = type(state[name])((k, v) for k, v in state[name].items() if k != hook_id)
        return state


@dataclasses.dataclass
class WrapState:
    """What :func:`wrap` attached to a model (``model._cxlalloc_hf``)."""

    allocator: Any
    mode: str  # "scoped" (own Allocator) or "global" (the process-wide engine)
    device: torch.device
    cache_kw: str
    hook: str  # "prepare" or "generate"
    options: dict  # as given to wrap() (for messages)
    config: Any = None  # the options as values (cxlalloc.config.Config), compared on a repeated wrap()
    weights_placed: bool = False
    weight_bytes: int = 0
    weight_params: int = 0
    caches_created: int = 0
    last_stats: Optional[dict] = None
    orig_prepare: Any = None
    orig_generate: Any = None
    reuse: Any = None  # cxlalloc.hf.reuse.PrefixReuse when kv_store is set
    reuse_options: Any = None
    _tls: Any = dataclasses.field(default_factory=threading.local)  # per thread: caches of its running generate()
    pre_hook: Any = None  # handle of the forward pre-hook (_make_pre_forward)
    _last: Any = None  # weakref to the last cache
    layer_report: Optional[dict] = None  # cxlalloc.hf.coverage.layer_report of the last generate() (or predicted)
    warned: set = dataclasses.field(default_factory=set)  # coverage situations already warned about
    cb: Any = None  # cxlalloc.hf.paged.CBState: continuous batching (generate_batch / init_continuous_batching)

    @property
    def _live(self) -> List[Any]:
        live = getattr(self._tls, "live", None)
        if live is None:
            live = self._tls.live = []
        return live

    def new_cache(self, model, max_cache_len: Optional[int], count: bool = True):
        """A CxlCache (a CxlEncoderDecoderCache for an encoder-decoder model)."""
        if count:
            self.caches_created += 1
        cfg = model.config.get_text_config(decoder=True)
        if getattr(model.config, "is_encoder_decoder", False):
            return CxlEncoderDecoderCache(cfg, allocator=self.allocator, max_cache_len=max_cache_len)
        return CxlCache(config=cfg, allocator=self.allocator, max_cache_len=max_cache_len)

    def note(self, cache) -> None:
        if isinstance(cache, (CxlCache, CxlEncoderDecoderCache)):
            self._live.append(cache)
            self._last = weakref.ref(cache)

    def last_cache(self) -> Optional[CxlCache]:
        return None if self._last is None else self._last()


def _state(model) -> WrapState:
    st = model.__dict__.get(STATE_ATTR)
    if st is None:
        raise ValueError("cxlalloc.hf: this model is not wrapped; call cxlalloc.hf.wrap(model, ...) first")
    return st


def is_wrapped(model) -> bool:
    return STATE_ATTR in getattr(model, "__dict__", {})


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
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
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
        model.__dict__["_prepare_cache_for_generation"] = _make_prepare_hook(model, st)
    model.__dict__["generate"] = _make_generate(model, st)
    if callable(getattr(model, "init_continuous_batching", None)):
        st.cb = paged.install(model, st)
    model.__dict__["__getstate__"] = _GetState(model)
    model.__dict__[STATE_ATTR] = st
    st.pre_hook = model.register_forward_pre_hook(_make_pre_forward(model, st), with_kwargs=True)
    st.layer_report = _predicted_report(model, st)
    if st.layer_report is not None:
        _warn_once(st, st.layer_report, measured=False, stacklevel=3)
    return model


def _kv_geometry(model, device: torch.device) -> Optional[Geometry]:
    """The K/V state geometry of the model's full-attention layers from its
    config (batch 1; the batch of each forward replaces it), or None."""
    try:
        cfg = model.config.get_text_config(decoder=True)
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_rope_head_dim", None):
            # Multi-head latent attention (DeepSeek-V3/V3.2, GLM-MoE-DSA, Kimi-Linear, ...): the cache holds the
            # compressed latents, single-head: K (B, 1, L, kv_lora_rank), V (B, 1, L, qk_rope_head_dim)
            # (transformers models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3Attention.forward).  A model
            # that caches otherwise only loses the plan (CxlCache.prepare_forward), not correctness.
            return Geometry(1, 1, int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim), dtype, device)
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    except (AttributeError, StopIteration, TypeError, ZeroDivisionError):
        return None
    return Geometry(1, int(heads), int(head_dim), int(head_dim), dtype, device)


def _make_pre_forward(model, st: WrapState):
    """A forward pre-hook that plans a CxlCache's next update before the forward
    runs (:meth:`CxlCache.prepare_forward`): the engine calls happen here, so
    that a ``torch.compile``'d ``model.forward`` traces the cache update without
    a graph break and compiles no more often than with transformers' DynamicCache
    (a graph break inside the forward makes dynamo compile transformers'
    decorated module forwards one by one, which share one code object and
    reach its recompile limit)."""
    geometry = _kv_geometry(model, torch.device("cpu") if st.device.type == "cpu" else st.device)

    @torch.compiler.disable
    def plan(cache, x: torch.Tensor) -> None:
        cache.prepare_forward(int(x.shape[1]), int(x.shape[0]), geometry)  # engine calls: never traced

    @torch.compiler.disable
    def eager(args, kwargs):
        cache = kwargs.get(st.cache_kw)
        tls = st._tls
        if getattr(tls, "depth", 0):  # inside a wrapped generate(): what cache does it use (coverage report)
            tls.forwards = getattr(tls, "forwards", 0) + 1
            used = cache
            for name in OWN_STATE_KWARGS:
                if used is None:
                    used = kwargs.get(name)
            if used is not None:
                if getattr(tls, "seen", None) is None and not isinstance(used, Cache):
                    tls.first_bytes = tensor_bytes(used)  # a plain state: does it grow? (coverage report)
                tls.seen = used
            if kwargs.get("use_cache") is False:
                tls.no_cache = True
        x = _main_input(args, kwargs) if isinstance(cache, CxlCache) else None
        if x is not None:
            plan(cache, x)

    def pre_forward(module, args, kwargs):
        # Kept out of torch.compile (docs/sources.md#torch-compile-hooks).  transformers' auto-compiled forward (a
        # static cache and a compile_config: model.get_compiled_call) and torch.compile(model) compile __call__;
        # torch runs its _call_impl eagerly and dynamo catches each hook as a frame of its own, guarding on every
        # Python value it reads: the forward counter changes every step, so it recompiled on each decode step.
        # That frame is skipped (skip_code below): eager() runs as in eager mode, counter exact, engine calls
        # outside the graph, and no compile of the hook at all.  Inlined into a larger traced function (a
        # compiled function that calls the model), dynamo traces this body instead: is_compiling() is then a
        # constant True, the per-step bookkeeping is left out and only a CxlCache is planned (a graph break).
        if torch.compiler.is_compiling():
            cache = kwargs.get(st.cache_kw)
            if isinstance(cache, CxlCache) and (x := _main_input(args, kwargs)) is not None:
                plan(cache, x)
            return None
        eager(args, kwargs)
        return None

    skip_code(pre_forward.__code__)
    return pre_forward


def _main_input(args, kwargs) -> Optional[torch.Tensor]:
    """A forward's ``input_ids`` / ``inputs_embeds`` (``(batch, tokens, ...)``), or None."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    return x if isinstance(x, torch.Tensor) and x.dim() >= 2 else None


def _keep_recording(made, cache) -> None:
    """Carry past-state recording from the cache transformers made over to the
    CxlCache that replaces it.  transformers 5.24's
    ``_prepare_cache_for_generation`` calls ``activate_past_recording()`` on
    the cache it makes for an assistant model (``generation_config.is_assistant``,
    set by ``AssistedCandidateGenerator``), so that its later ``crop()`` rollbacks
    can restore sliding-window and linear-attention layers; a fresh cache would
    refuse the first rollback once the window is reached
    (transformers ``generation/utils.py``, ``cache_utils.py``
    ``DynamicSlidingWindowLayer.crop``: docs/sources.md#transformers-cache-api)."""
    for i, layer in enumerate(getattr(made, "layers", ())):
        if getattr(layer, "record_past", False) and i < len(cache.layers):
            target = cache.layers[i]
            if hasattr(target, "activate_past_recording"):
                target.activate_past_recording()


def _make_prepare_hook(model, st: WrapState):
    def _prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                                      *args, **kwargs):
        name = st.cache_kw
        user = model_kwargs.get(name)
        if isinstance(user, (CxlCache, CxlEncoderDecoderCache)) and max_cache_length:
            user.reserve(int(max_cache_length))  # a continuation: grow once now, not during decode
        out = st.orig_prepare(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                              *args, **kwargs)
        made = model_kwargs.get(name)
        dynamic = getattr(generation_config, "cache_implementation", None) in (None, "dynamic")
        if (user is None and dynamic and type(made) is EncoderDecoderCache
                and type(made.self_attention_cache) is DynamicCache and type(made.cross_attention_cache) is DynamicCache
                and not getattr(made.self_attention_cache, "offloading", False)
                and (tiered := CxlEncoderDecoderCache.like(
                    made, model.config.get_text_config(decoder=True), allocator=st.allocator,
                    max_cache_len=int(max_cache_length) if max_cache_length else None)) is not None):
            st.caches_created += 1
            model_kwargs[name] = tiered
            if st.reuse is not None:
                st.reuse.skip("an encoder-decoder model (prefix reuse stores decoder-only caches)")
        elif (user is None and type(made) is DynamicCache and not getattr(made, "offloading", False)
                and dynamic):
            cache = model_kwargs[name] = st.new_cache(model, int(max_cache_length) if max_cache_length else None)
            _keep_recording(made, cache)
            if st.reuse is not None:
                kept = st.reuse.load(cache, generation_config, batch_size,
                                     int(max_cache_length) if max_cache_length else None)
                if kept is not None:  # the previous turn's cache continues (cxlalloc.hf.reuse)
                    cache.release()
                    model_kwargs[name] = kept
        elif (user is None and made is None and dynamic and getattr(generation_config, "use_cache", True) is not False
                and own_cache_class(model) is not None):
            # A model that builds its own DynamicCache subclass in forward() (MiniMax): give it a tiered one.
            st.caches_created += 1
            model_kwargs[name] = cxl_cache_for(model, st.allocator, int(max_cache_length) if max_cache_length else None)
            if st.reuse is not None:
                st.reuse.skip("the model's own cache class (prefix reuse stores plain full-attention caches)")
        elif st.reuse is not None:
            st.reuse.skip("a cache was passed in" if user is not None else
                          "generate() uses another cache (cache_implementation, use_cache=False or offloading)")
        swapped = model_kwargs.get(name)
        if swapped is not made and type(made) is not DynamicCache and getattr(generation_config, "is_assistant", False):
            # An assistant's encoder-decoder or model-specific cache (a DynamicCache's: _keep_recording above):
            # transformers records the past of the cache it makes, so that crop() can roll it back.
            swapped.activate_past_recording()
        st.note(swapped)
        return out

    return _prepare_cache_for_generation


def _make_generate(model, st: WrapState):
    orig = st.orig_generate

    @functools.wraps(orig)
    def generate(*args, **kwargs):
        began = False
        if st.hook == "generate":
            name = st.cache_kw
            gcfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)
            impl = kwargs.get("cache_implementation", getattr(gcfg, "cache_implementation", None))
            use_cache = kwargs.get("use_cache", getattr(gcfg, "use_cache", True))
            supports = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
            if kwargs.get(name) is None and impl is None and use_cache is not False and supports:
                kwargs[name] = st.new_cache(model, None)
                if getattr(gcfg, "is_assistant", False):
                    # The cache is passed in as the user's, so transformers does not mark it for past
                    # recording as it does the assistant cache it makes (_keep_recording).
                    kwargs[name].activate_past_recording()
                if st.reuse is not None and not isinstance(kwargs[name], CxlEncoderDecoderCache):
                    st.reuse.begin(args, kwargs)
                    began = True
                    kept = st.reuse.load(kwargs[name], _merged_generation_config(model, kwargs),
                                         _batch_of(args, kwargs))
                    if kept is not None:  # the previous turn's cache continues (cxlalloc.hf.reuse)
                        kwargs[name].release()
                        kwargs[name] = kept
            st.note(kwargs.get(name))
        elif st.reuse is not None:
            st.reuse.begin(args, kwargs)
            began = True
        outer = len(st._live)
        tls = st._tls
        saved = (getattr(tls, "depth", 0), getattr(tls, "forwards", 0), getattr(tls, "seen", None),
                 getattr(tls, "no_cache", False))
        tls.depth, tls.forwards, tls.seen, tls.no_cache = saved[0] + 1, 0, None, False
        out, ok = None, False
        try:
            out = orig(*args, **kwargs)
            ok = True
            return out
        finally:
            live = st._live
            mine, live[outer:] = live[outer:], []
            if mine:
                st.last_stats = mine[-1].kv_stats()
            seen, forwards, no_cache = tls.seen, tls.forwards, tls.no_cache
            first, tls.first_bytes = getattr(tls, "first_bytes", None), None
            tls.depth, tls.forwards, tls.seen, tls.no_cache = saved
            if ok:
                used = mine[-1] if mine else (seen if seen is not None else returned_cache(out))
                grew = None if first is None or used is not seen else tensor_bytes(seen) > first
                _report_coverage(model, st, used, forwards, no_cache, grew)
                if no_cache and forwards >= 2 and kwargs.get("use_cache") is not False:
                    _warn_no_cache(model, st, forwards)
            if began:
                st.reuse.finish(out, error=not ok)

    return generate


def _report_coverage(model, st: WrapState, cache, forwards: int, no_cache: bool, grew: Optional[bool]) -> None:
    """After a generate(): classify the cache it used (``st.layer_report``) and
    warn once per situation if anything is left to transformers."""
    if cache is None and (no_cache or forwards < 2):
        return  # use_cache=False, or too few forwards to know: nothing to report
    r = layer_report(cache, type(model).__name__, grew)
    st.layer_report = r
    _warn_once(st, r, measured=True, stacklevel=4)


NO_CACHE_WARNING = ("cxlalloc.hf: {model}'s generate() ran {forwards} forward passes with use_cache=False that the "
                    "call did not pass (this model or its generation config keeps no KV cache): there is no KV to "
                    "tier, each step recomputes the whole sequence, and hf.stats() lists the layers a cache would "
                    "have, not bytes held")


def _warn_no_cache(model, st: WrapState, forwards: int) -> None:
    """Warn once (``CacheCoverageWarning``) when transformers ran a wrapped
    generate() without a KV cache the caller did not turn off (transformers'
    MPT does): wrapping cannot apply, and it says so instead of a silent no-op."""
    if ("no-cache",) in st.warned:
        return
    st.warned.add(("no-cache",))
    warnings.warn(NO_CACHE_WARNING.format(model=type(model).__name__, forwards=forwards), CacheCoverageWarning,
                  stacklevel=4)


def _warn_once(st: WrapState, r: dict, measured: bool, stacklevel: int) -> None:
    if needs_warning(r) and signature(r) not in st.warned:
        st.warned.add(signature(r))
        warnings.warn(warning_text(r, measured), CacheCoverageWarning, stacklevel=stacklevel)


def _predicted_report(model, st: WrapState) -> Optional[dict]:
    """The layer report of the cache generate() will use, from the config
    (building a CxlCache allocates nothing), or None when only a generate()
    tells (a model that builds its own cache, or a configured cache_implementation)."""
    supports = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
    impl = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if not supports or impl not in (None, "dynamic"):
        return None
    try:
        cache = st.new_cache(model, 1, count=False)
    except Exception:  # a config transformers' DynamicCache cannot read: learn it from generate()
        return None
    return layer_report(cache, type(model).__name__)


def _merged_generation_config(model, kwargs):
    """generate()'s generation config with this call's keyword overrides (the
    ``hook="generate"`` path only; the prepare hook gets transformers' own)."""
    import copy

    cfg = copy.deepcopy(kwargs.get("generation_config") or getattr(model, "generation_config", None))
    for k in ("num_beams", "num_return_sequences", "eos_token_id"):
        if k in kwargs and cfg is not None:
            setattr(cfg, k, kwargs[k])
    return cfg


def _batch_of(args, kwargs) -> int:
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    return int(ids.shape[0]) if torch.is_tensor(ids) else 0


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
