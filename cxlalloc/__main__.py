"""``python -m cxlalloc``: see :mod:`cxlalloc.cli`."""

import sys

from cxlalloc.cli import main

sys.exit(main())
