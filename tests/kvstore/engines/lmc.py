"""Helpers of the LMCache plugin tests: the real ``lmcache`` package (pinned
in scripts/install_lmcache.sh), an LMCache engine's storage backends built
from a YAML config as LMCache builds them, and chunk contents.

``lmcache`` is installed beside the venv (``.lmcache-site``, or the folder in
``CXLALLOC_LMCACHE_SITE``) because its pins would replace the venv's numpy;
that folder is appended to ``sys.path`` so the venv's torch and numpy win.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from tests.kvstore.kvutil import ROOT

LMCACHE_VERSION = "0.5.6"
CHUNK_TOKENS = 16
KV_SHAPE = (4, 2, CHUNK_TOKENS, 2, 64)   # layers, K/V, tokens, kv heads, head dim: 32 KiB per bf16 chunk


def lmcache_site() -> str:
    return os.environ.get("CXLALLOC_LMCACHE_SITE") or os.path.join(ROOT, ".lmcache-site")


def import_lmcache():
    """Import lmcache (skip with the reason without it; under CI=true, fail)."""
    site = lmcache_site()
    if os.path.isdir(site) and site not in sys.path:
        sys.path.append(site)
    try:
        import lmcache  # noqa: F401
        from lmcache.v1.storage_backend.connector import ConnectorAdapter  # noqa: F401
    except Exception as e:
        msg = (f"lmcache=={LMCACHE_VERSION} is not importable ({type(e).__name__}: {e}); "
               "install it with scripts/install_lmcache.sh (.ci/run does)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + " -- CI must run the LMCache plugin tests")
        pytest.skip(msg)
    import lmcache

    return lmcache


def config_yaml(path: str, url: str, *, cpu_gb: float = 0.05) -> str:
    """Write at ``path`` the LMCache config ``cxlalloc info`` prints (tiny chunks, unfull chunks kept)."""
    from cxlalloc.kvstore.engines import lmcache_yaml

    with open(path, "w") as f:
        f.write(lmcache_yaml(url, chunk_size=CHUNK_TOKENS, local_cpu_gb=cpu_gb, extra="save_unfull_chunk: true\n"))
    return path


class Engine:
    """LMCache's storage backends for one worker, created from a config file by LMCache itself."""

    def __init__(self, cfg_path: str, model: str = "tiny-llama", worker_id: int = 0, world_size: int = 1):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend import CreateStorageBackends

        self.config = LMCacheEngineConfig.from_file(cfg_path)
        self.metadata = LMCacheMetadata(model_name=model, world_size=world_size, local_world_size=world_size,
                                        worker_id=worker_id, local_worker_id=worker_id, kv_dtype=torch.bfloat16,
                                        kv_shape=KV_SHAPE, chunk_size=CHUNK_TOKENS)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.backends = CreateStorageBackends(self.config, self.metadata, self.loop)
        self.cpu = self.backends["LocalCPUBackend"]
        self.remote = next((b for n, b in self.backends.items() if n.startswith("RemoteBackend")), None)

    @property
    def connector(self):
        """The plugin's connector (inside LMCache's InstrumentedRemoteConnector)."""
        return self.remote.connection._connector

    def key(self, i: int):
        import torch
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(self.metadata.model_name, self.metadata.world_size, self.metadata.worker_id,
                              0x5EED0000 + i, torch.bfloat16)

    def chunk(self, seed: int, tokens: int = CHUNK_TOKENS):
        """A memory object from LMCache's allocator holding :func:`contents` of ``seed``."""
        mo = self.cpu.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes())
        raw = mo.tensor.reshape(-1).view(torch_uint8())
        raw.copy_(contents(seed, raw.numel()))
        return mo

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        for b in self.backends.values():
            if b is self.cpu:
                continue
            try:
                b.close()
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def torch_uint8():
    import torch

    return torch.uint8


def contents(seed: int, nbytes: int):
    """``nbytes`` seeded random bytes (a 1-D uint8 tensor): the same in every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def same_bytes(mo, want) -> bool:
    """``mo`` (a memory object) holds exactly the bytes of ``want`` (a memory object, or a seed)."""
    import torch

    if mo is None:
        return False
    got = mo.tensor.reshape(-1).view(torch.uint8)
    if isinstance(want, int):
        return torch.equal(got, contents(want, got.numel()))
    return torch.equal(got, want.tensor.reshape(-1).view(torch.uint8))


def main(argv) -> int:
    """``python -m tests.kvstore.engines.lmc put CONFIG FIRST N``: another process's LMCache puts
    chunks FIRST..FIRST+N-1 (contents from their seed) through the plugin, then exits."""
    op, cfg, first, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    import_lmcache()
    eng = Engine(cfg)
    try:
        assert op == "put"
        keys = [eng.key(i) for i in range(first, first + n)]
        objs = [eng.chunk(i) for i in range(first, first + n)]
        done = []
        eng.remote.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
        import time

        deadline = time.monotonic() + 30
        while len(done) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        print("stored", eng.remote.batched_contains(keys), flush=True)
        for mo in objs:
            mo.ref_count_down()
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
