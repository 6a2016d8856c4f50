"""Hits that survive a restart (``--pool-file``, issue 31): a kv-server killed
with SIGKILL while a client commits blocks, restarted on the same file, serves
only committed blocks, each byte-identical; a torn record is dropped."""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import subprocess
import sys

from tests.kvstore.kvutil import ROOT, RawClient, key, subprocess_env

BLOCK = 16 * 1024
N = 1000  # more than the writer can commit before the kill lands (it is killed after 60-200)

WRITER = r"""
import hashlib, mmap, sys
from tests.kvstore.kvutil import RawClient, key
c = RawClient(sys.argv[1], name="writer")
m = mmap.mmap(c.fd, c.hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
for i in range(int(sys.argv[2])):
    r = c.call("reserve", ns="doc", keys=[key(i)], nbytes=%d, tokens=16)
    off = r["slots"][0]
    data = hashlib.shake_256(i.to_bytes(8, "little")).digest(%d)
    for j in range(0, %d, 4096):  # written page by page: a kill can land mid-write
        m[off + j:off + j + 4096] = data[j:j + 4096]
    assert c.call("commit", res=r["res"])["published"] == 1
    print(i, flush=True)
""" % (BLOCK, BLOCK, BLOCK)


def _kill_while_writing(sp, writer: str, seed: int) -> int:
    """Runs ``writer`` (a ``python -c`` script: the server's socket and N as arguments, it prints each block index
    once its commit is acknowledged) against ``sp``, SIGKILLs the server once the writer has acknowledged a block
    index drawn from [60, 200] by ``random.Random(seed)``, and returns the last index the writer acknowledged
    (read after the kill too).  Asserts a commit was still in flight when the kill landed."""
    w = subprocess.Popen([sys.executable, "-c", writer, sp.socket, str(N)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=subprocess_env(), cwd=ROOT, text=True)
    acked = -1
    target = random.Random(seed).randint(60, 200)
    while acked < target:
        line = w.stdout.readline()
        assert line, "the writer stopped early"
        acked = int(line)
    sp.kill()  # SIGKILL while the writer is committing
    rest = w.communicate(timeout=10)[0].split()  # what it had acknowledged that we had not read yet
    acked = int(rest[-1]) if rest else acked
    assert acked < N - 1, "the kill landed after the writer's last commit: nothing was in flight"
    return acked


def _payload(i):
    return hashlib.shake_256(i.to_bytes(8, "little")).digest(BLOCK)


def _served(path, n):
    """{i: bytes} of every block key(i), i < n, the server on ``path`` serves."""
    c = RawClient(path)
    m = mmap.mmap(c.fd, c.hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ)
    out = {}
    for i in range(n):
        r = c.call("lookup", ns="doc", keys=[key(i)])
        for off, nb, _ in r["blocks"]:
            out[i] = bytes(m[off:off + nb])
        if r["lease"]:
            c.call("release", leases=[r["lease"]])
    m.close()
    c.close()
    return out


def test_a_server_killed_mid_commit_restarts_serving_only_committed_blocks_byte_identical(server_proc, sockdir):
    pool_file = os.path.join(sockdir, "pool.kvp")
    args = ("--size", "32MiB", "--chunk", "1MiB", "--pool-file", pool_file)
    sp = server_proc(*args)
    acked = _kill_while_writing(sp, WRITER, seed=31)
    sp.start()
    got = _served(sp.socket, N)
    # every acknowledged commit survives; at most the one in flight besides; nothing torn or foreign
    assert set(range(acked + 1)) <= set(got) <= set(range(acked + 2)), (acked, sorted(got)[-3:])
    assert all(data == _payload(i) for i, data in got.items())
    st = sp.status()["pool"]
    assert st["pool_file"]["restored_blocks"] == len(got) and st["blocks"] == len(got)

    # a torn record (a crash inside a write of the file) is dropped, the others served
    sp.stop()
    size = os.path.getsize(pool_file)
    with open(pool_file, "r+b") as f:
        f.truncate(size - 100)  # the last record loses its end
    sp.start()
    again = _served(sp.socket, N)
    assert len(again) == len(got) - 1 and all(data == _payload(i) for i, data in again.items())
    st = sp.status()["pool"]["pool_file"]
    assert st["restore_torn_records"] == 1 and st["restored_blocks"] == len(got) - 1
    # a flipped byte inside a record's block fails its CRC: dropped, the rest kept
    sp.stop()
    with open(pool_file, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    sp.start()
    third = _served(sp.socket, N)
    assert len(third) == len(again) - 1 and all(data == _payload(i) for i, data in third.items())


def test_each_tenant_restores_its_own_file_into_its_own_pool(kv_server, sockdir):
    from cxlalloc.kvstore.server.tenants import parse_tenant

    pool_file = os.path.join(sockdir, "pool.kvp")
    tenants = [parse_tenant(f"a:{os.geteuid()}:8MiB"), parse_tenant("b:65533")]
    srv = kv_server(size=16 << 20, chunk=1 << 20, tenants=tenants, pool_file=pool_file, name="t1.sock")
    c = RawClient(srv.socket_path)
    r = c.call("reserve", ns="doc", keys=[key(1)], nbytes=BLOCK, tokens=16)
    m = mmap.mmap(c.fd, c.hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[r["slots"][0]:r["slots"][0] + BLOCK] = _payload(1)
    m.close()
    assert c.call("commit", res=r["res"])["published"] == 1
    c.close()
    srv.stop(0.1)
    # one file per tenant, each with the lock file that keeps a second server off it
    assert sorted(os.listdir(sockdir)) == ["pool.kvp.a", "pool.kvp.a.lock", "pool.kvp.b", "pool.kvp.b.lock"]
    again = kv_server(size=16 << 20, chunk=1 << 20, tenants=tenants, pool_file=pool_file, name="t2.sock")
    assert again.stats("a")["pool"]["blocks"] == 1 and again.stats("b")["pool"]["blocks"] == 0
    assert _served(again.socket_path, 2) == {1: _payload(1)}


def test_a_file_that_is_no_pool_file_is_refused_intact_and_two_servers_cannot_share_one(tmp_path, server_proc):
    """A mistyped --pool-file must not erase an unrelated file (the restore rewrites the file it read), and a
    second server on the same file would replace it under the first, whose acknowledged blocks would then be
    missing after its restart: both are a one-line error, exit 2, the file untouched."""
    other = tmp_path / "notes.bin"
    data = os.urandom(5000)
    other.write_bytes(data)
    r = subprocess.run([sys.executable, "-m", "cxlalloc", "kv-server", "--size", "16MiB", "--socket",
                        str(tmp_path / "a.sock"), "--pool-file", str(other)], capture_output=True, text=True,
                       env=subprocess_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "'--pool-file'" in r.stderr and "not a kv-server pool file" in r.stderr, r.stderr
    assert other.read_bytes() == data
    pool = str(tmp_path / "pool")
    first = server_proc("--size", "16MiB", "--chunk", "4MiB", "--pool-file", pool, socket_name="one.sock")
    r = subprocess.run([sys.executable, "-m", "cxlalloc", "kv-server", "--size", "16MiB", "--socket",
                        str(tmp_path / "two.sock"), "--pool-file", pool], capture_output=True, text=True,
                       env=subprocess_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "in use by another kv-server" in r.stderr, r.stderr
    assert first.proc.poll() is None


PIPELINED_WRITER = r"""
import hashlib, sys, torch
from cxlalloc.kvstore.client import RemoteBlockStore
from tests.kvstore.kvutil import key
st = RemoteBlockStore("unix://" + sys.argv[1], None, name="pipelined-writer")
assert st._conn.pipelined_commit
for i in range(int(sys.argv[2])):
    res = st.reserve("doc", [key(i)], %d, 16)
    data = hashlib.shake_256(i.to_bytes(8, "little")).digest(%d)
    res.views[0].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert res.commit() == 1  # pipelined: sent, not yet acknowledged
    if i %% 4 == 3:
        assert st.flush()  # acknowledged: on file from here
        print(i, flush=True)
""" % (BLOCK, BLOCK)


def test_pipelined_commits_a_flush_acknowledged_survive_a_killed_server(server_proc, sockdir):
    """Protocol 3: a commit sent without waiting is acknowledged by the next reply (here flush()'s ping);
    every acknowledged block survives a SIGKILL of the server, those in flight may or may not, none torn."""
    pool_file = os.path.join(sockdir, "pool.kvp")
    sp = server_proc("--size", "32MiB", "--chunk", "1MiB", "--pool-file", pool_file)
    acked = _kill_while_writing(sp, PIPELINED_WRITER, seed=33)
    sp.start()
    got = _served(sp.socket, N)
    # every acknowledged block; besides, at most the ones sent since the last flush (and the one being written)
    assert set(range(acked + 1)) <= set(got) <= set(range(acked + 6)), (acked, sorted(got)[-6:])
    assert all(data == _payload(i) for i, data in got.items())
