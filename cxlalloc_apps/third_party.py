"""Quieting third-party libraries the apps load (shared by the demo and the benchmarks).

transformers draws its own progress bars while loading weights; the apps draw
theirs (demo) or write records (bench), so both switch transformers' off.
"""

from __future__ import annotations


def quiet_third_party() -> None:
    """Switch off transformers' own progress bars: its weight-loading bars
    (``disable_progress_bar``) and the GGUF de-quantization loop, which calls
    plain ``tqdm`` (not transformers' switchable one, as of 5.17-5.24)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # a progress bar is never worth failing the demo over
        pass
    try:
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        tq = getattr(gguf_utils, "tqdm", None)
        if tq is not None and not isinstance(tq, functools.partial):
            gguf_utils.tqdm = functools.partial(tq, disable=True)
    except Exception:
        pass
