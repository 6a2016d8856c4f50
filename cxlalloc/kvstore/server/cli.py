"""``cxlalloc kv-server``: the command line of the shared KV cache server.

    python -m cxlalloc kv-server --numa-node auto --size 64GiB --socket PATH [--redis URL] ...
    python -m cxlalloc kv-server --status --socket PATH [--json]

Option parsing and validation (every bad value is one line naming the flag,
exit status 2, before any memory is mapped), the server's start-up and
signal handling, and ``--status`` (a query over the socket, printed as a table
or JSON).  The server itself is :class:`cxlalloc.kvstore.server.KVServer`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pwd
import signal
import socket
import sys
import threading
from typing import List, Optional

from cxlalloc import topology
from cxlalloc.config import format_bytes, parse_size, parse_size_or_fraction
from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.server import DEFAULT_CHUNK, REDIS_MODES, KVServer, log, resolve_group
from cxlalloc.kvstore.server.state import DEFAULT_SLICE_KEYS
from cxlalloc.kvstore.server.tenants import parse_tenant
from cxlalloc.kvstore.server.transport import (DEFAULT_BACKLOG, DEFAULT_FRAME_TIMEOUT_S, DEFAULT_HELLO_TIMEOUT_S,
                                               DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_OBJECTS)
from cxlalloc.cli_usage import OneLineParser

# ----------------------------------------------------------------- option parsing
def resolve_user(user) -> int:
    if isinstance(user, int) or (isinstance(user, str) and user.isdigit()):
        return int(user)
    try:
        return pwd.getpwnam(str(user)).pw_uid
    except KeyError:
        raise ValueError(f"cxlalloc option '--allow-user': no user named {user!r} on this machine") from None


def parse_mode(text: str) -> int:
    """``0660``, ``660`` or ``0o660`` -> 0o660.  Raises ValueError naming ``--socket-mode``."""
    t = str(text).strip().lower()
    t = t[2:] if t.startswith("0o") else t
    if not t or any(ch not in "01234567" for ch in t) or int(t, 8) > 0o777:
        raise ValueError(f"cxlalloc option '--socket-mode': {text!r} is not an octal file mode such as 0660 "
                         "(owner and group may attach) or 0600 (owner only)")
    return int(t, 8)


def parse_quota(text: str):
    """``NS=SIZE`` -> (ns, bytes); ``=SIZE`` is the default namespace (no cache_salt),
    ``*=SIZE`` every namespace without its own quota."""
    if "=" not in text:
        raise ValueError(f"cxlalloc option '--quota': {text!r} is not NAMESPACE=SIZE (e.g. --quota tenant-a=8GiB; "
                         "'=SIZE' for the default namespace, '*=SIZE' for every other)")
    ns, size = text.split("=", 1)
    return ns, parse_size(size.strip(), "--quota")


def choose_node(requested: str, sysfs_root: Optional[str] = None):
    """(node, reason) for ``--numa-node`` (``auto`` or a node id with memory).

    Raises:
        ValueError: naming ``--numa-node`` and the nodes with memory.
    """

    try:
        topo = topology.read_topology(sysfs_root)
    except Exception as e:
        if str(requested) in ("auto", "0"):
            return 0, f"node 0 (NUMA topology unavailable: {e})"
        raise ValueError(f"cxlalloc option '--numa-node': cannot read the NUMA topology ({e}); use 0 or auto") from None
    with_mem = [n for n in topo["nodes"] if n.get("has_memory")]
    ids = [n["id"] for n in with_mem]
    if str(requested).strip().lower() == "auto":
        choice = topology.choose_host_node(topo, -1, "auto")
        return int(choice["node"]), choice["reason"]
    try:
        node = int(str(requested).strip())
    except ValueError:
        node = None
    if node is None or node not in ids:
        raise ValueError(f"cxlalloc option '--numa-node': {requested!r} is not allowed; use auto or a node with "
                         f"memory: {', '.join(map(str, ids))}")
    n = next(x for x in with_mem if x["id"] == node)
    kind = "CXL" if n.get("cxl") else ("CPU-less" if not n.get("has_cpu") else "with CPUs")
    return node, f"node {node} ({kind}), as asked"


def node_total_bytes(node: int, sysfs_root: Optional[str] = None) -> int:

    topo = topology.read_topology(sysfs_root)
    return int(next(n["total_bytes"] for n in topo["nodes"] if n["id"] == node))


def make_parser(prog: str = "cxlalloc kv-server") -> argparse.ArgumentParser:
    p = OneLineParser(  # a bad flag is one line, not the usage block first (cxlalloc.cli_usage)
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A shared KV cache server: one pool of KV blocks in shared memory on one NUMA node (a CXL node "
                    "where present) for every GPU process of this machine. Clients: "
                    "hf.wrap(model, kv_store='unix://SOCKET').",
        epilog="docs/kv-server.md: protocol, crash rules, deployments, metrics.")
    p.add_argument("--socket", default=P.DEFAULT_SOCKET, help=f"unix socket path (default {P.DEFAULT_SOCKET})")
    p.add_argument("--status", action="store_true", help="print the running server's status and exit")
    p.add_argument("--json", action="store_true", help="with --status: machine-readable output")
    p.add_argument("--size", default=None, help="pool bytes: a size ('64GiB', '1TiB') or a share of the node's total "
                   "memory ('50%%'); exact, committed only as blocks are written")
    p.add_argument("--numa-node", default="auto", help="NUMA node of the pool: auto (a CPU-less/CXL node if any) or "
                   "a node id (default auto)")
    p.add_argument("--chunk", default=None, help="placement and client GPU-registration unit (default 256MiB, or the "
                   "pool when smaller; at most 64GiB; a block is at most one chunk)")
    p.add_argument("--socket-mode", default="0660", help="permission bits of the socket file: who may attach "
                   "(default 0660: owner and group)")
    p.add_argument("--group", default=None, help="group of the socket file (name or gid)")
    p.add_argument("--allow-user", action="append", default=None, metavar="USER",
                   help="only these users (name or uid; repeatable) may attach, checked by SO_PEERCRED")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME:USERS[:SIZE]",
                   help="a tenant with a pool of its own (SIZE, or an equal share of what --size leaves), bound to "
                        "the peer credentials of its USERS (comma list of users/uids and @groups/@gids); a process "
                        "of no tenant may not attach (repeatable; none: one pool for everyone)")
    p.add_argument("--shared-namespace", action="append", default=[], metavar="NS=TENANT[,TENANT]",
                   help="with --tenant: every tenant may read namespace NS, only these tenants write it (e.g. "
                        "public system prompts); other namespaces stay private to their tenant (repeatable)")
    p.add_argument("--pool-file", default=None, metavar="PATH",
                   help="record every committed block in PATH (tmpfs, a DAX file system, a file on a CXL-backed "
                        "mount; with --tenant, PATH.NAME each): a restarted server restores them (checksums "
                        "verified, torn records dropped), so hits survive a restart")
    p.add_argument("--pool-file-size", default=None, metavar="SIZE",
                   help="with --pool-file: the most bytes the file grows to between starts (default twice the pool)")
    p.add_argument("--quota", action="append", default=[], metavar="NS=SIZE",
                   help="bytes a namespace (cache_salt) may hold; '=SIZE' the default namespace, '*=SIZE' every "
                        "namespace without its own (repeatable)")
    p.add_argument("--max-clients", type=int, default=256, help="connections at once (default 256); one more is "
                   "answered 'limit' and closed")
    p.add_argument("--max-clients-per-uid", type=int, default=None, metavar="N",
                   help="connections of one user at once (default: --max-clients; the server's own user is not "
                        "capped); one more is answered 'limit' and closed")
    p.add_argument("--hello-timeout", type=float, default=DEFAULT_HELLO_TIMEOUT_S, metavar="S",
                   help=f"seconds from connecting to the hello (default {DEFAULT_HELLO_TIMEOUT_S:g}); a silent "
                        "connection is answered 'timeout' and closed")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S, metavar="S",
                   help="seconds a connection may wait between requests (default 0: for ever); an idle one is "
                        "answered 'timeout' and closed (its pins dropped)")
    p.add_argument("--max-frame", default="8MiB", metavar="SIZE",
                   help="bytes of one request (default 8MiB); a larger one is answered 'too_large' and closed")
    p.add_argument("--max-buffered", default="256MiB", metavar="SIZE",
                   help="bytes of partly received requests, all connections together (default 256MiB); past it a "
                        "request is answered 'busy' and closed")
    p.add_argument("--frame-timeout", type=float, default=DEFAULT_FRAME_TIMEOUT_S, metavar="S",
                   help="seconds from a request's first byte to its last (default 5); a slower one is answered "
                        "'timeout' and closed")
    p.add_argument("--max-objects", type=int, default=DEFAULT_MAX_OBJECTS, metavar="N",
                   help="maps and lists in one request (default 64); more is answered 'bad_request' and closed")
    p.add_argument("--max-items", type=int, default=P.DEFAULT_MAX_ITEMS, metavar="N",
                   help=f"elements of all lists and maps of one request together (default {P.DEFAULT_MAX_ITEMS}: "
                        f"a lookup of {P.MAX_KEYS} keys and room to spare); more is answered 'bad_request' and closed")
    p.add_argument("--slice-keys", type=int, default=DEFAULT_SLICE_KEYS, metavar="N",
                   help=f"blocks one request handles under one hold of the server's lock before the other clients "
                        f"run (default {DEFAULT_SLICE_KEYS}; 1 to {P.MAX_KEYS}): one client's 65,536-key requests "
                        "never stall the others")
    p.add_argument("--backlog", type=int, default=DEFAULT_BACKLOG, metavar="N",
                   help="connects queued before they are accepted (default 4096, capped by net.core.somaxconn)")
    p.add_argument("--max-reserve", default="100%", metavar="SIZE",
                   help="bytes one client may hold reserved and not yet committed (blocks rounded up to pages), "
                        "or a share of --size (default 100%%; lower it when clients do not trust each other); keys past it "
                        "get no slot, and a reserve of which none fits is answered 'limit'")
    p.add_argument("--max-pinned", default="50%", metavar="SIZE",
                   help="bytes of blocks one client may hold pinned at once (its open leases; blocks rounded up to "
                        "pages), or a share of --size (default 50%%; 10%% keeps 90%% of the pool for the others); "
                        "a lookup stops before the block that would pass it (the rest are misses), and one of "
                        "which no block fits is answered 'limit'")
    p.add_argument("--strict-placement", action="store_true", help="drop blocks whose pages are not on the node")
    p.add_argument("--redis", default=None, metavar="URL", help="a Redis/Valkey tier below the pool: "
                   "redis://[user:password@]host:port/db or rediss://... (TLS); a Redis/Valkey Cluster: "
                   "redis+cluster://host:port[,host:port...] (any nodes as seeds, tried in turn)")
    p.add_argument("--redis-mode", default="evict", choices=REDIS_MODES, help="evict: blocks go to Redis when "
                   "evicted from the pool (default); through: also when committed")
    p.add_argument("--redis-ttl", type=float, default=None, metavar="S", help="seconds a block lives in Redis")
    p.add_argument("--redis-prefix", default="cxlalloc:kv:", help="key prefix in Redis (default cxlalloc:kv:)")
    p.add_argument("--redis-queue", default="256MiB", help="bytes of evicted blocks waiting for Redis; past it "
                   "blocks are dropped, never waited for (default 256MiB)")
    p.add_argument("--redis-timeout", type=float, default=2.0, metavar="S", help="seconds per Redis operation "
                   "(default 2)")
    p.add_argument("--redis-max-value", default="64MiB", metavar="SIZE",
                   help="bytes of one block read back from Redis (default 64MiB); a larger value is never read "
                        "whole (refused, counted in too_large_values)")
    p.add_argument("--redis-password-file", default=None, metavar="PATH", help="read the AUTH password from a file "
                   "(keeps it out of the command line)")
    p.add_argument("--redis-key-file", default=None, metavar="PATH", help="authenticate Redis values with a keyed "
                   "BLAKE2b MAC whose key is in PATH (mode 0600, at least 16 bytes): values written with it, values "
                   "without a valid MAC refused (forged_values); without it anyone who can write the Redis database "
                   "can inject K/V (docs/kv-server.md, threat model)")
    p.add_argument("--redis-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a redis-py connection option, e.g. ssl_ca_certs=/etc/ssl/ca.pem, ssl_certfile=..., "
                        "ssl_keyfile=..., ssl_cert_reqs=required, username=... (repeatable)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics over HTTP on this port")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--metrics-file", default=None, metavar="PATH", help="write Prometheus text metrics to PATH "
                   "(node_exporter textfile), atomically")
    p.add_argument("--metrics-interval", type=float, default=5.0, metavar="S", help="seconds between metrics-file "
                   "writes (default 5)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _coerce(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def redis_options(args) -> dict:
    out = {}
    for pair in args.redis_option:
        if "=" not in pair:
            raise ValueError(f"cxlalloc option '--redis-option': {pair!r} is not KEY=VALUE (e.g. "
                             "ssl_ca_certs=/etc/ssl/ca.pem)")
        k, v = pair.split("=", 1)
        out[k.strip()] = _coerce(v.strip())
    if args.redis_password_file:
        try:
            with open(args.redis_password_file) as f:
                out["password"] = f.read().strip()
        except OSError as e:
            raise ValueError(f"cxlalloc option '--redis-password-file': cannot read {args.redis_password_file!r}: "
                             f"{e.strerror}") from None
    return out


def transport_limits(args, size: int) -> dict:
    """The per-request bounds of the command line as KVServer arguments.  Raises ValueError naming the option."""
    out = {"max_frame": parse_size(args.max_frame, "--max-frame"),
           "max_buffered": parse_size(args.max_buffered, "--max-buffered")}
    if out["max_frame"] < 1024:
        raise ValueError(f"cxlalloc option '--max-frame': {args.max_frame} must be at least 1KiB (a hello)")
    if not P.MAX_KEYS <= args.max_items <= 1 << 24:
        raise ValueError(f"cxlalloc option '--max-items': {args.max_items} must be in [{P.MAX_KEYS}, {1 << 24}] "
                         f"(a request carries up to {P.MAX_KEYS} keys)")
    P.check_seconds(args.hello_timeout, "--hello-timeout")
    P.check_seconds(args.idle_timeout, "--idle-timeout", allow_zero=True)
    if args.max_clients_per_uid is not None and not 1 <= args.max_clients_per_uid <= args.max_clients:
        raise ValueError(f"cxlalloc option '--max-clients-per-uid': {args.max_clients_per_uid} must be in "
                         f"[1, --max-clients {args.max_clients}]")
    if not 1 <= args.slice_keys <= P.MAX_KEYS:
        raise ValueError(f"cxlalloc option '--slice-keys': {args.slice_keys} must be in [1, {P.MAX_KEYS}]")
    need = out["max_frame"] + P.decoded_bound(out["max_frame"], args.max_items)
    if out["max_buffered"] < need:
        raise ValueError(f"cxlalloc option '--max-buffered': {args.max_buffered} must be at least {need} bytes "
                         f"(one --max-frame {args.max_frame} request and what it decodes to at --max-items "
                         f"{args.max_items})")
    P.check_seconds(args.frame_timeout, "--frame-timeout")
    if args.max_objects < 4:
        raise ValueError(f"cxlalloc option '--max-objects': {args.max_objects} must be at least 4")
    if args.backlog < 1:
        raise ValueError(f"cxlalloc option '--backlog': {args.backlog} must be at least 1")
    # A slot and a pin take at least one page (slots are page multiples): a budget below one page would refuse every
    # reserve / every hit, with a refusal telling the client to release what it does not hold.
    page = os.sysconf("SC_PAGESIZE")
    reserve = parse_size_or_fraction(args.max_reserve, "--max-reserve", of="the pool")
    reserve = int(reserve * size) if isinstance(reserve, float) else int(reserve)
    if reserve < page:
        raise ValueError(f"cxlalloc option '--max-reserve': {args.max_reserve} ({reserve} bytes) must be at least one "
                         f"page ({page} bytes: a slot takes whole pages), as a size or a share of the pool such as 10%")
    pinned = parse_size_or_fraction(args.max_pinned, "--max-pinned", of="the pool")
    if int(pinned * size if isinstance(pinned, float) else pinned) < page:
        raise ValueError(f"cxlalloc option '--max-pinned': {args.max_pinned} "
                         f"({int(pinned * size if isinstance(pinned, float) else pinned)} bytes) must be at least one "
                         f"page ({page} bytes: a pinned block takes whole pages, so less refuses every hit), as a size "
                         "or a share of the pool such as 10%")
    out.update(frame_timeout=args.frame_timeout, max_objects=args.max_objects, backlog=args.backlog,
               max_items=args.max_items, slice_keys=args.slice_keys, hello_timeout=args.hello_timeout,
               idle_timeout=args.idle_timeout, max_clients_per_uid=args.max_clients_per_uid,
               max_reserve_bytes=reserve, max_pinned=pinned)
    return out


SWITCH_INTERVAL_S = 0.0002   # the server process's GIL switch interval (Python's default: 0.005)


def _no_full_collections() -> None:
    """Keep Python's cyclic collector to its young generations in the server
    process: a full collection walks every index entry (108 ms at 131,072
    blocks, measured; 300 ms on a loaded machine) while the thread that
    triggered it holds the server's lock.  The index's entries and the
    requests' objects are freed by reference counting (no cycles); cycles
    die young and are still collected with generations 0 and 1."""
    import gc

    gc.freeze()  # what start-up made (modules, the pool's structures): never scanned again
    t0, t1, _ = gc.get_threshold()
    gc.set_threshold(t0, t1, 1 << 30)


def _return_large_buffers_to_the_kernel() -> None:
    """Make glibc serve every allocation of 1 MiB or more by mmap, and unmap it
    when freed (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc's
    dynamic threshold from rising after the first big free): a request's
    buffers then leave the server's resident memory when it is answered,
    instead of staying in a thread's heap arena, so RSS follows what
    ``--max-buffered`` charges.  Nothing happens off glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        log.debug("mallopt unavailable: large request buffers follow the C library's own policy")


def server_from_args(args) -> KVServer:
    """A KVServer (not started) from parsed CLI arguments.  Raises ValueError naming the option."""
    if args.size is None:
        raise ValueError("cxlalloc option '--size': required (the pool's bytes, e.g. --size 64GiB, or a share of the "
                         "node's memory, e.g. --size 50%)")
    node, reason = choose_node(args.numa_node)
    size = parse_size_or_fraction(args.size, "--size", of="the node's memory")
    if isinstance(size, float):
        size = int(size * node_total_bytes(node))
    if size < 1:
        raise ValueError(f"cxlalloc option '--size': {args.size} must be above 0 bytes (the pool's bytes, e.g. "
                         "--size 64GiB, or a share of the node's memory, e.g. --size 50%)")
    try:
        node_bytes = node_total_bytes(node)
    except Exception:  # no NUMA topology to compare with: nothing to warn about
        node_bytes = size
    if size > node_bytes:
        log.warning("--size %s is more than NUMA node %d's memory (%s): the pool is sparse and starts, but it can "
                    "never fill; blocks written past the node's memory fail, or the kernel's OOM killer stops the "
                    "server. Use --size %s or less (--size 80%% is a share of the node)", format_bytes(size), node,
                    format_bytes(node_bytes), format_bytes(node_bytes))
    if args.chunk is None:  # 256 MiB, or the whole pool when it is smaller
        page = os.sysconf("SC_PAGESIZE")
        chunk = max(page, min(DEFAULT_CHUNK, size) // page * page)
    else:
        chunk = parse_size(args.chunk, "--chunk")
    if args.max_clients < 1:
        raise ValueError(f"cxlalloc option '--max-clients': {args.max_clients} must be at least 1")
    limits = transport_limits(args, size)
    quotas, default_quota = {}, None
    for q in args.quota:
        ns, b = parse_quota(q)
        if ns == "*":
            default_quota = b
        else:
            quotas[ns] = b
    mode = parse_mode(args.socket_mode)
    if mode & 0o002:
        log.warning("--socket-mode %s lets every local user attach and read every namespace's blocks", oct(mode))
    allow = [resolve_user(u) for u in args.allow_user] if args.allow_user else None
    gid = resolve_group(args.group) if args.group is not None else None
    if size < chunk:
        raise ValueError(f"cxlalloc option '--size': {format_bytes(size)} is below one chunk "
                         f"({format_bytes(chunk)}, --chunk); use --size of at least {format_bytes(chunk)} or a "
                         "smaller --chunk")
    tenants = [parse_tenant(t) for t in args.tenant]
    shared = {}
    for text in args.shared_namespace:
        ns, eq, writers = text.partition("=")
        if not eq or not writers:
            raise ValueError(f"cxlalloc option '--shared-namespace': {text!r} is not NS=TENANT[,TENANT] (the tenants "
                             "that may write NS; every tenant reads it)")
        shared[ns] = [w.strip() for w in writers.split(",")]
    if args.pool_file_size is not None and not args.pool_file:
        raise ValueError("cxlalloc option '--pool-file-size': given without --pool-file PATH")
    pool_file_bytes = parse_size(args.pool_file_size, "--pool-file-size") if args.pool_file_size else None
    ropts = redis_options(args)
    if not args.redis:
        given = [f for f, v in (("--redis-option", args.redis_option), ("--redis-password-file",
                                                                        args.redis_password_file),
                                ("--redis-ttl", args.redis_ttl), ("--redis-key-file", args.redis_key_file),
                                ("--redis-max-value", args.redis_max_value != "64MiB")) if v]
        if given:
            raise ValueError(f"cxlalloc option '{given[0]}': given without --redis URL")
    redis = None
    if args.redis:
        from cxlalloc.kvstore.tiers.redis import RedisTier, split_url_options

        if "tenant" in split_url_options(args.redis)[1]:  # the server names each block's tenant itself
            raise ValueError("cxlalloc option '--redis': ?tenant= names an in-process kv_store's values; a kv-server "
                             "would ignore it (each block carries its own tenant's name: --tenant NAME:USERS[:SIZE])")

        redis = RedisTier(args.redis, prefix=args.redis_prefix, ttl=args.redis_ttl,
                          queue_bytes=parse_size(args.redis_queue, "--redis-queue"), timeout=args.redis_timeout,
                          key_file=args.redis_key_file,
                          max_value_bytes=parse_size(args.redis_max_value, "--redis-max-value"), **ropts)
    try:
        return KVServer(size, node, args.socket, chunk_bytes=chunk, socket_mode=mode, group=gid, tenants=tenants,
                        pool_file=args.pool_file, pool_file_bytes=pool_file_bytes, shared=shared,
                        quotas=quotas, default_quota=default_quota, redis=redis, redis_mode=args.redis_mode,
                        strict_placement=args.strict_placement, max_clients=args.max_clients, allow_uids=allow,
                        node_reason=reason, **limits)
    except BaseException:
        if redis is not None:
            redis.close(0.1)
        raise


# ----------------------------------------------------------------- --status
def query_status(socket_path: str, timeout: float = 5.0) -> dict:
    """The stats of the server on ``socket_path`` (a status-only connection: no pool fd)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(socket_path)
        for v in range(P.PROTOCOL_VERSION, 0, -1):  # an older server refuses a newer version: ask for the one below
            P.send_msg(s, {"op": "hello", "v": v, "pid": os.getpid(), "want_fd": False, "name": "status"})
            reply, _ = P.recv_msg(s)
            if reply.get("ok") or reply.get("code") != "bad_request" or "protocol version" not in str(
                    reply.get("error", "")):
                break
        if not reply.get("ok"):
            raise P.RemoteError(reply.get("code", "?"), reply.get("error", "refused"))
        P.send_msg(s, {"op": "stats"})
        reply, _ = P.recv_msg(s)
        if not reply.get("ok"):
            raise P.RemoteError(reply.get("code", "?"), reply.get("error", "refused"))
        return reply["stats"]
    finally:
        s.close()


def _rate(v, unit: str = "/s") -> str:
    return "-" if v is None else f"{v:,.1f}{unit}"


def format_status(st: dict) -> str:
    """The readable ``--status`` text (plain; rich tables when available)."""
    srv, pool, rates, rd = st["server"], st["pool"], st["rates"], st.get("redis")
    rows = [
        ("server", f"pid {srv['pid']}, pool {srv['pool_id']}, up {srv['uptime_s']:.0f} s, ready in "
                   f"{(srv.get('ready_s') or 0) * 1e3:.0f} ms, socket {srv['socket']} ({srv['socket_mode']})"),
        ("placement", f"{srv['node_reason']}; checked by {srv['numa_method']}: "
                      f"{format_bytes(pool['placement_verified_bytes'])} on node, "
                      f"{format_bytes(pool['placement_misplaced_bytes'])} elsewhere"),
        ("clients", f"{srv['clients']} now, {srv['peak_clients']} at most, {srv['connections_total']} connections, "
                    f"{srv['refused_full'] + srv['refused_denied']} refused"),
    ]
    tiers = [("pool", format_bytes(pool["capacity_bytes"]), format_bytes(pool["used_bytes"]),
              f"{pool['blocks']:,} ({pool['pinned_blocks']} pinned, {pool['writing_blocks']} writing)",
              f"{pool['hit_rate'] * 100:.1f}%", _rate(rates.get("loads_per_s")),
              _rate(rates.get("load_bytes_per_s") and rates["load_bytes_per_s"] / 1e6, " MB/s"),
              _rate(rates.get("stores_per_s")),
              _rate(rates.get("store_bytes_per_s") and rates["store_bytes_per_s"] / 1e6, " MB/s"),
              f"{pool['evicted_blocks']:,}")]
    for name, tp in sorted((st.get("tenants") or {}).items()):  # --tenant: each tenant's own pool
        tiers.append((f"  tenant {name}", format_bytes(tp["capacity_bytes"]), format_bytes(tp["used_bytes"]),
                      f"{tp['blocks']:,} ({tp['pinned_blocks']} pinned, {tp['writing_blocks']} writing)",
                      f"{tp['hit_rate'] * 100:.1f}%", "", "", "", "", f"{tp['evicted_blocks']:,}"))
    if rd is not None:
        cap = rd.get("capacity_bytes")
        tiers.append(("redis", "no limit" if not cap else format_bytes(cap), format_bytes(rd.get("used_bytes")),
                      f"queue {rd['queue_blocks']}", f"{rd['hit_rate'] * 100:.1f}%",
                      _rate(rates.get("redis_loads_per_s")),
                      _rate(rates.get("redis_load_bytes_per_s") and rates["redis_load_bytes_per_s"] / 1e6, " MB/s"),
                      _rate(rates.get("redis_stores_per_s")),
                      _rate(rates.get("redis_store_bytes_per_s") and rates["redis_store_bytes_per_s"] / 1e6, " MB/s"),
                      f"dropped {rd['dropped_blocks']:,}"))
        rows.append(("redis", f"{rd['url']} {'up' if rd['up'] else ('DOWN' if rd['up'] is False else 'not tried')}"
                              + (f" ({rd['last_error']})" if rd.get("last_error") and not rd["up"] else "")
                              + f", errors put {rd['put_errors']} get {rd['get_errors']} full {rd['full_errors']}, "
                                f"bad values {rd['bad_values']}"))
    src = pool.get("tiers")
    if src:
        rows.append(("served by tier", "; ".join(
            f"{name} {d['blocks']:,} blocks, {format_bytes(d['bytes'])}, {d['tokens']:,} tokens"
            for name, d in src.items())))
    heads = ("tier", "capacity", "used", "blocks", "hit rate", "loads", "load bytes", "stores", "store bytes",
             "evictions")
    ns = pool.get("namespaces") or {}
    try:
        import io

        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        con = Console(file=buf, width=160, force_terminal=False)
        t = Table(title=f"cxlalloc kv-server (rates over the last {rates.get('window_s', 0):.0f} s)")
        for h in heads:
            t.add_column(h)
        for r in tiers:
            t.add_row(*r)
        con.print(t)
        for k, v in rows:
            con.print(f"[bold]{k}[/bold]: {v}")
        for name, v in sorted(ns.items()):
            q = v.get("quota_bytes")
            con.print(f"namespace {name or '(default)'!s}: {format_bytes(v['used_bytes'])}"
                      + (f", quota {format_bytes(q)}" if q is not None else ""))
        return buf.getvalue().rstrip()
    except ImportError:
        lines = ["  ".join(heads)] + ["  ".join(r) for r in tiers] + [f"{k}: {v}" for k, v in rows]
        lines += [f"namespace {n or '(default)'}: {format_bytes(v['used_bytes'])}" for n, v in sorted(ns.items())]
        return "\n".join(lines)


# ----------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None, prog: str = "cxlalloc kv-server") -> int:
    """``cxlalloc kv-server``.  Exit codes: 0 stopped by SIGTERM/SIGINT (or --status
    answered), 1 the server could not start or --status could not reach it, 2 bad usage."""
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s kv-server[%(process)d] %(levelname)s %(message)s")
    try:
        P.check_socket_path(args.socket)
    except ValueError as e:
        parser.error(str(e))
    if args.status:
        try:
            st = query_status(args.socket)
        except (OSError, P.ProtocolError, P.RemoteError) as e:
            print(f"cxlalloc kv-server --status: no server answers on {args.socket}: "
                  f"{getattr(e, 'strerror', None) or e}", file=sys.stderr)
            return 1
        print(json.dumps(st, indent=2, sort_keys=True, default=str) if args.json else format_status(st))
        return 0
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        parser.error(f"cxlalloc option '--metrics-port': {args.metrics_port} is not a port (1-65535)")
    try:
        P.check_seconds(args.metrics_interval, "--metrics-interval")
    except ValueError as e:
        parser.error(str(e))
    try:
        server = server_from_args(args)
        _return_large_buffers_to_the_kernel()
        # Fair service between connections' threads: a thread waiting for the GIL gets it within
        # 0.2 ms instead of 5 ms, so a short lookup is not queued behind another client's long one.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        _no_full_collections()
    except (ValueError, ImportError) as e:
        parser.error(str(e))
    except Exception as e:  # mapping the pool failed (size, memfd, mbind)
        print(f"cxlalloc kv-server: cannot create the pool: {e}", file=sys.stderr)
        return 1
    # The stop handlers go in before the socket listens: a client (or a supervisor) that sees the
    # server answer may stop it at once, and a SIGTERM landing between start() and the handlers
    # killed it with the default action (exit -15, pool and socket file not cleaned up; seen in CI).
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
    except ValueError as e:  # the socket path: a server already listening there, a regular file (usage: exit 2)
        server.stop(0.1)
        parser.error(str(e))
    except OSError as e:
        server.stop(0.1)
        print(f"cxlalloc kv-server: {e}", file=sys.stderr)
        return 1
    exporter = None
    if args.metrics_port is not None or args.metrics_file:
        from cxlalloc.kvstore.server.metrics import MetricsExporter

        try:
            exporter = MetricsExporter(server.stats, port=args.metrics_port, addr=args.metrics_addr,
                                       path=args.metrics_file, interval=args.metrics_interval).start()
        except (OSError, ImportError, ValueError) as e:
            server.stop(0.1)
            print(f"cxlalloc kv-server: metrics: {e}", file=sys.stderr)
            return 1
    log.info("ready: pool %s (%d bytes) on NUMA node %d (%s), chunks of %s, %s committed, socket %s (mode %s), "
             "pool %s, ready in %.0f ms%s%s", format_bytes(server.size), server.size, server.node, server.node_reason,
             format_bytes(server.chunk_bytes), format_bytes(server.committed_bytes()), server.socket_path,
             f"{server.socket_mode:04o}", server.pool_id, (server.ready_seconds or 0) * 1e3,
             f", redis {server.redis.url} ({server.redis_mode})" if server.redis is not None else "",
             f", metrics {exporter.describe()}" if exporter is not None else "")
    while not done.wait(1.0):
        pass
    log.info("stopping")
    if exporter is not None:
        exporter.stop()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
