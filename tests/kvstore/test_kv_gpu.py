"""The kv-server with clients on a real GPU (skipped without one; scripts/gpu_check.sh
runs it as its own step): the pool's chunks are registered for the GPU by each
client, a block prefilled by another process is loaded into VRAM, tokens identical.

Small on purpose (well under a minute): a tiny Llama, a 256 MiB pool in 64 MiB
chunks, device_limit 1 GiB, no managed memory.
"""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.kvstore.kvutil import ROOT

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

PROCESS_A = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {here!r})
    import torch, cxlalloc.hf as hf
    from tests.kvstore.kvutil import tiny_llama, prompts
    m = tiny_llama().cuda()
    hf.wrap(m, device_limit="1GiB", host_limit="1GiB", kv_store={url!r}, block_tokens=8)
    p = prompts()[0].cuda()
    out = m.generate(p, max_new_tokens=8, do_sample=False)
    r = hf.stats(m)["hf"]["reuse"]
    print(json.dumps({{"tokens": out.tolist(), "stored": r["last"]["stored_blocks"],
                      "registered": r["store"]["registered_bytes"], "simulated": r["store"]["simulated"]}}), flush=True)
    os._exit(0)
""")


def test_a_hit_from_another_process_loads_into_vram_with_identical_tokens(server_proc):
    from tests.kvstore.kvutil import subprocess_env as _env
    from tests.kvstore.kvutil import prompts, tiny_llama

    import cxlalloc.hf as hf

    sp = server_proc("--size", "256MiB", "--chunk", "64MiB")
    code = PROCESS_A.format(here=ROOT, url=sp.url)
    a = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert a.returncode == 0, a.stderr[-3000:]
    ra = json.loads(a.stdout.strip().splitlines()[-1])
    assert ra["stored"] >= 8 and ra["simulated"] is False
    assert ra["registered"] == 64 << 20  # one chunk registered with cuMemHostRegister, not the pool

    p1, p2 = (p.cuda() for p in prompts())
    ref = tiny_llama().cuda()
    assert ra["tokens"] == ref.generate(p1, max_new_tokens=8, do_sample=False).tolist()
    m = tiny_llama().cuda()
    hf.wrap(m, device_limit="1GiB", host_limit="1GiB", kv_store=sp.url, block_tokens=8)
    out = m.generate(p2, max_new_tokens=8, do_sample=False)
    r = hf.stats(m)["hf"]["reuse"]
    assert r["last"]["hit_tokens"] == 64 and r["last"]["fallback"] is None, r["last"]
    assert torch.equal(out, ref.generate(p2, max_new_tokens=8, do_sample=False))
    st = r["store"]
    assert st["registered_bytes"] == 64 << 20 and st["register_failures"] == 0
    assert st["simulated"] is False and st["load_GBps"] is not None
    assert sp.status()["pool"]["placement_misplaced_bytes"] == 0
