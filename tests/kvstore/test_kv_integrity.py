"""Integrity of stored K/V: a checksum per block verified on every load (in
the in-process store and a real kv-server's shared pool, a byte flipped
through a second mapping), and Redis values authenticated with a keyed MAC
against a real redis-server (forged values: a valid header and CRC over other
K/V)."""

import os
import zlib

import pytest
import torch

import cxlalloc.hf as hf
from cxlalloc.hf.reuse import KVReuseWarning
from cxlalloc.hf.wrap import _state
from cxlalloc.kvstore import keys as K
from cxlalloc.kvstore.layout import CHECKSUM_BYTES, block_checksum, verify_stored
from cxlalloc.kvstore.keys import namespaced_key
from cxlalloc.kvstore.tiers.redis import _HEADER, HEADER_BYTES, RedisTier, pack_value
from tests.kvstore.kvutil import RawClient, key, prompts, tiny_llama

BT = 8
BLOCK = 64 << 10


def _wrap(m, store):
    # kv_conversation_limit=0: a repeated prompt must come from the block store (what these tests check), not from
    # the last conversation's cache the wrapped model would otherwise continue
    hf.wrap(m, device_limit="256MiB", host_limit="512MiB", kv_store=store, block_tokens=BT, kv_conversation_limit=0)
    return m


def _gen(m, p):
    out = m.generate(p, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    return out, hf.stats(m)["hf"]["reuse"]


def _keys(m, p):
    reuse = _state(m).reuse
    return K.chain_keys(reuse.root(None), p[0], BT)


def test_block_checksum_binds_key_and_bytes():
    payload = bytes(range(256)) * 16
    raw = bytearray(payload + block_checksum(b"k" * 32, payload))
    assert len(raw) == len(payload) + CHECKSUM_BYTES and verify_stored(raw, b"k" * 32)
    assert not verify_stored(raw, b"j" * 32)  # the same bytes under another key
    raw[100] ^= 1
    assert not verify_stored(raw, b"k" * 32)


def test_a_flipped_bit_in_the_in_process_store_is_caught_dropped_and_recomputed(fresh_sim):
    p = prompts(doc_tokens=40, n=1)[0]
    m, ref = _wrap(tiny_llama(), True), tiny_llama()
    _gen(m, p)
    store = _state(m).reuse.store
    ks = _keys(m, p)
    with store.lookup("", ks) as lease:
        assert lease.blocks >= 5
        lease.views[2][123] ^= 0x10  # one bit of block 2, as a stray write would
    with pytest.warns(KVReuseWarning, match="failed their checksum on load"):
        out, st = _gen(m, p)
    assert st["last"]["hit_tokens"] == 2 * BT  # the blocks before the bad one
    assert st["counters"]["corrupt_blocks"] == 1 and st["store"]["corrupt_blocks"] == 1
    assert torch.equal(out, ref.generate(p, max_new_tokens=6, min_new_tokens=6, do_sample=False))
    out, st = _gen(m, p)  # the dropped block was written again from the recompute
    assert st["last"]["hit_tokens"] == 40 and st["counters"]["corrupt_blocks"] == 1
    assert torch.equal(out, ref.generate(p, max_new_tokens=6, min_new_tokens=6, do_sample=False))


def test_a_flipped_byte_in_the_kv_server_pool_is_caught_on_load(kv_server, fresh_sim):
    srv = kv_server()
    p = prompts(doc_tokens=40, n=1)[0]
    m, ref = _wrap(tiny_llama(), srv.url), tiny_llama()
    _gen(m, p)
    ks = _keys(m, p)
    other = RawClient(srv.socket_path, name="buggy")  # another client, its own read-write mapping
    reply = other.call("lookup", ns="", keys=ks)
    off, n, _ = reply["blocks"][1]
    other.call("release", leases=[reply["lease"]])
    mm = other.mapping()
    mm[off + 7] ^= 0xFF
    assert other.call("discard", ns="", keys=[ks[0]])["dropped"] == 0  # a sound block is never dropped
    with pytest.warns(KVReuseWarning, match="failed their checksum on load"):
        out, st = _gen(m, p)
    assert st["last"]["hit_tokens"] == BT and st["counters"]["corrupt_blocks"] == 1
    assert srv.stats()["server"]["corrupt_blocks"] == 1
    assert torch.equal(out, ref.generate(p, max_new_tokens=6, min_new_tokens=6, do_sample=False))
    out, st = _gen(m, p)
    assert st["last"]["hit_tokens"] == 40
    mm.close()
    other.close()


def test_verification_can_be_turned_off_and_bad_values_name_the_option(fresh_sim):
    with pytest.raises(ValueError, match="kv_store_verify.*allowed: True, False"):
        hf.wrap(tiny_llama(), device_limit="256MiB", host_limit="512MiB", kv_store=True, kv_store_verify="yes")


# ------------------------------------------------------------------ Redis MAC
def _key_file(tmp_path, mode=0o600, data=b"0123456789abcdef0123456789abcdef"):
    path = tmp_path / "redis.key"
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def _forge(nskey, data):
    """A value with a valid header and CRC over other K/V: what any writer of the database can make."""
    return _HEADER.pack(b"CXKV", 1, 0, nskey, len(data), zlib.crc32(data)) + data


def test_forged_values_are_refused_with_a_key_and_accepted_without(redis_server, tmp_path):
    rs = redis_server()
    r = rs.client()
    kf = _key_file(tmp_path)
    t = RedisTier(rs.url, key_file=kf)
    plain = RedisTier(rs.url)
    k = key(1)
    rk = t.prefix + namespaced_key("", k).hex()
    good = os.urandom(BLOCK)
    t.put(k, "", good)
    t.flush(5)
    assert t.get_many([k]) == [good] and t.stats()["authenticated"]
    assert plain.get_many([k]) == [good]  # a keyless reader still reads it (CRC checked)
    evil = os.urandom(BLOCK)
    r.set(rk, _forge(namespaced_key("", k), evil))
    assert plain.get_many([k]) == [evil]  # without a key: injected (the threat model's first line)
    assert t.get_many([k]) == [None] and t.stats()["forged_values"] == 1
    r.set(rk, pack_value(namespaced_key("", k), evil, b"another key of 16+ bytes"))
    assert t.get_many([k]) == [None] and t.stats()["forged_values"] == 2
    with open(kf, "rb") as f:
        mac_ok = bytearray(pack_value(namespaced_key("", k), good, f.read()))
    mac_ok[HEADER_BYTES + 5] ^= 1  # bytes changed and the CRC recomputed by the forger: still refused
    r.set(rk, bytes(mac_ok))
    assert t.get_many([k]) == [None]
    assert t.stats()["bad_values"] + t.stats()["forged_values"] == 3
    t.close()
    plain.close()


def test_key_files_are_checked_and_the_url_option_reaches_an_in_process_store(redis_server, tmp_path, alloc):
    rs = redis_server()
    with pytest.raises(ValueError, match=r"'--redis-key-file'.*mode 0644.*chmod 600"):
        RedisTier(rs.url, key_file=_key_file(tmp_path, 0o644))
    with pytest.raises(ValueError, match=r"'--redis-key-file'.*holds 5 bytes"):
        RedisTier(rs.url, key_file=_key_file(tmp_path, data=b"short"))
    with pytest.raises(ValueError, match=r"'--redis-key-file'.*cannot read"):
        RedisTier(rs.url, key_file=str(tmp_path / "absent"))
    from cxlalloc.kvstore.server.cli import make_parser, server_from_args

    with pytest.raises(ValueError, match="'--redis-key-file': given without --redis"):
        server_from_args(make_parser().parse_args(["--size", "64MiB", "--socket", str(tmp_path / "s.sock"),
                                                   "--redis-key-file", _key_file(tmp_path)]))
    from cxlalloc.kvstore.open import open_store

    kf = _key_file(tmp_path)
    store = open_store(f"{rs.url}?redis_key_file={kf}", alloc(), limit=16 << 20)
    try:
        assert store.lower.stats()["authenticated"]
    finally:
        store.lower.close()
    with pytest.raises(ValueError, match=r"'kv_store \?redis_key_file'.*mode 0640"):
        open_store(f"{rs.url}?redis_key_file={_key_file(tmp_path, 0o640)}", alloc(), limit=16 << 20)
