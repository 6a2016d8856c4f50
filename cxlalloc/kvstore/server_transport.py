"""The kv-server's transport: the unix socket, its permissions, framing and dispatch.

:class:`Transport` binds the socket (born 0600, then ``--socket-mode`` and
``--group``; a stale socket of a dead server is replaced, a live one is
refused), accepts connections (peer credentials via ``SO_PEERCRED``; the
state admits or refuses them, and a refused client reads why), reads
length-prefixed msgpack frames (:mod:`cxlalloc.kvstore.protocol`) and hands
each request to one method of the :class:`~cxlalloc.kvstore.server_state.ServerState`.
When a connection closes for any reason its owner is dropped from the state
(its pins dropped, its reservations aborted).
"""

from __future__ import annotations

import grp
import os
import socket
import stat
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.server_state import Owner, ServerState, log

DEFAULT_SOCKET_MODE = 0o660
DEFAULT_IO_TIMEOUT_S = 10.0


def resolve_group(group) -> int:
    """A group name or gid -> gid.  Raises ValueError naming ``--group``."""
    if isinstance(group, int) or (isinstance(group, str) and group.isdigit()):
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ValueError(f"cxlalloc option '--group': no group named {group!r} on this machine") from None


def bind_socket(path: str, mode: int, gid: Optional[int]):
    """A listening unix socket at ``path`` with permission bits ``mode`` (and
    group ``gid``); returns (socket, inode of the socket file).

    Raises:
        ValueError: ``path`` is not a socket, or a kv-server listens there (naming ``--socket``).
        OSError: the directory or the socket cannot be made (the path is named).
    """
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
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, mode)
    ino = os.stat(path).st_ino
    s.listen(128)
    s.settimeout(0.5)
    return s, ino


class Transport:
    """The socket side of a kv-server.

    Args:
        state: what requests act on.
        socket_path, socket_mode, gid: where to listen, who may attach.
        io_timeout: seconds a started message may take to arrive or be sent.
        stats: the ``stats`` op's answer (the server's full stats).
        stop: set when the server stops (shared with the background jobs).
    """

    def __init__(self, state: ServerState, socket_path: str, socket_mode: int, gid: Optional[int],
                 io_timeout: float, stats: Callable[[], dict], stop: threading.Event):
        self.state = state
        self.socket_path, self.socket_mode, self.gid = socket_path, socket_mode, gid
        self.io_timeout = float(io_timeout)
        self._stats = stats
        self._stop = stop
        self._listener: Optional[socket.socket] = None
        self._socket_ino = None
        self._socks: Dict[int, socket.socket] = {}
        self._socks_lock = threading.Lock()
        self.threads: List[threading.Thread] = []

    def start(self) -> None:
        """Bind and accept in a background thread."""
        self._listener, self._socket_ino = bind_socket(self.socket_path, self.socket_mode, self.gid)
        t = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
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
                owner = self.state.admit(pid, uid, gid)
            except P.RemoteError as refuse:
                log.warning("refused %r: %s", Owner(pid, uid, gid), refuse)
                try:  # answer its hello, so the client reads why (instead of a broken pipe)
                    sock.settimeout(1.0)
                    try:
                        P.recv_msg(sock)
                    except (P.ProtocolError, OSError):
                        pass
                    P.send_msg(sock, {"ok": False, "code": refuse.code, "error": str(refuse)})
                except OSError:
                    pass
                sock.close()
                continue
            with self._socks_lock:
                self._socks[owner.id] = sock
            t = threading.Thread(target=self._serve, args=(owner, sock), name=f"kv-client-{owner.id}", daemon=True)
            t.start()

    def _serve(self, owner: Owner, sock: socket.socket) -> None:
        sock.settimeout(self.io_timeout)
        why = "closed"
        try:
            while not self._stop.is_set():
                try:
                    msg, _ = P.recv_msg(sock, wait=None)  # idle clients may wait for ever; a started message may not
                except P.ConnectionClosed:
                    break
                reply, fds = self.handle(owner, msg)
                P.send_msg(sock, reply, fds)
        except P.ProtocolError as e:
            self.state.count("protocol_errors")
            why = f"protocol error: {e}"
            try:
                P.send_msg(sock, {"ok": False, "code": "bad_request", "error": str(e)})
            except Exception:
                pass
        except (OSError, socket.timeout) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            self._drop(owner, sock, why)

    def _drop(self, owner: Owner, sock: socket.socket, why: str) -> None:
        pins, writing = self.state.drop(owner.id)
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
        self.state.count_request(owner.id)
        try:
            if op == "hello":
                return self._hello(owner, msg)
            if not owner.hello:
                raise P.RemoteError("bad_request", "the first message must be 'hello'")
            fn = getattr(self, f"_op_{op}", None) if op in P.OPS else None
            if fn is None:
                raise P.RemoteError("unknown_op", f"unknown op {op!r}; known: {', '.join(P.OPS)}")
            out = fn(owner.id, msg)
            out["ok"] = True
            return out, None
        except P.RemoteError as e:
            self.state.count("bad_requests")
            return {"ok": False, "code": e.code, "error": str(e)}, None
        except Exception as e:  # a bug: say so, keep serving
            log.error("internal error on %s from %r: %s", op, owner, traceback.format_exc())
            return {"ok": False, "code": "internal", "error": f"{type(e).__name__}: {e}"}, None

    def _hello(self, owner: Owner, msg: dict):
        want_fd = bool(msg.get("want_fd", True))
        owner.status_only = not want_fd
        pool = self.state.hello(owner.id, msg.get("v"), msg.get("name", ""))
        log.info("%r attached%s", owner, "" if want_fd else " (status only)")
        return {"ok": True, **pool, "fd": want_fd}, ([self.state.arena.fd] if want_fd else None)

    def _op_ping(self, cid, msg):
        return {}

    def _op_stats(self, cid, msg):
        return {"stats": self._stats()}

    def _op_lookup(self, cid: int, msg: dict):
        return self.state.lookup(cid, P.check_ns(msg.get("ns")), P.check_keys(msg.get("keys")))

    def _op_release(self, cid: int, msg: dict):
        ids = msg.get("leases")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise P.RemoteError("bad_request", "'leases' must be a list of lease ids")
        return {"released": self.state.release(cid, ids)}

    def _op_reserve(self, cid: int, msg: dict):
        ns = P.check_ns(msg.get("ns"))
        keys = P.check_keys(msg.get("keys"))
        nbytes = P.check_int(msg, "nbytes", 1, 1 << 40)
        tokens = P.check_int(msg, "tokens", 0, 1 << 31)
        return self.state.reserve(cid, ns, keys, nbytes, tokens)

    def _op_commit(self, cid: int, msg: dict):
        return {"published": self.state.commit(cid, P.check_int(msg, "res", 1))}

    def _op_abort(self, cid: int, msg: dict):
        self.state.abort(cid, P.check_int(msg, "res", 1))
        return {}

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
            with self.state.lock:
                if not self.state.owners:
                    break
            time.sleep(0.01)
