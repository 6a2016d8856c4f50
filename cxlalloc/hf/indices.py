"""The index arguments of cache calls, normalised once for every layer kind.

:func:`batch_rows` turns a batch-row argument (``reorder_cache``,
``batch_select_indices``) into one 1-D ``long`` tensor, :func:`crop_amount` a
``crop()`` argument into an int, and :func:`crop_layers` crops a list of layers of
any kinds all-or-nothing.  Used by :class:`~cxlalloc.hf.CxlCache` and by the
layers in :mod:`cxlalloc.hf.layers`; nothing here holds state.

Source of the semantics: transformers ``cache_utils.py`` (``DynamicLayer``,
``Cache.crop``) of 5.17 and 5.24 (docs/huggingface.md#cxlcache-vs-dynamiccache).
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch


def batch_rows(indices, batch: Optional[int], device, what: str, allow_mask: bool = True) -> torch.Tensor:
    """Normalise a batch-row argument to a 1-D ``torch.long`` tensor on ``device``.

    Every cache layer kind selects rows with the result (``index_select`` on
    dim 0), so a tuple is a sequence of rows as in ``DynamicLayer``'s
    ``keys[indices, ...]`` and never a multi-dimensional index.

    Args:
        indices: a 1-D tensor (any integer dtype, or bool: a mask of ``batch``
            rows when ``allow_mask``), a list, tuple or ``range`` of ints, or a
            1-D numpy array.  Negative rows count from the end, as in torch
            indexing.
        batch: the cache's batch size (None when no layer holds tokens yet:
            no range check).
        device: where the result goes (the storage's device).
        what: the argument's name, for messages.
        allow_mask: accept a bool mask (``batch_select_indices``; not
            ``reorder_cache``, whose ``index_select`` needs integers).

    Returns:
        ``(n,)`` long tensor of rows in ``[0, batch)``, ``n >= 1``.

    Raises:
        TypeError: not a sequence of ints (floats, nested sequences, a bool
            mask where none is accepted).
        ValueError: not 1-D, or it selects no row.
        IndexError: a row outside ``[-batch, batch)``, or a mask whose length
            is not ``batch``.
    """
    if isinstance(indices, torch.Tensor):
        t = indices.detach()
    else:
        try:
            t = torch.as_tensor(indices)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"cxlalloc.hf: {what} must be a 1-D tensor, list, tuple or numpy array of batch rows "
                            f"(ints), got {type(indices).__name__}: {e}") from None
        if t.numel() == 0:
            t = t.to(torch.long)
    if t.dim() != 1:
        raise ValueError(f"cxlalloc.hf: {what} must be 1-D (one entry per selected batch row), got shape "
                         f"{tuple(t.shape)}")
    if t.dtype == torch.bool:
        if not allow_mask:
            raise TypeError(f"cxlalloc.hf: {what} must hold integer batch rows, not a bool mask")
        if batch is not None and t.numel() != batch:
            raise IndexError(f"cxlalloc.hf: {what} is a mask of {t.numel()} rows for a cache of batch {batch}")
        t = t.nonzero().flatten()
    elif t.is_floating_point() or t.is_complex():
        raise TypeError(f"cxlalloc.hf: {what} must hold integer batch rows, got dtype {t.dtype}")
    t = t.to(device=device, dtype=torch.long)
    if t.numel() == 0:
        raise ValueError(f"cxlalloc.hf: {what} selects no batch row; a cache needs at least one")
    if batch is not None:
        lo, hi = int(t.min()), int(t.max())
        if lo < -batch or hi >= batch:
            raise IndexError(f"cxlalloc.hf: {what} {t.tolist()} has rows outside [-{batch}, {batch}) for a cache "
                             f"of batch {batch}")
        if lo < 0:
            t = torch.where(t < 0, t + batch, t)
    return t


def crop_amount(tokens_to_remove) -> int:
    """``crop()``'s argument as an int (a Python or numpy int, a 0-d integer tensor).

    Raises:
        TypeError: anything else (a float, a tensor of several values).
    """
    try:
        return operator.index(tokens_to_remove)
    except TypeError:
        raise TypeError(f"cxlalloc.hf: crop(tokens_to_remove) takes an int (negative: tokens to drop), got "
                        f"{type(tokens_to_remove).__name__} {tokens_to_remove!r}") from None


def _layer_snapshot(layer) -> list:
    """What a layer's ``crop`` may change: its attributes, and the contents of
    the dicts/lists among them (linear-attention layers assign into a dict of
    states).  Tensors are kept by reference: every crop slices and reassigns,
    none writes in place."""
    return [(k, v, dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else None)
            for k, v in vars(layer).items()]


def _layer_restore(layer, snap: list) -> None:
    d = vars(layer)
    d.clear()
    for k, v, contents in snap:
        if isinstance(v, dict):
            v.clear()
            v.update(contents)
        elif isinstance(v, list):
            v[:] = contents
        d[k] = v


def crop_layers(layers: Sequence, tokens_to_remove: int) -> None:
    """Crop every layer of a cache, or none: all-or-nothing for any mix of
    layer kinds (a hybrid sliding/full/linear cache is never left half cropped).

    The layers are cropped in order, as ``Cache.crop`` does, so the error
    raised is the one transformers' ``DynamicCache`` raises (the first layer
    that refuses: a sliding layer past its window without past recording, a
    linear-attention layer, a positive argument on 5.24); each layer's
    ``crop`` runs under a snapshot of its attributes and, if one raises, the
    layers already cropped are put back before the error propagates.
    (transformers validates inside each layer's ``crop``, so there is no
    separate check to run first; cxlalloc's own layers check before changing
    anything: :meth:`CxlKVLayer.check_crop`.)

    Raises:
        TypeError: ``tokens_to_remove`` is not an int.
        what the refusing layer raises (``ValueError``, ``RuntimeError``).
    """
    n = crop_amount(tokens_to_remove)
    snaps = [_layer_snapshot(layer) for layer in layers]
    done = 0
    try:
        for layer in layers:
            layer.crop(n)
            done += 1
    except BaseException:
        for layer, snap in zip(layers[:done + 1], snaps):
            _layer_restore(layer, snap)
        raise
