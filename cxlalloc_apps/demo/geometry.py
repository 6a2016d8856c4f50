"""A model's KV geometry read from its files, before torch or the model loads.

The demo checks ``--kv-store-limit`` against one KV block before it spends
minutes loading the model: a block is ``block_tokens`` tokens of every
layer's keys and values (``cxlalloc.kvstore.layout``), so it needs the layer
count, the KV heads and the head size.  They come from ``config.json`` (a
transformers model folder) or from a GGUF file's metadata, whose layout is
the GGUF specification's: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(little-endian; magic ``GGUF``, version, tensor count, metadata count, then
the metadata key/value pairs).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Optional


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, element_bytes: int) -> int:
        """KV bytes one token takes in every layer (keys + values), in bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def from_config_json(folder: str) -> Optional[KVGeometry]:
    """The geometry in ``folder/config.json``; None when it cannot be read or
    lacks the fields (a text config nested in a multimodal one included)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        return KVGeometry(int(cfg["num_hidden_layers"]), kv_heads, head_dim)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


# GGUF metadata value types (the specification's gguf_metadata_value_type) -> struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise EOFError
    return struct.unpack("<" + fmt, data)[0]


def _value(f: BinaryIO, vtype: int):
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        n = _read(f, "Q")
        return f.read(n).decode("utf-8", "replace")
    if vtype == _ARRAY:
        item, n = _read(f, "I"), _read(f, "Q")
        if item in _SCALARS:  # skipped unread: only scalars are needed here
            f.seek(n * struct.calcsize("<" + _SCALARS[item]), os.SEEK_CUR)
            return None
        for _ in range(n):
            _value(f, item)
        return None
    raise ValueError(f"unknown GGUF metadata type {vtype}")


def from_gguf(path: str) -> Optional[KVGeometry]:
    """The geometry in a GGUF file's metadata (``{arch}.block_count``,
    ``{arch}.attention.head_count[_kv]``, ``{arch}.embedding_length``,
    ``{arch}.attention.key_length``); None when the file is not GGUF (v2/v3)
    or lacks them.  Reads only the metadata (a few MB at the file's start)."""
    meta = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or _read(f, "I") < 2:
                return None
            _read(f, "Q")  # tensor count
            for _ in range(_read(f, "Q")):
                key = f.read(_read(f, "Q")).decode("utf-8", "replace")
                value = _value(f, _read(f, "I"))
                if value is not None and not key.startswith("tokenizer."):
                    meta[key] = value
    except (OSError, EOFError, ValueError, struct.error):
        return None
    arch = meta.get("general.architecture")
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
        head_dim = int(meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // heads)
        return KVGeometry(int(meta[f"{arch}.block_count"]), kv_heads, head_dim)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
