"""Hits that survive a restart: a file of committed blocks (``--pool-file PATH``).

Every block a client commits is appended to PATH (tmpfs, a DAX device's file
system, a file on a CXL-backed mount) as one record, written with one
``writev`` after the block is published::

    magic "CXLKVP01" | nbytes u64 | tokens u32 | ns length u16 | namespaced key (32 B) | ns | CRC-32 | block bytes

The CRC-32 covers everything before it and the block bytes.  A restarted
kv-server reads the file, keeps the last record of each key whose CRC holds
(a record cut by a crash, or overwritten, fails it and is dropped: counted
``restore_torn_records``), writes those blocks into its new pool, publishes
them and rewrites the file with them only (so the file is compacted at each
start).  Between starts the file grows with each commit up to ``max_bytes``
(``--pool-file-size``, default twice the pool); past it blocks are no longer
recorded (``persist_dropped_blocks``) until the next start.

The pool the clients map is still the server's sealed memfd (no client can
truncate it); the file is written by the server only.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import zlib
from typing import Dict, List, Tuple

from cxlalloc.kvstore.keys import KEY_BYTES

MAGIC = b"CXLKVP01"
_HEAD = struct.Struct("<8sQIH32s")   # magic, nbytes, tokens, ns length, namespaced key
_CRC = struct.Struct("<I")


class PoolFile:
    """The file of committed blocks of one pool.

    Args:
        path: the file (created mode 0600 if absent).
        max_bytes: the most bytes the file may grow to between starts.

    Raises:
        OSError: the file cannot be opened (its path is named, ``--pool-file``).
    """

    def __init__(self, path: str, max_bytes: int):
        self.path = str(path)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self.c = {"persisted_blocks": 0, "persist_dropped_blocks": 0, "restored_blocks": 0,
                  "restore_torn_records": 0, "restore_unplaced_blocks": 0}
        # One server per file: a second one would replace the file under the first, whose acknowledged blocks
        # would then be missing after its restart.  The lock sits on a file beside it, since a compaction replaces
        # the pool file itself (another inode).
        try:
            self._lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"cxlalloc option '--pool-file': cannot open {self.path + '.lock'!r}: "
                                   f"{e.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ValueError(f"cxlalloc option '--pool-file': {self.path!r} is in use by another kv-server "
                             f"(it holds {self.path + '.lock'!r}); give each server a file of its own") from None
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:
            os.close(self._lock_fd)
            raise OSError(e.errno, f"cxlalloc option '--pool-file': cannot open {self.path!r}: {e.strerror}") from None
        self._size = os.fstat(self._fd).st_size
        if self._size and os.pread(self._fd, len(MAGIC), 0) != MAGIC:
            # A mistyped path must not erase an unrelated file: restore() rewrites the file with what it read.
            os.close(self._fd)
            os.close(self._lock_fd)
            raise ValueError(f"cxlalloc option '--pool-file': {self.path!r} is not a kv-server pool file (it does not "
                             f"start with {MAGIC.decode()}); refusing to overwrite it")

    @staticmethod
    def record(nskey: bytes, ns: str, tokens: int, data: bytes) -> List[bytes]:
        """The parts of one record (for ``writev``)."""
        nsb = ns.encode()
        head = _HEAD.pack(MAGIC, len(data), int(tokens), len(nsb), nskey) + nsb
        return [head, _CRC.pack(zlib.crc32(data, zlib.crc32(head))), data]

    def append(self, nskey: bytes, ns: str, tokens: int, data: bytes) -> bool:
        """Record one committed block (``data``: its bytes, a copy); False when the file is full."""
        parts = self.record(nskey, ns, tokens, data)
        n = sum(map(len, parts))
        with self._lock:
            if self._size + n > self.max_bytes:
                self.c["persist_dropped_blocks"] += 1
                return False
            os.writev(self._fd, parts)
            self._size += n
            self.c["persisted_blocks"] += 1
        return True

    def read(self, buf) -> Dict[bytes, Tuple[str, int, memoryview]]:
        """``{namespaced key: (ns, tokens, its bytes in buf)}`` of the sound
        records of ``buf`` (the file's contents, a mapping: nothing is copied),
        the last of each key winning, in file order.  A record that fails its
        CRC is dropped; a record cut short or a broken header ends the scan."""
        buf = memoryview(buf)
        out: Dict[bytes, Tuple[str, int, memoryview]] = {}
        pos = 0
        while pos < len(buf):
            if pos + _HEAD.size > len(buf):
                self.c["restore_torn_records"] += 1  # a tail shorter than a header
                break
            magic, nbytes, tokens, nslen, nskey = _HEAD.unpack_from(buf, pos)
            end = pos + _HEAD.size + nslen + _CRC.size + nbytes
            if magic != MAGIC or len(nskey) != KEY_BYTES or end > len(buf):
                self.c["restore_torn_records"] += 1
                break
            head = bytes(buf[pos:pos + _HEAD.size + nslen])
            (crc,) = _CRC.unpack_from(buf, pos + len(head))
            data = buf[end - nbytes:end]
            try:
                ns = head[_HEAD.size:].decode()
            except UnicodeDecodeError:
                ns = None
            if ns is None or zlib.crc32(data, zlib.crc32(head)) != crc:
                self.c["restore_torn_records"] += 1
            else:
                out.pop(nskey, None)  # the last record of a key wins, at its place in the order
                out[nskey] = (ns, tokens, data)
            pos = end
        return out

    def rewrite(self, blocks: List[Tuple[bytes, str, int, memoryview]]) -> None:
        """Replace the file by the records of ``blocks`` (``(nskey, ns, tokens, bytes)``), atomically."""
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        size = 0
        try:
            for nskey, ns, tokens, data in blocks:
                parts = self.record(nskey, ns, tokens, data)
                os.writev(fd, parts)
                size += sum(map(len, parts))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        with self._lock:
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            self._size = size

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = -1


class _Restorer:
    """The owner of the reservations a restore makes (never a connection)."""

    def __repr__(self) -> str:
        return "restore"


def restore(state, pf: PoolFile) -> int:
    """Put the sound blocks of ``pf`` into ``state``'s pool and index
    (published, READY) and rewrite the file with them; returns how many.
    Blocks that find no room (a smaller pool than before) are counted
    ``restore_unplaced_blocks``.  The file is mapped, never read whole into memory."""
    if os.path.getsize(pf.path) == 0:
        return 0
    with open(pf.path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        return _restore(state, pf, buf)
    finally:
        buf.close()


def _restore(state, pf: PoolFile, buf) -> int:
    blocks = pf.read(buf)
    owner = _Restorer()
    kept = []
    with state.lock:
        for nskey, (ns, tokens, data) in blocks.items():
            got = state.index.reserve([nskey], len(data), ns, owner, tokens)[0] \
                if state.index.slot_size(len(data)) <= state.index.largest_block() else None
            if got is None:
                pf.c["restore_unplaced_blocks"] += 1
                continue
            state.view[got.offset:got.offset + len(data)] = data
            state.index.publish([got], owner)
            kept.append((nskey, ns, tokens, data))
    pf.rewrite(kept)
    pf.c["restored_blocks"] = len(kept)
    del blocks, kept  # the views into buf, before it is unmapped
    return pf.c["restored_blocks"]
