"""A remote tier of KV blocks on Redis or Valkey (RESP), below a pool.

``RedisTier(url)`` is the tier below a :class:`~cxlalloc.kvstore.local.LocalBlockStore`
(``kv_store="redis://host:port/db"``) or below a kv-server's pool
(``cxlalloc kv-server --redis URL``): blocks evicted from the pool are written
here, and a block the pool misses is looked up here before it is recomputed.
It is LMCache's remote backend idea (``remote_url: "redis://host:port"``) on the
store the deployment already runs (docs/sources.md#kv-reuse).

* **Same keys.**  A block's Redis key is ``prefix + H(namespace | block key)``
  (hex; :func:`cxlalloc.kvstore.keys.namespaced_key`), so one block has one name whichever process,
  server or machine computed it, and two namespaces never share a value.
* **Writes never block the caller.**  :meth:`put` copies nothing and waits for
  nothing: it appends to a bounded queue (``queue_bytes``) that a background
  thread drains with pipelined ``SET`` (``EX ttl`` when given).  A full queue
  drops the block and counts it.  A connection error puts the batch back and
  retries with exponential backoff (a restarting Redis loses nothing queued).
* **Reads are checked.**  A value is ``header + bytes``; the header holds a
  magic, a version, the namespaced key, the length and a CRC-32, so a
  truncated, foreign or mismatched value is refused (counted), never loaded.
  CRC-32 catches accidents, not forgery: anyone who can write the database
  can write a valid header and CRC over other K/V.
* **Values authenticated with a key.**  With ``key_file`` (the kv-server's
  ``--redis-key-file PATH``, the URL's ``?redis_key_file=PATH`` for an
  in-process store) every value carries a keyed BLAKE2b-256 MAC (RFC 7693's
  keyed mode) over its header (namespaced key, length, CRC) and bytes, and a
  value without a valid MAC is refused and counted (``forged_values``): a
  writer of the Redis database without the key can no longer inject K/V.
  The key file must be readable by its owner only (mode 0600 or 0400) and
  hold at least 16 bytes.  docs/kv-server.md has the threat model.
* **A down or full Redis is a miss.**  Errors are counted, never raised into
  ``generate()``; while Redis is down (after a failure, for the backoff) reads
  return misses at once instead of waiting for a timeout.  A Redis at
  ``maxmemory`` with ``noeviction`` answers ``OOM``: counted as ``full_errors``.
* **AUTH and TLS** as redis-py takes them: ``redis://user:password@host:port/db``,
  ``rediss://...`` for TLS, and any redis-py keyword (``ssl_ca_certs``,
  ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``, ``password``, ...) passed through,
  also as URL query options (``rediss://host:6380/0?ssl_ca_certs=/etc/ssl/ca.pem``).
  cxlalloc's own: ``?prefix=...&ttl=SECONDS&queue=SIZE``.
* **A Cluster** (Redis Cluster / Valkey Cluster): ``redis+cluster://host:port``
  (``rediss+cluster://`` for TLS), any node as the seed.  Keys are grouped by
  hash slot and read with one pipeline per primary, in parallel; ``MOVED`` and
  ``ASK`` are followed, the topology is re-read after a failover or resharding,
  and a node down is misses for its slots only
  (:mod:`cxlalloc.kvstore.resp_cluster`).  Values, MACs, the queue and the
  counters are the same as on one server.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import struct
import threading
import time
import zlib
from typing import Dict, List, Optional, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from cxlalloc.kvstore.keys import REDIS_PREFIX, namespaced_key, redis_key
from cxlalloc.kvstore.resp_cluster import ClusterRouter, is_cluster_url, plain_url

log = logging.getLogger("cxlalloc.kvstore.redis")

DEFAULT_PREFIX = REDIS_PREFIX
DEFAULT_QUEUE_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 2.0
_MAGIC = b"CXKV"
_VERSION = 1
_HEADER = struct.Struct("!4sHH32sQI")  # magic, version, flags, namespaced key, nbytes, crc32
HEADER_BYTES = _HEADER.size
FLAG_MAC = 1  # a MAC_BYTES keyed BLAKE2b of header + bytes follows the bytes
# flags >> 1: the tokens the block holds (0 = not recorded: values of older versions), so a block restored from
# Redis reports its tokens in hit_tokens; readers that know only FLAG_MAC ignore these bits.
MAX_TOKENS = 0x7FFF
MAC_BYTES = 32
MIN_KEY_BYTES = 16
_BACKOFF_MIN_S = 0.25
_BACKOFF_MAX_S = 10.0
_INFO_EVERY_S = 5.0
STATE_LOG_EVERY_S = 30.0  # at most one up/down line per this many seconds; the others are counted in the next


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


OWN_URL_OPTIONS = ("prefix", "ttl", "queue", "redis_key_file")


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


class RedisTier:
    """Blocks in Redis/Valkey, written asynchronously, read with checks.

    Args:
        url: ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS);
            ``redis+cluster://host:port`` (``rediss+cluster://``) for a Cluster.
        prefix: key prefix (default ``cxlalloc:kv:``).
        ttl: seconds a value lives (``SET ... EX``); None: until Redis evicts it.
        queue_bytes: bytes of blocks waiting to be written; past it puts are dropped.
        timeout: seconds for each connect, read and write.
        batch_keys: keys per ``MGET`` (a prefix lookup stops at the first miss).
        key_file: a file holding the MAC key (``?redis_key_file=PATH`` in the
            URL too): values are written with a MAC and read only with a valid one.
        **redis_kwargs: passed to ``redis.Redis.from_url`` (AUTH, TLS, ...).

    Raises:
        ValueError: a bad URL, ttl, queue size, timeout or key file (naming the option).
        ImportError: redis-py is not installed (``pip install redis``).
    """

    kind = "redis"

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, ttl: Optional[float] = None,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, timeout: float = DEFAULT_TIMEOUT_S, batch_keys: int = 8,
                 option: str = "--redis", key_file: Optional[str] = None, **redis_kwargs):
        check_url(url, option)
        url, ours = split_url_options(url)
        prefix = ours.get("prefix", prefix)
        if "redis_key_file" in ours:
            key_file, key_option = ours["redis_key_file"], f"{option} ?redis_key_file"
        else:
            key_option = "--redis-key-file" if option == "--redis" else f"{option} ?redis_key_file"
        self._mac_key = read_key_file(key_file, key_option) if key_file else None
        if "ttl" in ours:
            try:
                ttl = float(ours["ttl"])
            except ValueError:
                ttl = -1
        if "queue" in ours:
            from cxlalloc.config import parse_size

            queue_bytes = parse_size(ours["queue"], "--redis-queue")
        if ttl is not None and not (isinstance(ttl, (int, float)) and ttl > 0):
            raise ValueError(f"cxlalloc option '--redis-ttl': {ttl!r} must be a positive number of seconds")
        if not (isinstance(queue_bytes, int) and queue_bytes > 0):
            raise ValueError(f"cxlalloc option '--redis-queue': {queue_bytes!r} must be a positive size")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"cxlalloc option '--redis-timeout': {timeout!r} must be a positive number of seconds")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError("the Redis tier needs redis-py: pip install 'cxlalloc[kvserver]' (or pip install redis)"
                              ) from e
        self._redis_mod = redis
        self.url = redact_url(url)
        self.prefix = str(prefix)
        self.ttl = ttl
        self.queue_bytes = int(queue_bytes)
        self.batch_keys = max(1, int(batch_keys))
        kw = dict(socket_timeout=float(timeout), socket_connect_timeout=float(timeout),
                  retry=Retry(NoBackoff(), 0))  # our own backoff; never redis-py's retries on top
        kw.update(redis_kwargs)
        self._cluster: Optional[ClusterRouter] = None
        self._r = None
        try:
            if is_cluster_url(url):
                kw.pop("retry", None)
                self._cluster = ClusterRouter(plain_url(url), float(timeout), kw)
                self.kind = "redis-cluster"
            else:
                self._r = redis.Redis.from_url(url, **kw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"cxlalloc option '{option}': {self.url!r}: {e}") from None
        self._cv = threading.Condition()
        self._q: "collections.deque[tuple]" = collections.deque()
        self._q_bytes = 0
        self._closed = False
        self._busy = False  # a batch is being written
        self._lock = threading.Lock()  # counters and the down state
        self._down_until = 0.0
        self._backoff = _BACKOFF_MIN_S
        self.up: Optional[bool] = None  # None until the first operation
        self.last_error: Optional[str] = None
        self.info: Dict[str, int] = {}
        self._info_at = -1e9
        self.c = collections.Counter()
        self._warned_forged = False
        self._state_logged_at = -1e9
        self._state_suppressed = 0
        self.config_warnings: Optional[List[str]] = None  # None until checked (check_config)
        self._config_lock = threading.Lock()
        self._writer = threading.Thread(target=self._drain, name="cxlalloc-redis-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ state
    def _rkey(self, nskey: bytes) -> str:
        return redis_key(self.prefix, nskey)

    def _failed(self, exc: BaseException, what: str) -> None:
        with self._lock:
            self.c[f"{what}_errors"] += 1
            was_up = self.up is not False
            self.up = False
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
        if was_up:
            self._log_state(f"cxlalloc kv: Redis {self.url} is unreachable ({self.last_error}); blocks are recomputed "
                            "and retried with backoff")

    def _log_state(self, line: str) -> None:
        """One line per up/down transition, at most one per STATE_LOG_EVERY_S;
        the transitions not logged are counted in the next line (a Redis that
        flaps writes two lines a minute, not one per flap)."""
        with self._lock:
            now = time.monotonic()
            if now - self._state_logged_at < STATE_LOG_EVERY_S:
                self._state_suppressed += 1
                self.c["state_changes_not_logged"] += 1
                return
            n, self._state_suppressed, self._state_logged_at = self._state_suppressed, 0, now
        log.warning("%s%s", line, f" ({n} more up/down changes in the last {STATE_LOG_EVERY_S:g} s not logged)"
                    if n else "")

    def _ok(self) -> None:
        back = False
        with self._lock:
            if self.up is False:
                back = True
                self.c["reconnects"] += 1
            self.up = True
            self._backoff = _BACKOFF_MIN_S
            self._down_until = 0.0
        if back:
            self._log_state(f"cxlalloc kv: Redis {self.url} is reachable again")

    def check_config(self) -> List[str]:
        """Warn (once, logged) when Redis is not configured as a cache: its
        ``maxmemory-policy`` is ``noeviction`` (writes fail once full) or it has
        no ``maxmemory`` (it grows until the machine runs out).  Read with
        ``CONFIG GET``; where CONFIG is refused (managed services rename or
        disable it), says so once instead.  Returns the warnings (also kept in
        ``config_warnings``); [] when unreachable (checked again later)."""
        with self._config_lock:  # the writer thread checks at start; a caller may at the same time
            return self._check_config()

    def _check_config(self) -> List[str]:
        if self.config_warnings is not None:
            return self.config_warnings
        out: List[str] = []
        try:
            cfg = (self._cluster or self._r).config_get("maxmemory*")
        except Exception as e:
            if self._is_conn_error(e):
                return []
            out.append(f"cxlalloc kv: cannot read the configuration of Redis {self.url} (CONFIG GET refused: "
                       f"{type(e).__name__}: {e}); make sure it evicts as a cache (maxmemory and an allkeys-* "
                       "maxmemory-policy)")
        else:
            policy = str(cfg.get("maxmemory-policy", "")).lower()
            if policy == "noeviction":
                out.append(f"cxlalloc kv: Redis {self.url} has maxmemory-policy noeviction: once full, every write of "
                           "an evicted block fails; configure it as a cache (e.g. allkeys-lru)")
            if str(cfg.get("maxmemory", "0")) in ("0", ""):
                out.append(f"cxlalloc kv: Redis {self.url} has no maxmemory: it grows with every block until the "
                           "machine runs out; set maxmemory (and an allkeys-* maxmemory-policy)")
        for line in out:
            log.warning("%s", line)
        self.config_warnings = out
        return out

    def _is_conn_error(self, exc: BaseException) -> bool:
        r = self._redis_mod
        return isinstance(exc, (r.exceptions.ConnectionError, r.exceptions.TimeoutError, OSError, TimeoutError))

    def down(self) -> bool:
        """True while a recent failure's backoff lasts (reads are misses then);
        for a cluster, while no node answers (one node down is not down)."""
        if self._cluster is not None:
            return self._cluster.down()
        return time.monotonic() < self._down_until

    # ------------------------------------------------------------ writes
    def put(self, key: bytes, ns: str, data, tokens: int = 0) -> bool:
        """Queue block ``key`` of namespace ``ns`` (holding ``tokens`` tokens,
        recorded in the value's header); False when dropped (queue full or closed)."""
        return self.put_ns(namespaced_key(ns, key), data, tokens)

    def put_ns(self, nskey: bytes, data, tokens: int = 0) -> bool:
        """:meth:`put` by namespaced key.  ``data`` must not change after the
        call (pass bytes: the pool slot may be reused at once)."""
        value = pack_value(nskey, data, self._mac_key, tokens)
        with self._cv:
            if self._closed or self._q_bytes + len(value) > self.queue_bytes:
                self.c["dropped_blocks"] += 1
                self.c["dropped_bytes"] += len(value) - HEADER_BYTES
                return False
            self._q.append((nskey, value))
            self._q_bytes += len(value)
            self.c["queued_blocks"] += 1
            self._cv.notify()
        return True

    def _take_batch(self, max_items: int = 64, max_bytes: int = 64 << 20) -> List[tuple]:
        out, n = [], 0
        while self._q and len(out) < max_items and (not out or n + len(self._q[0][1]) <= max_bytes):
            item = self._q.popleft()
            out.append(item)
            n += len(item[1])
        self._q_bytes -= n
        return out

    def _drain(self) -> None:
        self._refresh_info()  # learn soon whether Redis is there
        self.check_config()
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait(timeout=_INFO_EVERY_S)
                    if not self._q and not self._closed:
                        break  # idle: refresh INFO below
                if self._closed and not self._q:
                    return
                wait = self._down_until - time.monotonic()
                if wait > 0 and not self._closed:
                    self._cv.wait(timeout=wait)
                    continue
                if self._closed and self.down():
                    # Closing while Redis is down: what is queued is lost (counted).
                    self.c["dropped_blocks"] += len(self._q)
                    self._q.clear()
                    self._q_bytes = 0
                    return
                batch = self._take_batch()
                self._busy = bool(batch)
            if batch:
                try:
                    self._write(batch)
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
            self._refresh_info()
            if self.config_warnings is None and not self.down():
                self.check_config()

    def _write(self, batch: List[tuple]) -> None:
        if self._cluster is not None:
            return self._write_cluster(batch)
        t0 = time.perf_counter()
        try:
            pipe = self._r.pipeline(transaction=False)
            for nskey, value in batch:
                if self.ttl is not None:
                    pipe.set(self._rkey(nskey), value, ex=max(1, int(round(self.ttl))))
                else:
                    pipe.set(self._rkey(nskey), value)
            results = pipe.execute(raise_on_error=False)
        except Exception as e:
            if self._is_conn_error(e):
                self._failed(e, "put")
                with self._cv:  # put the batch back first in line, if it still fits
                    room = self.queue_bytes - self._q_bytes
                    keep = []
                    for item in batch:
                        if len(item[1]) <= room:
                            keep.append(item)
                            room -= len(item[1])
                        else:
                            self.c["dropped_blocks"] += 1
                    self._q.extendleft(reversed(keep))
                    self._q_bytes += sum(len(v) for _, v in keep)
            else:
                self._failed(e, "put")
                self.c["dropped_blocks"] += len(batch)
            return
        self._ok()
        dt = time.perf_counter() - t0
        for (nskey, value), res in zip(batch, results):
            if isinstance(res, Exception):
                text = str(res)
                with self._lock:
                    if "OOM" in text or "maxmemory" in text:
                        self.c["full_errors"] += 1
                    else:
                        self.c["put_errors"] += 1
                    self.c["dropped_blocks"] += 1
                    self.last_error = f"{type(res).__name__}: {text}"
            else:
                with self._lock:
                    self.c["put_blocks"] += 1
                    self.c["put_bytes"] += len(value) - HEADER_BYTES
        with self._lock:
            self.c["put_seconds_us"] += int(dt * 1e6)

    def _write_cluster(self, batch: List[tuple]) -> None:
        """:meth:`_write` on a cluster: per item, stored, refused (counted,
        dropped) or its node unreachable (put back once, behind the queue, if
        it fits; dropped on the second failure)."""
        t0 = time.perf_counter()
        ex = max(1, int(round(self.ttl))) if self.ttl is not None else None
        results = self._cluster.set_many([(self._rkey(nskey), value) for nskey, value, *_ in batch], ex)
        retry = []
        for item, res in zip(batch, results):
            value = item[1]
            with self._lock:
                if res is True:
                    self.c["put_blocks"] += 1
                    self.c["put_bytes"] += len(value) - HEADER_BYTES
                elif self._is_conn_error(res):
                    self.c["put_errors"] += 1
                    self.last_error = f"{type(res).__name__}: {res}"
                    if len(item) == 2:
                        retry.append((item[0], item[1], 1))
                    else:
                        self.c["dropped_blocks"] += 1
                else:
                    text = str(res)
                    self.c["full_errors" if ("OOM" in text or "maxmemory" in text) else "put_errors"] += 1
                    self.c["dropped_blocks"] += 1
                    self.last_error = f"{type(res).__name__}: {text}"
        if any(r is True for r in results):
            self._ok()
        elif results and self._cluster.down():
            self._failed(ConnectionError(self._cluster.last_error or "no cluster node answers"), "put")
        if retry:
            time.sleep(min(0.05, self._cluster.timeout))  # the topology refresh runs meanwhile
            with self._cv:
                for item in retry:
                    if self._q_bytes + len(item[1]) <= self.queue_bytes:
                        self._q.append(item)
                        self._q_bytes += len(item[1])
                    else:
                        self.c["dropped_blocks"] += 1
        with self._lock:
            self.c["put_seconds_us"] += int((time.perf_counter() - t0) * 1e6)

    def _refresh_info(self) -> None:
        now = time.monotonic()
        if now - self._info_at < _INFO_EVERY_S or self.down():
            return
        self._info_at = now
        if self._cluster is not None:
            info = self._cluster.info()
            if info:
                self.info = info
                self._ok()
            return
        try:
            mem = self._r.info("memory")
            self.info = {"used_memory": int(mem.get("used_memory", 0)), "maxmemory": int(mem.get("maxmemory", 0)),
                         "maxmemory_policy": mem.get("maxmemory_policy")}
            self._ok()
        except Exception as e:
            if self._is_conn_error(e):
                self._failed(e, "info")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued block was sent (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cv:
                if not self._q and not self._busy:
                    return True
                self._cv.notify_all()
                self._cv.wait(timeout=0.05)
        return False

    # ------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[bytes], ns: str = "") -> List[Optional[bytes]]:
        """The bytes of each of ``keys`` (block keys of one sequence, in order)
        in namespace ``ns``; None from the first missing one on (a prefix is
        all a caller can use).  Never raises."""
        return self.get_many_ns([namespaced_key(ns, k) for k in keys])

    def get_many_ns(self, nskeys: Sequence[bytes]) -> List[Optional[bytes]]:
        """:meth:`get_many` by namespaced keys."""
        return [None if v is None else v[0] for v in self.get_many_ns_tokens(nskeys)]

    def get_many_tokens(self, keys: Sequence[bytes], ns: str = "") -> List[Optional[tuple]]:
        """:meth:`get_many` with each block's recorded tokens: ``(bytes,
        tokens)`` or None (tokens 0: written without them)."""
        return self.get_many_ns_tokens([namespaced_key(ns, k) for k in keys])

    def get_many_ns_tokens(self, nskeys: Sequence[bytes]) -> List[Optional[tuple]]:
        """:meth:`get_many_tokens` by namespaced keys."""
        out: List[Optional[tuple]] = [None] * len(nskeys)
        if not nskeys:
            return out
        with self._lock:
            self.c["lookups"] += 1
            self.c["lookup_blocks"] += len(nskeys)
        if self.down():
            with self._lock:
                self.c["skipped_down"] += 1
            return out
        t0 = time.perf_counter()
        got = nbytes = 0
        if self._cluster is not None:
            values = self._cluster.get([self._rkey(k) for k in nskeys])
            if self._cluster.ready():
                self._ok()
            for i, (k, v) in enumerate(zip(nskeys, values)):
                data = self._checked(k, v)
                if data is None:
                    break
                out[i] = (data, value_tokens(v))
                got += 1
                nbytes += len(data)
            with self._lock:
                self.c["hit_blocks"] += got
                self.c["hit_bytes"] += nbytes
                self.c["get_seconds_us"] += int((time.perf_counter() - t0) * 1e6)
            return out
        try:
            for i in range(0, len(nskeys), self.batch_keys):
                part = nskeys[i:i + self.batch_keys]
                values = self._r.mget([self._rkey(k) for k in part])
                stop = False
                for j, (k, v) in enumerate(zip(part, values)):
                    problem = value_problem(k, v, self._mac_key)
                    if problem is not None:
                        if problem != "missing":
                            with self._lock:
                                self.c["forged_values" if problem == "forged" else "bad_values"] += 1
                            if problem == "forged" and not self._warned_forged:
                                self._warned_forged = True
                                log.warning("cxlalloc kv: a Redis value without a valid MAC was refused (key "
                                            "%s...; counted in forged_values; said once)", self._rkey(k)[:40])
                        stop = True
                        break
                    data = v[HEADER_BYTES:HEADER_BYTES + _length(v)]
                    out[i + j] = (data, value_tokens(v))
                    got += 1
                    nbytes += len(data)
                if stop:
                    break
            self._ok()
        except Exception as e:
            if not self._is_conn_error(e):
                log.warning("cxlalloc kv: Redis read failed: %s: %s", type(e).__name__, e)
            self._failed(e, "get")
        dt = time.perf_counter() - t0
        with self._lock:
            self.c["hit_blocks"] += got
            self.c["hit_bytes"] += nbytes
            self.c["get_seconds_us"] += int(dt * 1e6)
        return out

    def _checked(self, k: bytes, v: Optional[bytes]) -> Optional[bytes]:
        """The block bytes of value ``v`` of namespaced key ``k``, or None
        (missing; bad or forged: counted)."""
        problem = value_problem(k, v, self._mac_key)
        if problem is None:
            return v[HEADER_BYTES:HEADER_BYTES + _length(v)]
        if problem != "missing":
            with self._lock:
                self.c["forged_values" if problem == "forged" else "bad_values"] += 1
            if problem == "forged" and not self._warned_forged:
                self._warned_forged = True
                log.warning("cxlalloc kv: a Redis value without a valid MAC was refused (key "
                            "%s...; counted in forged_values; said once)", self._rkey(k)[:40])
        return None

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Counters (blocks, bytes, seconds), queue, state; never does I/O.

        Keys: ``kind``, ``url`` (password redacted), ``up`` (None: not tried
        yet), ``last_error``, ``queue_blocks``/``queue_bytes``/``queue_limit_bytes``,
        ``queued_blocks``, ``put_blocks``, ``put_bytes``, ``dropped_blocks``
        (queue full, closed, or refused), ``full_errors`` (Redis OOM),
        ``put_errors``, ``get_errors``, ``lookups``, ``lookup_blocks``,
        ``hit_blocks``, ``hit_bytes``, ``hit_rate``, ``bad_values``,
        ``forged_values`` (no valid MAC while a key is set), ``authenticated``,
        ``skipped_down``, ``get_seconds``, ``load_seconds_per_block``,
        ``used_bytes``/``capacity_bytes`` (Redis ``used_memory``/``maxmemory``,
        refreshed every 5 s; capacity 0 = no limit), ``reconnects``.
        """
        with self._lock:
            c = dict(self.c)
            up, err, info = self.up, self.last_error, dict(self.info)
        with self._cv:
            qb, qn = self._q_bytes, len(self._q)
        out = {k: int(c.get(k, 0)) for k in (
            "queued_blocks", "put_blocks", "put_bytes", "dropped_blocks", "dropped_bytes", "full_errors",
            "put_errors", "get_errors", "info_errors", "lookups", "lookup_blocks", "hit_blocks", "hit_bytes",
            "bad_values", "forged_values", "skipped_down", "reconnects", "state_changes_not_logged")}
        out.update(kind=self.kind, url=self.url, prefix=self.prefix, ttl=self.ttl, up=up, last_error=err,
                   authenticated=self._mac_key is not None,
                   queue_blocks=qn, queue_bytes=qb, queue_limit_bytes=self.queue_bytes,
                   used_bytes=info.get("used_memory"), capacity_bytes=info.get("maxmemory"),
                   maxmemory_policy=info.get("maxmemory_policy"), config_warnings=self.config_warnings)
        out["get_seconds"] = c.get("get_seconds_us", 0) / 1e6
        out["put_seconds"] = c.get("put_seconds_us", 0) / 1e6
        out["hit_rate"] = out["hit_blocks"] / out["lookup_blocks"] if out["lookup_blocks"] else 0.0
        out["load_seconds_per_block"] = out["get_seconds"] / out["hit_blocks"] if out["hit_blocks"] else None
        if self._cluster is not None:
            out["cluster"] = self._cluster.stats()
        return out

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout`` s), stop the writer, close the connections."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._writer.join(timeout=timeout + 1.0)
        try:
            (self._cluster or self._r).close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<cxlalloc RedisTier {self.url} prefix={self.prefix!r}>"
