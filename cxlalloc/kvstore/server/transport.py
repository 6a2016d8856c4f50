"""The kv-server's transport: the unix socket, its permissions, framing and dispatch.

:class:`Transport` binds the socket (born 0600, then ``--socket-mode`` and
``--group``; a stale socket of a dead server is replaced, a live one is
refused), accepts connections (peer credentials via ``SO_PEERCRED``; the
state admits or refuses them), reads length-prefixed msgpack frames
(:mod:`cxlalloc.kvstore.protocol`) and hands each request to one method of the
:class:`~cxlalloc.kvstore.server.state.ServerState`.  When a connection closes
for any reason its owner is dropped from the state (its pins dropped, its
reservations aborted).

Bounded work per connection, whatever a client announces or sends (each
limit a ``cxlalloc kv-server`` option, docs/kv-server.md):

* the accept thread only accepts, asks the state to admit, and starts the
  connection's thread; it never reads.  A refused connection (``--allow-user``,
  ``--max-clients``) is answered at once (``denied`` / ``limit``) without
  blocking, then handed to one refusal thread that drains its hello for at
  most :data:`REFUSE_LINGER_S` and closes it (at most :data:`MAX_REFUSED`
  pending; past that it is closed at once);
* a frame is read incrementally, never allocated at its announced length:
  at most ``max_frame`` bytes (``--max-frame``, else ``too_large``), charged
  as they arrive against a server-wide ``max_buffered`` (``--max-buffered``,
  else ``busy``), and whole within ``frame_timeout`` seconds of its first
  byte (``--frame-timeout``, else ``timeout``);
* a request holds at most ``max_objects`` maps and lists (``--max-objects``)
  and at most ``max_items`` elements in them together (``--max-items``;
  strings, bins and maps of a request have fixed small bounds,
  :func:`~cxlalloc.kvstore.protocol.decode`), so a frame decodes to a bounded
  number of objects, whatever it holds;
* a whole request stays charged against ``max_buffered`` from its last byte
  until its reply is sent, at its frame bytes plus the bound of what it
  decodes to (:func:`~cxlalloc.kvstore.protocol.decoded_bound`); a request
  that does not fit waits for room up to its frame deadline (then ``busy``),
  so the bytes held by requests of all connections together stay under
  ``--max-buffered`` (the body is decoded in place, never copied);
* the listen backlog (``--backlog``) queues a burst of connects instead of
  refusing them with EAGAIN.

Each refusal is answered with its code, then the connection is closed.
"""

from __future__ import annotations

import grp
import os
import selectors
import socket
import stat
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.protocol import check_seconds
from cxlalloc.kvstore.server.state import Owner, ServerState, log
from cxlalloc.kvstore.server.tenants import Tenancy

DEFAULT_SOCKET_MODE = 0o660
DEFAULT_IO_TIMEOUT_S = 10.0
DEFAULT_MAX_FRAME = 8 << 20        # bytes of one request (a lookup or reserve of 65536 keys is ~2.4 MiB)
DEFAULT_MAX_BUFFERED = 256 << 20   # bytes of partly received requests, all connections together
DEFAULT_FRAME_TIMEOUT_S = 5.0      # seconds from a request's first byte to its last
DEFAULT_MAX_OBJECTS = 64           # maps and lists in one request (a request has 1-3)
DEFAULT_MAX_ITEMS = P.DEFAULT_MAX_ITEMS  # elements of all lists and maps of one request
DEFAULT_HELLO_TIMEOUT_S = 5.0      # seconds from accept to a connection's hello
DEFAULT_IDLE_TIMEOUT_S = 0.0       # seconds a greeted connection may wait between requests (0: for ever)
DEFAULT_BACKLOG = 4096             # connects queued before accept (the kernel caps it at net.core.somaxconn)
# Keys decoded / reply elements encoded between two sleep(0)s (other threads get the GIL anyway every 0.2 ms, the
# server's switch interval): each sleep(0) cost 1.2 ms on a loaded 2-core machine, 1,024 of them per 65,536-key
# request at 64 keys a slice.
CODEC_SLICE = 4096
REFUSE_LINGER_S = 1.0              # seconds a refused connection may take to send its hello
MAX_REFUSED = 1024                 # refused connections lingering at once
_READ = 64 << 10                   # bytes read per recv of a frame body


class _Idle(Exception):
    """No request began within the connection's hello or idle deadline."""


def resolve_group(group) -> int:
    """A group name or gid -> gid.  Raises ValueError naming ``--group``."""
    if isinstance(group, int) or (isinstance(group, str) and group.isdigit()):
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"cxlalloc option '--group': no group named {group!r} on this machine") from None


def bind_socket(path: str, mode: int, gid: Optional[int], backlog: int = DEFAULT_BACKLOG):
    """A listening unix socket at ``path`` with permission bits ``mode`` (and
    group ``gid``); returns (socket, inode of the socket file).

    Raises:
        ValueError: ``path`` is not a socket, or a kv-server listens there (naming ``--socket``).
        OSError: the directory or the socket cannot be made (the path is named).
    """
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        try:
            os.makedirs(d, mode=0o750, exist_ok=True)
            # 0750 whatever the umask; its group is the socket's (--group), so
            # only the owner and that group may reach the socket at all.
            os.chmod(d, 0o750)
            if gid is not None:
                os.chown(d, -1, gid)
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
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    ino = os.stat(path).st_ino
    s.listen(int(backlog))
    s.settimeout(0.5)
    return s, ino


class Transport:
    """The socket side of a kv-server.

    Args:
        state: what requests act on: one :class:`ServerState`, or
            ``{tenant: ServerState}`` with ``tenancy`` (each connection acts
            on its tenant's state only, chosen by its peer credentials).
        tenancy: who is which tenant (default: one tenant ``""``).
        socket_path, socket_mode, gid: where to listen, who may attach.
        io_timeout: seconds a started message may take to arrive or be sent.
        stats: the ``stats`` op's answer (the server's full stats).
        stop: set when the server stops (shared with the background jobs).
        max_frame: bytes of one request (``too_large`` past it).
        max_buffered: bytes of partly received requests, all connections (``busy`` past it).
        frame_timeout: seconds from a request's first byte to its last (``timeout``).
        max_objects: maps and lists in one request (``bad_request`` past it).
        max_items: elements of all lists and maps of one request (``bad_request`` past it).
        hello_timeout: seconds from accept to the connection's first request (``timeout``, closed).
        idle_timeout: seconds a greeted connection may wait between requests (0: for ever).
        backlog: the listen backlog (connects queued before accept).
    """

    def __init__(self, state, socket_path: str, socket_mode: int, gid: Optional[int],
                 io_timeout: float, stats: Callable[..., dict], stop: threading.Event, *,
                 max_frame: int = DEFAULT_MAX_FRAME, max_buffered: int = DEFAULT_MAX_BUFFERED,
                 frame_timeout: float = DEFAULT_FRAME_TIMEOUT_S, max_objects: int = DEFAULT_MAX_OBJECTS,
                 backlog: int = DEFAULT_BACKLOG, tenancy: Optional[Tenancy] = None,
                 max_items: int = DEFAULT_MAX_ITEMS, hello_timeout: float = DEFAULT_HELLO_TIMEOUT_S,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S):
        self.states: Dict[str, ServerState] = dict(state) if isinstance(state, dict) else {"": state}
        self.tenancy = tenancy if tenancy is not None else Tenancy()
        self.state = next(iter(self.states.values()))  # the first tenant's: refusals of unbound peers count here
        self.hello_timeout = check_seconds(hello_timeout, "hello_timeout")
        self.idle_timeout = check_seconds(idle_timeout, "idle_timeout", allow_zero=True)
        self.max_items = int(max_items)
        self.socket_path, self.socket_mode, self.gid = socket_path, socket_mode, gid
        self.io_timeout = float(io_timeout)
        self.max_frame, self.max_buffered = int(max_frame), int(max_buffered)
        self.frame_timeout = check_seconds(frame_timeout, "frame_timeout")
        self.max_objects, self.backlog = int(max_objects), int(backlog)
        self._buffered = 0                  # bytes of partly received frames now (all connections)
        self._buffered_lock = threading.Condition()
        self.buffered_peak = 0              # the most bytes charged at once (stats: buffered_peak_bytes)
        self._refused = selectors.DefaultSelector()
        self._refused_lock = threading.Lock()
        self._refused_n = 0
        self._stats = stats
        self._stop = stop
        self._listener: Optional[socket.socket] = None
        self._socket_ino = None
        self._socks: Dict[int, socket.socket] = {}
        self._socks_lock = threading.Lock()
        self.threads: List[threading.Thread] = []

    def start(self) -> None:
        """Bind and accept in a background thread."""
        self._listener, self._socket_ino = bind_socket(self.socket_path, self.socket_mode, self.gid, self.backlog)
        for target, name in ((self._accept_loop, "kv-accept"), (lambda: _refusal_loop(self), "kv-refuse")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self.threads.append(t)

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
            try:
                owner = self._admit(pid, uid, gid)
            except P.RemoteError as refuse:
                self._refuse(sock, Owner(pid, uid, gid), refuse)
                continue
            with self._socks_lock:
                self._socks[owner.id] = sock
            t = threading.Thread(target=self._serve, args=(owner, sock), name=f"kv-client-{owner.id}", daemon=True)
            t.start()

    def _admit(self, pid: int, uid: int, gid: int) -> Owner:
        """An owner in the state of the peer's tenant (by its credentials only).
        A peer bound to no tenant is refused (``denied``), except the operator,
        who is admitted for ``stats`` (of every tenant) and ``ping`` only (it maps no pool)."""
        tenant = self.tenancy.resolve(uid, gid)
        operator = self.tenancy.is_operator(uid)
        if tenant is None and not operator:
            self.state.count("refused_denied")
            raise P.RemoteError("denied", f"uid {uid} (gid {gid}) belongs to no tenant of this kv-server (--tenant)")
        st = self.states[tenant if tenant is not None else next(iter(self.states))]
        owner = st.admit(pid, uid, gid)
        owner.tenant = st.tenant
        owner.unbound = tenant is None
        return owner

    # ------------------------------------------------------------ refusals
    def _refuse(self, sock: socket.socket, who: Owner, refuse: P.RemoteError) -> None:
        """Answer a refused connection without ever blocking the accept thread:
        the reply is written non-blocking (a fresh socket's buffer holds it),
        then the refusal thread drains the client's hello (so the client reads
        the reply, not a reset) and closes it within REFUSE_LINGER_S."""
        log.warning("refused %r: %s", who, refuse)
        try:
            sock.setblocking(False)
            sock.send(P.encode({"ok": False, "code": refuse.code, "error": str(refuse)}))
        except OSError:
            pass
        with self._refused_lock:
            if self._refused_n < MAX_REFUSED and not self._stop.is_set():
                try:
                    self._refused.register(sock, selectors.EVENT_READ, time.monotonic() + REFUSE_LINGER_S)
                    self._refused_n += 1
                    return
                except (OSError, ValueError):
                    pass
        sock.close()

    # ------------------------------------------------------------ frames
    def _charge(self, n: int) -> None:
        with self._buffered_lock:
            if n > 0 and self._buffered + n > self.max_buffered:
                raise P.RemoteError("busy", f"the kv-server holds {self._buffered} bytes of requests "
                                            f"(--max-buffered {self.max_buffered}); retry")
            self._buffered += n
            self.buffered_peak = max(self.buffered_peak, self._buffered)
            if n < 0:
                self._buffered_lock.notify_all()

    def _charge_wait(self, n: int, deadline: float) -> None:
        """Charge ``n`` bytes, waiting for room until ``deadline`` (then ``busy``)."""
        with self._buffered_lock:
            while self._buffered + n > self.max_buffered:
                left = deadline - time.monotonic()
                if left <= 0 or n > self.max_buffered:
                    raise P.RemoteError("busy", f"the kv-server holds {self._buffered} bytes of requests "
                                                f"(--max-buffered {self.max_buffered}); retry")
                self._buffered_lock.wait(left)
            self._buffered += n
            self.buffered_peak = max(self.buffered_peak, self._buffered)

    def read_request(self, sock: socket.socket, wait: Optional[float] = None):
        """One request from ``sock``: waits for ever for its first byte, then
        reads it incrementally within ``frame_timeout`` seconds.  Returns
        ``(message, held)``: ``held`` bytes stay charged against
        ``max_buffered`` for the decoded message; the caller gives them back
        (``_charge(-held)``) once the request is answered.  ``wait``: seconds
        to wait for the first byte (None: for ever), else ``timeout``.

        Raises:
            protocol.ConnectionClosed: EOF (between or inside requests).
            protocol.RemoteError: ``too_large`` / ``busy`` / ``timeout`` (the
                connection is answered with it, then closed).
            protocol.ProtocolError: not a msgpack map, or over ``max_objects`` / ``max_items``.
        """
        sock.settimeout(wait)  # idle clients may wait (for ever, by default); a started request may not
        try:
            head = sock.recv(4)
        except socket.timeout:
            raise _Idle() from None
        if not head:
            raise P.ConnectionClosed("the peer closed the connection")
        deadline = time.monotonic() + self.frame_timeout
        body = bytearray(head)
        charged = 0
        try:
            n = None
            while True:
                if n is None and len(body) >= 4:
                    n = int.from_bytes(body[:4], "big")
                    if n > self.max_frame:
                        raise P.RemoteError("too_large", f"a request of {n} bytes exceeds this kv-server's "
                                                         f"{self.max_frame} bytes (--max-frame)")
                    del body[:4]
                if n is not None and len(body) >= n:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise P.RemoteError("timeout", f"a request must arrive whole within {self.frame_timeout:g} s of "
                                                   "its first byte (--frame-timeout)")
                want = 4 - len(body) if n is None else min(_READ, n - len(body))
                self._charge(want)
                charged += want
                sock.settimeout(left)
                try:
                    data = sock.recv(want)
                except socket.timeout:
                    data = None  # the deadline check above answers it
                got = len(data) if data else 0
                self._charge(got - want)  # only what arrived stays charged
                charged += got - want
                if data is None:
                    continue
                if not data:
                    raise P.ConnectionClosed("the peer closed the connection")
                body += data
            # What it decodes to, charged before it is built (waiting for room up to the deadline).
            held = P.decoded_bound(n, self.max_items)
            self._charge_wait(held, deadline)
            try:
                msg = P.decode(body, self.max_objects, self.max_items, CODEC_SLICE)
            except BaseException:
                self._charge(-held)
                raise
            return msg, held
        finally:
            del body
            if charged:
                self._charge(-charged)

    def _serve(self, owner: Owner, sock: socket.socket) -> None:
        why = "closed"
        st = self.states[owner.tenant]
        try:
            while not self._stop.is_set():
                if not owner.hello:
                    wait = self.hello_timeout
                else:
                    wait = self.idle_timeout or None
                try:
                    msg, held = self.read_request(sock, wait)
                except P.ConnectionClosed:
                    break
                except _Idle:
                    what = "hello" if not owner.hello else "idle"
                    st.count("closed_no_hello" if what == "hello" else "closed_idle")
                    raise P.RemoteError("timeout", f"no hello within {self.hello_timeout:g} s of connecting "
                                                   "(--hello-timeout)" if what == "hello" else
                                        f"no request for {self.idle_timeout:g} s (--idle-timeout)") from None
                try:
                    sock.settimeout(self.io_timeout)
                    one_way = P.is_one_way(msg, owner.version)
                    op, rid = msg.get("op"), msg.get("res")
                    reply, fds = self.handle(owner, msg)
                    del msg
                    if one_way:  # v2 release, v3 commit: acted on, never answered
                        st.count("one_way_requests")
                        if not reply.get("ok"):
                            st.count("one_way_errors")
                        if op == "commit":  # its outcome rides on the next reply (protocol.py, version 3)
                            st.count("pipelined_commits")
                            if len(owner.deferred) >= P.MAX_DEFERRED_COMMITS:
                                owner.deferred.pop(0)
                                owner.deferred_dropped += 1
                            owner.deferred.append([rid if isinstance(rid, int) else 0, int(reply.get("published", 0)),
                                                   None if reply.get("ok") else str(reply.get("code", "?"))])
                        continue
                    if owner.deferred:
                        reply["commits"], owner.deferred = owner.deferred, []
                        if owner.deferred_dropped:
                            reply["commits_dropped"], owner.deferred_dropped = owner.deferred_dropped, 0
                    P.send_msg(sock, reply, fds, CODEC_SLICE)
                finally:
                    self._charge(-held)
        except (P.ProtocolError, P.RemoteError) as e:
            code = e.code if isinstance(e, P.RemoteError) else "bad_request"
            st.count("protocol_errors")
            st.count(f"refused_{code}" if code in ("too_large", "busy", "timeout") else "bad_frames")
            if isinstance(e, P.LimitError):  # of the bad frames, those over --max-items / --max-objects
                st.count(f"refused_{e.limit}")
            why = f"{code}: {e}"
            try:
                sock.settimeout(1.0)
                P.send_msg(sock, {"ok": False, "code": code, "error": str(e)})
            except Exception:
                pass
        except (OSError, socket.timeout) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            self._drop(owner, sock, why)

    def _drop(self, owner: Owner, sock: socket.socket, why: str) -> None:
        pins, writing = self.states[owner.tenant].drop(owner.id)
        with self._socks_lock:
            self._socks.pop(owner.id, None)
        try:
            sock.close()
        except OSError:
            pass
        if pins or writing:
            log.info("%r gone (%s): dropped %d pins, aborted %d unpublished blocks", owner, why, pins, writing)
        else:
            log.debug("%r gone (%s)", owner, why)

    # ------------------------------------------------------------ dispatch
    def handle(self, owner: Owner, msg: dict):
        """One request -> (reply, file descriptors to send or None).  Errors
        are replies (``{"ok": False, "code", "error"}``); never raises."""
        op = msg.get("op")
        st = self.states[owner.tenant]
        st.count_request(owner.id)
        try:
            if op == "hello":
                return self._hello(st, owner, msg)
            if not owner.hello:
                raise P.RemoteError("bad_request", "the first message must be 'hello'")
            fn = self.OPS.get(op) if isinstance(op, str) else None
            if fn is None:
                raise P.RemoteError("unknown_op", f"unknown op {op!r}; known: {', '.join(P.OPS)}")
            if owner.unbound and op not in ("stats", "ping"):
                raise P.RemoteError("denied", f"uid {owner.uid} belongs to no tenant of this kv-server: it may ask "
                                              "for stats only (bind it with --tenant)")
            out = fn(self, st, owner, msg)
            out["ok"] = True
            return out, None
        except P.RemoteError as e:
            st.count("bad_requests")
            return {"ok": False, "code": e.code, "error": str(e)}, None
        except Exception as e:  # a bug: say so, keep serving
            log.error("internal error on %s from %r: %s", op, owner, traceback.format_exc())
            return {"ok": False, "code": "internal", "error": f"{type(e).__name__}: {e}"}, None

    def _hello(self, st: ServerState, owner: Owner, msg: dict):
        want_fd = bool(msg.get("want_fd", True))
        if want_fd and owner.unbound:
            raise P.RemoteError("denied", f"uid {owner.uid} belongs to no tenant of this kv-server: it may not map "
                                          "a pool (bind it with --tenant), only ask for stats (want_fd false)")
        owner.status_only = not want_fd
        pool = st.hello(owner.id, msg.get("v"), msg.get("name", ""))
        if self.tenancy.multi:
            pool["tenant"] = st.tenant
        log.info("%r attached%s%s", owner, f" as tenant {st.tenant!r}" if self.tenancy.multi else "",
                 "" if want_fd else " (status only)")
        return {"ok": True, **pool, "fd": want_fd}, ([st.arena.fd] if want_fd else None)

    # Each op acts on the state of the connection's own tenant (``st``), never on another's.
    def _op_ping(self, st, owner, msg):
        return {}

    def _op_stats(self, st, owner, msg):
        return {"stats": self._stats(None if owner.unbound else owner.tenant)}

    def _op_lookup(self, st, owner, msg: dict):
        return st.lookup(owner.id, P.check_ns(msg.get("ns")), P.check_keys(msg.get("keys")))

    def _op_discard(self, st, owner, msg: dict):
        return {"dropped": st.discard(owner.id, P.check_ns(msg.get("ns")), P.check_keys(msg.get("keys")))}

    def _op_release(self, st, owner, msg: dict):
        ids = msg.get("leases")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise P.RemoteError("bad_request", "'leases' must be a list of lease ids")
        return {"released": st.release(owner.id, ids)}

    def _op_reserve(self, st, owner, msg: dict):
        ns = P.check_ns(msg.get("ns"))
        keys = P.check_keys(msg.get("keys"))
        nbytes = P.check_int(msg, "nbytes", 1, 1 << 40)
        tokens = P.check_int(msg, "tokens", 0, 1 << 31)
        return st.reserve(owner.id, ns, keys, nbytes, tokens)

    def _op_commit(self, st, owner, msg: dict):
        return {"published": st.commit(owner.id, P.check_int(msg, "res", 1))}

    def _op_abort(self, st, owner, msg: dict):
        st.abort(owner.id, P.check_int(msg, "res", 1))
        return {}

    # Every op of the protocol but "hello" (answered before any other): name -> method.
    OPS = {"lookup": _op_lookup, "release": _op_release, "reserve": _op_reserve, "commit": _op_commit,
           "abort": _op_abort, "stats": _op_stats, "ping": _op_ping, "discard": _op_discard}

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """Close the listener (and remove its file, if still ours), shut every
        connection down and wait up to 2 s for their owners to be dropped."""
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
        with self._socks_lock:
            socks = list(self._socks.values())
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if all(not s.owners for s in self.states.values()):
                break
            time.sleep(0.01)


def _refusal_loop(tr: "Transport") -> None:
    while not tr._stop.is_set():
        with tr._refused_lock:
            empty = tr._refused_n == 0
        if empty:
            time.sleep(0.05)
            continue
        for key, _ in tr._refused.select(timeout=0.1):
            try:
                data = key.fileobj.recv(_READ)
            except OSError:
                data = b""
            if not data:
                _close_refused(tr, key.fileobj)
        now = time.monotonic()
        with tr._refused_lock:
            late = [k.fileobj for k in tr._refused.get_map().values() if k.data < now]
        for s in late:
            _close_refused(tr, s)
    with tr._refused_lock:
        for k in list(tr._refused.get_map().values()):
            tr._refused.unregister(k.fileobj)
            k.fileobj.close()
        tr._refused_n = 0


def _close_refused(tr: "Transport", sock: socket.socket) -> None:
    with tr._refused_lock:
        try:
            tr._refused.unregister(sock)
            tr._refused_n -= 1
        except (KeyError, ValueError):
            pass
    sock.close()
