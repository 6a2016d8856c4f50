"""``python -m cxlalloc bench``: run the benchmarks, one JSON record each.

    python -m cxlalloc bench [--simulate] [--out DIR] [--only NAMES] [--quick] ...

Benchmarks (``--only ceilings,allocation,decode,rightsizing``; default all):

  ceilings     GPU: device copy/read GB/s, H2D/D2H and zero-copy read GB/s of
               each host-tier backend and NUMA node (:mod:`.ceilings`)
  allocation   GPU: malloc/free latency per tier/backend, cold and cached, vs
               raw driver calls; CPU: the same on the simulated driver and an
               allocation throughput (:mod:`.allocation`)
  decode       GPU: generate() under 0/25/50/75 % KV spill, native vs
               transformers offloading vs policy-free vs cxlalloc per backend
               (:mod:`.decode`); --simulate: a tiny model on the simulator,
               on the --contexts x --batches given (--models: only tiny; a
               grid a CPU cannot run is refused, exit status 2)
  rightsizing  GPU: largest batch and tokens/s at a fixed budget (:mod:`.rightsizing`)

Run only when named (``--only reuse``, ``--only kvserver``, ``--only lmcache``, ``--only lmcache_get``, ``--only kvscale``, ``--only kvfair``, ``--only cb``, ``--only kvspeed``,
``--only cluster``, ``--only engines``, ``--only serve``):

  reuse        TTFT of a KV prefix hit vs a full prefill as the prefix grows, load
               GB/s vs the measured link rate, a block-size sweep (:mod:`.reuse`;
               CPU: SmolLM2-135M up to 2,048 tokens; GPU: an 8B shape up to 32K)
  kvserver     the kv-server across processes, N clients, the Redis tier, kill -9
               (:mod:`.kvserver`; CPU)
  kvscale      the kv-server at 10^4/10^5/10^6 blocks: lookup latency, the stall
               a disconnect causes to other clients, index bytes per block
               (:mod:`.kvscale`; CPU)
  kvfair       fair service: another client's lookup p50/p99 quiet, beside a CPU-only
               control and beside a client looping 65,536-key requests (arms
               interleaved, ratios per round), and the lock held by a 65,536-pin
               client's disconnect (:mod:`.kvfair`; CPU)
  lmcache      LMCache with cxlalloc:// vs its local CPU backend and its redis://
               connector: store/get GB/s and lookups/s, 256 KiB-16 MiB chunks
               (:mod:`.lmcache`; CPU; needs scripts/install_lmcache.sh)
  lmcache_get  cxlalloc:// get and retrieve vs LMCache's local CPU backend on the
               benchmark method (1/4/16 MiB chunks, arms rotated, ratios per round,
               the goal's verdict) and where a retrieve's time goes (:mod:`.lmcache_get`; CPU)
  cb           continuous batching: a Zipf stream of RAG questions and chats over
               long documents under a device budget below the batch's KV, plain
               vs wrapped vs wrapped + KV store, and the no-spill overhead
               (:mod:`.cb`; CPU)
  kvspeed      KV reuse side by side with what users pick instead: kv-server
               lookups vs redis-py MGET, insert vs memcpy, chat turns vs a
               by-hand DynamicCache, hits vs the deepcopy recipe (:mod:`.kvspeed`; CPU)
  cluster      the Redis tier on a local 3+3 Redis/Valkey Cluster vs one server vs
               redis-py's mget_nonatomic, 1-512 keys, 1-16 clients, and reads
               during a primary's failover (:mod:`.cluster`; CPU)
  engines      vLLM's time to first token and prefill tokens/s with a 1-8K-token shared
               prefix: no cache, vLLM's prefix cache, LMCache's local CPU tier, and the
               pool from another process three ways (cxlalloc:// via LMCache, LMCache MP's
               L2 adapter, vLLM's offloading tier); method.py rounds, ratios per round, a
               verdict for 1.3x LMCache's CPU tier (:mod:`.engines`; CPU, vLLM's CPU build
               from scripts/install_engines.sh, a clone's tests/engines stand-ins)
  serve        cxlalloc serve vs plain transformers serve at one device KV budget:
               issue 28's closed-loop trace (shared system prompts and 1-8K-token
               documents, Zipf reuse, RAG and multi-turn chat; --serve-trace
               KEY=VALUE,... changes it) streamed by the openai client; sessions
               completed, TTFT p50/p99, TPOT, tokens/s; arms interleaved
               (:mod:`.serve`; CPU)

Each writes ``DIR/<name>.json`` (:mod:`.meta` describes the record; decode's
``parameters`` hold the grid that ran: ``points``, ``models``, ``contexts``,
``batches``, and what was asked under ``requested``).  Parts
that need a GPU are recorded as skipped, with the reason, when there is none
or with ``--simulate``.  Run ``ceilings`` before ``decode`` in the same
``--out`` folder: decode's ratios to the link-bound ceiling use its numbers.

Exit status: 0 when every benchmark wrote its record (whatever its status),
1 when one raised unexpectedly (its record says ``error``), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import os
import math
import sys
import traceback
from typing import Callable, Dict, List, Optional, Tuple

from cxlalloc import _C
from cxlalloc_apps.bench.meta import BENCHMARKS, OPT_IN, RecordWriter, new_record
from cxlalloc_apps.bench.model import SHAPES
from cxlalloc_apps.bench.timing import Deadline
from cxlalloc_apps.third_party import quiet_third_party
from cxlalloc_apps.usage import OneLineParser, program_name


def _runner(name: str) -> Callable:
    import importlib

    return importlib.import_module(f"cxlalloc_apps.bench.{name}").run


def _csv(kind, choices=None, lo=None, hi=None):
    """A comma-separated list of `kind`, each in `choices` / [lo, hi] when given."""
    def parse(text: str):
        try:
            out = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}")
        for x in out:
            if isinstance(x, float) and not math.isfinite(x):
                raise argparse.ArgumentTypeError(f"{x!r} is not a finite number")
            if choices is not None and x not in choices:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(map(str, choices))}")
            if (lo is not None and x < lo) or (hi is not None and x > hi):
                raise argparse.ArgumentTypeError(f"{x!r} is outside [{lo}, {hi}]")
        return out
    return parse


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 2:
        raise argparse.ArgumentTypeError(f"{v} is below 2")
    return v


# The parts of the kvserver and kvspeed benchmarks (their PARTS mappings; a test keeps the two in step: importing
# them here would be an import circle, as each runs this CLI as its __main__).
PART_NAMES = ("ttft", "concurrency", "redis", "crash", "lookup", "insert", "chat", "prefix")
# The groups of arms of the engines benchmark (engines.GROUPS; a test keeps the two in step: importing engines here
# would load its module for every bench run)
ENGINE_GROUPS = ("lmcache", "lmcache_mp", "vllm_tier")


def make_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog or f"{program_name()} bench",
                                description="Run cxlalloc's benchmarks; each writes one JSON record into --out.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See benchmarks/README.md for what each benchmark measures and the ceiling "
                                       "model.")
    p.add_argument("--simulate", action="store_true",
                   help="CPU only: run the CPU-able parts on cxlalloc's simulated driver (labelled as simulation)")
    p.add_argument("--out", default=os.path.join("benchmarks", "out"), help="output folder for the JSON records "
                   "(default benchmarks/out)")
    p.add_argument("--only", type=_csv(str), default=None, metavar="NAMES",
                   help=f"comma-separated subset of: {', '.join(BENCHMARKS)} (default: all of them); also "
                        f"{', '.join(OPT_IN)} (only when named)")
    p.add_argument("--parts", type=_csv(str, choices=PART_NAMES), default=None, metavar="NAMES",
                   help="kvserver/kvspeed: run only these parts (comma-separated: "
                        f"{', '.join(PART_NAMES)}; default all)")
    p.add_argument("--engine-groups", type=_csv(str, choices=ENGINE_GROUPS), default=None, metavar="NAMES",
                   help=f"engines: run only these groups of arms (comma-separated: {', '.join(ENGINE_GROUPS)}; "
                        "default all)")
    p.add_argument("--prefixes", type=_csv(int, lo=256, hi=7936), default=None, metavar="TOKENS",
                   help="engines: shared prefix sizes (tokens, multiples of 256, at most 7,936; default "
                        "1024,2048,4096,7936)")
    p.add_argument("--quick", action="store_true", help="the small grid of scripts/gpu_check.sh")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="seconds for the whole run; parts not started in time are recorded as skipped")
    p.add_argument("--models", type=_csv(str, choices=tuple(SHAPES)), default=None,
                   help="decode/right-sizing models (llama-1b, llama-3b, llama-8b; with --simulate only tiny)")
    p.add_argument("--contexts", type=_csv(int, lo=1), default=None,
                   help="decode contexts (tokens; --simulate runs them on the tiny model, at most "
                        "16,384 tokens of batch x context per point)")
    p.add_argument("--batches", type=_csv(int, lo=1), default=None, help="decode batch sizes (also with --simulate)")
    p.add_argument("--fractions", type=_csv(float, lo=0.0, hi=0.95), default=None,
                   help="KV spill fractions in [0, 0.95] (default 0,0.25,0.5,0.75)")
    p.add_argument("--backends", type=_csv(str, choices=("host-vmm", "managed", "pinned")), default=None,
                   help="host backends (host-vmm,managed,pinned)")
    p.add_argument("--new-tokens", type=_positive_int, default=None, help="tokens generated per decode run (>= 2: "
                   "decode speed needs a step after the first token)")
    p.add_argument("--policy-free-backend", default="host-vmm", choices=("host-vmm", "managed", "pinned"),
                   help="backend of the policy-free spill baseline")
    p.add_argument("--ceiling-bytes", type=int, default=None, help="buffer size of the bandwidth probes (bytes)")
    p.add_argument("--serve-trace", default=None, metavar="KEY=VALUE,...",
                   help="serve: trace fields to change, e.g. concurrency=64,doc_tokens=1024-8192,zipf_s=1.1,"
                        "window_s=60 (cxlalloc_apps/bench/serve_trace.py: Trace)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress display")
    return p


class BenchContext:
    """What every benchmark's ``run(ctx)`` gets."""

    def __init__(self, args, argv: List[str], console=None):
        self.args = args
        self.argv = list(argv)
        self.simulate = bool(args.simulate)
        self.quick = bool(args.quick)
        self.device = int(args.device)
        self.out_dir = os.path.abspath(args.out)
        self.deadline = Deadline(args.time_budget)
        self.console = console
        self._gpu: Optional[Tuple[bool, str]] = None

    def log(self, text: str) -> None:
        if self.console is not None:
            self.console.log(text)
        else:
            print(text, flush=True)

    def gpu_ready(self) -> Tuple[bool, str]:
        """(True, "") when a CUDA GPU is usable by torch and cxlalloc, else (False, why)."""
        if self._gpu is None:
            self._gpu = _probe_gpu(self.simulate, self.device)
        return self._gpu


def _probe_gpu(simulate: bool, device: int) -> Tuple[bool, str]:
    if simulate:
        return False, "--simulate: GPU parts are not run (numbers from the simulated driver are not GPU numbers)"
    try:
        import torch
    except Exception as e:
        return False, f"no GPU run: torch is not importable ({e})"
    if getattr(torch.version, "cuda", None) is None:
        return False, f"no GPU run: torch {torch.__version__} is a CPU-only build"
    try:
        info = _C.probe_driver("libcuda.so.1", False)
        if int(info.get("device_count", 0)) <= device:
            return False, f"no GPU run: the CUDA driver reports {info.get('device_count')} device(s)"
    except Exception as e:
        return False, f"no GPU run: {e}"
    if not torch.cuda.is_available():
        return False, "no GPU run: torch.cuda.is_available() is False"
    return True, ""


def _console(no_progress: bool):
    if no_progress or not sys.stdout.isatty():
        return None
    try:
        from rich.console import Console

        return Console()
    except Exception:
        return None


def _print_table(console, records: Dict[str, dict]) -> None:
    rows = []
    for name, rec in records.items():
        why = "; ".join(s["reason"] for s in rec.get("skipped", [])[:1])
        err = "; ".join(e["error"] for e in rec.get("errors", [])[:1])
        rows.append((name, rec.get("status", "?"), str(len(rec.get("results", []))),
                     f"{rec.get('duration_s', 0):.1f}", (err or why)[:90]))
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="cxlalloc bench")
        for col in ("benchmark", "status", "results", "seconds", "first error / skip reason"):
            t.add_column(col)
        for r in rows:
            t.add_row(*r)
        (console or Console()).print(t)
    except Exception:
        for r in rows:
            print("  ".join(r))


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    names = list(BENCHMARKS) if not args.only else args.only
    bad = [n for n in names if n not in BENCHMARKS + OPT_IN]
    if bad:
        parser.error(f"--only: unknown benchmark(s) {', '.join(bad)}; known: {', '.join(BENCHMARKS + OPT_IN)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        parser.error(f"--time-budget: {args.time_budget!r} must be a positive number of seconds")
    bad_prefix = [n for n in args.prefixes or () if n % 256]
    if bad_prefix:
        parser.error(f"--prefixes: {', '.join(map(str, bad_prefix))} not a multiple of 256 tokens (LMCache's chunk)")
    if args.ceiling_bytes is not None and args.ceiling_bytes < 1 << 20:
        parser.error(f"--ceiling-bytes: {args.ceiling_bytes} is below 1 MiB ({1 << 20} bytes)")
    if args.serve_trace is not None:
        from cxlalloc_apps.bench.serve_trace import QUICK, Trace, parse_overrides

        try:
            parse_overrides(QUICK if args.quick else Trace(), args.serve_trace)
        except ValueError as e:
            parser.error(str(e))
    if args.simulate and "decode" in names:
        from cxlalloc_apps.bench.decode import sim_grid_error

        err = sim_grid_error(args.models, args.contexts, args.batches, args.new_tokens)
        if err:
            parser.error(err)
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, ".cxlalloc-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        parser.error(f"--out: cannot write to {args.out!r}: {e.strerror or e}")
    console = _console(args.no_progress)
    # transformers' own bars (weight loading, GGUF de-quantization) would fill a log with \r redraws
    # and fight the bench's progress display on a terminal: the bench reports its own progress.
    quiet_third_party()
    ctx = BenchContext(args, argv, console)
    ctx.log(f"cxlalloc bench: {', '.join(names)} -> {ctx.out_dir}"
            + (" (SIMULATION: CPU only, numbers not comparable to GPU)" if ctx.simulate else ""))
    records: Dict[str, dict] = {}
    rc = 0
    progress = None
    if console is not None:
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console)
        except Exception:
            progress = None
    task = None
    if progress is not None:
        progress.start()
        task = progress.add_task("benchmarks", total=len(names))
    try:
        for name in names:
            if progress is not None:
                progress.update(task, description=f"bench: {name}")
            try:
                records[name] = _runner(name)(ctx)
            except Exception as e:  # the benchmark's own guards failed: record it, keep going
                rc = 1
                wr = RecordWriter(ctx.out_dir, new_record(name, {}, ctx.simulate, argv, ctx.device))
                wr.error(name, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
                records[name] = wr.finish("error")
            ctx.log(f"bench: {name}: {records[name]['status']} ({len(records[name]['results'])} results)")
            if progress is not None:
                progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
    _print_table(console, records)
    return rc


if __name__ == "__main__":
    sys.exit(main())
