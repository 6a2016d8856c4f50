"""What every store's lease and reservation share: release on ``with`` exit and
when garbage-collected, and file descriptors closed on an error path.

A lease pins blocks (they cannot be evicted while it lives); a reservation
holds slots being written (never visible until committed).  Both must give
their hold back however the caller leaves — an exception inside ``with``, or
a handle dropped without a call — so the release runs from ``__exit__`` and,
as a last resort, from ``__del__`` (where an exception must not escape: the
interpreter would only print it).
"""

from __future__ import annotations

import os
from typing import Iterable


class ScopedHandle:
    """Base of leases and reservations: :meth:`_release` runs on ``with`` exit
    and at garbage collection.  Subclasses set ``_release`` to their
    ``close`` (leases) or ``abort`` (reservations; a no-op after ``commit``)."""

    def _release(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._release()

    def __del__(self):
        try:
            self._release()
        except Exception:
            pass


def close_fds(fds: Iterable[int]) -> None:
    """Close every descriptor of ``fds``, ignoring ones already closed (an error
    path must not raise a second error over the first)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
