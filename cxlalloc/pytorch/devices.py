"""Which GPUs the torch integration serves, with which options, and the
engine that serves them; whether torch can use CUDA here at all."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

from cxlalloc import _C
from cxlalloc.config import Config, _parse_device, check_per_device, per_device_values
from cxlalloc.engine import configure, device_options, new_engine


def c_library_path() -> str:
    return os.path.abspath(_C.__file__)


def no_cuda_reason(torch, cfg: Config) -> Optional[str]:
    """Why torch cannot use CUDA here, or None if it can."""
    if getattr(torch.version, "cuda", None) is None:
        return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    try:
        engine = _C.Engine(cfg.libcuda, False)
    except Exception as e:  # CudaUnavailableError: no driver, no device, ...
        return str(e)
    if engine.device_count == 0:
        return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def require_cuda(torch, cfg: Config) -> None:
    reason = no_cuda_reason(torch, cfg)
    if reason is not None:
        raise RuntimeError(
            f"cxlalloc.enable(): CUDA is not available: {reason}. There is no torch CUDA allocator to tier here. "
            "Without a GPU, use cxlalloc's simulated driver instead: cxlalloc.Allocator(simulate=True), "
            "cxlalloc.hf.wrap(model, simulate=True), or `python -m cxlalloc demo|bench --simulate`.")


def device_config(cfg: Config, device: int) -> Config:
    """The options that apply to ``device``: all of them when ``cfg.device`` is
    None or names it, with that GPU's own value of any option given per GPU (a
    list or mapping, :func:`cxlalloc.config.make_enable_config`); defaults for
    the other GPUs when ``cfg.device`` names one (global mode serves every
    GPU, so each needs an allocator)."""
    if cfg.device is not None and cfg.device != device:
        return Config(libcuda=cfg.libcuda)
    over = per_device_values(cfg, device)
    return dataclasses.replace(cfg, **over) if over else cfg


def made_by(source: str) -> Optional[str]:
    """The call an out-of-memory message names for raising a limit of the
    process-wide engine enabled by ``source``: ``cxlalloc.enable(...)``, or None
    (the engine's own ``CXLALLOC=host_limit:...``) for the environment variable."""
    return 'cxlalloc.enable(..., host_limit="64GiB")' if source == "cxlalloc.enable()" else None


def configure_engine(cfg: Config, devices, source: str = "") -> tuple:
    engine = new_engine(cfg)
    resolved = {}
    for d in devices:
        dcfg = device_config(cfg, d)
        opts = device_options(engine, d, dcfg, default_headroom=0.05, made_by=made_by(source))
        resolved[d] = dict(opts)
        configure(engine, d, opts)
    return engine, resolved


def visible_devices(engine_count: int, cfg: Config) -> list:
    if cfg.device is not None and not (0 <= cfg.device < engine_count):
        raise ValueError(f"cxlalloc option 'device': {cfg.device} is not a CUDA device ordinal "
                         f"(0..{engine_count - 1} are visible)")
    check_per_device(cfg, engine_count)
    return list(range(engine_count))


def current_device(device) -> int:
    """``device`` as an ordinal; None: torch's current device (0 before CUDA starts)."""
    d = _parse_device(device, "device")
    if d is not None:
        return d
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return 0
