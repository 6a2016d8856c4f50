"""Allocation latency and throughput.

GPU part (per host backend): latency of one ``malloc`` and one ``free`` of a
segment-sized block on each tier, **cold** (the block cache is emptied after
every free, so each malloc creates a new segment: driver calls included) and
**cached** (a hit in the block cache), next to the raw driver calls torch's
allocators make: ``cuMemAlloc``/``cuMemFree`` (torch's native allocator on a
cache miss), ``cuMemHostAlloc``/``cuMemFreeHost`` (torch's pinned host
allocator) and ``cuMemAllocManaged`` (guarded).  Microseconds, median and p90
of per-call samples.

CPU part (always runs; for regressions): the same latencies and an
allocation *throughput* (mallocs + frees per second over a fixed pseudo-random
size mix, :func:`size_mix`) on cxlalloc's **simulated** driver.  These measure
the engine's own CPU cost (block cache, policy, accounting) over a driver
whose calls are cheap host operations: they are labelled ``simulated`` and
are not comparable to GPU numbers.

Timing: ``cxlalloc._C.bench_alloc`` / ``bench_driver_alloc`` /
``bench_alloc_pattern`` (``csrc/python/bind_bench.cpp``) time each call in
C++ with ``steady_clock`` and the GIL released, so Python's own overhead
(about as large as a cached malloc) stays out.  When the extension was built
without them, a Python ``perf_counter_ns`` loop is used and each result says
so.
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from typing import Any, Dict, List, Optional

import cxlalloc
from cxlalloc import _C
from cxlalloc_apps.bench import guard
from cxlalloc_apps.bench.meta import RecordWriter, new_record
from cxlalloc_apps.bench.timing import summarize

MiB = 1 << 20
GiB = 1 << 30
BACKENDS = ("host-vmm", "pinned", "managed")


def size_mix(n: int = 256, seed: int = 7) -> List[int]:
    """``n`` sizes (bytes), log-uniform between 512 B and 8 MiB, fixed seed: the
    shapes of a decode step's temporaries and KV chunks."""
    rng = random.Random(seed)
    return [int(2 ** rng.uniform(9, 23)) for _ in range(n)]


def _us(ns: List[int]) -> Dict[str, float]:
    s = summarize([x / 1e3 for x in ns])
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}


def _have_cpp() -> bool:
    return all(hasattr(_C, n) for n in ("bench_alloc", "bench_driver_alloc", "bench_alloc_pattern"))


def _time_alloc(a, nbytes: int, iters: int, only_host: bool, cold: bool) -> Dict[str, Any]:
    if _have_cpp():
        r = _C.bench_alloc(a._engine, a.device, int(nbytes), int(iters), "other", bool(only_host), bool(cold))
        return {"malloc_us": _us(r["malloc_ns"]), "free_us": _us(r["free_ns"]), "tier": r["tier"],
                "timer": "C++ steady_clock per call (cxlalloc._C.bench_alloc)"}
    dev = a._dev
    mal, fre, tier = [], [], None
    if not cold:
        dev.free(dev.malloc(nbytes, 0, "other", only_host))
    else:
        dev.empty_cache()
    for i in range(iters):
        t0 = time.perf_counter_ns()
        p = dev.malloc(nbytes, 0, "other", only_host)
        mal.append(time.perf_counter_ns() - t0)
        if i == 0:
            tier = dev.tier_of(p)
        t1 = time.perf_counter_ns()
        dev.free(p)
        fre.append(time.perf_counter_ns() - t1)
        if cold:
            dev.empty_cache()
    return {"malloc_us": _us(mal), "free_us": _us(fre), "tier": tier,
            "timer": "Python perf_counter_ns loop (bind_bench not built): includes Python call overhead"}


def _latency_grid(w, a, label: str, sizes, tiers, iters_cached: int, iters_cold: int, simulated: bool, dl,
                  backend: str) -> None:
    for nbytes in sizes:
        for tier in tiers:
            for mode in ("cached", "cold"):
                part = f"{label}:{tier}:{mode}:{nbytes}"
                if dl.expired():
                    w.skip(part, "time budget used up")
                    continue
                try:
                    r = _time_alloc(a, nbytes, iters_cached if mode == "cached" else iters_cold, tier == "host",
                                    mode == "cold")
                except Exception as e:
                    w.error(part, e)
                    continue
                w.add(dict(r, part=part, kind="cxlalloc", backend=backend, tier_requested=tier, mode=mode,
                           bytes=nbytes, simulated=simulated,
                           iters=iters_cached if mode == "cached" else iters_cold,
                           method=(f"{'SIMULATED driver: ' if simulated else ''}one malloc + one free of {nbytes} "
                                   f"bytes per iteration on the {tier} tier "
                                   f"({'cache emptied after each free: a new segment each time' if mode == 'cold' else 'served from the block cache after one warm-up'}); "
                                   f"{r['timer']}")))


def _driver_grid(w, a, sizes, iters: int, simulated: bool, dl, free_bytes: Optional[int]) -> None:
    if not _have_cpp():
        w.skip("driver", "raw driver timings need cxlalloc._C.bench_driver_alloc (rebuild the extension)")
        return
    for kind in ("cuMemAlloc", "cuMemHostAlloc", "cuMemAllocManaged"):
        for nbytes in sizes:
            part = f"driver:{kind}:{nbytes}"
            if dl.expired():
                w.skip(part, "time budget used up")
                continue
            if kind == "cuMemAllocManaged" and not simulated:
                try:
                    guard.check_managed(nbytes, free_bytes or 0, what=part)
                except guard.ManagedMemoryGuardError as e:
                    w.skip(part, str(e))
                    continue
            try:
                r = _C.bench_driver_alloc(a._engine, a.device, kind, int(nbytes), int(iters))
            except Exception as e:
                w.error(part, e)
                continue
            w.add({"part": part, "kind": "driver", "call": kind, "bytes": nbytes, "iters": iters,
                   "simulated": simulated, "alloc_us": _us(r["alloc_ns"]), "free_us": _us(r["free_ns"]),
                   "method": f"{'SIMULATED driver: ' if simulated else ''}{kind} + its free, C++ steady_clock per "
                             "call on the device's primary context (cxlalloc._C.bench_driver_alloc)"})


def _throughput(w, a, rounds: int, simulated: bool, backend: str) -> None:
    sizes = size_mix()
    part = f"throughput:{backend}"
    try:
        if _have_cpp():
            r = _C.bench_alloc_pattern(a._engine, a.device, sizes, int(rounds), "other")
            ops, ns, timer = r["ops"], r["ns"], "C++ steady_clock around the whole loop (bench_alloc_pattern)"
        else:
            dev = a._dev
            t0 = time.perf_counter_ns()
            ops = 0
            for _ in range(rounds):
                ptrs = [dev.malloc(s, 0, "other", False) for s in sizes]
                for p in ptrs[0::2] + ptrs[1::2]:
                    dev.free(p)
                ops += 2 * len(sizes)
            ns, timer = time.perf_counter_ns() - t0, "Python perf_counter_ns loop (includes Python overhead)"
    except Exception as e:
        w.error(part, e)
        return
    w.add({"part": part, "kind": "throughput", "backend": backend, "simulated": simulated, "ops": ops, "ns": ns,
           "ops_per_s": ops / (ns / 1e9) if ns else None, "sizes": len(sizes), "rounds": rounds,
           "size_mix": "256 sizes log-uniform in [512 B, 8 MiB], seed 7",
           "method": f"{'SIMULATED driver: ' if simulated else ''}each round mallocs every size of the mix, then "
                     f"frees the even positions, then the odd ones; ops = mallocs + frees; {timer}"})



@contextlib.contextmanager
def _allocator(**options):
    """An Allocator for one measurement grid, its cache emptied and the
    object collected afterwards (even when the grid fails), so the next
    backend starts from a clean driver."""
    a = cxlalloc.Allocator(**options)
    try:
        yield a
    finally:
        try:
            a.empty_cache()
        except Exception:
            pass
        del a
        gc.collect()

def run(ctx) -> Dict[str, Any]:
    quick = ctx.quick or ctx.simulate
    sizes = [2 * MiB, 64 * MiB] if quick else [2 * MiB, 64 * MiB, 512 * MiB]
    iters_cached, iters_cold, iters_driver = (200, 5, 5) if quick else (1000, 10, 10)
    backends = [b for b in BACKENDS if b in (ctx.args.backends or BACKENDS)]
    params = {"sizes_bytes": sizes, "iters_cached": iters_cached, "iters_cold": iters_cold,
              "iters_driver": iters_driver, "backends": backends, "units": "microseconds (us); ops/s",
              "cpp_timers": _have_cpp()}
    w = RecordWriter(ctx.out_dir, new_record("allocation", params, ctx.simulate, ctx.argv, ctx.device))
    dl = ctx.deadline

    # ---- GPU part
    gpu_ok, reason = (False, "--simulate: GPU allocation latencies need a real GPU") if ctx.simulate \
        else ctx.gpu_ready()
    if not gpu_ok:
        w.skip("gpu", reason)
    else:
        free = None
        try:
            import torch

            free = int(torch.cuda.mem_get_info(ctx.device)[0])
        except Exception:
            pass
        w.record["parameters"]["free_bytes_at_start"] = free
        first = True
        for backend in backends:
            if dl.expired():
                w.skip(f"gpu:{backend}", "time budget used up")
                continue
            host_limit = 2 * max(sizes) + 64 * MiB
            if backend == "managed":
                try:
                    guard.check_managed(host_limit, free or 0, what=f"allocation:{backend}")
                except guard.ManagedMemoryGuardError as e:
                    w.skip(f"gpu:{backend}", str(e))
                    continue
            try:
                with _allocator(device_limit=2 * max(sizes) + 64 * MiB, host_limit=host_limit,
                                backend=backend, device=ctx.device, migration_rate=0) as a:
                    tiers = ("device", "host") if first else ("host",)  # the device tier does not depend on the backend
                    _latency_grid(w, a, f"gpu:{backend}", sizes, tiers, iters_cached, iters_cold, False, dl, backend)
                    if first:
                        _driver_grid(w, a, sizes, iters_driver, False, dl, free)
                        _throughput(w, a, 20, False, backend)
                first = False
            except Exception as e:
                w.error(f"gpu:{backend}", e)

    # ---- CPU part: the simulated driver (always)
    sim_backends = backends
    for backend in sim_backends:
        if dl.expired():
            w.skip(f"sim:{backend}", "time budget used up")
            continue
        try:
            with _allocator(simulate=True, device_limit=2 * max(sizes[:2]) + 64 * MiB,
                            host_limit=2 * max(sizes[:2]) + 64 * MiB, backend=backend, migration_rate=0) as a:
                _latency_grid(w, a, f"sim:{backend}", sizes[:2], ("device", "host"), iters_cached, iters_cold, True,
                              dl, backend)
                if backend == sim_backends[0]:
                    _driver_grid(w, a, sizes[:2], iters_driver, True, dl, None)
                _throughput(w, a, 20, True, backend)
        except Exception as e:
            w.error(f"sim:{backend}", e)
    w.note("results with simulated=true ran on cxlalloc's simulated CUDA driver: engine CPU cost only, "
           "not comparable to GPU numbers")
    return w.finish()
