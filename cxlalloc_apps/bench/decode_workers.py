"""Running the decode benchmark's workers: one process per group of cells, killed with its process group after
its time box (and on SIGTERM), or in this process for a simulation run.  Moved out of ``decode.py`` (moves
only) so that no module of the apps is over 600 lines; ``decode`` re-exports these names."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from typing import Any, Dict, List, Optional

from cxlalloc_apps.bench.worker import Worker


# ----------------------------------------------------------------- running workers
def gpu_free_bytes(device: int = 0) -> Optional[int]:
    """Free VRAM (bytes) from nvidia-smi (creates no CUDA context), else torch."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i",
                            str(device)], capture_output=True, text=True, timeout=15)
        if p.returncode == 0 and p.stdout.strip():
            return int(float(p.stdout.strip().splitlines()[0])) << 20
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    try:
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    except Exception:
        return None


_LIVE_WORKERS: Dict[int, Any] = {}


def _kill_workers(signum=None, frame=None) -> None:
    """Kill every live worker's process group (on SIGTERM from a time box, and at exit)."""
    for pid in list(_LIVE_WORKERS):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        _LIVE_WORKERS.pop(pid, None)
    if signum is not None:
        raise SystemExit(128 + signum)


def _install_sigterm() -> None:
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _kill_workers)
    except ValueError:  # not the main thread
        pass


def run_worker(spec: Dict[str, Any], work_dir: str, timeout_s: float, log=print) -> List[Dict[str, Any]]:
    """Run one worker process; return its cell rows (cells it never reached are
    returned as ``not_run``).  The process is killed (its whole process group)
    after ``timeout_s``."""
    name = spec["group"].replace(":", "_")
    spec_path = os.path.join(work_dir, f"worker_{name}.spec.json")
    out_path = os.path.join(work_dir, f"worker_{name}.jsonl")
    log_path = os.path.join(work_dir, f"worker_{name}.log")
    for p in (out_path,):
        if os.path.exists(p):
            os.remove(p)
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    env.pop("CXLALLOC", None)  # the worker enables cxlalloc itself, with the spec's options
    killed = None
    with open(log_path, "w") as logf:
        _install_sigterm()
        proc = subprocess.Popen([sys.executable, "-m", "cxlalloc_apps.bench.worker", spec_path, out_path], stdout=logf,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _LIVE_WORKERS[proc.pid] = proc
        try:
            rc = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            killed = f"killed after its time box of {timeout_s:.0f} s"
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            rc = proc.wait()
        finally:
            _LIVE_WORKERS.pop(proc.pid, None)
    rows, worker_info = [], {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            for line in f:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if obj.get("type") == "worker":
                    worker_info = obj
                else:
                    rows.append(obj)
    done = {r["id"] for r in rows}
    tail = ""
    try:
        with open(log_path) as f:
            tail = f.read()[-1500:]
    except OSError:
        pass
    for c in spec["cells"]:
        if c["id"] not in done:
            r = dict(c)
            r.update(status="not_run", reason=killed or f"worker exited (code {rc}) before this cell; log tail: {tail}")
            rows.append(r)
    for r in rows:
        r["group"] = spec["group"]
        r["worker"] = {k: worker_info.get(k) for k in ("enable_mode", "enable_error", "hf_wrap_available", "torch",
                                                       "setup_error")}
    log(f"decode: worker {spec['group']}: {sum(r.get('status') == 'ok' for r in rows)}/{len(rows)} cells ok"
        + (f" ({killed})" if killed else ""))
    return rows


def run_inprocess(spec: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Run a (simulation) worker spec in this process; returns its rows."""
    buf = io.StringIO()
    w = Worker(spec, buf)
    w.setup()
    w.run()
    rows, info = [], {}
    for line in buf.getvalue().splitlines():
        obj = json.loads(line)
        if obj.get("type") == "worker":
            info = obj
        else:
            rows.append(obj)
    for r in rows:
        r["group"] = spec["group"]
        r["worker"] = {k: info.get(k) for k in ("enable_mode", "enable_error", "hf_wrap_available", "torch")}
    return rows
