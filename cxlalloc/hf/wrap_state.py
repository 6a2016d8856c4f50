"""What :func:`cxlalloc.hf.wrap` attaches to a model (:class:`WrapState`, ``model._cxlalloc_hf``),
and the ``__getstate__`` that makes a copy or pickle of a wrapped model a plain one."""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
import weakref
from typing import Any, List, Optional

import torch

from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.encdec import CxlEncoderDecoderCache

STATE_ATTR = "_cxlalloc_hf"
# Instance attributes wrap() sets on the model (unwrap() and copies drop them).
INSTANCE_ATTRS = ("_prepare_cache_for_generation", "generate", "init_continuous_batching", "__getstate__", STATE_ATTR)

class UnwrappedCopyWarning(UserWarning):
    """A wrapped model was deep-copied or pickled: the copy is a plain model."""


COPY_WARNING = ("cxlalloc.hf: copying/pickling a wrapped model gives an unwrapped copy (transformers' own generate(); "
                "a deep copy or a pickle has its weights in torch's memory); call cxlalloc.hf.wrap() on the copy to "
                "tier it")


_COPY_MODULES = ("copy", "copyreg", "pickle", "torch.serialization")


def _caller_level() -> int:
    """``stacklevel`` that points a warning raised in ``GetState.__call__`` at
    the user's deepcopy/pickle/torch.save line, past the copy machinery."""
    level, f = 2, sys._getframe(2)  # level 2: the frame that called __call__
    while f is not None and f.f_globals.get("__name__") in _COPY_MODULES:
        level, f = level + 1, f.f_back
    return level


class GetState:
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
        hook_id = st.pre_hook.id if st is not None and st.pre_hook is not None else None
        for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):  # the copy's dicts, not the model's
            if hook_id is not None and isinstance(state.get(name), dict) and hook_id in state[name]:
                state[name] = type(state[name])((k, v) for k, v in state[name].items() if k != hook_id)
        return state


class CallThread(threading.local):
    """Per thread: the wrapped generate() running on it (``WrapState._tls``)."""

    live: Optional[List[Any]] = None   # the CxlCaches its generate() made
    depth: int = 0                     # nested wrapped generate() calls
    forwards: int = 0                  # forwards of the innermost call
    seen: Any = None                   # the cache (or plain state) its forwards used
    no_cache: bool = False             # a forward ran with use_cache=False
    first_bytes: Optional[int] = None  # a plain state's bytes at its first forward (does it grow?)


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
    _tls: "CallThread" = dataclasses.field(default_factory=lambda: CallThread())  # per thread: its running generate()
    pre_hook: Any = None  # handle of the forward pre-hook (make_pre_forward)
    _last: Any = None  # weakref to the last cache
    layer_report: Optional[dict] = None  # cxlalloc.hf.coverage.layer_report of the last generate() (or predicted)
    warned: set = dataclasses.field(default_factory=set)  # coverage situations already warned about
    cb: Any = None  # cxlalloc.hf.paged.CBState: continuous batching (generate_batch / init_continuous_batching)
    configs: dict = dataclasses.field(default_factory=dict)  # {gpu: Config}: each GPU's options as values
    layout: Any = None  # cxlalloc.hf.devices.GpuLayout: the model's GPUs, each decoder layer's GPU
    allocators: dict = dataclasses.field(default_factory=dict)  # {gpu: Allocator}; allocator is the first GPU's
    weight_bytes_per_gpu: dict = dataclasses.field(default_factory=dict)  # {gpu: bytes of weights placed}

    @property
    def multi(self) -> bool:
        """The model's decoder layers sit on several GPUs (one allocator each)."""
        return self.layout is not None and self.layout.multi

    def layer_allocators(self) -> Optional[List[Any]]:
        """The allocator of each decoder layer's GPU, by layer index (None: one GPU)."""
        if not self.multi:
            return None
        return [self.allocators[g] for g in self.layout.layer_gpu]

    @property
    def _live(self) -> List[Any]:
        live = self._tls.live
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
        return CxlCache(config=cfg, allocator=self.allocator, max_cache_len=max_cache_len,
                        layer_allocators=self.layer_allocators())

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
