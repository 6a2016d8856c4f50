"""Measurements for the demo: generate() timing through a streamer (TTFT,
prefill/decode tokens/s, TPOT) that also drives the progress display
(:mod:`cxlalloc_apps.demo.progress`), and the bytes transformers' own
``DynamicLayer`` copies per step (its ``torch.cat``).

torch and transformers are imported where they are used (the demo checks its
arguments before those imports)."""

from __future__ import annotations

import contextlib
import time
from typing import List, Optional


class Timer:
    """A transformers streamer (``generate(streamer=...)``) that timestamps tokens.

    generate() calls ``put(prompt_ids)`` once before the prefill, then ``put(tokens)``
    with each new token (shape ``(B,)`` or ``(B, 1)``), then ``end()``.

    Attributes (seconds, from :meth:`start`):
        t_first: when the first new token arrived (TTFT).
        t_tokens: arrival time of every new token.
    """

    def __init__(self, progress=None):
        """``progress``: a :class:`cxlalloc_apps.demo.progress.GenerationProgress`
        (told when the prefill starts, of each token, and of the end), or None."""
        self.t0 = 0.0
        self.t_tokens: List[float] = []
        self._prompt_seen = False
        self._progress = progress

    def start(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            if self._progress is not None:
                self._progress.prefill()
            return
        self.t_tokens.append(time.perf_counter() - self.t0)
        if self._progress is not None:
            self._progress.token()

    def end(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    @property
    def t_first(self) -> Optional[float]:
        return self.t_tokens[0] if self.t_tokens else None

    def summary(self, prompt_tokens: int, batch: int) -> dict:
        """``ttft_ms``, ``prefill_tok_s`` (prompt tokens x batch / TTFT),
        ``decode_tok_s`` (tokens after the first, x batch, per second),
        ``tpot_ms`` (time per output token after the first), ``steps``."""
        n = len(self.t_tokens)
        d = {"steps": n, "ttft_ms": None, "prefill_tok_s": None, "decode_tok_s": None, "tpot_ms": None}
        if n == 0:
            return d
        ttft = self.t_tokens[0]
        d["ttft_ms"] = 1e3 * ttft
        d["prefill_tok_s"] = prompt_tokens * batch / ttft if ttft > 0 else None
        if n > 1:
            span = self.t_tokens[-1] - self.t_tokens[0]
            d["tpot_ms"] = 1e3 * span / (n - 1)
            d["decode_tok_s"] = (n - 1) * batch / span if span > 0 else None
        return d


@contextlib.contextmanager
def count_dynamic_cache_copies(n_layers: int):
    """Count the bytes transformers' ``DynamicLayer.update`` writes (its
    ``torch.cat`` makes a new ``(B, H, L+q, D)`` K and V every call).

    Yields a list that receives, per forward pass, the bytes written by all
    ``n_layers`` full-attention layers (measured from the tensors it returns).
    """
    from transformers.cache_utils import DynamicLayer

    orig = DynamicLayer.update
    per_call: List[int] = []
    steps: List[int] = []

    def update(self, key_states, value_states, *args, **kwargs):
        k, v = orig(self, key_states, value_states, *args, **kwargs)
        if type(self) is DynamicLayer:
            per_call.append(k.nelement() * k.element_size() + v.nelement() * v.element_size())
            if len(per_call) == n_layers:
                steps.append(sum(per_call))
                per_call.clear()
        return k, v

    DynamicLayer.update = update
    try:
        yield steps
    finally:
        DynamicLayer.update = orig


def cache_bytes(cache) -> int:
    """Bytes of the K/V tensors a transformers cache holds now."""
    import torch

    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.nelement() * t.element_size()
    return total


def param_bytes(model) -> int:
    return sum(p.nelement() * p.element_size() for p in model.parameters())
