"""The "last conversation" of prefix reuse: a batch-1 call's cache kept after its generate()
returned, continued (cropped to the shared tokens, no copy) by the next call whose prompt starts
with the tokens it holds (``kv_conversation_limit``, ``conversation_hits``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from cxlalloc.hf.cache import CxlCache

if TYPE_CHECKING:
    from cxlalloc.hf.reuse import _Call


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



class ConversationMixin:
    """The last-conversation part of :class:`cxlalloc.hf.reuse.PrefixReuse`
    (uses its ``_conv``, ``_lock``, ``counters``, ``opts`` and :meth:`root`)."""

    def _conversation_hit(self, call: "_Call", tokens: torch.Tensor) -> int:
        """Tokens of ``tokens`` (this prompt, 1-D) the kept conversation holds
        (0: none kept, another namespace or weights, or no shared start); at
        most ``len(tokens) - 1``, so the last prompt token is prefilled."""
        conv = self._conv
        if conv is None or conv.salt != call.salt:
            return 0
        if conv.root != self.root(call.salt, call.fp):  # the weights changed since: never continue it
            self._drop_conversation(conv)
            return 0
        return min(common_prefix(conv.ids, tokens), int(tokens.numel()) - 1)

    def _continue_conversation(self, call: "_Call", tokens: torch.Tensor, hit: int,
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
            held = kc.held_tokens()
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

    def _keep_conversation(self, call: "_Call", output) -> None:
        """After a batch-1 call: keep its cache as the last conversation (the
        one kept before is released), if it fits ``kv_conversation_limit``
        and the caller was not handed the cache (``return_dict_in_generate``
        with ``past_key_values``: it is the caller's then)."""
        cache = call.cache
        seqs = output if torch.is_tensor(output) else getattr(output, "sequences", None)
        if seqs is None or seqs.shape[0] != 1 or getattr(output, "past_key_values", None) is cache:
            return
        if cache.kv_places() is None:
            return
        held = cache.held_tokens()
        if held <= 0 or seqs.shape[1] < held:
            return
        kv = cache.kv_stats()
        nbytes = int(kv.get("kv_device_bytes", 0)) + int(kv.get("kv_host_bytes", 0))
        if nbytes > self.opts.kv_conversation_limit:
            with self._lock:
                self.counters["conversation_too_large"] += 1
            return
        conv = _Conversation(cache, seqs[0, :held].detach().to("cpu", torch.long).clone(), self.root(call.salt, call.fp),
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

    def _conversation_stats(self) -> dict:
        conv = self._conv
        return {"limit_bytes": self.opts.kv_conversation_limit, "kept": conv is not None,
                "kept_tokens": int(conv.ids.numel()) if conv is not None else 0,
                "kept_bytes": conv.nbytes if conv is not None else 0}
