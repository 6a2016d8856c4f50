"""A model spread over several GPUs (accelerate's ``device_map``): which GPU each
decoder layer and each parameter sits on, per-GPU options, and stats summed over GPUs.

:func:`cxlalloc.hf.wrap` gives every GPU of the model an allocator of its own
(its own device budget and its own host/CXL tier); each decoder layer's KV lives
in the allocator of the GPU that layer runs on.

Where the GPUs come from:
    * a model on CUDA: each parameter's device (``cuda:i``), as accelerate's
      ``dispatch_model`` leaves them (``from_pretrained(device_map="auto" |
      "balanced" | {...})``);
    * simulation (a CPU model, ``simulate=True``): ``model.hf_device_map``
      ({module name: GPU index or ``"cuda:i"``}, accelerate's attribute), whose
      GPUs are simulated GPUs of cxlalloc's simulated driver.  The model itself
      runs on the CPU: torch without CUDA cannot hold a tensor on ``cuda:1``, so
      the map only decides which simulated GPU's allocator and tiers hold each
      layer's KV and each parameter.

Per-GPU options (:data:`PER_GPU_OPTIONS`) take one value for every GPU, a list
with one value per GPU of the model (in increasing GPU index), or a mapping
``{GPU index or "cuda:i": value}`` over the model's GPUs (a GPU left out gets the
option's default).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from cxlalloc.allocator import sum_stats  # noqa: F401  (re-exported: stats summed over GPUs)
from cxlalloc.config import make_config

class TensorParallelWarning(UserWarning):
    """A model sharded by transformers' tensor-parallel plan (``tp_plan``): its weight shards stay where
    torch.distributed put them (said once per wrap())."""


TP_WEIGHTS = ("cxlalloc.hf.wrap: the model is sharded by transformers' tensor-parallel plan (tp_size={tp}); its "
              "weights are torch.distributed DTensor shards, which cxlalloc does not move into its allocator (a "
              "parameter's .data replaced by a plain tensor would no longer be a shard), so device_limit does not "
              "cover them; each rank's KV cache is still this process's (not yet run under tensor parallelism)")


def tp_size(model) -> int:
    """transformers' tensor-parallel degree of ``model`` (``model._tp_size``; 1 when not sharded)."""
    try:
        return max(1, int(getattr(model, "_tp_size", None) or 1))
    except (TypeError, ValueError):
        return 1


PER_GPU_OPTIONS = ("device_limit", "kv_device_limit", "host_limit", "numa_node")


@dataclasses.dataclass
class GpuLayout:
    """Where a model's parts sit.

    Attributes:
        gpus: the model's GPU indices, increasing.
        layer_gpu: GPU index of each decoder layer (by ``layer_idx``: the cache
            layer of the same index); None when the model has one GPU.
        simulated: the GPUs are simulated (a CPU model with ``hf_device_map``).
    """

    gpus: List[int]
    layer_gpu: Optional[List[int]]
    simulated: bool
    device_map: Optional[dict] = None

    @property
    def multi(self) -> bool:
        return len(self.gpus) > 1

    def param_gpu(self, model) -> Dict[int, int]:
        """``{id(parameter): GPU index}`` for every parameter."""
        out = {}
        for name, p in model.named_parameters():
            out[id(p)] = (_gpu_in_map(name, self.device_map) if self.simulated else (p.device.index or 0))
        return out


def _gpu_index(value, where: str) -> int:
    """A device-map value as a GPU index (int, "cuda:i", "i", torch.device)."""
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, torch.device) and value.type == "cuda":
        return value.index or 0
    if isinstance(value, str):
        v = value.strip()
        if v.isdigit():
            return int(v)
        if v.startswith("cuda"):
            try:
                d = torch.device(v)
            except (RuntimeError, ValueError):
                d = None
            if d is not None and d.type == "cuda":
                return d.index or 0
    raise ValueError(f"cxlalloc.hf.wrap: {where} is {value!r}; a simulated model's device map places modules on "
                     "GPUs only (a GPU index or 'cuda:i'); cxlalloc does not tier accelerate's CPU or disk offload of "
                     "weights")


def _names_gpu(value) -> bool:
    try:
        _gpu_index(value, "")
        return True
    except ValueError:
        return False


def _gpu_in_map(name: str, device_map: dict) -> int:
    best = None
    for key in device_map:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    if best is None:
        raise ValueError(f"cxlalloc.hf.wrap: the model's hf_device_map places no module holding {name!r}")
    return _gpu_index(device_map[best], f"hf_device_map[{best!r}]")


def _layer_modules(model):
    """``[(qualified name, module)]`` of the attention modules with an int ``layer_idx``, by index."""
    found = {}
    for name, mod in model.named_modules():
        idx = getattr(mod, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool) and idx not in found:
            found[idx] = (name, mod)
    return [found[i] for i in sorted(found)]


def model_layout(model) -> GpuLayout:
    """Where ``model``'s parameters sit (:class:`GpuLayout`).

    Raises:
        ValueError: no parameter on a real device; parameters on the CPU and on
            GPUs at once (accelerate's CPU offload), or on another device type;
            a simulated device map naming a non-GPU device, or missing a
            parameter; a model on several GPUs whose decoder layers cannot be
            found (no attention module with ``layer_idx``).
    """
    devices = {p.device for p in model.parameters() if p.device.type != "meta"}
    if not devices:
        raise ValueError("cxlalloc.hf: the model has no parameters on a real device (all on 'meta')")
    types = {d.type for d in devices}
    if len(types) > 1 or (isinstance(getattr(model, "hf_device_map", None), dict)
                          and any(p.device.type == "meta" for p in model.parameters())):
        shown = sorted({str(p.device) for p in model.parameters()})  # 'meta': accelerate's disk offload
        raise ValueError(f"cxlalloc.hf: the model is spread over {shown}; wrap() tiers a model on "
                         "one or several GPUs (or on the CPU in simulation), not accelerate's CPU/disk offload of "
                         "weights: give the GPUs' device_map without 'cpu'/'disk' entries and let cxlalloc's host "
                         "tier hold what does not fit")
    kind = types.pop()
    device_map = getattr(model, "hf_device_map", None)
    if kind == "cuda":
        gpus = sorted({d.index or 0 for d in devices})
        simulated = False
    elif kind == "cpu" and isinstance(device_map, dict) and any(_names_gpu(v) for v in device_map.values()):
        # A CPU model whose map names GPUs: simulated GPUs (every entry must name one).
        gpus = sorted({_gpu_index(v, f"hf_device_map[{k!r}]") for k, v in device_map.items()})
        simulated = True
    else:
        return GpuLayout(gpus=[0], layer_gpu=None, simulated=kind == "cpu")
    if len(gpus) == 1:
        return GpuLayout(gpus=gpus, layer_gpu=None, simulated=simulated, device_map=device_map)
    layers = _layer_modules(model)
    if not layers:
        raise ValueError(f"cxlalloc.hf.wrap: the model is spread over GPUs {gpus} but cxlalloc finds no decoder layer "
                         f"in it (no attention module with an int layer_idx, as transformers' models have); "
                         f"wrap() cannot tell which GPU holds each layer's KV")
    layer_gpu = []
    for name, mod in layers:
        if simulated:
            layer_gpu.append(_gpu_in_map(name, device_map) if name else gpus[0])
        else:
            ps = [p for p in mod.parameters() if p.device.type == "cuda"]
            layer_gpu.append((ps[0].device.index or 0) if ps else gpus[0])
    return GpuLayout(gpus=gpus, layer_gpu=layer_gpu, simulated=simulated, device_map=device_map)


def _key_gpu(key, gpus: List[int], name: str, forms: str) -> int:
    try:
        gpu = _gpu_index(key, "")
    except ValueError:
        gpu = None
    if gpu is None or gpu not in gpus:
        raise ValueError(f"cxlalloc.hf.wrap option '{name}': key {key!r} is not one of the model's GPUs "
                         f"{['cuda:%d' % g for g in gpus]}; {forms}")
    return gpu


def _gpu_value(name: str, value, gpu: int, gpus: List[int]):
    """``value``, GPU ``gpu``'s own value of option ``name``, checked as the option checks it, so that an error
    says which GPU's value is at fault (wrap()'s later check of all options would name the option only)."""
    try:
        make_config(**{name: value})
    except ValueError as e:
        raise ValueError(f"cxlalloc.hf.wrap, GPU cuda:{gpu} of the model's {['cuda:%d' % g for g in gpus]}: {e}") \
            from None
    return value


def per_gpu_options(options: dict, gpus: List[int]) -> Dict[int, dict]:
    """``{gpu: options}``: ``options`` with every :data:`PER_GPU_OPTIONS` value
    resolved for each GPU of ``gpus`` (a value left out of a mapping is left out
    of that GPU's options: its default).

    Raises:
        ValueError: a list of another length than ``gpus``, a mapping key that is
            not one of ``gpus`` (naming the option and the allowed forms); a bad
            value in a list or mapping (naming the GPU, the option and its
            allowed values).
    """
    out = {g: {k: v for k, v in options.items() if k not in PER_GPU_OPTIONS} for g in gpus}
    for name in PER_GPU_OPTIONS:
        if name not in options:
            continue
        value = options[name]
        forms = (f"allowed: one value for every GPU, a list of {len(gpus)} value(s) (one per GPU of the model, in the "
                 f"order {['cuda:%d' % g for g in gpus]}), or a mapping {{GPU index or 'cuda:i': value}} over those "
                 "GPUs")
        if isinstance(value, (list, tuple)):
            if len(value) != len(gpus):
                raise ValueError(f"cxlalloc.hf.wrap option '{name}': a list of {len(value)} value(s) for a model on "
                                 f"{len(gpus)} GPU(s); {forms}")
            for g, v in zip(gpus, value):
                out[g][name] = _gpu_value(name, v, g, gpus)
        elif isinstance(value, dict):
            seen = {}
            for k, v in value.items():
                g = _key_gpu(k, gpus, name, forms)
                if g in seen:
                    raise ValueError(f"cxlalloc.hf.wrap option '{name}': GPU {g} is given twice ({seen[g]!r} and "
                                     f"{k!r}); {forms}")
                seen[g] = k
                out[g][name] = _gpu_value(name, v, g, gpus)
        else:
            for g in gpus:
                out[g][name] = value
    return out
