"""One vLLM process of the engine tests, run with the engine venv's Python (scripts/install_engines.sh).

``python -m tests.engines.vllm_child SPEC.json``: SPEC names the model folder,
the prompts (token ids), ``lmcache`` (true: LMCache's connector with the
config in ``LMCACHE_CONFIG_FILE``; false: no connector, no prefix cache: the
reference run), ``kv_transfer_config`` (optional: vLLM's ``--kv-transfer-config``
JSON as a dict, used as given instead of LMCache's), the output file, and optionally ``pause_after`` (an index:
after that request the child writes ``SPEC.out + '.paused'`` and waits for the
file ``SPEC.out + '.go'``, so the test can kill the kv-server between two
requests of a running engine).  Each request runs alone (greedy,
``max_tokens``), and the child writes, per request: the generated token ids,
vLLM's ``num_cached_tokens``, the wall time of the request and vLLM's time to its first token.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=spec["max_model_len"],
              enforce_eager=True, seed=0, enable_prefix_caching=False,
              max_num_batched_tokens=spec["max_model_len"], disable_log_stats=False)
    import torch

    if torch.cuda.is_available():  # scripts/gpu_check.sh: two engines share the card
        kw["gpu_memory_utilization"] = float(os.environ.get("CXLALLOC_ENGINE_GPU_MEMORY", "0.2"))
    if spec.get("kv_transfer_config"):  # vLLM's --kv-transfer-config JSON, as given
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    elif spec["lmcache"]:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    t0 = time.monotonic()
    llm = LLM(**kw)
    start_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    out = {"start_s": start_s, "requests": []}
    for i, ids in enumerate(spec["prompts"]):
        t = time.monotonic()
        r = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        out["requests"].append({"tokens": list(r.outputs[0].token_ids), "num_cached_tokens": r.num_cached_tokens,
                                "prompt_tokens": len(ids), "wall_s": time.monotonic() - t,
                                "ttft_s": getattr(r.metrics, "first_token_latency", None)})
        if spec.get("pause_after") == i:
            with open(spec["out"] + ".paused", "w") as f:
                json.dump(out, f)
            deadline = time.monotonic() + 120
            while not os.path.exists(spec["out"] + ".go") and time.monotonic() < deadline:
                time.sleep(0.05)
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
