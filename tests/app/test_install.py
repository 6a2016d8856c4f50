"""What a non-editable install (``pip install .``) ships: every module of the
product and of the apps beside it, the ``cxlalloc.apps`` entry points, the main job's default document (package data), the torch adapter's
sources (built at run time), the start-up hook, and (the wheel) both compiled
libraries.  An editable install reads all of these from the source tree, so only
a build shows a file that is left out."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCUMENT = "cxlalloc_apps/demo/data/tide_stations_report.txt"


def expected_files():
    """Paths (inside site-packages) that an install must hold, from the source tree."""
    out = {DOCUMENT, "cxlalloc/py.typed", "cxlalloc-startup.pth", "cxlalloc/_adapter_src/capi/c_api.h"}
    for path in (glob.glob(os.path.join(ROOT, "cxlalloc", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "cxlalloc_apps", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "cxlalloc", "plan", "presets", "*.json"))):  # cxlalloc plan's configs
        out.add(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    for path in glob.glob(os.path.join(ROOT, "csrc", "torch", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "torch",
                                                                                                  "*.h")):
        out.add("cxlalloc/_adapter_src/torch/" + os.path.basename(path))
    return out


def test_build_py_ships_modules_document_and_adapter_sources(tmp_path):
    """The pure-Python half of a wheel (``build_py``: no compiler, about a second)."""
    lib = tmp_path / "lib"
    p = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {os.path.relpath(os.path.join(d, f), lib).replace(os.sep, "/") for d, _, fs in os.walk(lib) for f in fs}
    missing = sorted(expected_files() - got)
    assert not missing, f"a non-editable install would lack {missing}"
    assert (lib / DOCUMENT).read_bytes() == open(os.path.join(ROOT, DOCUMENT), "rb").read()


def _source_copy(dest):
    """The files a build reads (so that the build writes nothing into the checkout)."""
    keep = ("csrc", "cxlalloc", "cxlalloc_apps", "setup.py", "pyproject.toml", "cxlalloc-startup.pth", "README.md", "LICENSE")
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "_adapter_src")
    for name in keep:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), ignore=skip)
        elif os.path.exists(src):
            shutil.copy(src, os.path.join(dest, name))
    return dest


@pytest.mark.slow
def test_wheel_ships_document_adapter_sources_and_libraries(tmp_path):
    """``pip wheel --no-deps --no-build-isolation`` (what ``pip install .`` builds;
    compiles the extension, minutes on 2 cores) of a copy of the sources."""
    src = _source_copy(tmp_path / "src")
    out = tmp_path / "wheels"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", str(src), "-w", str(out)], capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    (wheel,) = glob.glob(str(out / "cxlalloc-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        document = z.read(DOCUMENT)
        (ep_file,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(ep_file).decode()
    missing = sorted(expected_files() - names)
    assert not missing, f"the wheel lacks {missing}"
    for lib in ("_C", "_simcuda"):
        assert any(n.startswith(f"cxlalloc/{lib}.") and n.endswith(".so") for n in names), lib
    assert document == open(os.path.join(ROOT, DOCUMENT), "rb").read()
    from tests.app.conftest import declared_apps

    group, commands = declared_apps()
    assert f"[{group}]" in entry_points
    for name, target in commands.items():
        assert f"{name} = {target}" in entry_points, entry_points
