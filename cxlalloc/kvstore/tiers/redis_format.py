"""The Redis tier's value format, its URL options and its MAC key file (no I/O beyond reading the key file).

A value is ``header + block bytes [+ MAC]``: the header holds a magic, a
version, flags, the namespaced key, the length and a CRC-32
(:func:`pack_value`, :func:`value_problem`); with a key file a keyed
BLAKE2b-256 MAC over header and bytes follows (:func:`read_key_file`).
URLs are checked and redacted here (:func:`check_url`, :func:`redact_url`,
:func:`split_url_options`).  :mod:`cxlalloc.kvstore.tiers.redis` uses them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import zlib
from typing import List, Optional
from urllib.parse import unquote, urlsplit, urlunsplit

_MAGIC = b"CXKV"
_VERSION = 1
_HEADER = struct.Struct("!4sHH32sQI")  # magic, version, flags, namespaced key, nbytes, crc32
HEADER_BYTES = _HEADER.size
FLAG_MAC = 1  # a MAC_BYTES keyed BLAKE2b of header + bytes follows the bytes
# flags >> 1: the tokens the block holds (0 = not recorded: values of older versions), so a block restored from
# Redis reports its tokens in hit_tokens; readers that know only FLAG_MAC ignore these bits.
MAX_TOKENS = 0x7FFF
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
MAC_BYTES = 32
MIN_KEY_BYTES = 16


def _mac(mac_key: bytes, header: bytes, data) -> bytes:
    h = hashlib.blake2b(key=mac_key, digest_size=MAC_BYTES, person=b"cxlalloc-kv-mac")
    h.update(header)
    h.update(data)
    return h.digest()


def pack_value(nskey: bytes, data, mac_key: Optional[bytes] = None, tokens: int = 0) -> bytes:
    """The Redis value of block ``nskey``: header, bytes, and with ``mac_key`` a MAC.
    ``tokens`` (0 to 32767; the tokens the block holds) rides in the header's
    flags (covered by the MAC); :func:`value_tokens` reads it back."""
    data = bytes(data)
    flags = (FLAG_MAC if mac_key else 0) | (min(max(int(tokens), 0), MAX_TOKENS) << 1)
    header = _HEADER.pack(_MAGIC, _VERSION, flags, nskey, len(data), zlib.crc32(data))
    return header + data + (_mac(mac_key, header, data) if mac_key else b"")


def unpack_value(nskey: bytes, value: Optional[bytes], mac_key: Optional[bytes] = None) -> Optional[bytes]:
    """The block bytes of a stored value, or None when it is not a whole,
    intact value of this key, or (with ``mac_key``) has no valid MAC under
    that key (raises nothing; :func:`value_problem` says which)."""
    return None if value_problem(nskey, value, mac_key) else value[HEADER_BYTES:HEADER_BYTES + _length(value)]


def _length(value: bytes) -> int:
    return _HEADER.unpack_from(value)[4]


def value_tokens(value: bytes) -> int:
    """The tokens recorded in a sound value's header (0: not recorded)."""
    return _HEADER.unpack_from(value)[2] >> 1


def is_cluster_url(url: str) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://`` URLs."""
    return isinstance(url, str) and url.split("://", 1)[0] in CLUSTER_SCHEMES


def plain_url(url: str) -> str:
    """``redis+cluster://h:p`` -> ``redis://h:p`` (what redis-py parses)."""
    scheme, rest = url.split("://", 1)
    return scheme.replace("+cluster", "") + "://" + rest


def value_problem(nskey: bytes, value: Optional[bytes], mac_key: Optional[bytes] = None) -> Optional[str]:
    """None for a sound value of ``nskey``; else ``"missing"``, ``"bad"``
    (truncated, foreign, another key's, CRC wrong) or ``"forged"`` (a key is
    set and the MAC is absent or wrong)."""
    if value is None:
        return "missing"
    if len(value) < HEADER_BYTES:
        return "bad"
    magic, version, flags, key, n, crc = _HEADER.unpack_from(value)
    tail = MAC_BYTES if flags & FLAG_MAC else 0
    if magic != _MAGIC or version != _VERSION or key != nskey or len(value) - HEADER_BYTES - tail != n:
        return "bad"
    data = memoryview(value)[HEADER_BYTES:HEADER_BYTES + n]
    if zlib.crc32(data) != crc:
        return "bad"
    if mac_key is not None:
        if not tail or not hmac.compare_digest(_mac(mac_key, value[:HEADER_BYTES], data), value[HEADER_BYTES + n:]):
            return "forged"
    return None


def read_key_file(path: str, option: str = "--redis-key-file") -> bytes:
    """The MAC key in ``path`` (its bytes, a trailing newline dropped).

    Raises:
        ValueError: naming ``option``: the file cannot be read, is readable or
            writable by group or others (allowed: mode 0600 or 0400), or holds
            fewer than 16 bytes.
    """
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            key = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise ValueError(f"cxlalloc option '{option}': cannot read {path!r}: {e.strerror}") from None
    if st.st_mode & 0o077:
        raise ValueError(f"cxlalloc option '{option}': {path!r} has mode {st.st_mode & 0o777:04o}; a MAC key file "
                         "must be readable by its owner only (chmod 600)")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"cxlalloc option '{option}': {path!r} holds {len(key)} bytes; a MAC key needs at least "
                         f"{MIN_KEY_BYTES} (e.g. head -c 32 /dev/urandom > {path})")
    return key[:64]  # BLAKE2b takes keys of up to 64 bytes


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (for logs and stats)."""
    try:
        u = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if u.password is None:
        return url
    user = u.username or ""
    host = u.hostname or ""
    if u.port:
        host = f"{host}:{u.port}"
    return urlunsplit((u.scheme, f"{user}:***@{host}", u.path, u.query, u.fragment))


def check_url(url, option: str = "--redis") -> str:
    """Validate a ``redis://`` / ``rediss://`` URL, or a cluster's
    ``redis+cluster://`` / ``rediss+cluster://`` (database 0 or none).

    Raises:
        ValueError: naming ``option``, for another scheme, no host, or a bad port/db.
    """
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "redis+cluster://",
                                                       "rediss+cluster://")):
        raise ValueError(f"cxlalloc option '{option}': {url!r} is not a Redis URL; use 'redis://host:port/db' "
                         "or 'rediss://host:port/db' (TLS), with 'user:password@' for AUTH, or for a Redis/Valkey "
                         "Cluster 'redis+cluster://host:port' ('rediss+cluster://' for TLS; any node as the seed)")
    try:
        u = urlsplit(url)
        _ = u.port
    except ValueError as e:
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: {e}") from None
    if not u.hostname:
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r} has no host; use 'redis://host:port/db'")
    db = u.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: the database must be a number "
                         "('redis://host:port/0')")
    if db not in ("", "0") and is_cluster_url(url):
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: a cluster has database 0 only; use "
                         "'redis+cluster://host:port'")
    return url


OWN_URL_OPTIONS = ("prefix", "ttl", "queue", "redis_key_file", "tenant")


def split_url_options(url: str):
    """(url without cxlalloc's own query options, {prefix, ttl, queue}); the
    other query options (ssl_ca_certs=..., socket_timeout=...) stay for redis-py."""
    u = urlsplit(url)
    if not u.query:
        return url, {}
    keep, ours = [], {}
    for part in u.query.split("&"):
        k, _, v = part.partition("=")
        if k in OWN_URL_OPTIONS:
            ours[k] = unquote(v)
        elif part:
            keep.append(part)
    return urlunsplit((u.scheme, u.netloc, u.path, "&".join(keep), u.fragment)), ours


def cache_config_warnings(url: str, cfg: dict) -> List[str]:
    """The warnings for a Redis at ``url`` (redacted) whose ``CONFIG GET maxmemory*``
    answer is ``cfg``: ``maxmemory-policy noeviction`` (writes fail once full) and
    no ``maxmemory`` (it grows until the machine runs out); [] for a cache."""
    out: List[str] = []
    if str(cfg.get("maxmemory-policy", "")).lower() == "noeviction":
        out.append(f"cxlalloc kv: Redis {url} has maxmemory-policy noeviction: once full, every write of "
                   "an evicted block fails; configure it as a cache (e.g. allkeys-lru)")
    if str(cfg.get("maxmemory", "0")) in ("0", ""):
        out.append(f"cxlalloc kv: Redis {url} has no maxmemory: it grows with every block until the "
                   "machine runs out; set maxmemory (and an allkeys-* maxmemory-policy)")
    return out
