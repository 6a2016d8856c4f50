"""``python -m cxlalloc`` / ``cxlalloc``: info, run, plan, bench, demo, serve, kv-server.

    cxlalloc info [--json] [--simulate] [--no-torch]
                                             GPUs, driver, capabilities, NUMA nodes,
                                             the node "auto" picks and why, backends, and the
                                             serving-engine lines for that node (docs/engines.md)
    cxlalloc run [options] -- CMD ...        run CMD with CXLALLOC set from the options
    cxlalloc bench ...                       benchmarks (the app cxlalloc_apps.bench, found by entry point)
    cxlalloc demo ...                        the main job: HuggingFace generate() past VRAM (cxlalloc_apps.demo)
    cxlalloc serve [MODEL] ...               OpenAI-compatible server on the tiered KV cache (cxlalloc.serve_cli)
    cxlalloc kv-server ...                   shared KV cache server (cxlalloc.kvstore.server.cli)
    cxlalloc plan --model M ...              right-sizing: KV bytes, VRAM split, GPUs with/without CXL (cxlalloc.plan.cli)

Exit codes: 0 success (also when the reader of stdout closes it early, as
``| head`` does: no traceback); 2 bad usage or options (one line,
``PROG: error: ...``, :mod:`cxlalloc.cli_usage`); ``run`` returns CMD's own code
(127 if CMD cannot be started).  ``--version`` prints the version.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import Dict, List, Optional

import cxlalloc
from cxlalloc import _C, topology
from cxlalloc.config import BACKENDS, POLICIES, format_bytes, make_config, make_enable_config, parse_env
from cxlalloc.engine import choose_node, new_engine
from cxlalloc.pytorch import adapter_build
from cxlalloc.cli_usage import OneLineParser, program_name

# CUDA driver attributes shown by `info` (values from cuda.h): the ones that
# decide which host-tier backends can work and how fast.
GPU_ATTRIBUTES = {
    "compute_capability_major": 75,
    "compute_capability_minor": 76,
    "can_map_host_memory": 19,
    "unified_addressing": 41,
    "managed_memory": 83,
    "host_native_atomic_supported": 86,
    "pageable_memory_access": 88,
    "concurrent_managed_access": 89,
    "can_use_host_pointer_for_registered_mem": 91,
    "host_register_supported": 99,
    "virtual_memory_management_supported": 102,
    "memory_pools_supported": 115,
    "numa_config": 130,
    "numa_id": 131,
    "host_numa_id": 134,
    "host_numa_virtual_memory_management_supported": 141,
    "host_numa_memory_pools_supported": 142,
}

# `run` flags -> CXLALLOC keys (every key also works through --option KEY=VALUE).
RUN_FLAGS = ("device_limit", "host_limit", "numa_node", "backend", "kv_device_limit", "device_headroom",
             "spill_reserve", "migration_rate", "promote_after", "policy", "strict_placement", "device")


# ----------------------------------------------------------------- info
def _topology_section(gpu_near_node: int = -1) -> dict:
    try:
        topo = topology.read_topology()
        choice = topology.choose_host_node(topo, gpu_near_node, "auto")
        return {"available": True, "topology": topo, "auto_node": choice}
    except Exception as e:  # no sysfs, or the topology module is missing
        return {"available": False, "reason": f"{type(e).__name__}: {e}", "topology": None, "auto_node": None}


def _torch_on_disk() -> Optional[dict]:
    """What the installed torch is, read from its files without importing it
    (an import takes seconds): version from its package metadata, CUDA build
    or not from ``torch/lib/libtorch_cuda.so*``.  None when torch is absent."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"version": version, "cuda_build": bool(glob.glob(os.path.join(lib, "libtorch_cuda.so*")))}


def _torch_section(import_torch: bool = True) -> dict:
    """torch's version, CUDA build and whether the adapter builds here.

    torch is imported only when that can change the answer: a CUDA build,
    unless ``import_torch`` is False (``info --no-torch``).  A CPU-only build
    (no ``libtorch_cuda.so``) is reported from its files: the adapter needs a
    CUDA build (``adapter_build.check_buildable``)."""
    disk = _torch_on_disk()
    if disk is None:
        return {"installed": False, "reason": "ModuleNotFoundError: No module named 'torch'"}
    if not import_torch or not disk["cuda_build"]:
        why = ("not checked (--no-torch)" if disk["cuda_build"] else
               f"cxlalloc torch adapter: torch {disk['version']} is a CPU-only build (no libtorch_cuda.so)")
        return {"installed": True, "version": disk["version"], "cuda": "unknown (not imported)" if disk["cuda_build"]
                else None, "git_version": None, "imported": False, "adapter": {"buildable": False, "reason": why}}
    try:
        import torch
    except Exception as e:
        return {"installed": False, "reason": f"{type(e).__name__}: {e}"}
    out = {"installed": True, "version": torch.__version__, "cuda": getattr(torch.version, "cuda", None),
           "git_version": getattr(torch.version, "git_version", None), "imported": True}
    try:
        adapter_build.check_buildable(torch)
        out["adapter"] = {"buildable": True, "cache": os.path.join(adapter_build.cache_root(), "torch-adapter",
                                                                    adapter_build.build_tag(torch))}
    except Exception as e:
        out["adapter"] = {"buildable": False, "reason": str(e)}
    return out


def _device_section(engine, d: int, simulate: bool) -> dict:
    free_b, total_b = engine.mem_info(d)
    attrs = {name: engine.attribute(d, code, -1) for name, code in GPU_ATTRIBUTES.items()}
    dev = {"index": d, "name": engine.device_name(d), "total_bytes": int(total_b), "free_bytes": int(free_b),
           "attributes": attrs, "host_numa_id": attrs["host_numa_id"]}
    try:
        choice = choose_node(engine, d, "auto")
        dev["auto_node"] = {"node": int(choice["node"]), "reason": choice["reason"]}
    except Exception as e:
        dev["auto_node"] = {"node": None, "reason": f"cannot choose: {e}"}
    # The engine's own verdict on each backend (what enable() would use):
    # a throwaway allocator with no host tier probes them all.
    try:
        node = dev["auto_node"]["node"] if dev["auto_node"]["node"] is not None else 0
        engine.configure_device(d, {"device_limit": 2 << 20, "host_limit": 0, "host_node": node})
        info = engine.device(d).info()
        dev["backends"] = {name: {"supported": bool(ok), "reason": reason}
                           for name, (ok, reason) in sorted(info["backend_support"].items())}
    except Exception as e:
        dev["backends"] = {"error": str(e)}
    return dev


def gather_info(simulate: bool = False, libcuda: str = "libcuda.so.1", import_torch: bool = True) -> dict:
    """Everything ``cxlalloc info`` reports, as a JSON-ready dict.

    Keys: ``cxlalloc`` (version, library), ``torch`` (version, CUDA build,
    whether the adapter can be built here), ``gpu`` (``available``,
    ``reason`` when not, ``simulated``, ``driver_version``, ``devices``: name,
    VRAM bytes, capability attributes, host NUMA id, the node ``auto`` picks
    and why, each backend's support and reason), ``numa`` (the topology: nodes
    with CPU-less / CXL marking, tiers, warnings, and the node ``auto`` would
    pick without a GPU).  Never raises for a missing GPU: that is ``gpu.reason``.
    torch is imported only for a CUDA build and ``import_torch`` (see
    :func:`_torch_section`; ``torch.imported`` says whether it was).
    """
    out = {"cxlalloc": {"version": cxlalloc.__version__, "library": os.path.abspath(_C.__file__)},
           "torch": _torch_section(import_torch)}
    gpu: Dict[str, object] = {"available": False, "simulated": bool(simulate), "devices": []}
    try:
        engine = new_engine(make_config(simulate=simulate, libcuda=libcuda))
    except Exception as e:
        gpu["reason"] = str(e)
        engine = None
    if engine is not None:
        gpu["driver_version"] = engine.driver_version
        gpu["numa_method"] = engine.numa_method
        if engine.device_count == 0:
            gpu["reason"] = "the CUDA driver reports no device (check CUDA_VISIBLE_DEVICES)"
        else:
            gpu["available"] = True
            gpu["reason"] = None
            gpu["devices"] = [_device_section(engine, d, simulate) for d in range(engine.device_count)]
    out["gpu"] = gpu
    near = gpu["devices"][0]["host_numa_id"] if gpu["devices"] else -1
    out["numa"] = _topology_section(near if isinstance(near, int) else -1)
    out["engines"] = _engines_section(out["numa"])
    return out


def _engines_section(numa: dict) -> Optional[dict]:
    """The serving-engine lines for this machine's node (cxlalloc/kvstore/engines/config.py), None without NUMA."""
    from cxlalloc.kvstore.engines import engine_lines

    an = numa.get("auto_node") if numa.get("available") else None
    if not an or an.get("node") is None:
        return None
    free = next((n.get("free_bytes") for n in numa["topology"].get("nodes", []) if n.get("id") == an["node"]), None)
    return engine_lines(int(an["node"]), free)


def _fmt_bytes(n) -> str:
    return format_bytes(n)


def format_info(info: dict, use_rich: Optional[bool] = None) -> str:
    """The readable form of :func:`gather_info`."""
    lines: List[str] = []
    cx, th, gpu, numa = info["cxlalloc"], info["torch"], info["gpu"], info["numa"]
    lines.append(f"cxlalloc {cx['version']} ({cx['library']})")
    if th.get("installed"):
        adapter = th.get("adapter", {})
        a = "buildable" if adapter.get("buildable") else f"not buildable: {adapter.get('reason')}"
        lines.append(f"torch {th['version']} (CUDA {th.get('cuda') or 'none: CPU-only build'}); adapter {a}")
    else:
        lines.append(f"torch: not importable ({th.get('reason')})")
    lines.append("")
    if not gpu["available"]:
        lines.append(f"no GPU: {gpu.get('reason')}")
    else:
        sim = " (SIMULATED driver)" if gpu["simulated"] else ""
        lines.append(f"CUDA driver {gpu.get('driver_version')}{sim}, NUMA placement checks: {gpu.get('numa_method')}")
        for dev in gpu["devices"]:
            lines.append(f"cuda:{dev['index']}: {dev['name']}, {_fmt_bytes(dev['total_bytes'])} VRAM "
                         f"({_fmt_bytes(dev['free_bytes'])} free), host NUMA id {dev['host_numa_id']}")
            attrs = ", ".join(f"{k}={v}" for k, v in dev["attributes"].items())
            lines.append(f"  attributes: {attrs}")
            an = dev.get("auto_node") or {}
            lines.append(f"  numa_node auto -> {an.get('node')}: {an.get('reason')}")
            backends = dev.get("backends", {})
            if "error" in backends:
                lines.append(f"  backends: cannot probe: {backends['error']}")
            else:
                for name, b in backends.items():
                    state = "supported" if b["supported"] else "NOT supported"
                    label = "device tier (VRAM)" if name == "device" else f"host-tier backend {name}"
                    lines.append(f"  {label}: {state}" + (f" ({b['reason']})" if b["reason"] else ""))
    lines.append("")
    if numa["available"]:
        near = gpu["devices"][0]["host_numa_id"] if gpu["devices"] else -1
        lines.append(topology.format_topology(numa["topology"], gpu_near_node=near, use_rich=use_rich))
        if numa["auto_node"]:
            lines.append(f"numa_node auto -> {numa['auto_node']['node']}: {numa['auto_node']['reason']}")
    else:
        lines.append(f"NUMA topology: unavailable ({numa['reason']})")
    eng = info.get("engines")
    if eng:
        lines += ["", f"serving engines, KV on node {eng['node']} ({eng['status']}; docs/engines.md):",
                  f"  kv-server:  {eng['kv_server']}",
                  f"  LMCache config ({eng['lmcache_config_file']}, plugin cxlalloc://):"]
        lines += ["    " + ln for ln in eng["lmcache_yaml"].splitlines()]
        lines += [f"  vLLM:       {eng['vllm']}",
                  f"  vLLM's own offloading, cxlalloc tier (no LMCache): {eng['vllm_offload']}",
                  f"  SGLang:     {eng['sglang']}", f"  Dynamo:     {eng['dynamo']}",
                  "  Dynamo KVBM host tier (G2) on the node, no LMCache:"]
        lines += ["    " + ln for ln in eng["kvbm_g2"]]
    return "\n".join(lines)


def cmd_info(args) -> int:
    info = gather_info(simulate=args.simulate, libcuda=args.libcuda, import_torch=not args.no_torch)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
    else:
        print(format_info(info))
    return 0


# ----------------------------------------------------------------- run
def _startup_hook_installed() -> bool:
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return any(os.path.isfile(os.path.join(d, "cxlalloc-startup.pth")) for d in dirs)


def _inherited_error_already_shown() -> bool:
    """True when the inherited CXLALLOC is itself invalid and the start-up
    hook of this very interpreter has already printed why."""
    try:
        make_enable_config(**(parse_env(os.environ.get("CXLALLOC", "")) or {}))
        return False
    except ValueError:
        startup = sys.modules.get("cxlalloc.pytorch.startup")
        return getattr(startup, "reported_error", None) is not None


def build_env_value(args) -> str:
    """The CXLALLOC value for ``run``: the current CXLALLOC (if any) updated
    with the flags and ``--option`` pairs; "1" when nothing is set.

    Raises:
        ValueError: a bad key or value (named, as cxlalloc.config words it).
    """
    # The inherited CXLALLOC is the base; this command line overrides it.
    # Within the command line one key may be given once: `--device-limit 2GiB
    # --option device_limit=1GiB` is a conflict, not a silent choice.
    opts = dict(parse_env(os.environ.get("CXLALLOC", "")) or {})
    given: Dict[str, str] = {}

    def put(key: str, value, how: str) -> None:
        if key in given:
            raise ValueError(f"cxlalloc option '{key}' is given twice on the command line ({given[key]} and {how}); "
                             "give it once")
        given[key] = how
        opts[key] = value

    for key in RUN_FLAGS:
        v = getattr(args, key, None)
        if v is not None:
            put(key, v, f"--{key.replace('_', '-')} {v}")
    for pair in args.option or []:
        if "=" not in pair:
            raise ValueError(f"--option {pair!r}: use KEY=VALUE (e.g. --option migration_rate=4GiB)")
        k, v = pair.split("=", 1)
        put(k.strip(), v.strip(), f"--option {pair}")
    for k, v in opts.items():
        if "," in str(v):  # CXLALLOC separates pairs with commas
            raise ValueError(f"cxlalloc option '{k}': {v!r} cannot contain ',' in CXLALLOC")
    make_enable_config(**opts)  # validate now: a clear error before CMD starts
    if not opts:
        return "1"
    return ",".join(f"{k}:{v}" for k, v in opts.items())


def cmd_run(args) -> int:
    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    prog = f"{program_name()} run"
    if not cmd:
        print(f"{prog}: error: no command given (usage: {prog} [options] -- CMD ...)", file=sys.stderr)
        return 2
    try:
        value = build_env_value(args)
    except ValueError as e:
        if _inherited_error_already_shown():
            print(f"{prog}: error: not running CMD: fix or unset CXLALLOC (the error above)", file=sys.stderr)
        else:
            print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if not _startup_hook_installed():
        print("cxlalloc run: warning: cxlalloc-startup.pth is not installed in this Python's site-packages, so "
              "Python commands will not enable cxlalloc by themselves (reinstall cxlalloc with pip)", file=sys.stderr)
    env = dict(os.environ)
    env["CXLALLOC"] = value
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)  # CMD's exit status and signals become ours
    except OSError as e:
        print(f"cxlalloc run: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


# ----------------------------------------------------------------- bench / demo / serve / kv-server
# Subcommands implemented elsewhere, imported only when used.  bench and demo
# are apps shipped beside the product (cxlalloc_apps/): the product never
# imports them, it finds them through the entry-point group setup.py declares.
APP_GROUP = "cxlalloc.apps"
APPS = {"bench": "benchmarks", "demo": "HuggingFace generate() demo"}
PRODUCT_COMMANDS = {"kv-server": ("cxlalloc.kvstore.server.cli", "shared KV cache server"),
                    "plan": ("cxlalloc.plan.cli", "right-sizing: KV bytes, VRAM split, GPUs with and without CXL"),
                    "serve": ("cxlalloc.serve_cli", "OpenAI-compatible server on the tiered KV cache")}
DELEGATES = [*APPS, *PRODUCT_COMMANDS]


def _app_entry_point(name: str):
    """The ``cxlalloc.apps`` entry point called ``name``, or None when no
    installed distribution declares it."""
    from importlib.metadata import entry_points

    return next((ep for ep in entry_points(group=APP_GROUP) if ep.name == name), None)


def _run_main(main, what: str, argv: List[str]) -> int:
    try:
        rc = main(argv, prog=f"{program_name()} {what}")
    except TypeError:  # a main() without prog
        rc = main(argv)
    return int(rc or 0)


def _delegate(name: str, argv: List[str]) -> int:
    """Run subcommand ``name`` (an app of :data:`APPS` or one of
    :data:`PRODUCT_COMMANDS`) with ``argv``; its exit status, or 2 with one
    line on stderr when it is not installed."""
    if name in PRODUCT_COMMANDS:
        module = PRODUCT_COMMANDS[name][0]
        try:
            main = importlib.import_module(module).main
        except (ImportError, AttributeError) as e:
            print(f"cxlalloc {name}: not available in this installation ({module}: {e})", file=sys.stderr)
            return 2
        return _run_main(main, name, argv)
    ep = _app_entry_point(name)
    if ep is None:
        print(f"cxlalloc {name}: not installed (no '{APP_GROUP}' entry point named '{name}'; reinstall cxlalloc "
              "with pip, which ships cxlalloc_apps)", file=sys.stderr)
        return 2
    try:
        main = ep.load()
    except (ImportError, AttributeError) as e:
        print(f"cxlalloc {name}: not available in this installation ({ep.value} could not be loaded: {e})",
              file=sys.stderr)
        return 2
    return _run_main(main, name, argv)


# `run` flags: help text and, where the option has a fixed set, its choices
# (cxlalloc.config holds both sets; make_config validates the rest).
RUN_HELP = {
    "device_limit": "VRAM cxlalloc may hold: bytes ('8GiB') or a fraction of VRAM ('0.5', '50%%')",
    "host_limit": "bytes on the host tier ('64GiB'); 0 disables spilling",
    "numa_node": "host NUMA node of the host tier, or auto (a CPU-less/CXL node nearest the GPU)",
    "backend": "host-tier backend",
    "kv_device_limit": "KV bytes allowed in VRAM (bytes or fraction of --device-limit)",
    "device_headroom": "VRAM a KV placement leaves free for activations (bytes or fraction)",
    "spill_reserve": "scoped mode: host bytes reserved for torch's spill pool",
    "migration_rate": "bytes/s budget for demotion + promotion ('8GiB')",
    "promote_after": "uses of a demoted chunk before it may come back (int)",
    "policy": "placement policy (first-fit: the policy-free baseline)",
    "strict_placement": "fail host allocations whose pages miss the node (true/false; bare flag: true)",
    "device": "GPU index cxlalloc serves (default: every GPU)",
}
RUN_CHOICES = {"backend": BACKENDS, "policy": POLICIES}


def make_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of ``cxlalloc`` (``prog``: the name in usage lines, default
    :func:`cxlalloc.cli_usage.program_name`); usage errors are one line, status 2."""
    prog = prog or program_name()
    p = OneLineParser(prog=prog, description="Tiered PyTorch CUDA allocator: VRAM, then host/CXL NUMA memory. "
                      f"'{prog} COMMAND --help' lists a command's options; the Python API: help(cxlalloc).")
    p.add_argument("--version", action="version", version=f"cxlalloc {cxlalloc.__version__}")
    sub = p.add_subparsers(dest="command", metavar="{info,run,bench,demo,kv-server,plan,serve}")
    sub.required = True

    pi = sub.add_parser("info", help="GPUs, driver, capabilities, NUMA nodes, node choice, backends",
                        description="What cxlalloc sees here: GPUs, driver, NUMA nodes, the node numa_node=auto "
                        "picks and why, each backend's support.")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pi.add_argument("--simulate", action="store_true", help="report the simulated GPU of cxlalloc's test driver")
    pi.add_argument("--libcuda", default="libcuda.so.1", help="CUDA driver library (default libcuda.so.1)")
    pi.add_argument("--no-torch", action="store_true", help="do not import torch (seconds): report its version "
                    "from its files and skip the adapter check (a CPU-only torch is never imported)")
    pi.set_defaults(func=cmd_info)

    pr = sub.add_parser("run", help="run a command with cxlalloc enabled (sets CXLALLOC)",
                        description="Run CMD with CXLALLOC set from these options; every Python process it "
                        "starts enables cxlalloc right after importing torch.")
    for key in RUN_FLAGS:
        flag = "--" + key.replace("_", "-")
        if key == "strict_placement":
            pr.add_argument(flag, dest=key, nargs="?", const="true", default=None, metavar="BOOL",
                            help=RUN_HELP[key])
        elif key in RUN_CHOICES:
            pr.add_argument(flag, dest=key, default=None, choices=RUN_CHOICES[key],
                            help=f"{RUN_HELP[key]}: {', '.join(RUN_CHOICES[key])}")
        else:
            pr.add_argument(flag, dest=key, default=None, metavar=key.upper(), help=RUN_HELP[key])
    pr.add_argument("--option", action="append", metavar="KEY=VALUE",
                    help="any other cxlalloc option (a CXLALLOC key, e.g. migration_rate=4GiB); repeatable")
    pr.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...: the command to run")
    pr.set_defaults(func=cmd_run)

    helps = {**APPS, **{name: f"{text} ({module})" for name, (module, text) in PRODUCT_COMMANDS.items()}}
    for name in DELEGATES:
        ps = sub.add_parser(name, help=helps[name], add_help=False)
        ps.add_argument("rest", nargs=argparse.REMAINDER)
        ps.set_defaults(func=lambda a, n=name: _delegate(n, a.rest))
    p.commands = {"info": pi, "run": pr}  # main() reports a stray flag as the command's own error
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m cxlalloc`` and the ``cxlalloc`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # bench/demo own their arguments (argparse's REMAINDER would refuse a
        # leading option such as --help), so hand them over untouched.
        if argv and argv[0] in DELEGATES:
            return _delegate(argv[0], argv[1:])
        parser = make_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse would name the top-level program: name the command the flag was given to
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except BrokenPipeError:
        # `cxlalloc info --json | head`: the reader has what it wanted; no
        # traceback, and nothing more for the interpreter to flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
