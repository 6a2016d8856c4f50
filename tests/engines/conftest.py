"""Fixtures of the two-process vLLM tests (test_vllm_lmcache, test_vllm_lmcache_mp, test_vllm_offload_tier): a
work folder, the model, a kv-server and vLLM children, each stopped at the end of its test.

Ask for ``kv_server`` before ``start_child`` (pytest tears fixtures down in the reverse order): the children are
then killed before their kv-server stops.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.engines.engine_util import Child, engine_model_dir, start_kv_server


@pytest.fixture(scope="module")
def workdir():
    """A folder of the module's tests, under /tmp: short, as a unix socket path holds 107 bytes."""
    d = tempfile.mkdtemp(prefix="veng-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir():
    """The shipped SmolLM2-135M as a bf16 safetensors folder (:func:`engine_util.engine_model_dir`)."""
    return engine_model_dir()


@pytest.fixture
def kv_server(workdir):
    """A kv-server on ``workdir/kv.sock`` (128 MiB pool, 8 MiB chunks), stopped after the test (a test may kill
    it first)."""
    sp = start_kv_server(workdir)
    yield sp
    sp.stop()


@pytest.fixture
def start_child(workdir):
    """``start_child(name, spec, lmcache_config=None)``: a :class:`engine_util.Child` in ``workdir``, started at
    once and killed after the test if it is still running."""
    children = []

    def start(name: str, spec: dict, lmcache_config: str | None = None) -> Child:
        c = Child(workdir, name, spec, lmcache_config)
        children.append(c)
        return c

    yield start
    for c in children:
        c.close()
