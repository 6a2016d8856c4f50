"""docs/planning.md's Python example, run as written: ``plan`` from one
``PlanInputs`` gives the record the CLI prints, and equals ``plan(model,
field=...)``; the printed GPU counts are the record's."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "planning.md")


def python_blocks():
    return re.findall(r"```python\n(.*?)```", open(DOC).read(), re.S)


def test_the_python_example_runs_and_agrees_with_the_cli(tmp_path):
    blocks = python_blocks()
    assert len(blocks) == 1, "docs/planning.md: one python block expected (this test runs it)"
    env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", blocks[0]], env=env, capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    cli = subprocess.run([sys.executable, "-m", "cxlalloc", "plan", "--model", "llama-3.1-8b", "--context", "32768",
                          "--users", "64", "--gpu", "h200", "--json", "--no-records"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert cli.returncode == 0, cli.stderr
    gpus = json.loads(cli.stdout)["gpus"]
    assert r.stdout == f"{gpus['without_host']} GPUs without the host tier, {gpus['with_host']} with it\n"


def test_plan_inputs_replace_and_reject_unknown_fields():
    import pytest

    from cxlalloc.plan import PlanInputs, plan
    from cxlalloc.plan.cli import resolve_model

    base = PlanInputs(resolve_model("llama-3.1-8b"), users=8)
    # keyword options replace the dataclass's fields
    assert plan(base, users=16)["inputs"]["users"] == 16
    assert plan(base)["inputs"]["users"] == 8
    with pytest.raises(TypeError, match="userz"):
        plan(base.model, userz=3)
    with pytest.raises(ValueError, match="--users"):
        plan(base, users=0)
