"""A client of a ``cxlalloc kv-server``: the machine's shared KV pool as a block store.

``RemoteBlockStore("unix:///run/cxlalloc/kv.sock", allocator)`` is what
``hf.wrap(model, kv_store="unix:///run/cxlalloc/kv.sock")`` (or
``CXLALLOC=kv_store:unix:///run/cxlalloc/kv.sock``) opens.  It has the
contract of every store (:class:`~cxlalloc.kvstore.store.BlockStore`): ``lookup``
returns a lease whose ``views`` are 1-D uint8 CPU tensors *into the server's
pool*, mapped into this process (the pool's memfd arrives over the socket by
SCM_RIGHTS), so a hit is copied once, pool -> KV cache; on a GPU the pool is
registered for the device chunk by chunk when first used, so that copy is a
DMA over the link with no staging copy.  ``reserve`` returns slots in the pool
to write, then ``commit`` publishes them to every process of the machine.

Failures never cost a token: when the server cannot be reached, dies or
hangs (every socket operation has a timeout), lookups return no blocks and
reservations no slots, so ``generate()`` recomputes (or uses the optional
local ``fallback`` tier); the store warns once, counts it (``server_errors``,
``timeouts``), and reconnects with exponential backoff.  A restarted server
has a new pool (``pool_id``): the client maps the new one, and leases on the
old one stay valid (their memory lives while a view refers to it).

A connection that failed is closed only once no lease or reservation of it is
still open: closing it makes the server drop those pins and abort those
slots, and a slot the server reused while this process still read or wrote it
would be a wrong token.

URL options (``unix:///path/kv.sock?timeout=5&fallback=256MiB&commit=wait``):
    timeout   seconds for each request (default 5)
    fallback  bytes of an in-process LocalBlockStore used while the server is away
    commit    ``pipelined`` (default): a commit is not waited for (protocol 3;
              acknowledged by the next reply, :meth:`RemoteBlockStore.flush`);
              ``wait``: every commit waits for the server's reply
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
import warnings
from typing import List, Optional, Sequence

from cxlalloc import _C
from cxlalloc.config import format_bytes, parse_size
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.connection import _Broken, _Conn, _Pool, _slot_views  # noqa: F401 (tests import it from here)
from cxlalloc.kvstore.handles import close_fds
from cxlalloc.kvstore.local import KVStoreWarning, LocalBlockStore
from cxlalloc.kvstore.remote_handles import PendingReservation, RemoteLease, RemoteReservation, _Nothing
from cxlalloc.kvstore.store import AccountedStore, hit_rate

DEFAULT_TIMEOUT_S = 5.0
_BACKOFF_MIN_S = 0.2
_BACKOFF_MAX_S = 10.0


class RemoteBlockStore(AccountedStore):
    """The kv-server at ``url`` as a block store (see the module docstring).

    Args:
        url: ``unix:///path/kv.sock`` (``?timeout=S&fallback=SIZE``).
        allocator: the :class:`cxlalloc.Allocator` whose GPU (or simulated
            GPU) the pool is registered for; None maps the pool for CPU
            copies only (no GPU registration, no ``fallback``): what a
            process that stages blocks in its own pinned buffers uses (the
            LMCache plugin, :mod:`cxlalloc.kvstore.engines.lmcache_plugin`).
        timeout: seconds per request (overrides the URL's).
        fallback: bytes of a local store used while the server is away (overrides the URL's).
        name: shown in the server's client list (default: the program's name).
        commit: ``"pipelined"`` or ``"wait"`` (overrides the URL's; see the module docstring).

    Raises:
        ValueError: not a unix:// URL, a bad timeout or fallback size, a
            fallback without an allocator, a ``commit`` other than
            pipelined/wait (naming ``kv_store``).

    Never raises because the server is down: it warns and generates without it.
    """

    kind = "server"
    #: other processes (the server, its other clients) map the pool read-write: writers seal over a private copy
    #: (:class:`cxlalloc.hf.store_io.BlockWriter`), readers verify a private copy (``BlockReader``).
    views_shared = True

    def __init__(self, url: str, allocator, *, timeout: Optional[float] = None, fallback=None,
                 name: Optional[str] = None, commit: Optional[str] = None):
        self.url = url
        self.path = P.socket_path_from_url(url)
        q = P.url_query(url)
        unknown = sorted(set(q) - {"timeout", "fallback", "commit"})
        if unknown:
            raise ValueError(f"cxlalloc option 'kv_store': unknown URL option(s) {', '.join(unknown)} in {url!r}; "
                             "allowed: timeout (seconds), fallback (bytes of a local tier), commit (pipelined, wait)")
        commit = q.get("commit", "pipelined") if commit is None else commit
        if commit not in ("pipelined", "wait"):
            raise ValueError(f"cxlalloc option 'kv_store': commit={commit!r}; allowed values: pipelined (a commit is "
                             "acknowledged by the next reply), wait (every commit waits for its reply)")
        self.pipeline_commits = commit == "pipelined"
        if timeout is None:
            timeout = q.get("timeout", DEFAULT_TIMEOUT_S)
        try:
            self.timeout = P.check_seconds(timeout, "kv_store")
        except ValueError:
            raise ValueError(f"cxlalloc option 'kv_store': timeout={timeout!r} must be a finite number of seconds in "
                             f"(0, {P.MAX_TIMEOUT_S:g}]") from None
        if fallback is None and q.get("fallback"):
            fallback = parse_size(q["fallback"], "kv_store fallback")
        self.allocator = allocator
        self.name = (name or os.path.basename((sys.argv or [""])[0]) or "python")[:64]
        self.simulated = allocator is not None and bool(allocator.simulated)
        self.fallback = None
        if fallback:
            if allocator is None:
                raise ValueError("cxlalloc option 'kv_store': fallback needs an allocator (its blocks are registered "
                                 "for a GPU); without one, leave fallback out")
            self.fallback = LocalBlockStore(allocator, fallback)
        self._lock = threading.Lock()      # the connection state
        self._conn: Optional[_Conn] = None
        self._pool: Optional[_Pool] = None
        self._down_until = 0.0
        self._backoff = _BACKOFF_MIN_S
        self._ever_connected = False
        self._warned = set()
        self.last_error: Optional[str] = None
        super().__init__(("lookups", "lookup_blocks", "hit_blocks", "reserves", "reserved_blocks",
                                       "committed_blocks", "pipelined_commits", "commit_shortfall_blocks",
                                       "unacknowledged_commits", "server_errors", "timeouts", "remote_errors", "reconnects",
                                       "server_restarts", "skipped_down", "fallback_lookups", "register_failures",
                                       "pin_budget_misses"))
        self._get_conn()  # connect now if the server is up (a warning if not)

    # ------------------------------------------------------------ connection
    def _count(self, key: str, n=1) -> None:
        self.counters.add(key, n)

    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(msg, KVStoreWarning, stacklevel=4)

    def _failed(self, exc: BaseException, conn: Optional[_Conn] = None, warn: bool = True) -> None:
        """A request failed: count it; a broken connection puts the server 'down' for the backoff.  ``warn``
        False: the caller dials again at once (the 'not available' warning waits for that try to fail)."""
        # A _Broken already names the OS error it wraps; its own name means nothing to a user.
        text = str(exc) if isinstance(exc, _Broken) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, P.RemoteError):
            self._count("remote_errors")
            self._warn_once("remote:" + exc.code, f"cxlalloc kv store: the kv-server at {self.path} refused a "
                                                  f"request ({exc.code}: {exc}); that request counts as a miss (nothing "
                                                  "stored or loaded by it), later requests still go to the server "
                                                  "(said once per code)")
            return
        self._count("server_errors")
        if "timed out" in text or "timeout" in text.lower():
            self._count("timeouts")
        if conn is not None and conn.pending:  # pipelined commits the server may or may not have published
            self._count("unacknowledged_commits", len(conn.pending))
            conn.pending.clear()
        with self._lock:
            self.last_error = text
            if conn is not None:
                conn.abandon()
            if conn is None or self._conn is conn:
                self._conn = None
                self._down_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
        if not warn:
            return
        self._warn_once("down", f"cxlalloc kv store: the kv-server at {self.path} is not available ({text}); "
                                "generating without it (prompts are recomputed"
                                + (", the local fallback tier is used" if self.fallback is not None else "")
                                + ") and reconnecting in the background of later calls")

    def _get_conn(self) -> Optional[_Conn]:
        with self._lock:
            c = self._conn
            if c is not None and not c.broken:
                return c
            if time.monotonic() < self._down_until:
                self._count("skipped_down")
                return None
        try:
            c = self._dial()
        except Exception as e:
            self._failed(e if isinstance(e, (OSError, _Broken, P.ProtocolError)) else _Broken(f"{type(e).__name__}: {e}"))
            return None
        with self._lock:
            if self._conn is not None and not self._conn.broken:  # another thread won
                other = self._conn
            else:
                other = None
                if self._ever_connected:
                    self._count("reconnects")
                self._ever_connected = True
                self._conn = c
                self._backoff = _BACKOFF_MIN_S
                self._down_until = 0.0
        if other is not None:
            c.abandon()
            return other
        return c

    def _dial(self) -> _Conn:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        fds: List[int] = []
        try:
            s.connect(self.path)
            for v in range(P.PROTOCOL_VERSION, 0, -1):  # an older server refuses a newer version: ask for the one below
                P.send_msg(s, {"op": "hello", "v": v, "pid": os.getpid(), "want_fd": True, "name": self.name})
                reply, fds = P.recv_msg(s, max_fds=4)
                if reply.get("ok") or reply.get("code") != "bad_request" or "protocol version" not in str(
                        reply.get("error", "")):
                    break
            if not reply.get("ok"):
                raise P.RemoteError(str(reply.get("code", "?")), str(reply.get("error", "refused")))
            pool = self._pool
            if pool is not None and pool.pool_id == reply["pool_id"]:
                for fd in fds:  # the same pool, already mapped
                    os.close(fd)
            else:
                if not fds or not P.fd_is_shared_memory(fds[0]):
                    raise P.ProtocolError("the server sent no pool file descriptor")
                fd = fds.pop(0)
                for extra in fds:
                    os.close(extra)
                fds = []
                chunk = int(reply["chunk_bytes"])
                a = self.allocator  # None: no engine and no register chunk, so nothing is registered for a GPU
                arena = _C.HostArena(a._engine if a is not None else None, 0, int(reply["node"]), False, fd,
                                     chunk if a is not None else 0, int(a.device) if a is not None else 0)
                if arena.size < int(reply["size"]):
                    raise P.ProtocolError(f"the pool maps {arena.size} bytes, the server says {reply['size']}")
                if pool is not None:
                    self._count("server_restarts")
                pool = self._pool = _Pool(arena, reply)
            conn = _Conn(s, pool, reply)
            conn.on_commits = self._on_commits
            return conn
        except BaseException:
            close_fds(fds)
            s.close()
            raise

    def _on_commits(self, outcomes, sent, dropped) -> None:
        """A reply acknowledged pipelined commits: count what the server published, and any failure."""
        for rid, published, code in outcomes:
            self._count("committed_blocks", int(published))
            if code is not None:
                self._failed(P.RemoteError(str(code), f"a pipelined commit (reservation {rid}) failed"))
            elif int(published) < sent.get(rid, 0):
                self._count("commit_shortfall_blocks", sent[rid] - int(published))
        if dropped:
            self._count("unacknowledged_commits", dropped)

    def flush(self) -> bool:
        """Wait until the server has acknowledged every pipelined commit of this
        store (one ``ping`` when any is outstanding): after it, those blocks
        are published and, with ``--pool-file``, recorded.  Returns True when
        none is left unacknowledged (False: the server went away first; they
        are counted in ``unacknowledged_commits``)."""
        c = self._conn
        if c is None or c.broken or not c.pending:
            return c is None or not c.pending
        try:
            c.request({"op": "ping"})
        except (_Broken, P.RemoteError) as e:
            self._failed(e, c if isinstance(e, _Broken) else None)
            return False
        return not c.pending

    # ------------------------------------------------------------ blocks
    def _held_request(self, msg: dict, before=None, passes: Sequence[str] = (), sent=None):
        """Send ``msg`` on the connection, held for the lease/reservation its reply opens: ``(conn, reply)``.
        A connection that worked and is found broken (most often a restarted server, or one closed by
        --idle-timeout while the model was idle) is dialled once more at once (one try, no backoff), so the
        request is not lost; a server really away then counts as down.  ``before()`` runs once connected.
        Nothing held: ``(None, "away")`` (no connection), ``"failed"`` (broken: counted, warned once) or
        ``"refused"`` (counted, warned once per code); a refusal whose code is in ``passes`` is raised.
        ``sent``: ``(conn, read)`` of ``msg`` already sent on ``conn`` (held) by :meth:`reserve_ahead`; its
        reply is read first, and a broken connection dials again as above."""
        for last in (False, True):
            got, sent = sent or _dialled(self, msg, before), None
            if got is None:
                return None, "away"
            c, read = got
            try:
                return c, read()
            except _Broken as e:
                c.unhold()
                retry = not last and c.established
                self._failed(e, c, warn=not retry)
                if not retry:
                    return None, "failed"
                with self._lock:
                    self._down_until = 0.0
            except P.RemoteError as e:
                c.unhold()
                if e.code in passes:
                    raise
                self._failed(e)
                return None, "refused"

    def _register(self, pool: _Pool, off: int, n: int) -> None:
        try:
            pool.arena.ensure_registered(off, n)
        except Exception as exc:  # pageable copies still work, slower
            self._count("register_failures")
            self._warn_once("register", f"cxlalloc kv store: registering a chunk of the kv-server's pool for the GPU "
                                        f"failed ({exc}); blocks in it are copied through pageable memory (slower)")

    def lookup(self, ns: str, keys: Sequence[bytes]):
        """The longest prefix of ``keys`` stored on the server, pinned there until the lease closes."""
        keys = list(keys)
        self._count("lookups")
        self._count("lookup_blocks", len(keys))
        if not keys:
            return _Nothing()
        c, reply = self._held_request({"op": "lookup", "ns": ns, "keys": keys})
        if c is None:
            return _Nothing() if reply == "refused" else self._fallback_lookup(ns, keys)
        blocks = reply.get("blocks") or []
        if reply.get("budget_cut"):
            _say_budget_cut(self, int(reply["budget_cut"]))
        if not blocks:
            c.unhold()
            return _Nothing()
        views = []
        for off, n, _tokens in blocks:
            self._register(c.pool, int(off), int(n))
            views.append(c.pool.bytes[int(off):int(off) + int(n)])
        self._count("hit_blocks", len(views))
        return RemoteLease(self, c, int(reply["lease"]), views, int(reply.get("tier_blocks") or 0))

    def discard(self, ns: str, keys: Sequence[bytes]) -> int:
        """Report blocks whose checksum failed on load: the server verifies
        each and drops it (``corrupt_blocks`` in its stats).  Returns how many
        it dropped (0 when the server is away)."""
        c = self._get_conn()
        if c is None or not keys:
            return 0
        try:
            return int(c.request({"op": "discard", "ns": ns, "keys": list(keys)}).get("dropped", 0))
        except (_Broken, P.RemoteError) as e:
            self._failed(e, c if isinstance(e, _Broken) else None)
            return 0

    def _fallback_lookup(self, ns, keys):
        if self.fallback is None:
            return _Nothing()
        self._count("fallback_lookups")
        return self.fallback.lookup(ns, keys)

    def reserve(self, ns: str, keys: Sequence[bytes], nbytes: int, tokens: int):
        """Slots of ``nbytes`` in the server's pool for each key not stored yet.

        Raises:
            ValueError: a block larger than one chunk of the server (naming its ``--chunk``).
        """
        self._count("reserves")
        return self._reserve_now(ns, list(keys), nbytes, tokens)

    def _reserve_now(self, ns: str, keys: List[bytes], nbytes: int, tokens: int, sent=None):
        try:
            c, reply = self._held_request({"op": "reserve", "ns": ns, "keys": keys, "nbytes": int(nbytes),
                                           "tokens": int(tokens)},
                                          before=lambda: self.check_block_bytes(nbytes), passes=("too_large",),
                                          sent=sent)
        except P.RemoteError as e:
            raise ValueError(f"cxlalloc option 'kv_store': {e}") from None
        if c is None:
            if reply == "away" and self.fallback is not None:
                return self.fallback.reserve(ns, keys, nbytes, tokens)
            return _Nothing(len(keys))
        return _reservation(self, c, reply, len(keys), nbytes)

    def reserve_ahead(self, ns: str, keys: Sequence[bytes], nbytes: int, tokens: int) -> PendingReservation:
        """:meth:`reserve` sent now, its reply read by :meth:`PendingReservation.result`: the server reserves
        the next batch while this process copies the current one (docs/kv-server.md, "Reserving ahead").
        Slots are for keys not stored when the server handles it; closed without ``result()``: aborted.

        Raises:
            ValueError: a block larger than one chunk of the server (naming its ``--chunk``).
        """
        keys = list(keys)
        self._count("reserves")
        c = self._get_conn()
        if c is not None:
            self.check_block_bytes(nbytes)
            c.hold()
            try:
                d = c.send_deferred({"op": "reserve", "ns": ns, "keys": keys, "nbytes": int(nbytes),
                                     "tokens": int(tokens)})
                return PendingReservation(c, d, lambda read: self._reserve_now(ns, keys, nbytes, tokens, (c, read)))
            except _Broken as e:
                return PendingReservation(None, None, None,
                                          self._reserve_now(ns, keys, nbytes, tokens, (c, _raiser(e))))
        return PendingReservation(None, None, None, self._reserve_now(ns, keys, nbytes, tokens))

    def check_block_bytes(self, nbytes: int) -> None:
        """Raise ValueError naming ``kv_store`` if a block of ``nbytes`` can never fit
        (larger than one chunk of the server; unknown while it is away)."""
        pool = self._pool
        if pool is not None and nbytes > pool.chunk_bytes:
            raise ValueError(f"cxlalloc option 'kv_store': a block of {nbytes} bytes is larger than one chunk of the "
                             f"kv-server at {self.path} ({pool.chunk_bytes} bytes, its --chunk); restart it with a "
                             "larger --chunk or lower 'block_tokens'")
        if self.fallback is not None:
            self.fallback.check_block_bytes(nbytes)

    # ------------------------------------------------------------ accounting
    def connected(self) -> bool:
        c = self._conn
        return c is not None and not c.broken

    def server_stats(self) -> Optional[dict]:
        """The server's own stats (None while it is away)."""
        c = self._get_conn()
        if c is None:
            return None
        try:
            return c.request({"op": "stats"})["stats"]
        except (_Broken, P.RemoteError) as e:
            self._failed(e, c if isinstance(e, _Broken) else None)
            return None

    def stats(self) -> dict:
        """This client's counters, its mapping of the pool, and the server's pool stats.

        Keys: ``kind`` ("server"), ``url``, ``connected``, ``last_error``,
        ``pool_id``, ``tenant`` (the tenant the server bound this process's
        uid/gid to; None on a single-tenant server), ``node``, ``capacity_bytes``/``used_bytes``/``blocks``/
        ``hit_rate`` (the server's pool, all clients), ``registered_bytes``
        (of the pool, by this process), the client counters (``lookups``,
        ``hit_blocks``, ``server_errors``, ``timeouts``, ``reconnects``,
        ``server_restarts``, ``bytes_loaded``, ``load_GBps``, ...), ``server``
        (the server's full stats, None while away), ``fallback`` (its stats).
        """
        return _stats_of(self)

    def close(self) -> None:
        """Stop using the server (the connection closes once no lease or reservation is open);
        pipelined commits are acknowledged first (:meth:`flush`)."""
        self.flush()
        with self._lock:
            c, self._conn = self._conn, None
            self._down_until = float("inf")
        if c is not None:
            c.abandon()

    def __repr__(self) -> str:
        pool = self._pool
        where = f"pool {pool.pool_id}, {format_bytes(pool.size)} on node {pool.node}" if pool else "not connected"
        return f"<cxlalloc RemoteBlockStore {self.path}: {where}>"


def _reservation(st: "RemoteBlockStore", c: _Conn, reply: dict, n: int, nbytes: int):
    """The reservation a reserve's reply on ``c`` (held) opens, or an empty one of ``n`` keys (unheld)."""
    rid = int(reply.get("res") or 0)
    if not rid:
        c.unhold()
        return _Nothing(n)
    slots = reply.get("slots") or []
    res = RemoteReservation(st, c, rid, c.pool, [None if o is None else int(o) for o in slots], int(nbytes))
    st._count("reserved_blocks", res.slots)
    return res


def _dialled(st: "RemoteBlockStore", msg: dict, before):
    """``(conn, read)``: ``msg`` ready to send on a connection of ``st``, held (``read()`` sends it and reads the
    reply); None when there is no connection.  ``before()`` runs once connected."""
    c = st._get_conn()
    if c is None:
        return None
    if before is not None:
        before()
    c.hold()  # before the request: the connection must not close while its pins/slots are in use
    return c, functools.partial(c.request, msg)


def _raiser(exc: BaseException):
    """A reply reader that raises ``exc`` (a request whose send already failed)."""
    def read():
        raise exc
    return read


def _stats_of(st: "RemoteBlockStore") -> dict:
    """:meth:`RemoteBlockStore.stats` (kept out of the class: one job per piece)."""
    c = st.counters.snapshot()
    srv = st.server_stats()
    pool = st._pool
    c.update(kind=st.kind, url=st.url, connected=st.connected(), last_error=st.last_error,
             simulated=st.simulated, pool_id=pool.pool_id if pool else None, node=pool.node if pool else None,
             tenant=pool.tenant if pool else None,
             chunk_bytes=pool.chunk_bytes if pool else None)
    if pool is not None:
        a = pool.arena.stats()
        c["registered_bytes"] = a["registered_bytes"]
        c["register_failures"] += a["register_failures"]
    else:
        c["registered_bytes"] = 0
    sp = (srv or {}).get("pool") or {}
    c.update(capacity_bytes=sp.get("capacity_bytes"), used_bytes=sp.get("used_bytes"), blocks=sp.get("blocks"),
             stored_blocks=sp.get("stored_blocks"), evicted_blocks=sp.get("evicted_blocks"),
             hit_rate=sp.get("hit_rate"), client_hit_rate=hit_rate(c["hit_blocks"], c["lookup_blocks"]))
    c["server"] = srv
    if st.fallback is not None:
        c["fallback"] = st.fallback.stats()
    return c


def _say_budget_cut(st: "RemoteBlockStore", cut: int) -> None:
    """The server answered ``cut`` stored blocks of a lookup as misses (its ``--max-pinned``): count, warn once."""
    st._count("pin_budget_misses", cut)
    st._warn_once("pin_budget", f"cxlalloc kv store: the kv-server answered {cut} stored blocks as misses: this "
                                "client's pinned blocks reached the server's --max-pinned (default half the pool); "
                                "release leases sooner or start the server with a larger --max-pinned")
