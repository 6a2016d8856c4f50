"""Command-line usage errors as one line: ``PROG: error: MESSAGE``, exit status 2.

argparse prints its usage block before the error, so a bad flag costs a
screenful of stderr and a log line that is not the reason.  The parsers of
``python -m cxlalloc demo`` and ``bench`` use :class:`OneLineParser` instead:
the message names the flag; ``--help`` shows the usage.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose :meth:`error` writes one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        one = " ".join(str(message).split())  # never more than one line, whatever the message holds
        self.exit(2, f"{self.prog}: error: {one}\n")


def fail(prog: str, message: str) -> NoReturn:
    """Exit with status 2 after one ``PROG: error: MESSAGE`` line on stderr
    (for usage errors found after parsing, without the parser at hand)."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    raise SystemExit(2)
