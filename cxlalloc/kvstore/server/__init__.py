"""``cxlalloc kv-server``: one pool of KV blocks for every GPU process of a machine.

    python -m cxlalloc kv-server --numa-node auto --size 64GiB --socket /run/cxlalloc/kv.sock
    python -m cxlalloc kv-server --status [--json] --socket /run/cxlalloc/kv.sock

The server owns one shared-memory pool (a sparse memfd of exactly ``--size``
bytes, bound to the chosen NUMA node before first touch: the CXL node where
one is present, committed only as blocks are written), the index (key ->
block, LRU, pins, per-namespace quotas: :class:`~cxlalloc.kvstore.index.BlockIndex`)
and the statistics.  It never touches a GPU: clients
(:class:`cxlalloc.kvstore.client.RemoteBlockStore`, i.e.
``hf.wrap(model, kv_store="unix:///run/cxlalloc/kv.sock")``) receive the pool's
file descriptor over the socket (SCM_RIGHTS), map it, register it for their
GPU chunk by chunk on first use, and copy blocks in and out of it themselves;
the socket carries only lookups, reservations and commits
(:mod:`cxlalloc.kvstore.protocol`).  docs/kv-server.md has the protocol, the
block states and the crash rules.

:class:`KVServer` is the façade of three parts, each readable alone:

* :mod:`~cxlalloc.kvstore.server.state`: the pool, the index and the owners
  of leases and reservations, as plain methods taking a client id (no socket);
* :mod:`~cxlalloc.kvstore.server.transport`: bind, socket permissions,
  framing, accept, dispatch of each op to the state;
* :mod:`~cxlalloc.kvstore.server.jobs`: placement verification, rate
  sampling, the Redis tier's read-through and write-back.

Crash rules: a connection owns its leases (pinned blocks) and reservations
(WRITING blocks); when it closes for any reason the server drops the pins and
aborts the reservations (``BlockIndex.drop_owner``), so a client killed
mid-insert never publishes a half-written block.  A restarted server has a new
pool (a new ``pool_id``): clients notice it on reconnect and map the new one.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Optional, Sequence

from cxlalloc.config import format_bytes
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.server.jobs import REDIS_MODES, PlacementVerifier, RateSampler, RedisLink
from cxlalloc.kvstore.server.persist import PoolFile, restore
from cxlalloc.kvstore.server.state import DEFAULT_SLICE_KEYS, MAX_LEASES_PER_CLIENT, ServerState, log
from cxlalloc.kvstore.server.tenants import TenantSpec, Tenancy, split_sizes
from cxlalloc.kvstore.server.transport import (DEFAULT_BACKLOG, DEFAULT_FRAME_TIMEOUT_S, DEFAULT_IO_TIMEOUT_S,
                                               DEFAULT_MAX_BUFFERED, DEFAULT_MAX_FRAME, DEFAULT_MAX_OBJECTS,
                                               DEFAULT_HELLO_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S,
                                               DEFAULT_SOCKET_MODE, Transport, resolve_group)
from cxlalloc.policy import redis_write_back as write_back

__all__ = ["KVServer", "DEFAULT_CHUNK", "MAX_CHUNK", "REDIS_MODES", "MAX_LEASES_PER_CLIENT", "resolve_group", "log"]

DEFAULT_CHUNK = 256 << 20
MAX_CHUNK = 64 << 30             # one GPU registration (docs/sources.md#host-pinning)


class KVServer:
    """The pool, the index and the socket of a kv-server (use :func:`main` for the CLI).

    Args:
        size: pool bytes (exact; the mapping is rounded up to the page size).
        node: NUMA node of the pool.
        socket_path: unix socket to listen on.
        chunk_bytes: placement and client GPU-registration unit (page multiple, <= 64 GiB, <= size).
        socket_mode: permission bits of the socket file (who may attach).
        group: group (name or gid) of the socket file.
        quotas: ``{namespace: bytes}``; ``default_quota``: bytes for any other namespace.
        redis: a :class:`~cxlalloc.kvstore.tiers.redis.RedisTier` below the pool, or None.
        redis_mode: ``"evict"`` (blocks go to Redis when evicted) or ``"through"``
            (also when committed: other machines see them at once).
        strict_placement: drop a committed block whose pages are not on ``node``.
        max_clients: connections served at once (others are refused).
        allow_uids: if given, only these uids (and the server's own) may attach.
        node_reason: why this node (shown by --status).
        io_timeout: seconds a reply may take to be sent.
        max_frame, max_buffered, frame_timeout, max_objects, backlog, max_items: the
            transport's bounds (:class:`~cxlalloc.kvstore.server.transport.Transport`).
        max_reserve_bytes: slot bytes one client may hold unpublished (default the whole pool).
        tenants: :class:`~cxlalloc.kvstore.server.tenants.TenantSpec` s (``--tenant``):
            each gets a pool of its own (its SIZE, or an equal share of what
            ``size`` leaves), bound to its uids/gids; none: one pool for everyone.
        pool_file: a file recording every committed block (``--pool-file``;
            each tenant's ``PATH.NAME``): blocks it holds are restored at
            start, so hits survive a restart (:mod:`~cxlalloc.kvstore.server.persist`).
        pool_file_bytes: the most bytes each such file grows to between starts
            (default twice its pool).
        shared: ``{namespace: tenants that may write it}`` (``--shared-namespace``):
            every tenant may read those namespaces (a hit is copied from a
            writer's pool into the reader's own); the others' namespaces stay private.
        slice_keys: blocks a request handles under one hold of the server's lock (fair service).
        hello_timeout, idle_timeout: seconds to a connection's hello, and between a greeted
            connection's requests (0: for ever), then ``timeout`` and closed.
        max_clients_per_uid: connections of one uid at once (default ``max_clients``).
        max_pinned: slot bytes of blocks one client may hold pinned at once
            (``--max-pinned``): an int is bytes, a float in (0, 1] a share of
            each pool (default ``DEFAULT_MAX_PINNED_FRACTION``, 50 %).

    Raises:
        ValueError: a bad size/chunk/mode/group, naming the option.
        OSError: the socket cannot be created (its path is named).
    """

    def __init__(self, size: int, node: int, socket_path: str, *, chunk_bytes: int = DEFAULT_CHUNK,
                 socket_mode: int = DEFAULT_SOCKET_MODE, group=None, quotas: Optional[Dict[str, int]] = None,
                 default_quota: Optional[int] = None, redis=None, redis_mode: str = "evict",
                 strict_placement: bool = False, max_clients: int = 256, allow_uids: Optional[Sequence[int]] = None,
                 node_reason: str = "", io_timeout: float = DEFAULT_IO_TIMEOUT_S,
                 max_frame: int = DEFAULT_MAX_FRAME, max_buffered: int = DEFAULT_MAX_BUFFERED,
                 frame_timeout: float = DEFAULT_FRAME_TIMEOUT_S, max_objects: int = DEFAULT_MAX_OBJECTS,
                 backlog: int = DEFAULT_BACKLOG, max_reserve_bytes: Optional[int] = None,
                 tenants: Sequence[TenantSpec] = (), pool_file: Optional[str] = None,
                 pool_file_bytes: Optional[int] = None, shared: Optional[Dict[str, Sequence[str]]] = None,
                 max_items: int = P.DEFAULT_MAX_ITEMS, slice_keys: int = DEFAULT_SLICE_KEYS,
                 hello_timeout: float = DEFAULT_HELLO_TIMEOUT_S, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
                 max_clients_per_uid: Optional[int] = None, max_pinned=None):
        page = os.sysconf("SC_PAGESIZE")
        if chunk_bytes <= 0 or chunk_bytes % page or chunk_bytes > MAX_CHUNK:
            raise ValueError(f"cxlalloc option '--chunk': {format_bytes(chunk_bytes)} must be a multiple of the page "
                             f"size ({page} bytes) and at most 64 GiB")
        if size < chunk_bytes:
            raise ValueError(f"cxlalloc option '--size': {format_bytes(size)} is below one chunk "
                             f"({format_bytes(chunk_bytes)}, --chunk); use --size of at least "
                             f"{format_bytes(chunk_bytes)} or a smaller --chunk")
        write_back.check_mode(redis_mode)
        self.size = int(size)
        self.node = int(node)
        self.node_reason = node_reason
        self.chunk_bytes = int(chunk_bytes)
        self.socket_path = P.check_socket_path(socket_path)
        self.socket_mode = int(socket_mode)
        self.gid = resolve_group(group) if group is not None else None
        self.redis = redis
        self.redis_mode = redis_mode
        self.strict_placement = bool(strict_placement)
        self.max_clients = int(max_clients)
        self.allow_uids = None if allow_uids is None else {int(u) for u in allow_uids} | {os.geteuid()}
        self.io_timeout = float(io_timeout)
        self._threads: List[threading.Thread] = []
        self._stop = threading.Event()
        self.started = time.time()
        self._t0 = time.monotonic()
        self.ready_seconds = None

        self.tenancy = Tenancy(tenants)
        sizes = split_sizes(tenants, self.size, page) if tenants else {"": self.size}

        t0 = time.perf_counter()
        # One pool (its own sealed memfd), index, placement check and rate
        # sampler per tenant: a tenant's clients receive only its memfd.
        self.parts: Dict[str, tuple] = {}
        for name, tsize in sizes.items():
            tchunk = min(self.chunk_bytes, tsize // page * page)
            reserve = min(max_reserve_bytes, tsize) if max_reserve_bytes else None
            pinned = (int(max_pinned * tsize) if isinstance(max_pinned, float) else min(int(max_pinned), tsize)) \
                if max_pinned else None
            st = ServerState(tsize, self.node, tchunk, quotas=quotas, default_quota=default_quota,
                             max_clients=self.max_clients, allow_uids=self.allow_uids,
                             max_reserve_bytes=reserve, tenant=name, slice_keys=slice_keys,
                             max_clients_per_uid=max_clients_per_uid, max_pinned_bytes=pinned)
            verifier = PlacementVerifier(st, self.strict_placement, page)
            st.placement = verifier
            if redis is not None:
                st.set_tier(RedisLink(st, redis, redis_mode, verifier))
            if pool_file:
                st.persist = PoolFile(f"{pool_file}.{name}" if name else pool_file,
                                      pool_file_bytes or 2 * tsize)
                n = restore(st, st.persist)
                log.info("restored %d blocks of %s from %s (%d torn records dropped)", n,
                         f"tenant {name!r}" if name else "the pool", st.persist.path,
                         st.persist.c["restore_torn_records"])
            self.parts[name] = (st, verifier, RateSampler(st))
        shared = {ns: frozenset(w) for ns, w in (shared or {}).items()}
        for ns, writers in shared.items():
            unknown = sorted(writers - set(self.parts)) if tenants else sorted(writers)
            if unknown:
                raise ValueError(f"cxlalloc option '--shared-namespace': {ns}={','.join(sorted(writers))} names "
                                 f"{', '.join(unknown)}, not a --tenant of this server"
                                 + ("" if tenants else " (it has none: a namespace is shared by everyone already)"))
        for st, _, _ in self.parts.values():
            st.shared = shared
            st.siblings = {n: p[0] for n, p in self.parts.items()}
        self.state, self.verifier, self.sampler = next(iter(self.parts.values()))
        self.pool_id = self.state.pool_id
        self.arena = self.state.arena
        self.index = self.state.index
        self.transport = Transport({n: p[0] for n, p in self.parts.items()}, self.socket_path, self.socket_mode,
                                   self.gid, self.io_timeout, self.stats, self._stop, max_frame=max_frame,
                                   max_buffered=max_buffered, frame_timeout=frame_timeout, max_objects=max_objects,
                                   backlog=backlog, tenancy=self.tenancy, max_items=max_items,
                                   hello_timeout=hello_timeout, idle_timeout=idle_timeout)
        self.map_seconds = time.perf_counter() - t0

    def start(self) -> "KVServer":
        """Listen and serve in background threads; returns at once."""
        t0 = time.perf_counter()
        self.transport.start()
        for tenant, (_, verifier, sampler) in self.parts.items():
            for target, args, name in ((sampler.run, (self._stop,), "kv-sampler"), (verifier.run, (), "kv-verify")):
                t = threading.Thread(target=target, args=args, name=f"{name}{'-' + tenant if tenant else ''}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
        self.ready_seconds = self.map_seconds + (time.perf_counter() - t0)
        return self

    def verify_pending(self) -> int:
        """Blocks waiting for (or in) their background placement check."""
        return sum(v.pending() for _, v, _ in self.parts.values())

    def committed_bytes(self) -> int:
        """Bytes of the pool the kernel has committed (allocated pages of the memfd)."""
        return sum(st.committed_bytes() for st, _, _ in self.parts.values())

    def stats(self, tenant: Optional[str] = None) -> dict:
        """Everything ``--status`` and the metrics show (bytes, counts, seconds).

        ``{"server": {...}, "pool": {...}, "rates": {...}, "redis": {...} | None, "clients": [...]}``,
        and with tenants ``"tenants": {name: its pool}``.  ``tenant``: show
        only that tenant (what a client of it may see; ``server.tenant`` names
        it); None (the operator): every tenant, ``pool`` their sum.
        """
        names = list(self.parts) if tenant is None else [tenant]
        snaps = {n: self.parts[n][0].snapshot() for n in names}
        if len(snaps) == 1:
            pool, clients, c, counters = next(iter(snaps.values()))
            rates = self.parts[names[0]][2].rates(counters)
        else:
            pool = _merge_pools({n: sn[0] for n, sn in snaps.items()})
            clients = [cl for sn in snaps.values() for cl in sn[1]]
            c = {k: sum(sn[2][k] for sn in snaps.values()) for k in snaps[names[0]][2]}
            for k in ("peak_clients", "lock_hold_us_max", "drop_us_max"):  # maxima, not sums
                c[k] = max(sn[2][k] for sn in snaps.values())
            rates = _merge_pools({n: self.parts[n][2].rates(sn[3]) for n, sn in snaps.items()})
        server = {"pid": os.getpid(), "pool_id": self.parts[names[0]][0].pool_id if tenant else self.pool_id, "protocol": P.PROTOCOL_VERSION,
                  "socket": os.path.abspath(self.socket_path), "socket_mode": f"{self.socket_mode:04o}",
                  "socket_gid": self.gid, "node": self.node, "node_reason": self.node_reason,
                  "numa_method": self.arena.numa_method, "started_utc": time.strftime(
                      "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
                  "uptime_s": round(time.monotonic() - self._t0, 1), "ready_s": self.ready_seconds,
                  "clients": len(clients), "peak_clients": c["peak_clients"], "connections_total": c["connections"],
                  "refused_full": c["refused_full"], "refused_denied": c["refused_denied"],
                  "refused_too_large": c["refused_too_large"], "refused_busy": c["refused_busy"],
                  "refused_timeout": c["refused_timeout"], "bad_frames": c["bad_frames"],
                  "limits": {"max_frame": self.transport.max_frame, "max_buffered": self.transport.max_buffered,
                             "frame_timeout_s": self.transport.frame_timeout,
                             "max_objects": self.transport.max_objects, "backlog": self.transport.backlog,
                             "max_items": self.transport.max_items, "slice_keys": self.state.slice_keys,
                             "hello_timeout_s": self.transport.hello_timeout,
                             "idle_timeout_s": self.transport.idle_timeout,
                             "max_clients_per_uid": self.state.max_clients_per_uid,
                             "max_clients": self.max_clients, "max_reserve": self.state.max_reserve_bytes,
                             "max_pinned": self.state.max_pinned_bytes},
                  "protocol_errors": c["protocol_errors"], "bad_requests": c["bad_requests"],
                  "corrupt_blocks": c["corrupt_blocks"], "requests": c["requests"],
                  "buffered_peak_bytes": self.transport.buffered_peak,
                  "refused_per_uid": c["refused_per_uid"], "closed_no_hello": c["closed_no_hello"],
                  "closed_idle": c["closed_idle"], "refused_max_items": c["refused_max_items"],
                  "refused_max_objects": c["refused_max_objects"],
                  "redis_mode": self.redis_mode if self.redis is not None else None,
                  "strict_placement": self.strict_placement}
        out = {"server": server, "pool": pool, "rates": rates,
               "redis": self.redis.stats() if self.redis is not None else None, "clients": clients}
        if self.tenancy.multi:
            server["tenant"] = tenant
            out["tenants"] = {n: sn[0] for n, sn in snaps.items()}
            for n, sn in snaps.items():
                for cl in sn[1]:
                    cl["tenant"] = n
        return out

    def check(self) -> None:
        """The index invariants (tests)."""
        for st, _, _ in self.parts.values():
            st.check()

    # ------------------------------------------------------------ stop
    def stop(self, redis_flush_s: float = 2.0) -> None:
        """Stop serving: close the socket (and remove its file), drop every
        client, send what the Redis tier has queued (for up to ``redis_flush_s``)."""
        if self._stop.is_set():
            return
        self._stop.set()
        for st, verifier, _ in self.parts.values():
            verifier.stop()
            if st.persist is not None:
                st.persist.close()
        self.transport.stop()
        if self.redis is not None:
            self.redis.close(redis_flush_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _merge_pools(pools: Dict[str, dict]) -> dict:
    """The sum of several tenants' ``pool`` (or ``rates``) dicts: numbers added,
    ``namespaces``/``quotas`` keyed ``tenant/ns``, ratios recomputed or dropped."""
    out: dict = {}
    for name, p in pools.items():
        for k, v in p.items():
            if isinstance(v, dict):
                out.setdefault(k, {}).update({f"{name}/{ns}": x for ns, x in v.items()})
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    if "lookup_blocks" in out:
        out["hit_rate"] = out["hit_blocks"] / out["lookup_blocks"] if out["lookup_blocks"] else 0.0
    for k in ("index_bytes_per_block", "window_s"):
        if k in out:
            out[k] = max(p.get(k) or 0 for p in pools.values())
    if "window_s" in out:
        out["hit_rate"] = None
    return out
