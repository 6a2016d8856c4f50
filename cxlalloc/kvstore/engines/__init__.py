"""Serving-engine plugins and the config lines that point an engine at the kv-server.

The room where an engine plugin goes (CONTRIBUTING.md, "Where new code goes"):

    config          the config lines ``cxlalloc info`` prints and docs/engines.md shows
                    (:func:`lmcache_yaml`, :func:`engine_lines`); light: no torch, no lmcache
    lmcache_plugin  the kv-server as LMCache's ``cxlalloc://`` remote-storage plugin (needs
                    the ``lmcache`` extra; imported only by LMCache, through the module path
                    :data:`~cxlalloc.kvstore.engines.config.PLUGIN_MODULE` in its YAML)
    lmcache_l2      the kv-server as an L2 adapter of LMCache's multiprocess mode
                    (``{"type": "plugin", ...}``; needs the ``lmcache`` extra; imported only by LMCache)
    vllm_tier       the kv-server as a secondary tier of vLLM's own KV offloading
                    (``TieringOffloadingSpec``'s ``secondary_tiers``, by ``module_path``; needs
                    vLLM; imported only by vLLM)

A new engine's plugin is one module here, its config lines a function in
``config``, its tests under ``tests/kvstore/engines/``.
"""

from cxlalloc.kvstore.engines.config import (PLUGIN_CLASS, PLUGIN_MODULE, engine_lines, kvbm_host_tier_lines,
                                             lmcache_yaml, vllm_kv_transfer_config, vllm_offload_config)

__all__ = ["PLUGIN_CLASS", "PLUGIN_MODULE", "engine_lines", "kvbm_host_tier_lines", "lmcache_yaml",
           "vllm_kv_transfer_config", "vllm_offload_config"]
