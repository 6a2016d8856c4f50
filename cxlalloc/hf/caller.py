"""Where a warning of the HF wrapper points: the user's line, past cxlalloc and the libraries it runs under.

A warning raised inside a wrapped ``generate()`` is several frames below the user's call, and how many depends
on the path (transformers' ``generate()`` and its decorators, torch's ``no_grad``, PEFT's and accelerate's
wrappers, a hook called from ``Module.__call__``).  A fixed ``stacklevel`` then names a line in ``sys``,
``contextlib`` or transformers' ``utils.py``; :func:`user_stacklevel` counts the frames instead.
"""

from __future__ import annotations

import sys

# Modules whose frames sit between the user's call and the line that warns (prefix match on ``__name__``).
_LIBRARIES = ("cxlalloc.", "transformers.", "torch.", "accelerate.", "peft.")
_MODULES = frozenset({"cxlalloc", "transformers", "torch", "accelerate", "peft", "contextlib", "functools",
                      "threading", "importlib"})


def _is_library(name: str) -> bool:
    return name in _MODULES or name.startswith(_LIBRARIES)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by this function's caller that points at the first frame
    outside cxlalloc and the libraries above (the user's ``generate()`` line, or the test calling it).

    Returns:
        int >= 1: 1 is the caller itself; where every frame is library code (an engine thread), the outermost.
    """
    level, f = 1, sys._getframe(1)
    while f.f_back is not None and _is_library(f.f_globals.get("__name__", "")):
        level, f = level + 1, f.f_back
    return level
