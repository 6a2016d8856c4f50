"""Options of cxlalloc: parsing, units and validation.

Options come from keyword arguments (``cxlalloc.enable(device_limit="8GiB")``,
``cxlalloc.Allocator(...)``, ``cxlalloc.hf.wrap(model, ...)``) or from the one
environment variable ``CXLALLOC``, in the same ``key:value,key:value`` form as
``PYTORCH_CUDA_ALLOC_CONF``::

    CXLALLOC=1                                      # defaults
    CXLALLOC=device_limit:8GiB,numa_node:2,backend:managed

Every bad value raises ``ValueError`` naming the option and its allowed values.

Sizes are bytes: an int, or a string with a binary unit (``"512MiB"``,
``"8GiB"``, ``"1.5TiB"``, ``"4KiB"``) or a decimal one (``"8GB"`` = 8e9
bytes), or ``"<n>B"``.  ``device_limit`` and ``kv_device_limit`` also take a
fraction: a float in (0, 1] or a percentage string (``"50%"``) of the GPU's
VRAM (of ``device_limit`` for ``kv_device_limit``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Optional, Union

Size = Union[int, float, str, None]

# Up to PiB: the largest unit sizes are printed in (OOM messages, range errors) must parse back.
_BINARY = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

SIZE_HELP = "bytes (int) or a size string like '512MiB', '8GiB', '1.5TiB', '8GB'"
MAX_SIZE = 1 << 60  # 1 EiB: anything larger is a typo, and would not fit the engine's 64-bit sizes
BACKENDS = ("auto", "host-vmm", "managed", "pinned")
POLICIES = ("kv-aware", "first-fit")
TAGS = ("kv", "weight", "other")
IMPLICIT_MOVES = ("owner", "any-thread")
# Digits in a size string: 1 EiB is 19 digits; a few more allow leading
# zeros and decimals, and nothing near the ~300 digits at which float() ends.
_MAX_DIGITS = 24
# Linux: MAX_NUMNODES = 1 << CONFIG_NODES_SHIFT, at most 10 (include/linux/numa.h,
# mm/Kconfig NODES_SHIFT range 1..10).
MAX_NUMA_NODE = (1 << 10) - 1


def _short(value: Any) -> str:
    """``value`` for an error message, cut to 40 characters."""
    r = repr(value)
    return r if len(r) <= 40 else f"{r[:30]}... ({len(str(value))} characters)"


def _ascii_digits(value: Any) -> bool:
    """A string of ASCII digits after stripping spaces (str.isdigit() alone
    also accepts other scripts' digits and superscripts, which int() rejects)."""
    return isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() and len(value.strip()) <= 24


def parse_size(value: Any, option: str) -> int:
    """Parse a byte size.

    Args:
        value: int bytes, or a string such as ``"512MiB"``, ``"8GiB"``,
            ``"8GB"`` (decimal), ``"4096"``.
        option: the option's name, used in the error message.

    Returns:
        The size in bytes (int, >= 0).

    Raises:
        ValueError: naming ``option`` and the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"cxlalloc option '{option}': {value!r} is not a size; use {SIZE_HELP}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"cxlalloc option '{option}': {value} is negative; use {SIZE_HELP}")
        if value > MAX_SIZE:
            raise ValueError(f"cxlalloc option '{option}': {_short(value)} bytes is larger than 1 EiB; use {SIZE_HELP}")
        return value
    if isinstance(value, str):
        # ASCII only: Python's float() and int() also read other scripts'
        # digits ("١٠", "²" fails late), which no one means in a size.
        m = _SIZE_RE.match(value) if value.isascii() else None
        if m and len(m.group(1)) > _MAX_DIGITS:
            raise ValueError(f"cxlalloc option '{option}': {_short(value)} has {len(m.group(1))} digits (at most "
                             f"{_MAX_DIGITS}: sizes stop at 1 EiB); use {SIZE_HELP}")
        if m:
            number, unit = float(m.group(1)), m.group(2).lower()
            mult = _BINARY.get(unit or "b") or _DECIMAL.get(unit)
            if mult == 1 and not number.is_integer():
                # "0.5" is not half a byte: it is almost surely a fraction
                # given to an option that takes only sizes.
                raise ValueError(f"cxlalloc option '{option}': {value!r} is not a whole number of bytes; "
                                 f"use {SIZE_HELP}")
            if mult is not None and math.isfinite(number * mult):
                return parse_size(int(number * mult), option)
            if mult is not None:
                raise ValueError(f"cxlalloc option '{option}': {_short(value)} is larger than 1 EiB; use {SIZE_HELP}")
        raise ValueError(f"cxlalloc option '{option}': {_short(value)} is not a size; use {SIZE_HELP}")
    raise ValueError(f"cxlalloc option '{option}': {value!r} is not a size; use {SIZE_HELP}")


def parse_size_or_fraction(value: Any, option: str, of: str = "VRAM") -> Union[int, float]:
    """Parse a size (-> int bytes) or a fraction (-> float in (0, 1]).

    Fractions: a float in (0, 1] or a percentage string ``"50%"``.  An int is
    always bytes (so ``1`` means one byte, ``1.0`` means 100%).  ``of`` names
    what a fraction is of, in the error (``"VRAM"``, ``"the pool"``, ...).

    Raises:
        ValueError: naming ``option`` and the accepted forms.
    """
    help_ = f"{SIZE_HELP}, or a fraction of {of}: a float in (0, 1] or a percentage like '50%'"
    if isinstance(value, float):
        if 0.0 < value <= 1.0:
            return value
        raise ValueError(f"cxlalloc option '{option}': {value} is not a fraction in (0, 1]; use {help_}")
    if isinstance(value, str) and not value.isascii():
        raise ValueError(f"cxlalloc option '{option}': {_short(value)} is not a size or fraction (only ASCII digits "
                         f"are read); use {help_}")
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            pct = -1.0
        if 0.0 < pct <= 100.0:
            return pct / 100.0
        raise ValueError(f"cxlalloc option '{option}': {value!r} is not a percentage in (0, 100]; use {help_}")
    if isinstance(value, str):
        # "0.5" from the environment variable is a fraction, "512MiB" a size.
        try:
            f = float(value)
        except ValueError:
            f = None
        if f is not None and "." in value:
            return parse_size_or_fraction(f, option, of)
    try:
        return parse_size(value, option)
    except ValueError as e:
        m = _SIZE_RE.match(value) if isinstance(value, str) and value.isascii() else None
        if (isinstance(value, int) and not isinstance(value, bool)) or (m and len(m.group(1)) > _MAX_DIGITS):
            # a number refused for its value (negative, above 1 EiB, too many digits): that reason is the one to give
            raise ValueError(str(e).replace(f"use {SIZE_HELP}", f"use {help_}")) from None
        raise ValueError(f"cxlalloc option '{option}': {_short(value)} is not a size or fraction; use {help_}") from None


def _parse_bool(value: Any, option: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError(f"cxlalloc option '{option}': {value!r} is not a boolean; use true/false (or 1/0)")


def _parse_node(value: Any, option: str) -> Union[str, int]:
    if value == "auto":
        return "auto"
    n = -1
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif _ascii_digits(value):
        n = int(value.strip())
    if 0 <= n <= MAX_NUMA_NODE:
        return n
    raise ValueError(f"cxlalloc option '{option}': {_short(value)} is not a NUMA node; use 'auto' or a node id "
                     f"0..{MAX_NUMA_NODE} (Linux's MAX_NUMNODES limit; the node must also exist here)")


def _parse_choice(value: Any, option: str, allowed: tuple) -> str:
    if isinstance(value, str) and value.strip() in allowed:
        return value.strip()
    raise ValueError(f"cxlalloc option '{option}': {value!r} is not allowed; allowed: {', '.join(allowed)}")


def _parse_device(value: Any, option: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, str):
        v = value.strip()
        if v.startswith("cuda:"):
            v = v[5:]
        if _ascii_digits(v):
            return int(v)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    else:
        idx = getattr(value, "index", None)  # torch.device
        if isinstance(idx, int):
            return idx
    raise ValueError(f"cxlalloc option '{option}': {value!r} is not a device; use a CUDA ordinal (0, 1, ...) or 'cuda:N'")


def _parse_rate(value: Any, option: str) -> float:
    """Bytes per second: a size (per second) such as '8GiB' or '8GiB/s', or 0 to disable."""
    if isinstance(value, str) and value.strip().lower().endswith("/s"):
        value = value.strip()[:-2]
    return float(parse_size(value, option))


def _parse_positive_int(value: Any, option: str) -> int:
    v = -1
    if isinstance(value, int) and not isinstance(value, bool):
        v = value
    elif _ascii_digits(value):
        v = int(value.strip())
    if not 1 <= v < 1 << 31:
        raise ValueError(f"cxlalloc option '{option}': {_short(value)} is not a positive integer (1 .. 2**31-1)")
    return v


def _parse_chunk(value: Any, option: str) -> Optional[int]:
    if value is None:
        return None
    n = parse_size(value, option)
    if not 0 < n <= 1 << 30:
        raise ValueError(f"cxlalloc option '{option}': {value!r} must be between 1 byte and 1 GiB (it is rounded up "
                         "to a multiple of the VMM granularity, 2 MiB on current GPUs)")
    return n


def _parse_sim_vram(value: Any, option: str) -> Optional[int]:
    if value is None:
        return None
    n = parse_size(value, option)
    if not 256 << 20 <= n <= 1 << 50:
        raise ValueError(f"cxlalloc option '{option}': {value!r} must be between 256MiB and 1PiB "
                         "(the simulated GPU's VRAM; lazily backed)")
    return n


def _parse_kv_store(value: Any, option: str) -> Optional[str]:
    """``kv_store`` in CXLALLOC: where ``cxlalloc.hf.wrap`` keeps reusable KV
    (``local``, ``unix:///path/kv.sock``, ``redis://host:port/db``); False/off: none."""
    text = str(value).strip()
    if text.lower() in ("0", "false", "off", "no", "none", ""):
        return None
    if text.startswith(("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")):
        # the whole URL now (host, port, db, query options), not when the store is opened after a model load
        from cxlalloc.kvstore.tiers.redis_format import check_url  # no torch, no redis connection

        return check_url(text, option)
    if text.lower() in ("1", "true", "on", "yes", "local") or text.startswith("unix://"):
        return text
    raise ValueError(f"cxlalloc option '{option}': {value!r} is not allowed; use local, unix:///path/kv.sock (a "
                     "cxlalloc kv-server), redis://host:port/db or rediss://... (a Redis tier below a local store), "
                     "redis+cluster://host:port (a Redis/Valkey Cluster below a local store), "
                     "or off")


def _parse_path(value: Any, option: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ValueError(f"cxlalloc option '{option}': {value!r} is not a file path (e.g. 'libcuda.so.1')")
    return os.fspath(value)


@dataclasses.dataclass(frozen=True)
class Config:
    """Validated options (see the module docstring for units).

    Attributes:
        device_limit: VRAM cxlalloc may hold: bytes (int), a fraction of the
            GPU's VRAM (float), or None for "all free VRAM at start minus
            256 MiB for the CUDA context and libraries".
        host_limit: bytes on the host tier; None = 80% of the host node's
            free memory at start; 0 disables spilling.
        numa_node: host NUMA node of the host tier, or "auto" (a CPU-less
            node near the GPU if any, else the GPU's nearest node).
        backend: host-tier backend: "auto", "host-vmm", "managed", "pinned".
        kv_device_limit: KV cache bytes allowed in VRAM (bytes, or fraction
            of device_limit); None = no separate quota.
        device_headroom: VRAM a KV placement must leave free for activations
            (bytes, or fraction of device_limit); default 5% of device_limit.
        migration_rate: bytes/s budget for demotion + promotion (token
            bucket, burst = half a second's worth, at least 1 GiB); 0 disables.
        promote_after: uses of a demoted chunk before it may be promoted back.
        extent_chunk: bytes per KV extent chunk (None: the VMM granularity).
        policy: "kv-aware" (default: KV quota, headroom, demotion of cold KV,
            promotion) or "first-fit" (the policy-free baseline: VRAM first
            come, first served, then the host tier; for comparisons).
        strict_placement: fail host allocations whose pages did not land on
            the chosen node (default: warn and count them in stats).
        simulate: use the simulated CUDA driver shipped with the package.
        sim_vram: VRAM of the simulated GPU (simulation only).
        libcuda: path of the CUDA driver library (default "libcuda.so.1").
        device: the CUDA device for single-device APIs (None: current);
            for ``enable()`` the GPU the options apply to (None: every GPU).
        spill_reserve: scoped mode only (``enable()`` after CUDA init): bytes
            (or a fraction of VRAM) of host memory pre-reserved for torch's
            use-on-OOM spill pool; None = min(host_limit, 25% of VRAM);
            0 = no spill pool.
        implicit_moves: who carries out a KV move the policy chooses for
            another request (demotion to make room, extent growth,
            rebalance): "owner" (default: the thread that allocated the
            block or last grew/touched the extent, at its next cxlalloc
            call; a move unmaps the address for a moment, so doing it under
            a thread that reads the memory would fault) or "any-thread"
            (at once, whoever triggered it: only for programs whose other
            threads never read or launch work on KV memory meanwhile).
        kv_store: where ``cxlalloc.hf.wrap`` keeps reusable KV blocks when
            its own ``kv_store`` is not given (``local``, ``unix:///path``,
            ``redis://...``); None = no reuse.  The engine ignores it.
    """

    device_limit: Union[int, float, None] = None
    host_limit: Optional[int] = None
    numa_node: Union[str, int] = "auto"
    backend: str = "auto"
    kv_device_limit: Union[int, float, None] = None
    device_headroom: Union[int, float, None] = None
    migration_rate: float = float(8 << 30)
    promote_after: int = 2
    extent_chunk: Optional[int] = None
    policy: str = "kv-aware"
    strict_placement: bool = False
    simulate: bool = False
    sim_vram: Optional[int] = None
    libcuda: str = "libcuda.so.1"
    device: Optional[int] = None
    spill_reserve: Union[int, float, None] = None
    kv_store: Optional[str] = None
    implicit_moves: str = "owner"
    # enable() only (make_enable_config): per-GPU values of PER_DEVICE_OPTIONS, as
    # ((option, "list" | "mapping", count, ((device, value), ...)), ...)
    per_device: tuple = ()


def _opt_size(v, name):
    return None if v is None else parse_size(v, name)


def _opt_size_or_fraction(v, name):
    return None if v is None else parse_size_or_fraction(v, name)


# name -> parser(value, name) -> parsed value
_PARSERS = {
    "device_limit": _opt_size_or_fraction,
    "host_limit": _opt_size,
    "numa_node": _parse_node,
    "backend": lambda v, n: _parse_choice(v, n, BACKENDS),
    "kv_device_limit": _opt_size_or_fraction,
    "device_headroom": _opt_size_or_fraction,
    "migration_rate": _parse_rate,
    "promote_after": _parse_positive_int,
    "extent_chunk": _parse_chunk,
    "policy": lambda v, n: _parse_choice(v, n, POLICIES),
    "strict_placement": _parse_bool,
    "simulate": _parse_bool,
    "sim_vram": _parse_sim_vram,
    "libcuda": _parse_path,
    "device": _parse_device,
    "spill_reserve": _opt_size_or_fraction,
    "kv_store": _parse_kv_store,
    "implicit_moves": lambda v, n: _parse_choice(v, n, IMPLICIT_MOVES),
}

OPTION_NAMES = tuple(_PARSERS)


def make_config(**options: Any) -> Config:
    """Validate keyword options into a :class:`Config`.

    Raises:
        ValueError: for an unknown option (listing the known ones) or a bad
            value (naming the option and its allowed values).
    """
    parsed = {}
    for name, value in options.items():
        if name not in _PARSERS:
            raise ValueError(f"cxlalloc: unknown option '{name}'; known options: {', '.join(OPTION_NAMES)}")
        if value is None and name not in ("device_limit", "host_limit", "kv_device_limit", "device_headroom",
                                           "extent_chunk", "sim_vram", "device", "spill_reserve"):
            continue
        parsed[name] = _PARSERS[name](value, name)
    return Config(**parsed)


# Options enable() takes per GPU: one value, a list (one per visible GPU) or a mapping by device index.
PER_DEVICE_OPTIONS = ("device_limit", "kv_device_limit", "host_limit", "numa_node", "device_headroom")


def _per_device_help(option: str) -> str:
    return (f"give one value for every GPU, a list with one value per visible GPU ({option}=['8GiB', '4GiB']), or a "
            f"mapping by device index ({option}={{0: '8GiB', 1: '4GiB'}}); in CXLALLOC: {option}:8GiB|4GiB or "
            f"{option}:0=8GiB|1=4GiB")


def _split_env_per_device(option: str, text: str):
    """``8GiB|4GiB`` -> a list, ``0=8GiB|1=4GiB`` -> a mapping (CXLALLOC's per-GPU forms)."""
    parts = [p.strip() for p in text.split("|")]
    if any(not p for p in parts):
        raise ValueError(f"cxlalloc option '{option}': {text!r} has an empty value; {_per_device_help(option)}")
    if all("=" in p for p in parts):
        pairs = [p.split("=", 1) for p in parts]
        keys = [k.strip() for k, _ in pairs]
        repeated = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if repeated is not None:  # dict() would keep the last value silently
            raise ValueError(f"cxlalloc option '{option}': {text!r} gives device {repeated!r} twice; "
                             f"{_per_device_help(option)}")
        return dict(pairs)
    if any("=" in p for p in parts):
        raise ValueError(f"cxlalloc option '{option}': {text!r} mixes device=value and plain values; "
                         f"{_per_device_help(option)}")
    return parts


def make_enable_config(**options: Any) -> Config:
    """:func:`make_config` for ``cxlalloc.enable()`` / ``CXLALLOC``: each of
    :data:`PER_DEVICE_OPTIONS` may also be a list (one value per visible GPU,
    in device order) or a mapping ``{device index or 'cuda:N': value}`` (GPUs
    not named get the option's default); from ``CXLALLOC`` the text forms
    ``8GiB|4GiB`` and ``0=8GiB|1=4GiB``.  Each value is validated as the
    option's own; the list's length and the mapping's devices are checked
    against the visible GPUs when enabling (:func:`check_per_device`).

    Raises:
        ValueError: a bad value (named ``option[i]`` / ``option[cuda:N]``), an
            empty list or mapping, a repeated device, or per-GPU values given
            with ``device`` (the message names the option and the allowed forms).
    """
    per = []
    plain = dict(options)
    for name in PER_DEVICE_OPTIONS:
        value = plain.get(name)
        if isinstance(value, str) and ("|" in value or "=" in value):
            value = _split_env_per_device(name, value)
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"cxlalloc option '{name}': an empty list; {_per_device_help(name)}")
            pairs = tuple((i, _PARSERS[name](v, f"{name}[{i}]")) for i, v in enumerate(value))
            per.append((name, "list", len(value), pairs))
        elif isinstance(value, dict):
            if not value:
                raise ValueError(f"cxlalloc option '{name}': an empty mapping; {_per_device_help(name)}")
            pairs, seen = [], set()
            for k, v in value.items():
                try:
                    d = _parse_device(k, name)
                except ValueError:
                    raise ValueError(f"cxlalloc option '{name}': the key {k!r} is not a device index (0, 1, ... or "
                                     f"'cuda:N'); {_per_device_help(name)}") from None
                if d in seen:
                    raise ValueError(f"cxlalloc option '{name}': cuda:{d} is given twice; {_per_device_help(name)}")
                seen.add(d)
                pairs.append((d, _PARSERS[name](v, f"{name}[cuda:{d}]")))
            per.append((name, "mapping", len(pairs), tuple(sorted(pairs))))
        elif value is not None and not isinstance(value, (str, int, float)):
            raise ValueError(f"cxlalloc option '{name}': {_short(value)} is not one value, a list or a mapping; "
                             f"{_per_device_help(name)}")
        else:
            continue
        plain.pop(name)
    cfg = make_config(**plain)
    if per and cfg.device is not None:
        raise ValueError(f"cxlalloc option 'device': cannot be combined with per-GPU values of "
                         f"{', '.join(p[0] for p in per)} (a list or mapping names the GPUs itself); leave out device")
    return dataclasses.replace(cfg, per_device=tuple(per)) if per else cfg


def check_per_device(cfg: Config, count: int) -> None:
    """Per-GPU values against the ``count`` visible GPUs.

    Raises:
        ValueError: a list whose length is not ``count``, or a mapping naming a
            device that is not visible (naming the option and the allowed forms).
    """
    for name, form, n, pairs in cfg.per_device:
        if form == "list" and n != count:
            raise ValueError(f"cxlalloc option '{name}': a list of {n} values for {count} visible GPU(s); "
                             f"{_per_device_help(name)}")
        bad = [d for d, _ in pairs if d >= count]
        if form == "mapping" and bad:
            raise ValueError(f"cxlalloc option '{name}': cuda:{bad[0]} is not a visible GPU (cuda:0..cuda:{count - 1} "
                             f"are); {_per_device_help(name)}")


def per_device_values(cfg: Config, device: int) -> dict:
    """The per-GPU values that apply to ``device`` (option -> parsed value)."""
    return {name: v for name, _, _, pairs in cfg.per_device for d, v in pairs if d == device}


def parse_env(value: Optional[str] = None) -> dict:
    """Parse the ``CXLALLOC`` environment variable into option kwargs.

    Args:
        value: the variable's text (default: ``os.environ["CXLALLOC"]``).
            ``"1"``/``"true"``/``"on"`` means defaults; ``"0"``/``""`` means
            off (returns None); otherwise ``key:value`` pairs separated by
            commas.

    Returns:
        dict of raw option values (validate with :func:`make_config`), or
        None when the variable asks for cxlalloc to stay off.

    Raises:
        ValueError: a malformed pair or an unknown key, naming it.
    """
    if value is None:
        value = os.environ.get("CXLALLOC", "")
    text = value.strip()
    if text.lower() in ("", "0", "false", "off", "no"):
        return None
    if text.lower() in ("1", "true", "on", "yes"):
        return {}
    out = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" not in part:
            raise ValueError(
                f"CXLALLOC: '{part}' is not key:value (e.g. CXLALLOC=device_limit:8GiB,numa_node:2); "
                f"known keys: {', '.join(OPTION_NAMES)}")
        key, val = (s.strip() for s in part.split(":", 1))
        if key not in _PARSERS:
            raise ValueError(f"CXLALLOC: unknown key '{key}'; known keys: {', '.join(OPTION_NAMES)}")
        if key in out:
            raise ValueError(f"CXLALLOC: key '{key}' is given twice ({out[key]!r} and {val!r})")
        out[key] = val
    return out


def resolve_fraction(value: Union[int, float, None], whole: int) -> Optional[int]:
    """Turn a parsed size-or-fraction into bytes of ``whole`` (None stays None)."""
    if value is None:
        return None
    if isinstance(value, float):
        return int(value * whole)
    return int(value)


def format_bytes(n: Optional[int]) -> str:
    """'1.50 GiB', '512.00 MiB', '123 B' (None -> 'n/a')."""
    if n is None:
        return "n/a"
    n = int(n)
    if abs(n) < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024.0
        if abs(v) < 1024.0 or unit == "PiB":
            return f"{v:.2f} {unit}"
    return f"{n} B"
