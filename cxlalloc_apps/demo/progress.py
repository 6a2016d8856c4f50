"""What the demo shows while it works: loading the model, the prefill, the decode.

On a terminal (stderr is a TTY): a rich spinner while the model loads and a
rich progress line per generate() call (a spinner with the prompt size during
the prefill, then a bar of new tokens).  Outside a terminal (a log, CI): plain
lines, a few per stage, never a redrawn bar.  ``--no-progress``: nothing.

Third-party bars (transformers' weight loading, its GGUF de-quantization) are
switched off by the demo in every case (:func:`cxlalloc_apps.third_party.quiet_third_party`): this
module's lines say the same once, and a log never fills with ``\\r`` redraws.
rich is imported where it is used (the demo checks its arguments first).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator


class Progress:
    """Progress of one demo run, written to ``stream`` (default stderr)."""

    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(enabled)
        isatty = getattr(self.stream, "isatty", None)
        self.tty = self.enabled and bool(isatty and isatty())
        self._console = None

    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream, force_terminal=self.tty or None)
        return self._console

    def line(self, text: str) -> None:
        """One plain line (outside a terminal) or a printed line (terminal)."""
        if not self.enabled:
            return
        if self.tty:
            self.console().print(text, highlight=False, markup=False)
        else:
            print(f"cxlalloc demo: {text}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def stage(self, text: str) -> Iterator[None]:
        """A spinner (terminal) or a line (log) while ``text`` is under way,
        then a line with the time it took."""
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        if self.tty:
            with self.console().status(f"{text} ...", spinner="dots"):
                yield
        else:
            self.line(f"{text} ...")
            yield
        self.line(f"{text}: done in {time.perf_counter() - t0:.1f} s")

    def generation(self, desc: str, prompt_tokens: int, batch: int, total: int) -> "GenerationProgress":
        return GenerationProgress(self, desc, prompt_tokens, batch, total)


class GenerationProgress:
    """One generate() call: :meth:`prefill` when the prompt goes in, :meth:`token`
    per new token (the first one ends the prefill), :meth:`close` at the end."""

    def __init__(self, progress: Progress, desc: str, prompt_tokens: int, batch: int, total: int):
        self.p = progress
        self.desc = desc
        self.prompt_tokens = int(prompt_tokens)
        self.batch = int(batch)
        self.total = int(total)
        self.n = 0
        self.t0 = 0.0
        self._live = None
        self._task = None

    def prefill(self) -> None:
        self.t0 = time.perf_counter()
        what = f"{self.desc}: prefill of {self.prompt_tokens:,} prompt tokens x {self.batch}"
        if not self.p.enabled:
            return
        if self.p.tty:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, SpinnerColumn,
                                       TextColumn, TimeElapsedColumn)

            self._live = RichProgress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(), console=self.p.console(),
                                      transient=True, refresh_per_second=4)
            self._live.start()
            self._task = self._live.add_task(what, total=None)
        else:
            self.p.line(f"{what} ...")

    def token(self) -> None:
        self.n += 1
        if not self.p.enabled:
            return
        if self.n == 1:
            ttft = time.perf_counter() - self.t0
            if self._live is not None:
                self._live.update(self._task, description=f"{self.desc}: decode (first token after {ttft:.1f} s)",
                                  total=self.total, completed=1)
            else:
                self.p.line(f"{self.desc}: first token after {ttft:.1f} s; decoding up to {self.total} tokens ...")
        elif self._live is not None:
            self._live.advance(self._task)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self.p.enabled and self.t0:
            self.p.line(f"{self.desc}: {self.n} new tokens in {time.perf_counter() - self.t0:.1f} s")
            self.t0 = 0.0


