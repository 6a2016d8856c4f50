"""Block keys of the KV reuse store: a model fingerprint and chained block hashes.

A stored block of ``block_tokens`` tokens is found by its key::

    root    = H("cxlalloc-kv/1" | fingerprint | layout signature | block_tokens | cache_salt)
    key[0]  = H(root   | tokens[0 : bt])
    key[j]  = H(key[j-1] | tokens[j*bt : (j+1)*bt])

so a key names the block *and every token before it* (the K/V of a token depend
on all earlier tokens), the model that computed it, the memory layout of its
bytes, and the tenant's namespace.  This is vLLM's chained block hash (automatic
prefix caching: ``hash(parent_hash, block_tokens, extra_keys)``) and LMCache's
``model@...@chunk_hash`` key, with the model identity inside the chain instead of
beside it (docs/sources.md#kv-reuse).  A block's name inside a namespace
(:func:`namespaced_key`: the kv-server's index key) and its Redis key
(:func:`redis_key`) are made here too, next to the keys they name.  ``H`` is BLAKE2b-256 (``hashlib``):
collision-resistant, so tenants cannot forge another tenant's key (vLLM moved
from Python's ``hash`` to SHA-256 for the same reason).

The fingerprint (:func:`model_fingerprint`) covers the architecture, the config
(every field except paths, versions and run-time switches that do not change
the K/V), the dtype and the **weights' identity**: KV computed by other weights
is a silent wrong answer, so two models that differ only in their weights (a
fine-tune, a merged LoRA) must never share a block.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, List, Optional, Sequence

import numpy as np

KEY_BYTES = 32
VERSION = b"cxlalloc-kv/1"

# Config fields that do not change a K/V value: where the weights came from,
# which library wrote the file, and run-time switches of forward().
_CONFIG_IGNORED = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "architectures", "auto_map",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "_attn_implementation", "_attn_implementation_internal", "_attn_implementation_autoset", "attn_implementation",
    "_experts_implementation", "dtype", "torch_dtype", "tie_word_embeddings", "id2label", "label2id",
    "task_specific_params", "problem_type", "tokenizer_class", "prefix", "pad_token_id", "bos_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id",
})
WEIGHT_MODES = ("sampled", "full")
# Sampled weight digest: per tensor, its first and last _EDGE elements and
# _POINTS evenly spaced ones.  A fine-tune changes nearly every element, so a
# few hundred points per tensor tell two checkpoints apart; "full" hashes
# every byte (about 1 s/GB on one core) for a change confined to a few values.
_EDGE = 256
_POINTS = 64


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))  # length-prefixed: no two part lists hash alike
        h.update(p)
    return h.digest()


def _config_text(config) -> str:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in sorted(x.items()) if k not in _CONFIG_IGNORED}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(d), sort_keys=True, default=str)


def _tensor_bytes(t, mode: str) -> bytes:
    """The bytes of ``t`` that enter the weights digest (moved to the CPU)."""
    import torch

    flat = t.detach().reshape(-1)
    n = flat.numel()
    if mode == "full" or n <= 2 * _EDGE + _POINTS:
        sample = flat
    else:
        # Integer spacing: a float linspace rounds past the end of large tensors.
        idx = torch.arange(_POINTS, device=flat.device, dtype=torch.long) * (n - 1) // (_POINTS - 1)
        sample = torch.cat([flat[:_EDGE], flat.index_select(0, idx), flat[-_EDGE:]])
    sample = sample.cpu().contiguous()
    return sample.view(torch.uint8).numpy().tobytes() if sample.element_size() else b""


def weights_digest(model, mode: str = "sampled") -> bytes:
    """Digest of the model's parameters: names, shapes, dtypes and values.

    Args:
        model: a ``torch.nn.Module``.
        mode: ``"sampled"`` (first/last 256 and 64 evenly spaced elements of
            each tensor: a few small copies per tensor, milliseconds for a
            135M model, well under a second for an 8B one) or ``"full"``
            (every byte).

    Returns:
        32 bytes.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"cxlalloc option 'kv_store_fingerprint': {mode!r} is not allowed; allowed: "
                         f"{', '.join(WEIGHT_MODES)}")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for name, p in model.named_parameters(remove_duplicate=True):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
        if p.numel() and p.device.type != "meta":
            h.update(_tensor_bytes(p, mode))
    return h.digest()


def weights_version(model) -> tuple:
    """A cheap token that changes when any parameter is replaced or modified in
    place (its storage address and torch's in-place version counter), so a
    fingerprint is recomputed after training steps or ``load_state_dict``."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def model_fingerprint(model, weights: str = "sampled") -> bytes:
    """The identity of the model that computes a K/V: 32 bytes.

    Covers ``type(model).__name__``, ``config.model_type``, the config without
    paths, versions and run-time switches (see ``_CONFIG_IGNORED``), the
    parameters' dtype, and :func:`weights_digest`.  Loading the same checkpoint
    from another path, another process or another machine gives the same
    fingerprint; another dtype, config or weights gives another.

    Raises:
        ValueError: an unknown ``weights`` mode.
    """
    config = getattr(model, "config", None)
    arch = type(model).__name__
    model_type = str(getattr(config, "model_type", ""))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    cfg = _config_text(config) if config is not None else ""
    return _h(b"model", arch.encode(), model_type.encode(), ",".join(dtypes).encode(), cfg.encode(),
              weights_digest(model, weights))


def root_key(fingerprint: bytes, layout_signature: bytes, block_tokens: int, cache_salt: Optional[str]) -> bytes:
    """The key every chain of a (model, layout, block size, namespace) starts from."""
    salt = b"" if cache_salt is None else b"salt:" + str(cache_salt).encode()
    return _h(VERSION, fingerprint, layout_signature, int(block_tokens).to_bytes(8, "little"), salt)


def token_bytes(tokens) -> bytes:
    """Token ids as little-endian int64 (any int sequence, NumPy array or CPU/GPU tensor)."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(tokens, dtype="<i8")).tobytes()


def chain_keys(root: bytes, tokens, block_tokens: int, start_key: Optional[bytes] = None,
               max_blocks: Optional[int] = None) -> List[bytes]:
    """Keys of the full blocks of ``tokens`` (a partial last block has none).

    Args:
        root: :func:`root_key`.
        tokens: token ids of one sequence (1-D).
        block_tokens: tokens per block.
        start_key: continue a chain whose previous key is this (then
            ``tokens`` starts at a block boundary after it).
        max_blocks: at most this many keys.

    Returns:
        ``len(tokens) // block_tokens`` keys (or ``max_blocks``), 32 bytes each.
    """
    raw = token_bytes(tokens)
    step = 8 * int(block_tokens)
    n = len(raw) // step
    if max_blocks is not None:
        n = min(n, int(max_blocks))
    out = []
    prev = root if start_key is None else start_key
    for j in range(n):
        prev = _h(prev, raw[j * step:(j + 1) * step])
        out.append(prev)
    return out


def namespaced_key(ns: str, key: bytes) -> bytes:
    """The 32-byte name of block ``key`` in namespace ``ns``:
    ``H("cxlalloc-kv-ns/1" | ns | key)`` (BLAKE2b-256, length-prefixed parts).

    The kv-server indexes blocks by it and the Redis tier names values by it
    (:func:`redis_key`), so a namespace can only ever reach its own blocks."""
    return _h(b"cxlalloc-kv-ns/1", (ns or "").encode(), bytes(key))


def namespaced_keys(ns: str, keys) -> list:
    """``[namespaced_key(ns, k) for k in keys]`` with the namespace's part
    hashed once (a copy of that hash state per key): the same names, a
    request of many keys without re-hashing the prefix for each."""
    h0 = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in (b"cxlalloc-kv-ns/1", (ns or "").encode()):
        h0.update(len(p).to_bytes(8, "little"))
        h0.update(p)
    out = []
    for k in keys:
        k = bytes(k)
        h = h0.copy()
        h.update(len(k).to_bytes(8, "little"))
        h.update(k)
        out.append(h.digest())
    return out


REDIS_PREFIX = "cxlalloc:kv:"  # the default prefix of every Redis key (``?prefix=`` changes it)


def redis_key(prefix: str, nskey: bytes) -> str:
    """The Redis key of the block named ``nskey`` (:func:`namespaced_key`):
    ``prefix`` + 64 hex digits, so every process, server and machine that
    computed the block names it alike."""
    return prefix + bytes(nskey).hex()


def hex_keys(keys: Iterable[bytes]) -> List[str]:
    return [k.hex() for k in keys]


def check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"cxlalloc.kvstore: a block key is {KEY_BYTES} bytes, not {key!r:.40}")
    return bytes(key)


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
