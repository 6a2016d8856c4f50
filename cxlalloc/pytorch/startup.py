"""Start-up activation through the ``CXLALLOC`` environment variable.

``cxlalloc-startup.pth`` (installed at the top of site-packages) imports this
module only when ``CXLALLOC`` is set, so every other Python process pays one
``os.environ`` lookup.  Here the value is validated at once (a bad key or
value: one ``cxlalloc: error: ...`` line on stderr naming it; the program
still runs, without cxlalloc) and a post-import hook is installed that calls
``cxlalloc.enable(**options)`` right after ``torch`` finishes importing, i.e.
before anything can initialise CUDA: global mode, with no code change.  This
holds for ``python script.py``, ``python -m ...``, torchrun workers and any
subprocess that inherits the variable.

Nothing here may break the interpreter: every problem becomes one line on
stderr, and the program continues (``CXLALLOC=1`` with a CPU-only torch:
``cxlalloc: warning: CXLALLOC is set but cxlalloc is not enabled: ...``).
``CXLALLOC=simulate:1`` cannot apply to torch (torch cannot allocate from a
simulated GPU): once torch is imported, one warning line says so and points
to the simulated entry points.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import warnings

from cxlalloc.config import make_enable_config, parse_env
from cxlalloc.pytorch.modes import enable_from

_done = False
# The error line already printed for a bad CXLALLOC (the CLI's `run` then
# does not print it a second time), or None.
reported_error: str | None = None


def _line(kind: str, msg: str) -> None:
    text = " ".join(str(msg).split())  # one line, whatever the message holds
    try:
        sys.stderr.write(f"cxlalloc: {kind}: {text}\n")
        sys.stderr.flush()
    except Exception:
        pass


_SIMULATE_NOTE = ('CXLALLOC=simulate:1 has no effect on torch (torch cannot allocate from a simulated GPU), so cxlalloc is not enabled; for simulated tiers use cxlalloc.Allocator(simulate=True), cxlalloc.hf.wrap(model, simulate=True), or `python -m cxlalloc demo|bench --simulate`')


def _enable_now(options: dict) -> None:
    global _done
    if _done:
        return
    _done = True
    if str(options.get("simulate", "")).strip().lower() in ("1", "true", "yes", "on"):
        _line("warning", _SIMULATE_NOTE)
        return
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            enable_from(options, source="the CXLALLOC environment variable")
        for w in caught:  # scoped mode / fallback notice: one line each
            _line("warning", w.message)
    except Exception as e:
        _line("warning", f"CXLALLOC is set but cxlalloc is not enabled: {e}")


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so that cxlalloc is enabled
    as soon as ``torch`` (the package) has finished executing."""

    def __init__(self, options: dict):
        self.options = options

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        try:
            sys.meta_path.remove(self)  # one shot; also avoids recursion below
        except ValueError:
            pass
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        options = self.options

        def exec_module(module):
            original(module)
            _enable_now(options)

        loader.exec_module = exec_module
        return spec


def _main() -> None:
    text = os.environ.get("CXLALLOC", "")
    try:
        options = parse_env(text)
        if options is None:
            return
        make_enable_config(**options)  # every option checked here, before CUDA starts, so a bad value is one line
    except ValueError as e:
        global reported_error
        msg = str(e) if str(e).startswith("CXLALLOC") else f"CXLALLOC: {e}"
        reported_error = msg
        _line("error", f"{msg} (cxlalloc is not enabled)")
        return
    # simulate:1 only warns (in _enable_now), and only in processes that
    # import torch: others stay silent.
    if "torch" in sys.modules:
        _enable_now(options)
    else:
        sys.meta_path.insert(0, _TorchImportHook(options))


try:
    _main()
except Exception as _e:  # never break the interpreter
    _line("warning", f"CXLALLOC start-up hook failed ({type(_e).__name__}: {_e}); cxlalloc is not enabled")
