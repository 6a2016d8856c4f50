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

Correctness: the fingerprint covers every weight byte, checked at the start
and the end of each call (no in-place update gives a stale hit: by default the
weights' pages are write-guarded and only written tensors are digested again;
:class:`~cxlalloc.kvstore.keys.WeightsWatch`);
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
import os
import threading
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from cxlalloc.hf import store_io
from cxlalloc.hf.cache import CxlCache
from cxlalloc.hf.caller import user_stacklevel
from cxlalloc.hf.conversation import ConversationMixin, _Conversation
from cxlalloc.hf.forward_state import StateMemo, first_three, foreign_hooks, forward_state
from cxlalloc.hf.layers import STOCK_KIND, CxlKVLayer
from cxlalloc.hf.reuse_options import (DEFAULT_BLOCK_TOKENS, DEFAULT_CONVERSATION_LIMIT,  # noqa: F401
                                      REUSE_OPTIONS, ReuseOptions, parse_reuse_options)
from cxlalloc.hf.store_io import BlockReader, BlockWriter, copy_rows_in, copy_rows_out
from cxlalloc.kvstore import keys as kvkeys
from cxlalloc.kvstore.layout import BlockLayout
from cxlalloc.kvstore.open import open_store
from cxlalloc.kvstore.store import BlockStore

# generate() arguments that never change a K/V value beyond what the block key covers (the token ids; a 2-D
# attention mask is checked to be left padding).  Any other tensor argument (inputs_embeds, pixel_values,
# position_ids, cache_position, token_type_ids, a 4-D mask, ...) may change K/V for the same ids: no lookup,
# no store for that call, said once per argument name.
_KEYED_INPUTS = frozenset({"input_ids", "inputs", "attention_mask"})



class KVReuseWarning(UserWarning):
    """KV reuse cannot apply to this model or call (said once per model/reason)."""


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
    # {tier: {"blocks", "tokens", "bytes"}} of this call's reused tokens (store_io.TIERS; tokens sum to reused_tokens)
    tiers: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict)



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


class _CallStack(threading.local):
    """Per thread: the wrapped generate() calls in progress (innermost last)."""

    calls: Optional[List[_Call]] = None


class PrefixReuse(ConversationMixin):
    """The reuse state of one wrapped model: its store, fingerprint, layout and counters.

    Args:
        model: the wrapped model.
        allocator: its :class:`cxlalloc.Allocator` (the store's node and device).
        opts: :class:`ReuseOptions`.
        cache_kw: the forward() keyword of the cache (``cache``/``past_key_values``).
        layer_allocators: a model spread over several GPUs: the allocator of
            each decoder layer's GPU, by layer index (None: one GPU).

    Raises:
        ValueError: a store smaller than one block (names ``kv_store_limit``),
            or a bad store spec.
    """

    def __init__(self, model, allocator, opts: ReuseOptions, cache_kw: str, layer_allocators=None):
        self.model = model
        self.allocator = allocator
        # A model spread over GPUs: each layer's allocator (its GPU's); the store's host arena is the first GPU's.
        self.layer_allocators = layer_allocators
        self.opts = opts
        self.cache_kw = cache_kw
        self.store: BlockStore = open_store(opts.kv_store, allocator, limit=opts.kv_store_limit)
        self.block_tokens = opts.block_tokens
        self.layout: Optional[BlockLayout] = None
        self.off_reason: Optional[str] = None
        self._weights = kvkeys.WeightsWatch(model, opts.kv_store_fingerprint)
        self._state_memo = StateMemo()  # the module-state digest, encoded again only where state changed
        self._fingerprint: Optional[bytes] = None
        self._roots = {}
        self._warned_inputs = set()
        self._warned_corrupt = False
        self._tls = _CallStack()
        self._lock = threading.Lock()
        self.counters = {"calls": 0, "calls_with_hit": 0, "hit_tokens": 0, "prompt_tokens": 0, "stored_blocks": 0,
                         "skipped_calls": 0, "load_failures": 0, "skipped_inputs": 0, "corrupt_blocks": 0,
                         "fingerprint_changes": 0, "fingerprint_ms": 0.0, "conversation_hits": 0,
                         "conversation_hit_tokens": 0, "conversation_kept": 0, "conversation_too_large": 0,
                         "conversation_dropped": 0, "skipped_state": 0, "changed_during_call": 0,
                         "tiers": {t: {"blocks": 0, "tokens": 0, "bytes": 0} for t in store_io.TIERS}}
        self._warned_state = set()
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
                          "(generate() works as without kv_store)", KVReuseWarning, stacklevel=user_stacklevel())
            return
        device = next(p.device for p in model.parameters())
        cache = CxlCache(config=model.config.get_text_config(decoder=True), allocator=self.allocator, max_cache_len=1,
                         layer_allocators=self.layer_allocators)
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
                              "(generate() works as without kv_store)", KVReuseWarning, stacklevel=user_stacklevel())
                return
            slots = []
            for layer in kv:
                g = layer.storage.g
                slots.append((g.heads, g.k_dim, g.v_dim))
            self.layout = BlockLayout(self.block_tokens, kv[0].storage.g.dtype, tuple(slots))
            self._dtypes = [layer.storage.g.dtype for layer in kv]
        finally:
            cache.release()
        self.store.check_block_bytes(self.layout.stored_bytes)

    def fingerprint(self) -> bytes:
        """The model fingerprint, checked at the start and end of each call
        (:class:`~cxlalloc.kvstore.keys.WeightsWatch`: a digest of every byte of every parameter and
        buffer, kept by a write guard by default, so no in-place update escapes it); counts
        ``fingerprint_changes`` and ``fingerprint_ms``."""
        return self._fingerprint_why()[0]

    def _fingerprint_why(self) -> Tuple[bytes, Optional[str]]:
        """:meth:`fingerprint` and why no block may be looked up or stored under it (None: they may): a
        hook of unknown effect, or module state no digest can cover (then the fingerprint is random)."""
        t0 = time.perf_counter()
        # K/V depend on the modules' own state too (PEFT's active adapter, a norm's eps, training mode):
        # its digest joins the weights'.  Under a hook of unknown effect begin() turns the call's reuse off;
        # a random state here keeps any other path from ever matching a block computed under it.
        state, why = forward_state(self.model, self._state_memo)
        fp = kvkeys.with_state(self._weights.fingerprint(), os.urandom(16) if why else state)
        dt = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self.counters["fingerprint_ms"] += dt
            if fp != self._fingerprint:
                if self._fingerprint is not None:
                    self.counters["fingerprint_changes"] += 1
                self._fingerprint = fp
                self._roots = {}
        return fp, why

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
                              "and no store (said once per argument)", KVReuseWarning, stacklevel=user_stacklevel())
        hooks = foreign_hooks(self.model) if call.enabled and enabled else []
        if hooks:
            self._skip_for_state(call, f"forward hooks of unknown effect on K/V: {first_three(hooks)}", hooks,
                                 lambda new: "forward hooks whose effect on K/V cannot be known are installed "
                                             f"({first_three(new)}); calls do no "
                                             "lookup and no store while they are (counted in 'skipped_state'; "
                                             "said once per hook)")
        if not enabled:
            call.record.skipped = "kv_reuse=False"
        elif self.layout is None:
            call.record.skipped = self.off_reason
        stack = self._tls.calls
        if stack is None:
            stack = self._tls.calls = []
        stack.append(call)

    def _skip_for_state(self, call: _Call, skipped: str, items: List[str], warning) -> None:
        """Turn reuse off for ``call`` because of state no block key covers (a hook, undigestable module state):
        ``skipped`` in its record, counted in ``skipped_state``, and a :class:`KVReuseWarning` (``warning(new)``
        of the ``items`` not warned about before) said once per item."""
        call.enabled = False
        call.record.skipped = skipped
        with self._lock:
            self.counters["skipped_state"] += 1
            new = [i for i in items if i not in self._warned_state]
            self._warned_state.update(new)
        if new:
            warnings.warn("cxlalloc.hf: kv_store: " + warning(new), KVReuseWarning, stacklevel=user_stacklevel())

    def skip(self, reason: str) -> None:
        """This call does no lookup and no store (``reason`` is recorded)."""
        call = self._current()
        if call is not None and call.cache is None:
            call.enabled = False
            call.record.skipped = call.record.skipped or reason

    def _current(self) -> Optional[_Call]:
        stack = self._tls.calls
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
        # One fingerprint for the whole call: every lookup, the kept conversation and the stored blocks
        # use it; finish() checks it again before storing (weights changed during the call: nothing kept).
        call.fp, why = self._fingerprint_why()
        if why:  # state that enters the forward but no digest covers (hooks: begin() turned the call off)
            self._skip_for_state(call, why, [why], lambda new: f"{why}; calls do no lookup and no store while it "
                                                               "is there (counted in 'skipped_state'; said once)")
            return None
        conv_hit = 0
        if call.conversation_ok and expand == 1 and not call.beam and pads == [0] and ids.shape[0] == 1:
            conv_hit = self._conversation_hit(call, ids[0])
        L, bt = int(ids.shape[1]), self.block_tokens
        if conv_hit and conv_hit >= (L - 1) // bt * bt:  # no block lookup can beat it
            return self._continue_conversation(call, ids[0], conv_hit, max_cache_len)
        try:
            # conv_hit as the floor: stored blocks that cannot cover more than the kept conversation are not
            # copied in (they would be thrown away below; in a chat that was every turn whose new tokens
            # crossed a block boundary: a whole-prefix copy per turn, measured +0.12 s a turn on SmolLM2).
            self._load(call, cache, ids, pads, expand, floor=conv_hit)
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
    def close(self) -> None:
        """Release the kept conversation and close the store if this wrap opened
        it from a ``kv_store`` spec (a store object passed in is the caller's to
        close): a Redis tier's writer thread and connections, a kv-server
        connection.  ``cxlalloc.hf.unwrap(model)`` calls it."""
        self._drop_conversation()
        self._weights.close()  # the weights' pages writable again (the "guarded" fingerprint)
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

    def _load(self, call: _Call, cache: CxlCache, ids: torch.Tensor, pads: List[int], expand: int,
              floor: int = 0) -> None:
        """Look each prompt row up and load the hit (the cache length ``C``
        every row can use) into ``cache`` (:class:`~cxlalloc.hf.store_io.BlockReader`); nothing is
        copied when ``C`` is at most ``floor`` tokens (what the kept conversation already holds)."""
        layout, bt, rec = self.layout, self.block_tokens, call.record
        if call.fp is None:
            call.fp = self.fingerprint()
        root = self.root(call.salt, call.fp)
        L = int(ids.shape[1])
        leases, hits = [], []
        with BlockReader(self.store, call.salt or "", layout, self.opts.kv_store_verify, self.drop_corrupt) as rd:
            for r in range(ids.shape[0]):
                max_blocks = max(0, (L - 1 - pads[r]) // bt)
                lease, good = rd.lookup(kvkeys.chain_keys(root, ids[r, pads[r]:], bt, max_blocks=max_blocks))
                leases.append(lease)
                hits.append(good * bt)
            rec.row_hit_tokens = list(hits)
            C = min(min(p + h for p, h in zip(pads, hits)), L - 1)
            if C <= max(0, floor) or not any(min(h, C - p) > 0 for p, h in zip(pads, hits)):
                return

            def copy_in():
                geoms = [(h, dk, dv, dt) for (h, dk, dv), dt in zip(layout.slots, self._dtypes)]
                places = cache.open_prefix(geoms, ids.shape[0] * expand, C)
                return copy_rows_in(layout, bt, places, leases, pads, C, expand), places[0][0].g.device

            nbytes = rd.copy(copy_in)
        rec.hit_tokens = C
        rec.reused_tokens = sum(max(0, min(h, C - p)) for p, h in zip(pads, hits)) * expand
        rec.bytes_loaded = nbytes
        rec.tiers = store_io.attribute(leases, pads, hits, C, expand, bt, nbytes, rec.reused_tokens)
        rec.load_ms = rd.seconds * 1e3
        rd.record(nbytes)

    def drop_corrupt(self, ns: str, keys: List[bytes]) -> None:
        """Count blocks whose checksum failed and ask the store to drop them
        (so this call's store step writes them again, recomputed)."""
        with self._lock:
            self.counters["corrupt_blocks"] += len(keys)
        if not self._warned_corrupt:
            self._warned_corrupt = True
            warnings.warn(f"cxlalloc.hf: kv_store: {len(keys)} stored block(s) failed their checksum on load; "
                          "they were dropped and recomputed (counted in reuse counters 'corrupt_blocks'; said "
                          "once)", KVReuseWarning, stacklevel=user_stacklevel())
        store_io.discard(self.store, ns, keys)

    def finish(self, output, error: bool) -> None:
        """Called by the generate() wrapper after transformers' generate():
        store the new full blocks, update the counters."""
        stack = self._tls.calls
        call = stack.pop() if stack else None
        if call is None:
            return
        rec = call.record
        with self._lock:
            self.counters["calls"] += 1
            if rec.skipped:
                self.counters["skipped_calls"] += 1
        if call.enabled and not error and call.cache is not None and call.fp is not None \
                and self.fingerprint() != call.fp:
            # The weights (or module state) changed while generate() ran: its K/V mix two models.
            call.enabled = False
            rec.skipped = "the weights or module state changed during the call (nothing stored or kept)"
            with self._lock:
                self.counters["changed_during_call"] += 1
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
            store_io.add_tiers(self.counters["tiers"], rec.tiers)
            self.counters["prompt_tokens"] += rec.prompt_tokens * max(1, rec.rows)
            self.counters["stored_blocks"] += rec.stored_blocks
            self.last = rec

    def _store_call(self, call: _Call, output) -> None:
        """Store the full blocks of each row's tokens (prompt and answer up to
        its first EOS; the prompt only for beam search) that the cache holds
        (:class:`~cxlalloc.hf.store_io.BlockWriter`)."""
        cache = call.cache
        seqs = output if torch.is_tensor(output) else getattr(output, "sequences", None)
        places = cache.kv_places()
        if seqs is None or places is None:
            return
        cache_len = cache.held_tokens()
        batch = places[0][0].g.batch
        L = int(call.input_ids.shape[1])
        seqs = seqs.detach().to("cpu", torch.long)
        bt = self.block_tokens
        root = self.root(call.salt, call.fp)
        # (cache row, that row's token ids, tokens of it to store)
        if call.beam:  # the prompt only: beams' cache rows are not the returned sequences
            ids = call.input_ids.detach().to("cpu", torch.long)
            rows = [(g * call.expand, ids[g], min(L, cache_len)) for g in range(ids.shape[0])]
        elif seqs.shape[0] == batch:
            rows = [(r, seqs[r], cache_len) for r in range(batch)]
        else:
            rows = []
        writer = BlockWriter(self.store, call.salt or "", self.layout, bt)
        seen = set()
        for r, row_ids, end in rows:
            pad = call.pads[r // call.expand]
            tokens = row_ids[pad:end]
            if call.eos and tokens.numel() > L - pad:
                hit = [i for i, t in enumerate(tokens[L - pad:].tolist()) if t in call.eos]
                if hit:
                    tokens = tokens[:L - pad + hit[0] + 1]
            new = [(j, k) for j, k in enumerate(kvkeys.chain_keys(root, tokens, bt)) if k not in seen]
            seen.update(k for _, k in new)
            if new:
                writer.write([k for _, k in new],
                             lambda i, view, r=r, new=new, pad=pad: copy_rows_out(self.layout, bt, places, r, pad + new[i][0] * bt,
                                                                           view),
                             places[0][0].g.device)
        dt = writer.finish()
        call.record.stored_blocks = writer.stored
        call.record.bytes_stored = writer.nbytes
        call.record.store_ms = dt * 1e3

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        """``{"enabled", "off_reason", "block_tokens", "layout", "namespace",
        "counters" (with "tiers": {tier: {"blocks", "tokens", "bytes"}} of the
        reused tokens by where they came from: vram_prefix, host, pool, remote,
        store; see store_io.TIERS), "last" (CallRecord of the latest call), "conversation"
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
