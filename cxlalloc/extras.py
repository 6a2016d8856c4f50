"""What to install for an optional part of cxlalloc: :func:`install_hint`.

cxlalloc is installed from a clone (it is not on PyPI), so an error that says
``pip install 'cxlalloc[hf]'`` sends a user to a package index that does not
have it.  The hint names the extra's own packages instead, read from the
installed distribution's metadata (setup.py's ``extras_require``, the one
list), and the clone's line.
Standard library only: the kv-server's command line uses it before torch is
imported.
"""

from __future__ import annotations

import re
from typing import List

_FROM_CLONE = "pip install --no-build-isolation '.[{extra}]' in the clone"


def extra_packages(extra: str) -> List[str]:
    """The requirement strings of cxlalloc's optional extra ``extra``
    (e.g. ``["transformers>=5.0", "accelerate", ...]`` for ``"hf"``), from the
    installed metadata; ``[]`` when no metadata is installed (a source tree
    run without ``pip install``) or the extra is unknown."""
    try:
        from importlib import metadata
        reqs = metadata.requires("cxlalloc") or []
    except Exception:  # PackageNotFoundError, a broken dist-info: fall back to the clone's line
        return []
    out = []
    for r in reqs:
        spec, _, marker = r.partition(";")
        m = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if m and m.group(1) == extra:
            out.append(spec.strip())
    return out


def install_hint(extra: str) -> str:
    """A one-line install instruction for cxlalloc's extra ``extra``:
    ``"install the 'hf' extra: pip install 'transformers<5.25,>=5.0' accelerate gguf 'msgpack>=1.0'
    (or pip install --no-build-isolation '.[hf]' in the clone)"`` (each requirement as the installed
    metadata writes it: a specifier set in its sorted order)."""
    pkgs = extra_packages(extra)
    clone = _FROM_CLONE.format(extra=extra)
    if not pkgs:
        return f"install the '{extra}' extra: {clone}"
    quoted = " ".join(f"'{p}'" if re.search(r"[<>=!~ ]", p) else p for p in pkgs)
    return f"install the '{extra}' extra: pip install {quoted} (or {clone})"
