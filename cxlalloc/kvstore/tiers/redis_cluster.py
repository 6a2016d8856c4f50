"""Cluster addressing for the RESP tier: a Redis/Valkey **Cluster** below a pool.

:class:`ClusterRouter` is what :class:`~cxlalloc.kvstore.tiers.redis.RedisTier`
uses for a ``redis+cluster://`` (``rediss+cluster://``) URL instead of one
``redis.Redis`` connection.  The cluster protocol itself (node discovery from
``CLUSTER SLOTS``/``CLUSTER SHARDS``, the slot map, ``MOVED`` slot updates,
topology refresh, one connection pool per node, TLS/AUTH) is redis-py's
``RedisCluster`` (its ``NodesManager``); docs/kv-server.md#redis-cluster says why
redis-py and not valkey-glide.  What is added here is the part redis-py's own
pipeline does not do for a cache:

* **Grouped by node, pipelined, at once.**  A read of N keys is one
  pipeline of ``GET`` per key per primary (``GETRANGE`` up to a limit when the
  tier bounds its reads; keys grouped by hash slot, slots by
  owner); every node's pipeline is written before any reply is read, so the
  nodes work at the same time (one thread, no hand-off); no ``MGET`` across slots
  (``CROSSSLOT``), no hash tags (a hot prefix is spread over every node).
  One ``GET`` per key rather than one ``MGET`` per slot: during a slot
  migration a multi-key ``MGET`` answers ``TRYAGAIN`` when the slot's keys are
  split between the two nodes; single keys are always served or redirected.
* **A node down is misses for its slots only.**  redis-py's pipeline raises for
  the whole batch when one node refuses; here each node's pipeline fails on
  its own (its keys are misses, counted in ``node_errors``), the others'
  values are returned, and a node that failed is skipped for a backoff
  (0.25 s doubling to 10 s) instead of being waited for again.
* **No stall beyond the timeout.**  A node that sends nothing for
  ``timeout`` seconds is left behind (its connection dropped, its keys
  misses); a node that is gone (refused, reset) fails at once.  A node that
  keeps answering is read to the end: a large read under load is slow, not
  missed.
* **MOVED and ASK followed.**  ``MOVED`` updates the slot map (redis-py's
  ``move_slot``) and the key is asked again of the new owner in the same call;
  ``ASK`` sends ``ASKING`` + ``GET`` to the importing node.  Either also
  schedules a full topology refresh.
* **Topology refreshed in the background** after a node error or a redirect
  (at most every ``REFRESH_MIN_S``): a failover (a replica promoted) or a
  resharding is learnt without a caller waiting for it.

Values, MACs, the write queue and the counters stay the tier's: this module only
moves ``GET``/``SET`` to the right nodes.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from cxlalloc.kvstore.tiers.redis_format import HEADER_BYTES, cluster_seeds, first_seed_url

log = logging.getLogger("cxlalloc.kvstore.redis")

REFRESH_MIN_S = 0.5
_BACKOFF_MIN_S = 0.25
_BACKOFF_MAX_S = 10.0


def _commands(ops: List[tuple]) -> Tuple[List[tuple], List[int]]:
    """The RESP commands of ``ops`` (("get", key) / ("set", key, value, ex)
    / "ask*" variants preceded by ASKING) and the index of each op's reply."""
    cmds: List[tuple] = []
    at: List[int] = []
    for op in ops:
        if op[0].startswith("ask"):
            cmds.append(("ASKING",))
        if op[0].endswith("get"):  # ("get", key[, limit]): GETRANGE of at most limit + 1 bytes with a limit
            cmds.append(("GET", op[1]) if len(op) < 3 or op[2] is None else ("GETRANGE", op[1], 0, op[2]))
        else:
            cmds.append(("SET", op[1], op[2]) + (("EX", op[3]) if op[3] is not None else ()))
        at.append(len(cmds) - 1)
    return cmds, at


class ClusterRouter:
    """Reads and writes of single keys spread over a Redis/Valkey Cluster.

    Args:
        url: the seed nodes, ``redis://[user:password@]host:port[,host:port...]``
            (already without ``+cluster``; the database must be 0: a cluster has
            one); redis-py's ``RedisCluster`` gets the first from the URL and the
            others as ``startup_nodes``, and tries them in turn.
        timeout: seconds for each connect, read and write, and the longest a
            read waits for a node.
        redis_kwargs: passed to ``redis.RedisCluster`` (AUTH, TLS, ...).

    The ``RedisCluster`` client is made on first use and again after a failure
    (its constructor connects), so a tier whose cluster is down at start-up
    still starts; ``ready()`` says whether a slot map is known.
    """

    def __init__(self, url: str, timeout: float, redis_kwargs: dict):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        self._url = url
        self.timeout = float(timeout)
        self._kw = dict(socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                        retry=Retry(NoBackoff(), 0),
                        require_full_coverage=False)
        self._kw.update(redis_kwargs)
        self._rc = None
        self._rc_lock = threading.Lock()
        self._rc_next_try = 0.0
        self._rc_backoff = _BACKOFF_MIN_S
        self._refresh_at = 0.0          # earliest next background refresh
        self._refreshing = False
        self._lock = threading.Lock()
        self._node_down: Dict[str, float] = {}  # node name -> down until (monotonic)
        self._node_backoff: Dict[str, float] = {}
        self.c = collections.Counter()
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cxlalloc-redis-topology")
        self._closed = False
        self._primaries: List[str] = []

    # ------------------------------------------------------------ topology
    def client(self):
        """The ``RedisCluster`` (made now if needed); None while no seed answers.

        Raises nothing: a failure to reach the cluster is counted
        (``topology_errors``) and retried after a backoff."""
        rc = self._rc
        if rc is not None:
            return rc
        with self._rc_lock:
            if self._rc is not None:
                return self._rc
            now = time.monotonic()
            if now < self._rc_next_try or self._closed:
                return None
            try:
                self._rc, self.standalone = _open_cluster(self._redis, self._url, self._kw)
                if not self.standalone:
                    self._rc_backoff = _BACKOFF_MIN_S
                    self._learn_primaries()
            except (ValueError, TypeError):
                raise
            except Exception as e:
                self.c["topology_errors"] += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._rc_next_try = now + self._rc_backoff
                self._rc_backoff = min(self._rc_backoff * 2, _BACKOFF_MAX_S)
                return None
            return self._rc

    last_error: Optional[str] = None
    standalone = False

    def ready(self) -> bool:
        """True once a slot map is known and some primary is not in its backoff."""
        return self._rc is not None and not self.down()

    def down(self) -> bool:
        """True while no seed node answered, or every primary failed (within
        their backoffs): every key is a miss."""
        rc = self._rc
        if rc is None:
            return time.monotonic() < self._rc_next_try
        names = [rc.node.name] if self.standalone else self._primaries
        return bool(names) and all(self._is_down(n) for n in names)

    def _learn_primaries(self) -> None:
        """Remember the primaries of the slot map just read (a failed refresh keeps the last ones)."""
        nm = self._rc.nodes_manager
        self._primaries = sorted({v[0].name for v in list(nm.slots_cache.values()) if v})

    def refresh_soon(self) -> None:
        """Re-read the topology in the background (at most every REFRESH_MIN_S)."""
        if self.standalone:
            return
        now = time.monotonic()
        with self._lock:
            if self._refreshing or now < self._refresh_at or self._rc is None or self._closed:
                return
            self._refreshing = True
            self._refresh_at = now + REFRESH_MIN_S
        try:
            self._pool.submit(self._refresh)
        except RuntimeError:  # closed
            with self._lock:
                self._refreshing = False

    def _refresh(self) -> None:
        rc = self._rc
        try:
            if rc is not None:
                rc.nodes_manager.initialize()
                self.c["topology_refreshes"] += 1
                self._learn_primaries()
        except Exception as e:
            self.c["topology_errors"] += 1
            self.last_error = f"{type(e).__name__}: {e}"
            with self._lock:  # no node gave a slot map: every known primary counts as down for its backoff
                for name in self._primaries:
                    b = self._node_backoff.get(name, _BACKOFF_MIN_S)
                    self._node_down[name] = max(self._node_down.get(name, 0.0), time.monotonic() + b)
        finally:
            with self._lock:
                self._refreshing = False

    def _node_ok(self, name: str) -> None:
        if name in self._node_down:
            with self._lock:
                self._node_down.pop(name, None)
                self._node_backoff.pop(name, None)

    def _node_failed(self, name: str, exc: BaseException) -> None:
        with self._lock:
            b = self._node_backoff.get(name, _BACKOFF_MIN_S)
            self._node_down[name] = time.monotonic() + b
            self._node_backoff[name] = min(b * 2, _BACKOFF_MAX_S)
            self.c["node_errors"] += 1
            self.last_error = f"{name}: {type(exc).__name__}: {exc}"
        self.refresh_soon()

    def _is_down(self, name: str) -> bool:
        until = self._node_down.get(name)
        return until is not None and time.monotonic() < until

    def _group(self, rc, rkeys: Sequence[str]) -> Tuple[Dict[str, tuple], List[int]]:
        """{node name: (node, [indices])} for the keys' primaries; indices of
        keys whose slot no node covers or whose node is in its backoff."""
        if self.standalone:
            if self._is_down(rc.node.name):
                return {}, list(range(len(rkeys)))
            return {rc.node.name: (rc.node, list(range(len(rkeys))))}, []
        nm = rc.nodes_manager
        by_node: Dict[str, tuple] = {}
        skipped: List[int] = []
        for i, k in enumerate(rkeys):
            try:
                node = nm.get_node_from_slot(rc.keyslot(k))
            except Exception:
                skipped.append(i)
                continue
            if self._is_down(node.name):
                skipped.append(i)
                self.refresh_soon()
                continue
            ent = by_node.get(node.name)
            if ent is None:
                by_node[node.name] = ent = (node, [])
            ent[1].append(i)
        return by_node, skipped

    # ------------------------------------------------------------ per node
    def _fan_out(self, rc, jobs: Dict[str, tuple]) -> Dict[str, object]:
        """Run {name: (node, ops)}: every node's pipeline is written first,
        then the replies are read, so the nodes work at once.  A node that
        sends nothing for ``timeout`` seconds is left behind (its keys are
        misses; a node that is gone fails at once); a node that keeps sending
        is read to the end, however large the read.  Returns {name: [reply or
        exception per op]} or {name: exception} for a node that failed."""
        r_exc = self._redis.exceptions
        sent: List[tuple] = []
        out: Dict[str, object] = {}
        try:
            for name, (node, ops) in jobs.items():
                cmds, at = _commands(ops)
                pool = rc.get_redis_connection(node).connection_pool
                conn = None
                try:
                    conn = pool.get_connection()
                    conn.send_packed_command(conn.pack_commands(cmds))
                except Exception as e:
                    if conn is not None:
                        conn.disconnect()
                        pool.release(conn)
                    out[name] = e
                    continue
                sent.append((name, pool, conn, cmds, at))
            for name, pool, conn, cmds, at in sent:
                replies: List[object] = []
                try:
                    for _ in cmds:
                        try:
                            replies.append(conn.read_response(timeout=self.timeout))
                        except r_exc.ResponseError as e:  # MOVED, ASK, OOM, ...: this command only
                            replies.append(e)
                except Exception as e:
                    conn.disconnect()  # replies may still be in flight: never reuse it
                    out[name] = e
                else:
                    out[name] = [replies[i] for i in at]
                finally:
                    pool.release(conn)
        except BaseException:
            for name, pool, conn, cmds, at in sent:
                if name not in out:
                    conn.disconnect()
                    pool.release(conn)
            raise
        return out

    def _is_conn_error(self, exc: BaseException) -> bool:
        r = self._redis
        return isinstance(exc, (r.exceptions.ConnectionError, r.exceptions.TimeoutError, OSError, TimeoutError))

    # ------------------------------------------------------------ API
    def get(self, rkeys: Sequence[str]) -> List[Optional[bytes]]:
        """The values of ``rkeys`` (None: missing, or its node down / not
        answering / redirected twice).  Raises nothing."""
        return self.get_status(rkeys)[0]

    def get_status(self, rkeys: Sequence[str], limit: Optional[int] = None) -> Tuple[List[Optional[bytes]], int, int]:
        """:meth:`get` and the nodes that answered / failed; ``limit``: ``GETRANGE`` up to ``limit + 1`` bytes."""
        out: List[Optional[bytes]] = [None] * len(rkeys)
        answered = failed = 0
        rc = self.client()
        if rc is None:
            self.c["skipped_keys"] += len(rkeys)
            return out, 0, 1
        by_node, skipped = self._group(rc, rkeys)
        self.c["skipped_keys"] += len(skipped)
        todo = {name: (node, [("get", rkeys[i], limit) for i in idx]) for name, (node, idx) in by_node.items()}
        where = {name: idx for name, (node, idx) in by_node.items()}
        for _attempt in range(2):  # the first round, and one for the redirected keys
            if not todo:
                break
            self.c["node_pipelines"] += len(todo)
            results = self._fan_out(rc, todo)
            again: Dict[str, tuple] = {}
            again_where: Dict[str, List[int]] = {}
            for name, res in results.items():
                if isinstance(res, BaseException):
                    self._node_failed(name, res)
                    self.c["node_error_keys"] += len(where[name])
                    failed += 1
                    continue
                self._node_ok(name)
                answered += 1
                for i, v in zip(where[name], res):
                    if isinstance(v, BaseException):
                        tgt = self._redirect(rc, v)
                        if tgt is None:
                            self.c["key_errors"] += 1
                            continue
                        node, kind = tgt
                        ent = again.setdefault(node.name, (node, []))
                        ent[1].append((kind + "get" if kind == "ask" else "get", rkeys[i], limit))
                        again_where.setdefault(node.name, []).append(i)
                    else:
                        out[i] = v
            todo, where = again, again_where
        return out, answered, failed

    def _redirect(self, rc, exc):
        """(node, "moved"|"ask") for a MOVED/ASK reply (the slot map updated
        for MOVED, a refresh scheduled); None for another error."""
        ex = self._redis.exceptions
        if isinstance(exc, ex.MovedError):
            self.c["moved"] += 1
            try:
                rc.nodes_manager.move_slot(exc)
            except Exception:
                pass
            self.refresh_soon()
            node = rc.nodes_manager.get_node(host=exc.host, port=exc.port)
            if node is None:
                return None
            return node, "moved"
        if isinstance(exc, ex.AskError):
            self.c["ask"] += 1
            node = rc.nodes_manager.get_node(host=exc.host, port=exc.port)
            if node is None:
                from redis.cluster import PRIMARY, ClusterNode

                node = ClusterNode(exc.host, exc.port, PRIMARY)
                node.redis_connection = None
                try:
                    rc.nodes_manager.nodes_cache[node.name] = node
                    rc.nodes_manager.create_redis_connections([node])
                except Exception:
                    return None
            self.refresh_soon()
            return node, "ask"
        if isinstance(exc, (ex.ClusterDownError, ex.TryAgainError)):
            self.refresh_soon()
        return None

    def set_many(self, items: Sequence[Tuple[str, bytes]], ex: Optional[int]) -> List[object]:
        """``SET`` each (key, value) (``EX ex`` when given) on its primary.
        Returns per item: True (stored), a ``redis`` ResponseError (refused:
        OOM and the like), or a connection error / TimeoutError (its node is
        down or not answering: the caller may retry later).  Raises nothing."""
        out: List[object] = [None] * len(items)
        rc = self.client()
        if rc is None:
            e = self._redis.exceptions.ConnectionError(self.last_error or "no cluster node answers")
            return [e] * len(items)
        keys = [k for k, _ in items]
        by_node, skipped = self._group(rc, keys)
        for i in skipped:
            out[i] = self._redis.exceptions.ConnectionError("its node is down (backoff) or its slot uncovered")
        todo = {name: (node, [("set", items[i][0], items[i][1], ex) for i in idx])
                for name, (node, idx) in by_node.items()}
        where = {name: idx for name, (node, idx) in by_node.items()}
        for attempt in range(2):
            if not todo:
                break
            results = self._fan_out(rc, todo)
            again: Dict[str, tuple] = {}
            again_where: Dict[str, List[int]] = {}
            for name, res in results.items():
                if isinstance(res, BaseException):
                    self._node_failed(name, res)
                    for i in where[name]:
                        out[i] = res
                    continue
                self._node_ok(name)
                for i, v in zip(where[name], res):
                    if isinstance(v, BaseException):
                        tgt = self._redirect(rc, v) if attempt == 0 else None
                        if tgt is None:
                            out[i] = v
                            continue
                        node, kind = tgt
                        again.setdefault(node.name, (node, []))[1].append(
                            ("askset" if kind == "ask" else "set", items[i][0], items[i][1], ex))
                        again_where.setdefault(node.name, []).append(i)
                    else:
                        out[i] = True
            todo, where = again, again_where
        return out

    def config_get(self, pattern: str) -> dict:
        """``CONFIG GET`` of one primary (raises as redis-py does)."""
        rc = self.client()
        if rc is None:
            raise self._redis.exceptions.ConnectionError(self.last_error or "no cluster node answers")
        node = rc.node if self.standalone else rc.get_primaries()[0]
        return rc.get_redis_connection(node).config_get(pattern)

    def stats(self) -> dict:
        """``nodes``, ``primaries``, ``slots_covered``, ``nodes_down`` and the counters (``node_errors``,
        ``node_error_keys``, ``moved``, ``ask``, ``topology_refreshes``, ``topology_errors``,
        ``skipped_keys``, ``key_errors``, ``node_pipelines``); never does I/O."""
        rc = self._rc
        out = {k: int(self.c.get(k, 0)) for k in (
            "node_errors", "node_error_keys", "moved", "ask", "topology_refreshes", "topology_errors",
            "skipped_keys", "key_errors", "node_pipelines")}
        now = time.monotonic()
        with self._lock:
            out["nodes_down"] = sorted(n for n, t in self._node_down.items() if t > now)
        if rc is not None and self.standalone:
            out.update(nodes=1, primaries=1, slots_covered=16384, standalone=True)
        elif rc is not None:
            nm = rc.nodes_manager
            try:
                out["nodes"] = len(nm.nodes_cache)
                out["primaries"] = len({v[0].name for v in nm.slots_cache.values() if v})
                out["slots_covered"] = sum(1 for v in nm.slots_cache.values() if v)
            except Exception:
                pass
        return out

    def close(self) -> None:
        """Close every node's connections and stop the worker threads."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        rc = self._rc
        if rc is not None:
            try:
                rc.close()
            except Exception:
                pass


class _Standalone:
    """A one-server stand-in for ``RedisCluster`` (``node``, ``get_redis_connection``, ``close``)."""

    def __init__(self, redis_mod, url: str, kw: dict):
        from redis.cluster import PRIMARY, ClusterNode

        kw = {k: v for k, v in kw.items() if k not in ("require_full_coverage",)}
        r = redis_mod.Redis.from_url(url, **kw)
        ck = r.connection_pool.connection_kwargs
        self.node = ClusterNode(ck.get("host", "?"), ck.get("port", 0), PRIMARY, redis_connection=r)

    def get_redis_connection(self, node):
        return node.redis_connection

    def close(self) -> None:
        self.node.redis_connection.close()


def _open_cluster(redis_mod, url: str, kw: dict):
    """``(client, standalone)`` for a cluster URL: redis-py's ``RedisCluster`` over every seed of the URL
    (tried in turn: a dead first seed is skipped), or, for one server without cluster mode, that server as
    the only node (:class:`_Standalone`, said once).  Raises what connecting raises otherwise."""
    from redis.cluster import ClusterNode

    seeds = [ClusterNode(h, p) for h, p in cluster_seeds(url)[1:]]
    try:
        return redis_mod.RedisCluster.from_url(first_seed_url(url), startup_nodes=seeds, **kw), False
    except (ValueError, TypeError):
        raise
    except Exception as e:
        if not ("cluster" in str(e).lower() and "not enabled" in str(e).lower() or "support disabled" in str(e)):
            raise
    # One server without cluster mode: the same tier, every slot on it.
    log.warning("cxlalloc kv: %s is one server, not a cluster node (cluster mode not enabled): "
                "used as one node (the URL for one server is 'redis://host:port/0')", url.split("@")[-1])
    return _Standalone(redis_mod, first_seed_url(url), kw), True


def write_batch(tier, router: ClusterRouter, batch: List[tuple]) -> None:
    """The writer thread's batch on a cluster (``RedisTier._write`` there):
    per item (``(nskey, value[, tries])``), stored, refused (counted,
    dropped: OOM is ``full_errors``) or its node unreachable (put back once,
    behind the queue, if it fits; dropped on the second failure), so one
    down node never holds up the others' writes."""
    t0 = time.perf_counter()
    ex = max(1, int(round(tier.ttl))) if tier.ttl is not None else None
    results = router.set_many([(tier._rkey(item[0]), item[1]) for item in batch], ex)
    retry = []
    for item, res in zip(batch, results):
        value = item[1]
        with tier._lock:
            if res is True:
                tier.c["put_blocks"] += 1
                tier.c["put_bytes"] += len(value) - HEADER_BYTES
            elif tier._is_conn_error(res):
                tier.c["put_errors"] += 1
                tier.last_error = f"{type(res).__name__}: {res}"
                if len(item) == 2:
                    retry.append((item[0], item[1], 1))
                else:
                    tier.c["dropped_blocks"] += 1
            else:
                text = str(res)
                tier.c["full_errors" if ("OOM" in text or "maxmemory" in text) else "put_errors"] += 1
                tier.c["dropped_blocks"] += 1
                tier.last_error = f"{type(res).__name__}: {text}"
    if any(r is True for r in results):
        tier._ok()
    elif results and router.down():
        tier._failed(ConnectionError(router.last_error or "no cluster node answers"), "put")
    if retry:
        time.sleep(min(0.05, router.timeout))  # the topology refresh runs meanwhile
        with tier._cv:
            for item in retry:
                if tier._q_bytes + len(item[1]) <= tier.queue_bytes:
                    tier._q.append(item)
                    tier._q_bytes += len(item[1])
                else:
                    tier.c["dropped_blocks"] += 1
    with tier._lock:
        tier.c["put_seconds_us"] += int((time.perf_counter() - t0) * 1e6)


def cluster_info(router: "ClusterRouter") -> Dict[str, int]:
    """Memory of the primaries summed: used_memory, maxmemory (0 if any has
    none), and the policy of the first; {} when no primary answered."""
    rc = router.client()
    if rc is None:
        return {}
    used = cap = answered = 0
    unlimited = False
    policy = None
    for node in ([rc.node] if router.standalone else rc.get_primaries()):
        if router._is_down(node.name):
            continue
        try:
            mem = rc.get_redis_connection(node).info("memory")
        except Exception as e:
            if router._is_conn_error(e):
                router._node_failed(node.name, e)
            continue
        answered += 1
        used += int(mem.get("used_memory", 0))
        m = int(mem.get("maxmemory", 0))
        unlimited |= m == 0
        cap += m
        policy = policy or mem.get("maxmemory_policy")
    if not answered:
        return {}
    return {"used_memory": used, "maxmemory": 0 if unlimited else cap, "maxmemory_policy": policy}
