"""What changes K/V besides the weights and the token ids: the modules' own state and forward hooks.

A block key covers the token ids, and the model fingerprint covers every weight and buffer byte
(:class:`~cxlalloc.kvstore.keys.WeightsWatch`).  K/V also depend on state that is neither (issue 29, item 1,
each seen to give wrong tokens before this module):

- **PEFT adapters.**  A multi-adapter PEFT model keeps every adapter loaded and chooses the active one by an
  attribute of each LoRA layer (``active_adapter``; ``_disable_adapters`` inside ``disable_adapter()``): the
  weights do not change, the K/V do.
- **Plain module attributes** that enter ``forward``: a norm's ``variance_epsilon``, a rotary embedding's
  ``attention_scaling``, ``training`` (dropout), a layer's ``scaling``.
- **Forward hooks and pre-hooks** (activation steering, probes that edit outputs): their effect cannot be
  seen from outside at all.

:func:`forward_state` digests the first two (every attribute of every module whose value is a number --
NumPy's and complex ones too --, a string, a bool, None, a dtype, an enum member, a tensor or NumPy array of
at most 2^20 elements that is not a registered parameter or buffer, a function (qualified name, code, and
the plain values of its constants, defaults, closure and a partial's arguments), or a list/tuple/dict/set of
those; XXH3-128, a few milliseconds for a 30-layer model) so that the digest joins the fingerprint, and
reports a reason to turn reuse off for the third: any forward hook or pre-hook, on any module or global, that
is not known to leave outputs unchanged, a ``forward`` replaced on a module instance, and an accelerate
``ModelHook`` of another package.  Known: cxlalloc's own hooks and those of transformers and accelerate
(device placement, output recording), identified by the module that defined the hook function.  Reuse is
turned off too (a reason, not a digest) while some state enters the forward that no digest can cover: a
module held outside ``_modules`` (a plain list of layers, ``object.__setattr__``: its weights are in no
digest), a tensor attribute over 2^20 elements, an object-dtype array, a TorchScript object (quantized
packed weights), containers nested deeper than 3
(trial33: each of these, and each type above, gave a wrong token before; tests/hf/test_hf_reuse_memo_attacks.py).
A ``forward`` patched on a module's class (``LlamaMLP.forward = f``) joins the digest too
(:func:`class_forward_patches`): the class's ``forward`` is taken as patched when it is not the function
the class (or the base it inherits it from) defined -- its qualified name is not ``Class.forward`` of that
class and module -- or when it is not the one this process first saw on the class; a patched one is digested
as a function attribute is (name, code, constants, closure values: the function it wraps among them), so the
patched model's blocks get keys of their own, and restoring the original brings the old keys back.  An
unpatched model's fingerprint is what it was before this check (nothing is added).  So does a function
replaced, since the process first used the model's classes, where their forwards look it up
(:func:`function_patches`: a module-level function of the modeling file, ``modeling_llama.apply_rotary_pos_emb =
f``, or an entry of transformers' ``ALL_ATTENTION_FUNCTIONS``).  Not seen: a ``functools.wraps`` class patch
or a function patch made before the process first used the classes, and the state of objects of other
types (a config: it is in the model fingerprint).
"""

from __future__ import annotations

import enum
import functools
import operator
import sys
import threading
import types
import weakref
from typing import Any, Iterable, List, Optional, Tuple

import numpy as np
import torch
import xxhash

# Attributes of nn.Module that are the module machinery, not state that enters forward (parameters and
# buffers are digested with the weights; submodules are visited on their own; hooks are checked apart).
_MACHINERY = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_is_full_backward_hook",
    "_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
    "_compiled_call_impl", "_version",
})

# Attributes that say where a module runs, not what it computes: accelerate's ``dispatch_model`` (what
# ``from_pretrained(device_map=...)`` calls) sets ``hf_device_map`` on the model.  A prefix stored by the
# model on 2 GPUs must be hit by the same weights on 1 GPU (issue 32): the device map is not state.
_PLACEMENT = frozenset({"hf_device_map"})

# Packages whose hooks are known not to change a module's outputs: cxlalloc's own (the wrap's pre-forward
# hook), accelerate's device-placement hooks, transformers' output recording.
KNOWN_HOOK_PACKAGES = ("cxlalloc", "accelerate", "transformers")

_SMALL_TENSOR = 1 << 20  # elements: a plain tensor attribute up to this size is digested by value

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


def _hook_origin(fn: Any) -> str:
    """The module that defined a hook callable (a function, a bound method, a partial, an object)."""
    seen = 0
    while seen < 8:
        seen += 1
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None)
        if inner is None or inner is fn:
            break
        fn = inner
    mod = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return str(mod)


def _is_known(fn: Any) -> bool:
    origin = _hook_origin(fn)
    return any(origin == p or origin.startswith(p + ".") for p in KNOWN_HOOK_PACKAGES)


def foreign_hooks(model: torch.nn.Module) -> List[str]:
    """Where forward hooks or pre-hooks of unknown effect sit: ``["model.layers.3 (forward hook steer)",
    "global (forward pre-hook f)"]``; empty when there are none.  A hook is known when the package that
    defined it is one of :data:`KNOWN_HOOK_PACKAGES`.  A ``forward`` set on a module instance (a monkeypatch:
    ``mod.forward = f``) is a hook too (``"model.layers.0.mlp (forward replaced f)"``), and so is an
    accelerate ``ModelHook`` of another package (``accelerate.hooks.add_hook_to_module``: its
    ``pre_forward``/``post_forward`` may change inputs and outputs; ``"... (accelerate hook Steer)"``)."""
    return _foreign_hooks(model.named_modules())


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def _replaced_forward(mod: torch.nn.Module) -> List[str]:
    """What of ``mod``'s instance-level ``forward`` (none: the class's) is of unknown effect."""
    fwd = mod.__dict__.get("forward")
    if fwd is None:
        return []
    cls_fwd = getattr(type(mod), "forward", None)
    if getattr(fwd, "__func__", None) is cls_fwd and getattr(fwd, "__self__", None) is mod:
        return []  # the class's own forward, bound (mod.forward = mod.forward)
    if _hook_origin(fwd).startswith("accelerate.") and "_hf_hook" in mod.__dict__:
        # accelerate's add_hook_to_module: new_forward runs _hf_hook.pre_forward, _old_forward, post_forward
        hook = mod.__dict__["_hf_hook"]
        hooks = list(getattr(hook, "hooks", ())) if type(hook).__name__ == "SequentialHook" else [hook]
        out = [f"accelerate hook {type(h).__name__}" for h in hooks if not _is_known(h)]
        old = mod.__dict__.get("_old_forward")
        if old is not None and not (getattr(old, "__func__", None) is cls_fwd or _is_known(old)):
            out.append(f"forward replaced {_name(old)}")
        return out
    return [] if _is_known(fwd) else [f"forward replaced {_name(fwd)}"]


def _foreign_hooks(modules: Iterable[Tuple[str, torch.nn.Module]]) -> List[str]:
    from torch.nn.modules import module as _m

    out = []
    for kind, hooks in (("forward pre-hook", _m._global_forward_pre_hooks),
                        ("forward hook", _m._global_forward_hooks)):
        out += [f"global ({kind} {getattr(h, '__name__', type(h).__name__)})"
                for h in hooks.values() if not _is_known(h)]
    for name, mod in modules:
        for attr in _HOOK_DICTS:
            hooks = mod.__dict__.get(attr)
            if not hooks:
                continue
            kind = "forward pre-hook" if "pre" in attr else "forward hook"
            out += [f"{name or type(mod).__name__} ({kind} {getattr(h, '__name__', type(h).__name__)})"
                    for h in hooks.values() if not _is_known(h)]
        if "forward" in mod.__dict__:
            out += [f"{name or type(mod).__name__} ({what})" for what in _replaced_forward(mod)]
    return out


_MAX_DEPTH = 3  # containers nested deeper than this are state the digest does not see (reuse off)
# Attribute names not digested because the hook check covers them: accelerate's add_hook_to_module sets the
# instance's forward to its new_forward, keeps the class's in _old_forward and its hook object in _hf_hook; a
# device map's placement hooks must not change the key (issue 32), others turn reuse off (_foreign_hooks).
_HOOKED = frozenset({"forward", "_old_forward", "_hf_hook"})
_SCALARS = (bool, int, float, complex, str, bytes)
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)
_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial, types.BuiltinFunctionType,
              types.BuiltinMethodType)


def _path(path: Any) -> str:
    """``"a.b[0]['k']"`` from ``_feed``'s path (a name, or ``(parent path, index or key)``: built only when needed)."""
    if isinstance(path, tuple) and len(path) == 3:  # (module name, attribute, ".")
        return f"{path[0]}.{path[1]}" if path[0] else str(path[1])
    if isinstance(path, tuple):
        return f"{_path(path[0])}[{path[1]!r}]"
    return str(path)


def _feed(out: List[bytes], v: Any, depth: int = 0, opaque: Optional[List[str]] = None, path: Any = "") -> bool:
    """Append ``v``'s encoding to ``out`` when it is plain state; False (nothing appended) when it is
    something else (skipped: a config, an object of another type).  The digest is the XXH3-128 of the
    concatenation (one update: the same as feeding each piece in turn, without a call per piece).

    State that enters a forward but cannot be digested here is appended to ``opaque`` (``"path (why)"``):
    a module or a tensor held outside ``_modules``/``_parameters``/``_buffers`` that is too large to digest
    at every check (over 2^20 elements), a module held in a plain attribute or container (its weights are in
    no digest), an object-dtype array, containers nested deeper than 3; the caller turns reuse off."""
    # issubclass(type(v), ...) rather than isinstance(v, ...): isinstance falls back to ``v.__class__``, which
    # runs an object's own __getattribute__ (transformers' configs define one: 35 % of a digest's time)
    tv = type(v)
    if tv in _SKIPPED:  # a type seen before that the digest does not encode (a config): decided by type alone
        return False
    if v is None or issubclass(tv, _SCALARS):
        out.append(f"{type(v).__name__}:{v!r};".encode())
        return True
    if issubclass(tv, torch.Tensor):
        # A Parameter here is not registered (object.__setattr__, a plain list): no weights digest covers it.
        if v.is_meta:
            out.append(f"T{tuple(v.shape)}{v.dtype};".encode())
            return True
        if v.numel() > _SMALL_TENSOR:
            if opaque is not None:
                opaque.append(f"{_path(path)} (a tensor of {v.numel()} elements outside the parameters and buffers, "
                              f"over {_SMALL_TENSOR} digested at each call)")
            return False
        t = v.detach().to("cpu").contiguous()
        out.append(f"T{tuple(t.shape)}{t.dtype}:".encode())
        out.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return True
    if issubclass(tv, np.generic):  # a NumPy scalar: np.float32(1e-5) is no float
        out.append(f"np.{v.dtype.str}:".encode() + v.tobytes() + b";")
        return True
    if issubclass(tv, np.ndarray):
        if v.dtype.hasobject or v.size > _SMALL_TENSOR:
            if opaque is not None:
                opaque.append(f"{_path(path)} (a NumPy array of {v.size} elements of {v.dtype})")
            return False
        out.append(f"A{v.shape}{v.dtype.str}:".encode() + np.ascontiguousarray(v).tobytes())
        return True
    if issubclass(tv, _TORCH_ENUMS):
        out.append(f"{tv.__name__}:{v};".encode())
        return True
    if issubclass(tv, enum.Enum):
        out.append(f"enum:{tv.__module__}.{tv.__qualname__}.{v.name};".encode())
        return True
    if issubclass(tv, torch._C.ScriptObject):  # e.g. quantize_dynamic's packed weights: in no weights digest
        if opaque is not None:
            opaque.append(f"{_path(path)} (a TorchScript object, such as quantized packed weights, that no digest covers)")
        return False
    if issubclass(tv, torch.nn.Module):
        if opaque is not None:
            opaque.append(f"{_path(path)} (a {tv.__name__} module held outside _modules: its weights are in no digest)")
        return False
    if depth >= _MAX_DEPTH:
        if issubclass(tv, (list, tuple, set, frozenset, dict) + _FUNCTIONS) and opaque is not None:
            opaque.append(f"{_path(path)} (nested more than {_MAX_DEPTH} deep)")
        return False
    if issubclass(tv, _FUNCTIONS):
        return _feed_function(out, v, depth, opaque, path)
    if issubclass(tv, (list, tuple, set, frozenset)):
        items: Iterable[Any] = sorted(v, key=repr) if issubclass(tv, (set, frozenset)) else v
        out.append(f"{type(v).__name__}[".encode())
        for i, x in enumerate(items):
            if not _feed(out, x, depth + 1, opaque, (path, i)):
                out.append(b"?")
        out.append(b"]")
        return True
    if issubclass(tv, dict):
        out.append(b"{")
        for k in sorted(v, key=repr):
            out.append(repr(k).encode() + b"=")
            if not _feed(out, v[k], depth + 1, opaque, (path, k)):
                out.append(b"?")
        out.append(b"}")
        return True
    _SKIPPED.add(tv)
    return False


# Types _feed does not encode, learnt as they are met (every check reached this decision by the type alone).
_SKIPPED: set = set()


def _feed_function(out: List[bytes], fn: Any, depth: int, opaque: Optional[List[str]], path: Any) -> bool:
    """A callable attribute (an activation function, a partial, a closure): its qualified name, code, the
    constants, defaults and closure values that are plain state, a partial's arguments; a bound method's
    function (not the object it is bound to).  Names and code, not addresses: the same in every process."""
    if isinstance(fn, functools.partial):
        out.append(b"partial(")
        for part in (fn.func, fn.args, fn.keywords):
            if not _feed(out, part, depth + 1, None, path):  # a module passed to it is the call's business
                out.append(b"?")
        out.append(b")")
        return True
    if isinstance(fn, types.MethodType):
        out.append(b"method:")
        if not _feed(out, fn.__func__, depth + 1, None, path):
            out.append(b"?")
        return True
    out.append(f"fn:{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', _name(fn))};".encode())
    code = getattr(fn, "__code__", None)
    if code is not None:
        out.append(code.co_code)
        cells = []
        for c in fn.__closure__ or ():
            try:
                cells.append(c.cell_contents)
            except ValueError:  # an empty cell
                cells.append(None)
        for part in (code.co_consts, fn.__defaults__, fn.__kwdefaults__, tuple(cells)):
            if not _feed(out, part, depth + 1, None, path):
                out.append(b"?")
    return True


_NOT_STATE = _MACHINERY | _PLACEMENT | _HOOKED


def _encodable_attrs(mod: torch.nn.Module) -> List[str]:
    """The names of ``mod``'s attributes that :func:`_module_piece` digests, in order."""
    return [k for k in sorted(mod.__dict__) if k not in _NOT_STATE]


def _module_piece(name: str, mod: torch.nn.Module, opaque: Optional[List[str]] = None,
                  keys: Optional[List[str]] = None) -> bytes:
    """One module's part of :func:`state_digest`: its path, class and plain attributes, in key order.
    ``opaque``: receives what enters the forward but cannot be digested (see :func:`_feed`); ``keys``:
    :func:`_encodable_attrs` when the caller has them."""
    out: List[bytes] = [f"<{name}:{type(mod).__qualname__}>".encode()]
    d = mod.__dict__
    for k in _encodable_attrs(mod) if keys is None else keys:
        out.append(k.encode() + b"=")
        if not _feed(out, d[k], 0, opaque, (name, k, ".")):
            out.pop()
    return b"".join(out)


def state_digest(model: torch.nn.Module) -> bytes:
    """16 bytes over every module's plain state (see the module docstring): its path, class, and each
    attribute that is a number (NumPy's too), string, bool, None, a dtype, an enum member, a non-parameter
    tensor or array, a function (name, code, closure values) or a container of those (not the device
    placement: ``hf_device_map``, so block keys do not depend on the device map; not ``forward`` and
    accelerate's ``_old_forward``/``_hf_hook``, which the hook check covers).  Objects of other types
    (configs, other objects) are not part of it: the config is in the model fingerprint.
    :class:`StateMemo` gives the same digest without encoding again the modules whose state did not
    change; :func:`forward_state` also says when some state cannot be digested."""
    return xxhash.xxh3_128_digest(b"".join(_module_piece(n, m) for n, m in model.named_modules()))


# Attribute values whose encoding cannot change while the object lives, so the same object (by identity)
# encodes the same: immutable scalars, and every type _feed does not encode at all (a config: no part of
# the digest whatever it holds).  What _feed encodes and can change in place (containers, tensors, arrays,
# functions (closures, defaults), subclasses of the scalar types, which may carry their own state) makes its
# module encoded at every check.
_FROZEN = frozenset({type(None), bool, int, float, complex, str, bytes})
_MUTABLE = (torch.Tensor, np.ndarray, list, tuple, set, frozenset, dict, types.FunctionType, types.MethodType,
            functools.partial) + _SCALARS


def _frozen(v: Any) -> bool:
    tv = type(v)
    return tv in _FROZEN or not issubclass(tv, _MUTABLE)


class _Entry:
    """A module's encoded part and the objects it was made from."""

    __slots__ = ("name", "mod", "cls", "d", "keys", "vals", "piece", "frozen", "opaque")

    def __init__(self, name: str, mod: torch.nn.Module):
        d = mod.__dict__
        self.name, self.mod, self.cls, self.d = name, mod, type(mod), d
        # Strong references: no key or value can be freed and its address reused while the entry lives, so
        # "the very same object" below never means a new object at an old address.
        self.keys, self.vals = tuple(d), tuple(d.values())
        self.opaque: List[str] = []
        keys = _encodable_attrs(mod)
        self.piece = _module_piece(name, mod, self.opaque, keys)
        self.frozen = all(_frozen(d[k]) for k in keys)

    def same(self, name: str, mod: torch.nn.Module) -> bool:
        d = mod.__dict__
        return (self.frozen and self.mod is mod and self.name == name and self.cls is type(mod) and self.d is d
                and len(d) == len(self.keys) and all(map(operator.is_, d, self.keys))
                and all(map(operator.is_, d.values(), self.vals)))


class StateMemo:
    """:func:`state_digest` at the cost of identity checks per module while the modules' state does not
    change (issue 33, the wrapped model's per-call overhead: encoding SmolLM2-135M's 397 modules and 1,661
    attributes took 1.9 ms a check, two checks a ``generate()``).

    Each module's encoded part is kept with the objects it was made from: the module, its path, its class,
    its ``__dict__`` and that dict's keys and values (strong references).  A later check reuses the part only
    when all of these are the very same objects and every attribute value is of a type whose encoding cannot
    change in place (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, NumPy scalars,
    dtypes, enum members; or that the digest does not encode at all: a config); a module holding a container,
    a tensor, an array, a function (its closure and defaults can change) or a subclass of a scalar type is
    encoded again at every check.  An attribute set again, even to an equal value, is a change unless
    it is the very same object.  So the digest is always the one
    :func:`state_digest` gives (tests/hf/test_hf_reuse_state.py compares them under every kind of change).
    The walk over the modules runs at every check, so a module added, removed, renamed or re-classed is
    seen.  Thread-safe (one lock); entries of modules no longer walked are dropped at each check.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict = {}
        self.encoded = 0  # modules encoded at the last check (for tests and profiles)

    def check(self, modules: Iterable[Tuple[str, torch.nn.Module]]) -> Tuple[bytes, List[str]]:
        """``(digest, opaque)``: the :func:`state_digest` of the ``(name, module)`` pairs given and what of
        their state enters the forward but cannot be digested (``"path (why)"``, see :func:`_feed`)."""
        with self._lock:
            old, new, pieces, encoded, opaque = self._entries, {}, [], 0, []
            for name, mod in modules:
                e = old.get(id(mod))
                if e is None or not e.same(name, mod):
                    e = _Entry(name, mod)
                    encoded += 1
                new[id(mod)] = e
                pieces.append(e.piece)
                if e.opaque:
                    opaque += e.opaque
            self._entries, self.encoded = new, encoded
            return xxhash.xxh3_128_digest(b"".join(pieces)), opaque


def numerics() -> bytes:
    """What of torch's global state changes the K/V a forward computes, as bytes: empty by default (so the
    fingerprint is the one of before), else autocast on the CPU or CUDA (its dtype: K/V computed in bf16
    precision must not be served to an fp32 call, nor the reverse) and a float32 matmul precision other than
    ``"highest"`` (TF32 on a GPU).  Read inside ``generate()``, so a ``with torch.autocast(...)`` around the
    call counts."""
    out = []
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            out.append(f"autocast:{dev}:{torch.get_autocast_dtype(dev)};")
    prec = torch.get_float32_matmul_precision()
    if prec != "highest":
        out.append(f"matmul:{prec};")
    return "".join(out).encode()


# The forward this process first saw on each module class, and whether it is the class's own (see
# class_forward_patches); weak keys: a class made at run time and dropped leaves nothing behind.
_FIRST_FORWARD: "weakref.WeakKeyDictionary[type, Tuple[Any, bool]]" = weakref.WeakKeyDictionary()
_FIRST_FORWARD_LOCK = threading.Lock()


def _defined_by_its_class(cls: type, fn: Any) -> bool:
    """Whether ``fn`` (``cls.forward``) is the function that the class holding it in its MRO defined: its
    qualified name is ``Owner.forward`` of that class and module (``functools.wraps`` decorators, as
    transformers' ``can_return_tuple``, keep them), or torch's own ``Module.forward`` placeholder."""
    if fn is torch.nn.Module.forward:
        return True
    for owner in cls.__mro__:
        if owner.__dict__.get("forward") is fn:
            return getattr(fn, "__qualname__", None) == f"{owner.__qualname__}.forward" and \
                getattr(fn, "__module__", None) == owner.__module__
    return False


def class_forward_patches(classes: Iterable[type]) -> List[Tuple[type, Any]]:
    """The module classes among ``classes`` whose ``forward`` is patched, with it, sorted by class name:
    a ``forward`` the class did not define itself (:func:`_defined_by_its_class`), or another than the one
    this process first saw on the class (a patch with ``functools.wraps`` after that).  Empty for a model
    nobody patched: the fingerprint then stays what it was without this check."""
    out = []
    for cls in classes:
        fn = getattr(cls, "forward", None)
        with _FIRST_FORWARD_LOCK:
            first = _FIRST_FORWARD.get(cls)
            if first is None:
                first = _FIRST_FORWARD[cls] = (fn, _defined_by_its_class(cls, fn))
        if fn != first[0] or not first[1]:  # == : a classmethod gives a new bound method per getattr
            out.append((cls, fn))
    return sorted(out, key=lambda p: f"{p[0].__module__}.{p[0].__qualname__}")


# The functions this process first saw in each place a forward looks its helpers up: a module's globals
# (``{module name: {name: function}}``) and transformers' attention-function registry.
_FIRST_FUNCTIONS: dict = {}


def _function_places(classes: Iterable[type]) -> List[Tuple[str, Any]]:
    """``(label, mapping)`` of where the forwards of ``classes`` look functions up at call time: the globals
    of each class's module, and transformers' ``ALL_ATTENTION_FUNCTIONS`` (``AttentionInterface``'s global
    mapping: ``"sdpa"`` -> the function) when transformers is loaded."""
    places = []
    for name in sorted({cls.__module__ for cls in classes}):
        mod = sys.modules.get(name)
        if mod is not None:
            places.append((name, vars(mod)))
    mu = sys.modules.get("transformers.modeling_utils")
    registry = getattr(getattr(mu, "ALL_ATTENTION_FUNCTIONS", None), "_global_mapping", None)
    if isinstance(registry, dict):
        places.append(("ALL_ATTENTION_FUNCTIONS", registry))
    return places


def function_patches(classes: Iterable[type]) -> List[Tuple[str, Any]]:
    """The functions replaced where the forwards of ``classes`` look them up (a module-level function of a
    modeling file, ``modeling_llama.apply_rotary_pos_emb = f``; an entry of transformers'
    ``ALL_ATTENTION_FUNCTIONS``) since this process first saw that place: ``[("module.name", new value)]``,
    sorted.  Only functions present at first sight are watched (a few dozen dictionary lookups per call)."""
    out = []
    for label, names in _function_places(classes):
        with _FIRST_FORWARD_LOCK:
            first = _FIRST_FUNCTIONS.get(label)
            if first is None:
                first = _FIRST_FUNCTIONS[label] = {k: v for k, v in names.items()
                                                   if isinstance(v, (types.FunctionType, functools.partial))}
        out += [(f"{label}.{k}", names.get(k)) for k, fn in first.items() if names.get(k) is not fn]
    return sorted(out, key=lambda p: p[0])


def _patches_piece(patches: List[Tuple[str, Any]]) -> bytes:
    """The digest's part for :func:`class_forward_patches` and :func:`function_patches`: each place's name and
    the function now there, encoded as a function attribute is (:func:`_feed_function`)."""
    out: List[bytes] = []
    for where, fn in patches:
        out.append(f"<{where}>".encode())
        if not _feed(out, fn, 0, None, where):
            out.append(b"?")
    return b"".join(out)


def first_three(items: List[str]) -> str:
    """``"a, b, c and 2 more"``: the first three of ``items`` and how many follow."""
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def forward_state(model: torch.nn.Module,
                  memo: Optional[StateMemo] = None) -> Tuple[Optional[bytes], Optional[str]]:
    """``(digest, None)``: the 16-byte :func:`state_digest` to add to the model fingerprint (with
    :func:`numerics` when they are not torch's defaults: autocast, TF32, and the forwards and functions
    patched since, :func:`class_forward_patches`, :func:`function_patches`); or
    ``(None, reason)`` when a forward hook of unknown effect is installed, or some state that enters the
    forward cannot be digested (a module, parameter or large tensor held outside ``_modules``,
    ``_parameters`` and ``_buffers``; containers nested too deep): then no lookup and no store may happen,
    since nothing can tell whether it changed K/V.  ``memo``: a :class:`StateMemo` the caller keeps between
    checks (the same digest, cheaper while the state does not change).  One walk over the modules serves
    the hooks and the digest."""
    modules = list(model.named_modules())
    hooks = _foreign_hooks(modules)
    if hooks:
        return None, f"forward hooks whose effect on K/V cannot be known are installed: {first_three(hooks)}"
    if memo is None:
        opaque: List[str] = []
        digest = xxhash.xxh3_128_digest(b"".join(_module_piece(n, m, opaque) for n, m in modules))
    else:
        digest, opaque = memo.check(modules)
    if opaque:
        return None, f"module state that no digest can cover: {first_three(opaque)}"
    glob = numerics()
    classes = {type(m) for _, m in modules}
    patches = [(f"forward of {c.__module__}.{c.__qualname__}", fn) for c, fn in class_forward_patches(classes)]
    patches += function_patches(classes)
    if patches:
        glob += _patches_piece(patches)
    return (xxhash.xxh3_128_digest(digest + glob) if glob else digest), None
