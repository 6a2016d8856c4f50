"""Processes killed mid-operation, generate() across processes, and who may attach.

Real processes: the server runs as ``python -m cxlalloc kv-server``; crashing
clients are small scripts killed with SIGKILL at chosen or random moments.
"""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import cxlalloc.hf as hf
from tests.kvstore.kvutil import ROOT, subprocess_env as _env
from tests.kvstore.kvutil import RawClient, generate, key, prompts, tiny_llama

BLOCK = 256 << 10


def _pattern(k: bytes, n: int) -> bytes:
    seed = hashlib.blake2b(k, digest_size=64).digest()
    return (seed * (n // len(seed) + 1))[:n]


# A client that inserts blocks whose bytes are a function of their key, in
# small pieces (so a kill lands mid-block), for ever; it prints each key it
# has committed.
WRITER = textwrap.dedent("""
    import hashlib, mmap, os, sys, time
    sys.path.insert(0, {here!r})
    from tests.kvstore.kvutil import RawClient, key
    c = RawClient({path!r})
    m = mmap.mmap(c.fd, c.hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    B = {block}
    def pattern(k):
        seed = hashlib.blake2b(k, digest_size=64).digest()
        return (seed * (B // len(seed) + 1))[:B]
    print("READY", flush=True)
    i = {start}
    while True:
        ks = [key(i + j, b"w") for j in range(4)]
        r = c.call("reserve", ns="crash", keys=ks, nbytes=B, tokens=64)
        for k, off in zip(ks, r["slots"]):
            if off is None:
                continue
            data = pattern(k)
            for p in range(0, B, 4096):
                m[off + p:off + p + 4096] = data[p:p + 4096]
            if {stop_half} and i == {start}:
                print("HALF", flush=True)
                time.sleep(60)
        if r["res"]:
            c.call("commit", res=r["res"])
        print("COMMITTED", i, flush=True)
        i += 4
""")


def _writer(path, start=0, stop_half=False):
    code = WRITER.format(here=ROOT, path=path, block=BLOCK, start=start,
                         stop_half=stop_half)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=_env(), cwd=ROOT, text=True)
    assert p.stdout.readline().strip() == "READY"
    return p


def test_client_killed_mid_insert_publishes_nothing_half_written(server_proc):
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB")
    p = _writer(sp.socket, stop_half=True)
    assert p.stdout.readline().strip() == "HALF"  # 4 slots reserved, one written, none committed
    st = sp.status()["pool"]
    assert st["writing_blocks"] == 4
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 5
    while sp.status()["pool"]["writing_blocks"] and time.monotonic() < deadline:
        time.sleep(0.02)
    st = sp.status()["pool"]
    assert st["writing_blocks"] == 0 and st["aborted_blocks"] == 4 and st["blocks"] == 0
    c = RawClient(sp.socket)
    assert c.call("lookup", ns="crash", keys=[key(j, b"w") for j in range(4)])["blocks"] == []
    c.close()


def test_random_kills_never_leave_a_torn_block_visible(server_proc):
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB")
    rng = random.Random(7)
    tried = []
    # At least 3 kills, and more until one has landed mid-insert (a kill
    # between two inserts proves nothing; on a loaded machine it can take a few).
    for round_ in range(12):
        p = _writer(sp.socket, start=round_ * 100000)
        time.sleep(rng.uniform(0.05, 0.3))
        p.send_signal(signal.SIGKILL)
        out = p.communicate()[0]
        tried.append(4 * (out.count("COMMITTED") + 2))  # committed, and the reservation in flight
        deadline = time.monotonic() + 5
        while sp.status()["pool"]["writing_blocks"] and time.monotonic() < deadline:
            time.sleep(0.02)
        if round_ >= 2 and sp.status()["pool"]["aborted_blocks"] > 0:
            break
    c = RawClient(sp.socket)
    m = c.mapping()
    visible = 0
    for round_ in range(len(tried)):
        base = round_ * 100000
        for i in range(base, base + tried[round_]):
            k = key(i, b"w")
            r = c.call("lookup", ns="crash", keys=[k])
            for off, n, _ in r["blocks"]:
                assert m[off:off + n] == _pattern(k, n), f"block {i} is torn"
                visible += 1
            if r["lease"]:
                c.call("release", leases=[r["lease"]])
    st = sp.status()["pool"]
    assert visible == st["blocks"] and visible > 0
    assert st["writing_blocks"] == 0 and st["aborted_blocks"] > 0
    m.close()
    c.close()


# ----------------------------------------------------------------- generate() across processes
CLIENT_A = textwrap.dedent("""
    import json, sys, warnings
    sys.path.insert(0, {here!r})
    import torch, cxlalloc.hf as hf
    from tests.kvstore.kvutil import tiny_llama, prompts, generate
    m = tiny_llama()
    hf.wrap(m, device_limit="256MiB", host_limit="512MiB", kv_store={url!r}, block_tokens=8)
    out, r = generate(m, prompts()[0])
    print(json.dumps({{"tokens": out.tolist(), "stored": r["last"]["stored_blocks"],
                      "registered": r["store"]["registered_bytes"]}}), flush=True)
    import os
    os._exit(0)  # skip the interpreter's teardown (seconds with torch loaded)
""")


def test_a_prefix_prefilled_by_process_a_is_a_hit_for_process_b(server_proc):
    sp = server_proc()
    code = CLIENT_A.format(here=ROOT, url=sp.url)
    a = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=120)
    assert a.returncode == 0, a.stderr[-3000:]
    ra = json.loads(a.stdout.strip().splitlines()[-1])
    assert ra["stored"] >= 9 and ra["registered"] > 0
    p1, p2 = prompts()
    ref = tiny_llama()
    assert ra["tokens"] == ref.generate(p1, max_new_tokens=8, do_sample=False).tolist()
    m = tiny_llama()  # process B: same checkpoint (same fingerprint), another process
    hf.wrap(m, device_limit="256MiB", host_limit="512MiB", kv_store=sp.url, block_tokens=8)
    out, r = generate(m, p2)
    assert r["last"]["hit_tokens"] == 64 and r["last"]["fallback"] is None  # 70-token document: 8 blocks of 8
    assert torch.equal(out, ref.generate(p2, max_new_tokens=8, do_sample=False))
    assert r["store"]["server"]["pool"]["hit_blocks"] >= 8
    other = tiny_llama(seed=5)  # other weights: never a hit on A's blocks
    hf.wrap(other, device_limit="256MiB", host_limit="512MiB", kv_store=sp.url, block_tokens=8)
    _, r = generate(other, p2)
    assert r["last"]["hit_tokens"] == 0


def test_generate_stays_correct_when_the_server_dies_and_hits_again_after_restart(server_proc):
    sp = server_proc()
    p1, p2 = prompts()
    ref = tiny_llama()
    want1 = ref.generate(p1, max_new_tokens=8, do_sample=False)
    want2 = ref.generate(p2, max_new_tokens=8, do_sample=False)
    m = tiny_llama()
    # kv_conversation_limit=0: every hit below must come from the server (the process's last-conversation
    # cache would continue p1's shared tokens whether the server is there or not)
    hf.wrap(m, device_limit="256MiB", host_limit="512MiB", kv_store=sp.url + "?timeout=2", block_tokens=8,
            kv_conversation_limit=0)
    out, _ = generate(m, p1)
    assert torch.equal(out, want1)
    sp.kill()
    with pytest.warns(Warning):
        out, r = generate(m, p2)  # no server: recomputed, same tokens
    assert torch.equal(out, want2) and r["last"]["hit_tokens"] == 0
    sp.start()  # restarted: the cache is gone, correctness never was
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        out, r = generate(m, p1)
        assert torch.equal(out, want1)
        if r["last"]["stored_blocks"]:
            break
        time.sleep(0.2)
    out, r = generate(m, p2)
    assert torch.equal(out, want2) and r["last"]["hit_tokens"] == 64
    assert r["store"]["server_restarts"] == 1


# ----------------------------------------------------------------- who may attach
def _as_nobody(path, gid=65534):
    """Connect to ``path`` from a child process running as nobody; returns
    'EACCES', 'denied: ...', or 'ok'."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no imports, no threads
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(65534)
            try:
                c = RawClient(path, want_fd=False, timeout=5)
                msg = "ok" if c.hello.get("ok") else "denied: " + c.hello.get("error", "")
            except PermissionError:
                msg = "EACCES"
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
def test_socket_permissions_decide_who_may_attach(kv_server):
    srv = kv_server(name="a.sock")  # 0660 root:root
    assert _as_nobody(srv.socket_path) == "EACCES"
    srv = kv_server(name="b.sock", socket_mode=0o660, group="nogroup")
    assert _as_nobody(srv.socket_path, gid=65534) == "ok"
    assert _as_nobody(srv.socket_path, gid=1) == "EACCES"  # not in the socket's group
    srv = kv_server(name="c.sock", socket_mode=0o666, allow_uids=[0])
    got = _as_nobody(srv.socket_path)
    assert got.startswith("denied") and "--allow-user" in got
    assert srv.stats()["server"]["refused_denied"] == 1
