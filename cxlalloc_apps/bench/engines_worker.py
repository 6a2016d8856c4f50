"""One long-lived vLLM engine of ``bench --only engines`` (:mod:`.engines`), run with the engine venv's Python.

``python -m cxlalloc_apps.bench.engines_worker SPEC_JSON``: starts ``vllm.LLM`` (SPEC: model, ``max_model_len``,
``prefix_caching``, ``kv_cache_bytes`` (vLLM's KV cache, bytes), and either ``kv_transfer_config``: vLLM's
``--kv-transfer-config`` JSON as a dict, used as given, or ``lmcache``: true for LMCache's connector with
``LMCACHE_CONFIG_FILE``), prints one line ``MARK + {"ready": ...}``,
then answers each JSON line on stdin, ``{"ids": [...]}``, with one line: vLLM's time to the first token
(``ttft_s``, from its request metrics), the request's wall time and ``num_cached_tokens``.  EOF ends it.
"""

from __future__ import annotations

import json
import sys
import time

MARK = "@@cxlalloc-bench@@ "  # vLLM and LMCache log to stdout too: replies carry this prefix


def main(argv) -> int:
    spec = json.loads(argv[0])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"], enforce_eager=True,
              seed=0, enable_prefix_caching=bool(spec["prefix_caching"]),
              max_num_batched_tokens=spec["max_model_len"], disable_log_stats=False)
    if spec.get("kv_cache_bytes"):  # instead of the CPU build's VLLM_CPU_KVCACHE_SPACE (whole GiB only)
        kw["kv_cache_memory_bytes"] = int(spec["kv_cache_bytes"])
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    elif spec.get("lmcache"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    t0 = time.monotonic()
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    print(MARK + json.dumps({"ready": True, "start_s": time.monotonic() - t0}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t = time.monotonic()
        r = llm.generate([TokensPrompt(prompt_token_ids=req["ids"])], params, use_tqdm=False)[0]
        print(MARK + json.dumps({"ttft_s": getattr(r.metrics, "first_token_latency", None), "wall_s": time.monotonic() - t,
                          "cached": r.num_cached_tokens, "token": r.outputs[0].token_ids[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
