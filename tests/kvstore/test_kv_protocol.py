"""The kv-server wire format: frames, limits, fd passing, URLs (no server)."""

import os
import socket
import struct

import pytest

from cxlalloc.kvstore import protocol as P


def test_roundtrip_keeps_bytes_strings_ints_none():
    a, b = socket.socketpair()
    msg = {"op": "lookup", "ns": "tenant-ä", "keys": [b"\x00" * 32, b"\xff" * 32], "n": 1 << 40, "x": None}
    P.send_msg(a, msg)
    got, fds = P.recv_msg(b)
    assert got == msg and fds == []


def test_fd_travels_with_the_message():
    a, b = socket.socketpair()
    r, w = os.pipe()
    P.send_msg(a, {"op": "hello"}, fds=[w])
    got, fds = P.recv_msg(b, max_fds=2)
    assert got == {"op": "hello"} and len(fds) == 1
    os.write(fds[0], b"x")
    assert os.read(r, 1) == b"x"
    for fd in (r, w, fds[0]):
        os.close(fd)


def test_oversized_and_malformed_frames_are_protocol_errors():
    a, b = socket.socketpair()
    a.sendall(struct.pack("!I", P.MAX_FRAME + 1))
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.recv_msg(b)
    a, b = socket.socketpair()
    body = b"\x93\x01\x02\x03"  # a msgpack list, not a map
    a.sendall(struct.pack("!I", len(body)) + body)
    with pytest.raises(P.ProtocolError, match="must be a map"):
        P.recv_msg(b)
    a, b = socket.socketpair()
    body = b"\xc1garbage"
    a.sendall(struct.pack("!I", len(body)) + body)
    with pytest.raises(P.ProtocolError, match="not a msgpack"):
        P.recv_msg(b)


def test_ext_types_are_refused_never_decoded():
    import msgpack

    body = msgpack.packb({"op": msgpack.ExtType(1, b"\x80\x04N.")})  # what a pickle smuggler would send
    with pytest.raises(P.ProtocolError):
        P.decode(body)


def test_eof_mid_frame_is_connection_closed():
    a, b = socket.socketpair()
    a.sendall(struct.pack("!I", 100) + b"abc")
    a.close()
    with pytest.raises(P.ConnectionClosed):
        P.recv_msg(b)


def test_urls_and_socket_paths():
    assert P.socket_path_from_url("unix:///run/cxlalloc/kv.sock") == "/run/cxlalloc/kv.sock"
    assert P.socket_path_from_url("unix:///tmp/kv.sock?timeout=2") == "/tmp/kv.sock"
    assert P.url_query("unix:///tmp/kv.sock?timeout=2&fallback=64MiB") == {"timeout": "2", "fallback": "64MiB"}
    with pytest.raises(ValueError, match="'kv_store'.*unix:///path"):
        P.socket_path_from_url("tcp://127.0.0.1:9000")
    with pytest.raises(ValueError, match="at most 107 bytes"):
        P.check_socket_path("/tmp/" + "x" * 200)
    with pytest.raises(ValueError, match="empty"):
        P.socket_path_from_url("unix://")


def test_request_checks_name_the_field():
    with pytest.raises(P.RemoteError, match="32 bytes"):
        P.check_keys([b"short"])
    with pytest.raises(P.RemoteError, match="'ns'"):
        P.check_ns(7)
    with pytest.raises(P.RemoteError, match="'nbytes'"):
        P.check_int({"nbytes": -1}, "nbytes", 1)


def test_the_server_dispatches_every_op_of_the_protocol_by_its_table():
    """The transport answers every op of ``P.OPS`` ("hello" first, the others through its table) and no other."""
    from cxlalloc.kvstore.server.transport import Transport

    assert set(Transport.OPS) | {"hello"} == set(P.OPS)
    assert all(fn.__name__ == f"_op_{op}" for op, fn in Transport.OPS.items())
