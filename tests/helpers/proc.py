"""The environment of a child Python process that runs this checkout (the CLI, the demo, the bench)."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(*, hide_gpus: bool = True, keep_cxlalloc: bool = True, unbuffered: bool = False) -> dict:
    """``os.environ`` with this checkout first on ``PYTHONPATH`` and the
    HuggingFace hub offline (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``).

    Args:
        hide_gpus: set ``CUDA_VISIBLE_DEVICES=""`` (the child runs simulated).
        keep_cxlalloc: keep a ``CXLALLOC`` setting of this process (False: drop it).
        unbuffered: ``PYTHONUNBUFFERED=1`` (output read while the child runs).
    """
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=path)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if not keep_cxlalloc:
        env.pop("CXLALLOC", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env
