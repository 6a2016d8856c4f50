"""KV that outlives a request: prefix and session reuse for a wrapped ``generate()``.

With ``cxlalloc.hf.wrap(model, kv_store=...)`` every ``generate()`` call

1. looks up, for each prompt row, the longest stored block-aligned prefix of its
   tokens (:mod:`cxlalloc.kvstore.keys`: chained keys that include the model's
   fingerprint and the namespace ``cache_salt``), keeping at least the last
   prompt token to prefill (its logits start decoding);
2. builds the :class:`~cxlalloc.hf.CxlCache` with those tokens' K/V already in
   place: loaded in bulk from the store into the KV extent, whose chunks the
   KV policy places (VRAM while it has room, the host tier otherwise) — one
   contiguous copy per block for a batch-1 cache;
3. lets transformers prefill only the rest (``generate()``'s own
   restart-from-cache path: it slices the prompt by ``cache.get_seq_length()``);
4. after the call, stores the full blocks of the prompt and of the generated
   tokens (up to each row's first EOS), so the next turn of a chat — whose
   prompt contains this answer — hits too.
5. keeps a batch-1 call's cache as the "last conversation" (bounded by
   ``kv_conversation_limit`` bytes): the next call whose prompt starts with
   the tokens that cache holds continues it (cropped to the shared tokens,
   no copy), so a chat turn prefills only its new tokens, the last partial
   block of the previous turn included (``conversation_hits``).

What each generation mode reuses and stores:

* greedy, sampling, assisted decoding, ``num_return_sequences``: each row's
  prompt and generated tokens (rows with the same prompt share blocks);
* beam search: the prompt only ("store before the beams fork": the beams'
  final cache rows are not the returned sequences);
* a batch: each row is looked up; the cache is one length ``C`` for all rows,
  so a row reuses ``C - pad`` of its hit tokens, where ``C`` is the smallest
  ``pad + hit`` over the rows (left padding ``pad``; the pad positions get zero
  K/V, which the attention mask hides).  A right-padded or otherwise
  non-left-padded batch reuses nothing (counted as ``skipped``);
* a cache passed in by the caller, ``use_cache=False``, a
  static/quantized/offloaded cache: no lookup and no store (counted);
* ``inputs_embeds`` or any other tensor argument that can change K/V for the
  same ids (``pixel_values``, ``position_ids``, ``cache_position``,
  ``token_type_ids``, a 4-D attention mask): no lookup and no store
  (``skipped_inputs``; a warning naming the argument, once);
* per call: ``generate(..., cache_salt="tenant")`` overrides the namespace and
  ``generate(..., kv_reuse=False)`` turns reuse off for that call.

Correctness: the fingerprint digests every weight byte at each call (no
in-place update gives a stale hit; :class:`~cxlalloc.kvstore.keys.WeightsWatch`);
every loaded block's checksum is checked (``kv_store_verify``), a corrupt one
is dropped and recomputed (``corrupt_blocks``).  A load that fails (out of memory, a block whose size does not
match) empties the cache and the call recomputes the whole prompt, counted in
``load_failures``; a hit is never partially applied.  K/V of generated tokens
were computed one token at a time; a later prefill of the same tokens computes
them in one matrix product, which may differ in the last bits (floating point),
so a hit on generated tokens can change logits slightly against a full
recompute (the tests measure the largest difference).

Which models: every cache layer must be a full-attention :class:`CxlKVLayer`
(per-token K/V in cxlalloc).  Sliding-window, linear-attention/SSM and other
layer kinds keep state that is not a per-token K/V of the whole prefix; for such
a model reuse is off and :func:`cxlalloc.hf.wrap` says so once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import Any, Dict, List, Optional

import torch

from cxlalloc.config import make_config, parse_env, parse_size
from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.layers import STOCK_KIND, CxlKVLayer
from cxlalloc.kvstore import keys as kvkeys
from cxlalloc.kvstore.layout import BlockLayout, check_block_tokens
from cxlalloc.kvstore.open import open_store
from cxlalloc.kvstore.store import BlockStore

DEFAULT_BLOCK_TOKENS = 64
DEFAULT_CONVERSATION_LIMIT = 256 << 20   # bytes of KV the "last conversation" cache may keep (kv_conversation_limit)
REUSE_OPTIONS = ("kv_store", "kv_store_limit", "block_tokens", "cache_salt", "kv_store_fingerprint",
                 "kv_store_verify", "kv_conversation_limit")
# generate() arguments that never change a K/V value beyond what the block key covers (the token ids; a 2-D
# attention mask is checked to be left padding).  Any other tensor argument (inputs_embeds, pixel_values,
# position_ids, cache_position, token_type_ids, a 4-D mask, ...) may change K/V for the same ids: no lookup,
# no store for that call, said once per argument name.
_KEYED_INPUTS = frozenset({"input_ids", "inputs", "attention_mask"})


class KVReuseWarning(UserWarning):
    """KV reuse cannot apply to this model or call (said once per model/reason)."""


@dataclasses.dataclass(frozen=True)
class ReuseOptions:
    """The KV reuse options of :func:`cxlalloc.hf.wrap` (validated)."""

    kv_store: Any
    kv_store_limit: Any = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    cache_salt: Optional[str] = None
    kv_store_fingerprint: str = kvkeys.DEFAULT_WEIGHT_MODE
    kv_store_verify: bool = True
    kv_conversation_limit: int = DEFAULT_CONVERSATION_LIMIT


def parse_reuse_options(options: dict) -> Optional[ReuseOptions]:
    """Pop the reuse options out of ``options`` (wrap()'s keyword arguments).

    Returns None when ``kv_store`` is absent, None or False (reuse off).

    Raises:
        ValueError: a bad value, naming the option and its allowed values; or a
            reuse option given without ``kv_store``.
    """
    got = {k: options.pop(k) for k in REUSE_OPTIONS if k in options}
    if "kv_store" not in got:  # CXLALLOC=kv_store:unix:///run/cxlalloc/kv.sock (one setting for every process)
        env = _env_kv_store()
        if env is not None:
            got["kv_store"] = env
    store = got.get("kv_store")
    if store is None or store is False:
        extra = [k for k, v in got.items() if k != "kv_store" and v is not None]
        if extra:
            raise ValueError(f"cxlalloc.hf.wrap: {', '.join(extra)} given without kv_store; pass kv_store=True (or "
                             "'local', 'unix:///path/kv.sock', 'redis://host:port/db', or a store object)")
        return None
    bt = got.get("block_tokens")
    bt = DEFAULT_BLOCK_TOKENS if bt is None else check_block_tokens(bt)
    salt = got.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cxlalloc option 'cache_salt': {salt!r} is not a string (a namespace such as a tenant id)")
    fp = got.get("kv_store_fingerprint")
    fp = kvkeys.DEFAULT_WEIGHT_MODE if fp is None else fp
    if fp not in kvkeys.WEIGHT_MODES:
        raise ValueError(f"cxlalloc option 'kv_store_fingerprint': {fp!r} is not allowed; allowed: "
                         f"{', '.join(kvkeys.WEIGHT_MODES)}")
    verify = got.get("kv_store_verify")
    verify = True if verify is None else verify
    if not isinstance(verify, bool):
        raise ValueError(f"cxlalloc option 'kv_store_verify': {verify!r} is not allowed; allowed: True, False "
                         "(check each loaded block's checksum)")
    conv = got.get("kv_conversation_limit")
    conv = DEFAULT_CONVERSATION_LIMIT if conv is None else parse_size(conv, "kv_conversation_limit")
    return ReuseOptions(kv_store=store, kv_store_limit=got.get("kv_store_limit"), block_tokens=bt, cache_salt=salt,
                        kv_store_fingerprint=fp, kv_store_verify=verify,
                        kv_conversation_limit=conv)


def _env_kv_store() -> Optional[str]:
    """The ``kv_store`` key of the CXLALLOC environment variable, or None
    (an invalid CXLALLOC was already reported by the start-up hook)."""
    try:
        opts = parse_env() or {}
        return make_config(kv_store=opts["kv_store"]).kv_store if "kv_store" in opts else None
    except ValueError:
        return None


# Where reused tokens came from, end to end (``tiers`` in the counters and in each CallRecord):
#   vram_prefix  the model's own kept cache (the previous turn of a conversation): nothing copied
#   host         an in-process store's host/CXL memory (kv_store=True / "local", the store of "redis://...")
#   pool         a kv-server's pool (kv_store="unix://...")
#   remote       the Redis/Valkey tier below either (one server or a Cluster), restored on a miss
#   store        a store object that does not say (a user's BlockStore)
TIERS = ("vram_prefix", "host", "pool", "remote", "store")


def _tier_counts() -> Dict[str, Dict[str, int]]:
    return {t: {"blocks": 0, "tokens": 0, "bytes": 0} for t in TIERS}


@dataclasses.dataclass
class CallRecord:
    """What one generate() call reused and stored (``hf.stats(model)["hf"]["reuse"]["last"]``)."""

    rows: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0          # cache positions filled from the store (the cache length C before prefill)
    reused_tokens: int = 0       # real tokens loaded, summed over the cache's rows
    row_hit_tokens: List[int] = dataclasses.field(default_factory=list)  # per prompt row, before the batch min
    bytes_loaded: int = 0
    load_ms: float = 0.0
    stored_blocks: int = 0
    bytes_stored: int = 0
    store_ms: float = 0.0
    skipped: Optional[str] = None   # why no lookup was made
    fallback: Optional[str] = None  # why a load failed (then the prompt was recomputed)
    namespace: Optional[str] = None
    conversation: bool = False      # the hit came from the previous turn's cache (sub-block reuse)
    # {tier: {"blocks", "tokens", "bytes"}} of this call's reused tokens (TIERS; tokens sum to reused_tokens)
    tiers: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Conversation:
    """The last conversation's cache, kept after its generate() returned (one per wrapped model).

    ``ids`` (1-D int64, CPU) are the tokens whose K/V the cache holds, in
    order (the prompt and the answer but its last token, which no forward
    fed); ``root`` is the block-key root of that call (fingerprint, layout,
    block size, namespace), so changed weights or another namespace never
    continue it; ``nbytes`` the KV storage it holds (committed bytes, both tiers)."""

    cache: CxlCache
    ids: torch.Tensor
    root: bytes
    salt: Optional[str]
    nbytes: int


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens ``a`` (1-D) and ``b`` (1-D) share from their start (0 if none)."""
    n = min(int(a.numel()), int(b.numel()))
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


def _has_tensor(v) -> bool:
    if torch.is_tensor(v):
        return True
    if isinstance(v, (list, tuple)):
        return any(torch.is_tensor(x) for x in v)
    if isinstance(v, dict):
        return any(torch.is_tensor(x) for x in v.values())
    return False


def _unkeyed_inputs(kwargs: dict, cache_kw: str) -> List[str]:
    """generate() arguments of this call that may change K/V without
    changing the token ids: every tensor argument but the ids and a 2-D
    attention mask (a 4-D mask is a custom attention pattern)."""
    out = []
    for name, v in kwargs.items():
        if name in (cache_kw, "past_key_values", "cache") or not _has_tensor(v):
            continue
        if name in _KEYED_INPUTS and not (name == "attention_mask" and torch.is_tensor(v) and v.dim() != 2):
            continue
        out.append(name)
    return sorted(out)


class _Call:
    """Per-call state between the generate() wrapper and the cache hook."""

    def __init__(self, input_ids, attention_mask, salt, enabled):
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.salt = salt
        self.enabled = enabled
        self.cache: Optional[CxlCache] = None
        self.conversation_ok = True     # this call may take and leave a "last conversation" cache
        self.expand = 1
        self.beam = False
        self.eos: List[int] = []
        self.pads: List[int] = []
        self.fp: Optional[bytes] = None  # the fingerprint at the start of the call (K/V computed by those weights)
        self.record = CallRecord()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class PrefixReuse:
    """The reuse state of one wrapped model: its store, fingerprint, layout and counters.

    Args:
        model: the wrapped model.
        allocator: its :class:`cxlalloc.Allocator` (the store's node and device).
        opts: :class:`ReuseOptions`.
        cache_kw: the forward() keyword of the cache (``cache``/``past_key_values``).

    Raises:
        ValueError: a store smaller than one block (names ``kv_store_limit``),
            or a bad store spec.
    """

    def __init__(self, model, allocator, opts: ReuseOptions, cache_kw: str):
        self.model = model
        self.allocator = allocator
        self.opts = opts
        self.cache_kw = cache_kw
        self.store: BlockStore = open_store(opts.kv_store, allocator, limit=opts.kv_store_limit)
        self.block_tokens = opts.block_tokens
        self.layout: Optional[BlockLayout] = None
        self.off_reason: Optional[str] = None
        self._weights = kvkeys.WeightsWatch(model, opts.kv_store_fingerprint)
        self._fingerprint: Optional[bytes] = None
        self._roots = {}
        self._warned_inputs = set()
        self._warned_corrupt = False
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.counters = {"calls": 0, "calls_with_hit": 0, "hit_tokens": 0, "prompt_tokens": 0, "stored_blocks": 0,
                         "skipped_calls": 0, "load_failures": 0, "skipped_inputs": 0, "corrupt_blocks": 0,
                         "fingerprint_changes": 0, "fingerprint_ms": 0.0, "conversation_hits": 0,
                         "conversation_hit_tokens": 0, "conversation_kept": 0, "conversation_too_large": 0,
                         "conversation_dropped": 0, "tiers": _tier_counts()}
        self._conv: Optional[_Conversation] = None   # the "last conversation" cache (sub-block reuse)
        self.last: Optional[CallRecord] = None
        self._probe()

    # ------------------------------------------------------------ model facts
    def _probe(self) -> None:
        """Learn the cache layout with one 1-token forward (the geometry of each
        full-attention layer, and whether any layer is of another kind)."""
        model = self.model
        if getattr(model.config, "is_encoder_decoder", False):
            # A prompt's KV there depends on the encoder input too, which a block key does not cover.
            self.off_reason = (f"prefix reuse stores decoder-only caches; {type(model).__name__} is an "
                               f"encoder-decoder model")
            warnings.warn(f"cxlalloc.hf.wrap: kv_store: {self.off_reason}; KV reuse is off for this model "
                          "(generate() works as without kv_store)", KVReuseWarning, stacklevel=4)
            return
        device = next(p.device for p in model.parameters())
        cache = CxlCache(config=model.config.get_text_config(decoder=True), allocator=self.allocator, max_cache_len=1)
        try:
            with torch.no_grad():
                model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True,
                      **{self.cache_kw: cache})
            layers = list(cache.layers)
            # Exactly CxlKVLayer: a tiered layer of another kind (sliding window, indexer keys, SSM state)
            # holds what a stored block does not, and a hit would serve wrong tokens.
            others = sorted({STOCK_KIND.get(type(layer), type(layer).__name__)
                             for layer in layers if type(layer) is not CxlKVLayer})
            kv = [layer for layer in layers if type(layer) is CxlKVLayer]
            if others or not kv:
                what = ", ".join(others) if others else "no cache layers"
                self.off_reason = (f"prefix reuse needs every cache layer to be full attention with its K/V in "
                                   f"cxlalloc (a stored block holds only those); {type(model).__name__} has {what}")
                warnings.warn(f"cxlalloc.hf.wrap: kv_store: {self.off_reason}; KV reuse is off for this model "
                              "(generate() works as without kv_store)", KVReuseWarning, stacklevel=4)
                return
            slots = []
            for layer in kv:
                g = layer._store.g
                slots.append((g.heads, g.k_dim, g.v_dim))
            self.layout = BlockLayout(self.block_tokens, kv[0]._store.g.dtype, tuple(slots))
            self._dtypes = [layer._store.g.dtype for layer in kv]
        finally:
            cache.release()
        self.store.check_block_bytes(self.layout.stored_bytes)

    def fingerprint(self) -> bytes:
        """The model fingerprint, checked at each call (:class:`~cxlalloc.kvstore.keys.WeightsWatch`:
        by default a digest of every byte of every parameter and buffer, so no in-place update
        escapes it); counts ``fingerprint_changes`` and ``fingerprint_ms``."""
        t0 = time.perf_counter()
        fp = self._weights.fingerprint()
        dt = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self.counters["fingerprint_ms"] += dt
            if fp != self._fingerprint:
                if self._fingerprint is not None:
                    self.counters["fingerprint_changes"] += 1
                self._fingerprint = fp
                self._roots = {}
        return fp

    def root(self, salt: Optional[str], fp: Optional[bytes] = None) -> bytes:
        """The chain root of namespace ``salt`` for fingerprint ``fp`` (the current one when None)."""
        fp = self.fingerprint() if fp is None else fp
        if fp != self._fingerprint:
            return kvkeys.root_key(fp, self.layout.signature(), self.block_tokens, salt)
        r = self._roots.get(salt)
        if r is None:
            r = self._roots[salt] = kvkeys.root_key(fp, self.layout.signature(), self.block_tokens, salt)
        return r

    # ------------------------------------------------------------ per call
    def begin(self, args, kwargs) -> None:
        """Called by the generate() wrapper before transformers' generate():
        pops ``cache_salt``/``kv_reuse`` from ``kwargs`` and remembers the
        prompt for the cache hook."""
        salt = kwargs.pop("cache_salt", self.opts.cache_salt)
        enabled = kwargs.pop("kv_reuse", True)
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cxlalloc: generate(cache_salt=...): {salt!r} is not a string")
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs", args[0] if args else None)
        call = _Call(ids, kwargs.get("attention_mask"), salt, bool(enabled) and self.layout is not None)
        call.record.namespace = salt
        # Assisted / prompt-lookup decoding crops and rolls the cache back with candidates: its final cache
        # is not kept for the next turn (the block store still serves the call).
        call.conversation_ok = (kwargs.get("assistant_model") is None and not kwargs.get("prompt_lookup_num_tokens")
                                and self.opts.kv_conversation_limit > 0)
        if ids is None or not torch.is_tensor(ids) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
            call.enabled = False
            call.record.skipped = "no input_ids tensor (inputs_embeds or another input)"
        unkeyed = _unkeyed_inputs(kwargs, self.cache_kw)
        if unkeyed and call.enabled and enabled:
            call.enabled = False
            call.record.skipped = (f"generate({', '.join(unkeyed)}=...) can change K/V without changing the token "
                                   "ids (the block key)")
            with self._lock:
                self.counters["skipped_inputs"] += 1
                new = [n for n in unkeyed if n not in self._warned_inputs]
                self._warned_inputs.update(new)
            if new:
                warnings.warn(f"cxlalloc.hf: kv_store: generate({', '.join(new)}=...) can change K/V without "
                              "changing the token ids, which is all a block key covers; such calls do no lookup "
                              "and no store (said once per argument)", KVReuseWarning, stacklevel=4)
        if not enabled:
            call.record.skipped = "kv_reuse=False"
        elif self.layout is None:
            call.record.skipped = self.off_reason
        stack = getattr(self._tls, "calls", None)
        if stack is None:
            stack = self._tls.calls = []
        stack.append(call)

    def skip(self, reason: str) -> None:
        """This call does no lookup and no store (``reason`` is recorded)."""
        call = self._current()
        if call is not None and call.cache is None:
            call.enabled = False
            call.record.skipped = call.record.skipped or reason

    def _current(self) -> Optional[_Call]:
        stack = getattr(self._tls, "calls", None)
        return stack[-1] if stack else None

    def load(self, cache: CxlCache, generation_config, batch_size: int,
             max_cache_len: Optional[int] = None) -> Optional[CxlCache]:
        """Called by the cache hook with the fresh cache of this call: load the
        hit into it (or leave it empty).

        Returns None, or the cache to use instead of ``cache`` (the caller
        releases ``cache``): the previous turn's cache, cropped to the tokens
        this prompt shares with it and reserved for ``max_cache_len`` tokens,
        when the same conversation continues (batch 1, no padding, one
        sequence; :meth:`_continue_conversation`)."""
        call = self._current()
        if call is None or call.cache is not None:
            return None
        call.cache = cache
        expand = max(int(getattr(generation_config, "num_beams", 1) or 1),
                     int(getattr(generation_config, "num_return_sequences", 1) or 1))
        call.expand = expand
        call.beam = int(getattr(generation_config, "num_beams", 1) or 1) > 1
        eos = getattr(generation_config, "eos_token_id", None)
        call.eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        if not call.enabled:
            return
        ids = call.input_ids.detach().to("cpu", torch.long)
        rec = call.record
        rec.rows, rec.prompt_tokens = int(ids.shape[0]), int(ids.shape[1])
        if ids.shape[0] != batch_size:
            call.enabled = False
            rec.skipped = f"the prompt has {ids.shape[0]} rows but generate() prepared {batch_size}"
            return
        pads = self._left_pads(call.attention_mask, ids.shape)
        if pads is None:
            call.enabled = False
            rec.skipped = "the attention mask is not left padding"
            return
        call.pads = pads
        conv_hit = 0
        if call.conversation_ok and expand == 1 and not call.beam and pads == [0] and ids.shape[0] == 1:
            conv_hit = self._conversation_hit(call, ids[0])
        L, bt = int(ids.shape[1]), self.block_tokens
        if conv_hit and conv_hit >= (L - 1) // bt * bt:  # no block lookup can beat it
            return self._continue_conversation(call, ids[0], conv_hit, max_cache_len)
        try:
            self._load(call, cache, ids, pads, expand)
        except Exception as exc:  # never a wrong token: recompute the whole prompt
            cache.reset()
            rec.fallback = f"{type(exc).__name__}: {exc}"
            rec.hit_tokens = rec.bytes_loaded = 0
            rec.tiers = {}
            with self._lock:
                self.counters["load_failures"] += 1
            self.store.record_failure()
        if conv_hit > rec.hit_tokens:  # the previous turn covers more than the stored blocks
            cache.reset()
            rec.hit_tokens = rec.reused_tokens = rec.bytes_loaded = 0
            rec.load_ms = 0.0
            rec.tiers = {}
            return self._continue_conversation(call, ids[0], conv_hit, max_cache_len)
        return None

    # ------------------------------------------------------------ the last conversation
    def _conversation_hit(self, call: _Call, tokens: torch.Tensor) -> int:
        """Tokens of ``tokens`` (this prompt, 1-D) the kept conversation holds
        (0: none kept, another namespace or weights, or no shared start); at
        most ``len(tokens) - 1``, so the last prompt token is prefilled."""
        conv = self._conv
        if conv is None or conv.salt != call.salt:
            return 0
        if conv.root != self.root(call.salt):  # the weights changed since: never continue it
            self._drop_conversation(conv)
            return 0
        return min(common_prefix(conv.ids, tokens), int(tokens.numel()) - 1)

    def _continue_conversation(self, call: _Call, tokens: torch.Tensor, hit: int,
                               max_cache_len: Optional[int]) -> Optional[CxlCache]:
        """Take the kept cache for this call, cropped to ``hit`` tokens; None
        when another thread took it first or it cannot be reused (then the
        call goes on with its own, empty or store-loaded, cache)."""
        with self._lock:
            conv, self._conv = self._conv, None
        if conv is None:
            return None
        kc = conv.cache
        try:
            held = min(layer._len for layer in kc._cxl_layers())
            if held > hit:
                kc.crop(hit - held)  # drop the tokens this prompt does not share
            if max_cache_len:
                kc.reserve(int(max_cache_len))
        except Exception as exc:  # never a wrong token: this call computes its prompt
            kc.release()
            call.record.fallback = f"conversation cache: {type(exc).__name__}: {exc}"
            return None
        call.cache = kc
        rec = call.record
        rec.hit_tokens = rec.reused_tokens = hit
        rec.conversation = True
        rec.row_hit_tokens = [hit]
        rec.tiers = {"vram_prefix": {"blocks": 0, "tokens": hit, "bytes": 0}}
        with self._lock:
            self.counters["conversation_hits"] += 1
            self.counters["conversation_hit_tokens"] += hit
        return kc

    def _keep_conversation(self, call: _Call, output) -> None:
        """After a batch-1 call: keep its cache as the last conversation (the
        one kept before is released), if it fits ``kv_conversation_limit``
        and the caller was not handed the cache (``return_dict_in_generate``
        with ``past_key_values``: it is the caller's then)."""
        cache = call.cache
        seqs = output if torch.is_tensor(output) else getattr(output, "sequences", None)
        if seqs is None or seqs.shape[0] != 1 or getattr(output, "past_key_values", None) is cache:
            return
        layers = cache._cxl_layers()
        if not layers or any(layer._store is None for layer in layers):
            return
        held = min(layer._len for layer in layers)
        if held <= 0 or seqs.shape[1] < held:
            return
        kv = cache.kv_stats()
        nbytes = int(kv.get("kv_device_bytes", 0)) + int(kv.get("kv_host_bytes", 0))
        if nbytes > self.opts.kv_conversation_limit:
            with self._lock:
                self.counters["conversation_too_large"] += 1
            return
        conv = _Conversation(cache, seqs[0, :held].detach().to("cpu", torch.long).clone(), self.root(call.salt),
                             call.salt, nbytes)
        with self._lock:
            old, self._conv = self._conv, conv
            self.counters["conversation_kept"] += 1
        if old is not None and old.cache is not cache:
            old.cache.release()

    def _drop_conversation(self, conv: Optional[_Conversation] = None) -> None:
        with self._lock:
            if self._conv is None or (conv is not None and self._conv is not conv):
                return
            conv, self._conv = self._conv, None
            self.counters["conversation_dropped"] += 1
        conv.cache.release()

    def forget_conversation(self) -> None:
        """Release the kept "last conversation" cache now (its KV memory); the
        next call starts from the block store.  ``cxlalloc.hf.forget_conversation(model)``."""
        self._drop_conversation()

    def close(self) -> None:
        """Release the kept conversation and close the store if this wrap opened
        it from a ``kv_store`` spec (a store object passed in is the caller's to
        close): a Redis tier's writer thread and connections, a kv-server
        connection.  ``cxlalloc.hf.unwrap(model)`` calls it."""
        self._drop_conversation()
        if self.store is not self.opts.kv_store:  # open_store made it (a Local/RemoteBlockStore): ours to close
            self.store.close()

    @staticmethod
    def _left_pads(mask, shape) -> Optional[List[int]]:
        if mask is None:
            return [0] * int(shape[0])
        m = mask.detach().to("cpu")
        if tuple(m.shape) != tuple(shape):
            return None
        m = m != 0
        pads = (~m).long().argmin(dim=1) if m.shape[1] else torch.zeros(m.shape[0], dtype=torch.long)
        pads = [int(p) if bool(m[r].any()) else int(shape[1]) for r, p in enumerate(pads)]
        for r, p in enumerate(pads):
            if not bool(m[r, p:].all()):
                return None
        return pads

    def _load(self, call: _Call, cache: CxlCache, ids: torch.Tensor, pads: List[int], expand: int) -> None:
        layout, bt, rec = self.layout, self.block_tokens, call.record
        call.fp = self.fingerprint()
        root = self.root(call.salt, call.fp)
        ns = call.salt or ""
        L = int(ids.shape[1])
        leases, hits, corrupt, leases_tiers = [], [], [], []
        try:
            for r in range(ids.shape[0]):
                tokens = ids[r, pads[r]:]
                max_blocks = max(0, (L - 1 - pads[r]) // bt)
                keys = kvkeys.chain_keys(root, tokens, bt, max_blocks=max_blocks)
                lease = self.store.lookup(ns, keys)
                leases.append(lease)
                leases_tiers.append(getattr(lease, "tiers", None) or [("store", lease.blocks)])
                good = lease.blocks
                for j, v in enumerate(lease.views):
                    if v.numel() != layout.stored_bytes:
                        raise ValueError(f"a stored block of {v.numel()} bytes, expected {layout.stored_bytes}")
                    if self.opts.kv_store_verify and not layout.verify(v, keys[j]):
                        # A bit flipped in the pool (another client's bug, a bad DIMM) or bytes under the
                        # wrong key: use the blocks before it, drop it, recompute from there.
                        good = j
                        corrupt.append(keys[j])
                        break
                hits.append(good * bt)
            rec.row_hit_tokens = list(hits)
            C = min(min(p + h for p, h in zip(pads, hits)), L - 1)
            if C <= 0 or not any(min(h, C - p) > 0 for p, h in zip(pads, hits)):
                return
            t0 = time.perf_counter()
            geoms = [(h, dk, dv, dt) for (h, dk, dv), dt in zip(layout.slots, self._dtypes)]
            places = cache.open_prefix(geoms, ids.shape[0] * expand, C)
            nbytes = self._copy_in(places, leases, pads, C, expand)
            device = places[0][0].g.device
            _sync(device)
            dt = time.perf_counter() - t0
        finally:
            for lease in leases:
                lease.close()
            if corrupt:
                self.drop_corrupt(ns, corrupt)
        rec.hit_tokens = C
        rec.reused_tokens = sum(max(0, min(h, C - p)) for p, h in zip(pads, hits)) * expand
        rec.bytes_loaded = nbytes
        rec.tiers = self._attribute(leases_tiers, pads, hits, C, expand, nbytes, rec.reused_tokens)
        rec.load_ms = dt * 1e3
        self.store.record_load(nbytes, dt)

    def _attribute(self, leases_tiers, pads, hits, C, expand, nbytes, reused) -> Dict[str, Dict[str, int]]:
        """{tier: {"blocks", "tokens", "bytes"}} of the tokens a load reused:
        row r uses its first ``min(hits[r], C - pads[r])`` tokens, block j of
        its lease covering tokens [j*bt, (j+1)*bt) and coming from the tier the
        lease says (in order); tokens times ``expand``; the loaded bytes split
        in proportion to the tokens."""
        bt = self.block_tokens
        out: Dict[str, Dict[str, int]] = {}
        for tiers, p, h in zip(leases_tiers, pads, hits):
            used = max(0, min(h, C - p))
            j = 0
            for tier, n in tiers:
                for _ in range(int(n)):
                    t = max(0, min(bt, used - j * bt))
                    j += 1
                    if t <= 0:
                        continue
                    d = out.setdefault(tier, {"blocks": 0, "tokens": 0, "bytes": 0})
                    d["blocks"] += expand
                    d["tokens"] += t * expand
        for d in out.values():
            d["bytes"] = int(nbytes * d["tokens"] / reused) if reused else 0
        return out

    def drop_corrupt(self, ns: str, keys: List[bytes]) -> None:
        """Count blocks whose checksum failed and ask the store to drop them
        (so this call's store step writes them again, recomputed)."""
        with self._lock:
            self.counters["corrupt_blocks"] += len(keys)
        if not self._warned_corrupt:
            self._warned_corrupt = True
            warnings.warn(f"cxlalloc.hf: kv_store: {len(keys)} stored block(s) failed their checksum on load; "
                          "they were dropped and recomputed (counted in reuse counters 'corrupt_blocks'; said "
                          "once)", KVReuseWarning, stacklevel=5)
        discard = getattr(self.store, "discard", None)
        if discard is not None:
            try:
                discard(ns, keys)
            except Exception:  # dropping is best effort: the answer is already right
                pass

    def _copy_in(self, places, leases, pads, C, expand) -> int:
        """Write the hit K/V into the cache's storage; returns bytes copied from the store."""
        layout, bt = self.layout, self.block_tokens
        stores = {id(s): s for s, _ in places}
        bulk = (len(stores) == 1 and len(leases) == 1 and expand == 1 and pads[0] == 0
                and places[0][0].g.batch == 1 and places[0][0].n_slots == len(places)
                and [slot for _, slot in places] == list(range(len(places))))
        nbytes = 0
        if bulk:  # one contiguous copy per block: the block format is a batch-1 storage row
            storage = places[0][0]
            for j, view in enumerate(leases[0].views):
                t0 = j * bt
                if t0 >= C:
                    break
                n = min(bt, C - t0)
                storage.rows(t0, t0 + n).copy_(layout.rows(view)[:n], non_blocking=True)
                nbytes += n * layout.row_bytes
            return nbytes
        for r, lease in enumerate(leases):
            pad = pads[r]
            real = max(0, C - pad)
            for e in range(r * expand, (r + 1) * expand):
                for s, (storage, slot) in enumerate(places):
                    if pad:
                        storage.key_view(slot, 0, min(pad, C))[e].zero_()
                        storage.value_view(slot, 0, min(pad, C))[e].zero_()
            for j, view in enumerate(lease.views):
                t0 = j * bt
                if t0 >= real:
                    break
                n = min(bt, real - t0)
                rows = layout.rows(view)[:n]
                for s, (storage, slot) in enumerate(places):
                    k_src = layout.key_part(rows, s).permute(1, 0, 2)   # (H, n, Dk)
                    v_src = layout.value_part(rows, s).permute(1, 0, 2)
                    a, b = pad + t0, pad + t0 + n
                    for e in range(r * expand, (r + 1) * expand):
                        storage.key_view(slot, a, b)[e].copy_(k_src, non_blocking=True)
                        storage.value_view(slot, a, b)[e].copy_(v_src, non_blocking=True)
                nbytes += n * layout.row_bytes
        return nbytes

    def finish(self, output, error: bool) -> None:
        """Called by the generate() wrapper after transformers' generate():
        store the new full blocks, update the counters."""
        stack = getattr(self._tls, "calls", None)
        call = stack.pop() if stack else None
        if call is None:
            return
        rec = call.record
        with self._lock:
            self.counters["calls"] += 1
            if rec.skipped:
                self.counters["skipped_calls"] += 1
        if call.enabled and not error and call.cache is not None:
            try:
                self._store_call(call, output)
            except Exception as exc:  # storing is best effort: the answer is already right
                rec.fallback = rec.fallback or f"store failed: {type(exc).__name__}: {exc}"
            if call.conversation_ok and call.expand == 1 and not call.beam and call.pads == [0]:
                self._keep_conversation(call, output)
        with self._lock:
            if rec.hit_tokens:
                self.counters["calls_with_hit"] += 1
            self.counters["hit_tokens"] += rec.reused_tokens
            for tier, d in rec.tiers.items():
                agg = self.counters["tiers"].setdefault(tier, {"blocks": 0, "tokens": 0, "bytes": 0})
                for k, v in d.items():
                    agg[k] += v
            self.counters["prompt_tokens"] += rec.prompt_tokens * max(1, rec.rows)
            self.counters["stored_blocks"] += rec.stored_blocks
            self.last = rec

    def _store_call(self, call: _Call, output) -> None:
        cache = call.cache
        seqs = output if torch.is_tensor(output) else getattr(output, "sequences", None)
        if seqs is None or not cache._cxl_layers():
            return
        layers = cache._cxl_layers()
        places = [(layer._store, layer._slot) for layer in layers]
        if any(s is None for s, _ in places):
            return
        cache_len = min(layer._len for layer in layers)
        batch = places[0][0].g.batch
        L = int(call.input_ids.shape[1])
        seqs = seqs.detach().to("cpu", torch.long)
        layout, bt = self.layout, self.block_tokens
        root = self.root(call.salt, call.fp)
        ns = call.salt or ""
        # (cache row, that row's token ids, tokens of it to store)
        if call.beam:  # the prompt only: beams' cache rows are not the returned sequences
            ids = call.input_ids.detach().to("cpu", torch.long)
            rows = [(g * call.expand, ids[g], min(L, cache_len)) for g in range(ids.shape[0])]
        elif seqs.shape[0] == batch:
            rows = [(r, seqs[r], cache_len) for r in range(batch)]
        else:
            rows = []
        t0 = time.perf_counter()
        stored = nbytes = 0
        seen = set()
        for r, row_ids, end in rows:
            pad = call.pads[r // call.expand]
            tokens = row_ids[pad:end]
            if call.eos and tokens.numel() > L - pad:
                gen = tokens[L - pad:]
                hit = [i for i, t in enumerate(gen.tolist()) if t in call.eos]
                if hit:
                    tokens = tokens[:L - pad + hit[0] + 1]
            keys = kvkeys.chain_keys(root, tokens, bt)
            new = [(j, k) for j, k in enumerate(keys) if k not in seen]
            seen.update(k for _, k in new)
            if not new:
                continue
            res = self.store.reserve(ns, [k for _, k in new], layout.stored_bytes, bt)
            try:
                written = []
                for (j, k), view in zip(new, res.views):
                    if view is None:
                        continue
                    self._copy_out(places, r, pad + j * bt, view)
                    written.append((k, view))
                    nbytes += layout.block_bytes
                _sync(places[0][0].g.device)
                for k, view in written:  # after the copies landed: the checksum covers the bytes readers get
                    layout.seal(view, k)
                stored += res.commit()
            finally:
                res.abort()
        dt = time.perf_counter() - t0
        call.record.stored_blocks = stored
        call.record.bytes_stored = nbytes
        call.record.store_ms = dt * 1e3
        if nbytes:
            self.store.record_store(nbytes, dt)

    def _copy_out(self, places, row: int, start: int, view: torch.Tensor) -> None:
        layout, bt = self.layout, self.block_tokens
        rows = layout.rows(view)
        storage = places[0][0]
        if (storage.g.batch == 1 and len({id(s) for s, _ in places}) == 1 and storage.n_slots == len(places)
                and [slot for _, slot in places] == list(range(len(places)))):
            rows.copy_(storage.rows(start, start + bt), non_blocking=True)
            return
        for s, (st, slot) in enumerate(places):
            layout.key_part(rows, s).copy_(st.key_view(slot, start, start + bt)[row].permute(1, 0, 2),
                                           non_blocking=True)
            layout.value_part(rows, s).copy_(st.value_view(slot, start, start + bt)[row].permute(1, 0, 2),
                                             non_blocking=True)

    # ------------------------------------------------------------ stats
    def _conversation_stats(self) -> dict:
        conv = self._conv
        return {"limit_bytes": self.opts.kv_conversation_limit, "kept": conv is not None,
                "kept_tokens": int(conv.ids.numel()) if conv is not None else 0,
                "kept_bytes": conv.nbytes if conv is not None else 0}

    def stats(self) -> dict:
        """``{"enabled", "off_reason", "block_tokens", "layout", "namespace",
        "counters" (with "tiers": {tier: {"blocks", "tokens", "bytes"}} of the
        reused tokens by where they came from: vram_prefix, host, pool, remote,
        store; see TIERS), "last" (CallRecord of the latest call), "conversation"
        (``limit_bytes``, ``kept``, ``kept_tokens``, ``kept_bytes``: the last
        conversation's cache), "store" (its stats)}``."""
        with self._lock:
            counters = dict(self.counters)
            counters["tiers"] = {t: dict(d) for t, d in self.counters["tiers"].items()}
            last = dataclasses.asdict(self.last) if self.last is not None else None
        return {
            "enabled": self.layout is not None,
            "off_reason": self.off_reason,
            "block_tokens": self.block_tokens,
            "layout": self.layout.describe() if self.layout is not None else None,
            "bytes_per_token": self.layout.row_bytes if self.layout is not None else None,
            "namespace": self.opts.cache_salt,
            "counters": counters,
            "last": last,
            "conversation": self._conversation_stats(),
            "store": self.store.stats(),
        }
