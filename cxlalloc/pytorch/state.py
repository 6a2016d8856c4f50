"""The process-wide state of cxlalloc's torch integration: the mode in force,
the settings it was enabled with, and every object it must keep alive.

Set once by :func:`cxlalloc.pytorch.modes.enable_from` (under :data:`lock`)
and read by the other modules as ``state.current``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Optional

from cxlalloc.config import Config

MODES = ("global", "global-pluggable", "scoped")


class CxlallocWarning(UserWarning):
    """A warning from cxlalloc's torch integration."""


@dataclasses.dataclass
class State:
    mode: str
    settings: Dict[str, Any]
    source: str
    config: Config
    engine: Any
    devices: Dict[int, dict]
    adapter: Any = None
    keepalive: list = dataclasses.field(default_factory=list)  # allocators, pools: never released
    kv_pools: Dict[int, Any] = dataclasses.field(default_factory=dict)
    spill_pools: Dict[int, Any] = dataclasses.field(default_factory=dict)
    spill_reserved: Dict[int, int] = dataclasses.field(default_factory=dict)


lock = threading.RLock()
current: Optional[State] = None


def settings(cfg: Config) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def describe_difference(old: Dict[str, Any], new: Dict[str, Any]) -> str:
    diffs = [f"{k}={old.get(k)!r} -> {new.get(k)!r}" for k in sorted(new) if old.get(k) != new.get(k)]
    return ", ".join(diffs)


def require_enabled() -> State:
    """The state, or RuntimeError when cxlalloc is not enabled."""
    st = current
    if st is None:
        raise RuntimeError("cxlalloc is not enabled in this process: call cxlalloc.enable() (or set CXLALLOC=1 "
                           "before starting Python); for a standalone allocator use cxlalloc.Allocator(...)")
    return st
