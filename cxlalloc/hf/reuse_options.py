"""The KV reuse options of :func:`cxlalloc.hf.wrap` (``kv_store``, ``block_tokens``, ...), validated."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from cxlalloc.config import make_config, parse_env, parse_size
from cxlalloc.kvstore import keys as kvkeys
from cxlalloc.kvstore.layout import check_block_tokens

DEFAULT_BLOCK_TOKENS = 64
DEFAULT_CONVERSATION_LIMIT = 256 << 20   # bytes of KV the "last conversation" cache may keep (kv_conversation_limit)
REUSE_OPTIONS = ("kv_store", "kv_store_limit", "block_tokens", "cache_salt", "kv_store_fingerprint",
                 "kv_store_verify", "kv_conversation_limit")

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
