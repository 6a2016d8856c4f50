"""The kv-server as a secondary tier of vLLM's own KV offloading (no LMCache).

vLLM's ``OffloadingConnector`` with ``spec_name: TieringOffloadingSpec`` keeps a CPU primary tier (a shared
memory region of the engine) and takes out-of-tree secondary tiers by ``module_path``
(``vllm/v1/kv_offload/tiering/base.py``, ``SecondaryTierManager``; vLLM 0.32's CPU build ships it).  This
module is one: chunks cascade primary -> the machine's kv-server pool, and come back (promotion) pool ->
primary, so every vLLM process of the machine finds the chunks any other one stored.  The tier config, in
``kv_connector_extra_config``::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4294967296,
     "secondary_tiers": [{"type": "CxlallocSecondaryTier", "module_path": "cxlalloc.kvstore.engines.vllm_tier",
                          "url": "cxlalloc:///run/cxlalloc/kv.sock"}]}

URL options: ``?timeout=S`` (seconds per kv-server request, default 5), ``&namespace=NAME`` (default
``vllm``).  Tier parameters: ``url``, ``io_threads`` (copy threads, 1-16, default 2), ``locality``
(``LOCAL``, the default: the pool is this machine's, or ``REMOTE``).

**Keys.**  vLLM's ``OffloadKey`` (a block hash of the chunk's tokens and everything before them, then the KV
group) names the chunk; the kv-server namespace is ``<namespace>/<model>@<world_size>@<dtype>@<bytes>``
(bytes: one chunk of the primary tier, every worker's pages) and the key BLAKE2b-256 of that identity and the
``OffloadKey``.  vLLM's default block hash (``sha256``) is the same in every process; a non-cryptographic
``prefix_caching_hash_algo`` is seeded per process unless ``PYTHONHASHSEED`` is set (then nothing is shared).

**Slots.**  A 64-byte header (magic ``CXLVLM01``, the 32-byte key, the payload length), the chunk's bytes, and
the block store's 16-byte checksum trailer (XXH3-128 of the key, header and payload), sealed over the engine's
own primary chunk (pinned by vLLM for the job), never over the pool; a reader copies the chunk into its
primary slot and checks the checksum on that copy (another client mapping the pool read-write could change
the pool's bytes between a check there and the copy).  A chunk that fails is a miss for that key (vLLM
recomputes it), reported to the server, which drops it after its own check.

**Calls** (vLLM's contract: every method runs in the scheduler process and must not block on copies):

* ``lookup``: one kv-server lookup of the key (its pin released at once): ``HIT`` or ``MISS``; a kv-server
  that is down is a ``MISS``, never an exception.
* ``submit_store`` (cascade primary -> pool) and ``submit_load`` (promotion pool -> primary) run on copy
  threads; ``get_finished_jobs`` hands their ``JobResult``\\ s back.  A store is one reservation, one copy
  per chunk and one commit (nothing visible before; a chunk the pool holds already is skipped); a load is one
  lookup per run of stored chunks, pinned for the copy.  A chunk evicted between the lookup and the load, or
  one whose checksum fails, is a failed key of the job (``successful_keys`` names the others).

Tested on vLLM's CPU build with a test-only stand-in for vLLM's GPU<->CPU copy (vLLM's own worker refuses
the CPU platform): tests/engines/test_vllm_offload_tier.py.  Not yet run on a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Dict, Iterable, List, Tuple

import numpy as np
import torch

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.client import DEFAULT_TIMEOUT_S, RemoteBlockStore
from cxlalloc.kvstore.counters import StoreCounters
from cxlalloc.kvstore.engines.config import check_params, int_in, one_of, parse_kv_url
from cxlalloc.kvstore.layout import CHECKSUM_BYTES, block_checksum, copy_verified

try:
    from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, ReqContext, RequestOffloadingContext,
                                         get_offload_group_idx)
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as _e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("cxlalloc's vLLM offloading tier needs vLLM with kv_offload tiering (vLLM >= 0.32: "
                      f"vllm/v1/kv_offload/tiering/base.py); import failed: {_e}") from _e

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey

log = logging.getLogger("cxlalloc.kvstore.engines.vllm_tier")

SCHEME = "cxlalloc://"
DEFAULT_URL = SCHEME + P.DEFAULT_SOCKET
DEFAULT_NAMESPACE = "vllm"
# secondary_tiers keys: name -> (default, checker, what it allows)
PARAMS = {"url": (DEFAULT_URL, str, "a cxlalloc:// URL"), "io_threads": (2, int_in(1, 16), "copy threads, 1-16"),
          "locality": ("LOCAL", one_of("LOCAL", "REMOTE"), "LOCAL or REMOTE")}
MAGIC = b"CXLVLM01"
_HEAD = struct.Struct("<8s32sQ")   # magic, key, payload bytes
_HDR = 64                          # payload offset: cache-line aligned copies


class TierConfigError(ValueError):
    """A malformed parameter of the cxlalloc tier in vLLM's ``secondary_tiers`` (vLLM stops at start)."""


def parse_url(url: str) -> Tuple[str, float, str]:
    """``cxlalloc:///path/kv.sock?timeout=S&namespace=NAME`` -> (socket path, timeout s, namespace).

    Raises:
        TierConfigError: not a ``cxlalloc://`` URL, a bad socket path, an unknown option, a timeout that is not
            a positive number, a namespace that is empty, longer than 64 characters or contains ``/``
            (:func:`cxlalloc.kvstore.engines.config.parse_kv_url`).
    """
    return parse_kv_url(url, "cxlalloc vLLM tier", DEFAULT_NAMESPACE, DEFAULT_TIMEOUT_S, TierConfigError)


def _chunks(view: memoryview) -> torch.Tensor:
    """vLLM's primary-tier memoryview, ``(num_chunks, chunk bytes)``, as a uint8 tensor over the same memory."""
    arr = np.asarray(view)
    if arr.ndim != 2:
        raise ValueError(f"vLLM's primary-tier view has shape {arr.shape}; expected (num_chunks, chunk bytes)")
    return torch.from_numpy(arr.view(np.uint8))


class CxlallocSecondaryTier(SecondaryTierManager):
    """vLLM's ``SecondaryTierManager`` over a cxlalloc kv-server (see the module docstring).

    Args (vLLM's factory passes the first four; the rest are the tier config's keys):
        offloading_spec: vLLM's ``TieringOffloadingSpec`` (its ``config`` names the model, dtype, parallelism).
        primary_kv_view: the primary tier's memoryview, shape ``(num_chunks, chunk bytes)``; chunk ``c`` is
            ``view[c]``, a chunk of every worker's pages (uint8).
        tier_type: the config's ``type``.
        backpressure_detector: vLLM's, or None.
        url: ``cxlalloc:///path/kv.sock?timeout=S&namespace=NAME`` (default ``cxlalloc:///run/cxlalloc/kv.sock``).
        io_threads: copy threads (int, 1-16, default 2).
        locality: ``"LOCAL"`` (default) or ``"REMOTE"``: how vLLM's tier filters see this tier.

    Raises:
        TierConfigError: an unknown parameter or a malformed value (vLLM stops at start with it).
    """

    medium = Medium.CPU

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **params):
        got = check_params(params, PARAMS, "cxlalloc vLLM tier", TierConfigError)
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        self.url = got["url"]
        path, timeout, self.tenant = parse_url(self.url)
        threads = got["io_threads"]
        self.locality = Locality(got["locality"])
        cfg = offloading_spec.config
        parts = [cfg.model.name, cfg.parallel.world_size, cfg.model.dtype, self.block_size_bytes]
        parts += [x for x in (getattr(cfg, "kv_cache_layout", None), "canonical" if cfg.canonical_layout else None)
                  if x]
        self.ident = "@".join(str(x) for x in parts)
        ns = self.tenant + "/" + self.ident
        if len(ns) > P.MAX_NS_CHARS:
            ns = ns[:P.MAX_NS_CHARS - 17] + "#" + hashlib.blake2b(ns.encode(), digest_size=8).hexdigest()
        self.ns = ns
        self._tokens = [int(t) * int(offloading_spec.blocks_per_chunk) for t in offloading_spec.tokens_per_block]
        self.slot_bytes = _HDR + self.block_size_bytes + CHECKSUM_BYTES
        self._primary = _chunks(primary_kv_view)
        # commit="wait": another vLLM process may look a chunk up right after its cascade, and a store job's
        # result counts what the server published (a pipelined commit would count what was sent)
        self.store = RemoteBlockStore("unix://" + path, None, timeout=timeout, name="vllm-offload", commit="wait")
        if not self.store.connected():
            log.error("cxlalloc vLLM tier: no kv-server answers at %s (%s); every lookup is a miss until one "
                      "listens there (start `cxlalloc kv-server --socket %s`)", path,
                      self.store.last_error or "not reachable", path)
        self.counters = StoreCounters(("lookups", "hits", "stores", "stored_chunks", "store_failures", "loads",
                                       "loaded_chunks", "load_failures", "bad_chunks", "corrupt_chunks"))
        self._lock = threading.Lock()
        self._done: List[JobResult] = []
        self._pending: Dict[int, Future] = {}
        self._warned: set = set()
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="cxlalloc-vllm-tier")
        self._closed = False
        log.info("cxlalloc vLLM tier: kv-server %s, namespace %s, %d-byte chunks", path, self.ns,
                 self.block_size_bytes)

    # ------------------------------------------------------------ names
    def server_key(self, key: "OffloadKey") -> bytes:
        """The 32-byte kv-server key of a vLLM ``OffloadKey`` (the same in every process)."""
        return hashlib.blake2b(b"cxlalloc-vllm/1|" + self.ident.encode() + b"|" + bytes(key),
                               digest_size=32).digest()

    def _tokens_of(self, key: "OffloadKey") -> int:
        g = get_offload_group_idx(key)
        return self._tokens[g] if g < len(self._tokens) else 0

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    # ------------------------------------------------------------ lookups
    def lookup(self, key: "OffloadKey", req_context: ReqContext) -> LookupResult:
        """``HIT`` when the pool holds the chunk, else ``MISS`` (a kv-server that is down is a miss)."""
        self.counters.add("lookups")
        try:
            with self.store.lookup(self.ns, [self.server_key(key)]) as lease:
                hit = lease.blocks == 1
        except Exception as e:  # never into vLLM's scheduler
            self._warn_once("lookup", "cxlalloc vLLM tier: lookup failed (%s: %s); a miss", type(e).__name__, e)
            return LookupResult.MISS
        if hit:
            self.counters.add("hits")
        return LookupResult.HIT if hit else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # ------------------------------------------------------------ jobs
    def _submit(self, job: TransferJob, fn) -> None:
        def run():
            try:
                result = fn(job)
            except Exception as e:  # a failed job, never an exception in vLLM's scheduler
                self._warn_once("job:" + type(e).__name__, "cxlalloc vLLM tier: a %s job failed (%s: %s)",
                                "load" if job.is_promotion else "store", type(e).__name__, e)
                result = JobResult(job_id=job.job_id, success=False)
            with self._lock:
                self._done.append(result)
                self._pending.pop(job.job_id, None)

        with self._lock:
            self._pending[job.job_id] = self._io.submit(run)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Copy the job's primary chunks into the pool on a copy thread (the result from
        :meth:`get_finished_jobs`)."""
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Copy the job's chunks from the pool into its primary chunks on a copy thread."""
        self._submit(job_metadata, self._load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def drain_jobs(self) -> None:
        """Wait for every submitted job (their results stay queued for :meth:`get_finished_jobs`)."""
        with self._lock:
            futures = list(self._pending.values())
        for f in futures:
            f.result()

    # ------------------------------------------------------------ store: primary -> pool
    def _store(self, job: TransferJob) -> JobResult:
        t0 = time.perf_counter()
        self.counters.add("stores")
        keys = list(job.keys)
        chunk_ids = [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ValueError(f"{len(keys)} keys for {len(chunk_ids)} chunk ids")
        sks = [self.server_key(k) for k in keys]
        groups: Dict[int, List[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self._tokens_of(k), []).append(i)
        ok, written = True, 0
        for tokens, idx in groups.items():
            try:
                res = self.store.reserve(self.ns, [sks[i] for i in idx], self.slot_bytes, tokens)
            except ValueError as e:  # a chunk larger than the server's --chunk: never stored, said once
                self._warn_once("too_large", "cxlalloc vLLM tier: %s; chunks of %d bytes are not stored", e,
                                self.slot_bytes)
                self.counters.add("store_failures", len(idx))
                ok = False
                continue
            if getattr(res, "slots", None) == 0 and not self.store.connected():  # the kv-server is away
                self.counters.add("store_failures", len(idx))
                ok = False
                res.abort()
                continue
            filled, nbytes = 0, 0
            with res:
                for i, view in zip(idx, res.views):
                    if view is None:
                        continue  # stored already, or no room (every block pinned)
                    src = self._primary[chunk_ids[i]]
                    head = bytearray(_HDR)
                    _HEAD.pack_into(head, 0, MAGIC, sks[i], src.numel())
                    # sealed over the engine's own chunk (pinned for this job), not the pool's copy of it
                    trailer = block_checksum(sks[i], bytes(head), memoryview(src.numpy()))
                    view[:_HDR].copy_(torch.frombuffer(head, dtype=torch.uint8))
                    view[_HDR:_HDR + src.numel()].copy_(src)
                    view[-CHECKSUM_BYTES:].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
                    filled += 1
                    nbytes += src.numel()
                n = res.commit()
            self.counters.add("stored_chunks", n)
            if n == filled:
                written += nbytes
            else:  # the kv-server went away before the commit: nothing of this reservation is visible
                self.counters.add("store_failures", filled)
                ok = False
        return JobResult(job_id=job.job_id, success=ok, transfer_time=time.perf_counter() - t0,
                         transfer_bytes=written)

    # ------------------------------------------------------------ load: pool -> primary
    def _copy_in(self, view: torch.Tensor, sk: bytes, chunk_id: int, corrupt: List[bytes]) -> bool:
        """Copy one stored chunk into primary chunk ``chunk_id`` and verify the copy; False on any mismatch."""
        head = view[:_HDR].numpy().tobytes()   # one read: parsed and checksummed from this copy
        magic, key, n = _HEAD.unpack(head[:_HEAD.size])
        dst = self._primary[chunk_id]
        if magic != MAGIC or key != sk or n != dst.numel() or view.numel() != _HDR + n + CHECKSUM_BYTES:
            self.counters.add("bad_chunks")
            self._warn_once("bad", "cxlalloc vLLM tier: a stored chunk of another layout or key: a miss")
            return False
        want = view[-CHECKSUM_BYTES:].numpy().tobytes()
        # one read of the pool, into this engine's primary chunk, verified there
        if not copy_verified(dst, view[_HDR:_HDR + n], sk, head, want):
            corrupt.append(sk)
            self.counters.add("corrupt_chunks")
            self._warn_once("corrupt", "cxlalloc vLLM tier: a chunk whose checksum does not match its bytes "
                                       "(changed in the pool): a miss")
            return False
        return True

    def _load(self, job: TransferJob) -> JobResult:
        t0 = time.perf_counter()
        self.counters.add("loads")
        keys = list(job.keys)
        chunk_ids = [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ValueError(f"{len(keys)} keys for {len(chunk_ids)} chunk ids")
        sks = [self.server_key(k) for k in keys]
        good: List[int] = []
        corrupt: List[bytes] = []
        i = 0
        while i < len(keys):
            try:
                lease = self.store.lookup(self.ns, sks[i:])
            except Exception as e:
                self._warn_once("load", "cxlalloc vLLM tier: load lookup failed (%s: %s)", type(e).__name__, e)
                break
            with lease:
                views = list(lease.views)
                for m, view in enumerate(views):
                    if self._copy_in(view, sks[i + m], chunk_ids[i + m], corrupt):
                        good.append(i + m)
            i += len(views) + 1   # the key after the stored run is not stored (or not any more): skip it
        if corrupt:   # dropped (the server checks again first): vLLM recomputes and stores them anew
            try:
                self.store.discard(self.ns, corrupt)
            except Exception as e:
                self._warn_once("discard", "cxlalloc vLLM tier: discard failed (%s: %s)", type(e).__name__, e)
        self.counters.add("loaded_chunks", len(good))
        self.counters.add("load_failures", len(keys) - len(good))
        all_ok = len(good) == len(keys)
        return JobResult(job_id=job.job_id, success=all_ok,
                         successful_keys=None if all_ok else [keys[j] for j in good],
                         transfer_time=time.perf_counter() - t0,
                         transfer_bytes=len(good) * self.block_size_bytes)

    # ------------------------------------------------------------ the rest
    def stats(self) -> dict:
        """This tier's counters (lookups, hits, chunks stored and loaded, failures) and the client's."""
        return {"url": self.url, "namespace": self.ns, "connected": self.store.connected(),
                **self.counters.snapshot()}

    def shutdown(self) -> None:
        """Finish the submitted jobs and close the kv-server connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._io.shutdown(wait=True)
        log.info("cxlalloc vLLM tier: %s", self.counters.snapshot())
        self.store.close()


__all__ = ["CxlallocSecondaryTier", "TierConfigError", "parse_url", "DEFAULT_URL"]
