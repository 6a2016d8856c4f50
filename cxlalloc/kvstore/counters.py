"""Thread-safe counters of a block store, and the transfer accounting every store shares.

``record_load``/``record_store``/``record_failure`` are what
:mod:`cxlalloc.hf.reuse` calls after it copied blocks into or out of a store
(it times the copies itself, around a stream synchronize on a GPU), so every
store (in-process, kv-server client) reports ``bytes_loaded``/``load_GBps``
the same way.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable

TRANSFER_FIELDS = ("bytes_loaded", "load_seconds", "loads", "bytes_stored", "store_seconds", "load_failures")


class StoreCounters:
    """Named counters (ints or floats) under one lock.

    Args:
        names: the counters besides :data:`TRANSFER_FIELDS`, all starting at 0.
    """

    def __init__(self, names: Iterable[str]):
        self._lock = threading.Lock()
        self._c: Dict[str, float] = {n: 0 for n in (*TRANSFER_FIELDS, *names)}
        self._c["load_seconds"] = self._c["store_seconds"] = 0.0

    def add(self, name: str, n=1) -> None:
        with self._lock:
            self._c[name] += n

    def record_load(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` copied from the store into a cache in ``seconds``."""
        with self._lock:
            self._c["bytes_loaded"] += int(nbytes)
            self._c["load_seconds"] += float(seconds)
            self._c["loads"] += 1

    def record_store(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` copied from a cache into the store in ``seconds``."""
        with self._lock:
            self._c["bytes_stored"] += int(nbytes)
            self._c["store_seconds"] += float(seconds)

    def record_failure(self) -> None:
        """A load failed and the caller recomputed the prompt."""
        self.add("load_failures")

    def snapshot(self) -> dict:
        """A copy of every counter plus ``load_GBps``/``store_GBps`` (1 GB =
        1e9 bytes; None before the first timed copy)."""
        with self._lock:
            c = dict(self._c)
        c["load_GBps"] = c["bytes_loaded"] / c["load_seconds"] / 1e9 if c["load_seconds"] > 0 else None
        c["store_GBps"] = c["bytes_stored"] / c["store_seconds"] / 1e9 if c["store_seconds"] > 0 else None
        return c

    def __getitem__(self, name: str):
        with self._lock:
            return self._c[name]
