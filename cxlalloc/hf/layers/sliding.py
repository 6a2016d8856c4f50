"""Sliding-window (and chunked) attention layers with their K/V in a bounded cxlalloc extent.

transformers' ``DynamicSlidingWindowLayer`` (transformers ``cache_utils.py``, 5.24;
docs/sources.md#transformers-layer-kinds)
keeps the last ``window - 1`` tokens of each layer: every ``update`` returns
``cat(cached, new)`` to attention and then keeps the last ``window - 1`` of that,
so each decode step copies the whole window (``torch.cat``).  Its memory is
bounded, but ``batch x window x layers`` is large for a long window and a large
batch, and it lives in torch's allocator, outside ``device_limit``.

:class:`CxlSlidingLayer` is a drop-in ``DynamicSlidingWindowLayer`` whose K/V live
in one cxlalloc extent of class ``kv`` per layer, token-major (a
:class:`~cxlalloc.hf.storage.KVStorage` of one slot), **bounded**: capacity
``window - 1 + max((window - 1) // 4, 16)`` tokens (:func:`window_capacity`; the
extent rounds up to whole chunks, see ``capacity_tokens``), 1.25x the window the
stock layer keeps.  The cached window is the row range ``[start, end)``:

* ``update`` writes the new tokens in place at ``end`` and returns the strided
  views of ``[start, end + q)`` (what the stock layer's ``cat`` returns), then
  advances ``start`` so the range holds the last ``window - 1`` tokens;
* when the new tokens do not fit before the capacity, the live window is first
  moved to rows ``[0, n)`` once, front to back in blocks no longer than the shift
  (no temporary): one copy of ``window - 1`` rows every ``capacity - (window - 1)``
  tokens, amortised at most 4 rows per token against the stock layer's ``window``
  rows per token (its ``torch.cat``);
* a forward of more tokens than the capacity holds (a prefill longer than the
  window) returns ``cat(cached, new)`` as the stock layer does (a transient in
  torch's memory, as there) and keeps its last ``window - 1`` tokens.

:meth:`CxlSlidingLayer.plan_window` (called by :meth:`CxlCache.prepare_forward`
from wrap()'s forward pre-hook) does the engine work before the forward, so that
the update inside a ``torch.compile``'d forward is a copy into a view; the row
range is settled after it (``_settle``).

``get_seq_length`` / ``get_mask_sizes`` are the stock layer's (from
``cumulative_length``), so the mask and the returned K/V are the stock layer's
exactly: same values, same order, same offsets.  ``activate_past_recording``
(assisted decoding) keeps every token until ``crop`` as the stock layer does (the
extent then regrows, one copy of the live window per regrowth).
"""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from cxlalloc.hf.pool import GRAD_ACROSS_FORWARDS, PICKLE_ERROR, KVPool, _shallow_copy
from cxlalloc.hf.storage import Geometry, KVStorage
from cxlalloc.policy.kv_growth import grown_capacity

# Rows a bounded extent holds beyond the window: (window - 1) // EXTRA_DIVISOR, at
# least MIN_EXTRA_TOKENS.  Each compaction moves window - 1 rows once per extra rows
# written, so the divisor is the amortised rows copied per token (4) and the memory
# above the stock layer's window is 1 / divisor (25%).
EXTRA_DIVISOR = 4
MIN_EXTRA_TOKENS = 16


def window_capacity(sliding_window: int) -> int:
    """Tokens a sliding-window layer's bounded extent is asked for (before rounding to chunks)."""
    keep = int(sliding_window) - 1
    return keep + max(keep // EXTRA_DIVISOR, MIN_EXTRA_TOKENS)


class WindowStore:
    """The rows ``[start, end)`` of a one-slot :class:`KVStorage` that hold a
    layer's cached tokens, in token order.  Knows nothing of transformers."""

    def __init__(self, pool: KVPool, g: Geometry, capacity_tokens: int):
        if g.device != pool.device:
            raise ValueError(
                f"cxlalloc.hf: this cache's allocator serves {pool.device} but the model's key/value states are on "
                f"{g.device}; wrap the model on the device it runs on (one device per wrapped model), or pass "
                f"simulate=True for a CPU model")
        self.pool = pool
        row_bytes = g.slot_elems * g.elem
        self.store = KVStorage(pool.allocator, g, 1, pool.clamp(capacity_tokens, capacity_tokens, row_bytes),
                               pool.counters)
        pool.stores.add(self.store)
        self.start = self.end = 0

    @property
    def g(self) -> Geometry:
        return self.store.g

    @property
    def n(self) -> int:
        return self.end - self.start

    def views(self, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor]:
        self.store.apply_pending()
        return self.store.key_view(0, start, stop), self.store.value_view(0, start, stop)

    def _set_end(self, end: int) -> None:
        self.end = end
        # Rows a beam reorder must move (apply_pending reorders [0, live)): never lowered here, so a
        # crop put back by CxlCache's all-or-nothing crop (cxlalloc.hf.indices.crop_layers) stays covered.
        self.store.live_tokens = max(self.store.live_tokens, end)

    def compact(self) -> None:
        """Move the live rows to ``[0, n)``: front to back in blocks of at most
        ``start`` rows, so no block's source overlaps its destination and no
        temporary is needed (memmove order)."""
        n, s, shift = self.n, self.store, self.start
        if shift == 0:
            return
        if n:
            s.apply_pending()
            for r0 in range(0, n, shift):
                r1 = min(n, r0 + shift)
                s.rows(r0, r1).copy_(s.rows(r0 + shift, r1 + shift))
            s.counters.add_existing(n * s.row_bytes)
        self.start = 0
        self._set_end(n)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append ``q`` tokens at ``end`` (the caller made room)."""
        q = key_states.shape[-2]
        self.store.apply_pending()
        self.store.ensure(self.end + q)
        self.store.write(0, self.end, key_states, value_states)
        self._set_end(self.end + q)

    def grow(self, tokens: int) -> None:
        """Re-create the storage to hold ``tokens`` rows (live rows copied to ``[0, n)``)."""
        self.compact()
        pool = self.pool
        self.store.regrow(pool.clamp(grown_capacity(tokens, self.store.capacity_tokens, pool.growth,
                                                    pool.round_tokens), tokens, self.store.row_bytes))

    def replace(self, key_states: torch.Tensor, value_states: torch.Tensor, existing: bool = False) -> None:
        """Hold exactly these ``(B, H, n, D)`` states at rows ``[0, n)``
        (``existing``: they are cached tokens being copied, not new ones)."""
        self.start = 0
        self._set_end(0)
        self.store._pending = None
        self.store.live_tokens = 0  # every row is rewritten
        n = key_states.shape[-2]
        if n:
            self.write(key_states, value_states)
            if existing:
                c, nbytes = self.store.counters, n * self.store.row_bytes
                c.add_new(-nbytes)
                c.add_existing(nbytes)

    def keep_last(self, keep: int) -> None:
        self.start = max(self.start, self.end - keep)

    def release(self) -> None:
        self.start = 0
        self._set_end(0)
        self.store._pending = None
        self.store.trim(0)


class CxlSlidingLayer(DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` with its K/V in a bounded cxlalloc extent.

    Args:
        pool: the owning cache's :class:`~cxlalloc.hf.pool.KVPool` (allocator, counters).
        sliding_window: the window ``w`` in tokens (>= 2): the layer caches the
            last ``w - 1`` tokens.

    ``update(key_states, value_states)`` takes ``(B, H_kv, q, D)`` tensors and
    returns ``(keys, values)`` of shape ``(B, H_kv, min(L, w - 1) + q, D)``
    (``L``: tokens seen before), equal to the stock layer's.

    Raises (from ``update``):
        ValueError: batch/heads/head-dim/dtype differ from the cached tokens', or
            the states are on another device than the allocator's.
        cxlalloc.OutOfMemoryError: neither tier has room for the window.
    """

    is_compileable = False  # engine calls inside update (the window's extent is made lazily)
    shares_full_store = False  # a bounded extent per layer (CxlCache gives it no shared slot)
    _win: Optional["WindowStore"] = None  # also before __init__ ran (transformers' constructor assigns keys = None)
    _wplan = None
    # Never set _layer_type: transformers would register the class globally.

    def __init__(self, pool: KVPool, sliding_window: int):
        if int(sliding_window) < 2:
            raise ValueError(f"cxlalloc.hf: sliding_window must be >= 2 tokens, got {sliding_window}")
        self._pool = pool
        self._win: Optional[WindowStore] = None
        self._grad_cached = False  # tokens from a forward with gradients are in the window
        # A forward planned ahead (plan_window): (k view, v view, new tokens, end after, nbytes), and
        # whether update() used it; its bookkeeping is settled outside the forward (_settle).
        self._wplan = None
        self._wplan_used = False
        super().__init__(sliding_window=int(sliding_window))

    @classmethod
    def from_stock(cls, stock: DynamicSlidingWindowLayer, pool: KVPool,
                   slot: Optional[int] = None) -> Optional["CxlSlidingLayer"]:
        """The tiered counterpart of transformers' ``stock`` layer (its window kept), or
        None for a window under 2 tokens (it caches no token: left to transformers)."""
        return cls(pool, stock.sliding_window) if int(stock.sliding_window) >= 2 else None

    @property
    def _keep(self) -> int:
        return self.sliding_window - 1

    # ------------------------------------------------------------ live views
    def _window_view(self, which: int) -> Optional[torch.Tensor]:
        """K (``which=0``) or V (1) view of the cached window, after settling a
        planned update (None before the first update)."""
        if self._wplan is not None:
            self._settle()
        w = self._win
        if w is None or not self.is_initialized:
            return None
        return w.views(w.start, w.end)[which]

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """``(B, H_kv, n, Dk)`` view of the cached window (None before the first update)."""
        return self._window_view(0)

    @keys.setter
    def keys(self, value) -> None:
        self._assign(value)

    @property
    def values(self) -> Optional[torch.Tensor]:
        """``(B, H_kv, n, Dv)`` view of the cached window (None before the first update)."""
        return self._window_view(1)

    @values.setter
    def values(self, value) -> None:
        self._assign(value)

    def _assign(self, value) -> None:
        if value is None:  # transformers' constructors and resets assign None
            w = self._win
            if w is not None:
                self._wplan, self._wplan_used = None, False
                w.release()
            return
        raise AttributeError("cxlalloc.hf: CxlSlidingLayer.keys/values are views of cxlalloc storage; "
                             "write through update()")

    def _extra_stores(self) -> list:
        return [] if self._win is None else [self._win.store]

    # ------------------------------------------------------------ HF layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self.is_initialized = True

    def _bind(self, g: Geometry) -> WindowStore:
        w = self._win
        if w is not None and w.g == g:
            return w
        if w is not None and w.n:
            raise ValueError(
                f"cxlalloc.hf: new key states (B={g.batch}, H={g.heads}, D={g.k_dim}, {g.dtype}) do not match the "
                f"{w.n} cached tokens of a sliding-window layer (B={w.g.batch}, H={w.g.heads}, D={w.g.k_dim}, "
                f"{w.g.dtype}); to continue with num_return_sequences/num_beams=n call "
                f"cache.batch_repeat_interleave(n) first")
        if w is not None:
            w.release()
        self._win = WindowStore(self._pool, g, window_capacity(self.sliding_window))
        return self._win

    # ------------------------------------------------------------ planned forwards
    def plan_window(self, tokens: int, batch: int, guess: Optional[Geometry]) -> bool:
        """Do the engine work of the next update of ``tokens`` tokens before the
        forward (:meth:`CxlCache.prepare_forward`, so that a ``torch.compile``'d
        forward traces a copy into a view, as for full attention): bind the
        extent, compact if needed, commit the rows, make the views.  Returns
        False (no plan; update() does it all) while recording the past, for a
        forward longer than the extent, or a batch other than the cached one."""
        self._settle()
        w = self._win
        if getattr(self, "record_past", False) or tokens < 1:
            return False
        if w is not None and w.n:
            if w.g.batch != batch:
                return False
            g = w.g
        elif guess is None:
            return False
        else:
            g = Geometry(int(batch), guess.heads, guess.k_dim, guess.v_dim, guess.dtype, guess.device)
        w = self._bind(g)
        cap = w.store.capacity_tokens
        if w.end + tokens > cap:
            if w.n + tokens > cap:
                return False
            w.compact()
        w.store.apply_pending()
        w.store.ensure(w.end + tokens)
        if not self.is_initialized:
            self.device, self.dtype = g.device, g.dtype
            self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
            self.is_initialized = True
        k, v = w.views(w.start, w.end + tokens)
        self._wplan = (k, v, int(tokens), w.end + tokens, int(tokens) * g.slot_elems * g.elem)
        self._wplan_used = False
        return True

    def _settle(self) -> None:
        """Apply the bookkeeping of a planned update that ran (or drop an unused plan)."""
        p, used = self._wplan, self._wplan_used
        self._wplan, self._wplan_used = None, False
        if p is not None and used:
            w = self._win
            w._set_end(p[3])
            w.keep_last(self._keep)
            w.store.counters.add_new(p[4])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        p = self._wplan
        if p is not None and not self._wplan_used:
            # Planned: only tensor operations and shapes here (torch.compile traces them); the
            # window's row range is settled outside the forward.
            k, v, q0 = p[0], p[1], p[2]
            q = key_states.shape[-2]
            grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
            if (q == q0 and not grad and key_states.shape[:2] == k.shape[:2] and value_states.shape[:2] == v.shape[:2]
                    and key_states.shape[-1] == k.shape[-1] and value_states.shape[-1] == v.shape[-1]
                    and key_states.dtype == k.dtype):
                k.narrow(2, k.shape[-2] - q, q).copy_(key_states)
                v.narrow(2, v.shape[-2] - q, q).copy_(value_states)
                self.cumulative_length += q
                self._wplan_used = True
                return k, v
        self._settle()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        w = self._bind(Geometry.of(key_states, value_states))
        q = key_states.shape[-2]
        # With gradients: stored detached (the storage is no autograd leaf written in place), and
        # returned as the stock layer's cat (cached tokens without grad, then this forward's states),
        # as CxlKVLayer does; K/V cached by an earlier forward with gradients: refused, as there.
        grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
        if grad and self._grad_cached and w.n:
            raise RuntimeError(GRAD_ACROSS_FORWARDS)
        new_k, new_v = (key_states.detach(), value_states.detach()) if grad else (key_states, value_states)
        self._grad_cached = self._grad_cached or grad
        self.cumulative_length += q
        cap = w.store.capacity_tokens
        if getattr(self, "record_past", False):
            # Keep every token until crop(); return what get_mask_sizes announces.
            if w.end + q > cap:
                w.compact()
            if w.end + q > w.store.capacity_tokens:
                w.grow(w.n + q)
            visible = self._keep + q
            first = max(w.start, w.end + q - visible)
            w.write(new_k, new_v)
            return self._returned(w, first, key_states, value_states, grad)
        if w.end + q > cap and w.n + q <= cap:
            w.compact()
        if w.end + q <= w.store.capacity_tokens:
            start = w.start
            w.write(new_k, new_v)
            out = self._returned(w, start, key_states, value_states, grad)
            w.keep_last(self._keep)
            return out
        # More new tokens than the bounded extent holds (a prefill longer than the
        # window): the stock layer's cat, then keep its last window - 1 tokens.
        ck, cv = w.views(w.start, w.end)
        full_k = torch.cat([ck, key_states], dim=-2)
        full_v = torch.cat([cv, value_states], dim=-2)
        w.replace(full_k[:, :, -self._keep:, :].detach(), full_v[:, :, -self._keep:, :].detach())
        return full_k, full_v

    @staticmethod
    def _returned(w: WindowStore, start: int, key_states, value_states, grad: bool):
        """Rows ``[start, end)`` (the new tokens last) as views, or with gradients
        the cached part as views followed by the states themselves."""
        if not grad:
            return w.views(start, w.end)
        q = key_states.shape[-2]
        ck, cv = w.views(start, w.end - q)
        return torch.cat([ck, key_states], dim=-2), torch.cat([cv, value_states], dim=-2)

    def crop(self, tokens_to_remove: int) -> None:
        """The stock layer's ``crop`` (5.24 rules and errors), on the extent's rows.
        Only this layer's attributes change (a new row range object; no memory
        is released), so an all-or-nothing crop can put them back."""
        self._settle()
        if self._win is not None:
            self._win = copy.copy(self._win)
        w = self._win
        if self.get_seq_length() >= self.sliding_window:
            if not getattr(self, "record_past", False):
                raise RuntimeError(
                    "`crop` was called, but the current layer does not track past states, and the sliding window size "
                    "was already reached. Call `activate_past_recording` before `crop` to be able to rollback the cache.")
            if tokens_to_remove > 0:
                raise RuntimeError(
                    "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be cropped by "
                    "passing a negative int, to specify how many tokens to remove")
            if tokens_to_remove == 0:
                w.keep_last(self._keep)
            else:
                t = abs(int(tokens_to_remove))
                n = w.n
                new_start = w.start + max(0, n - self._keep - t)
                new_end = max(new_start, w.end - t)
                w.start = new_start
                w._set_end(new_end)
                self.cumulative_length -= t
            return
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead.")
        if tokens_to_remove == 0 or not self.is_initialized or w is None:
            return
        t = abs(int(tokens_to_remove))
        w._set_end(max(w.start, w.end - t))
        self.cumulative_length = w.n

    def reset(self) -> None:
        self._wplan, self._wplan_used = None, False
        if self._win is not None:
            self._win.release()
        self._grad_cached = False
        self.is_initialized = False
        self.cumulative_length = 0

    def offload(self) -> None:  # tiering is cxlalloc's job
        pass

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: recorded, applied before the window is next read (only moved rows are copied)."""
        self._settle()
        if self._win is not None and self._win.n:
            self._win.store.reorder(beam_idx)

    def _rebatch(self, batch: int, transform) -> None:
        self._settle()
        w = self._win
        if w is None or not w.n:
            return
        k, v = w.views(w.start, w.end)
        k, v = transform(k), transform(v)
        old = w
        self._win = WindowStore(self._pool, Geometry(int(batch), *_rest(old.g)), old.store.capacity_tokens)
        self._win.replace(k, v, existing=True)
        old.release()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._settle()
        if self._win is not None and self._win.n:
            self._rebatch(self._win.g.batch * repeats, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._settle()
        if self._win is not None and self._win.n:
            n = torch.arange(self._win.g.batch)[torch.as_tensor(indices).cpu()].numel()
            self._rebatch(n, lambda t: t[indices])

    def __reduce_ex__(self, protocol):
        raise TypeError(PICKLE_ERROR.format(what="CxlSlidingLayer"))

    def __copy__(self):
        return _shallow_copy(self)

    def __deepcopy__(self, memo):
        self._settle()
        pool = memo.get(id(self._pool), self._pool)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in ("_pool", "_win", "_wplan"):
                new.__dict__[k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v, memo)
        new._pool, new._win, new._wplan = pool, None, None
        w = self._win
        if w is not None and w.n:
            new._win = WindowStore(pool, w.g, w.store.capacity_tokens)
            new._win.replace(*w.views(w.start, w.end), existing=True)
        return new


def _rest(g: Geometry):
    return g.heads, g.k_dim, g.v_dim, g.dtype, g.device
