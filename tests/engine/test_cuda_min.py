"""csrc/driver/cuda_min.h agrees with the CUDA toolkit's cuda.h.

A build without the toolkit compiles against cuda_min.h; one with it uses
cuda.h (setup.py's _cuda_include).  Both must give the same ABI: this compiles
tests/engine/cuda_min_check.cpp, whose static_asserts compare every enum value,
macro, type size and struct layout of cuda_min.h with cuda.h, and every entry of
driver.h's function table with cudaTypedefs.h's PFN type of the version it is
loaded at.  Skipped (with the reason) when no cuda.h is found.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_MIN = ROOT / "csrc" / "driver" / "cuda_min.h"


def _cuda_include():
    """The include dir holding cuda.h and cudaTypedefs.h, found as setup.py finds it; None if absent."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    inc = Path(home) / "include"
    return inc if (inc / "cuda.h").is_file() and (inc / "cudaTypedefs.h").is_file() else None


def _declarations(text):
    """(enumerators, macros {name: value}, type names) declared by cuda_min.h's text."""
    enumerators = re.findall(r"^\s*(CU[A-Za-z0-9_]+)\s*=", text, re.M)
    enumerators += re.findall(r"^\s*(CUDA_[A-Z0-9_]+)\s*=", text, re.M)
    macros = dict(re.findall(r"^#define\s+(CU_[A-Z0-9_]+)\s+(\S+)", text, re.M))
    types = re.findall(r"^typedef\s+[^;{]*?\b(\w+);", text, re.M)  # typedef int CUdevice;
    types += re.findall(r"^}\s*(\w+);", text, re.M)  # } CUresult;
    return sorted(set(enumerators)), macros, sorted(set(types))


def _generated(text):
    enumerators, macros, types = _declarations(text)
    out = []
    for e in enumerators:
        out.append(f'static_assert(static_cast<long long>(mini::{e}) == static_cast<long long>(::{e}), "{e}");')
    for m, v in sorted(macros.items()):
        out.append(f'static_assert(({m}) == ({v}), "{m}");')
    for t in types:
        out.append(f'static_assert(sizeof(mini::{t}) == sizeof(::{t}), "sizeof {t}");')
        out.append(f'static_assert(alignof(mini::{t}) == alignof(::{t}), "alignof {t}");')
    return "\n".join(out) + "\n", (len(enumerators), len(macros), len(types))


def test_declarations_are_parsed():
    """The generator sees what cuda_min.h declares (a parser that found nothing would check nothing)."""
    enumerators, macros, types = _declarations(CUDA_MIN.read_text())
    assert "CUDA_ERROR_OUT_OF_MEMORY" in enumerators and "CU_MEM_LOCATION_TYPE_HOST_NUMA" in enumerators
    assert "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID" in enumerators and len(enumerators) >= 90
    assert macros["CU_MEMHOSTREGISTER_DEVICEMAP"] == "0x02"
    assert {"CUdevice", "CUdeviceptr", "CUresult", "CUmemAllocationProp", "CUmemAccessDesc"} <= set(types)


def test_cuda_min_matches_cuda_h(tmp_path):
    inc = _cuda_include()
    if inc is None:
        # Not known to be on CI's image, so a missing toolkit is a skip there too.
        pytest.skip("no CUDA toolkit headers (cuda.h + cudaTypedefs.h under $CUDA_HOME/include or /usr/local/cuda/include)")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    text, counts = _generated(CUDA_MIN.read_text())
    (tmp_path / "cuda_min_generated.inc").write_text(text)
    src = ROOT / "tests" / "engine" / "cuda_min_check.cpp"
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Werror", f"-I{ROOT / 'csrc'}", f"-I{inc}", f"-I{tmp_path}", str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, "cuda_min.h disagrees with cuda.h:\n" + r.stderr[-4000:]
    assert counts[0] >= 90 and counts[2] >= 20, counts
