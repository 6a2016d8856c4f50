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

import ctypes
import grp
import itertools
import logging
import os
import secrets
import socket
import stat
import threading
import time
import traceback
from collections import deque
from typing import Dict, List, Optional, Sequence

from cxlalloc import _C
from cxlalloc.config import format_bytes
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.index import BlockIndex, Entry
from cxlalloc.kvstore.keys import namespaced_key

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


def resolve_group(group) -> int:
    """A group name or gid -> gid.  Raises ValueError naming ``--group``."""
    if isinstance(group, int) or (isinstance(group, str) and group.isdigit()):
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"cxlalloc option '--group': no group named {group!r} on this machine") from None
