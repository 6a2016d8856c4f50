"""Command-line conventions shared by every ``cxlalloc`` command and the apps.

* Usage errors are one line, ``PROG: error: MESSAGE``, exit status 2
  (argparse prints its usage block first, so a bad flag costs a screenful of
  stderr and a log line that is not the reason); ``--help`` shows the usage.
* The program name in usage lines is the one the user typed: ``cxlalloc``
  for the console script, ``python -m cxlalloc`` for the module.

Imports nothing but the standard library (``cxlalloc --help`` stays fast).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose :meth:`error` writes one line (no usage
    block), exit status 2; subparsers it makes are OneLineParsers too."""

    def error(self, message: str) -> NoReturn:
        one = " ".join(str(message).split())  # never more than one line, whatever the message holds
        self.exit(2, f"{self.prog}: error: {one}\n")


def fail(prog: str, message: str) -> NoReturn:
    """Exit with status 2 after one ``PROG: error: MESSAGE`` line on stderr
    (for usage errors found after parsing, without the parser at hand)."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    raise SystemExit(2)


def program_name(argv0: str | None = None) -> str:
    """``"python -m cxlalloc"`` when run as a module (``sys.argv[0]`` is the
    package's ``__main__.py``), else ``"cxlalloc"`` (the console script, or
    anything else that calls :func:`cxlalloc.cli.main`)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    return "python -m cxlalloc" if os.path.basename(argv0 or "") == "__main__.py" else "cxlalloc"
