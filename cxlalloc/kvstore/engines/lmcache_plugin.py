"""The kv-server as an LMCache remote-storage plugin: ``cxlalloc:///run/cxlalloc/kv.sock``.

vLLM (its LMCache connector), SGLang, Dynamo's LMCache path, llm-d and KServe
store KV through LMCache; LMCache loads remote-storage plugins by name
(docs/sources.md#lmcache-plugins).  This module is that plugin: a
``ConnectorAdapter`` claiming the ``cxlalloc://`` scheme (and
``plugin://cxlalloc``) and a ``RemoteConnector`` over the kv-server's client
(:class:`~cxlalloc.kvstore.client.RemoteBlockStore`), so every engine process
of the machine shares the one pool on the CXL node.  LMCache config::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5          # LMCache stages every block in its own CPU buffers
    remote_storage_plugins: ["cxlalloc"]
    extra_config:
      remote_storage_plugin.cxlalloc.module_path: cxlalloc.kvstore.engines.lmcache_plugin
      remote_storage_plugin.cxlalloc.class_name: CxlallocConnectorAdapter
      remote_storage_plugin.cxlalloc.url: cxlalloc:///run/cxlalloc/kv.sock?timeout=5

(LMCache's older ``remote_url`` finds only its built-in adapters: list the
plugin as above.)

URL options (``?timeout=5&namespace=tenant-a``):
    timeout     seconds for each kv-server request (default 5)
    namespace   prefix of every namespace this connector uses (default ``lmcache``)

**Tenants.**  ``namespace`` is a name the engine chooses, not a boundary.  On
a kv-server with ``--tenant``, the engine process's tenant is the one the
server binds its uid/gid to (``SO_PEERCRED``), the same as for any client:
its chunks live in that tenant's own pool and are named (down to Redis and
its MAC) within that tenant, so engines of other tenants cannot address
them; ``store.stats()["tenant"]`` says which tenant the server chose
(docs/kv-server.md#tenants).

**Keys.**  LMCache's ``CacheEngineKey`` names a chunk by ``model@world_size@
worker_id@chunk_hash@dtype[@tags]``.  The kv-server namespace is
``<namespace>/<model>@<world_size>@<worker_id>@<dtype>[@tags]`` (so ``--quota``
applies per tenant and model, and one model's chunks never answer another's),
the 32-byte key is BLAKE2b-256 of the whole key string: the same in every
process, so a chunk put by one engine is found by any other.

**One copy each way.**  A put reserves a slot in the pool, copies the memory
object's bytes into the mapped pool (the pool's memfd came over the socket),
and commits: nothing is visible before the commit, and a process killed
mid-write leaves nothing behind (the server aborts its reservations).  A get
looks the key up (the block is pinned on the server), copies pool -> a memory
object from LMCache's own allocator, and releases the pin.

**Block layout** (in one slot): a 64-byte-aligned header -- magic
``CXLLMC01``, the 32-byte key, the length of LMCache's ``RemoteMetadata``,
that metadata (payload length, shapes, dtypes, memory format) -- then the
payload.  A header that does not match (another layout, another key) is a
miss, never wrong bytes.  The server's Redis tier stores the slot as it is,
so evicted chunks come back from Redis unchanged.

**Failures are misses.**  A kv-server that is down, restarting, full or slow
makes lookups return nothing and puts store nothing; LMCache recomputes.
The client warns once, counts it, and reconnects by itself with backoff
(:mod:`cxlalloc.kvstore.client`).  No exception reaches LMCache from a
request.  The connector reports no health to LMCache (``support_ping`` is
False): LMCache 0.5.6 turns a failed ping into "unhealthy", and an unhealthy
engine skips every tier, its local CPU one included, until a later check
passes (every 30 s); a pool that is down is a miss, never that.  At start, a
malformed URL or option stops LMCache with :class:`PluginConfigError` (one
line naming the option; LMCache re-raises it, so the engine does not start
silently without the pool), and a well-formed URL with no kv-server behind it
logs one error line naming the socket (the engine runs; lookups miss until a
server listens there).

Not yet run with an engine on a GPU.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.client import DEFAULT_TIMEOUT_S, RemoteBlockStore
from cxlalloc.kvstore.counters import StoreCounters
from cxlalloc.kvstore.engines.config import parse_kv_url
from cxlalloc.kvstore.layout import CHECKSUM_BYTES, block_checksum, copy_verified

try:  # the extra: pip install '.[lmcache]' (from a clone)
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.protocol import RemoteMetadata, get_remote_metadata_bytes
    from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
    from lmcache.v1.exceptions import IrrecoverableException
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
except ImportError as _e:  # pragma: no cover - exercised only without the extra
    raise ImportError("cxlalloc's LMCache plugin needs LMCache: pip install '.[lmcache]' from a clone of cxlalloc "
                      f"(import failed: {_e})") from _e

log = logging.getLogger("cxlalloc.kvstore.lmcache")

SCHEME = "cxlalloc://"
PLUGIN_TYPE = "cxlalloc"
DEFAULT_URL = SCHEME + P.DEFAULT_SOCKET
DEFAULT_NAMESPACE = "lmcache"
MAGIC = b"CXLLMC02"               # 02: chunks end in the block checksum trailer (01 chunks read as misses)
_HEAD = struct.Struct("<8s32sI")   # magic, key, RemoteMetadata bytes
_ALIGN = 64                        # payload offset in a slot: cache-line aligned copies
_IO_THREADS = 4                    # large copies run off LMCache's event loop
# Below this many bytes a request runs on LMCache's event loop itself: a hop
# to a copy thread (two thread wake-ups) costs more than the copy (measured:
# 1,300 vs 3,150 exists/s through LMCache on the 2-core CI machine).
_INLINE_BYTES = 1 << 20
_KEY_CACHE = 65536                 # chunk keys whose kv-server name is remembered


class PluginConfigError(IrrecoverableException, ValueError):
    """A malformed ``cxlalloc://`` URL or option in LMCache's config.  LMCache re-raises an
    ``IrrecoverableException`` from a connector's creation (any other exception it logs and then runs with no
    connection, reporting "Connected to remote storage"), so the engine stops at start with this one line."""


def parse_url(url: str) -> Tuple[str, float, str]:
    """``cxlalloc:///path/kv.sock?timeout=S&namespace=NAME`` -> (socket path, timeout s, namespace).

    Raises:
        ValueError: not a cxlalloc:// URL, a bad socket path, an unknown
            option, a timeout that is not a positive number, a namespace that
            is empty, longer than 64 characters or contains ``/``
            (:func:`cxlalloc.kvstore.engines.config.parse_kv_url`).
    """
    return parse_kv_url(url, "cxlalloc LMCache plugin", DEFAULT_NAMESPACE, DEFAULT_TIMEOUT_S)


def server_key(key: CacheEngineKey) -> bytes:
    """The kv-server key of an LMCache chunk key: BLAKE2b-256 of ``key.to_string()`` (32 bytes)."""
    return hashlib.blake2b(b"cxlalloc-lmcache/1|" + key.to_string().encode(), digest_size=32).digest()


@functools.lru_cache(maxsize=_KEY_CACHE)
def _names(tenant: str, key: CacheEngineKey) -> Tuple[str, bytes]:
    """(namespace, server key) of a chunk, remembered: a prefix lookup names the same chunks again and again."""
    return namespace_of(tenant, key), server_key(key)


def namespace_of(tenant: str, key: CacheEngineKey) -> str:
    """The kv-server namespace of a chunk: ``tenant/model@world_size@worker_id@dtype[@tags]``.

    Longer than the protocol's 256 characters (a long model path, many tags):
    the tail is replaced by a 16-hex-digit BLAKE2b digest of it.
    """
    s = key.to_string().split("@")
    # model@world@worker@hash@dtype[@tags...]: drop the chunk hash (index 3)
    ns = tenant + "/" + "@".join(s[:3] + s[4:])
    if len(ns) > P.MAX_NS_CHARS:
        digest = hashlib.blake2b(ns.encode(), digest_size=8).hexdigest()
        ns = ns[:P.MAX_NS_CHARS - 17] + "#" + digest
    return ns


def _run_end(names: Sequence[Tuple[str, bytes]], start: int) -> int:
    """End of the run of ``names[start:]`` in the same namespace (one kv-server request each)."""
    end = start + 1
    while end < len(names) and names[end][0] == names[start][0]:
        end += 1
    return end


def _bytes_of(memory_obj: MemoryObj) -> torch.Tensor:
    """The logical bytes of a memory object as a 1-D uint8 tensor (no copy), on the
    object's device: a GPU-resident one is copied to or from the pool over the link."""
    n = memory_obj.get_size()
    raw = getattr(memory_obj, "raw_data", None)
    if isinstance(raw, torch.Tensor) and raw.is_contiguous():
        return raw.view(-1).view(torch.uint8)[:n] if raw.dtype != torch.uint8 else raw.view(-1)[:n]
    buf = memory_obj.byte_array
    return torch.frombuffer(buf, dtype=torch.uint8, count=n) if n else torch.empty(0, dtype=torch.uint8)


class CxlallocConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over a cxlalloc kv-server (see the module docstring).

    Args:
        url: ``cxlalloc:///path/kv.sock`` with optional ``timeout``/``namespace``.
        loop: LMCache's event loop (the async methods run on it; requests
            moving 1 MiB or more run on a small thread pool of this connector
            so the loop keeps serving).
        local_cpu_backend: LMCache's ``LocalCPUBackend``: gets allocate their
            memory objects from it.
        config, metadata: LMCache's engine config and metadata (chunk shapes).

    Raises:
        ValueError: a bad URL or option (see :func:`parse_url`).
    """

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop, local_cpu_backend, config=None, metadata=None):
        try:
            path, timeout, tenant = parse_url(url)
        except ValueError as e:
            raise PluginConfigError(str(e)) from None
        self.url, self.loop, self.local_cpu_backend, self.tenant = url, loop, local_cpu_backend, tenant
        self.have_metadata = metadata is not None
        if metadata is not None:
            super().__init__(config, metadata)   # shapes, dtypes, RemoteMetadata size
        else:  # LMCache's scheduler role: lookups only, nothing is allocated
            self.full_chunk_size_bytes = self.single_token_size = None
        # commit="wait": LMCache's scheduler process asks another connection whether a chunk exists right after a
        # worker's put; a pipelined commit (protocol 3) could still be in flight then (not measured here yet)
        self.store = RemoteBlockStore("unix://" + path, None, timeout=timeout, name="lmcache", commit="wait")
        self.counters = StoreCounters(("puts", "put_blocks", "stored_blocks", "put_skipped", "gets", "get_blocks",
                                       "hit_blocks", "bad_blocks", "corrupt_blocks", "alloc_failures", "lookups",
                                       "errors"))
        self._io = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="cxlalloc-lmcache")
        self._put_keys: Dict[str, Tuple[str, bytes]] = {}  # for list(): key string -> (ns, server key)
        self._keys_lock = threading.Lock()
        self._warned = set()
        if not self.store.connected():
            log.error("cxlalloc LMCache plugin: no kv-server answers at %s (%s: %s); every lookup is a miss until "
                      "one listens there (start `cxlalloc kv-server --socket %s`, or correct "
                      "remote_storage_plugin.cxlalloc.url)", path, url, self.store.last_error or "not reachable",
                      path)

    # ------------------------------------------------------------ helpers
    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("cxlalloc LMCache plugin: %s", msg)

    async def _run(self, nbytes: int, fn, *args):
        """``fn(*args)`` on this connector's copy threads, or on the loop when it moves under 1 MiB."""
        if nbytes < _INLINE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def _chunk_bytes(self, n: int) -> int:
        return n * (self.full_chunk_size_bytes or 0)

    def _meta_bytes(self) -> int:
        return get_remote_metadata_bytes()

    def _header_bytes(self, meta_len: int) -> int:
        n = _HEAD.size + meta_len
        return (n + _ALIGN - 1) // _ALIGN * _ALIGN

    # ------------------------------------------------------------ lookups
    def _prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many of ``keys`` are stored, counted from the first, stopping at the first miss
        (one kv-server lookup per namespace run; the pins are released at once)."""
        self.counters.add("lookups")
        names = [_names(self.tenant, k) for k in keys]
        n = 0
        while n < len(keys):
            ns, end = names[n][0], _run_end(names, n)
            run = names[n:end]
            try:
                with self.store.lookup(ns, [sk for _, sk in run]) as lease:
                    got = lease.blocks
            except Exception as e:  # never into the engine
                self._error("lookup", e)
                return n
            n += got
            if got < len(run):
                break
        return n

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """True when the kv-server holds ``key`` (or its Redis tier does: it is read back into the pool)."""
        return self._prefix([key]) == 1

    async def exists(self, key: CacheEngineKey) -> bool:
        return self.exists_sync(key)  # one short request: on the loop (see _INLINE_BYTES)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """Chunks stored, by prefix: counting stops at the first miss (one lookup for the whole prefix)."""
        return self._prefix(list(keys))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return self._prefix(list(keys))

    # ------------------------------------------------------------ puts
    def _put_many(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> int:
        """Reserve, copy (one copy per block), commit; returns the blocks published."""
        self.counters.add("puts")
        self.counters.add("put_blocks", len(keys))
        if not self.have_metadata:
            self._warn_once("nometa", "no LMCache metadata (scheduler role): puts are skipped")
            return 0
        meta_len = self._meta_bytes()
        hdr = self._header_bytes(meta_len)
        # one reservation per (namespace, slot size)
        groups: Dict[Tuple[str, int], List[int]] = {}
        payloads = []
        for i, (k, mo) in enumerate(zip(keys, objs)):
            src = _bytes_of(mo)
            payloads.append(src)
            # header | payload | 16-byte trailer: the block store's checksum format (XXH3-128 of the server key
            # and everything before it), so readers and the kv-server's discard verify chunks like any block
            groups.setdefault((_names(self.tenant, k)[0], hdr + src.numel() + CHECKSUM_BYTES), []).append(i)
        published = 0
        for (ns, nbytes), idx in groups.items():
            skeys = [_names(self.tenant, keys[i])[1] for i in idx]
            tokens = payloads[idx[0]].numel() // self.single_token_size if self.single_token_size else 0
            try:
                res = self.store.reserve(ns, skeys, nbytes, tokens)
            except ValueError as e:  # larger than one chunk of the server: a miss, said once
                self._warn_once("too_large", f"{e}; chunks of {nbytes} bytes are not stored")
                self.counters.add("put_skipped", len(idx))
                continue
            except Exception as e:
                self._error("reserve", e)
                self.counters.add("put_skipped", len(idx))
                continue
            with res:
                for i, sk, view in zip(idx, skeys, res.views):
                    if view is None:
                        continue  # stored already, or no room (all pinned)
                    mo = objs[i]
                    meta = RemoteMetadata(payloads[i].numel(), mo.get_shapes(), mo.get_dtypes(),
                                          mo.get_memory_format()).serialize()
                    head = bytearray(hdr)
                    _HEAD.pack_into(head, 0, MAGIC, sk, len(meta))
                    head[_HEAD.size:_HEAD.size + len(meta)] = meta
                    view[:hdr].copy_(torch.frombuffer(head, dtype=torch.uint8))
                    # a device payload comes to host memory once; the pool and the checksum take that copy
                    body = payloads[i] if payloads[i].device.type == "cpu" else payloads[i].cpu()
                    view[hdr:-CHECKSUM_BYTES].copy_(body)
                    # sealed over the private header and payload, not the pool: another client mapping the pool
                    # read-write could change the pool's bytes between the copy and a checksum taken there, and a
                    # reader would then accept them (block_checksum(sk, header + payload), as the block store seals)
                    trailer = block_checksum(sk, bytes(head), memoryview(body.numpy()))
                    view[-CHECKSUM_BYTES:].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
                n = res.commit()
            published += n
            self.counters.add("put_skipped", len(idx) - n)
            with self._keys_lock:
                for i, sk in zip(idx, skeys):
                    if len(self._put_keys) < P.MAX_KEYS:
                        self._put_keys[keys[i].to_string()] = (ns, sk)
        self.counters.add("stored_blocks", published)
        return published

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        """Store one chunk (LMCache keeps its own reference counting of ``memory_obj``)."""
        await self._run(memory_obj.get_size(), self._put_many, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        """Store chunks with one reservation and one commit per namespace."""
        await self._run(sum(m.get_size() for m in memory_objs), self._put_many, list(keys), list(memory_objs))

    # ------------------------------------------------------------ gets
    def _read(self, key: CacheEngineKey, view: torch.Tensor, corrupt: List[bytes]) -> Optional[MemoryObj]:
        """A memory object holding the block in ``view`` (a pinned slot), or None.  A block whose checksum
        fails on the copy is a miss, its server key appended to ``corrupt`` (the caller has it dropped)."""
        meta_len = self._meta_bytes()
        hdr = self._header_bytes(meta_len)
        if view.numel() < hdr:
            return self._bad("a block shorter than its header")
        head = view[:hdr].numpy().tobytes()  # one read of the header: parsed and checksummed from this copy
        magic, sk, mlen = _HEAD.unpack(head[:_HEAD.size])
        if magic != MAGIC or sk != _names(self.tenant, key)[1] or mlen != meta_len:
            return self._bad("a block of another layout or key")
        meta = RemoteMetadata.deserialize(head[_HEAD.size:_HEAD.size + meta_len])
        if hdr + meta.length + CHECKSUM_BYTES != view.numel():
            return self._bad("a block whose size does not match its metadata")
        mo = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if mo is None:
            self.counters.add("alloc_failures")
            self._warn_once("alloc", "LMCache's CPU buffer is full: a stored chunk is not read back")
            return None
        dst = _bytes_of(mo)
        if dst.numel() < meta.length:
            mo.ref_count_down()
            return self._bad("LMCache allocated fewer bytes than the block holds")
        # One read of the pool: copied straight into LMCache's own buffer and verified there (not in the pool,
        # which another client could change between a check and the copy); a device buffer through one private
        # host copy
        want = view[-CHECKSUM_BYTES:].numpy().tobytes()
        if not copy_verified(dst[:meta.length], view[hdr:hdr + meta.length], sk, head, want):
            mo.ref_count_down()
            corrupt.append(sk)
            self.counters.add("corrupt_blocks")
            return self._bad("a chunk whose checksum does not match its bytes (changed in the pool)")
        return mo

    def _bad(self, why: str):
        self.counters.add("bad_blocks")
        self._warn_once("bad:" + why, f"{why}: treated as a miss")
        return None

    def _get_many(self, keys: Sequence[CacheEngineKey], prefix_only: bool) -> List[Optional[MemoryObj]]:
        """Memory objects for ``keys`` (None for a miss).  ``prefix_only``: stop at the first miss."""
        self.counters.add("gets")
        self.counters.add("get_blocks", len(keys))
        out: List[Optional[MemoryObj]] = [None] * len(keys)
        if not self.have_metadata:
            return out
        names = [_names(self.tenant, k) for k in keys]
        i = 0
        while i < len(keys):
            ns, j = names[i][0], _run_end(names, i)
            try:
                lease = self.store.lookup(ns, [sk for _, sk in names[i:j]])
            except Exception as e:
                self._error("lookup", e)
                return out
            corrupt: List[bytes] = []
            with lease:
                views = list(lease.views)
                for m, view in enumerate(views):
                    mo = self._read(keys[i + m], view, corrupt)
                    if mo is None:
                        views = views[:m]
                        break
                    out[i + m] = mo
            if corrupt:  # dropped (the server checks again first), so the engine's recompute stores it anew
                try:
                    self.store.discard(ns, corrupt)
                except Exception as e:
                    self._error("discard", e)
            self.counters.add("hit_blocks", len(views))
            if len(views) < j - i:
                if prefix_only:
                    break
                i += len(views) + 1  # the key after the stored prefix is missing: skip it
            else:
                i = j
        return out

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """The chunk of ``key`` in a memory object from LMCache's allocator, or None."""
        return (await self._run(self._chunk_bytes(1), self._get_many, [key], True))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Chunks of ``keys`` (None for each miss); a stored run is one lookup."""
        return await self._run(self._chunk_bytes(len(keys)), self._get_many, list(keys), False)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The stored prefix of ``keys`` (LMCache's prefetch): stops at the first miss."""
        got = await self._run(self._chunk_bytes(len(keys)), self._get_many, list(keys), True)
        return [mo for mo in got if mo is not None]

    # ------------------------------------------------------------ the rest
    def _list_sync(self) -> List[str]:
        with self._keys_lock:
            items = list(self._put_keys.items())
        live = []
        for s, (ns, sk) in items:
            try:
                with self.store.lookup(ns, [sk]) as lease:
                    if lease.blocks:
                        live.append(s)
            except Exception as e:
                self._error("lookup", e)
                break
        return live

    async def list(self) -> List[str]:
        """The key strings this connector put that the kv-server still holds.

        The server stores 32-byte hashes, not LMCache's key strings, so keys
        put by other processes are found by ``exists``/``get``, not listed.
        """
        return await self._run(_INLINE_BYTES, self._list_sync)

    def support_ping(self) -> bool:
        """False: LMCache's health check must not see the pool.  LMCache 0.5.6 marks the whole engine unhealthy
        on a failed ping and then skips every tier (its local CPU one too) until a later check passes; a pool
        that is down is a miss (lookups 0, puts skipped, reconnect with backoff), and the other tiers go on."""
        return False

    async def ping(self) -> int:
        """0 when the kv-server answers, 1 when it is away (not used by LMCache: see :meth:`support_ping`)."""
        stats = await self._run(0, self.store.server_stats)
        return 0 if stats is not None else 1

    def _error(self, what: str, e: BaseException) -> None:
        self.counters.add("errors")
        self._warn_once("err:" + what, f"{what} failed ({type(e).__name__}: {e}); treated as a miss")

    def stats(self) -> dict:
        """This connector's counters (puts, stored_blocks, put_skipped, gets, hit_blocks, bad_blocks, ...)
        and its kv-server client's (``client``: connected, server_errors, reconnects, the pool's bytes)."""
        out = self.counters.snapshot()
        out["client"] = self.store.stats()
        return out

    async def close(self):
        self.store.close()
        self._io.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"<CxlallocConnector {self.url}>"


class CxlallocConnectorAdapter(ConnectorAdapter):
    """LMCache's adapter for ``cxlalloc://`` URLs and the ``cxlalloc`` remote-storage plugin.

    With ``remote_storage_plugins: ["cxlalloc"]`` (or ``"cxlalloc.<instance>"``)
    LMCache asks it for ``plugin://<name>``; the kv-server's URL comes from
    ``extra_config["remote_storage_plugin.<name>.url"]`` (default
    ``cxlalloc:///run/cxlalloc/kv.sock``).  A ``cxlalloc://`` URL given
    directly (``CreateConnector``) is used as it is.
    """

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        url = context.url
        if url.startswith("plugin://"):
            name = url[len("plugin://"):]
            extra = (context.config.extra_config if context.config is not None else None) or {}
            url = extra.get(f"remote_storage_plugin.{name}.url") or DEFAULT_URL
        return CxlallocConnector(url, context.loop, context.local_cpu_backend, context.config, context.metadata)


__all__ = ["CxlallocConnectorAdapter", "CxlallocConnector", "PluginConfigError", "parse_url", "server_key", "namespace_of", "SCHEME"]
