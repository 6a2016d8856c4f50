"""Fair service for the kv-server: a first-come, first-served lock with hand-off, and a record of its holds.

The server's state is guarded by one lock, held by a request for one slice of ``--slice-keys`` blocks at a
time.  A plain ``threading.Lock`` is not fair: when a client with a 65,536-key request releases it between two
slices and asks again at once, it usually wins the lock again before the thread it woke has run (the woken
thread needs the GIL and a CPU first), so another client's one-key lookup may wait for dozens of slices
(measured: a probe's slowest lookup 0.5-0.9 s beside such a client).  :class:`FairLock` serves waiters in
the order they asked and hands the lock over directly on release: a client that releases it and asks again
goes behind every client already waiting, so clients' slices are served round-robin (each connection has one
thread, so at most one waiter).  Uncontended, it costs one extra lock operation.

:class:`HoldRecord` keeps the longest hold (wall clock: it includes a holder preempted by the scheduler).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Deque


class FairLock:
    """A mutex that grants itself in request order (FIFO) and hands off on release.

    Use as ``with lock:``; not re-entrant.  ``waiting()`` is the number of threads queued now; ``handoffs``
    counts releases that passed the lock straight to a queued thread.
    """

    __slots__ = ("_mutex", "_held", "_queue", "handoffs")

    def __init__(self) -> None:
        self._mutex = threading.Lock()      # guards _held and _queue; held only for a few operations
        self._held = False
        self._queue: Deque[threading.Lock] = collections.deque()
        self.handoffs = 0

    def acquire(self) -> bool:
        """Take the lock, waiting behind every thread that asked before (always returns True)."""
        with self._mutex:
            if not self._held:
                self._held = True
                return True
            gate = threading.Lock()
            gate.acquire()
            self._queue.append(gate)
        gate.acquire()  # released by the holder's release(): the lock is ours, still marked held
        return True

    def release(self) -> None:
        """Give the lock to the longest-waiting thread, or free it.  RuntimeError if it is not held."""
        with self._mutex:
            if not self._held:
                raise RuntimeError("FairLock.release: the lock is not held")
            if self._queue:
                self.handoffs += 1
                self._queue.popleft().release()
            else:
                self._held = False

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return self._held

    def waiting(self) -> int:
        """Threads queued for the lock now."""
        return len(self._queue)

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


class HoldRecord:
    """The longest hold of a lock seen, and how many (wall clock, microseconds).

    ``start()`` under the lock returns a token; ``stop(token)`` (still under the lock) records the hold and
    returns its microseconds.  Wall clock only: ``time.thread_time`` (the holder's CPU time) is a system call
    that took 170 us on the loaded 2-core VM this was measured on, more than a slice's work, so a hold that
    was preempted is told from a long one by comparing with ``holds`` and the load instead.
    """

    __slots__ = ("wall_us_max", "holds")

    def __init__(self) -> None:
        self.wall_us_max = 0
        self.holds = 0

    start = staticmethod(time.perf_counter)

    def stop(self, token: float) -> int:
        wall = int((time.perf_counter() - token) * 1e6)
        self.holds += 1
        if wall > self.wall_us_max:
            self.wall_us_max = wall
        return wall

    def as_dict(self) -> dict:
        """``{"holds", "hold_ms_max"}``."""
        return {"holds": self.holds, "hold_ms_max": self.wall_us_max / 1e3}
