"""Command-line usage errors as one line: ``PROG: error: MESSAGE``, exit status 2.

The parsers of ``cxlalloc demo`` and ``bench`` use :class:`OneLineParser`:
the message names the flag; ``--help`` shows the usage.  The same
conventions as the product's own commands (``cxlalloc.cli_usage``), re-exported
so the apps keep one import.
"""

from cxlalloc.cli_usage import OneLineParser, fail, program_name

__all__ = ["OneLineParser", "fail", "program_name"]
