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
    """The URL with its password replaced by ``***`` (for logs and stats); a cluster URL's seed list is kept."""
    try:
        u = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    userinfo, at, hosts = u.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit((u.scheme, f"{user}:***@{hosts}", u.path, u.query, u.fragment))


SINGLE_FORM = ("'redis://host:port/db' or 'rediss://host:port/db' (TLS), with 'user:password@' for AUTH, "
               "query options after '?'")
CLUSTER_FORM = ("'redis+cluster://host:port[,host:port...]' ('rediss+cluster://' for TLS; any nodes as seeds, "
                "database 0 only, 'user:password@' for AUTH, query options after '?')")
# cxlalloc's own query options (taken off the URL before redis-py sees it)
OWN_URL_OPTIONS = ("prefix", "ttl", "queue", "redis_key_file", "tenant")
# redis-py's own string-valued connection options given in a TLS URL (SSLConnection's keywords)
TLS_URL_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile",
                   "ssl_password", "ssl_ciphers", "ssl_check_hostname", "ssl_min_version",
                   "ssl_include_verify_flags", "ssl_exclude_verify_flags")


def url_options_allowed(url: str) -> List[str]:
    """The query options a Redis URL may carry: cxlalloc's own (:data:`OWN_URL_OPTIONS`), redis-py's
    (``redis.connection.URL_QUERY_ARGUMENT_PARSERS``: ``socket_timeout``, ``health_check_interval``, ...,
    and ``client_name``), and with ``rediss`` the TLS ones (:data:`TLS_URL_OPTIONS`).  A cluster has
    database 0 only: no ``db``."""
    try:
        from redis.connection import URL_QUERY_ARGUMENT_PARSERS as parsers
    except ImportError:  # redis-py is checked (and said to be missing) when the tier is made
        parsers = {}
    tls = url.split("://", 1)[0].startswith("rediss")
    names = list(OWN_URL_OPTIONS) + [n for n in parsers if tls or not n.startswith("ssl_")] + ["client_name"]
    names += [n for n in TLS_URL_OPTIONS if tls and n not in names]
    if is_cluster_url(url):
        names = [n for n in names if n != "db"]
    return names


def cluster_seeds(url: str, option: str = "--redis") -> List[tuple]:
    """The seed nodes ``[(host, port), ...]`` of a cluster URL ``redis+cluster://h1:p1,h2:p2,...``
    (IPv6 hosts in brackets; port 6379 when left out).

    Raises:
        ValueError: naming ``option`` and the cluster form, for an empty seed, a bad or out-of-range port.
    """
    u = urlsplit(url)
    hosts = u.netloc.rpartition("@")[2]
    seeds = []
    for part in hosts.split(","):
        part = part.strip()
        if part.startswith("["):
            host, _, rest = part[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ("" if not rest else None)
        else:
            host, _, port_text = part.partition(":")
        if not host or port_text is None:
            raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: seed {part!r} has no host; use "
                             f"{CLUSTER_FORM}")
        if port_text == "":
            port = 6379
        elif port_text.isdigit() and 1 <= int(port_text) <= 65535:
            port = int(port_text)
        else:
            raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: seed {part!r} has port "
                             f"{port_text!r}; allowed: 1..65535; use {CLUSTER_FORM}")
        seeds.append((host, port))
    return seeds


def first_seed_url(url: str) -> str:
    """A cluster URL with its first seed only (what redis-py's ``from_url`` parses; the others are given as
    ``startup_nodes``)."""
    u = urlsplit(url)
    userinfo, at, hosts = u.netloc.rpartition("@")
    return urlunsplit((u.scheme, userinfo + at + hosts.split(",")[0].strip(), u.path, u.query, u.fragment))


def check_url(url, option: str = "--redis") -> str:
    """Validate a ``redis://`` / ``rediss://`` URL, or a cluster's
    ``redis+cluster://h1:p1[,h2:p2...]`` / ``rediss+cluster://...`` (database 0 or none), and its query
    options (:func:`url_options_allowed`).

    Raises:
        ValueError: naming ``option`` and the form of the URL given (single server or cluster), for another
            scheme, no host, a bad port or db, an unknown query option (naming it and the allowed ones).
    """
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "redis+cluster://",
                                                       "rediss+cluster://")):
        raise ValueError(f"cxlalloc option '{option}': {url!r} is not a Redis URL; use {SINGLE_FORM}, or for a "
                         f"Redis/Valkey Cluster {CLUSTER_FORM}")
    cluster = is_cluster_url(url)
    form = CLUSTER_FORM if cluster else SINGLE_FORM
    try:
        u = urlsplit(url)
        if cluster:
            cluster_seeds(url, option)
        else:
            _ = u.port
    except ValueError as e:
        if str(e).startswith("cxlalloc option"):
            raise
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: {e}; use {form}") from None
    if not u.netloc.rpartition("@")[2] or (not cluster and not u.hostname):
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r} has no host; use {form}")
    db = u.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: the database must be a number; "
                         f"use {form}")
    if db not in ("", "0") and cluster:
        raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: a cluster has database 0 only; use "
                         f"{CLUSTER_FORM}")
    allowed = url_options_allowed(url)
    for part in filter(None, u.query.split("&")):
        name = unquote(part.partition("=")[0])
        if name not in allowed:
            raise ValueError(f"cxlalloc option '{option}': {redact_url(url)!r}: unknown query option {name!r}; "
                             f"allowed: {', '.join(allowed)}")
    return url


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
