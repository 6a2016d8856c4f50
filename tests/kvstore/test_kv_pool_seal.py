"""The pool's size is sealed: no client can truncate (or grow) the shared memfd under everyone's mapping.

Issue 29, item 2: before the seals, a client that ``ftruncate``d the pool fd it received made every wrapped
worker die with SIGBUS at its next ``generate()`` and the server three requests later.  Now the server seals
its memfd (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) and every mapping side refuses an fd that is not
sealed, so a truncated pool (and the SIGBUS that follows) cannot happen.
"""

from __future__ import annotations

import fcntl
import os

import pytest

from tests.kvstore.kvutil import RawClient, key

BLOCK = 64 * 1024


def test_a_client_cannot_truncate_or_grow_the_pool_and_everyone_keeps_working(server_proc):
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB")
    attacker = RawClient(sp.socket)
    seals = fcntl.fcntl(attacker.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    size = os.fstat(attacker.fd).st_size
    for new in (0, size // 2, size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(attacker.fd, new)
    with pytest.raises(PermissionError):  # the seals are final: nobody can lift or change them
        fcntl.fcntl(attacker.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert os.fstat(attacker.fd).st_size == size

    # an honest client still writes, commits and reads a block at the pool's far end
    honest = RawClient(sp.socket)
    m = honest.mapping()
    ks = [key(i, b"seal") for i in range(4)]
    r = honest.call("reserve", ns="seal", keys=ks, nbytes=BLOCK, tokens=16)
    assert r["res"] and all(off is not None for off in r["slots"])
    for i, off in enumerate(r["slots"]):
        m[off:off + BLOCK] = bytes([i + 1]) * BLOCK
    honest.call("commit", res=r["res"])
    m.close()
    found = attacker.call("lookup", ns="seal", keys=ks)
    assert len(found["blocks"]) == 4
    tail = attacker.mapping()
    tail[size - 1] = 7  # the last byte of the pool is still backed (no SIGBUS)
    assert tail[size - 1] == 7
    tail.close()
    assert sp.proc.poll() is None and sp.status()["pool"]["blocks"] >= 4
    attacker.close()
    honest.close()


def test_an_unsealed_fd_is_refused_by_the_mapping_side():
    from cxlalloc import _C

    fd = os.memfd_create("not-a-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 20)
    with pytest.raises(Exception, match="not a sealed pool"):
        _C.HostArena(None, 0, 0, False, fd)  # takes ownership of fd and closes it on failure
