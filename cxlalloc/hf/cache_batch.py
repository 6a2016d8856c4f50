"""Batch-row operations of :class:`cxlalloc.hf.CxlCache`: beam reorder, repeat and select rows.

Full-attention K/V (:class:`~cxlalloc.hf.layers.CxlKVLayer`) are reordered in their storage or
copied into new storage of the new batch; transformers' own layers do their own operation.
"""

from __future__ import annotations

import operator

from cxlalloc.hf.layers import CxlKVLayer


class BatchRowsMixin:
    """``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices`` of
    :class:`~cxlalloc.hf.CxlCache` (uses its ``layers``, ``_pool``, ``_stores``,
    ``_cxl_layers``, ``_rows``, ``_batch``, ``_on``)."""

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: ``new[b] = old[beam_idx[b]]`` for every layer.  Full-attention
        layers record it and apply it at the next forward (only rows that move
        are copied; the reorder after generate()'s last step is never applied).

        ``beam_idx``: integer rows as :func:`batch_rows` (tensor of any integer
        dtype, list, tuple, numpy array); one of another length than the batch
        selects those rows (:meth:`batch_select_indices`), as ``index_select``
        does in transformers' layers.  Views handed out before are rewritten in
        place when the reorder is applied (docs/huggingface.md, "CxlCache vs
        DynamicCache").

        Raises:
            TypeError / ValueError / IndexError: as :func:`batch_rows`.
        """
        idx = self._rows(beam_idx, "beam_idx", allow_mask=False)
        batch = self._batch()
        if batch is not None and idx.numel() != batch:
            self.batch_select_indices(idx)
            return
        for s in self._stores():
            s.reorder(idx)
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                layer._reorder_extra(idx)
            else:
                layer.reorder_cache(self._on(idx, layer))

    def _check_supported(self, op: str) -> None:
        """Raise before changing anything if one of transformers' own layers has
        no ``op`` (5.24's linear-attention layers have no batch_select_indices /
        batch_repeat_interleave: DynamicCache raises AttributeError there after
        the layers before it were changed)."""
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, CxlKVLayer) and not callable(getattr(layer, op, None)):
                raise AttributeError(f"cxlalloc.hf: cache layer {i} is transformers' {type(layer).__name__}, which "
                                     f"has no {op}() (DynamicCache cannot do it either); nothing was changed")

    def _rebuild(self, batch_of, transform, stock_op, op: str = "", arg=None) -> None:
        for s in self._stores():
            if s.live_tokens == 0:
                continue
            new = s.rebuilt(batch_of(s.g.batch), transform)
            pool = next(layer._pool for layer in self._cxl_layers() if layer._store is s)  # its GPU's pool
            pool.stores.add(new)
            if pool.shared is s:
                pool.shared = new
            for layer in self._cxl_layers():
                if layer._store is s:
                    layer._store = new
        for layer in self.layers:
            if isinstance(layer, CxlKVLayer):
                layer._batch_extra(op, arg)
            else:
                stock_op(layer)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every cached sequence ``repeats`` times on the batch dim (to
        continue a batch-B cache with ``num_return_sequences``/``num_beams``)."""
        repeats = operator.index(repeats)
        if repeats < 1:
            raise ValueError(f"cxlalloc.hf: batch_repeat_interleave(repeats) needs repeats >= 1, got {repeats}")
        self._check_supported("batch_repeat_interleave")
        self._rebuild(lambda b: b * repeats, lambda t: t.repeat_interleave(repeats, dim=0),
                      lambda layer: layer.batch_repeat_interleave(repeats), "batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices) -> None:
        """Keep only the batch rows ``indices``, in that order, in every layer:
        a 1-D tensor (any integer dtype, or a bool mask of ``batch`` rows), a
        list, tuple or numpy array of rows (a tuple is a sequence of rows, as in
        ``DynamicLayer``, never a multi-dimensional index); negative rows count
        from the end.  Full-attention K/V are copied into new storage; views
        handed out before keep their values.

        Raises:
            TypeError / ValueError / IndexError: as :func:`batch_rows` (nothing
            changed).
        """
        idx = self._rows(indices, "indices")
        self._check_supported("batch_select_indices")
        self._rebuild(lambda b: idx.numel(), lambda t: t.index_select(0, idx),
                      lambda layer: layer.batch_select_indices(self._on(idx, layer)), "batch_select_indices", idx)


__all__ = ["BatchRowsMixin"]
