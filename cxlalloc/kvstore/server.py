"""``cxlalloc kv-server``: one pool of KV blocks for every GPU process of a machine.

    python -m cxlalloc kv-server --numa-node auto --size 64GiB --socket /run/cxlalloc/kv.sock
    python -m cxlalloc kv-server --status [--json] --socket /run/cxlalloc/kv.sock

The server owns one shared-memory pool (a sparse memfd of exactly ``--size``
bytes, bound to the chosen NUMA node before first touch: the CXL node where
one is present, committed only as blocks are written), the index (key ->
block, LRU, pins, per-namespace quotas: :class:`~cxlalloc.kvstore.index.BlockIndex`)
and the statistics.  It never touches a GPU: clients
(:class:`cxlalloc.kvstore.client.RemoteBlockStore`, i.e.
``hf.wrap(model, kv_store="unix:///run/cxlalloc/kv.sock")``) receive the pool's
file descriptor over the socket (SCM_RIGHTS), map it, register it for their
GPU chunk by chunk on first use, and copy blocks in and out of it themselves;
the socket carries only lookups, reservations and commits
(:mod:`cxlalloc.kvstore.protocol`).  docs/kv-server.md has the protocol, the
block states and the crash rules.

Crash rules: a connection owns its leases (pinned blocks) and reservations
(WRITING blocks); when it closes for any reason the server drops the pins and
aborts the reservations (``BlockIndex.drop_owner``), so a client killed
mid-insert never publishes a half-written block.  A restarted server has a new
pool (a new ``pool_id``): clients notice it on reconnect and map the new one.
"""

from __future__ import annotations

import argparse
import ctypes
import grp
import itertools
import json
import logging
import os
import pwd
import secrets
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from collections import deque
from typing import Dict, List, Optional, Sequence

from cxlalloc.config import format_bytes, parse_size, parse_size_or_fraction
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.index import BlockIndex, Entry
from cxlalloc.kvstore.redis_tier import namespaced_key

log = logging.getLogger("cxlalloc.kvstore.server")

DEFAULT_CHUNK = 256 << 20
MAX_CHUNK = 64 << 30             # one GPU registration (docs/sources.md#host-pinning)
DEFAULT_SOCKET_MODE = 0o660
DEFAULT_IO_TIMEOUT_S = 10.0
MAX_LEASES_PER_CLIENT = 4096     # open leases/reservations of one connection
RATE_WINDOW_S = 10.0
VERIFY_QUEUE = 65536             # blocks waiting for their placement check
REDIS_MODES = ("evict", "through")


_MADV_POPULATE_READ = 22  # linux/mman.h, Linux 5.14+


def _libc_madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_madvise = _libc_madvise()


class _Quotas(dict):
    """``{namespace: bytes}`` with a default for namespaces not named (``--quota '*=SIZE'``)."""

    def __init__(self, quotas: Dict[str, int], default: Optional[int] = None):
        super().__init__(quotas)
        self.default = default

    def get(self, ns, fallback=None):  # BlockIndex asks quotas.get(ns)
        if dict.__contains__(self, ns):
            return dict.__getitem__(self, ns)
        return self.default if self.default is not None else fallback


class _Client:
    """One connection: the owner of its leases and reservations in the index."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int):
        self.id = next(self._ids)
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        self.name = ""
        self.hello = False
        self.since = time.time()
        self.leases: Dict[int, List[Entry]] = {}
        self.reservations: Dict[int, List[Optional[Entry]]] = {}
        self._next = itertools.count(1)
        self.requests = 0

    def new_id(self) -> int:
        return next(self._next)

    def __repr__(self) -> str:
        return f"client#{self.id}(pid={self.pid}, uid={self.uid}{', ' + self.name if self.name else ''})"


class KVServer:
    """The pool, the index and the socket of a kv-server (use :func:`main` for the CLI).

    Args:
        size: pool bytes (exact; the mapping is rounded up to the page size).
        node: NUMA node of the pool.
        socket_path: unix socket to listen on.
        chunk_bytes: slab and client GPU-registration unit (page multiple, <= 64 GiB, <= size).
        socket_mode: permission bits of the socket file (who may attach).
        group: group (name or gid) of the socket file.
        quotas: ``{namespace: bytes}``; ``default_quota``: bytes for any other namespace.
        redis: a :class:`~cxlalloc.kvstore.redis_tier.RedisTier` below the pool, or None.
        redis_mode: ``"evict"`` (blocks go to Redis when evicted) or ``"through"``
            (also when committed: other machines see them at once).
        strict_placement: drop a committed block whose pages are not on ``node``.
        max_clients: connections served at once (others are refused).
        allow_uids: if given, only these uids (and the server's own) may attach.
        node_reason: why this node (shown by --status).
        io_timeout: seconds a started message may take to arrive or be sent.

    Raises:
        ValueError: a bad size/chunk/mode/group, naming the option.
        OSError: the socket cannot be created (its path is named).
    """

    def __init__(self, size: int, node: int, socket_path: str, *, chunk_bytes: int = DEFAULT_CHUNK,
                 socket_mode: int = DEFAULT_SOCKET_MODE, group=None, quotas: Optional[Dict[str, int]] = None,
                 default_quota: Optional[int] = None, redis=None, redis_mode: str = "evict",
                 strict_placement: bool = False, max_clients: int = 256, allow_uids: Optional[Sequence[int]] = None,
                 node_reason: str = "", io_timeout: float = DEFAULT_IO_TIMEOUT_S):
        page = self._page = os.sysconf("SC_PAGESIZE")
        if chunk_bytes <= 0 or chunk_bytes % page or chunk_bytes > MAX_CHUNK:
            raise ValueError(f"cxlalloc option '--chunk': {format_bytes(chunk_bytes)} must be a multiple of the page "
                             f"size ({page} bytes) and at most 64 GiB")
        if size < chunk_bytes:
            raise ValueError(f"cxlalloc option '--size': {format_bytes(size)} is below one chunk "
                             f"({format_bytes(chunk_bytes)}, --chunk); use --size of at least "
                             f"{format_bytes(chunk_bytes)} or a smaller --chunk")
        if redis_mode not in REDIS_MODES:
            raise ValueError(f"cxlalloc option '--redis-mode': {redis_mode!r} is not allowed; allowed: "
                             f"{', '.join(REDIS_MODES)}")
        self.size = int(size)
        self.node = int(node)
        self.node_reason = node_reason
        self.chunk_bytes = int(chunk_bytes)
        self.socket_path = P.check_socket_path(socket_path)
        self.socket_mode = int(socket_mode)
        self.gid = resolve_group(group) if group is not None else None
        self.redis = redis
        self.redis_mode = redis_mode
        self.strict_placement = bool(strict_placement)
        self.max_clients = int(max_clients)
        self.allow_uids = None if allow_uids is None else {int(u) for u in allow_uids} | {os.geteuid()}
        self.io_timeout = float(io_timeout)
        self.pool_id = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._clients: Dict[int, _Client] = {}
        self._threads: List[threading.Thread] = []
        self._stop = threading.Event()
        self._listener: Optional[socket.socket] = None
        self._socket_ino = None
        self.c = {"connections": 0, "refused_full": 0, "refused_denied": 0, "protocol_errors": 0,
                  "bad_requests": 0, "hit_bytes": 0, "redis_hit_blocks": 0, "redis_hit_bytes": 0, "redis_put_blocks": 0,
                  "placement_verified_bytes": 0, "placement_misplaced_bytes": 0, "placement_unverified_bytes": 0,
                  "placement_skipped_bytes": 0, "misplaced_dropped_blocks": 0, "peak_clients": 0, "requests": 0}
        self._samples: "deque[tuple]" = deque(maxlen=600)
        self._verify_q: "deque[tuple]" = deque()
        self._verify_cv = threading.Condition()
        self._verifying = 0
        self._warned_placement = False
        self.started = time.time()
        self._t0 = time.monotonic()
        self.ready_seconds = None

        from cxlalloc import _C

        t0 = time.perf_counter()
        # No engine: the kernel's own mbind/move_pages place and verify pages;
        # the server never registers (its clients do, for their GPU).
        self.arena = _C.HostArena(None, self.size, self.node, True)
        self._mem = (ctypes.c_char * self.arena.size).from_address(self.arena.base)
        self._view = memoryview(self._mem).cast("B")
        self.index = BlockIndex(self.size, self.chunk_bytes, on_evict=self._evicted if redis is not None else None)
        # After construction: BlockIndex copies its quotas argument into a plain dict.
        self.index.quotas = _Quotas(quotas or {}, default_quota)
        self.map_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------ socket
    def _bind(self) -> socket.socket:
        path = self.socket_path
        d = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(d):
            try:
                os.makedirs(d, mode=0o755, exist_ok=True)
            except OSError as e:
                raise OSError(e.errno, f"cxlalloc option '--socket': cannot create the directory {d!r}: "
                                       f"{e.strerror}") from None
        if os.path.lexists(path):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise ValueError(f"cxlalloc option '--socket': {path!r} exists and is not a socket; remove it or "
                                 "choose another path")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                raise ValueError(f"cxlalloc option '--socket': a kv-server is already listening on {path!r}; stop it "
                                 "first or choose another path")
            except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
                os.unlink(path)  # a stale socket of a server that died
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born 0600: never more open than asked, even for an instant
        try:
            s.bind(path)
        except OSError as e:
            s.close()
            raise OSError(e.errno, f"cxlalloc option '--socket': cannot listen on {path!r}: {e.strerror}") from None
        finally:
            os.umask(old)
        if self.gid is not None:
            os.chown(path, -1, self.gid)
        os.chmod(path, self.socket_mode)
        self._socket_ino = os.stat(path).st_ino
        s.listen(128)
        s.settimeout(0.5)
        return s

    def start(self) -> "KVServer":
        """Listen and serve in background threads; returns at once."""
        t0 = time.perf_counter()
        self._listener = self._bind()
        t = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        t.start()
        self._threads.append(t)
        for target, name in ((self._sample_loop, "kv-sampler"), (self._verify_loop, "kv-verify")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.ready_seconds = self.map_seconds + (time.perf_counter() - t0)
        return self

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            try:
                pid, uid, gid = P.peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            client = _Client(sock, pid, uid, gid)
            refuse = None
            with self._lock:
                if self.allow_uids is not None and uid not in self.allow_uids:
                    self.c["refused_denied"] += 1
                    refuse = ("denied", f"uid {uid} may not attach to this kv-server (--allow-user)")
                elif len(self._clients) >= self.max_clients:
                    self.c["refused_full"] += 1
                    refuse = ("limit", f"the kv-server serves {self.max_clients} clients already (--max-clients)")
                else:
                    self._clients[client.id] = client
                    self.c["connections"] += 1
                    self.c["peak_clients"] = max(self.c["peak_clients"], len(self._clients))
            if refuse is not None:
                log.warning("refused %r: %s", client, refuse[1])
                try:  # answer its hello, so the client reads why (instead of a broken pipe)
                    sock.settimeout(1.0)
                    try:
                        P.recv_msg(sock)
                    except (P.ProtocolError, OSError):
                        pass
                    P.send_msg(sock, {"ok": False, "code": refuse[0], "error": refuse[1]})
                except OSError:
                    pass
                sock.close()
                continue
            t = threading.Thread(target=self._serve, args=(client,), name=f"kv-client-{client.id}", daemon=True)
            t.start()

    def _serve(self, client: _Client) -> None:
        sock = client.sock
        sock.settimeout(self.io_timeout)
        why = "closed"
        try:
            while not self._stop.is_set():
                try:
                    msg, _ = P.recv_msg(sock, wait=None)  # idle clients may wait for ever; a started message may not
                except P.ConnectionClosed:
                    break
                reply, fds = self._handle(client, msg)
                P.send_msg(sock, reply, fds)
        except P.ProtocolError as e:
            with self._lock:
                self.c["protocol_errors"] += 1
            why = f"protocol error: {e}"
            try:
                P.send_msg(sock, {"ok": False, "code": "bad_request", "error": str(e)})
            except Exception:
                pass
        except (OSError, socket.timeout) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            self._drop(client, why)

    def _drop(self, client: _Client, why: str) -> None:
        with self._lock:
            pins = sum(len(v) for v in client.leases.values())
            writing = sum(1 for v in client.reservations.values() for e in v if e is not None)
            self.index.drop_owner(client)
            client.leases.clear()
            client.reservations.clear()
            self._clients.pop(client.id, None)
        try:
            client.sock.close()
        except OSError:
            pass
        if pins or writing:
            log.info("%r gone (%s): dropped %d pins, aborted %d unpublished blocks", client, why, pins, writing)
        else:
            log.debug("%r gone (%s)", client, why)

    # ------------------------------------------------------------ requests
    def _handle(self, client: _Client, msg: dict):
        op = msg.get("op")
        with self._lock:
            self.c["requests"] += 1
        client.requests += 1
        try:
            if op == "hello":
                return self._hello(client, msg)
            if not client.hello:
                raise P.RemoteError("bad_request", "the first message must be 'hello'")
            fn = getattr(self, f"_op_{op}", None) if op in P.OPS else None
            if fn is None:
                raise P.RemoteError("unknown_op", f"unknown op {op!r}; known: {', '.join(P.OPS)}")
            out = fn(client, msg)
            out["ok"] = True
            return out, None
        except P.RemoteError as e:
            with self._lock:
                self.c["bad_requests"] += 1
            return {"ok": False, "code": e.code, "error": str(e)}, None
        except Exception as e:  # a bug: say so, keep serving
            log.error("internal error on %s from %r: %s", op, client, traceback.format_exc())
            return {"ok": False, "code": "internal", "error": f"{type(e).__name__}: {e}"}, None

    def _hello(self, client: _Client, msg: dict):
        v = msg.get("v")
        if v != P.PROTOCOL_VERSION:
            raise P.RemoteError("bad_request", f"protocol version {v!r} is not served here (this server speaks "
                                               f"{P.PROTOCOL_VERSION})")
        client.hello = True
        client.name = str(msg.get("name", ""))[:64]
        want_fd = bool(msg.get("want_fd", True))
        reply = {"ok": True, "v": P.PROTOCOL_VERSION, "pool_id": self.pool_id, "size": self.size,
                 "mapped": self.arena.size, "chunk_bytes": self.chunk_bytes, "node": self.node, "pid": os.getpid(),
                 "numa_method": self.arena.numa_method, "max_keys": P.MAX_KEYS, "fd": want_fd}
        log.info("%r attached%s", client, "" if want_fd else " (status only)")
        return reply, ([self.arena.fd] if want_fd else None)

    def _op_ping(self, client, msg):
        return {}

    def _op_stats(self, client, msg):
        return {"stats": self.stats()}

    def _op_lookup(self, client: _Client, msg: dict):
        ns = P.check_ns(msg.get("ns"))
        keys = P.check_keys(msg.get("keys"))
        ik = [namespaced_key(ns, k) for k in keys]
        with self._lock:
            if len(client.leases) >= MAX_LEASES_PER_CLIENT:
                raise P.RemoteError("limit", f"a client may hold {MAX_LEASES_PER_CLIENT} open leases; release some")
            entries = self.index.match(ik, client)
        if self.redis is not None and len(entries) < len(ik) and not self.redis.down():
            entries += self._from_redis(ns, ik[len(entries):], client)
        if not entries:
            return {"lease": 0, "blocks": []}
        with self._lock:
            lid = client.new_id()
            client.leases[lid] = entries
            self.c["hit_bytes"] += sum(e.nbytes for e in entries)
        return {"lease": lid, "blocks": [[e.offset, e.nbytes, e.tokens] for e in entries]}

    def _op_release(self, client: _Client, msg: dict):
        ids = msg.get("leases")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise P.RemoteError("bad_request", "'leases' must be a list of lease ids")
        n = 0
        with self._lock:
            for lid in ids:
                entries = client.leases.pop(lid, None)
                if entries is not None:
                    self.index.unpin(entries, client)
                    n += 1
        return {"released": n}

    def _op_reserve(self, client: _Client, msg: dict):
        ns = P.check_ns(msg.get("ns"))
        keys = P.check_keys(msg.get("keys"))
        nbytes = P.check_int(msg, "nbytes", 1, 1 << 40)
        tokens = P.check_int(msg, "tokens", 0, 1 << 31)
        if nbytes > self.index.largest_block():
            raise P.RemoteError("too_large", f"a block of {nbytes} bytes is larger than one chunk of this kv-server "
                                             f"({self.chunk_bytes} bytes, --chunk); raise --chunk or lower "
                                             "block_tokens")
        ik = [namespaced_key(ns, k) for k in keys]
        with self._lock:
            if len(client.reservations) >= MAX_LEASES_PER_CLIENT:
                raise P.RemoteError("limit", f"a client may hold {MAX_LEASES_PER_CLIENT} open reservations; commit or "
                                             "abort some")
            entries = self.index.reserve(ik, nbytes, ns, client, tokens)
            if not any(e is not None for e in entries):
                return {"res": 0, "slots": [None] * len(entries)}
            rid = client.new_id()
            client.reservations[rid] = entries
        return {"res": rid, "slots": [e.offset if e is not None else None for e in entries]}

    def _check_placement(self, entries: List[Entry]) -> List[Entry]:
        """The entries to publish.  With --strict-placement each block is
        verified now and a misplaced one dropped; otherwise the check runs on
        a background thread after the block is published (counted, warned),
        so a commit never waits for it."""
        if not self.strict_placement:
            skipped = 0
            with self._verify_cv:
                for e in entries:
                    if len(self._verify_q) < VERIFY_QUEUE:
                        self._verify_q.append((e.offset, e.nbytes))
                    else:
                        skipped += e.nbytes
                self._verify_cv.notify()
            if skipped:
                with self._lock:
                    self.c["placement_skipped_bytes"] += skipped
            return list(entries)
        keep: List[Entry] = []
        self._verify_into(entries, keep)
        return keep

    def _verify_loop(self) -> None:
        while True:
            with self._verify_cv:
                if self._verifying:
                    self._verifying = 0
                    self._verify_cv.notify_all()
                while not self._verify_q and not self._stop.is_set():
                    self._verify_cv.wait(0.5)
                if self._stop.is_set():
                    return
                batch = list(self._verify_q)
                self._verify_q.clear()
                self._verifying = len(batch)
            self._verify_into([Entry(key=b"", offset=o, nbytes=n, ns="", tokens=0) for o, n in batch], [])

    def verify_pending(self) -> int:
        """Blocks waiting for (or in) their background placement check."""
        with self._verify_cv:
            return len(self._verify_q) + self._verifying

    def _verify_into(self, entries: List[Entry], keep: List[Entry]) -> None:
        on = off = unpop = dropped = 0
        for e in entries:
            try:
                # The client wrote these pages through its own mapping; read one
                # byte of each so they are in this process's page table too
                # (move_pages reports pages of the caller's mappings only).
                # They exist already: nothing is allocated.
                self._touch(e.offset, e.nbytes)
                chk = self.arena.verify(e.offset, e.nbytes)
            except Exception:
                unpop += e.nbytes
                keep.append(e)
                continue
            on += int(chk["on_node"])
            unpop += int(chk["unpopulated"])
            wrong = int(chk["elsewhere"])
            off += wrong
            if wrong and not self._warned_placement:
                self._warned_placement = True
                log.warning("%s of a block landed outside node %d (%s)%s", format_bytes(wrong), self.node,
                            chk["detail"], "; dropped (--strict-placement)" if self.strict_placement else "")
                if self.strict_placement:
                    dropped += 1
                    continue
            keep.append(e)
        with self._lock:
            self.c["placement_verified_bytes"] += on
            self.c["placement_misplaced_bytes"] += off
            self.c["placement_unverified_bytes"] += unpop
            self.c["misplaced_dropped_blocks"] += dropped

    def _touch(self, off: int, n: int) -> None:
        page = self._page
        first = off - off % page
        if _madvise is not None and _madvise(self.arena.base + first, off + n - first, _MADV_POPULATE_READ) == 0:
            return
        for p in range(first, off + n, page):  # kernels before 5.14: one read per page
            self._mem[p]  # noqa: B018 - a read fault maps the page

    def _op_commit(self, client: _Client, msg: dict):
        rid = P.check_int(msg, "res", 1)
        with self._lock:
            entries = client.reservations.pop(rid, None)
        if entries is None:
            raise P.RemoteError("bad_request", f"no open reservation {rid} on this connection")
        live = [e for e in entries if e is not None]
        keep = self._check_placement(live)
        sent = 0
        if self.redis is not None and self.redis_mode == "through":
            for e in keep:  # still WRITING and owned by this client: nobody else touches the slot
                sent += bool(self.redis.put_ns(e.key, self._view[e.offset:e.offset + e.nbytes].tobytes()))
        with self._lock:
            self.c["redis_put_blocks"] += sent
            self.index.abort([e for e in live if e not in keep], client)
            n = self.index.publish(keep, client)
        return {"published": n}

    def _op_abort(self, client: _Client, msg: dict):
        rid = P.check_int(msg, "res", 1)
        with self._lock:
            entries = client.reservations.pop(rid, None)
            if entries is not None:
                self.index.abort([e for e in entries if e is not None], client)
        return {}

    # ------------------------------------------------------------ redis tier
    def _evicted(self, e: Entry) -> None:
        # Under the lock, before the slot is reused: copy the bytes out; the
        # tier sends them from its own thread.
        if self.redis_mode == "through":
            return  # written when committed
        if self.redis.put_ns(e.key, self._view[e.offset:e.offset + e.nbytes].tobytes()):
            self.c["redis_put_blocks"] += 1

    def _from_redis(self, ns: str, iks: List[bytes], client: _Client) -> List[Entry]:
        got = []
        for data in self.redis.get_many_ns(iks):
            if data is None:
                break
            got.append(data)
        if not got:
            return []
        nbytes = len(got[0])
        got = [d for d in itertools.takewhile(lambda d: len(d) == nbytes, got)]
        if nbytes > self.index.largest_block():
            return []
        with self._lock:
            slots = self.index.reserve(iks[:len(got)], nbytes, ns, client)
        written = []
        for e, data in zip(slots, got):
            if e is None:
                break
            self._view[e.offset:e.offset + e.nbytes] = data
            written.append(e)
        keep = self._check_placement(written)
        with self._lock:
            self.index.abort([e for e in slots if e is not None and e not in keep], client)
            self.index.publish(keep, client)
            pinned = self.index.match([e.key for e in keep], client)
            self.index.c.lookups -= 1  # part of this lookup
            self.index.c.lookup_blocks -= len(keep)
            self.c["redis_hit_blocks"] += len(pinned)
            self.c["redis_hit_bytes"] += sum(e.nbytes for e in pinned)
        return pinned

    # ------------------------------------------------------------ stats
    def _counters(self) -> dict:
        """Monotonic counters for rates (call under the lock)."""
        ic = self.index.c
        out = {"lookups": ic.lookups, "lookup_blocks": ic.lookup_blocks, "hit_blocks": ic.hit_blocks,
               "hit_bytes": self.c["hit_bytes"], "stored_blocks": ic.stored_blocks, "stored_bytes": ic.stored_bytes,
               "evicted_blocks": ic.evicted_blocks, "evicted_bytes": ic.evicted_bytes,
               "redis_hit_blocks": self.c["redis_hit_blocks"], "redis_hit_bytes": self.c["redis_hit_bytes"]}
        if self.redis is not None:
            rs = self.redis.stats()
            out.update(redis_put_blocks=rs["put_blocks"], redis_put_bytes=rs["put_bytes"],
                       redis_lookup_blocks=rs["lookup_blocks"])
        return out

    def _sample_loop(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                self._samples.append((time.monotonic(), self._counters()))

    def _rates(self, now_counters: dict) -> dict:
        now = time.monotonic()
        old = None
        for t, c in self._samples:
            if now - t <= RATE_WINDOW_S + 0.5:
                old = (t, c)
                break
        if old is None or now - old[0] < 0.5:
            return {"window_s": 0.0}
        dt = now - old[0]
        d = {k: now_counters.get(k, 0) - old[1].get(k, 0) for k in now_counters}
        out = {"window_s": round(dt, 3),
               "lookups_per_s": d["lookups"] / dt,
               "loads_per_s": d["hit_blocks"] / dt, "load_bytes_per_s": d["hit_bytes"] / dt,
               "stores_per_s": d["stored_blocks"] / dt, "store_bytes_per_s": d["stored_bytes"] / dt,
               "evictions_per_s": d["evicted_blocks"] / dt,
               "hit_rate": d["hit_blocks"] / d["lookup_blocks"] if d["lookup_blocks"] else None,
               "redis_loads_per_s": d["redis_hit_blocks"] / dt, "redis_load_bytes_per_s": d["redis_hit_bytes"] / dt}
        if "redis_put_blocks" in d:
            out.update(redis_stores_per_s=d["redis_put_blocks"] / dt, redis_store_bytes_per_s=d["redis_put_bytes"] / dt)
        return out

    def committed_bytes(self) -> int:
        """Bytes of the pool the kernel has committed (allocated pages of the memfd)."""
        return os.fstat(self.arena.fd).st_blocks * 512

    def stats(self) -> dict:
        """Everything ``--status`` and the metrics show (bytes, counts, seconds).

        ``{"server": {...}, "pool": {...}, "rates": {...}, "redis": {...} | None, "clients": [...]}``
        """
        with self._lock:
            ic = dict(vars(self.index.c))
            counters = self._counters()
            c = dict(self.c)
            used = self.index.used_bytes
            n_entries = len(self.index.entries)
            ns_bytes = {ns: b for ns, b in self.index.ns_bytes.items() if b}
            writing = sum(1 for cl in self._clients.values() for v in cl.reservations.values() for e in v
                          if e is not None)
            pinned = sum(len(mine) for mine in self.index._pins.values())
            clients = [{"id": cl.id, "pid": cl.pid, "uid": cl.uid, "name": cl.name, "leases": len(cl.leases),
                        "reservations": len(cl.reservations), "requests": cl.requests,
                        "connected_s": round(time.time() - cl.since, 1)} for cl in self._clients.values()]
            quotas = dict(self.index.quotas)
            default_quota = self.index.quotas.default
        pool = {
            "capacity_bytes": self.size, "mapped_bytes": self.arena.size, "chunk_bytes": self.chunk_bytes,
            "used_bytes": used, "committed_bytes": self.committed_bytes(),
            "blocks": n_entries - writing, "writing_blocks": writing, "pinned_blocks": pinned,
            "lookups": ic["lookups"], "lookup_blocks": ic["lookup_blocks"], "hit_blocks": ic["hit_blocks"],
            "hit_tokens": ic["hit_tokens"], "hit_bytes": c["hit_bytes"], "miss_blocks": ic["miss_blocks"],
            "hit_rate": ic["hit_blocks"] / ic["lookup_blocks"] if ic["lookup_blocks"] else 0.0,
            "stored_blocks": ic["stored_blocks"], "stored_bytes": ic["stored_bytes"],
            "duplicate_blocks": ic["duplicate_blocks"], "evicted_blocks": ic["evicted_blocks"],
            "evicted_bytes": ic["evicted_bytes"], "dropped_blocks": ic["dropped_blocks"],
            "aborted_blocks": ic["aborted_blocks"], "dropped_pins": ic["dropped_pins"],
            "placement_verified_bytes": c["placement_verified_bytes"],
            "placement_misplaced_bytes": c["placement_misplaced_bytes"],
            "placement_unverified_bytes": c["placement_unverified_bytes"],
            "placement_skipped_bytes": c["placement_skipped_bytes"],
            "misplaced_dropped_blocks": c["misplaced_dropped_blocks"],
            "redis_hit_blocks": c["redis_hit_blocks"], "redis_hit_bytes": c["redis_hit_bytes"],
            "redis_put_blocks": c["redis_put_blocks"],
            "namespaces": {ns: {"used_bytes": b, "quota_bytes": quotas.get(ns, default_quota)}
                           for ns, b in ns_bytes.items()},
            "quotas": {**quotas, **({"*": default_quota} if default_quota is not None else {})},
        }
        server = {"pid": os.getpid(), "pool_id": self.pool_id, "protocol": P.PROTOCOL_VERSION,
                  "socket": os.path.abspath(self.socket_path), "socket_mode": f"{self.socket_mode:04o}",
                  "socket_gid": self.gid, "node": self.node, "node_reason": self.node_reason,
                  "numa_method": self.arena.numa_method, "started_utc": time.strftime(
                      "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
                  "uptime_s": round(time.monotonic() - self._t0, 1), "ready_s": self.ready_seconds,
                  "clients": len(clients), "peak_clients": c["peak_clients"], "connections_total": c["connections"],
                  "refused_full": c["refused_full"], "refused_denied": c["refused_denied"],
                  "protocol_errors": c["protocol_errors"], "bad_requests": c["bad_requests"],
                  "requests": c["requests"], "redis_mode": self.redis_mode if self.redis is not None else None,
                  "strict_placement": self.strict_placement}
        return {"server": server, "pool": pool, "rates": self._rates(counters),
                "redis": self.redis.stats() if self.redis is not None else None, "clients": clients}

    def check(self) -> None:
        """The index invariants (tests)."""
        with self._lock:
            self.index.check()

    # ------------------------------------------------------------ stop
    def stop(self, redis_flush_s: float = 2.0) -> None:
        """Stop serving: close the socket (and remove its file), drop every
        client, send what the Redis tier has queued (for up to ``redis_flush_s``)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._verify_cv:
            self._verify_cv.notify_all()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
            try:
                if self._socket_ino is not None and os.stat(self.socket_path).st_ino == self._socket_ino:
                    os.unlink(self.socket_path)
            except OSError:
                pass
        with self._lock:
            clients = list(self._clients.values())
        for cl in clients:
            try:
                cl.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with self._lock:
                if not self._clients:
                    break
            time.sleep(0.01)
        if self.redis is not None:
            self.redis.close(redis_flush_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ----------------------------------------------------------------- option parsing
def resolve_group(group) -> int:
    """A group name or gid -> gid.  Raises ValueError naming ``--group``."""
    if isinstance(group, int) or (isinstance(group, str) and group.isdigit()):
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"cxlalloc option '--group': no group named {group!r} on this machine") from None


def resolve_user(user) -> int:
    if isinstance(user, int) or (isinstance(user, str) and user.isdigit()):
        return int(user)
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ValueError(f"cxlalloc option '--allow-user': no user named {user!r} on this machine") from None


def parse_mode(text: str) -> int:
    """``0660``, ``660`` or ``0o660`` -> 0o660.  Raises ValueError naming ``--socket-mode``."""
    t = str(text).strip().lower()
    t = t[2:] if t.startswith("0o") else t
    if not t or any(ch not in "01234567" for ch in t) or int(t, 8) > 0o777:
        raise ValueError(f"cxlalloc option '--socket-mode': {text!r} is not an octal file mode such as 0660 "
                         "(owner and group may attach) or 0600 (owner only)")
    return int(t, 8)


def parse_quota(text: str):
    """``NS=SIZE`` -> (ns, bytes); ``=SIZE`` is the default namespace (no cache_salt),
    ``*=SIZE`` every namespace without its own quota."""
    if "=" not in text:
        raise ValueError(f"cxlalloc option '--quota': {text!r} is not NAMESPACE=SIZE (e.g. --quota tenant-a=8GiB; "
                         "'=SIZE' for the default namespace, '*=SIZE' for every other)")
    ns, size = text.split("=", 1)
    return ns, parse_size(size.strip(), "--quota")


def choose_node(requested: str, sysfs_root: Optional[str] = None):
    """(node, reason) for ``--numa-node`` (``auto`` or a node id with memory).

    Raises:
        ValueError: naming ``--numa-node`` and the nodes with memory.
    """
    from cxlalloc import topology

    try:
        topo = topology.read_topology(sysfs_root)
    except Exception as e:
        if str(requested) in ("auto", "0"):
            return 0, f"node 0 (NUMA topology unavailable: {e})"
        raise ValueError(f"cxlalloc option '--numa-node': cannot read the NUMA topology ({e}); use 0 or auto") from None
    with_mem = [n for n in topo["nodes"] if n.get("has_memory")]
    ids = [n["id"] for n in with_mem]
    if str(requested).strip().lower() == "auto":
        choice = topology.choose_host_node(topo, -1, "auto")
        return int(choice["node"]), choice["reason"]
    try:
        node = int(str(requested).strip())
    except ValueError:
        node = None
    if node is None or node not in ids:
        raise ValueError(f"cxlalloc option '--numa-node': {requested!r} is not allowed; use auto or a node with "
                         f"memory: {', '.join(map(str, ids))}")
    n = next(x for x in with_mem if x["id"] == node)
    kind = "CXL" if n.get("cxl") else ("CPU-less" if not n.get("has_cpu") else "with CPUs")
    return node, f"node {node} ({kind}), as asked"


def node_total_bytes(node: int, sysfs_root: Optional[str] = None) -> int:
    from cxlalloc import topology

    topo = topology.read_topology(sysfs_root)
    return int(next(n["total_bytes"] for n in topo["nodes"] if n["id"] == node))


def make_parser(prog: str = "cxlalloc kv-server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A shared KV cache server: one pool of KV blocks in shared memory on one NUMA node (a CXL node "
                    "where present) for every GPU process of this machine. Clients: "
                    "hf.wrap(model, kv_store='unix://SOCKET').",
        epilog="docs/kv-server.md: protocol, crash rules, deployments, metrics.")
    p.add_argument("--socket", default=P.DEFAULT_SOCKET, help=f"unix socket path (default {P.DEFAULT_SOCKET})")
    p.add_argument("--status", action="store_true", help="print the running server's status and exit")
    p.add_argument("--json", action="store_true", help="with --status: machine-readable output")
    p.add_argument("--size", default=None, help="pool bytes: a size ('64GiB', '1TiB') or a share of the node's "
                   "memory ('50%%'); exact, committed only as blocks are written")
    p.add_argument("--numa-node", default="auto", help="NUMA node of the pool: auto (a CPU-less/CXL node if any) or "
                   "a node id (default auto)")
    p.add_argument("--chunk", default=None, help="slab and client GPU-registration unit (default 256MiB, or the "
                   "pool when smaller; at most 64GiB; a block is at most one chunk)")
    p.add_argument("--socket-mode", default="0660", help="permission bits of the socket file: who may attach "
                   "(default 0660: owner and group)")
    p.add_argument("--group", default=None, help="group of the socket file (name or gid)")
    p.add_argument("--allow-user", action="append", default=None, metavar="USER",
                   help="only these users (name or uid; repeatable) may attach, checked by SO_PEERCRED")
    p.add_argument("--quota", action="append", default=[], metavar="NS=SIZE",
                   help="bytes a namespace (cache_salt) may hold; '=SIZE' the default namespace, '*=SIZE' every "
                        "namespace without its own (repeatable)")
    p.add_argument("--max-clients", type=int, default=256, help="connections at once (default 256)")
    p.add_argument("--strict-placement", action="store_true", help="drop blocks whose pages are not on the node")
    p.add_argument("--redis", default=None, metavar="URL", help="a Redis/Valkey tier below the pool: "
                   "redis://[user:password@]host:port/db or rediss://... (TLS)")
    p.add_argument("--redis-mode", default="evict", choices=REDIS_MODES, help="evict: blocks go to Redis when "
                   "evicted from the pool (default); through: also when committed")
    p.add_argument("--redis-ttl", type=float, default=None, metavar="S", help="seconds a block lives in Redis")
    p.add_argument("--redis-prefix", default="cxlalloc:kv:", help="key prefix in Redis (default cxlalloc:kv:)")
    p.add_argument("--redis-queue", default="256MiB", help="bytes of evicted blocks waiting for Redis; past it "
                   "blocks are dropped, never waited for (default 256MiB)")
    p.add_argument("--redis-timeout", type=float, default=2.0, metavar="S", help="seconds per Redis operation "
                   "(default 2)")
    p.add_argument("--redis-password-file", default=None, metavar="PATH", help="read the AUTH password from a file "
                   "(keeps it out of the command line)")
    p.add_argument("--redis-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a redis-py connection option, e.g. ssl_ca_certs=/etc/ssl/ca.pem, ssl_certfile=..., "
                        "ssl_keyfile=..., ssl_cert_reqs=required, username=... (repeatable)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics over HTTP on this port")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--metrics-file", default=None, metavar="PATH", help="write Prometheus text metrics to PATH "
                   "(node_exporter textfile), atomically")
    p.add_argument("--metrics-interval", type=float, default=5.0, metavar="S", help="seconds between metrics-file "
                   "writes (default 5)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _coerce(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def redis_options(args) -> dict:
    out = {}
    for pair in args.redis_option:
        if "=" not in pair:
            raise ValueError(f"cxlalloc option '--redis-option': {pair!r} is not KEY=VALUE (e.g. "
                             "ssl_ca_certs=/etc/ssl/ca.pem)")
        k, v = pair.split("=", 1)
        out[k.strip()] = _coerce(v.strip())
    if args.redis_password_file:
        try:
            with open(args.redis_password_file) as f:
                out["password"] = f.read().strip()
        except OSError as e:
            raise ValueError(f"cxlalloc option '--redis-password-file': cannot read {args.redis_password_file!r}: "
                             f"{e.strerror}") from None
    return out


def server_from_args(args) -> KVServer:
    """A KVServer (not started) from parsed CLI arguments.  Raises ValueError naming the option."""
    if args.size is None:
        raise ValueError("cxlalloc option '--size': required (the pool's bytes, e.g. --size 64GiB, or a share of the "
                         "node's memory, e.g. --size 50%)")
    node, reason = choose_node(args.numa_node)
    size = parse_size_or_fraction(args.size, "--size")
    if isinstance(size, float):
        size = int(size * node_total_bytes(node))
    if args.chunk is None:  # 256 MiB, or the whole pool when it is smaller
        page = os.sysconf("SC_PAGESIZE")
        chunk = max(page, min(DEFAULT_CHUNK, size) // page * page)
    else:
        chunk = parse_size(args.chunk, "--chunk")
    if args.max_clients < 1:
        raise ValueError(f"cxlalloc option '--max-clients': {args.max_clients} must be at least 1")
    quotas, default_quota = {}, None
    for q in args.quota:
        ns, b = parse_quota(q)
        if ns == "*":
            default_quota = b
        else:
            quotas[ns] = b
    mode = parse_mode(args.socket_mode)
    if mode & 0o002:
        log.warning("--socket-mode %s lets every local user attach and read every namespace's blocks", oct(mode))
    allow = [resolve_user(u) for u in args.allow_user] if args.allow_user else None
    gid = resolve_group(args.group) if args.group is not None else None
    if size < chunk:
        raise ValueError(f"cxlalloc option '--size': {format_bytes(size)} is below one chunk "
                         f"({format_bytes(chunk)}, --chunk); use --size of at least {format_bytes(chunk)} or a "
                         "smaller --chunk")
    ropts = redis_options(args)
    if not args.redis:
        given = [f for f, v in (("--redis-option", args.redis_option), ("--redis-password-file",
                                                                        args.redis_password_file),
                                ("--redis-ttl", args.redis_ttl)) if v]
        if given:
            raise ValueError(f"cxlalloc option '{given[0]}': given without --redis URL")
    redis = None
    if args.redis:
        from cxlalloc.kvstore.redis_tier import RedisTier

        redis = RedisTier(args.redis, prefix=args.redis_prefix, ttl=args.redis_ttl,
                          queue_bytes=parse_size(args.redis_queue, "--redis-queue"), timeout=args.redis_timeout,
                          **ropts)
    try:
        return KVServer(size, node, args.socket, chunk_bytes=chunk, socket_mode=mode, group=gid,
                        quotas=quotas, default_quota=default_quota, redis=redis, redis_mode=args.redis_mode,
                        strict_placement=args.strict_placement, max_clients=args.max_clients, allow_uids=allow,
                        node_reason=reason)
    except BaseException:
        if redis is not None:
            redis.close(0.1)
        raise


# ----------------------------------------------------------------- --status
def query_status(socket_path: str, timeout: float = 5.0) -> dict:
    """The stats of the server on ``socket_path`` (a status-only connection: no pool fd)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(socket_path)
        P.send_msg(s, {"op": "hello", "v": P.PROTOCOL_VERSION, "pid": os.getpid(), "want_fd": False,
                       "name": "status"})
        reply, _ = P.recv_msg(s)
        if not reply.get("ok"):
            raise P.RemoteError(reply.get("code", "?"), reply.get("error", "refused"))
        P.send_msg(s, {"op": "stats"})
        reply, _ = P.recv_msg(s)
        if not reply.get("ok"):
            raise P.RemoteError(reply.get("code", "?"), reply.get("error", "refused"))
        return reply["stats"]
    finally:
        s.close()


def _rate(v, unit: str = "/s") -> str:
    return "-" if v is None else f"{v:,.1f}{unit}"


def format_status(st: dict) -> str:
    """The readable ``--status`` text (plain; rich tables when available)."""
    srv, pool, rates, rd = st["server"], st["pool"], st["rates"], st.get("redis")
    rows = [
        ("server", f"pid {srv['pid']}, pool {srv['pool_id']}, up {srv['uptime_s']:.0f} s, ready in "
                   f"{(srv.get('ready_s') or 0) * 1e3:.0f} ms, socket {srv['socket']} ({srv['socket_mode']})"),
        ("placement", f"{srv['node_reason']}; checked by {srv['numa_method']}: "
                      f"{format_bytes(pool['placement_verified_bytes'])} on node, "
                      f"{format_bytes(pool['placement_misplaced_bytes'])} elsewhere"),
        ("clients", f"{srv['clients']} now, {srv['peak_clients']} at most, {srv['connections_total']} connections, "
                    f"{srv['refused_full'] + srv['refused_denied']} refused"),
    ]
    tiers = [("pool", format_bytes(pool["capacity_bytes"]), format_bytes(pool["used_bytes"]),
              f"{pool['blocks']:,} ({pool['pinned_blocks']} pinned, {pool['writing_blocks']} writing)",
              f"{pool['hit_rate'] * 100:.1f}%", _rate(rates.get("loads_per_s")),
              _rate(rates.get("load_bytes_per_s") and rates["load_bytes_per_s"] / 1e6, " MB/s"),
              _rate(rates.get("stores_per_s")),
              _rate(rates.get("store_bytes_per_s") and rates["store_bytes_per_s"] / 1e6, " MB/s"),
              f"{pool['evicted_blocks']:,}")]
    if rd is not None:
        cap = rd.get("capacity_bytes")
        tiers.append(("redis", "no limit" if not cap else format_bytes(cap), format_bytes(rd.get("used_bytes")),
                      f"queue {rd['queue_blocks']}", f"{rd['hit_rate'] * 100:.1f}%",
                      _rate(rates.get("redis_loads_per_s")),
                      _rate(rates.get("redis_load_bytes_per_s") and rates["redis_load_bytes_per_s"] / 1e6, " MB/s"),
                      _rate(rates.get("redis_stores_per_s")),
                      _rate(rates.get("redis_store_bytes_per_s") and rates["redis_store_bytes_per_s"] / 1e6, " MB/s"),
                      f"dropped {rd['dropped_blocks']:,}"))
        rows.append(("redis", f"{rd['url']} {'up' if rd['up'] else ('DOWN' if rd['up'] is False else 'not tried')}"
                              + (f" ({rd['last_error']})" if rd.get("last_error") and not rd["up"] else "")
                              + f", errors put {rd['put_errors']} get {rd['get_errors']} full {rd['full_errors']}, "
                                f"bad values {rd['bad_values']}"))
    heads = ("tier", "capacity", "used", "blocks", "hit rate", "loads", "load bytes", "stores", "store bytes",
             "evictions")
    ns = pool.get("namespaces") or {}
    try:
        import io

        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        con = Console(file=buf, width=160, force_terminal=False)
        t = Table(title=f"cxlalloc kv-server (rates over the last {rates.get('window_s', 0):.0f} s)")
        for h in heads:
            t.add_column(h)
        for r in tiers:
            t.add_row(*r)
        con.print(t)
        for k, v in rows:
            con.print(f"[bold]{k}[/bold]: {v}")
        for name, v in sorted(ns.items()):
            q = v.get("quota_bytes")
            con.print(f"namespace {name or '(default)'!s}: {format_bytes(v['used_bytes'])}"
                      + (f", quota {format_bytes(q)}" if q is not None else ""))
        return buf.getvalue().rstrip()
    except ImportError:
        lines = ["  ".join(heads)] + ["  ".join(r) for r in tiers] + [f"{k}: {v}" for k, v in rows]
        lines += [f"namespace {n or '(default)'}: {format_bytes(v['used_bytes'])}" for n, v in sorted(ns.items())]
        return "\n".join(lines)


# ----------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None, prog: str = "cxlalloc kv-server") -> int:
    """``cxlalloc kv-server``.  Exit codes: 0 stopped by SIGTERM/SIGINT (or --status
    answered), 1 the server could not start or --status could not reach it, 2 bad usage."""
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s kv-server[%(process)d] %(levelname)s %(message)s")
    try:
        P.check_socket_path(args.socket)
    except ValueError as e:
        parser.error(str(e))
    if args.status:
        try:
            st = query_status(args.socket)
        except (OSError, P.ProtocolError, P.RemoteError) as e:
            print(f"cxlalloc kv-server --status: no server answers on {args.socket}: "
                  f"{getattr(e, 'strerror', None) or e}", file=sys.stderr)
            return 1
        print(json.dumps(st, indent=2, sort_keys=True, default=str) if args.json else format_status(st))
        return 0
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        parser.error(f"cxlalloc option '--metrics-port': {args.metrics_port} is not a port (1-65535)")
    if not args.metrics_interval > 0:
        parser.error(f"cxlalloc option '--metrics-interval': {args.metrics_interval} must be > 0 seconds")
    try:
        server = server_from_args(args)
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    except Exception as e:  # mapping the pool failed (size, memfd, mbind)
        print(f"cxlalloc kv-server: cannot create the pool: {e}", file=sys.stderr)
        return 1
    try:
        server.start()
    except (ValueError, OSError) as e:
        server.stop(0.1)
        print(f"cxlalloc kv-server: {e}", file=sys.stderr)
        return 1
    exporter = None
    if args.metrics_port is not None or args.metrics_file:
        from cxlalloc.kvstore.metrics import MetricsExporter

        try:
            exporter = MetricsExporter(server.stats, port=args.metrics_port, addr=args.metrics_addr,
                                       path=args.metrics_file, interval=args.metrics_interval).start()
        except (OSError, ImportError, ValueError) as e:
            server.stop(0.1)
            print(f"cxlalloc kv-server: metrics: {e}", file=sys.stderr)
            return 1
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("ready: pool %s (%d bytes) on NUMA node %d (%s), chunks of %s, %s committed, socket %s (mode %s), "
             "pool %s, ready in %.0f ms%s%s", format_bytes(server.size), server.size, server.node, server.node_reason,
             format_bytes(server.chunk_bytes), format_bytes(server.committed_bytes()), server.socket_path,
             f"{server.socket_mode:04o}", server.pool_id, (server.ready_seconds or 0) * 1e3,
             f", redis {server.redis.url} ({server.redis_mode})" if server.redis is not None else "",
             f", metrics {exporter.describe()}" if exporter is not None else "")
    while not done.wait(1.0):
        pass
    log.info("stopping")
    if exporter is not None:
        exporter.stop()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
