"""One decode worker process: ``python -m cxlalloc_apps.bench.worker SPEC.json OUT.jsonl``.

Why a process per variant group: cxlalloc's global mode must be enabled
before CUDA is initialised (so each cxlalloc configuration needs a fresh
process), an out-of-memory or a sticky CUDA error must not poison the other
variants, and a hang must be killable by the parent's time box without
losing the cells already measured.  Every finished cell is appended to
``OUT.jsonl`` at once (flushed), one JSON object per line.

SPEC (written by :mod:`cxlalloc_apps.bench.decode`)::

    {"group": "cxlalloc:host-vmm", "kind": "native" | "cxlalloc",
     "device": 0, "device_type": "cuda" | "cpu" (cpu: plumbing tests only),
     "deadline_unix": float,            # start no cell after this
     "global": bool (default true),     # kind cxlalloc: cxlalloc.enable() first (false: scoped/simulation)
     "cxlalloc_options": {...},         # cxlalloc.enable() options (kind cxlalloc)
     "free_bytes_at_start": int,        # for the managed-memory guard
     "stop_after_failure": bool,        # right-sizing: stop a variant at its first failure
     "cells": [{"id", "variant", "model", "context", "batch", "new_tokens", "spill",
                "budget_bytes" | None, "budget_rule", "backend", "managed_bytes",
                "cache_implementation", "prefill_chunk", "timeline"}, ...]}

Each output line is the cell plus ``status`` ("ok", "oom", "error",
"refused", "not_run"), and for finished runs: ``ttft_s``, ``decode_tokens_per_s``
(all sequences), ``step_ms`` (median per decode step), ``peak_*`` bytes,
cxlalloc tier statistics, the measured host fraction of the KV cache,
``timeline`` (per-step tier usage) when asked, and ``tokens_digest`` (hash of
the generated ids, to compare variants).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import cxlalloc
from cxlalloc_apps.bench.guard import ManagedMemoryGuardError, check_managed
from cxlalloc_apps.bench.model import SHAPES, build_model

# torch and cxlalloc.hf (which imports torch and transformers) are imported in
# Worker.setup(), after cxlalloc.enable(): global mode is installed before
# torch is imported, as the CXLALLOC start-up hook would.

GiB = 1 << 30
BUDGET_SLACK = 256 << 20


def budget_from_peak(peak_reserved: int, kv_final_bytes: int, spill: float) -> int:
    """Device budget (bytes) forcing ``spill`` of the KV cache to the host:
    native peak reserved + 256 MiB slack - spill x final KV bytes."""
    return int(peak_reserved + BUDGET_SLACK - spill * kv_final_bytes)


def _emit(fh, obj: Dict[str, Any]) -> None:
    fh.write(json.dumps(obj, default=str) + "\n")
    fh.flush()
    try:
        os.fsync(fh.fileno())
    except OSError:
        pass


def _is_oom(e: BaseException) -> bool:
    name = type(e).__name__
    return name in ("OutOfMemoryError",) or "out of memory" in str(e).lower()


class TimingStreamer:
    """A transformers streamer that timestamps every ``put`` (the prompt first,
    then one per generated token) and samples tier usage at each one.

    ``generate()`` hands each new token to ``put`` as a CPU tensor, i.e. after
    the step's GPU work has completed (the ``.cpu()`` copy synchronises), so
    consecutive timestamps bracket one decode step."""

    def __init__(self, sampler=None, on_first=None):
        self.times: List[float] = []
        self.samples: List[Dict[str, Any]] = []
        self.sampler = sampler
        self.on_first = on_first

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == 2 and self.on_first is not None:
            self.on_first()
        if self.sampler is not None:
            try:
                s = self.sampler()
            except Exception as e:  # sampling must never break the run
                s = {"error": str(e)}
            s["put"] = len(self.times) - 1
            self.samples.append(s)

    def end(self) -> None:
        pass


class Worker:
    def __init__(self, spec: Dict[str, Any], out):
        self.spec = spec
        self.out = out
        self.kind = spec.get("kind", "native")
        self.device = int(spec.get("device", 0))
        self.device_type = spec.get("device_type", "cuda")
        self.deadline = float(spec.get("deadline_unix") or 0) or None
        self.enable_mode: Optional[str] = None
        self.enable_error: Optional[str] = None
        self.hf_wrap = None
        self.model = None
        self.model_name: Optional[str] = None
        self.torch = None
        self.total_vram = 0
        self.broken: Optional[str] = None
        self.native_peaks: Dict[str, int] = {}
        self.kv_storage = "transformers DynamicCache (torch's allocator)"

    # ------------------------------------------------------------ set-up
    def setup(self) -> None:
        opts = dict(self.spec.get("cxlalloc_options") or {})
        if self.kind == "cxlalloc" and self.spec.get("global", True):
            enable = getattr(cxlalloc, "enable", None)
            if enable is None:
                self.enable_error = ("cxlalloc.enable() is not in this build (branch 'torch' not merged): global mode "
                                     "unavailable, cells use scoped mode (cxlalloc.hf.wrap with its own Allocator)")
            else:
                try:
                    self.enable_mode = enable(device=self.device, **opts)
                except Exception as e:
                    self.enable_error = f"cxlalloc.enable({opts}) failed: {type(e).__name__}: {e}"
        import torch

        self.torch = torch
        if self.device_type == "cuda":
            torch.cuda.set_device(self.device)
            self.total_vram = int(torch.cuda.get_device_properties(self.device).total_memory)
        else:
            # The CPU toy (simulation, tests) is tiny: one thread avoids oversubscribing shared CPUs, which
            # made it an order of magnitude slower on a 2-core machine.
            torch.set_num_threads(1)
        try:
            import cxlalloc.hf as hf

            self.hf_wrap = hf if hasattr(hf, "wrap") else None
        except Exception:
            self.hf_wrap = None
        _emit(self.out, {"type": "worker", "group": self.spec.get("group"), "kind": self.kind,
                         "enable_mode": self.enable_mode, "enable_error": self.enable_error,
                         "hf_wrap_available": self.hf_wrap is not None, "pid": os.getpid(),
                         "torch": torch.__version__, "time_unix": time.time()})

    def _global(self) -> bool:
        return self.enable_mode in ("global", "global-pluggable")

    def load_model(self, name: str) -> None:
        if self.model_name == name:
            return
        self.model = None
        self.model_name = None  # until the new model is built and warmed up
        gc.collect()
        if self.device_type == "cuda":
            self.torch.cuda.empty_cache()
        torch = self.torch
        dtype = torch.bfloat16 if self.device_type == "cuda" else torch.float32
        scope = None
        if self._global():
            scope = getattr(cxlalloc, "weights", None)
        if scope is not None:
            with scope():
                self.model = build_model(SHAPES[name], device=self.device_type, dtype=dtype)
        else:
            self.model = build_model(SHAPES[name], device=self.device_type, dtype=dtype)
        if self._global() and self.spec.get("wrap", True):
            if self.hf_wrap is not None:
                self.hf_wrap.wrap(self.model)  # global mode: KV cache in cxlalloc extents on the process-wide engine
                self.kv_storage = "cxlalloc.hf CxlCache (KV in cxlalloc extents, class kv)"
            else:
                _tag_dynamic_cache_as_kv()
                self.kv_storage = ("transformers DynamicCache (torch.cat) through cxlalloc's global allocator, its "
                                   "allocations tagged kv with cxlalloc.kv() (cxlalloc.hf.wrap not available)")
        self.model_name = name
        self._warmup()

    def _warmup(self) -> None:
        """One small generate(): CUDA/cuBLAS initialisation and kernel selection stay out of the timings."""
        torch = self.torch
        ids = torch.randint(3, 200, (1, 64), device=self.device_type)
        with torch.no_grad():
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                min_new_tokens=2, do_sample=False, pad_token_id=0)
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    # ------------------------------------------------------------ limits
    def set_limit(self, budget: Optional[int]) -> None:
        if self.device_type != "cuda":
            return
        frac = 1.0 if not budget else min(1.0, max(budget / self.total_vram, 1e-6))
        self.torch.cuda.set_per_process_memory_fraction(frac, self.device)

    # ------------------------------------------------------------ stats
    def _allocator(self, model):
        if self.hf_wrap is not None and getattr(self.hf_wrap, "is_wrapped", lambda m: False)(model):
            return self.hf_wrap.allocator(model)
        return None

    def sampler(self, model):
        torch = self.torch
        alloc = self._allocator(model)
        cxl_stats = None
        if alloc is None and self._global():
            cxl_stats = getattr(cxlalloc, "stats", None)
        t0 = time.perf_counter()

        def sample():
            d: Dict[str, Any] = {"t_s": round(time.perf_counter() - t0, 6)}
            s = alloc.stats() if alloc is not None else (cxl_stats() if cxl_stats is not None else None)
            if s is not None:
                d.update(_tier_bytes(s))
            elif self.device_type == "cuda":
                d["device_bytes"] = int(torch.cuda.memory_allocated(self.device))
                d["host_bytes"] = _pinned_host_bytes(torch)
            return d

        return sample

    # ------------------------------------------------------------ cells
    def run(self) -> None:
        failed_variants = set()
        for cell in self.spec["cells"]:
            row = dict(cell)
            if self.broken:
                row.update(status="not_run", reason=f"worker unusable: {self.broken}")
                _emit(self.out, row)
                continue
            if self.spec.get("stop_after_failure") and cell["variant"] in failed_variants:
                row.update(status="not_run", reason="a smaller batch of this variant already failed")
                _emit(self.out, row)
                continue
            if self.deadline and time.time() > self.deadline:
                row.update(status="not_run", reason="time budget of the decode benchmark used up")
                _emit(self.out, row)
                continue
            refused = self._guard(cell)
            if refused:
                row.update(status="refused", reason=refused)
                _emit(self.out, row)
                continue
            failed = False
            try:
                row.update(self.run_cell(cell))
            except Exception as e:  # noqa: BLE001 - every failure is recorded
                row.update(status="oom" if _is_oom(e) else "error", error=f"{type(e).__name__}: {str(e)[:1500]}")
                if row["status"] == "error":
                    row["traceback"] = traceback.format_exc()[-3000:]
                failed = True
            if failed:
                # Outside the except block: its traceback's frames still hold the failed
                # generate()'s KV and activations, which empty_cache could not release.
                self._after_failure()
            if row.get("status") != "ok":
                failed_variants.add(cell["variant"])
            _emit(self.out, row)

    def _guard(self, cell) -> Optional[str]:
        free = int(self.spec.get("free_bytes_at_start") or 0)
        if int(cell.get("managed_bytes") or 0) == 0:
            return None
        if free <= 0:
            return "managed-memory guard: the card's free memory is unknown, so no managed memory is requested"
        try:
            check_managed(int(cell["managed_bytes"]), free, what=f"cell {cell['id']}")
        except ManagedMemoryGuardError as e:
            return str(e)
        return None

    def _torch_peak(self, fn) -> Optional[int]:
        """torch's peak counter ``fn`` for this device in bytes, or None where the
        installed allocator has none (torch's plain CUDAPluggableAllocator raises
        "does not yet support" for peak stats: cxlalloc's fallback mode)."""
        try:
            return int(fn(self.device))
        except RuntimeError:
            return None

    def _reset_torch_peaks(self) -> None:
        try:
            self.torch.cuda.reset_peak_memory_stats(self.device)
        except RuntimeError:
            pass  # as _torch_peak: no peak counters under this allocator

    def _after_failure(self) -> None:
        gc.collect()
        if self.device_type != "cuda":
            return
        torch = self.torch
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # a sticky CUDA error: nothing more can run in this process
            self.broken = f"CUDA context unusable after an error: {type(e).__name__}: {str(e)[:300]}"

    def run_cell(self, cell) -> Dict[str, Any]:
        torch = self.torch
        self.load_model(cell["model"])
        model = self.model
        budget = cell.get("budget_bytes")
        if cell.get("budget_rule") == "native_peak" and budget is None:
            budget = self._budget_from_native(cell)
        res: Dict[str, Any] = {"budget_bytes": budget}
        if cell.get("cache_implementation") == "offloaded":
            res["kv_storage"] = "transformers DynamicCache(offloading=True): pinned host copies, 2 layers on the GPU"
        elif self.kind == "cxlalloc" and not self._global():
            res["kv_storage"] = "cxlalloc.hf CxlCache in a scoped Allocator (weights + KV; activations in torch's)"
        else:
            res["kv_storage"] = self.kv_storage
        scoped = None
        if self.kind == "cxlalloc" and not self._global():
            if self.hf_wrap is None:
                return {"status": "refused", "reason": "neither global mode nor cxlalloc.hf.wrap is available",
                        "budget_bytes": budget}
            scoped = self._scoped_wrap(model, cell, budget)
            res["mode"] = "scoped"
        else:
            res["mode"] = self.enable_mode or ("native" if self.kind == "native" else None)
            self.set_limit(budget)
        try:
            res.update(self._generate(model, cell))
        finally:
            if scoped is not None:
                try:
                    self.hf_wrap.unwrap(model)
                except Exception as e:
                    self.broken = f"cxlalloc.hf.unwrap failed: {e}"
            gc.collect()
            if self.device_type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        if cell["variant"] == "native" and res.get("status") == "ok":
            self.native_peaks[_point_key(cell)] = int(res.get("peak_reserved_bytes") or 0)
        return res

    def _budget_from_native(self, cell) -> Optional[int]:
        peak = self.native_peaks.get(_point_key(cell))
        if not peak:
            return None
        return budget_from_peak(peak, int(cell["kv_final_bytes"]), float(cell["spill"]))

    def _scoped_wrap(self, model, cell, budget):
        """Scoped fallback: the model's weights + KV in an Allocator of their own,
        device_limit = budget minus the activations measured natively."""
        opts = dict(self.spec.get("cxlalloc_options") or {})
        opts.pop("device_limit", None)
        if budget:
            opts["device_limit"] = max(int(budget) - int(cell.get("activation_bytes") or 0), 2 << 20)
        return self.hf_wrap.wrap(model, **opts)

    def _generate(self, model, cell) -> Dict[str, Any]:
        torch = self.torch
        dev = self.device_type
        batch, ctx, new = int(cell["batch"]), int(cell["context"]), int(cell["new_tokens"])
        vocab = model.config.vocab_size
        g = torch.Generator(device="cpu").manual_seed(1234 + batch * 7 + ctx)
        ids = torch.randint(3, vocab - 1, (batch, ctx), generator=g).to(dev)
        mask = torch.ones_like(ids)
        prefill_peak: Dict[str, int] = {}

        def at_first_token():
            # Prefill peaks (allocated/reserved), then restart the peak counters for the decode phase.
            prefill_peak["allocated"] = self._torch_peak(torch.cuda.max_memory_allocated)
            prefill_peak["reserved"] = self._torch_peak(torch.cuda.max_memory_reserved)
            self._reset_torch_peaks()

        streamer = TimingStreamer(self.sampler(model) if cell.get("timeline", True) else None,
                                  on_first=at_first_token if dev == "cuda" else None)
        gen: Dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                   streamer=streamer)
        if cell.get("prefill_chunk"):
            gen["prefill_chunk_size"] = int(cell["prefill_chunk"])
        if cell.get("cache_implementation"):
            gen["cache_implementation"] = cell["cache_implementation"]
        if dev == "cuda":
            torch.cuda.synchronize()
            self._reset_torch_peaks()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **gen)
        if dev == "cuda":
            torch.cuda.synchronize()
        t_end = time.perf_counter()
        times = streamer.times
        res: Dict[str, Any] = {"status": "ok", "total_s": t_end - t0}
        if len(times) >= 2:
            res["ttft_s"] = times[1] - t0
        steps = [b - a for a, b in zip(times[1:], times[2:])]
        if steps:
            res["decode_s"] = times[-1] - times[1]
            res["decode_steps"] = len(steps)
            res["decode_tokens_per_s"] = batch * len(steps) / res["decode_s"] if res["decode_s"] > 0 else None
            res["step_ms"] = sorted(steps)[len(steps) // 2] * 1e3
            res["step_ms_all"] = [round(s * 1e3, 3) for s in steps]
        seq = out if isinstance(out, torch.Tensor) else out.sequences
        new_ids = seq[:, ctx:].to("cpu")
        res["generated_tokens"] = int(new_ids.numel())
        res["tokens_digest"] = hashlib.sha256(new_ids.numpy().tobytes()).hexdigest()[:16]
        if dev == "cuda":
            dec_alloc = self._torch_peak(torch.cuda.max_memory_allocated)  # since the first token
            dec_res = self._torch_peak(torch.cuda.max_memory_reserved)
            res["decode_peak_allocated_bytes"] = dec_alloc
            res["prefill_peak_allocated_bytes"] = prefill_peak.get("allocated")
            if dec_alloc is not None:
                res["peak_allocated_bytes"] = max(dec_alloc, prefill_peak.get("allocated") or 0)
                res["peak_reserved_bytes"] = max(dec_res or 0, prefill_peak.get("reserved") or 0)
            else:
                res["torch_peaks"] = "unavailable under this allocator (see cxlalloc stats)"
            res["pinned_host_bytes"] = _pinned_host_bytes(torch)
        alloc = self._allocator(model)
        if alloc is not None:
            st = alloc.stats()
            res["cxlalloc"] = _summary_stats(st)
            try:
                hf_stats = self.hf_wrap.stats(model).get("hf", {})
                res["hf"] = {k: hf_stats.get(k) for k in ("mode", "hook", "weights_placed", "weight_bytes")}
                cache = hf_stats.get("cache") or {}
                res["hf"]["cache"] = {k: v for k, v in cache.items() if not isinstance(v, list)}
            except Exception as e:
                res["hf"] = {"error": str(e)}
        elif self._global():
            if hasattr(cxlalloc, "stats"):
                try:
                    res["cxlalloc"] = _summary_stats(cxlalloc.stats())
                except Exception as e:
                    res["cxlalloc"] = {"error": str(e)}
        samples = streamer.samples
        res["measured_host_fraction"] = _host_fraction(samples)
        if cell.get("timeline", True):
            res["timeline"] = samples
        del out, seq, ids, mask
        return res


def _tag_dynamic_cache_as_kv() -> None:
    """Make transformers' DynamicLayer.update allocate under ``cxlalloc.kv()``,
    so the KV cache's torch.cat allocations are class kv for cxlalloc's policy
    and statistics (the fallback when cxlalloc.hf is not available)."""
    from transformers.cache_utils import DynamicLayer

    if getattr(DynamicLayer.update, "_cxlalloc_kv", False):
        return
    orig = DynamicLayer.update

    def update(self, *args, **kwargs):
        with cxlalloc.kv():
            return orig(self, *args, **kwargs)

    update._cxlalloc_kv = True
    DynamicLayer.update = update


def _point_key(cell) -> str:
    return f"{cell['model']}|{cell['context']}|{cell['batch']}"


def _pinned_host_bytes(torch) -> Optional[int]:
    fn = getattr(getattr(torch.cuda, "memory", None), "host_memory_stats", None)
    if fn is None:
        return None
    try:
        s = fn()
        v = s.get("allocated_bytes.current", s.get("allocated_bytes", {}))
        return int(v["current"]) if isinstance(v, dict) else int(v)
    except Exception:
        return None


def _tier_bytes(s: Dict[str, Any]) -> Dict[str, Any]:
    d = {"device_bytes": int(s.get("device", {}).get("allocated_bytes", 0)),
         "host_bytes": int(s.get("host", {}).get("allocated_bytes", 0))}
    kv = s.get("kv")
    if isinstance(kv, dict):
        d["kv_device_bytes"] = int(kv.get("device_bytes", 0))
        d["kv_host_bytes"] = int(kv.get("host_bytes", 0))
    return d


def _summary_stats(s: Dict[str, Any]) -> Dict[str, Any]:
    out = _tier_bytes(s)
    for k in ("spilled_bytes", "demoted_bytes", "promoted_bytes", "ooms", "migration_budget_denials",
              "new_device_segments", "new_host_segments"):
        if k in s:
            out[k] = s[k]
    host = s.get("host", {})
    out["backend"] = host.get("backend")
    out["numa_node"] = host.get("numa_node")
    out["placement"] = host.get("placement")
    out["device_limit_bytes"] = s.get("device", {}).get("limit_bytes")
    out["peak_device_bytes"] = s.get("device", {}).get("peak_allocated_bytes")
    out["peak_host_bytes"] = host.get("peak_allocated_bytes")
    return out


def _host_fraction(samples: List[Dict[str, Any]]) -> Optional[float]:
    """Host share of the KV cache over the decode steps (mean of the samples
    after the first token); falls back to the host share of all memory."""
    vals = []
    for s in samples[2:] or samples[1:]:
        kd, kh = s.get("kv_device_bytes"), s.get("kv_host_bytes")
        if kd is not None and kh is not None and kd + kh > 0:
            vals.append(kh / (kd + kh))
    if vals:
        return sum(vals) / len(vals)
    return None


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (the bench process) dies, so a time
    box that kills the parent never leaves a worker holding the GPU."""
    try:
        import ctypes
        import signal as _signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(_signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent is already gone
            os._exit(1)
    except Exception:
        pass


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _die_with_parent()
    if len(argv) != 2:
        print("usage: python -m cxlalloc_apps.bench.worker SPEC.json OUT.jsonl", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    with open(argv[1], "a") as out:
        w = Worker(spec, out)
        try:
            w.setup()
        except Exception as e:
            _emit(out, {"type": "worker", "group": spec.get("group"), "setup_error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-3000:]})
            for cell in spec["cells"]:
                row = dict(cell)
                row.update(status="not_run", reason=f"worker set-up failed: {type(e).__name__}: {e}")
                _emit(out, row)
            return 1
        w.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
