"""One-line usage errors for the product's command lines (``cxlalloc plan``,
``cxlalloc serve``): ``PROG: error: MESSAGE`` on stderr, exit status 2.

argparse prints its usage block before an error, so a bad flag costs a
screenful of stderr and a log line that is not the reason; here the message
names the flag and ``--help`` shows the usage.  (The apps beside the product
have their own, ``cxlalloc_apps.usage``: the product never imports them.)
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


def fail(prog: str, message: str) -> NoReturn:
    """Exit with status 2 after one ``PROG: error: MESSAGE`` line on stderr."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block; ``--help``
    shows the usage), and a type's ValueError message (it names the option) as is."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)

    def _get_value(self, action, arg_string):
        try:
            return action.type(arg_string) if callable(action.type) else arg_string
        except ValueError as e:
            self.error(str(e))
