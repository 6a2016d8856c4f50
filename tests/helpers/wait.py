"""Polling helper shared by the tests: wait until a condition holds, with a deadline."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Call ``pred`` every ``interval`` seconds until it returns something true or
    ``timeout`` seconds passed; returns its last value (falsy on timeout), so a
    test writes ``assert wait_until(lambda: ...)``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    return pred()
