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
fine-tune, a merged LoRA) must never share a block.  Every byte of every
parameter and buffer enters it (XXH3-128 per tensor, https://xxhash.com), and
:class:`WeightsWatch` keeps it right at each ``generate()``.  An in-place
update through ``.data`` or ``.numpy()`` moves neither the address nor
torch's version counter, so those cannot tell that weights changed; the
default mode (``"guarded"``) makes the weights' pages read-only after they
are digested and learns of any later write from the page fault
(``csrc/common/write_guard.h``), so only written tensors are digested again.
"""

from __future__ import annotations

import hashlib
import re
import json
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import xxhash

from cxlalloc.kvstore.guarded_tensors import _Guarded, _edge_digest, _guardable, _inside, _maps, _sig

KEY_BYTES = 32
VERSION = b"cxlalloc-kv/2"  # /2: blocks carry a checksum trailer (layout.py), weights digested in full

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
WEIGHT_MODES = ("guarded", "full", "sampled")
DEFAULT_WEIGHT_MODE = "guarded"
# Sampled weight digest ("sampled" mode's per-call check): per tensor, its
# first and last _EDGE elements and _POINTS evenly spaced ones.
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


def _check_mode(mode: str) -> str:
    if mode not in WEIGHT_MODES:
        raise ValueError(f"cxlalloc option 'kv_store_fingerprint': {mode!r} is not allowed; allowed: "
                         f"{', '.join(WEIGHT_MODES)}")
    return mode


# Module methods whose torch versions weight_tensors' one walk reproduces; a model class that overrides one
# (a wrapper that renames or filters its parameters) gets the two calls themselves.
_WALKS = ("named_parameters", "named_buffers", "named_modules", "_named_members")


def weight_tensors(model) -> List[tuple]:
    """``(name, tensor)`` of every parameter and buffer of ``model`` (a tied
    parameter once): everything that can enter a K/V value.  Buffers count
    too (rotary ``inv_freq``, a position table): changing one changes K/V."""
    import torch

    cls = type(model)
    if not all(getattr(cls, f, None) is getattr(torch.nn.Module, f, None) for f in _WALKS):
        out = list(model.named_parameters(remove_duplicate=True))
        out += [(f"buffer:{n}", b) for n, b in model.named_buffers(remove_duplicate=True) if b is not None]
        return out
    # The same pairs in the same order from one walk over the modules instead of two (named_parameters and
    # named_buffers each walk them; a quarter of a guarded check's time on SmolLM2-135M): torch's
    # Module._named_members, parameters first, each tensor once, None skipped.
    params, bufs, seen_p, seen_b = [], [], set(), set()
    for prefix, mod in model.named_modules():
        dot = prefix + "." if prefix else ""
        for k, v in mod._parameters.items():
            if v is not None and v not in seen_p:
                seen_p.add(v)
                params.append((dot + k, v))
        for k, v in mod._buffers.items():
            if v is not None and v not in seen_b:
                seen_b.add(v)
                bufs.append(("buffer:" + dot + k, v))
    return params + bufs


def _device_digest(flat) -> bytes:
    """A digest of a tensor's bytes computed where the tensor lives (no copy
    to the host): int64 sums of the 32-bit words, plain and weighted by
    position (an odd multiplier per position modulo 2^31-1), so a change of
    any word or a swap of two words changes it.  Used for non-CPU tensors;
    not yet run on a GPU (tests run it on CPU tensors)."""
    import torch

    raw = flat.contiguous().view(torch.uint8)
    n = raw.numel()
    pad = (-n) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    sums = []
    step = 1 << 22  # 16 MiB of words per pass: bounded temporaries
    for a in range(0, words.numel(), step):
        w = words[a:a + step].to(torch.int64)
        pos = torch.arange(a, a + w.numel(), device=w.device, dtype=torch.int64)
        mult = (pos * 2654435761 % 2147483647) | 1
        sums.append(torch.stack([w.sum(), (w * mult).sum(), (w ^ (pos << 7)).sum()]))
    total = torch.stack(sums).sum(0) if sums else torch.zeros(3, dtype=torch.int64)
    return total.cpu().numpy().astype("<i8").tobytes() + n.to_bytes(8, "little")


def _tensor_bytes(t, mode: str) -> bytes:
    """What of ``t`` enters the weights digest: for ``"full"`` the XXH3-128 of
    every byte (read in place for a CPU tensor, no copy), for ``"sampled"``
    the sampled elements' bytes."""
    import torch

    flat = t.detach().reshape(-1)
    n = flat.numel()
    if mode == "full":
        if flat.device.type != "cpu":
            return _device_digest(flat)
        raw = flat.contiguous().view(torch.uint8) if flat.element_size() else flat.new_zeros(0, dtype=torch.uint8)
        return xxhash.xxh3_128_digest(memoryview(raw.numpy()))
    if n <= 2 * _EDGE + _POINTS:
        sample = flat
    else:
        # Integer spacing: a float linspace rounds past the end of large tensors.
        idx = torch.arange(_POINTS, device=flat.device, dtype=torch.long) * (n - 1) // (_POINTS - 1)
        sample = torch.cat([flat[:_EDGE], flat.index_select(0, idx), flat[-_EDGE:]])
    sample = sample.cpu().contiguous()
    return sample.view(torch.uint8).numpy().tobytes() if sample.element_size() else b""


def weights_digest(model, mode: str = DEFAULT_WEIGHT_MODE) -> bytes:
    """Digest of the model's parameters and buffers: names, shapes, dtypes,
    device types and values.

    Args:
        model: a ``torch.nn.Module``.
        mode: ``"full"`` (every byte of every tensor, XXH3-128 per tensor:
            one read of the weights; measured 205 ms for SmolLM2-135M in
            bf16, 466 ms in fp32, 1.2-1.3 GB/s on the shared 2-core CPU) or
            ``"sampled"`` (first/last 256 and 64 evenly spaced elements of
            each tensor: ~1 ms; blind to a change confined to other elements).

    Returns:
        32 bytes.

    Raises:
        ValueError: an unknown ``mode``.
    """
    _check_mode(mode)
    if mode == "guarded":  # the same bytes as "full" (the mode differs in how often they are read)
        mode = "full"
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(mode.encode())
    for name, p in weight_tensors(model):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.device.type}\n".encode())
        if p.numel() and p.device.type != "meta":
            h.update(_tensor_bytes(p, mode))
    return h.digest()


def weights_version(model) -> tuple:
    """A cheap token that changes when a parameter or buffer is replaced,
    moved (its storage address) or modified in place through autograd's view
    of it (torch's version counter).  Not complete: a write through
    ``.data``, ``.numpy()`` or another alias with its own counter moves
    neither (see :class:`WeightsWatch`)."""
    return tuple((t.data_ptr(), t._version, t.dtype) for _, t in weight_tensors(model))


def model_fingerprint(model, weights: str = DEFAULT_WEIGHT_MODE, digest: Optional[bytes] = None) -> bytes:
    """The identity of the model that computes a K/V: 32 bytes.

    Covers ``type(model).__name__``, ``config.model_type``, the config without
    paths, versions and run-time switches (see ``_CONFIG_IGNORED``), the
    parameters' dtype, and :func:`weights_digest` (``digest`` when the caller
    computed it already).  Loading the same checkpoint from another path,
    another process or another machine gives the same fingerprint; another
    dtype, config or weights gives another.

    Raises:
        ValueError: an unknown ``weights`` mode.
    """
    config = getattr(model, "config", None)
    arch = type(model).__name__
    model_type = str(getattr(config, "model_type", ""))
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    cfg = _config_text(config) if config is not None else ""
    if digest is None:
        digest = weights_digest(model, weights)
    return _h(b"model", arch.encode(), model_type.encode(), ",".join(dtypes).encode(), cfg.encode(), digest)


def _combine(entries: Sequence[Tuple[str, object, bytes]]) -> bytes:
    """:func:`weights_digest` ("full") from each tensor's ``(name, tensor, its XXH3-128 or b"")``."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(b"full")
    for name, p, d in entries:
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.device.type}\n".encode())
        h.update(d)
    return h.digest()


class WeightsWatch:
    """The model fingerprint kept right across in-place weight updates.

    ``"guarded"`` (default): the first call digests every byte (as ``"full"``)
    and then makes the pages of each CPU tensor read-only
    (``csrc/common/write_guard.h``).  Any later user-space write into them —
    ``.data``, ``.numpy()``, ``copy_``, ``load_state_dict``, a merged LoRA,
    an optimizer step, ctypes — faults once; the handler marks that tensor
    written and lets the write go on.  A call then digests again only the
    tensors written, replaced, moved or re-versioned since, plus the few
    bytes at each tensor's ends that share a page with other memory: a cost
    set by the number of tensors, not their bytes, while weights do not
    change.  Tensors it cannot guard are digested in full at every call, as
    ``"full"``: non-CPU tensors (a GPU's weights: the on-device digest),
    pinned memory (a device may write it by DMA), shared mappings (another
    process may write them), non-contiguous ones.  If another SIGSEGV handler
    replaced the guard's, the next call digests everything again.  What it
    cannot see (as no check but a full read can): a write by a debugger
    (``ptrace``); a kernel write (``read(2)`` into the weights) fails with
    ``EFAULT`` instead while guarded.

    ``"full"``: every :meth:`fingerprint` call digests every byte of
    every parameter and buffer (:func:`weights_digest`), so no update escapes
    it, whatever wrote the bytes.  Cost: one read of the weights per check
    (measured in docs/huggingface.md).

    ``"sampled"``: the full digest is made at the first call and again
    whenever the cheap per-call check changes: :func:`weights_version`
    (addresses, version counters, dtypes) plus the sampled digest.  About a
    millisecond, but a write through ``.data`` or ``.numpy()`` confined to
    elements outside the sample goes unseen (a wrong answer), so it is for
    models whose weights never change in place.

    The three give the same fingerprint for the same weights.

    Raises:
        ValueError: an unknown ``mode`` (naming ``kv_store_fingerprint``).
    """

    def __init__(self, model, mode: str = DEFAULT_WEIGHT_MODE):
        self.model = model
        self.mode = _check_mode(mode)
        self._check = None
        self._digest: Optional[bytes] = None
        self._fingerprint: Optional[bytes] = None
        self.recomputed = 0  # how many times the fingerprint changed after the first
        self._guarded: Dict[str, _Guarded] = {}
        self._combined: Tuple[tuple, bytes] = ((), b"")  # the last check's tensor names and digest
        self._lock = threading.Lock()
        # Per check (guarded mode): tensors digested in full, bytes digested, guarded tensors.
        self.last_check = {"digested_tensors": 0, "digested_bytes": 0, "guarded_tensors": 0}
        self._C = None
        if self.mode == "guarded":
            try:
                from cxlalloc import _C

                self._C = _C if _C.guard_install_handler() else None
            except (ImportError, AttributeError):
                self._C = None

    def fingerprint(self) -> bytes:
        """The current fingerprint (32 bytes)."""
        if self.mode == "full":
            digest = weights_digest(self.model, "full")
        elif self.mode == "guarded":
            with self._lock:
                digest = self._guarded_digest()
        else:
            check = (weights_version(self.model), weights_digest(self.model, "sampled"))
            if check == self._check and self._digest is not None:
                return self._fingerprint
            self._check = check
            digest = weights_digest(self.model, "full")
        if digest != self._digest:
            if self._digest is not None:
                self.recomputed += 1
            self._digest = digest
            self._fingerprint = model_fingerprint(self.model, digest=digest)
        return self._fingerprint

    def _guarded_digest(self) -> bytes:
        C = self._C
        if C is not None and not C.guard_handler_installed():
            # Another library replaced the handler: a write since may not have been seen.  Start over.
            self.close()
            C.guard_install_handler()
        if C is not None and self._guarded:
            # A guarded range must still be read-only (a remap of its address, e.g. by a driver, gives pages
            # without the guard, and writes to them would not fault): those count as written.
            C.guard_verify()
        maps: list = []  # /proc/self/maps, read once per check and only when a tensor is (re)guarded
        out, seen = [], set()
        digested = nbytes = guarded = 0
        for name, t in weight_tensors(self.model):
            seen.add(name)
            if not t.numel() or t.device.type == "meta":
                out.append((name, t, b""))
                digested += 1  # nothing to read, but its shape enters the digest: combine again
                continue
            e = self._guarded.get(name)
            sig = _sig(t)
            if e is not None and e.sig == sig and (e.slot is None or not C.guard_written(e.slot)):
                if _edge_digest(e.edges) == e.edge_digest:  # unchanged: its bytes are known
                    out.append((name, t, e.digest))
                    guarded += 1
                    nbytes += sum(n for _, n in e.edges)
                    continue
            if e is not None:
                e.release(C)
                del self._guarded[name]
            e = self._guard(t, sig, C, maps)
            digested += 1
            nbytes += t.numel() * t.element_size()
            if e.edges is not None:
                self._guarded[name] = e
                guarded += 1
            out.append((name, t, e.digest))
        for name in [n for n in self._guarded if n not in seen]:
            self._guarded.pop(name).release(C)
        self.last_check = {"digested_tensors": digested, "digested_bytes": nbytes, "guarded_tensors": guarded}
        names = tuple(n for n, _, _ in out)
        if digested or names != self._combined[0]:  # else: the same tensors (signatures checked), same bytes
            self._combined = (names, _combine(out))
        return self._combined[1]

    def _guard(self, t, sig, C, maps: list) -> _Guarded:
        """Guard ``t``'s interior pages (when it can be guarded), then digest it: a write after the guard
        is seen, whether it comes before or during the digest.  ``edges`` None: not guardable (digested
        in full at every check)."""
        slot = edges = ed = None
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if C is not None and _guardable(t):
            ptr, n = t.data_ptr(), t.numel() * t.element_size()
            ps = C.guard_page_size()
            lo, hi = -(-ptr // ps) * ps, (ptr + n) // ps * ps
            edges = [(ptr, n)]  # too small for a whole page: all its bytes at every check
            if hi > lo:
                if not maps:
                    maps.append(_maps())
                if _inside(maps[0], lo, hi, "rw"):
                    slot = C.guard_protect(lo, hi - lo)
                    edges = [(ptr, lo - ptr), (hi, ptr + n - hi)]
                else:  # e.g. shared memory another process may write: every byte at every check
                    edges = None
        d = _tensor_bytes(t, "full")
        if edges is not None:
            ed = _edge_digest(edges)
        return _Guarded(sig, storage, base, d, slot, edges, ed)

    def close(self) -> None:
        """Make every guarded page writable again and forget it (``cxlalloc.hf.unwrap`` calls it)."""
        for e in self._guarded.values():
            e.release(self._C)
        self._guarded = {}
        self._combined = ((), b"")

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def with_state(fingerprint: bytes, state: bytes) -> bytes:
    """The fingerprint of weights ``fingerprint`` under module state ``state`` (the digest of everything
    besides the weights that enters the forward: ``cxlalloc.hf.forward_state``), 32 bytes."""
    return _h(b"state", bytes(fingerprint), bytes(state))


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


TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a tenant's name (``--tenant``, ``?tenant=``)


def check_tenant(name: str, option: str) -> str:
    """``name`` if it is a tenant name (1-64 of ``A-Z a-z 0-9 _ . -``), else ValueError naming ``option``."""
    if not isinstance(name, str) or not TENANT_NAME.match(name):
        raise ValueError(f"cxlalloc option '{option}': {name!r} is not a tenant name (1-64 characters of "
                         "A-Z a-z 0-9 _ . -)")
    return name


#: The tenant part of the names of blocks in a namespace the operator shares
#: between tenants (``--shared-namespace``): not a valid tenant name, so no tenant's own names collide.
SHARED_TENANT = "*shared*"


def _ns_parts(ns: str, tenant: str) -> tuple:
    # The default tenant keeps the names of before (a single-tenant deployment's
    # Redis values stay readable); a named tenant has a domain of its own.
    if not tenant:
        return (b"cxlalloc-kv-ns/1", (ns or "").encode())
    return (b"cxlalloc-kv-tenant/1", tenant.encode(), (ns or "").encode())


def namespaced_key(ns: str, key: bytes, tenant: str = "") -> bytes:
    """The 32-byte name of block ``key`` in namespace ``ns`` of ``tenant``:
    ``H("cxlalloc-kv-ns/1" | ns | key)`` for the default tenant ``""``,
    ``H("cxlalloc-kv-tenant/1" | tenant | ns | key)`` for a named one
    (BLAKE2b-256, length-prefixed parts).

    The kv-server indexes blocks by it and the Redis tier names values by it
    (:func:`redis_key`) and MACs them over it, so a namespace of a tenant can
    only ever reach its own blocks."""
    return _h(*_ns_parts(ns, tenant), bytes(key))


def namespaced_keys(ns: str, keys, tenant: str = "") -> list:
    """``[namespaced_key(ns, k, tenant) for k in keys]`` with the namespace's part
    hashed once (a copy of that hash state per key): the same names, a
    request of many keys without re-hashing the prefix for each."""
    h0 = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in _ns_parts(ns, tenant):
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


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
