"""scripts/call_path.py, the file-switch count of docs/DESIGN.md's walks: it traces the client's
and the in-process kv-server's Python code, and the path goes through the one home of store I/O."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script():
    spec = importlib.util.spec_from_file_location("call_path", os.path.join(ROOT, "scripts", "call_path.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_block_walk_reaches_the_pool_and_back_through_store_io():
    r = load_script().run("block")
    path = r["path"]
    assert r["switches"] == len(path) - 1 and r["files"] == len(set(path)) and r["functions"] >= r["files"]
    assert path[0] == "hf/generate_hooks.py"  # the generate() wrapper
    # the store I/O of both directions, the client, and the server's threads (traced too)
    for f in ("hf/reuse.py", "hf/store_io.py", "kvstore/client.py", "kvstore/server/state.py", "kvstore/index.py"):
        assert f in path, (f, path)
    assert all(a != b for a, b in zip(path, path[1:]))
