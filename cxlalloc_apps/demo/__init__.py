"""The main job: a real model's generate() past the VRAM budget, with identical output.

    python examples/generate.py [--compare]      (= python -m cxlalloc demo ...)

Modules:
    app       the command line, the model and prompt, the runs (cxlalloc vs plain transformers), main()
    checks    what is checked before the model loads (packages, files, limits), the default device limit
    measure   generate() timing (TTFT, tokens/s, TPOT) and the bytes transformers' DynamicCache copies
    progress  what the user sees meanwhile: loading, prefill, decode (bars on a terminal, lines in a log)
    report    the report: rich tables on stdout, the same numbers as JSON
    data/     the default document (package data: a non-editable install ships it)
"""

from cxlalloc_apps.demo.app import main  # noqa: F401

__all__ = ["main"]
