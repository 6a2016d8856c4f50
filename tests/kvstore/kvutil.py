"""Helpers of the kv-server tests: a tiny random Llama (no download), prompts
that share a document, generate() with reuse stats, raw protocol clients."""

from __future__ import annotations

import os
import socket

from tests.helpers.net import free_port  # noqa: F401  (re-exported: the kvstore tests import it from here)

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def subprocess_env():
    """The environment of a child process: this checkout first on the path, no CXLALLOC."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CXLALLOC", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tiny_llama(layers=3, seed=0, hidden=64, heads=4, kv_heads=2, vocab=1000):
    """The tests' tiny Llama (:func:`tests.helpers.hf_util.tiny_llama`: seeded, eval, sdpa, one
    torch thread) with this folder's default of 3 layers; imported here so this module needs no torch."""
    from tests.helpers.hf_util import tiny_llama as build

    return build(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, seed=seed)


def prompts(doc_tokens=70, n=2, seed=1):
    """``n`` prompts sharing one document of ``doc_tokens`` tokens, each with its own question."""
    import torch

    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, 1000, (1, doc_tokens), generator=g)
    return [torch.cat([doc, torch.randint(3, 1000, (1, 5 + i), generator=g)], 1) for i in range(n)]


def generate(model, prompt, new=8):
    import cxlalloc.hf as hf

    out = model.generate(prompt, max_new_tokens=new, do_sample=False)
    return out, hf.stats(model)["hf"]["reuse"]


class RawClient:
    """A protocol-level client (no torch mapping): for crash and bad-input tests."""

    def __init__(self, path, want_fd=True, timeout=5.0, name="raw"):
        from cxlalloc.kvstore import protocol as P

        self.P = P
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        P.send_msg(self.sock, {"op": "hello", "v": P.PROTOCOL_VERSION, "pid": os.getpid(), "want_fd": want_fd,
                               "name": name})
        self.hello, fds = P.recv_msg(self.sock, max_fds=2)
        self.fd = fds[0] if fds else None

    def call(self, op, **kw):
        self.P.send_msg(self.sock, dict(op=op, **kw))
        reply, _ = self.P.recv_msg(self.sock)
        return reply

    def mapping(self):
        import mmap

        return mmap.mmap(self.fd, self.hello["mapped"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self):
        self.sock.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def key(i: int, tag: bytes = b"k") -> bytes:
    import hashlib

    return hashlib.blake2b(tag + i.to_bytes(8, "little"), digest_size=32).digest()
