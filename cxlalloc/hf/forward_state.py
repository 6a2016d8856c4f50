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

:func:`forward_state` digests the first two (every attribute of every module whose value is a number, a
string, a bool, None, a small tensor that is not a parameter or buffer, or a list/tuple/dict/set of those;
XXH3-128, a few milliseconds for a 30-layer model) so that the digest joins the fingerprint, and reports a
reason to turn reuse off for the third: any forward hook or pre-hook, on any module or global, that is not
known to leave outputs unchanged.  Known: cxlalloc's own hooks and those of transformers and accelerate
(device placement, output recording), identified by the module that defined the hook function.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

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
    defined it is one of :data:`KNOWN_HOOK_PACKAGES`."""
    from torch.nn.modules import module as _m

    out = []
    for kind, hooks in (("forward pre-hook", _m._global_forward_pre_hooks),
                        ("forward hook", _m._global_forward_hooks)):
        out += [f"global ({kind} {getattr(h, '__name__', type(h).__name__)})"
                for h in hooks.values() if not _is_known(h)]
    for name, mod in model.named_modules():
        for attr in _HOOK_DICTS:
            hooks = mod.__dict__.get(attr)
            if not hooks:
                continue
            kind = "forward pre-hook" if "pre" in attr else "forward hook"
            out += [f"{name or type(model).__name__} ({kind} {getattr(h, '__name__', type(h).__name__)})"
                    for h in hooks.values() if not _is_known(h)]
    return out


def _feed(out: List[bytes], v: Any, depth: int = 0) -> bool:
    """Append ``v``'s encoding to ``out`` when it is plain state; False (nothing appended) when it is
    something else (skipped).  The digest is the XXH3-128 of the concatenation (one update: the same as
    feeding each piece in turn, without a call per piece)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        out.append(f"{type(v).__name__}:{v!r};".encode())
        return True
    if isinstance(v, torch.Tensor):
        if isinstance(v, torch.nn.Parameter) or v.numel() > _SMALL_TENSOR or v.is_meta:
            out.append(f"T{tuple(v.shape)}{v.dtype};".encode())
            return True
        t = v.detach().to("cpu").contiguous()
        out.append(f"T{tuple(t.shape)}{t.dtype}:".encode())
        out.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return True
    if depth >= 3:
        return False
    if isinstance(v, (list, tuple, set, frozenset)):
        items: Iterable[Any] = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        out.append(f"{type(v).__name__}[".encode())
        for x in items:
            if not _feed(out, x, depth + 1):
                out.append(b"?")
        out.append(b"]")
        return True
    if isinstance(v, dict):
        out.append(b"{")
        for k in sorted(v, key=repr):
            out.append(repr(k).encode() + b"=")
            if not _feed(out, v[k], depth + 1):
                out.append(b"?")
        out.append(b"}")
        return True
    return False


def state_digest(model: torch.nn.Module) -> bytes:
    """16 bytes over every module's plain state (see the module docstring): its path, class, and each
    attribute that is a number, string, bool, None, a non-parameter tensor or a container of those (not
    the device placement: ``hf_device_map``, so block keys do not depend on the device map).  Objects
    of other types (configs, functions, other objects) are not part of it: the config is in the model
    fingerprint, and a function's effect cannot be digested."""
    out: List[bytes] = []
    for name, mod in model.named_modules():
        out.append(f"<{name}:{type(mod).__qualname__}>".encode())
        d = mod.__dict__
        for k in sorted(d):
            if k in _MACHINERY or k in _PLACEMENT:
                continue
            out.append(k.encode() + b"=")
            if not _feed(out, d[k]):
                out.pop()
    return xxhash.xxh3_128_digest(b"".join(out))


def forward_state(model: torch.nn.Module) -> Tuple[Optional[bytes], Optional[str]]:
    """``(digest, None)``: the 16-byte :func:`state_digest` to add to the model fingerprint; or
    ``(None, reason)`` when a forward hook of unknown effect is installed (then no lookup and no store may
    happen, since nothing can tell whether the hook changes K/V)."""
    hooks = foreign_hooks(model)
    if hooks:
        more = f" and {len(hooks) - 3} more" if len(hooks) > 3 else ""
        return None, (f"forward hooks whose effect on K/V cannot be known are installed: "
                      f"{', '.join(hooks[:3])}{more}")
    return state_digest(model), None
