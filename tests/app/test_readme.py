"""README.md as a new user reads it: the install lines bring what the build
needs, and no Python snippet uses a module it does not import."""

import importlib.util
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_install_lines_bring_the_build_requirements_before_the_no_isolation_build():
    """``pip install --no-build-isolation .`` builds with the environment's own
    pybind11 and setuptools: the README installs each requirement of
    pyproject.toml's [build-system] first (a fresh venv failed with
    ``No module named 'pybind11'``), and passes -v (the build's progress lines)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        requires = re.search(r"^requires\s*=\s*\[(.*?)\]", f.read(), re.M | re.S).group(1)
    names = [re.match(r"[A-Za-z0-9_.-]+", r.strip().strip('"')).group(0) for r in requires.split(",") if r.strip()]
    assert "pybind11" in names and "setuptools" in names, names
    lines = [ln for ln in _readme().splitlines() if ln.startswith("pip install")]
    build = next(i for i, ln in enumerate(lines) if "--no-build-isolation" in ln)
    assert " -v " in lines[build], lines[build]
    for name in names:
        assert any(name in ln for ln in lines[:build]), f"README installs no {name} before {lines[build]!r}"


def test_setup_without_pybind11_says_what_to_install(tmp_path):
    """setup.py where pybind11 is missing (a shadowing package that fails to
    import): one line naming pybind11 and the install command, not a traceback."""
    shadow = tmp_path / "pybind11"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'pybind11'\")\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "pip install 'pybind11>=2.12'" in err[0] and "Traceback" not in r.stderr, r.stderr


def test_python_snippets_import_every_module_they_use():
    """Each ```python block of README.md, checked by ruff's undefined-name rule:
    a name left undefined may be a placeholder (``model``), never a module
    (the second snippet once used ``torch`` without ``import torch``)."""
    blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        r = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F821", "--output-format", "json",
                            "--stdin-filename", "snippet.py", "-"], input=block, capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        undefined = {re.search(r"`(\w+)`", d["message"]).group(1) for d in json.loads(r.stdout or "[]")}
        modules = sorted(n for n in undefined if importlib.util.find_spec(n) is not None)
        assert not modules, f"README snippet uses {modules} without importing them:\n{block}"
