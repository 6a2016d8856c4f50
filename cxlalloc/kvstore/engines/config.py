"""Config snippets that put a serving engine's KV on this machine's kv-server / CXL node.

Light on purpose (no torch, no lmcache import): ``cxlalloc info`` prints these
lines for the machine it runs on, and docs/engines.md shows the same ones.

* :func:`lmcache_yaml`: an LMCache config using the ``cxlalloc://`` plugin
  (:mod:`cxlalloc.kvstore.engines.lmcache_plugin`); vLLM, SGLang and Dynamo read it
  through ``LMCACHE_CONFIG_FILE``.
* :func:`vllm_kv_transfer_config`: vLLM's ``--kv-transfer-config`` for
  LMCache's connector (``LMCacheConnectorV1``).
* :func:`vllm_offload_config`: vLLM's ``--kv-transfer-config`` for its own
  KV offloading (``OffloadingConnector``) with cxlalloc's secondary tier.
* :func:`kvbm_host_tier_lines`: Dynamo KVBM's host tier (G2) on a NUMA node
  without code: its ``DYN_KVBM_CPU_CACHE_GB`` with KVBM's own NUMA placement
  switched off (``DYN_MEMORY_DISABLE_NUMA=1``, docs/sources.md#dynamo-kvbm)
  and the worker's memory policy bound to the node (``numactl --membind``).

Not yet run with an engine on a GPU.
"""

from __future__ import annotations

import json
from typing import List, Optional

from cxlalloc.kvstore.protocol import DEFAULT_SOCKET

PLUGIN_MODULE = "cxlalloc.kvstore.engines.lmcache_plugin"
PLUGIN_CLASS = "CxlallocConnectorAdapter"


def lmcache_yaml(socket_path: str = DEFAULT_SOCKET, *, chunk_size: int = 256, local_cpu_gb: float = 5.0,
                 timeout_s: Optional[float] = None, namespace: Optional[str] = None, extra: str = "") -> str:
    """LMCache's YAML config with the kv-server at ``socket_path`` as its remote-storage plugin.

    Args:
        socket_path: the kv-server's ``--socket``, or a whole ``cxlalloc://`` URL (used as it is).
        chunk_size: tokens per LMCache chunk (LMCache's default: 256).
        local_cpu_gb: LMCache's own CPU buffer (``max_local_cpu_size``, GB): it
            stages every chunk that goes to or comes from the kv-server, so it
            must be above 0.
        timeout_s / namespace: the plugin's URL options (defaults: 5 s, ``lmcache``).
        extra: more YAML lines, inserted before ``remote_storage_plugins``.
    """
    opts = []
    if timeout_s is not None:
        opts.append(f"timeout={timeout_s:g}")
    if namespace:
        opts.append(f"namespace={namespace}")
    if socket_path.startswith("cxlalloc://"):
        url = socket_path
    else:
        url = "cxlalloc://" + socket_path + ("?" + "&".join(opts) if opts else "")
    return (f"chunk_size: {int(chunk_size)}\n"
            "local_cpu: true\n"
            f"max_local_cpu_size: {local_cpu_gb:g}\n"
            # LMCache's default chunk hash ("builtin") is Python's hash(), seeded per process: two processes (even
            # vLLM's scheduler and worker) would name one chunk differently and share nothing
            "pre_caching_hash_algorithm: sha256_cbor\n"
            + extra +
            "remote_serde: naive\n"
            "remote_storage_plugins: [\"cxlalloc\"]\n"
            "extra_config:\n"
            "  use_exists_sync: true\n"   # LMCache asks the plugin directly, not through its event loop
            f"  remote_storage_plugin.cxlalloc.module_path: {PLUGIN_MODULE}\n"
            f"  remote_storage_plugin.cxlalloc.class_name: {PLUGIN_CLASS}\n"
            f"  remote_storage_plugin.cxlalloc.url: \"{url}\"\n")


def vllm_kv_transfer_config() -> str:
    """vLLM's ``--kv-transfer-config`` JSON for LMCache's connector (store and load)."""
    return json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})


VLLM_TIER_MODULE = "cxlalloc.kvstore.engines.vllm_tier"
VLLM_TIER_CLASS = "CxlallocSecondaryTier"


def vllm_offload_config(socket_path: str = DEFAULT_SOCKET, cpu_bytes: int = 1 << 30) -> str:
    """vLLM's ``--kv-transfer-config`` JSON for its own KV offloading with cxlalloc's secondary tier
    (:mod:`cxlalloc.kvstore.engines.vllm_tier`; docs/engines.md section 5c prints the same, on three lines).

    Args:
        socket_path: the kv-server's ``--socket``, or a whole ``cxlalloc://`` URL (used as it is).
        cpu_bytes: vLLM's CPU primary tier per engine (``cpu_bytes_to_use``, bytes; a ``/dev/shm`` region).
    """
    url = socket_path if socket_path.startswith("cxlalloc://") else "cxlalloc://" + socket_path
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {
                           "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": int(cpu_bytes),
                           "secondary_tiers": [{"type": VLLM_TIER_CLASS, "module_path": VLLM_TIER_MODULE,
                                                "url": url}]}})


def kvbm_host_tier_lines(node: int, gib: int) -> List[str]:
    """Shell lines that put Dynamo KVBM's host tier (G2, ``gib`` GiB) on NUMA node ``node``.

    KVBM allocates its pinned host blocks from worker threads pinned to the
    GPU's NUMA node (first touch places them there; a CPU-less CXL node has
    no CPU to pin to).  With ``DYN_MEMORY_DISABLE_NUMA=1`` it allocates
    directly, and the pages follow the worker's memory policy, which
    ``numactl --membind`` sets to the node (docs/sources.md#dynamo-kvbm).
    The policy covers every page of the worker, not only G2.
    """
    return [f"export DYN_KVBM_CPU_CACHE_GB={int(gib)}",
            "export DYN_MEMORY_DISABLE_NUMA=1",
            f"numactl --membind={int(node)} <your Dynamo worker command>"]


def engine_lines(node: int, node_free_bytes: Optional[int], socket_path: str = DEFAULT_SOCKET) -> dict:
    """The lines ``cxlalloc info`` prints for serving engines on this machine (docs/engines.md explains them).

    Args:
        node: the NUMA node the kv-server's pool and KVBM's G2 go on (``info``'s
            ``numa_node auto`` choice: a CPU-less/CXL node when there is one).
        node_free_bytes: the node's free memory (G2 is sized at half of it, at
            least 1 GiB); None when unknown (G2: 16 GiB).

    Returns:
        ``{"node", "kv_server", "lmcache_config_file", "lmcache_yaml", "vllm", "vllm_offload" (vLLM's own
        offloading with cxlalloc's tier, no LMCache), "sglang", "dynamo",
        "kvbm_g2": [lines], "status"}`` (strings).
    """
    g2 = max(1, int(node_free_bytes // 2 // (1 << 30))) if node_free_bytes else 16
    cfg = "/etc/cxlalloc/lmcache.yaml"
    return {
        "node": int(node),
        "kv_server": f"cxlalloc kv-server --numa-node {int(node)} --size 50% --socket {socket_path}",
        "lmcache_config_file": cfg,
        "lmcache_yaml": lmcache_yaml(socket_path),
        "vllm": f"LMCACHE_CONFIG_FILE={cfg} vllm serve <model> --kv-transfer-config '{vllm_kv_transfer_config()}'",
        "vllm_offload": f"vllm serve <model> --kv-transfer-config '{vllm_offload_config(socket_path)}'",
        "sglang": f"LMCACHE_CONFIG_FILE={cfg} python -m sglang.launch_server --model-path <model> --enable-lmcache",
        "dynamo": (f"LMCACHE_CONFIG_FILE={cfg} python -m dynamo.vllm --model <model> "
                   f"--kv-transfer-config '{vllm_kv_transfer_config()}'"),
        "kvbm_g2": kvbm_host_tier_lines(node, g2),
        "status": "not yet run with an engine on a GPU",
    }


__all__ = ["engine_lines", "lmcache_yaml", "vllm_kv_transfer_config", "vllm_offload_config", "kvbm_host_tier_lines",
           "PLUGIN_MODULE", "PLUGIN_CLASS", "VLLM_TIER_MODULE", "VLLM_TIER_CLASS"]
