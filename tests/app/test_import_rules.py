"""The import directions CONTRIBUTING.md writes down ("Import directions"),
checked on the source: every module of ``cxlalloc`` (the product) and
``cxlalloc_apps`` (the apps beside it) is parsed with :mod:`ast`, never
imported, so a violation is found even in a module no test runs.

``RULES`` mirrors the table in CONTRIBUTING.md row by row; change both
together.  Module-level imports are the ones outside any function (an
``if TYPE_CHECKING:`` block counts as none); a rule marked ``anywhere`` also
covers imports inside functions.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from typing import Dict, List, NamedTuple, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("cxlalloc", "cxlalloc_apps")
# The compiled extensions (setup.py): modules without a .py file.
EXTENSIONS = ("cxlalloc._C", "cxlalloc._simcuda")
TOP_LEVEL = ("cxlalloc.config", "cxlalloc.allocator", "cxlalloc.engine", "cxlalloc.topology", "cxlalloc._sim",
             "cxlalloc.cli", "cxlalloc.cli_usage", "cxlalloc.serve_cli")
# The top of cxlalloc.kvstore: the store contract, the in-process store and what client and server share.
KVSTORE_TOP = tuple(f"cxlalloc.kvstore.{m}" for m in ("store", "keys", "layout", "index", "local", "open", "handles",
                                                       "counters", "protocol", "client", "remote_handles",
                                                       "blockcopy"))


class Rule(NamedTuple):
    importers: Tuple[str, ...]   # module names or package prefixes the rule applies to
    forbidden: Tuple[str, ...]   # what they must not import
    anywhere: bool               # also imports inside functions


# The table of CONTRIBUTING.md, "Import directions", in its order.
RULES = [
    Rule(TOP_LEVEL, ("cxlalloc.pytorch", "cxlalloc.hf", "cxlalloc.kvstore"), False),
    Rule(("cxlalloc.pytorch",), ("cxlalloc.hf", "cxlalloc.kvstore"), False),
    Rule(("cxlalloc.kvstore",), ("cxlalloc.hf", "cxlalloc.pytorch"), False),
    Rule(KVSTORE_TOP, ("cxlalloc.kvstore.server", "cxlalloc.kvstore.engines"), True),
    Rule(("cxlalloc.kvstore.tiers",), ("cxlalloc.kvstore.server", "cxlalloc.kvstore.engines"), True),
    Rule(("cxlalloc.policy",), ("cxlalloc", "cxlalloc_apps"), True),
    Rule(("cxlalloc.plan",), ("cxlalloc.pytorch", "cxlalloc.hf", "cxlalloc.kvstore"), True),
    Rule(("cxlalloc",), ("cxlalloc_apps",), True),
    Rule(("cxlalloc_apps.bench",), ("cxlalloc_apps.demo",), True),
    Rule(("cxlalloc_apps.demo",), ("cxlalloc_apps.bench",), True),
    Rule(("cxlalloc_apps.usage", "cxlalloc_apps.third_party"), ("cxlalloc_apps.bench", "cxlalloc_apps.demo"), True),
]

# Exceptions to a rule, each with its reason (CONTRIBUTING.md names them).
EXEMPT = {
    # `cxlalloc info` reports whether the torch adapter can be built; adapter_build imports no torch at module level.
    ("cxlalloc.cli", "cxlalloc.pytorch.adapter_build"),
}
# Every module may import its own package (a policy module another policy module): a rule forbids the rest.

# The product's public API, as far as the apps are concerned: the packages'
# exports (``cxlalloc/__init__.py``, ``cxlalloc.hf``, ``cxlalloc.kvstore``).
PUBLIC = ("cxlalloc", "cxlalloc.hf", "cxlalloc.kvstore")
# The private pieces the apps still use (CONTRIBUTING.md, "Import directions").
APP_PRIVATE_ALLOWED = ("cxlalloc._C", "cxlalloc.config", "cxlalloc.topology", "cxlalloc.kvstore.client",
                       "cxlalloc.kvstore.protocol", "cxlalloc.kvstore.server.cli", "cxlalloc.kvstore.tiers.redis",
                       "cxlalloc.hf.reuse", "cxlalloc.cli_usage", "cxlalloc.extras",
                       "cxlalloc.kvstore.engines.lmcache_plugin")


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def find_modules() -> Dict[str, str]:
    """{dotted module name: path} of every ``.py`` file of the two packages."""
    out = {}
    for top in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "_adapter_src", "data")]
            for f in files:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out[".".join(parts)] = os.path.join(d, f)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(module: str, path: str, known: Set[str]) -> List[Tuple[str, bool]]:
    """(imported module, at module level) for every import of ``module`` that
    names one of ours; ``from P import X`` counts as ``P.X`` when that is a module."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    out: List[Tuple[str, bool]] = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), top)
            elif isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    out.append((full if full in known else base, top))
            else:
                visit(child, top)

    visit(tree, True)
    return [(m, top) for m, top in out if m.split(".")[0] in PACKAGES]


def import_graph():
    mods = find_modules()
    known = set(mods) | set(EXTENSIONS)
    return mods, {m: imports_of(m, p, known) for m, p in mods.items()}


def violations(graph) -> List[str]:
    bad = []
    for mod, imps in sorted(graph.items()):
        for target, top in imps:
            for rule in RULES:
                if (_under(mod, rule.importers) and _under(target, rule.forbidden) and (top or rule.anywhere)
                        and (mod, target) not in EXEMPT and not _under(target, rule.importers)):
                    bad.append(f"{mod} imports {target}{'' if top else ' (in a function)'}: "
                               f"{rule.importers} never import {rule.forbidden}")
    return bad


def import_circles(graph) -> List[List[str]]:
    """Strongly connected components (more than one module, or a module that
    imports itself) of the module-level import graph (Tarjan)."""
    edges = defaultdict(set)
    for mod, imps in graph.items():
        for target, top in imps:
            if top and target in graph:
                edges[mod].add(target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_rules_mirror_contributing_md():
    """Every rule row of CONTRIBUTING.md's table is in RULES, and no other."""
    text = open(os.path.join(ROOT, "CONTRIBUTING.md"), encoding="utf-8").read()
    table = text[text.index("## Import directions"):].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| importer")]
    assert len(rows) == len(RULES), rows
    for row, rule in zip(rows, RULES):
        importer, forbidden = (cell.strip() for cell in row.strip("|").split("|"))
        for name in rule.forbidden:
            assert f"`{name}`" in forbidden, (row, rule)
        for name in rule.importers:
            assert f"`{name}`" in importer or f"`{name.rsplit('.', 1)[-1]}`" in importer, (row, rule)
        assert ("also inside functions" in importer) == rule.anywhere, (row, rule)


def test_lower_layers_never_import_higher_ones():
    _, graph = import_graph()
    assert violations(graph) == []


def test_policy_is_pure():
    """``cxlalloc/policy/`` imports the standard library and itself only (no
    torch, no numpy, nothing of the project: CONTRIBUTING.md), anywhere in a module."""
    import sys

    mods = find_modules()
    policy = {m: p for m, p in mods.items() if _under(m, ("cxlalloc.policy",))}
    assert "cxlalloc.policy.cb_moves" in policy and "cxlalloc.policy.kv_growth" in policy
    bad = []
    for mod, path in sorted(policy.items()):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not _under(name, ("cxlalloc.policy",)):
                    bad.append(f"{mod} imports {name}")
    assert bad == []


def test_no_import_circles():
    _, graph = import_graph()
    assert import_circles(graph) == []


def test_apps_use_the_public_api_and_the_listed_pieces():
    _, graph = import_graph()
    bad = sorted({f"{mod} imports {target}" for mod, imps in graph.items() if mod.startswith("cxlalloc_apps")
                  for target, _ in imps
                  if target.split(".")[0] == "cxlalloc" and target not in PUBLIC
                  and not _under(target, APP_PRIVATE_ALLOWED)})
    assert bad == []


def test_the_checker_sees_a_violation_and_a_circle(tmp_path):
    """The checks can fail: a product module importing an app, an app
    importing the other, and a two-module circle, in a synthetic graph."""
    graph = {"cxlalloc.config": [("cxlalloc_apps.demo.app", False)],
             "cxlalloc_apps.bench.cli": [("cxlalloc_apps.demo", True)],
             "cxlalloc_apps.demo": [], "cxlalloc_apps.demo.app": [("cxlalloc_apps.demo", True)],
             "cxlalloc.allocator": [("cxlalloc.engine", True)], "cxlalloc.engine": [("cxlalloc.allocator", True)],
             # the rooms of cxlalloc.kvstore and the pure policies
             "cxlalloc.kvstore.local": [("cxlalloc.kvstore.server.state", False)],
             "cxlalloc.kvstore.tiers.redis": [("cxlalloc.kvstore.server.jobs", True)],
             "cxlalloc.kvstore.server.jobs": [("cxlalloc.kvstore.tiers", True), ("cxlalloc.kvstore.index", True)],
             "cxlalloc.policy.store_eviction": [("cxlalloc.config", False), ("cxlalloc.policy", True)]}
    assert len(violations(graph)) == 5
    assert import_circles(graph) == [["cxlalloc.allocator", "cxlalloc.engine"]]
    # relative imports resolve like absolute ones
    pkg = tmp_path / "m.py"
    pkg.write_text("from . import engine\nfrom .hf import wrap\n\ndef f():\n    import cxlalloc_apps.demo\n")
    known = {"cxlalloc.engine", "cxlalloc.hf"}
    assert imports_of("cxlalloc.m", str(pkg), known) == [("cxlalloc.engine", True), ("cxlalloc.hf", True),
                                                         ("cxlalloc_apps.demo", False)]


# CONTRIBUTING.md, "Where new code goes": the KV store's modules stay readable alone.
SIZE_LIMITS = {"cxlalloc.kvstore": (600, 400)}   # package -> (lines per module, lines per class)


def oversized(mods: Dict[str, str]) -> List[str]:
    """Modules of the packages in ``SIZE_LIMITS`` over their line limit, and classes over theirs."""
    bad = []
    for mod, path in sorted(mods.items()):
        for pkg, (max_file, max_class) in SIZE_LIMITS.items():
            if not _under(mod, (pkg,)):
                continue
            text = open(path, encoding="utf-8").read()
            if text.count("\n") > max_file:
                bad.append(f"{mod}: {text.count(chr(10))} lines (at most {max_file})")
            for node in ast.walk(ast.parse(text, path)):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > max_class:
                    bad.append(f"{mod}.{node.name}: {node.end_lineno - node.lineno + 1} lines (at most {max_class})")
    return bad


def test_kvstore_modules_and_classes_stay_small(tmp_path):
    mods, _ = import_graph()
    assert oversized(mods) == []
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + "    x = 1\n" * 400 + "\n" * 200)
    assert oversized({"cxlalloc.kvstore.big": str(big), "cxlalloc.other": str(big)}) == [
        "cxlalloc.kvstore.big: 601 lines (at most 600)", "cxlalloc.kvstore.big.Big: 401 lines (at most 400)"]
