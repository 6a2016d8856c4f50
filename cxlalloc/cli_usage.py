"""Command-line conventions of every ``cxlalloc`` command (and, re-exported by
``cxlalloc_apps.usage``, of the apps): one-line usage errors, ``PROG: error:
MESSAGE`` on stderr, exit status 2; the program name as the user typed it
(:func:`program_name`).

argparse prints its usage block before an error, so a bad flag costs a
screenful of stderr and a log line that is not the reason; here the message
names the flag and ``--help`` shows the usage.  (The apps import this
through ``cxlalloc_apps.usage``; the product never imports the apps.)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


def fail(prog: str, message: str) -> NoReturn:
    """Exit with status 2 after one ``PROG: error: MESSAGE`` line on stderr."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block; ``--help``
    shows the usage), and a type's ValueError / ArgumentTypeError message (it names the option) as is."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)

    def _get_value(self, action, arg_string):
        if action.type in (int, float):  # their messages name no option: argparse's own names it
            return super()._get_value(action, arg_string)
        try:
            return action.type(arg_string) if callable(action.type) else arg_string
        except (ValueError, argparse.ArgumentTypeError) as e:  # ArgumentTypeError is no ValueError
            self.error(str(e))


def program_name(argv0: str | None = None) -> str:
    """``"python -m cxlalloc"`` when run as a module (``sys.argv[0]`` is the
    package's ``__main__.py``), else ``"cxlalloc"`` (the console script, or
    anything else that calls :func:`cxlalloc.cli.main`)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    return "python -m cxlalloc" if os.path.basename(argv0 or "") == "__main__.py" else "cxlalloc"
