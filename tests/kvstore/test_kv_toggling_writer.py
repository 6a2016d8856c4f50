"""The checksum guards the bytes actually copied (issue 29, item 6).

Before: a block's trailer was verified in the shared pool, then its bytes were read from the pool again for
the copy into the KV cache, so a writer that changed them between the two reads (another client of the
kv-server with its own read-write mapping) got unverified K/V copied: 11 wrong answers in 400 calls.  Now
each block is copied out of the pool once into private memory, that copy is verified, and the KV cache is
filled from it: a block torn by the writer fails its checksum (dropped, recomputed), a block that passes is
exactly the bytes the cache gets.

The writer's side: a block recomputed after a torn load is stored again, often in the same pool slot the
toggler keeps flipping; sealed over the pool, its checksum covered the flipped bytes and a later reader
accepted them (CI: 2 wrong answers in 120 calls; here, with the seal over the pool, every run of 600 calls
failed).  Now the writer seals a private copy and copies it into the pool whole
(``BlockWriter``, ``RemoteBlockStore.views_shared``).
"""

import subprocess
import sys
import textwrap

import torch

from cxlalloc.hf.wrap import _state
from cxlalloc.kvstore import keys as K
from tests.kvstore.kvutil import ROOT, prompts, subprocess_env, tiny_llama

import cxlalloc.hf as hf

BT = 8
CALLS = 400

# Another client of the same kv-server: maps the pool read-write and toggles 4 KiB of three stored blocks
# (flip, flip back) as fast as it can until killed.
TOGGLER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from tests.kvstore.kvutil import RawClient
    c = RawClient({path!r}, name="toggler")
    reply = c.call("lookup", ns="", keys=[bytes.fromhex(h) for h in {keys!r}])
    spans = [(off, min(n, 4096)) for off, n, _ in reply["blocks"][1:4]]
    c.call("release", leases=[reply["lease"]])
    m = c.mapping()
    print("READY", len(spans), flush=True)
    while True:
        for off, n in spans:
            m[off:off + n] = bytes(b ^ 0x5A for b in m[off:off + n])
""")


def test_a_writer_toggling_stored_bytes_during_hits_never_gives_a_wrong_answer(kv_server, fresh_sim):
    srv = kv_server()
    p = prompts(doc_tokens=40, n=1)[0]
    m, ref = tiny_llama(), tiny_llama()
    hf.wrap(m, device_limit="256MiB", host_limit="512MiB", kv_store=srv.url, block_tokens=BT,
            kv_conversation_limit=0)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    want = ref.generate(p, **kw)
    assert torch.equal(m.generate(p, **kw), want)  # stores the prompt's blocks
    keys = K.chain_keys(_state(m).reuse.root(None), p[0], BT)
    code = TOGGLER.format(root=ROOT, path=srv.socket_path, keys=[k.hex() for k in keys])
    tog = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env(),
                           cwd=ROOT)
    try:
        assert tog.stdout.readline().split()[0] == "READY"
        wrong = hits = 0
        for _ in range(CALLS):
            out = m.generate(p, **kw)
            wrong += not torch.equal(out, want)
            hits += hf.stats(m)["hf"]["reuse"]["last"]["hit_tokens"] > 0
    finally:
        tog.kill()
        tog.wait()
    corrupt = hf.stats(m)["hf"]["reuse"]["counters"]["corrupt_blocks"]
    assert wrong == 0, f"{wrong} wrong answers in {CALLS} calls ({hits} with a hit, {corrupt} corrupt blocks caught)"
    assert hits > 0 and corrupt > 0  # the race was on: hits happened and torn blocks were caught
