"""LMCache with the cxlalloc:// plugin on a real GPU (skipped without one, and without
lmcache; scripts/gpu_check.sh runs it as its own step): KV in VRAM goes through
LMCache's CPU buffer into the kv-server's pool and back into VRAM byte-identical.

Small on purpose (seconds): 8 chunks of 256 tokens, 1 MiB each.
"""

import os

import pytest

from tests.kvstore.engines.lmc import Engine, config_yaml, import_lmcache

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_kv_from_vram_round_trips_through_lmcache_and_the_pool(server_proc, sockdir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    import_lmcache()
    sp = server_proc("--size", "256MiB", "--chunk", "4MiB")
    eng = Engine(config_yaml(os.path.join(sockdir, "gpu.yaml"), "cxlalloc://" + sp.socket, cpu_gb=0.2))
    try:
        shapes, dtypes = eng.metadata.get_shapes(), eng.metadata.get_dtypes()
        kv = [torch.randn(shapes[0], dtype=dtypes[0], device="cuda") for _ in range(8)]
        keys = [eng.key(i) for i in range(8)]
        objs = []
        for t in kv:  # what LMCache's GPU connector does on a store: VRAM -> its CPU buffer
            mo = eng.cpu.allocate(shapes, dtypes)
            mo.tensor.copy_(t)
            objs.append(mo)
        done = []
        eng.remote.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
        import time

        deadline = time.monotonic() + 30
        while len(done) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.remote.batched_contains(keys) == 8
        got = eng.remote.batched_get_blocking(keys)
        for g, t in zip(got, kv):  # and on a hit: its CPU buffer -> VRAM
            assert torch.equal(g.tensor.to("cuda"), t)
        print("pinned LMCache buffer:", bool(got[0].tensor.is_pinned()))
        for mo in [*objs, *got]:
            mo.ref_count_down()
    finally:
        eng.close()
