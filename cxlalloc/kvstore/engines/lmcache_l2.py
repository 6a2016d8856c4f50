"""The kv-server as an L2 adapter of LMCache's multiprocess (MP) mode.

LMCache's MP mode (``lmcache server`` beside the engines, vLLM's ``LMCacheMPConnector``) ignores
``remote_storage_plugins`` (the seam of :mod:`cxlalloc.kvstore.engines.lmcache_plugin`); its storage plugins are L2
adapters, loaded from the server's ``--l2-adapter`` JSON (LMCache 0.5.6,
``lmcache/v1/distributed/l2_adapters/plugin_l2_adapter.py``)::

    {"type": "plugin", "module_path": "cxlalloc.kvstore.engines.lmcache_l2", "class_name": "CxlallocL2Adapter",
     "adapter_params": {"url": "cxlalloc:///run/cxlalloc/kv.sock?timeout=5&namespace=lmcache"}}

The URL is the plugin's (same options: ``timeout``, ``namespace``;
:func:`cxlalloc.kvstore.engines.lmcache_plugin.parse_url`); a malformed one raises
:class:`~cxlalloc.kvstore.engines.lmcache_plugin.PluginConfigError` when LMCache creates the adapter.

**Keys.**  LMCache's ``ObjectKey`` (chunk hash, model, KV rank, object group, cache salt) maps to the
kv-server namespace ``<namespace>/<model>@<kv_rank>@<group>[@<salt>]`` (quotas per tenant and model; two
salts never share a chunk) and a 32-byte key, BLAKE2b-256 of the whole key: the same in every process.

**What each call does** (LMCache's contract, ``L2AdapterInterface``: non-blocking submits, results polled,
three distinct event fds signalled on completion, thread-safe):

* store: one reservation per (namespace, size), one copy of each object's bytes into the pool, one commit
  (nothing visible before; a key already stored is skipped).  The result is the bytes written; a kv-server
  that is down is a failed task (LMCache may retry), never an exception.
* lookup and lock: one kv-server lookup per namespace run; the stored prefix of the keys is pinned on the
  server (the server never evicts a pinned block) until :meth:`submit_unlock` of those keys.  A miss, or a
  kv-server that is down, is a 0 bit.
* load: copies each block pool -> the caller's memory object (one copy, verified there), from the lock's pin when the key is
  locked, else through a short lookup; a block of another size or key is a 0 bit.

Each slot holds a 64-byte header (magic ``CXLL2v02``, the 32-byte key, the payload length), the payload, and
the block store's 16-byte checksum trailer (XXH3-128 of the key, header and payload: ``block_checksum``), sealed
over LMCache's own L1 object, never over the pool.  A load copies the payload once, straight into the L1 object
LMCache hands the adapter, and verifies the trailer over that copy (another client mapping the pool read-write
could change the pool's bytes between a check there and the copy): a chunk that fails is a 0 bit (LMCache
recomputes it), counted in ``corrupt_blocks`` and reported to the server, which drops it after its own check.
Slots of the older format (``CXLL2v01``, no trailer) read as misses.

Tested against LMCache 0.5.6's own factory and interface on the CPU (tests/kvstore/engines/test_lmcache_l2.py), and
with vLLM's CPU build through LMCache's MP server, two vLLM processes sharing a prefix through the pool
(tests/engines/test_vllm_lmcache_mp.py).  Not yet run on a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.client import RemoteBlockStore
from cxlalloc.kvstore.counters import StoreCounters
from cxlalloc.kvstore.client import DEFAULT_TIMEOUT_S
from cxlalloc.kvstore.engines.config import check_params, parse_kv_url
from cxlalloc.kvstore.engines.lmcache_plugin import DEFAULT_NAMESPACE, DEFAULT_URL, PluginConfigError
from cxlalloc.kvstore.layout import CHECKSUM_BYTES, block_checksum, copy_verified

try:  # the extra: pip install '.[lmcache]' (from a clone)
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.platform import create_event_notifier
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    raise ImportError("cxlalloc's LMCache L2 adapter needs LMCache: pip install '.[lmcache]' from a clone of "
                      f"cxlalloc (import failed: {_e})") from _e

log = logging.getLogger("cxlalloc.kvstore.engines.lmcache_l2")

MAGIC = b"CXLL2v02"                # 02: slots end in the block checksum trailer (01 slots read as misses)
_HEAD = struct.Struct("<8s32sQ")   # magic, key, payload bytes
_HDR = 64                          # payload offset: cache-line aligned copies
PARAMS = {"url": (DEFAULT_URL, str, f"e.g. {DEFAULT_URL!r}")}   # adapter_params: name -> (default, checker, what)


def _bytes(obj) -> torch.Tensor:
    """The bytes of an LMCache memory object as a 1-D uint8 tensor (no copy)."""
    n = obj.get_size()
    raw = obj.raw_data if isinstance(getattr(obj, "raw_data", None), torch.Tensor) else obj.tensor
    return raw.reshape(-1).view(torch.uint8)[:n]


class CxlallocL2Adapter(L2AdapterInterface):
    """LMCache MP mode's ``L2AdapterInterface`` over a cxlalloc kv-server (see the module docstring).

    Args:
        params: LMCache's ``adapter_params``: ``{"url": "cxlalloc:///path/kv.sock?timeout=S&namespace=N"}``
            (default ``cxlalloc:///run/cxlalloc/kv.sock``).
        l1_memory_desc: LMCache's L1 descriptor (unused: the copies go through the memory objects).

    Raises:
        PluginConfigError: an unknown parameter or a malformed URL (LMCache stops the adapter's creation).
    """

    def __init__(self, params: Optional[dict] = None, l1_memory_desc=None):
        super().__init__()
        self.url = check_params(dict(params or {}), PARAMS, "cxlalloc L2 adapter", PluginConfigError,
                                what="adapter_params key")["url"]
        path, timeout, self.tenant = parse_kv_url(self.url, "cxlalloc L2 adapter", DEFAULT_NAMESPACE,
                                                  DEFAULT_TIMEOUT_S, PluginConfigError)
        # commit="wait": other processes look a chunk up right after its put (see lmcache_plugin.py)
        self.store = RemoteBlockStore("unix://" + path, None, timeout=timeout, name="lmcache-mp", commit="wait")
        if not self.store.connected():
            log.error("cxlalloc L2 adapter: no kv-server answers at %s (%s); every lookup is a miss until one "
                      "listens there (start `cxlalloc kv-server --socket %s`)", path,
                      self.store.last_error or "not reachable", path)
        self.counters = StoreCounters(("stores", "stored_blocks", "store_failures", "lookups", "hit_blocks",
                                       "loads", "loaded_blocks", "bad_blocks", "corrupt_blocks"))
        self._efd = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self._lock = threading.Lock()
        self._next = 0
        self._done: Dict[str, Dict[int, object]] = {"store": {}, "lookup": {}, "load": {}}
        self._locks: Dict[Tuple[str, bytes], List] = {}   # (ns, key) -> [(lease, its view index), ...]: its pins
        self._lease_keys: Dict[int, int] = {}              # id(lease) -> keys of it still locked
        self._io = ThreadPoolExecutor(2, thread_name_prefix="cxlalloc-l2")
        self._closed = False
        self._warned_corrupt = False
        self._to_discard: Dict[str, set] = {}   # ns -> keys of corrupt chunks still pinned by a lock here

    # ------------------------------------------------------------ names
    def names(self, key) -> Tuple[str, bytes]:
        """(kv-server namespace, 32-byte key) of an LMCache ``ObjectKey``."""
        ident = f"{key.model_name}@{key.kv_rank}@{key.object_group_id}" + (f"@{key.cache_salt}"
                                                                            if key.cache_salt else "")
        ns = self.tenant + "/" + ident
        if len(ns) > P.MAX_NS_CHARS:
            ns = ns[:P.MAX_NS_CHARS - 17] + "#" + hashlib.blake2b(ns.encode(), digest_size=8).hexdigest()
        sk = hashlib.blake2b(b"cxlalloc-lmcache-l2/1|" + ident.encode() + b"|" + bytes(key.chunk_hash),
                             digest_size=32).digest()
        return ns, sk

    # ------------------------------------------------------------ tasks
    def _submit(self, kind: str, fn, *args) -> int:
        with self._lock:
            tid = self._next
            self._next += 1

        def run():
            try:
                result = fn(*args)
            except Exception as e:  # never into LMCache: a failed task
                log.warning("cxlalloc L2 adapter: %s failed (%s: %s)", kind, type(e).__name__, e)
                result = L2StoreResult(False, 0) if kind == "store" else Bitmap(len(args[0]))
            with self._lock:
                self._done[kind][tid] = result
            self._efd[kind].notify()

        self._io.submit(run)
        return tid

    def _pop(self, kind: str, tid: int):
        with self._lock:
            return self._done[kind].pop(tid, None)

    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    # ------------------------------------------------------------ store
    def _store(self, keys, objects) -> "L2StoreResult":
        self.counters.add("stores")
        groups: Dict[Tuple[str, int], List[int]] = {}
        names = [self.names(k) for k in keys]
        payloads = [_bytes(o) for o in objects]
        for i, (ns, _) in enumerate(names):
            groups.setdefault((ns, _HDR + payloads[i].numel() + CHECKSUM_BYTES), []).append(i)
        written, stored_keys, sizes, ok = 0, [], [], True
        for (ns, nbytes), idx in groups.items():
            try:
                res = self.store.reserve(ns, [names[i][1] for i in idx], nbytes, 0)
            except Exception as e:
                log.warning("cxlalloc L2 adapter: reserve failed (%s: %s); not stored", type(e).__name__, e)
                self.counters.add("store_failures", len(idx))
                ok = False
                continue
            if res.slots == 0 and not self.store.connected():  # the kv-server is away: nothing was written
                self.counters.add("store_failures", len(idx))
                ok = False
                res.abort()
                continue
            with res:
                filled = []
                for i, view in zip(idx, res.views):
                    if view is None:
                        continue  # stored already, or no room (every block pinned)
                    head = bytearray(_HDR)
                    _HEAD.pack_into(head, 0, MAGIC, names[i][1], payloads[i].numel())
                    # sealed over LMCache's own object (host bytes), not the pool's copy of it
                    body = payloads[i] if payloads[i].device.type == "cpu" else payloads[i].cpu()
                    trailer = block_checksum(names[i][1], bytes(head), memoryview(body.numpy()))
                    view[:_HDR].copy_(torch.frombuffer(head, dtype=torch.uint8))
                    view[_HDR:-CHECKSUM_BYTES].copy_(body)
                    view[-CHECKSUM_BYTES:].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
                    filled.append(i)
                n = res.commit()
            if n == len(filled):
                written += sum(payloads[i].numel() for i in filled)
                stored_keys += [keys[i] for i in filled]
                sizes += [payloads[i].numel() for i in filled]
            self.counters.add("stored_blocks", n)
        if stored_keys:
            self._notify_keys_stored(stored_keys, sizes)
        return L2StoreResult(ok, written)

    def submit_store_task(self, keys, objects) -> int:
        """Store ``objects`` under ``keys`` (a task id; the result from :meth:`pop_completed_store_tasks`)."""
        return self._submit("store", self._store, list(keys), list(objects))

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    # ------------------------------------------------------------ lookup and lock
    def _runs(self, keys):
        """(namespace, [(index, server key), ...]) runs of ``keys`` in one namespace."""
        out: List[Tuple[str, List[Tuple[int, bytes]]]] = []
        for i, k in enumerate(keys):
            ns, sk = self.names(k)
            if not out or out[-1][0] != ns:
                out.append((ns, []))
            out[-1][1].append((i, sk))
        return out

    def _lookup(self, keys, _layouts) -> "Bitmap":
        self.counters.add("lookups")
        bits = Bitmap(len(keys))
        for ns, run in self._runs(keys):
            try:
                lease = self.store.lookup(ns, [sk for _, sk in run])
            except Exception as e:
                log.warning("cxlalloc L2 adapter: lookup failed (%s: %s); a miss", type(e).__name__, e)
                continue
            n = lease.blocks
            if n == 0:
                lease.close()
                continue
            with self._lock:
                self._lease_keys[id(lease)] = n
                for j, (i, sk) in enumerate(run[:n]):
                    self._locks.setdefault((ns, sk), []).append((lease, j))
            for i, _ in run[:n]:
                bits.set(i)
            self.counters.add("hit_blocks", n)
        return bits

    def submit_lookup_and_lock_task(self, keys, group_layout_descs) -> int:
        """Look ``keys`` up and pin the stored ones until :meth:`submit_unlock` (bitmap from
        :meth:`query_lookup_and_lock_result`: 1 = stored and pinned)."""
        return self._submit("lookup", self._lookup, list(keys), group_layout_descs)

    def query_lookup_and_lock_result(self, task_id: int):
        return self._pop("lookup", task_id)

    def submit_unlock(self, keys) -> None:
        """Release one pin of each key (a key not locked is ignored); a lease is closed with its last key."""
        to_close = []
        with self._lock:
            for k in keys:
                held = self._locks.get(self.names(k))
                if not held:
                    continue
                lease, _ = held.pop()
                if not held:
                    del self._locks[self.names(k)]
                left = self._lease_keys[id(lease)] - 1
                if left:
                    self._lease_keys[id(lease)] = left
                else:
                    del self._lease_keys[id(lease)]
                    to_close.append(lease)
        for lease in to_close:
            lease.close()
        if to_close:
            with self._lock:
                pending, self._to_discard = self._to_discard, {}
            for ns, sks in pending.items():
                try:
                    self.store.discard(ns, sorted(sks))
                except Exception as e:
                    log.warning("cxlalloc L2 adapter: discard failed (%s: %s)", type(e).__name__, e)

    # ------------------------------------------------------------ load
    def _copy_out(self, view: torch.Tensor, sk: bytes, obj, corrupt: List[bytes]) -> bool:
        """Copy one stored block into LMCache's L1 object ``obj`` and verify that copy; False on any mismatch
        (a checksum that fails appends ``sk`` to ``corrupt``)."""
        head = view[:_HDR].numpy().tobytes()   # one read of the header: parsed and checksummed from this copy
        magic, key, n = _HEAD.unpack(head[:_HEAD.size])
        dst = _bytes(obj)
        if magic != MAGIC or key != sk or n != dst.numel() or view.numel() != _HDR + n + CHECKSUM_BYTES:
            self.counters.add("bad_blocks")
            return False
        want = view[-CHECKSUM_BYTES:].numpy().tobytes()
        if not copy_verified(dst, view[_HDR:_HDR + n], sk, head, want):
            self.counters.add("bad_blocks")
            self.counters.add("corrupt_blocks")
            corrupt.append(sk)
            if not self._warned_corrupt:
                self._warned_corrupt = True
                log.warning("cxlalloc L2 adapter: a chunk whose checksum does not match its bytes (changed in the "
                            "pool): a miss")
            return False
        return True

    def _discard(self, ns: str, corrupt: List[bytes]) -> None:
        """Have the server drop chunks whose checksum failed here.  The server never drops a pinned chunk, so those
        this adapter still holds locked are dropped again when their last lock goes (:meth:`submit_unlock`)."""
        try:
            dropped = self.store.discard(ns, corrupt)
        except Exception as e:
            log.warning("cxlalloc L2 adapter: discard failed (%s: %s)", type(e).__name__, e)
            return
        if dropped < len(corrupt):
            with self._lock:
                self._to_discard.setdefault(ns, set()).update(corrupt)

    def _load(self, keys, objects) -> "Bitmap":
        self.counters.add("loads")
        bits = Bitmap(len(keys))
        for ns, run in self._runs(keys):
            missing, corrupt = [], []
            for i, sk in run:
                with self._lock:
                    held = self._locks.get((ns, sk))
                    view = held[-1][0].views[held[-1][1]] if held else None
                if view is None:
                    missing.append((i, sk))
                elif self._copy_out(view, sk, objects[i], corrupt):
                    bits.set(i)
            for i, sk in missing:   # not locked: a short lookup of its own
                try:
                    with self.store.lookup(ns, [sk]) as lease:
                        if lease.blocks and self._copy_out(lease.views[0], sk, objects[i], corrupt):
                            bits.set(i)
                except Exception as e:
                    log.warning("cxlalloc L2 adapter: load failed (%s: %s); a miss", type(e).__name__, e)
            if corrupt:   # dropped (the server checks again first), so LMCache's recompute stores it anew
                self._discard(ns, corrupt)
        self.counters.add("loaded_blocks", sum(1 for i in range(len(keys)) if bits.test(i)))
        return bits

    def submit_load_task(self, keys, objects) -> int:
        """Copy the stored blocks of ``keys`` into ``objects`` (bitmap from :meth:`query_load_result`)."""
        return self._submit("load", self._load, list(keys), list(objects))

    def query_load_result(self, task_id: int):
        return self._pop("load", task_id)

    # ------------------------------------------------------------ the rest
    def report_status(self) -> dict:
        """LMCache's status dict: healthy always (a kv-server that is down is a miss), plus counters."""
        return {"is_healthy": True, "type": "CxlallocL2Adapter", "url": self.url,
                "connected": self.store.connected(), "locked_keys": len(self._locks),
                **self.counters.snapshot()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._io.shutdown(wait=True)
        with self._lock:
            leases = {id(lease): lease for held in self._locks.values() for lease, _ in held}
            self._locks.clear()
            self._lease_keys.clear()
        for lease in leases.values():
            lease.close()
        self.store.close()
        for e in self._efd.values():
            e.close()


__all__ = ["CxlallocL2Adapter"]
