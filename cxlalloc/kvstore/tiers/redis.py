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
  can write a valid header and CRC over other K/V.  Without a key file this
  is said once per process, at start.
* **Reads are bounded.**  Each value is read with ``GETRANGE`` up to its
  header, ``max_value_bytes`` and a MAC (a planted huge value is never read
  whole: ``too_large_values``), and a whole read has a deadline of
  ``timeout`` seconds (past it the tier's connections are closed, so a
  server trickling its reply cannot stretch a miss: ``deadline_expired``).
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
  cxlalloc's own: ``?prefix=...&ttl=SECONDS&queue=SIZE&tenant=NAME``; any other
  query option is refused, naming it and the allowed ones.
* **A Cluster** (Redis Cluster / Valkey Cluster): ``redis+cluster://host:port[,host:port...]``
  (``rediss+cluster://`` for TLS), any nodes as seeds (tried in turn).  Keys are grouped by
  hash slot and read with one pipeline per primary, all written before any
  reply is read; ``MOVED`` and ``ASK`` are followed, the topology is re-read
  after a failover or resharding, and a node down is misses for its slots
  only (:mod:`cxlalloc.kvstore.tiers.redis_cluster`).  Values, MACs, the queue
  and the counters are the same as on one server.
* **Tenants.**  ``tenant=NAME`` (``?tenant=NAME``; default ``""``, the single
  tenant) names the blocks of :meth:`put`/:meth:`get_many` as a kv-server's
  tenant of that name does (:func:`cxlalloc.kvstore.keys.namespaced_key`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence

from cxlalloc.kvstore.keys import REDIS_PREFIX, check_tenant, redis_key
from cxlalloc.kvstore.protocol import MAX_TIMEOUT_S, check_seconds
from cxlalloc.kvstore.tiers import Tier
from cxlalloc.kvstore.tiers.redis_format import (_HEADER, HEADER_BYTES, MAC_BYTES, _length, cache_config_warnings,  # noqa: F401
                                                  check_url, pack_value, read_key_file, redact_url, split_url_options, unpack_value,
                                                  value_problem, value_tokens, is_cluster_url, plain_url)
from cxlalloc.kvstore.tiers.redis_cluster import ClusterRouter, cluster_info, write_batch
from cxlalloc.kvstore.tiers.redis_read import _expire, _read_cluster, _read_prefix

log = logging.getLogger("cxlalloc.kvstore.redis")

DEFAULT_PREFIX = REDIS_PREFIX
DEFAULT_QUEUE_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_VALUE_BYTES = 64 << 20   # bytes of one block read from Redis (--redis-max-value)
_warned_unauthenticated = False      # the missing key file is said once per process
_BACKOFF_MIN_S = 0.25
_BACKOFF_MAX_S = 10.0
_INFO_EVERY_S = 5.0
STATE_LOG_EVERY_S = 30.0  # at most one up/down line per this many seconds; the others are counted in the next


class RedisTier(Tier):
    """Blocks in Redis/Valkey, written asynchronously, read with checks (a :class:`~cxlalloc.kvstore.tiers.Tier`).

    Args:
        url: ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS);
            ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``) for a Cluster
            (every seed given to redis-py, tried in turn); unknown query options are refused.
        prefix: key prefix (default ``cxlalloc:kv:``).
        ttl: seconds a value lives (``SET ... EX``); None: until Redis evicts it.
        queue_bytes: bytes of blocks waiting to be written; past it puts are dropped.
        timeout: seconds for each connect and write, and the deadline of a
            whole read (past it the connections are closed: :func:`_expire`).
        batch_keys: keys per pipelined ``GETRANGE`` (a prefix lookup stops at the first miss).
        max_value_bytes: bytes of one block read back (``--redis-max-value``;
            a larger value is never read whole: :func:`_read_prefix`).
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
                 option: str = "--redis", key_file: Optional[str] = None, tenant: str = "",
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES, **redis_kwargs):
        check_url(url, option)
        self.max_value_bytes = _check_max_value(max_value_bytes)
        self.timeout = float(timeout) if isinstance(timeout, (int, float)) else timeout
        url, ours = split_url_options(url)
        prefix = ours.get("prefix", prefix)
        self.tenant = check_tenant(t, f"{option} ?tenant") if (t := ours.get("tenant", tenant)) else ""
        if "redis_key_file" in ours:
            key_file, key_option = ours["redis_key_file"], f"{option} ?redis_key_file"
        else:
            key_option = "--redis-key-file" if option == "--redis" else f"{option} ?redis_key_file"
        self._mac_key = read_key_file(key_file, key_option) if key_file else None
        ttl_option = "--redis-ttl" if option == "--redis" else f"{option} ttl"
        if "ttl" in ours:  # the URL's ?ttl= is named as such, not as a flag the user did not give
            ttl_option = f"{option} ?ttl"
            try:
                ttl = float(ours["ttl"])
            except ValueError:
                ttl = -1
        if "queue" in ours:
            from cxlalloc.config import parse_size

            queue_bytes = parse_size(ours["queue"], f"{option} ?queue")
        if ttl is not None and not (isinstance(ttl, (int, float)) and ttl > 0):
            raise ValueError(f"cxlalloc option '{ttl_option}': {ttl!r} must be a positive number of seconds")
        if not (isinstance(queue_bytes, int) and queue_bytes > 0):
            raise ValueError(f"cxlalloc option '--redis-queue': {queue_bytes!r} must be a positive size")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            raise ValueError(f"cxlalloc option '--redis-timeout': {timeout!r} must be a finite number of seconds in "
                             f"(0, {MAX_TIMEOUT_S:g}]")
        timeout = check_seconds(timeout, "--redis-timeout")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            from cxlalloc.extras import install_hint
            raise ImportError(f"the Redis tier needs redis-py: {install_hint('kvserver')}") from e
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
        if self._mac_key is None:
            _say_unauthenticated(self.url, key_option)

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
            out = cache_config_warnings(self.url, cfg)
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
    def put_ns(self, nskey: bytes, data, tokens: int = 0) -> bool:
        """:meth:`put` by namespaced key.  ``data`` must not change after the
        call (pass bytes: the pool slot may be reused at once); ``tokens`` is
        recorded in the value's header."""
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
        (write_batch if self._cluster is not None else _write_single)(self, self._cluster, batch)

    def _refresh_info(self) -> None:
        now = time.monotonic()
        if now - self._info_at < _INFO_EVERY_S or self.down():
            return
        self._info_at = now
        if self._cluster is not None:
            info = cluster_info(self._cluster)
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
    def get_many_ns(self, nskeys: Sequence[bytes]) -> List[Optional[bytes]]:
        """The bytes of each of ``nskeys`` (namespaced block keys of one sequence,
        in order); None from the first missing, bad or forged one on (a prefix
        is all a caller can use).  Never raises."""
        return [None if v is None else v[0] for v in self.get_many_ns_tokens(nskeys)]

    def get_many_ns_tokens(self, nskeys: Sequence[bytes]) -> List[Optional[tuple]]:
        """:meth:`get_many_ns` with the tokens each value records: ``(bytes,
        tokens)`` or None (tokens 0: written without them)."""
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
        # one server: pipelined GETRANGE in batches, stopping at the first miss; a cluster: one call,
        # grouped by node inside (redis_cluster); both capped in size and under one deadline
        expired = threading.Event()  # the read's deadline, not a per-recv timeout
        watchdog = threading.Timer(self.timeout, _expire, args=(self, expired))
        watchdog.daemon = True
        watchdog.start()
        limit = HEADER_BYTES + self.max_value_bytes + MAC_BYTES
        try:
            if self._cluster is None:
                got, nbytes = _read_prefix(self, nskeys, out, limit, expired)
                self._ok()
            else:
                got, nbytes, status = _read_cluster(self, nskeys, out, limit)
                if expired.is_set():
                    raise TimeoutError("deadline")
                if status[1] and not status[0]:  # every node asked failed
                    self._failed(ConnectionError(self._cluster.last_error or "no cluster node answers"), "get")
                else:
                    self._ok()
        except Exception as exc:
            if not expired.is_set() and not self._is_conn_error(exc):
                log.warning("cxlalloc kv: Redis read failed: %s: %s", type(exc).__name__, exc)
            self._failed(TimeoutError(f"the Redis read passed its {self.timeout:g} s deadline (--redis-timeout)")
                         if expired.is_set() else exc, "get")
        finally:
            watchdog.cancel()
        with self._lock:
            self.c["hit_blocks"] += got
            self.c["hit_bytes"] += nbytes
            self.c["get_seconds_us"] += int((time.perf_counter() - t0) * 1e6)
        return out

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict:
        """Counters (blocks, bytes, seconds), queue, state; never does I/O.

        Keys: ``kind``, ``url`` (password redacted), ``up`` (None: not tried
        yet), ``last_error``, ``queue_blocks``/``queue_bytes``/``queue_limit_bytes``,
        ``queued_blocks``, ``put_blocks``, ``put_bytes``, ``dropped_blocks``
        (queue full, closed, or refused), ``full_errors`` (Redis OOM),
        ``put_errors``, ``get_errors``, ``lookups``, ``lookup_blocks``,
        ``hit_blocks``, ``hit_bytes``, ``hit_rate``, ``bad_values``,
        ``forged_values`` (no valid MAC while a key is set), ``too_large_values``
        (over ``max_value_bytes``, never read whole), ``deadline_expired`` (reads
        cut off at the ``timeout`` deadline), ``authenticated``,
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
            "bad_values", "forged_values", "too_large_values", "deadline_expired", "skipped_down", "reconnects",
            "state_changes_not_logged")}
        out["max_value_bytes"] = self.max_value_bytes
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


def _write_single(tier: "RedisTier", _router, batch: List[tuple]) -> None:
    """The writer thread's batch on one server (``RedisTier._write``): one
    pipeline of ``SET``; a connection error puts the batch back first in line
    (if it still fits) and backs off; a refused value (OOM: ``full_errors``)
    is dropped and counted."""
    t0 = time.perf_counter()
    try:
        pipe = tier._r.pipeline(transaction=False)
        for nskey, value in batch:
            if tier.ttl is not None:
                pipe.set(tier._rkey(nskey), value, ex=max(1, int(round(tier.ttl))))
            else:
                pipe.set(tier._rkey(nskey), value)
        results = pipe.execute(raise_on_error=False)
    except Exception as e:
        if tier._is_conn_error(e):
            tier._failed(e, "put")
            with tier._cv:  # put the batch back first in line, if it still fits
                room = tier.queue_bytes - tier._q_bytes
                keep = []
                for item in batch:
                    if len(item[1]) <= room:
                        keep.append(item)
                        room -= len(item[1])
                    else:
                        tier.c["dropped_blocks"] += 1
                tier._q.extendleft(reversed(keep))
                tier._q_bytes += sum(len(v) for _, v in keep)
        else:
            tier._failed(e, "put")
            tier.c["dropped_blocks"] += len(batch)
        return
    tier._ok()
    dt = time.perf_counter() - t0
    for (nskey, value), res in zip(batch, results):
        if isinstance(res, Exception):
            text = str(res)
            with tier._lock:
                if "OOM" in text or "maxmemory" in text:
                    tier.c["full_errors"] += 1
                else:
                    tier.c["put_errors"] += 1
                tier.c["dropped_blocks"] += 1
                tier.last_error = f"{type(res).__name__}: {text}"
        else:
            with tier._lock:
                tier.c["put_blocks"] += 1
                tier.c["put_bytes"] += len(value) - HEADER_BYTES
    with tier._lock:
        tier.c["put_seconds_us"] += int(dt * 1e6)


# ----------------------------------------------------------------- bounded reads (module level: RedisTier stays small)
def _check_max_value(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 36:
        raise ValueError(f"cxlalloc option '--redis-max-value': {n!r} must be a size from 1 byte to 64 GiB")
    return int(n)


def _say_unauthenticated(url: str, key_option: str) -> None:
    """Log once per process that values at ``url`` carry no MAC (no key file)."""
    global _warned_unauthenticated
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        log.warning("cxlalloc kv: Redis values at %s are not authenticated (no %s): anyone who can write that "
                    "database can inject K/V that is loaded as a hit; give a key file (docs/kv-server.md, "
                    "threat model)", url, key_option)
