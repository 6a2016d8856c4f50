"""Install hints name an extra's packages (cxlalloc is installed from a clone,
not from PyPI: ``pip install 'cxlalloc[hf]'`` cannot work for a user)."""

import ast
import os
import re

from cxlalloc.extras import extra_packages, install_hint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup_extras():
    """setup.py's ``extras_require`` literal (the one list of the extras)."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    kw = next(k for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg == "extras_require")
    return ast.literal_eval(kw.value)


def _norm(req: str):
    """(name, sorted specifiers): the installed metadata may order a specifier set differently."""
    req = req.replace(" ", "")
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    return name, sorted(s for s in req[len(name):].split(",") if s)


def test_each_extra_lists_exactly_setup_pys_packages():
    extras = _setup_extras()
    assert {"hf", "serve", "kvserver", "bench"} <= set(extras)
    for name, reqs in extras.items():
        assert [_norm(r) for r in extra_packages(name)] == [_norm(r) for r in reqs], name


def test_the_hint_names_packages_and_the_clone_never_a_package_index_cxlalloc():
    hint = install_hint("serve")
    assert "pip install 'transformers<5.25,>=5.24' 'fastapi>=0.115'" in hint and "openai" in hint
    assert "pip install --no-build-isolation '.[serve]' in the clone" in hint
    assert "cxlalloc[" not in hint
    assert install_hint("no-such-extra") == ("install the 'no-such-extra' extra: "
                                             "pip install --no-build-isolation '.[no-such-extra]' in the clone")


def test_the_docstrings_example_is_what_setup_pys_hf_extra_renders(monkeypatch):
    """install_hint's example is setup.py's 'hf' extra as the installed metadata writes it (packaging's
    Requirement: "transformers>=5.0,<5.25" is "transformers<5.25,>=5.0"); independent of the metadata
    installed here, which may predate setup.py's last change."""
    from packaging.requirements import Requirement

    import cxlalloc.extras as extras

    example = re.search(r'``"(.*?)"``', extras.install_hint.__doc__, re.S).group(1)
    rendered = [str(Requirement(r)) for r in _setup_extras()["hf"]]
    monkeypatch.setattr(extras, "extra_packages", lambda extra: rendered if extra == "hf" else [])
    assert " ".join(example.split()) == extras.install_hint("hf")
