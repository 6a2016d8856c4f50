"""Build and run one of tests/engine's C++ unit tests (``*_test.cpp``).

Each such test compiles its .cpp with the csrc/ sources the class under test
links against and prints ``ok: N checks`` (exit 0) or every failed check
(exit 1).  Used by test_tier_limits.py and test_pending_frees.py.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build(test_cpp, sources, out_dir):
    """Compile ``tests/engine/<test_cpp>`` with ``csrc/<sources>`` into ``out_dir``.

    Returns the executable's path; skips the test when no C++ compiler is
    installed; fails with the compiler's message on an error (-Werror).
    """
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = Path(out_dir) / Path(test_cpp).stem
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'csrc'}", "-o", str(exe),
           str(ROOT / "tests" / "engine" / test_cpp), *(str(ROOT / "csrc" / s) for s in sources), "-ldl", "-pthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


def run_checks(exe, *args):
    """Run a built unit test; return its number of checks (asserting all passed)."""
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.fullmatch(r"ok: (\d+) checks\n", r.stdout)
    assert m, r.stdout
    return int(m.group(1))
