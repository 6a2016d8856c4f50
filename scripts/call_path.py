"""Count the file switches on a call path of cxlalloc's Python code (docs/DESIGN.md, "Two walks").

Runs one scenario on a tiny random Llama (CPU, simulated tiers) against an in-process kv-server
(its threads are traced too) and lists the project's Python functions (files under ``cxlalloc/``)
in the order each is first entered, by any thread; a *switch* is two consecutive functions of
that list in different files.  C++ (the engine) is not seen.

* ``block``: one ``generate()`` that stores its prompt's blocks in the kv-server pool, then the
  same prompt again, loading them back (a warm-up call before, not counted).
* ``cb``: one continuous-batching request (``generate_batch`` with one prompt, the kv-server as
  the store; a warm-up request before, not counted).

Prints one JSON line (``mode``, ``functions``, ``files``, ``switches``) and the files in order
(consecutive repeats collapsed).  ``python scripts/call_path.py block``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=1000, max_position_embeddings=4096, head_dim=32)
    m = LlamaForCausalLM(cfg).eval()
    m.config._attn_implementation = "sdpa"
    return m


class FirstEntries:
    """A profiler (every thread) keeping the project's functions in first-entry order while ``on``."""

    def __init__(self, pkg_dir: str):
        self.pkg = pkg_dir + os.sep
        self.on = False
        self.seen, self.order, self.lock = set(), [], threading.Lock()

    def __call__(self, frame, event, arg):
        if event != "call" or not self.on or not frame.f_code.co_filename.startswith(self.pkg):
            return
        key = (frame.f_code.co_filename, frame.f_code.co_firstlineno)
        with self.lock:
            if key not in self.seen:
                self.seen.add(key)
                self.order.append(os.path.relpath(frame.f_code.co_filename, self.pkg))

    def result(self, mode: str) -> dict:
        files = self.order
        seq = files[:1] + [b for a, b in zip(files, files[1:]) if a != b]
        return {"mode": mode, "functions": len(files), "files": len(set(files)), "switches": len(seq) - 1,
                "path": seq}


def run(mode: str) -> dict:
    """Trace scenario ``mode`` (``block`` or ``cb``); returns :meth:`FirstEntries.result`."""
    import torch

    import cxlalloc
    import cxlalloc.hf as hf
    from cxlalloc.kvstore.server import KVServer

    torch.set_num_threads(1)
    prof = FirstEntries(os.path.dirname(cxlalloc.__file__))
    threading.setprofile(prof)  # the server's threads too
    d = tempfile.mkdtemp(prefix="callpath-", dir="/tmp")
    srv = KVServer(64 << 20, 0, os.path.join(d, "kv.sock"), chunk_bytes=4 << 20).start()
    url = "unix://" + os.path.join(d, "kv.sock")
    m = tiny_llama()
    try:
        if mode == "block":
            hf.wrap(m, device_limit=64 << 20, host_limit=256 << 20, kv_store=url, block_tokens=8,
                    kv_conversation_limit=0)
            warm, ids = (torch.randint(3, 1000, (1, 20), generator=torch.Generator().manual_seed(s)) for s in (0, 1))
            m.generate(warm, max_new_tokens=2, do_sample=False)
            prof.on = True
            sys.setprofile(prof)
            m.generate(ids, max_new_tokens=2, do_sample=False)  # stores the prompt's blocks
            m.generate(ids, max_new_tokens=2, do_sample=False)  # loads them back
        else:
            from transformers import GenerationConfig
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            hf.wrap(m, device_limit=8 << 20, host_limit=64 << 20, device_headroom=0, kv_store=url)
            g = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
            cfg = dict(num_blocks=16, page_size=64, max_batch_tokens=512)
            m.generate_batch([list(range(3, 140))], generation_config=g,
                             continuous_batching_config=ContinuousBatchingConfig(**cfg))
            prof.on = True
            sys.setprofile(prof)
            m.generate_batch([list(range(5, 150))], generation_config=g,
                             continuous_batching_config=ContinuousBatchingConfig(**cfg))
    finally:
        prof.on = False
        sys.setprofile(None)
        threading.setprofile(None)
        if hf.is_wrapped(m):
            hf.unwrap(m)
        srv.stop()
        shutil.rmtree(d, ignore_errors=True)
    return prof.result(mode)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("block", "cb"))
    r = run(ap.parse_args(argv).mode)
    path = r.pop("path")
    print(json.dumps(r))
    print(" -> ".join(path))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
