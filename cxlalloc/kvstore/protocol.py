"""The kv-server's wire protocol: length-prefixed msgpack over a unix stream socket.

One frame = a 4-byte big-endian length, then that many bytes of one msgpack
map.  Every request carries ``op`` and is answered by exactly one reply, in
order, on the same connection::

    request  {"op": "lookup", "ns": "tenant", "keys": [b"<32 bytes>", ...]}
    reply    {"ok": True, "lease": 7, "blocks": [[offset, nbytes, tokens], ...]}
    error    {"ok": False, "code": "bad_request", "error": "text"}

Operations (docs/kv-server.md has the states and the crash rules):

==========  =====================================================  ===========================================
op          request fields                                          reply fields
==========  =====================================================  ===========================================
hello       v, pid, want_fd (bool), name                            v, pool_id, size, chunk_bytes, node, pid,
                                                                    numa_method, max_keys (+ the pool's fd
                                                                    by SCM_RIGHTS when want_fd)
lookup      ns, keys                                                lease (0 = none), blocks [[off, n, tokens]]
release     leases [ids], reply (bool, v2; default True)            released (no reply at all when reply=False)
reserve     ns, keys, nbytes, tokens                                res (0 = none), slots [off | None]
commit      res, reply (bool, v3; default True)                     published (no reply when reply=False: the
                                                                    outcome rides on the next reply, ``commits``)
abort       res                                                     (nothing)
stats       (nothing)                                               stats (the server's counters)
ping        (nothing)                                               (nothing)
discard     ns, keys (blocks whose checksum failed on load)         dropped (the server verifies each first)
==========  =====================================================  ===========================================

Versions: a client says its ``v`` in ``hello`` and the server answers with
the same ``v`` when it serves it (:data:`SUPPORTED_VERSIONS`).  Version 2 adds
one thing: ``release`` with ``"reply": False`` is *one-way* — the server acts
on it and sends nothing back, so a hit costs one waited round trip (``lookup``,
then the lease's release goes out without waiting; it is done before the
connection's next request is read, as frames are handled in order).  A
version-1 client never sends it and gets every reply as before.

Version 3 adds a *pipelined* ``commit`` (``"reply": False``): the client
writes a reservation's blocks, sends the commit and goes on without waiting
(an insert costs one waited round trip, the reserve).  The server handles it
in order, before the connection's next request, exactly as a waited commit
(a block is published only then, after its bytes were written; a connection
that closes first aborts it), and puts its outcome on the next reply it
sends on that connection, whatever the op::

    "commits": [[res, published, code | None], ...]     (code: the error's, when it failed)

so a pipelined commit is *acknowledged* (durable in ``--pool-file``, written
through to the tier below) when the reply that carries it arrives; a
``ping`` waits for every one sent before it.  At most
:data:`MAX_DEFERRED_COMMITS` outcomes wait for a reply; past that the oldest
are dropped and counted (``"commits_dropped": n`` on the reply).

The connection is the owner of its leases (pinned READY blocks) and
reservations (WRITING blocks): when it closes, for any reason, the server
drops its pins and aborts its reservations, so a client killed at any point
never leaves a half-written block visible nor a block pinned forever.

Nothing here unpickles: msgpack decodes only maps, lists, ints, floats,
strings, bytes, bools and None, with size limits on each (a hostile or broken
peer gets an error, never code execution).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from typing import Any, Dict, List, Optional, Tuple

from cxlalloc.kvstore.handles import close_fds

PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)  # hello versions a server serves (2: one-way release; 3: pipelined commit)
MAX_DEFERRED_COMMITS = 4096    # pipelined commits' outcomes one connection keeps for its next reply
MAX_FRAME = 64 << 20           # bytes of one message (a lookup of 65536 keys is ~2.4 MiB)
MAX_KEYS = 65536               # keys in one lookup/reserve
MAX_NS_CHARS = 256             # a namespace (cache_salt) name
DEFAULT_SOCKET = "/run/cxlalloc/kv.sock"
SUN_PATH_MAX = 107             # bytes of a unix socket path (sockaddr_un.sun_path minus the NUL)
_LEN = struct.Struct("!I")

OPS = ("hello", "lookup", "release", "reserve", "commit", "abort", "stats", "ping", "discard")


class ProtocolError(Exception):
    """The peer sent something that is not this protocol (the connection is closed)."""


class LimitError(ProtocolError):
    """A request over one of the kv-server's decoding limits (the connection is closed).

    Attributes:
        limit: ``"max_items"`` (``--max-items``) or ``"max_objects"`` (``--max-objects``).
    """

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class ConnectionClosed(ProtocolError):
    """The peer closed the connection (EOF)."""


class RemoteError(Exception):
    """The server answered a request with an error.

    Attributes:
        code: ``bad_request``, ``too_large``, ``limit``, ``unknown_op``, ``denied``, ``internal``.
    """

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _msgpack():
    try:
        import msgpack
    except ImportError as e:  # pragma: no cover - msgpack is a dependency of the kvserver extra
        from cxlalloc.extras import install_hint
        raise ImportError(f"cxlalloc kv-server protocol needs msgpack: {install_hint('kvserver')}") from e
    return msgpack


def encode(msg: Dict[str, Any], yield_every: int = 0) -> bytes:
    """One frame: the length prefix and the msgpack body of ``msg``.

    ``yield_every``: pack the map's top-level lists this many elements at a
    time, letting other threads run between slices (the kv-server's replies
    of 65,536 blocks; the bytes are the same as one ``packb``)."""
    if yield_every and any(isinstance(v, list) and len(v) > yield_every for v in msg.values()):
        import time

        pk = _msgpack().Packer(use_bin_type=True)
        parts = [pk.pack_map_header(len(msg))]
        for k, v in msg.items():
            parts.append(pk.pack(k))
            if isinstance(v, list) and len(v) > yield_every:
                parts.append(pk.pack_array_header(len(v)))
                for i in range(0, len(v), yield_every):
                    if i:
                        time.sleep(0)
                    parts.append(b"".join(map(pk.pack, v[i:i + yield_every])))
            else:
                parts.append(pk.pack(v))
        body = b"".join(parts)
    else:
        body = _msgpack().packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a message of {len(body)} bytes exceeds the protocol's {MAX_FRAME} bytes")
    return _LEN.pack(len(body)) + body


class _TooManyObjects(Exception):
    pass


class _TooManyItems(Exception):
    pass


# What one decoded request may hold on the kv-server (``decode(..., max_items=...)``): a request's
# strings are an op, a namespace (MAX_NS_CHARS) and a client name; its bins are 32-byte keys.
SERVER_MAX_STR = 4096          # characters of one string
SERVER_MAX_BIN = 4096          # bytes of one bin
SERVER_MAX_MAP = 64            # pairs of one map
DEFAULT_MAX_ITEMS = MAX_KEYS + 1024   # elements of all lists and maps of one request (--max-items)


def decoded_bound(nbytes: int, max_items: int) -> int:
    """An upper estimate of the Python memory (bytes) a frame body of
    ``nbytes`` decodes to under :func:`decode`'s server limits: the bytes of
    its strings and bins, one 8-byte reference per element, and one object
    header (<= 72 bytes) per element that is not a shared constant (such an
    element takes at least 2 bytes of the frame)."""
    m = min(int(max_items), int(nbytes))
    return int(nbytes) + 8 * m + 72 * min(m, int(nbytes) // 2)


def _decode_in_slices(body, sizes, hooks, seen, cap, items, every: int):
    """A request map whose top-level lists are decoded ``every`` elements at a
    time, releasing the GIL between slices (``time.sleep(0)``), so one
    65,536-key request never holds the interpreter for its whole decode.
    Same limits as one ``unpackb``; the map and lists read here count too."""
    import time

    msgpack = _msgpack()
    up = msgpack.Unpacker(None, raw=False, use_list=True, strict_map_key=True, max_buffer_size=len(body) or 1,
                          max_array_len=MAX_KEYS + 16, max_ext_len=0, **sizes, **hooks)
    up.feed(body)

    def container(n):
        seen[0] += 1
        seen[1] += n
        if seen[0] > cap:
            raise _TooManyObjects()
        if seen[1] > items:
            raise _TooManyItems()

    def header(read):
        try:
            return read()
        except ValueError as e:  # msgpack: "Unexpected type header on stream" (nothing consumed)
            if "Unexpected type" in str(e):
                return None
            raise

    npairs = header(up.read_map_header)
    if npairs is None:
        return up.unpack()  # not a map: the caller says so
    container(npairs)
    msg = {}
    for _ in range(npairs):
        k = up.unpack()
        if not isinstance(k, (str, bytes)):
            raise ValueError("a map key must be a string")
        n = header(up.read_array_header)
        if n is None:
            msg[k] = up.unpack()
            continue
        container(n)
        v = []
        for i in range(n):
            if i and not i % every:
                time.sleep(0)
            v.append(up.unpack())
        msg[k] = v
    if up.tell() != len(body):
        raise ValueError("extra data after the message")
    return msg


def decode(body, max_containers: Optional[int] = None, max_items: Optional[int] = None,
           yield_every: int = 0) -> Dict[str, Any]:
    """The message in a frame body (bytes-like; not copied); ProtocolError when it is not a msgpack map.

    Args:
        max_containers: if given, at most this many maps and lists in the
            message (the kv-server's ``--max-objects``): a frame of nested
            empty lists is refused after that many, instead of building one
            Python list per byte (ProtocolError naming the limit).
        max_items: if given (the kv-server, ``--max-items``), the decoded
            message is bounded in objects and bytes, not only in containers:
            at most this many elements in all its lists and maps together
            (counted as each container is built, so a frame of 2.8 M short
            strings stops after two lists of at most MAX_KEYS + 16), strings
            of at most SERVER_MAX_STR characters, bins of at most
            SERVER_MAX_BIN bytes, maps of at most SERVER_MAX_MAP pairs.
        yield_every: with ``max_items``, decode the request's top-level lists
            this many elements at a time, letting other threads run between
            slices (the kv-server's fair service, ``--slice-keys``).
    """
    hooks = {}
    seen = [0, 0]
    cap = max_containers if max_containers is not None else 1 << 62
    items = max_items if max_items is not None else 1 << 62
    if max_containers is not None or max_items is not None:
        def count(obj):
            seen[0] += 1
            seen[1] += len(obj)
            if seen[0] > cap:
                raise _TooManyObjects()
            if seen[1] > items:
                raise _TooManyItems()
            return obj

        hooks = {"list_hook": count, "object_hook": count}
    if max_items is not None:
        sizes = dict(max_bin_len=SERVER_MAX_BIN, max_str_len=SERVER_MAX_STR, max_map_len=SERVER_MAX_MAP)
    else:
        sizes = dict(max_bin_len=MAX_FRAME, max_str_len=1 << 20, max_map_len=4096)
    try:
        if max_items is not None and yield_every:
            msg = _decode_in_slices(body, sizes, hooks, seen, cap, items, yield_every)
        else:
            msg = _msgpack().unpackb(body, raw=False, use_list=True, strict_map_key=True,
                                     max_array_len=MAX_KEYS + 16, max_ext_len=0, **sizes, **hooks)
    except _TooManyObjects:
        raise LimitError(f"a message holds more than {max_containers} maps and lists (--max-objects)",
                         "max_objects") from None
    except _TooManyItems:
        raise LimitError(f"a message holds more than {max_items} elements in its lists and maps together "
                         "(--max-items)", "max_items") from None
    except ValueError as e:
        if max_items is not None and "exceeds max_" in str(e):
            raise ProtocolError(f"not a kv-server request: {e} (strings hold at most {SERVER_MAX_STR} characters, "
                                f"bins {SERVER_MAX_BIN} bytes, maps {SERVER_MAX_MAP} pairs, lists "
                                f"{MAX_KEYS + 16} elements)") from None
        raise ProtocolError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    except Exception as e:
        raise ProtocolError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be a map, not {type(msg).__name__}")
    return msg


def send_msg(sock: socket.socket, msg: Dict[str, Any], fds: Optional[List[int]] = None,
             yield_every: int = 0) -> None:
    """Send one message (and ``fds`` with its first byte, by SCM_RIGHTS); ``yield_every``: see :func:`encode`."""
    frame = encode(msg, yield_every)
    if fds:
        sent = socket.send_fds(sock, [frame], list(fds))
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _recv_into(sock: socket.socket, buf: bytearray, got: int = 0) -> None:
    """Fill ``buf[got:]`` from the socket."""
    view = memoryview(buf)
    while got < len(buf):
        k = sock.recv_into(view[got:], len(buf) - got)
        if k == 0:
            raise ConnectionClosed("the peer closed the connection")
        got += k


_NO_WAIT = object()


def recv_msg(sock: socket.socket, max_fds: int = 0, wait=_NO_WAIT) -> Tuple[Dict[str, Any], List[int]]:
    """Receive one message; returns ``(msg, fds)`` (fds only when ``max_fds``).

    Args:
        wait: seconds to wait for the message's first byte (None: for ever;
            default: the socket's timeout); the rest of the message must come
            within the socket's own timeout.

    Raises:
        ConnectionClosed: EOF before a whole message.
        ProtocolError: a frame larger than MAX_FRAME, or a body that is not a map.
        socket.timeout / OSError: from the socket.
    """
    fds: List[int] = []
    head = bytearray()
    own = sock.gettimeout()
    if wait is not _NO_WAIT:
        sock.settimeout(wait)
    try:
        if max_fds:
            data, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, max_fds)
        else:
            data = sock.recv(_LEN.size)
    finally:
        if wait is not _NO_WAIT:
            sock.settimeout(own)
    if not data:
        close_fds(fds)
        raise ConnectionClosed("the peer closed the connection")
    head += data
    try:
        if len(head) < _LEN.size:
            have = len(head)
            head += bytearray(_LEN.size - have)
            _recv_into(sock, head, have)
        (n,) = _LEN.unpack(bytes(head))
        if n > MAX_FRAME:
            raise ProtocolError(f"a frame of {n} bytes exceeds the protocol's {MAX_FRAME} bytes")
        body = bytearray(n)
        if n:
            _recv_into(sock, body)
        return decode(bytes(body)), fds
    except BaseException:
        close_fds(fds)
        raise


def peer_credentials(sock: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


MAX_TIMEOUT_S = 1e9                # the longest timeout in seconds (~31 years): socket.settimeout and
                                   # threading waits overflow time_t near 9.2e9 s, and inf is no number of seconds


def check_seconds(value, option: str, allow_zero: bool = False) -> float:
    """``value`` as a timeout in seconds: a finite number in (0, MAX_TIMEOUT_S] ([0, ...] with ``allow_zero``).

    Raises:
        ValueError: naming ``option`` and the allowed range (NaN, inf, negative, zero when not allowed,
            above MAX_TIMEOUT_S, not a number).
    """
    try:
        s = float(value)
    except (TypeError, ValueError):
        s = float("nan")
    low_ok = s >= 0 if allow_zero else s > 0
    if not (low_ok and s <= MAX_TIMEOUT_S):  # also false for NaN; inf is above MAX_TIMEOUT_S
        allowed = f"[0, {MAX_TIMEOUT_S:g}] seconds (0: none)" if allow_zero else f"(0, {MAX_TIMEOUT_S:g}] seconds"
        raise ValueError(f"cxlalloc option '{option}': {value!r} must be a finite number of seconds in {allowed}")
    return s


def socket_path_from_url(url: str, option: str = "kv_store") -> str:
    """The socket path of ``unix:///path/kv.sock`` (or ``unix://relative/kv.sock``).

    Raises:
        ValueError: not a unix:// URL, an empty path, or a path longer than a
            unix socket address allows (107 bytes), naming ``option``.
    """
    if not isinstance(url, str) or not url.startswith("unix://"):
        raise ValueError(f"cxlalloc option '{option}': {url!r} is not a kv-server address; use "
                         "'unix:///path/to/kv.sock' (the --socket of `cxlalloc kv-server`)")
    path = url[len("unix://"):].split("?", 1)[0]
    return check_socket_path(path, option)


def check_socket_path(path: str, option: str = "--socket") -> str:
    """Validate a unix socket path (non-empty, no NUL, at most 107 bytes)."""
    if not path:
        raise ValueError(f"cxlalloc option '{option}': the socket path is empty; use e.g. '{DEFAULT_SOCKET}'")
    if "\0" in path:
        raise ValueError(f"cxlalloc option '{option}': {path!r} contains a NUL byte")
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise ValueError(f"cxlalloc option '{option}': {path!r} is {len(os.fsencode(path))} bytes; a unix socket "
                         f"path holds at most {SUN_PATH_MAX} bytes (use a shorter directory, e.g. /run/cxlalloc)")
    return path


def url_query(url: str) -> Dict[str, str]:
    """``?a=1&b=2`` of a URL as a dict (last value wins)."""
    if "?" not in url:
        return {}
    out = {}
    for part in url.split("?", 1)[1].split("&"):
        if part:
            k, _, v = part.partition("=")
            out[k] = v
    return out


def is_one_way(msg: Dict[str, Any], version: int = PROTOCOL_VERSION) -> bool:
    """True for a request the server must not answer on a connection speaking ``version``: ``release`` with
    ``reply: False`` (v2 and later), ``commit`` with ``reply: False`` (v3 and later)."""
    if msg.get("reply") is not False:
        return False
    op = msg.get("op")
    return (op == "release" and version >= 2) or (op == "commit" and version >= 3)


# ----------------------------------------------------------------- request checks (server side)
def check_ns(v) -> str:
    if not isinstance(v, str) or len(v) > MAX_NS_CHARS:
        raise RemoteError("bad_request", f"'ns' must be a string of at most {MAX_NS_CHARS} characters")
    return v


def check_keys(v) -> List[bytes]:
    if not isinstance(v, list) or len(v) > MAX_KEYS:
        raise RemoteError("bad_request", f"'keys' must be a list of at most {MAX_KEYS} keys")
    for k in v:
        if not isinstance(k, bytes) or len(k) != 32:
            raise RemoteError("bad_request", "each key must be 32 bytes (cxlalloc.kvstore.keys)")
    return v


def check_int(msg: dict, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = msg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RemoteError("bad_request", f"'{name}' must be an int in [{lo}, {hi}], not {v!r}")
    return v


def fd_is_shared_memory(fd: int) -> bool:
    """True when ``fd`` is a non-empty regular file (what a pool fd must be)."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        if e.errno == errno.EBADF:
            return False
        raise
    import stat

    return stat.S_ISREG(st.st_mode) and st.st_size > 0


__all__ = ["PROTOCOL_VERSION", "SUPPORTED_VERSIONS", "MAX_DEFERRED_COMMITS", "is_one_way", "MAX_FRAME", "MAX_KEYS", "OPS", "ProtocolError", "ConnectionClosed", "RemoteError",
           "encode", "decode", "send_msg", "recv_msg", "peer_credentials", "socket_path_from_url",
           "check_socket_path", "url_query"]
