#!/usr/bin/env python3
"""The main job: a real model's generate() past the VRAM budget with identical output.

    python examples/generate.py [--compare] [--max-new-tokens N] [--device-limit SIZE] ...

Same as ``python -m cxlalloc demo ...``; all the logic is in cxlalloc_apps/demo/app.py
(``--help`` lists the options).  Without a GPU it runs in simulation and says so
on its first line.
"""

import sys

from cxlalloc_apps.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="examples/generate.py"))
