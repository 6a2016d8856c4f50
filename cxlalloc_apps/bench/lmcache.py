"""LMCache with ``cxlalloc://`` beside LMCache's own local CPU backend and its ``redis://`` connector (CPU).

    python -m cxlalloc bench --only lmcache [--quick] --out DIR

Writes ``DIR/lmcache.json`` (:mod:`.meta` record) and ``DIR/lmcache.png``.
One process builds LMCache's storage backends from LMCache configs (the real
``lmcache`` package, scripts/install_lmcache.sh) three ways, in the same run:

local_cpu
    LMCache's ``LocalCPUBackend`` alone (what an engine gets with
    ``local_cpu: true`` and no remote tier; private to the process).
cxlalloc
    ``RemoteBackend`` with the ``cxlalloc`` plugin, to a real ``cxlalloc
    kv-server`` process (shared by every process of the machine).
redis
    ``RemoteBackend`` with LMCache's ``redis://`` connector to a local
    ``redis-server`` (127.0.0.1 TCP, no persistence).

For each chunk size (256 KiB to 16 MiB: LMCache chunks of 256 tokens, bf16),
each backend, median of repeats:

store GB/s
    a chunk's bytes (a CPU tensor standing in for the engine's KV) copied into
    a memory object from LMCache's allocator, then put (batched, waited for).
get GB/s
    ``batched_get_blocking`` of the stored chunks (memory objects out).
retrieve GB/s
    get, then each memory object copied into a destination tensor (standing
    in for the engine's paged KV cache, where LMCache copies a hit next).
lookups/s
    ``contains`` of one stored key (LMCache's per-chunk lookup), and
    ``batched_contains`` of a 32-chunk prefix.

GB/s = 1e9 bytes/s.  Everything is host memory on this machine (the CPU
copies are memcpy; no GPU, no CXL device): the ratios compare the paths'
software and copies, not a link.  Not yet run with an engine on a GPU.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

MiB = 1 << 20
KiB = 1 << 10
SIZES = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
TOKENS = 256                     # LMCache's default chunk_size
BACKENDS = ("local_cpu", "cxlalloc", "redis")
LOOKUP_PREFIX = 32


def _shape(nbytes: int):
    """(layers, 2, tokens, kv_heads, head_dim) of a bf16 LMCache chunk of ``nbytes``:
    256 tokens x 2 (K, V) x 2 bytes x heads x 128 = 256 KiB per layer with 2 KV heads."""
    per_layer_2h = TOKENS * 2 * 2 * 2 * 128  # 2 kv heads
    if nbytes < per_layer_2h:
        raise ValueError(f"chunk of {nbytes} bytes is below one layer of 2 KV heads")
    layers = nbytes // per_layer_2h
    heads = 2
    while layers > 8 and layers % 2 == 0:  # a plausible shape: up to 8 KV heads, more layers after that
        if heads == 8:
            break
        layers //= 2
        heads *= 2
    return (layers, 2, TOKENS, heads, 128)


def lmcache_site() -> Optional[str]:
    from cxlalloc_apps.bench.meta import REPO_ROOT

    site = os.environ.get("CXLALLOC_LMCACHE_SITE") or os.path.join(REPO_ROOT, ".lmcache-site")
    return site if os.path.isdir(site) else None


def open_record(ctx, name: str, params: Dict[str, Any]):
    """(RecordWriter, None) for benchmark ``name`` with lmcache imported (its version in the parameters), or
    (writer, the finished "skipped" result) when lmcache cannot be imported; the LMCache benchmarks share it."""
    from cxlalloc_apps.bench.meta import RecordWriter, new_record

    w = RecordWriter(ctx.out_dir, new_record(name, params, False, ctx.argv, ctx.device))
    try:
        version = _import_lmcache()
    except Exception as e:
        return w, w.finish_skipped("all", f"lmcache is not importable ({type(e).__name__}: {e}); "
                                          "install it with scripts/install_lmcache.sh")
    w.record["parameters"]["lmcache"] = version
    return w, None


def _import_lmcache() -> str:
    site = lmcache_site()
    if site and site not in sys.path:
        sys.path.append(site)
    import lmcache  # noqa: F401
    from lmcache.v1.storage_backend.connector import ConnectorAdapter  # noqa: F401

    return lmcache.__version__


class _Engine:
    """LMCache's storage backends for one backend kind and chunk size."""

    def __init__(self, kind: str, nbytes: int, work: str, kv_url: str, redis_url: Optional[str], cpu_gb: float):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend import CreateStorageBackends

        from cxlalloc.kvstore import lmcache_yaml

        path = os.path.join(work, f"{kind}-{nbytes}.yaml")
        if kind == "cxlalloc":
            text = lmcache_yaml(kv_url, chunk_size=TOKENS, local_cpu_gb=cpu_gb)
        else:
            text = (f"chunk_size: {TOKENS}\nlocal_cpu: true\nmax_local_cpu_size: {cpu_gb:g}\nremote_serde: naive\n"
                    + (f"remote_url: \"{redis_url}\"\n" if kind == "redis" else ""))
        with open(path, "w") as f:
            f.write(text)
        self.config = LMCacheEngineConfig.from_file(path)
        self.metadata = LMCacheMetadata(model_name=f"bench-{nbytes}", world_size=1, local_world_size=1, worker_id=0,
                                        local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=_shape(nbytes),
                                        chunk_size=TOKENS)
        self.loop = asyncio.new_event_loop()
        self._t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._t.start()
        self.backends = CreateStorageBackends(self.config, self.metadata, self.loop)
        self.cpu = self.backends["LocalCPUBackend"]
        if kind == "local_cpu":
            self.store = self.cpu
        else:
            self.store = next(b for n, b in self.backends.items() if n.startswith("RemoteBackend"))
            if self.store.connection is None:
                raise RuntimeError(f"LMCache could not connect its {kind} backend")

    def keys(self, n: int, tag: int):
        import torch
        from lmcache.utils import CacheEngineKey

        return [CacheEngineKey(self.metadata.model_name, 1, 0, (tag << 32) + i, torch.bfloat16) for i in range(n)]

    def close(self) -> None:
        for name, b in self.backends.items():
            if b is not self.cpu:
                # LMCache 0.5.6's Redis connector can hang in close() (its executor's shutdown waits on
                # the loop it runs on): bounded, on a daemon thread
                t = threading.Thread(target=b.close, daemon=True)
                t.start()
                t.join(10)
        try:
            self.cpu.clear()
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._t.join(5)


def _server_args(nbytes: int, n: int) -> List[str]:
    """A kv-server whose pool holds one round of ``n`` chunks of ``nbytes`` (plus the plugin's header):
    slabs of at least 4 MiB, a page multiple, each a whole number of chunks."""
    page = os.sysconf("SC_PAGESIZE")
    slot = nbytes + 4096                                   # the plugin's header fits in the extra page
    chunk = max(4 * MiB // slot, 1) * slot
    chunk = (chunk + page - 1) // page * page
    per = chunk // slot
    size = -(-n // per) * chunk
    return ["--size", str(size), "--chunk", str(chunk), "--max-pinned", "100%"]  # a get pins the whole round


def _store(eng: _Engine, keys, src) -> float:
    """Seconds to copy ``src`` into one memory object per key and put them all (waited for)."""
    done: List[Any] = []
    t0 = time.perf_counter()
    objs = []
    for _ in keys:
        mo = eng.cpu.allocate(eng.metadata.get_shapes(), eng.metadata.get_dtypes())
        if mo is None:
            raise RuntimeError("LMCache's CPU buffer is full (raise max_local_cpu_size)")
        mo.tensor.reshape(-1).view(src.dtype).copy_(src)
        objs.append(mo)
    eng.store.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
    deadline = time.monotonic() + 120
    while len(done) < len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(keys) - len(done)} puts did not finish in 120 s")
        time.sleep(0.0005)
    dt = time.perf_counter() - t0
    for mo in objs:
        mo.ref_count_down()
    return dt


def _get(eng: _Engine, keys, dst=None) -> float:
    t0 = time.perf_counter()
    got = eng.store.batched_get_blocking(keys)
    if any(g is None for g in got):
        raise RuntimeError(f"{sum(g is None for g in got)} of {len(keys)} stored chunks were not found")
    if dst is not None:
        for g in got:
            dst.copy_(g.tensor.reshape(-1).view(dst.dtype))
    dt = time.perf_counter() - t0
    for g in got:
        g.ref_count_down()
    return dt


def _lookups(eng: _Engine, keys, seconds: float) -> Dict[str, float]:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if not eng.store.contains(keys[n % len(keys)]):
            raise RuntimeError("a stored chunk was not found by contains")
        n += 1
    one = n / (time.perf_counter() - t0)
    prefix = keys[:LOOKUP_PREFIX]
    m, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if eng.store.batched_contains(prefix) != len(prefix):
            raise RuntimeError("batched_contains missed a stored prefix")
        m += 1
    return {"contains_per_s": one, "batched_contains_per_s": m / (time.perf_counter() - t0),
            "prefix_chunks": len(prefix)}


def run(ctx) -> Dict[str, Any]:
    from cxlalloc_apps.bench.kvprocs import _Redis, _Server

    quick = ctx.quick
    total = (32 if quick else 64) * MiB          # bytes stored per size and backend, per repeat
    repeats = 2 if quick else 3
    lookup_s = 0.5 if quick else 1.0
    params = {"sizes_bytes": list(SIZES), "backends": list(BACKENDS), "bytes_per_point": total, "repeats": repeats,
              "chunk_tokens": TOKENS, "dtype": "bfloat16", "lookup_seconds": lookup_s,
              "lookup_prefix_chunks": LOOKUP_PREFIX, "quick": quick,
              "units": "GB/s = 1e9 bytes/s; lookups/s", "where": "CPU host memory; no GPU, no CXL device"}
    w, skipped = open_record(ctx, "lmcache", params)
    if skipped is not None:
        return skipped
    import torch

    torch.set_num_threads(1)  # one copy thread per path: the same for all three
    work = tempfile.mkdtemp(prefix="lmcb-", dir="/tmp")
    redis = None
    try:
        redis = _Redis(work)
        cpu_gb = max(0.5, 3 * total / 1e9)
        for nbytes in SIZES:
            n = max(total // nbytes, 2)
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            dst = torch.empty(nbytes, dtype=torch.uint8)
            for kind in BACKENDS:
                if ctx.deadline.expired():
                    w.skip(f"{kind}-{nbytes}", "time budget used up")
                    continue
                ctx.log(f"lmcache: {kind}, {nbytes // KiB} KiB chunks x {n}")
                eng = srv = None
                try:
                    if kind == "cxlalloc":
                        srv = _Server(work, _server_args(nbytes, n), f"kv-{nbytes}.sock").start()
                    eng = _Engine(kind, nbytes, work, srv.socket if srv else "", redis.url, cpu_gb)
                    # round 0 is the cold one (fresh pages of the pool, Redis's and LMCache's first
                    # allocations); the timed rounds reuse them, as a long-running server does
                    cold = _store(eng, eng.keys(n, 0), src)
                    if kind == "local_cpu":
                        eng.cpu.clear()
                    st, gt, rt = [], [], []
                    for r in range(repeats):
                        keys = eng.keys(n, r + 1)
                        st.append(_store(eng, keys, src))
                        gt.append(_get(eng, keys))
                        rt.append(_get(eng, keys, dst))
                        if r == 0:
                            lk = _lookups(eng, keys, lookup_s)
                        if kind == "local_cpu":
                            eng.cpu.clear()  # the next repeat's chunks need the buffer
                    b = n * nbytes
                    w.add({"kind": "throughput", "backend": kind, "chunk_bytes": nbytes, "chunks": n,
                           "store_GBps": b / statistics.median(st) / 1e9, "store_cold_GBps": b / cold / 1e9,
                           "get_GBps": b / statistics.median(gt) / 1e9,
                           "retrieve_GBps": b / statistics.median(rt) / 1e9, **lk, "status": "ok",
                           "method": "LMCache backend API from LMCache's own config (batched_submit_put_task waited "
                                     "for by its completion callback; batched_get_blocking; contains; "
                                     "batched_contains), median of repeats after an untimed cold round (its store "
                                     "is store_cold_GBps), one process; the kv-server's pool holds one round, so "
                                     "each round's puts evict the last one's and reuse its pages"})
                except Exception as e:
                    import traceback

                    w.error(f"{kind}-{nbytes}", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}")
                finally:
                    if eng is not None:
                        eng.close()
                    if srv is not None:
                        srv.stop()
        _ratios(w)
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    rec = w.finish()
    try:
        plot(rec, os.path.join(ctx.out_dir, "lmcache.png"))
    except Exception as e:  # a missing matplotlib never loses the record
        ctx.log(f"bench lmcache: no plot ({type(e).__name__}: {e})")
    return rec


def _ratios(w) -> None:
    """cxlalloc:// over local_cpu and over redis, per size and metric."""
    rows = {(r["backend"], r["chunk_bytes"]): r for r in w.record["results"] if r.get("kind") == "throughput"}
    for nbytes in SIZES:
        c = rows.get(("cxlalloc", nbytes))
        if c is None:
            continue
        out = {"kind": "ratio", "chunk_bytes": nbytes, "status": "ok",
               "method": "cxlalloc:// figure divided by the other backend's, same run"}
        for other in ("local_cpu", "redis"):
            o = rows.get((other, nbytes))
            if o is None:
                continue
            for m in ("store_GBps", "get_GBps", "retrieve_GBps", "contains_per_s", "batched_contains_per_s"):
                out[f"{m}_vs_{other}"] = c[m] / o[m] if o[m] else None
        w.add(out)


def plot(rec: Dict[str, Any], path: str) -> Optional[str]:
    """Store / get / retrieve GB/s and lookups/s by chunk size, one line per backend."""
    rows = [r for r in rec.get("results", []) if r.get("kind") == "throughput"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for ax, (m, label) in zip(axes, [("store_GBps", "store GB/s"), ("get_GBps", "get GB/s"),
                                     ("retrieve_GBps", "retrieve (get + copy out) GB/s"),
                                     ("contains_per_s", "contains (lookups/s)")]):
        for b, style in zip(BACKENDS, ("o-", "s-", "^-")):
            pts = sorted((r["chunk_bytes"], r[m]) for r in rows if r["backend"] == b)
            if pts:
                ax.plot([p[0] / MiB for p in pts], [p[1] for p in pts], style, label=b)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("chunk (MiB)")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("LMCache backends, CPU host memory (2-core shared machine; no GPU): "
                 f"lmcache {rec.get('parameters', {}).get('lmcache', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
