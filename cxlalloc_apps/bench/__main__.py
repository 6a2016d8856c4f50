"""``python -m cxlalloc_apps.bench``: the same as ``cxlalloc bench``, without
the installed ``cxlalloc.apps`` entry points (a checkout built in place, as
``scripts/gpu_check.sh`` may do)."""

import sys

from cxlalloc_apps.bench.cli import main

sys.exit(main())
