"""Benchmark records: the JSON every benchmark writes, and its metadata.

One record per benchmark and run, written to ``<out>/<benchmark>.json``::

    {"schema": "cxlalloc-bench/1",
     "benchmark": "ceilings" | "allocation" | "decode" | "rightsizing",
     "status": "ok" | "partial" | "skipped" | "error",
     "simulated": bool,          # True: numbers from cxlalloc's simulated driver
     "date_utc": "2026-11-30T14:03:00Z",   # when the run started
     "duration_s": float,
     "command": "python -m cxlalloc bench --quick --out DIR",  # exact command
     "argv": [...], "cwd": str,
     "parameters": {...},        # every knob of this benchmark
     "hardware": {"gpu": {...}, "cpu": {...}, "numa_nodes": [...], "memory_bytes": int, "kernel": str},
     "software": {"python", "torch", "torch_cuda", "torch_git", "transformers", "cxlalloc",
                  "git_commit", "git_dirty", "source_digest"},
     "results": [{..., "method": "how it was measured"}, ...],
     "skipped": [{"part": str, "reason": str}, ...],
     "errors": [{"part": str, "error": str}, ...],
     "notes": [str, ...]}

``source_digest`` is a SHA-256 over the package and C++ sources, so a record
made where ``git`` is unavailable (the device machine gets a copy of the tree
without ``.git``) still identifies the code: compare it with
:func:`source_digest` of a checkout.  ``CXLALLOC_GIT_COMMIT`` overrides the
commit when git cannot be asked.

Records are rewritten after every result (:class:`RecordWriter`), so a run
killed by a time box leaves a ``"partial"`` record with what it had.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any, Dict, Iterable, List, Optional

import cxlalloc
from cxlalloc import _C, topology

SCHEMA = "cxlalloc-bench/1"
BENCHMARKS = ("ceilings", "allocation", "decode", "rightsizing")
OPT_IN = ("reuse", "kvserver", "lmcache", "lmcache_get", "kvscale", "kvfair", "cb", "kvspeed", "cluster", "engines", "serve")  # run only when named (--only reuse,kvserver,...): minutes of CPU each
STATUSES = ("ok", "partial", "skipped", "error")
REQUIRED_FIELDS = ("schema", "benchmark", "status", "simulated", "date_utc", "duration_s", "command", "argv",
                   "parameters", "hardware", "software", "results", "skipped", "errors", "notes")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def utc_now() -> str:
    """The current UTC time as ISO 8601 with a ``Z`` suffix, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _run(cmd: List[str], timeout: float = 10.0, cwd: Optional[str] = None) -> Optional[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def source_digest(root: str = REPO_ROOT) -> str:
    """SHA-256 (hex, first 16 digits) over ``cxlalloc/**/*.py``, ``csrc/**`` and
    ``setup.py`` under ``root``: identifies the code without git."""
    h = hashlib.sha256()
    files = []
    for sub, exts in (("cxlalloc", (".py",)), ("csrc", (".cpp", ".h", ".map", ".c"))):
        for d, _dirs, names in os.walk(os.path.join(root, sub)):
            _dirs[:] = sorted(x for x in _dirs if x != "__pycache__")
            files += [os.path.join(d, n) for n in names if n.endswith(exts)]
    if os.path.isfile(os.path.join(root, "setup.py")):
        files.append(os.path.join(root, "setup.py"))
    for f in sorted(files):
        h.update(os.path.relpath(f, root).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def git_info(root: str = REPO_ROOT) -> Dict[str, Any]:
    """``{"git_commit": str|None, "git_dirty": bool|None, "source_digest": str}``."""
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    dirty = None
    if commit:
        st = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
        dirty = bool(st) if st is not None else None
    else:
        commit = os.environ.get("CXLALLOC_GIT_COMMIT") or None
    try:
        digest = source_digest(root)
    except OSError:
        digest = None
    return {"git_commit": commit, "git_dirty": dirty, "source_digest": digest}


def cpu_info() -> Dict[str, Any]:
    """CPU model (``/proc/cpuinfo``), logical CPUs, CPUs this process may use."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"model": model or platform.processor() or None, "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "machine": platform.machine()}


def memory_bytes() -> Optional[int]:
    """MemTotal of ``/proc/meminfo`` in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def numa_nodes() -> List[Dict[str, Any]]:
    """NUMA nodes (id, total/free bytes, CPUs, CPU-less, CXL, memory tier) from
    :func:`cxlalloc.topology.read_topology`; [] when it cannot be read."""
    try:
        topo = topology.read_topology()
    except Exception:
        return []
    out = []
    for n in topo.get("nodes", []):
        out.append({"id": n.get("id"), "total_bytes": n.get("total_bytes"), "free_bytes": n.get("free_bytes"),
                    "cpus": len(n.get("cpus") or []), "has_cpu": n.get("has_cpu"), "cxl": n.get("cxl"),
                    "movable_only": n.get("movable_only"), "memory_tier": n.get("memory_tier")})
    return out


def _nvidia_smi() -> Dict[str, Any]:
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pci.bus_id",
                "--format=csv,noheader,nounits"], timeout=15)
    if not out:
        return {}
    first = [x.strip() for x in out.splitlines()[0].split(",")]
    d: Dict[str, Any] = {"nvidia_smi_gpus": len(out.splitlines())}
    if len(first) >= 4:
        d.update({"name": first[0], "driver_version": first[1], "pci_bus_id": first[3]})
        try:
            d["total_bytes_nvidia_smi"] = int(float(first[2])) << 20  # MiB
        except ValueError:
            pass
    return d


def gpu_info(simulated: bool, device: int = 0) -> Dict[str, Any]:
    """The GPU (name, driver version, VRAM bytes, compute capability, count).

    From ``nvidia-smi`` (driver version) and torch (name, memory); in
    simulation ``{"available": False, "simulated": True, ...}``.
    """
    if simulated:
        return {"available": False, "simulated": True, "name": "cxlalloc simulated CUDA driver (no GPU)"}
    d: Dict[str, Any] = {"available": False, "simulated": False}
    d.update(_nvidia_smi())
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(device)
            d.update({"available": True, "name": p.name, "total_bytes": int(p.total_memory),
                      "compute_capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                      "count": torch.cuda.device_count(), "device": device})
        else:
            d["reason"] = "torch.cuda.is_available() is False"
    except Exception as e:  # CPU torch, broken driver
        d["reason"] = f"{type(e).__name__}: {e}"
    try:
        d["cuda_driver_api"] = _C.probe_driver("libcuda.so.1", False).get("version")
    except Exception:
        pass
    return d


def hardware_info(simulated: bool, device: int = 0) -> Dict[str, Any]:
    return {"gpu": gpu_info(simulated, device), "cpu": cpu_info(), "numa_nodes": numa_nodes(),
            "memory_bytes": memory_bytes(), "kernel": platform.release(), "hostname_hash": _host_hash()}


def _host_hash() -> str:
    # Which runs came from the same machine, without publishing its name.
    return hashlib.sha256(platform.node().encode()).hexdigest()[:8]


def _version(mod: str) -> Optional[str]:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", None)
    except Exception:
        return None


def software_info() -> Dict[str, Any]:
    d: Dict[str, Any] = {"python": platform.python_version(), "cxlalloc": getattr(cxlalloc, "__version__", None),
                         "transformers": _version("transformers"), "numpy": _version("numpy")}
    try:
        import torch

        d.update({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "torch_git": getattr(torch.version, "git_version", None)})
    except Exception:
        d.update({"torch": None, "torch_cuda": None, "torch_git": None})
    d.update(git_info())
    return d


def command_line(argv: Optional[Iterable[str]]) -> str:
    """The exact bench command as a shell line (``python -m cxlalloc bench ...``)."""
    if argv is None:
        return shlex.join([os.path.basename(sys.executable)] + sys.argv)
    return shlex.join(["python", "-m", "cxlalloc", "bench"] + list(argv))


_ENV_CACHE: Dict[str, Any] = {}


def environment(simulated: bool, device: int = 0) -> Dict[str, Any]:
    """hardware + software, computed once per process and mode."""
    key = f"{simulated}:{device}"
    if key not in _ENV_CACHE:
        _ENV_CACHE[key] = {"hardware": hardware_info(simulated, device), "software": software_info()}
    return _ENV_CACHE[key]


def new_record(benchmark: str, parameters: Dict[str, Any], simulated: bool, argv: Optional[List[str]] = None,
               device: int = 0) -> Dict[str, Any]:
    """A fresh record (status "partial" until :meth:`RecordWriter.finish`)."""
    env = environment(simulated, device)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "status": "partial",
        "simulated": bool(simulated),
        "date_utc": utc_now(),
        "duration_s": 0.0,
        "command": command_line(argv),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "parameters": parameters,
        "hardware": env["hardware"],
        "software": env["software"],
        "results": [],
        "skipped": [],
        "errors": [],
        "notes": [],
    }


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (temporary file + rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


class RecordWriter:
    """A record on disk, rewritten after every change.

    Usage::

        w = RecordWriter(out_dir, new_record("ceilings", params, simulated=False))
        w.add(result_dict)            # a measurement (must carry "method")
        w.skip("managed", "why")      # a part not run
        w.error("pinned", exc)        # a part that failed
        w.finish()                    # status: ok / partial / skipped / error
    """

    def __init__(self, out_dir: str, record: Dict[str, Any]):
        self.record = record
        self.path = os.path.join(out_dir, f"{record['benchmark']}.json")
        self._t0 = time.monotonic()
        self.flush()

    def flush(self) -> None:
        self.record["duration_s"] = round(time.monotonic() - self._t0, 3)
        write_json(self.path, self.record)

    def add(self, result: Dict[str, Any]) -> None:
        if "method" not in result:
            raise ValueError("every benchmark result must say how it was measured ('method')")
        self.record["results"].append(result)
        self.flush()

    def skip(self, part: str, reason: str) -> None:
        self.record["skipped"].append({"part": part, "reason": reason})
        self.flush()

    def finish_skipped(self, part: str, reason: str) -> Dict[str, Any]:
        """Record that ``part`` was skipped for ``reason`` and finish the
        record as "skipped" (a benchmark that cannot run here at all)."""
        self.skip(part, reason)
        return self.finish("skipped")

    def error(self, part: str, err: Any) -> None:
        text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        self.record["errors"].append({"part": part, "error": text[:2000]})
        self.flush()

    def note(self, text: str) -> None:
        self.record["notes"].append(text)
        self.flush()

    def status_from_rows(self) -> str:
        """The record's status judged by its result rows, for benchmarks whose
        cells run in worker processes (decode, right-sizing): "error" when no
        row is "ok", "partial" when any row errored or did not run (killed,
        time budget), else "ok".  An "oom" row is a measured outcome (plain
        transformers under a budget), and a "refused" row the managed-memory
        guard doing its job: neither makes a run partial.  Also stores the
        per-status row counts in ``summary["row_status_counts"]``."""
        counts: Dict[str, int] = {}
        for r in self.record["results"]:
            counts[str(r.get("status"))] = counts.get(str(r.get("status")), 0) + 1
        summary = self.record.get("summary")
        if isinstance(summary, dict):
            summary["row_status_counts"] = counts
        else:
            self.record["row_status_counts"] = counts
        if not counts.get("ok"):
            return "error"
        if counts.get("error") or counts.get("not_run") or self.record["errors"]:
            return "partial"
        return "ok"

    def finish_and_plot(self, plot, log) -> Dict[str, Any]:
        """:meth:`finish`, then ``plot(record, <out>/<benchmark>.png)``; a plot
        that fails (no matplotlib, say) is logged with ``log`` and never loses
        the record.  Returns the record."""
        rec = self.finish()
        try:
            plot(rec, os.path.join(os.path.dirname(self.path), f"{rec['benchmark']}.png"))
        except Exception as e:
            log(f"bench {rec['benchmark']}: no plot ({type(e).__name__}: {e})")
        return rec

    def finish(self, status: Optional[str] = None) -> Dict[str, Any]:
        r = self.record
        if status is None:
            if r["results"]:
                status = "partial" if r["errors"] else "ok"
            elif r["errors"]:
                status = "error"
            else:
                status = "skipped"
        r["status"] = status
        self.flush()
        return r


def validate_record(rec: Any) -> List[str]:
    """Problems with a record (empty list: valid).  Used by tests and the report."""
    if not isinstance(rec, dict):
        return ["not a JSON object"]
    probs = [f"missing field {k!r}" for k in REQUIRED_FIELDS if k not in rec]
    if probs:
        return probs
    if rec["schema"] != SCHEMA:
        probs.append(f"schema {rec['schema']!r} is not {SCHEMA!r}")
    if rec["benchmark"] not in BENCHMARKS + OPT_IN:
        probs.append(f"unknown benchmark {rec['benchmark']!r}")
    if rec["status"] not in STATUSES:
        probs.append(f"unknown status {rec['status']!r}")
    try:
        _dt.datetime.strptime(rec["date_utc"], "%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError):
        probs.append(f"date_utc {rec['date_utc']!r} is not UTC ISO 8601 (YYYY-MM-DDTHH:MM:SSZ)")
    hw = rec["hardware"]
    for k in ("gpu", "cpu", "numa_nodes"):
        if k not in hw:
            probs.append(f"hardware.{k} missing")
    sw = rec["software"]
    for k in ("torch", "transformers", "cxlalloc", "git_commit", "source_digest"):
        if k not in sw:
            probs.append(f"software.{k} missing")
    for i, r in enumerate(rec["results"]):
        if not isinstance(r, dict) or "method" not in r:
            probs.append(f"results[{i}] has no 'method'")
    if rec["status"] == "skipped" and not rec["skipped"]:
        probs.append("status skipped without a reason in 'skipped'")
    return probs


def load_records(paths: Iterable[str]) -> List[Dict[str, Any]]:
    """Load and validate records; invalid files are skipped (a warning is
    printed to stderr naming the file and its problems)."""
    out = []
    for p in paths:
        try:
            with open(p) as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            print(f"cxlalloc bench: skipping {p}: {e}", file=sys.stderr)
            continue
        probs = validate_record(rec)
        if probs:
            print(f"cxlalloc bench: skipping {p}: {'; '.join(probs)}", file=sys.stderr)
            continue
        rec["_path"] = p
        out.append(rec)
    return out
