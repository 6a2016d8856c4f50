"""docs/kv-server.md's two-process example, run as written: its worker.py and
its shell commands (a real kv-server process, two worker processes, --status);
process B hits the blocks A's prefill stored and generates the same tokens."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "kv-server.md"


def _blocks():
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index('<a id="two-processes"></a>'):text.index('<a id="hit"></a>')]
    code = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    assert [lang for lang, _ in code] == ["python", "bash"], code
    return code[0][1], code[1][1]


def test_the_two_process_example_of_the_docs_runs(tmp_path):
    worker, commands = _blocks()
    (tmp_path / "worker.py").write_text(worker)
    bin_dir = tmp_path / "bin"  # `python` and `cxlalloc` as the doc's reader has them: this interpreter
    bin_dir.mkdir()
    for name, target in (("python", f'exec {sys.executable} "$@"'),
                         ("cxlalloc", f'exec {sys.executable} -m cxlalloc "$@"')):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\n{target}\n")
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=path, CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1")
    script = "set -e\n" + commands
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    got = dict(re.findall(r"^worker (\w): (.*)$", r.stdout, re.M))
    assert set(got) == {"A", "B"}, r.stdout
    hit_a, tokens_a = re.match(r"hit_tokens (\d+), tokens (.*)", got["A"]).groups()
    hit_b, tokens_b = re.match(r"hit_tokens (\d+), tokens (.*)", got["B"]).groups()
    assert int(hit_a) == 0
    assert int(hit_b) == 192  # 12 full blocks of 16 of the 200-token prompt, as the doc says
    assert tokens_a == tokens_b
    assert "clients" in r.stdout  # the --status table
