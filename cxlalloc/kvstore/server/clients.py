"""The kv-server's clients: :class:`Owner` (one connection, the owner of its
leases and reservations) and :class:`ClientsMixin`, the part of
:class:`~cxlalloc.kvstore.server.state.ServerState` that admits, greets,
counts and drops them (moved out of ``state.py`` to keep one job per file;
the lock, the index and the counters are ``ServerState``'s)."""

from __future__ import annotations

import itertools
import os
import time
from typing import Dict, List, Optional

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.index import Entry
from cxlalloc.kvstore.server.fair import HoldRecord


class Owner:
    """One client (a connection): the owner of its leases and reservations in the index."""

    _ids = itertools.count(1)

    def __init__(self, pid: int, uid: int, gid: int):
        self.id = next(self._ids)
        self.pid, self.uid, self.gid = pid, uid, gid
        self.name = ""
        self.tenant = ""          # set by the transport from the peer's credentials (never from the client)
        self.unbound = False      # the operator (root, the server's uid) bound to no tenant: stats of
                                  # every tenant and ping only, no pool
        self.hello = False
        self.version = 0        # the protocol version of its hello
        self.deferred: List[list] = []  # v3 pipelined commits' outcomes [res, published, code] for the next reply
        self.deferred_dropped = 0       # outcomes dropped past protocol.MAX_DEFERRED_COMMITS
        self.status_only = False  # a --status query (hello without the pool fd): not counted as a client
        self.since = time.time()
        self.leases: Dict[int, List[Entry]] = {}
        self.pinned_bytes = 0     # slot bytes of its leases' blocks (bounded by --max-pinned)
        self.reservations: Dict[int, List[Optional[Entry]]] = {}
        self._next = itertools.count(1)
        self.requests = 0

    def new_id(self) -> int:
        return next(self._next)

    def __repr__(self) -> str:
        return f"client#{self.id}(pid={self.pid}, uid={self.uid}{', ' + self.name if self.name else ''})"


class ClientsMixin:
    """Admission, greeting, counting and clean-up of clients; mixed into
    ``ServerState`` (which owns ``lock``, ``owners``, ``index``, ``c`` and the
    limits these methods read)."""

    def admit(self, pid: int, uid: int, gid: int) -> Owner:
        """A new owner for a connection of ``pid``/``uid``/``gid``.

        Raises:
            protocol.RemoteError: ``denied`` (uid not in ``allow_uids``) or
                ``limit`` (``max_clients`` served already); counted.
        """
        owner = Owner(pid, uid, gid)
        with self.lock:
            if self.allow_uids is not None and uid not in self.allow_uids:
                self.c["refused_denied"] += 1
                raise P.RemoteError("denied", f"uid {uid} may not attach to this kv-server (--allow-user)")
            if len(self.owners) >= self.max_clients:
                self.c["refused_full"] += 1
                raise P.RemoteError("limit", f"the kv-server serves {self.max_clients} clients already "
                                             "(--max-clients)")
            mine = self._per_uid.get(uid, 0)
            if mine >= self.max_clients_per_uid and uid != os.geteuid():
                self.c["refused_full"] += 1
                self.c["refused_per_uid"] += 1
                raise P.RemoteError("limit", f"uid {uid} has {mine} connections to this kv-server already "
                                             f"(--max-clients-per-uid {self.max_clients_per_uid})")
            self._per_uid[uid] = mine + 1
            self.owners[owner.id] = owner
            self.c["connections"] += 1
            self.c["peak_clients"] = max(self.c["peak_clients"], len(self.owners))
        return owner

    def owner(self, cid: int) -> Owner:
        """The owner ``cid`` (KeyError once dropped)."""
        return self.owners[cid]

    def hello(self, cid: int, version, name: str) -> dict:
        """Mark ``cid`` as greeted; returns what the pool is (for the ``hello``
        reply, ``v`` = the client's version, which the connection speaks).

        Raises:
            protocol.RemoteError: ``bad_request`` for a version not in
                ``protocol.SUPPORTED_VERSIONS``.
        """
        if isinstance(version, bool) or version not in P.SUPPORTED_VERSIONS:
            raise P.RemoteError("bad_request", f"protocol version {version!r} is not served here (this server "
                                               f"speaks {', '.join(map(str, P.SUPPORTED_VERSIONS))})")
        o = self.owner(cid)
        o.hello = True
        o.version = int(version)
        o.name = str(name or "")[:64]
        return {"v": int(version), "pool_id": self.pool_id, "size": self.size, "mapped": self.arena.size,
                "chunk_bytes": self.chunk_bytes, "node": self.node, "pid": os.getpid(),
                "numa_method": self.arena.numa_method, "max_keys": P.MAX_KEYS}

    def count_request(self, cid: int) -> None:
        with self._count_lock:  # not the server's lock: a request does not queue for it only to be counted
            self.c["requests"] += 1
        self.owner(cid).requests += 1

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.c[name] += n

    def _held(self, t0) -> int:
        """Record one hold of the lock that began at ``t0`` (a :meth:`HoldRecord.start` token; call under the
        lock); returns its wall microseconds."""
        us = self.holds.stop(t0)
        if us > self.c["lock_hold_us_max"]:
            self.c["lock_hold_us_max"] = us
        return us

    def drop(self, cid: int):
        """Forget ``cid``: drop its pins, abort its reservations, ``slice_keys // 4``
        blocks per hold of the lock, the lock released (and handed to any waiting
        client) between holds.  Returns (pins dropped, blocks aborted); (0, 0) for
        an unknown id.

        Between two slices the client is half released, and consistently so: it is
        no longer an owner (no request of it is served), its WRITING blocks not yet
        aborted stay invisible to lookups and are skipped by other reserves as being
        written, and its pins not yet dropped keep their blocks from eviction; no
        block is ever half freed.  ``last_drop`` records the clean-up (how many
        holds of the lock, their median, p99 and longest, wall clock)."""
        t_start = time.perf_counter()
        with self.lock:
            o = self.owners.pop(cid, None)
            if o is None:
                return 0, 0
            left = self._per_uid.get(o.uid, 1) - 1
            if left > 0:
                self._per_uid[o.uid] = left
            else:
                self._per_uid.pop(o.uid, None)
            pins = sum(len(v) for v in o.leases.values())
            writing = sum(1 for v in o.reservations.values() for e in v if e is not None)
            o.leases.clear()
            o.reservations.clear()
        walls: List[int] = []  # microseconds of each hold
        done = False
        while not done:
            with self.lock:
                t0 = HoldRecord.start()
                done = self.index.drop_owner(o, max(1, self.slice_keys // 4))  # a pin costs more than a lookup
                us = self._held(t0)
                walls.append(us)
                # The longest hold of the lock a disconnect makes other clients wait (stats: drop_ms_max).
                self.c["drop_us_max"] = max(self.c["drop_us_max"], us)
                if done and (pins or writing):  # a client that held nothing (a --status query) is not recorded
                    walls.sort()
                    self.last_drop = {"seq": self.last_drop["seq"] + 1, "pins": pins, "blocks": writing,
                                      "holds": len(walls), "hold_ms_max": walls[-1] / 1e3,
                                      "hold_ms_p50": walls[len(walls) // 2] / 1e3,
                                      "hold_ms_p99": walls[min(len(walls) - 1, int(0.99 * len(walls)))] / 1e3,
                                      "wall_ms": round((time.perf_counter() - t_start) * 1e3, 3)}
        return pins, writing
