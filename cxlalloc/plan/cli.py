"""``cxlalloc plan``: right-sizing from a model config, on any machine (no GPU,
no network, no torch).

    cxlalloc plan --model DIR|config.json|llama-3.1-8b --context 32768 --users 64 --gpu h200
                  [--gpus 2 [--parallel tp|pp]] [--json] [--plot plan.png] [--reuse 0.5] [--host-bytes 1TB]
                  [--host-node cxl-x8] ...

Exit codes: 0 success; 2 bad usage (one line naming the option and its allowed values).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import List, Optional

from cxlalloc.cli_usage import OneLineParser as _Parser, fail
from cxlalloc.plan import hardware
from cxlalloc.plan.layout import DTYPE_BYTES, PRESETS_DIR, presets
from cxlalloc.plan.planner import PARALLEL, PlanInputs, check_whole, plan

DEFAULT_RECORDS = os.path.join("benchmarks", "results")
UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1 << 10, "mib": 1 << 20,
         "gib": 1 << 30, "tib": 1 << 40}




def size(option: str):
    """An argparse type: bytes from ``512GB``, ``1.5TiB``, ``80e9`` (decimal and binary units)."""
    def parse(text: str) -> float:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in UNITS:
            raise ValueError(f"{option} takes a size such as 512GB, 1.5TiB or 80e9 (units: "
                             f"{', '.join(u for u in UNITS if u)}), got {text!r}")
        return float(m.group(1)) * UNITS[m.group(2).lower()]
    parse.__name__ = option
    return parse


def _positive(option: str, lo=0.0, hi=None):
    def parse(text: str):
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"{option} takes a number, got {text!r}") from None
        if v <= lo or (hi is not None and v > hi):
            raise ValueError(f"{option} must be > {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
                             + f", got {text!r}")
        return v
    parse.__name__ = option
    return parse


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"--reuse takes a share in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"--reuse takes a share in [0, 1], got {text!r}")
    return v


def _whole(option: str):
    """An argparse type: a whole number >= 1 (:func:`cxlalloc.plan.planner.check_whole`, as plan() takes it)."""
    def parse(text: str) -> int:
        return check_whole(text, option)
    parse.__name__ = option
    return parse


def _slo(text: str):
    if str(text).lower() == "none":
        return None
    return _positive("--tpot-slo-ms")(text)


def _node(text: str):
    if str(text).lower() in hardware.HOST_NODES:
        return str(text).lower()
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"--host-node must be one of {', '.join(hardware.HOST_NODES)} or a bandwidth in GB/s, "
                         f"got {text!r}") from None
    if v <= 0:
        raise ValueError(f"--host-node bandwidth must be > 0 GB/s, got {text!r}")
    return v


def make_parser(prog: str = "cxlalloc plan") -> argparse.ArgumentParser:
    dtypes = sorted(DTYPE_BYTES)
    p = _Parser(prog=prog, description="Right-sizing: KV bytes per token (exact, per layer kind), the VRAM split, "
                "sequences per GPU with and without the host/CXL tier, decode and TTFT bounds, and the GPU count "
                "with and without it.  Formulas and sources: docs/planning.md.")
    p.add_argument("--model", required=True, metavar="DIR|CONFIG|PRESET",
                   help=f"a model directory or config.json (read as JSON), or a preset: {', '.join(presets())}")
    p.add_argument("--context", type=_whole("--context"), default=32768,
                   help="tokens per sequence, prompt + generated (default 32768)")
    p.add_argument("--users", type=_whole("--users"), default=64,
                   help="concurrent sequences to serve (default 64)")
    p.add_argument("--weight-dtype", choices=dtypes, default="bf16", help="weight element type (default bf16)")
    p.add_argument("--kv-dtype", choices=dtypes, default=None, help="KV element type (default: the weights')")
    p.add_argument("--reuse", type=_share, default=0.0,
                   help="share of each prompt served from the prefix reuse pool, 0..1 (default 0)")
    p.add_argument("--gpu", choices=sorted(hardware.GPUS), default="h200", help="GPU preset (default h200)")
    p.add_argument("--hbm-bytes", type=size("--hbm-bytes"), default=None, help="VRAM per GPU (default: the preset's)")
    p.add_argument("--hbm-gbps", type=_positive("--hbm-gbps"), default=None,
                   help="HBM read rate, GB/s (default: a measured record, else the datasheet)")
    p.add_argument("--tflops", type=_positive("--tflops"), default=None,
                   help="dense BF16 TFLOPS for prefill (default: the preset's)")
    p.add_argument("--link-gbps", type=_positive("--link-gbps"), default=None,
                   help="GPU-host link per direction, GB/s (default: a measured record, else PCIe theoretical)")
    p.add_argument("--host-bytes", type=size("--host-bytes"), default=None,
                   help="host/CXL memory per GPU for KV (default: from --info, else 512GB)")
    p.add_argument("--info", metavar="JSON|here", default=None,
                   help="host/CXL node sizes (and the GPU's memory) from a `cxlalloc info --json` file, or 'here' "
                        "for this machine's NUMA nodes")
    p.add_argument("--host-node", type=_node, default="dram",
                   help=f"host/CXL memory bandwidth: {', '.join(hardware.HOST_NODES)} or GB/s (default dram)")
    p.add_argument("--headroom", type=size("--headroom"), default=None,
                   help="VRAM per GPU left to activations (default max(2GiB, 10%% of VRAM))")
    p.add_argument("--tpot-slo-ms", type=_slo, default=50.0,
                   help="decode step target in ms, or 'none' for capacity only (default 50)")
    p.add_argument("--mfu", type=_positive("--mfu", 0.0, 1.0), default=0.4,
                   help="prefill's share of the dense peak, (0, 1] (default 0.4)")
    p.add_argument("--weight-bytes", type=size("--weight-bytes"), default=None,
                   help="the checkpoint's weight bytes (default: parameters from the config x --weight-dtype)")
    p.add_argument("--records", action="append", default=None, metavar="PATH",
                   help=f"bench records (files or folders) whose measured ceilings replace datasheet rates "
                        f"(default: {DEFAULT_RECORDS} if present)")
    p.add_argument("--no-records", action="store_true", help="use datasheet figures only")
    p.add_argument("--gpus", type=_whole("--gpus"), default=None, metavar="N",
                   help="GPUs per model copy, with per-GPU figures (weights, KV, host/CXL bytes, node, link); "
                        "default: the smallest of 1, 2, 4, 8 that holds the weights")
    p.add_argument("--parallel", choices=PARALLEL, default="tp",
                   help="how --gpus spread a copy: tp, tensor parallel (default, as vLLM/SGLang "
                        "--tensor-parallel-size), or pp, layers split over the GPUs (as transformers' "
                        "device_map='auto')")
    p.add_argument("--json", action="store_true", help="print the plan record as JSON")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="write a plot: capacity against context, TPOT against users")
    return p


def resolve_model(text: str) -> str:
    """A preset name's config path, or ``text`` itself."""
    if text in presets() and not os.path.exists(text):
        return os.path.join(PRESETS_DIR, text + ".json")
    return text


def main(argv: Optional[List[str]] = None, prog: str = "cxlalloc plan") -> int:
    """Entry point of ``cxlalloc plan`` (returns the exit status)."""
    args = make_parser(prog).parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before the plan is computed)
        except ImportError:
            from cxlalloc.extras import install_hint
            fail(prog, f"--plot needs matplotlib: {install_hint('bench')}; or leave out --plot")
    records = [] if args.no_records else (args.records or ([DEFAULT_RECORDS] if os.path.isdir(DEFAULT_RECORDS) else []))
    try:
        info = None
        if args.info == "here":
            info = hardware.info_here()
        elif args.info:
            try:
                with open(args.info) as f:
                    info = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"--info: cannot read {args.info!r} as a `cxlalloc info --json` record: {e}") from None
        inputs = PlanInputs(resolve_model(args.model), context=args.context, users=args.users,
                            weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, reuse=args.reuse, gpu=args.gpu,
                            hbm_bytes=args.hbm_bytes, hbm_gbps=args.hbm_gbps, bf16_tflops=args.tflops,
                            link_gbps=args.link_gbps, host_bytes=args.host_bytes, host_node=args.host_node, info=info,
                            headroom_bytes=args.headroom, tpot_slo_ms=args.tpot_slo_ms, mfu=args.mfu,
                            weight_bytes=args.weight_bytes, records=records, gpus=args.gpus,
                            parallel=args.parallel)
        rec = plan(inputs)
    except (ValueError, FileNotFoundError) as e:
        fail(prog, str(e))
    rec["inputs"]["records_searched"] = records
    if args.plot:
        from cxlalloc.plan.report import plot
        rec["plot"] = plot(rec, args.plot)
    if args.json:
        json.dump(rec, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        from cxlalloc.plan.report import print_table
        print_table(rec)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
