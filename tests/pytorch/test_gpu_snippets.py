"""The GPU tests' subprocess scripts are at least valid Python (CPU, no GPU).

tests/pytorch/test_torch_gpu.py runs each scenario as PRELUDE + a snippet in a fresh
interpreter, and only on a GPU.  Two of its tests once failed on the H200 for
nothing but an indentation slip in how a snippet was assembled: device time
lost to a syntax error.  Here every snippet that a GPU test would run is
assembled exactly as `run_case` does and compiled, so that class of fault is
caught in CI.
"""

import inspect
import textwrap

import pytest

from tests.pytorch import test_torch_gpu as gpu_tests


class _Anything:
    """Stands in for a RESULT dict and stderr: every lookup, call and
    comparison succeeds, so a test goes on to its next run_case call."""

    def __getitem__(self, key):
        return _Anything()

    def __getattr__(self, name):
        return lambda *a, **k: _Anything()

    def __call__(self, *a, **k):
        return _Anything()

    def __eq__(self, other):
        return True

    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = lambda self, other: True
    __hash__ = object.__hash__

    def __bool__(self):
        return True

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __contains__(self, item):
        return True

    def __int__(self):
        return 0

    def __float__(self):
        return 0.0

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __abs__ = (
        lambda self, *a: _Anything())


GPU_TESTS = sorted(name for name in dir(gpu_tests) if name.startswith("test_"))


@pytest.mark.parametrize("name", GPU_TESTS)
def test_every_gpu_snippet_compiles(name, monkeypatch):
    compiled = []

    def fake_run_case(code, env=None, timeout=900, expect_rc=0):
        source = gpu_tests.PRELUDE + textwrap.dedent(code)
        compile(source, f"<{name} snippet {len(compiled) + 1}>", "exec")  # SyntaxError / IndentationError fail here
        compiled.append(source)
        return _Anything(), _Anything()

    monkeypatch.setattr(gpu_tests, "run_case", fake_run_case)
    try:
        getattr(gpu_tests, name)()
    except SyntaxError:  # IndentationError included
        raise
    except pytest.skip.Exception:
        if not compiled:
            raise  # e.g. "needs 2 GPUs" before its first snippet: nothing to check here
    except Exception:
        pass  # assertions on fake results: the snippets before them were checked
    if "run_case(" in inspect.getsource(getattr(gpu_tests, name)):
        assert compiled, f"{name} calls run_case but no snippet was assembled before it stopped"
