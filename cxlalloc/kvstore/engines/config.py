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
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

from cxlalloc.kvstore import protocol as P
from cxlalloc.kvstore.protocol import DEFAULT_SOCKET

SCHEME = "cxlalloc://"

# ------------------------------------------------------------------ parameters of the engine plugins
# One checker for every engine plugin's options (the LMCache plugin's URL, the MP L2 adapter's adapter_params,
# the vLLM tier's secondary_tiers entry): an unknown name, or a value outside the allowed ones, is one error
# naming the option and what it allows.

Check = Callable[[Any], Any]
"""A value checker: returns the value to use, or raises ValueError saying what is allowed."""


def int_in(lo: int, hi: int) -> Check:
    """A checker: an int (not a bool) from ``lo`` to ``hi``."""
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"must be an int from {lo} to {hi}")
        return v
    return check


def one_of(*choices: str) -> Check:
    """A checker: one of ``choices`` (case-insensitive), returned as spelled in ``choices``."""
    def check(v):
        for c in choices:
            if str(v).upper() == c.upper():
                return c
        raise ValueError(f"must be {' or '.join(choices)}" if len(choices) == 2 else f"must be one of {', '.join(choices)}")
    return check


def positive_seconds(v) -> float:
    """A checker: a positive number of seconds (a string such as ``"5"`` from a URL is read as a number)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = -1.0
    if isinstance(v, bool) or not f > 0:
        raise ValueError("must be a positive number of seconds")
    return f


def namespace_name(v) -> str:
    """A checker: a namespace name, 1-64 characters without ``/``."""
    if not isinstance(v, str) or not v or len(v) > 64 or "/" in v:
        raise ValueError("must be 1-64 characters without '/'")
    return v


def check_params(given: Mapping[str, Any], spec: Mapping[str, Tuple[Any, Check, str]], where: str,
                 error: Type[Exception] = ValueError, what: str = "parameter") -> Dict[str, Any]:
    """Check an engine plugin's options against ``spec`` and fill in the defaults.

    Args:
        given: the options as the engine passed them (name -> value).
        spec: name -> (default, checker, what it is, said in the "allowed" list); a default of None is used
            as it is (not checked).
        where: the plugin, first in every message (``"cxlalloc vLLM tier"``).
        error: the exception class raised (a ``ValueError`` subclass the engine stops on).
        what: the kind of option, in the unknown-name message (``"parameter"``, ``"URL option"``).

    Returns:
        name -> checked value, for every name of ``spec``.

    Raises:
        error: an unknown name (the message lists the allowed names) or a value its checker refuses (the
            message names the option, the value and what is allowed).
    """
    unknown = sorted(set(given) - set(spec))
    if unknown:
        allowed = ", ".join(f"{n} ({desc})" for n, (_, _, desc) in spec.items())
        raise error(f"{where}: unknown {what}(s) {', '.join(map(str, unknown))}; allowed: {allowed}")
    out: Dict[str, Any] = {}
    for name, (default, check, _) in spec.items():
        v = given.get(name, default)
        if v is None and default is None:
            out[name] = None
            continue
        try:
            out[name] = check(v)
        except ValueError as e:
            raise error(f"{where}: {name}={v!r} {e}") from None
    return out


def parse_kv_url(url: str, where: str, default_namespace: str, default_timeout_s: float,
                 error: Type[Exception] = ValueError) -> Tuple[str, float, str]:
    """``cxlalloc:///path/kv.sock?timeout=S&namespace=NAME`` -> (socket path, timeout s, namespace): the URL of
    every engine plugin.

    Raises:
        error: not a ``cxlalloc://`` URL, a bad socket path, an unknown option, a timeout that is not a positive
            number, a namespace that is empty, longer than 64 characters or contains ``/``.
    """
    default_url = SCHEME + DEFAULT_SOCKET
    if not isinstance(url, str) or not url.startswith(SCHEME):
        raise error(f"{where}: url={url!r} is not a kv-server URL; use '{default_url}' (the --socket of "
                    "`cxlalloc kv-server`)")
    try:
        path = P.check_socket_path(url[len(SCHEME):].split("?", 1)[0], "cxlalloc:// socket path")
    except ValueError as e:
        raise error(f"{where}: url={url!r}: {e}") from None
    got = check_params(P.url_query(url), {"timeout": (default_timeout_s, positive_seconds, "seconds"),
                                          "namespace": (default_namespace, namespace_name, "a name")},
                       where, error, what="URL option")
    return path, got["timeout"], got["namespace"]


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


__all__ = ["check_params", "parse_kv_url", "int_in", "one_of", "positive_seconds", "namespace_name", "engine_lines", "lmcache_yaml", "vllm_kv_transfer_config", "vllm_offload_config", "kvbm_host_tier_lines",
           "PLUGIN_MODULE", "PLUGIN_CLASS", "VLLM_TIER_MODULE", "VLLM_TIER_CLASS"]
