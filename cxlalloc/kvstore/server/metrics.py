"""Prometheus metrics of a kv-server: an HTTP endpoint and/or a text file.

``cxlalloc kv-server --metrics-port 9400`` serves ``/metrics``;
``--metrics-file /var/lib/node_exporter/cxlalloc_kv.prom`` rewrites a file
(write to a temporary name, then rename: a reader never sees half a file)
every ``--metrics-interval`` seconds, for node_exporter's textfile collector.
Both read :meth:`KVServer.stats` when asked, so they cost nothing between scrapes.

Names (``tier`` is ``pool`` or ``redis``; docs/kv-server.md#metrics lists them with units):

    cxlalloc_kv_capacity_bytes{tier}          cxlalloc_kv_used_bytes{tier}
    cxlalloc_kv_committed_bytes               cxlalloc_kv_blocks{state}
    cxlalloc_kv_lookups_total{tier}           cxlalloc_kv_lookup_blocks_total{tier}
    cxlalloc_kv_hit_blocks_total{tier}        cxlalloc_kv_hit_ratio{tier}
    cxlalloc_kv_recent_hit_ratio              cxlalloc_kv_loads_total{tier}
    cxlalloc_kv_load_bytes_total{tier}        cxlalloc_kv_stores_total{tier}
    cxlalloc_kv_store_bytes_total{tier}       cxlalloc_kv_rate_window_seconds
    cxlalloc_kv_evictions_total
    cxlalloc_kv_evicted_bytes_total           cxlalloc_kv_dropped_blocks_total{tier}
    cxlalloc_kv_aborted_blocks_total          cxlalloc_kv_dropped_pins_total
    cxlalloc_kv_clients                       cxlalloc_kv_connections_total
    cxlalloc_kv_refused_connections_total{reason}  (max_clients, per_uid, denied, too_large, busy, timeout,
                                                 hello_timeout, idle_timeout, max_items, max_objects, bad_frame)
    cxlalloc_kv_bad_requests_total            cxlalloc_kv_corrupt_blocks_total
    cxlalloc_kv_refused_reserves_total        cxlalloc_kv_reserve_budget_blocks_total
    cxlalloc_kv_refused_lookups_total         cxlalloc_kv_pin_budget_blocks_total
    cxlalloc_kv_lock_hold_seconds_max         cxlalloc_kv_drop_seconds_max
    cxlalloc_kv_lock_holds_total              cxlalloc_kv_lock_handoffs_total
    cxlalloc_kv_buffered_peak_bytes           cxlalloc_kv_limit{limit}
    cxlalloc_kv_redis_refused_values_total{reason}  cxlalloc_kv_redis_deadline_expired_total
    cxlalloc_kv_namespace_used_bytes{namespace}  cxlalloc_kv_namespace_quota_bytes{namespace}
    cxlalloc_kv_placement_bytes_total{result}
    cxlalloc_kv_redis_up                      cxlalloc_kv_redis_errors_total{op}
    cxlalloc_kv_redis_queue_bytes             cxlalloc_kv_redis_bad_values_total
    cxlalloc_kv_redis_load_seconds_per_block  cxlalloc_kv_uptime_seconds
    cxlalloc_kv_pool_info{node,pool_id,numa_method,socket}
    cxlalloc_kv_served_blocks_total{source}   cxlalloc_kv_served_bytes_total{source}
    cxlalloc_kv_served_tokens_total{source}   (source: pool, remote = read through from Redis/Valkey)

As Prometheus practice has it (https://prometheus.io/docs/practices/naming/,
https://prometheus.io/docs/practices/instrumentation/): HELP strings are the
same in every scrape (no measured values in them); rates are left to
``rate()`` over the ``_total`` counters (``--status`` prints its own per-second
figures); no label value is empty (an empty value is the same series as no
label): the default namespace is ``namespace="(default)"``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterator, Optional

log = logging.getLogger("cxlalloc.kvstore.server.metrics")


def _prom():
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as e:
        from cxlalloc.extras import install_hint
        raise ImportError(f"kv-server metrics need prometheus_client: {install_hint('kvserver')}") from e
    return CounterMetricFamily, GaugeMetricFamily


DEFAULT_NS_LABEL = "(default)"


def ns_label(ns: str) -> str:
    """A namespace as a label value: the default namespace ("") is
    ``(default)``, never the empty value."""
    return ns if ns else DEFAULT_NS_LABEL


def families(st: dict) -> Iterator:
    """Prometheus metric families of one :meth:`KVServer.stats` snapshot."""
    Counter, Gauge = _prom()
    srv, pool, rates, rd = st["server"], st["pool"], st.get("rates") or {}, st.get("redis")
    P = "cxlalloc_kv_"

    def gauge(name, doc, labels=(), rows=()):
        g = Gauge(P + name, doc, labels=list(labels))
        for lab, v in rows:
            if v is not None:
                g.add_metric(list(lab), float(v))
        return g

    def counter(name, doc, labels=(), rows=()):
        c = Counter(P + name, doc, labels=list(labels))
        for lab, v in rows:
            if v is not None:
                c.add_metric(list(lab), float(v))
        return c

    red = rd or {}
    has_r = rd is not None
    tiers = lambda pool_v, redis_v: [(("pool",), pool_v)] + ([(("redis",), redis_v)] if has_r else [])  # noqa: E731

    yield gauge("capacity_bytes", "Bytes the tier may hold (redis: maxmemory, 0 = no limit).", ["tier"],
                tiers(pool["capacity_bytes"], red.get("capacity_bytes")))
    yield gauge("used_bytes", "Bytes of blocks held (redis: used_memory).", ["tier"],
                tiers(pool["used_bytes"], red.get("used_bytes")))
    yield gauge("committed_bytes", "Bytes of the pool the kernel has committed (pages written at least once).",
                rows=[((), pool["committed_bytes"])])
    yield gauge("blocks", "Blocks in the pool by state.", ["state"],
                [(("ready",), pool["blocks"]), (("writing",), pool["writing_blocks"]),
                 (("pinned",), pool["pinned_blocks"])])
    yield counter("lookups", "Lookup requests.", ["tier"], tiers(pool["lookups"], red.get("lookups")))
    yield counter("lookup_blocks", "Blocks looked up.", ["tier"], tiers(pool["lookup_blocks"], red.get("lookup_blocks")))
    # the pool's own finds: a block read through from Redis on a pool miss is the redis tier's hit, not the pool's
    # (the pool's hit_blocks counts it, since the client is served from the pool afterwards)
    pool_found = pool["hit_blocks"] - pool.get("redis_hit_blocks", 0)
    yield counter("hit_blocks", "Blocks found in the tier (pool: not those read through from Redis).", ["tier"],
                  tiers(pool_found, red.get("hit_blocks")))
    yield gauge("hit_ratio", "Found / looked-up blocks since start.", ["tier"],
                tiers(pool_found / pool["lookup_blocks"] if pool["lookup_blocks"] else 0.0, red.get("hit_rate")))
    yield gauge("recent_hit_ratio", "Found / looked-up blocks of the pool over the last rate window "
                "(cxlalloc_kv_rate_window_seconds).", rows=[((), rates.get("hit_rate"))])
    yield gauge("rate_window_seconds", "Seconds of the window of cxlalloc_kv_recent_hit_ratio.",
                rows=[((), rates.get("window_s"))])
    yield counter("loads", "Blocks served to clients (pool) or read from Redis into the pool.", ["tier"],
                  tiers(pool["hit_blocks"], red.get("hit_blocks")))
    yield counter("load_bytes", "Bytes of the blocks served / read.", ["tier"],
                  tiers(pool["hit_bytes"], red.get("hit_bytes")))
    yield counter("stores", "Blocks committed (pool) or written (redis).", ["tier"],
                  tiers(pool["stored_blocks"], red.get("put_blocks")))
    yield counter("store_bytes", "Bytes committed / written.", ["tier"],
                  tiers(pool["stored_bytes"], red.get("put_bytes")))
    src = pool.get("tiers") or {}
    for what, doc in (("blocks", "Blocks"), ("bytes", "Bytes of the blocks"), ("tokens", "Tokens of the blocks")):
        yield counter(f"served_{what}", f"{doc} served to clients by where they were found (pool: in the pool; "
                      "remote: read through from the Redis/Valkey tier below on a pool miss).", ["source"],
                      [((s,), d.get(what)) for s, d in src.items()])
    yield counter("evictions", "Blocks evicted from the pool (LRU or quota).", rows=[((), pool["evicted_blocks"])])
    yield counter("evicted_bytes", "Bytes evicted from the pool.", rows=[((), pool["evicted_bytes"])])
    yield counter("dropped_blocks", "Blocks not stored (pool: no room; redis: queue full, refused or down).",
                  ["tier"], tiers(pool["dropped_blocks"], red.get("dropped_blocks")))
    yield counter("aborted_blocks", "Reservations aborted (by the client, or because it died).",
                  rows=[((), pool["aborted_blocks"])])
    yield counter("dropped_pins", "Pins dropped because their client disconnected.", rows=[((), pool["dropped_pins"])])
    yield gauge("clients", "Connected clients.", rows=[((), srv["clients"])])
    yield counter("connections", "Connections accepted.", rows=[((), srv["connections_total"])])
    g = srv.get
    per_uid, no_hello, idle = g("refused_per_uid", 0), g("closed_no_hello", 0), g("closed_idle", 0)
    max_items, max_objects = g("refused_max_items", 0), g("refused_max_objects", 0)
    yield counter("refused_connections", "Connections refused (max_clients: --max-clients, per_uid: "
                  "--max-clients-per-uid, denied: --allow-user/--tenant) or closed for breaking a limit (too_large: "
                  "--max-frame, busy: --max-buffered, timeout: --frame-timeout, hello_timeout: --hello-timeout, "
                  "idle_timeout: --idle-timeout, max_items: --max-items, max_objects: --max-objects, bad_frame: "
                  "not a request). Each refusal has one reason.", ["reason"],
                  [(("max_clients",), max(0, srv["refused_full"] - per_uid)), (("per_uid",), per_uid),
                   (("denied",), srv["refused_denied"]),
                   (("too_large",), g("refused_too_large", 0)), (("busy",), g("refused_busy", 0)),
                   (("timeout",), max(0, g("refused_timeout", 0) - no_hello - idle)), (("hello_timeout",), no_hello),
                   (("idle_timeout",), idle), (("max_items",), max_items), (("max_objects",), max_objects),
                   (("bad_frame",), max(0, g("bad_frames", 0) - max_items - max_objects))])
    yield counter("bad_requests", "Requests answered bad_request (a field missing or of the wrong type; the "
                  "connection stays).", rows=[((), g("bad_requests"))])
    yield counter("corrupt_blocks", "Blocks a reader found corrupt, verified here (checksum) and dropped.",
                  rows=[((), g("corrupt_blocks"))])
    yield counter("refused_reserves", "Reserve requests of which no block fitted the client's --max-reserve "
                  "budget.", rows=[((), pool.get("refused_reserve_budget"))])
    yield counter("reserve_budget_blocks", "Blocks given no slot because their client's --max-reserve budget "
                  "was spent.", rows=[((), pool.get("reserve_budget_blocks"))])
    yield counter("refused_lookups", "Lookup requests refused because their client held --max-pinned bytes "
                  "of blocks pinned already (the client reads a miss).", rows=[((), pool.get("refused_pin_budget"))])
    yield counter("pin_budget_blocks", "Blocks found by a lookup but not pinned, answered as misses, because "
                  "their client's --max-pinned budget was spent.", rows=[((), pool.get("pin_budget_blocks"))])
    yield gauge("lock_hold_seconds_max", "Longest hold of the server's lock by one slice of a request "
                "(--slice-keys) since start (wall clock: includes the holder being preempted).",
                rows=[((), _ms(pool.get("lock_hold_ms_max")))])
    yield counter("lock_holds", "Holds of the server's lock by slices of requests and disconnects.",
                  rows=[((), pool.get("lock_holds"))])
    yield counter("lock_handoffs", "Releases of the server's lock that handed it straight to a waiting "
                  "client's thread (first come, first served).", rows=[((), pool.get("lock_handoffs"))])
    yield gauge("drop_seconds_max", "Longest hold of the lock while a disconnected client's pins and "
                "reservations were dropped, since start.", rows=[((), _ms(pool.get("drop_ms_max")))])
    yield gauge("buffered_peak_bytes", "Most bytes of requests received and decoded at once, over every "
                "connection (bounded by --max-buffered).", rows=[((), g("buffered_peak_bytes"))])
    limits = srv.get("limits") or {}
    yield gauge("limit", "The server's hardening limits (max_frame, max_buffered, max_items, max_objects, "
                "max_reserve: bytes or counts; *_timeout_s, frame_timeout_s: seconds).", ["limit"],
                [((k,), v) for k, v in sorted(limits.items()) if isinstance(v, (int, float))
                 and not isinstance(v, bool)])
    yield gauge("namespace_used_bytes", "Bytes held per namespace.", ["namespace"],
                [((ns_label(ns),), v["used_bytes"]) for ns, v in (pool.get("namespaces") or {}).items()])
    yield gauge("namespace_quota_bytes", "Quota per namespace ('*' = every namespace without its own).", ["namespace"],
                [((ns_label(ns),), q) for ns, q in (pool.get("quotas") or {}).items()])
    yield counter("placement_bytes", "Bytes of committed blocks by where their pages were found.", ["result"],
                  [(("on_node",), pool["placement_verified_bytes"]), (("elsewhere",), pool["placement_misplaced_bytes"]),
                   (("unverified",), pool["placement_unverified_bytes"])])
    if has_r:
        up = red.get("up")
        yield gauge("redis_up", "1 when the last Redis operation succeeded, 0 after a failure, -1 not tried yet.",
                    rows=[((), -1 if up is None else int(bool(up)))])
        yield counter("redis_errors", "Redis errors by operation (full = OOM from maxmemory).", ["op"],
                      [(("put",), red["put_errors"]), (("get",), red["get_errors"]), (("full",), red["full_errors"])])
        yield gauge("redis_queue_bytes", "Bytes waiting to be written to Redis.", rows=[((), red["queue_bytes"])])
        yield counter("redis_bad_values", "Redis values refused (truncated, foreign, CRC mismatch).",
                      rows=[((), red["bad_values"])])
        yield counter("redis_refused_values", "Redis values refused by reason (too_large: over --redis-max-value, "
                      "never read whole; forged: no valid MAC while --redis-key-file is set).", ["reason"],
                      [(("too_large",), red.get("too_large_values", 0)),
                       (("forged",), red.get("forged_values", 0))])
        yield counter("redis_deadline_expired", "Redis reads cut off at their --redis-timeout deadline.",
                      rows=[((), red.get("deadline_expired", 0))])
        yield gauge("redis_load_seconds_per_block", "Mean seconds to read one block from Redis.",
                    rows=[((), red.get("load_seconds_per_block"))])
    yield gauge("uptime_seconds", "Seconds since the server started.", rows=[((), srv["uptime_s"])])
    info = Gauge(P + "pool_info", "The pool's node, id, placement check and socket.",
                 labels=["node", "pool_id", "numa_method", "socket"])
    info.add_metric([str(srv["node"]), srv["pool_id"], srv["numa_method"], srv["socket"]], 1.0)
    yield info


def _ms(v):
    return None if v is None else float(v) / 1e3


class _Collector:
    def __init__(self, stats_fn: Callable[[], dict]):
        self.stats_fn = stats_fn

    def collect(self):
        try:
            st = self.stats_fn()
        except Exception as e:  # a scrape never kills the server
            log.warning("metrics: stats failed: %s", e)
            return
        yield from families(st)


def render(stats: dict) -> str:
    """The Prometheus text exposition of one stats snapshot."""
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(lambda: stats))
    return generate_latest(reg).decode()


class MetricsExporter:
    """Serve ``stats_fn()`` as Prometheus metrics on ``addr:port`` and/or
    write them to ``path`` every ``interval`` seconds.

    Raises:
        ImportError: prometheus_client is missing.
        OSError: the port cannot be bound, or the file's directory is not writable.
    """

    def __init__(self, stats_fn: Callable[[], dict], port: Optional[int] = None, addr: str = "127.0.0.1",
                 path: Optional[str] = None, interval: float = 5.0):
        _prom()
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(stats_fn))
        self.port, self.addr, self.path, self.interval = port, addr, path, float(interval)
        self._http = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if path is not None:
            d = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                raise OSError(f"cxlalloc option '--metrics-file': the directory {d!r} does not exist or is not "
                              "writable")

    def start(self) -> "MetricsExporter":
        from prometheus_client import start_http_server

        if self.port is not None:
            try:
                got = start_http_server(self.port, addr=self.addr, registry=self.registry)
            except OSError as e:
                raise OSError(f"cxlalloc option '--metrics-port': cannot listen on {self.addr}:{self.port}: "
                              f"{e.strerror or e}") from None
            self._http = got if isinstance(got, tuple) else None
        if self.path is not None:
            self.write()
            self._thread = threading.Thread(target=self._loop, name="kv-metrics-file", daemon=True)
            self._thread.start()
        return self

    def write(self) -> None:
        """Rewrite the metrics file now (atomically)."""
        from prometheus_client import write_to_textfile

        write_to_textfile(self.path, self.registry)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.write()
            except Exception as e:
                log.warning("metrics: cannot write %s: %s", self.path, e)

    def describe(self) -> str:
        parts = []
        if self.port is not None:
            parts.append(f"http://{self.addr}:{self.port}/metrics")
        if self.path is not None:
            parts.append(f"{self.path} every {self.interval:g} s")
        return ", ".join(parts)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.path is not None:
            try:
                self.write()  # the final state
            except Exception:
                pass
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
