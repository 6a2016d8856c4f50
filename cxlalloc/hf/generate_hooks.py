"""The hooks :func:`cxlalloc.hf.wrap` installs on a model: the forward pre-hook that plans each
cache update (and counts forwards for the coverage report), the ``_prepare_cache_for_generation``
override that swaps transformers' ``DynamicCache`` for a :class:`~cxlalloc.hf.CxlCache`, the
``generate()`` wrapper (``hook="generate"``, prefix reuse begin/finish), and the coverage
warnings they raise."""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch._dynamo.eval_frame import skip_code
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache

from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.compat import returned_cache
from cxlalloc.hf.coverage import CacheCoverageWarning, layer_report, needs_warning, signature, tensor_bytes, warning_text
from cxlalloc.hf.encdec import CxlEncoderDecoderCache
from cxlalloc.hf.model_caches import cxl_cache_for, own_cache_class
from cxlalloc.hf.storage import Geometry
from cxlalloc.hf.wrap_state import WrapState

# forward() keywords under which models without a transformers Cache pass their own
# state back in (XLNet / Transfo-XL "mems", RWKV "state", Reformer "past_buckets_states").
OWN_STATE_KWARGS = ("mems", "state", "past_buckets_states")


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


def make_pre_forward(model, st: WrapState):
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
        if tls.depth:  # inside a wrapped generate(): what cache does it use (coverage report)
            tls.forwards += 1
            used = cache
            for name in OWN_STATE_KWARGS:
                if used is None:
                    used = kwargs.get(name)
            if used is not None:
                if tls.seen is None and not isinstance(used, Cache):
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


def _load_reused(st: WrapState, cache: CxlCache, generation_config, batch_size: int,
                 max_cache_len: Optional[int] = None) -> CxlCache:
    """Fill the fresh ``cache`` of a generate() call from the KV store
    (:meth:`cxlalloc.hf.reuse.PrefixReuse.load`); returns the cache the call
    uses: ``cache``, or the previous turn's cache when the same conversation
    continues (``cache`` is then released)."""
    kept = st.reuse.load(cache, generation_config, batch_size, max_cache_len)
    if kept is None:
        return cache
    cache.release()
    return kept


def make_prepare_hook(model, st: WrapState):
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
            cap = int(max_cache_length) if max_cache_length else None
            cache = model_kwargs[name] = st.new_cache(model, cap)
            _keep_recording(made, cache)
            if st.reuse is not None:
                model_kwargs[name] = _load_reused(st, cache, generation_config, batch_size, cap)
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


def make_generate(model, st: WrapState):
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
                    kwargs[name] = _load_reused(st, kwargs[name], _merged_generation_config(model, kwargs),
                                                _batch_of(args, kwargs))
            st.note(kwargs.get(name))
        elif st.reuse is not None:
            st.reuse.begin(args, kwargs)
            began = True
        outer = len(st._live)
        tls = st._tls
        saved = (tls.depth, tls.forwards, tls.seen, tls.no_cache)
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
            first, tls.first_bytes = tls.first_bytes, None
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
    warn_once(st, r, measured=True, stacklevel=4)


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


def warn_once(st: WrapState, r: dict, measured: bool, stacklevel: int) -> None:
    if needs_warning(r) and signature(r) not in st.warned:
        st.warned.add(signature(r))
        warnings.warn(warning_text(r, measured), CacheCoverageWarning, stacklevel=stacklevel)


def predicted_report(model, st: WrapState) -> Optional[dict]:
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
