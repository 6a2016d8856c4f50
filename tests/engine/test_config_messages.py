"""Option parsing and validation (cxlalloc.config), exact texts: every key,
every unit, the bad values with their exact messages, and the CXLALLOC
variable's forms (test_config.py checks the rules).

These messages are user interface: the start-up hook prints them as its one
error line, so a change here is a change users see.
"""

import pytest

from cxlalloc.config import (OPTION_NAMES, Config, format_bytes, make_config, parse_env, parse_size,
                             parse_size_or_fraction, resolve_fraction)

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
SIZE_HELP = "bytes (int) or a size string like '512MiB', '8GiB', '1.5TiB', '8GB'"
FRACTION_HELP = f"{SIZE_HELP}, or a fraction of VRAM: a float in (0, 1] or a percentage like '50%'"
KEYS = ("device_limit, host_limit, numa_node, backend, kv_device_limit, device_headroom, migration_rate, "
        "promote_after, extent_chunk, policy, strict_placement, simulate, sim_vram, libcuda, device, spill_reserve, "
        "kv_store, implicit_moves")


def test_option_names_are_the_documented_set():
    assert ", ".join(OPTION_NAMES) == KEYS


@pytest.mark.parametrize("text,expected", [
    (0, 0), (4096, 4096), ("4096", 4096), ("100B", 100), ("100b", 100),
    ("4KiB", 4 * KiB), ("512MiB", 512 * MiB), ("512 MiB", 512 * MiB), ("8GiB", 8 * GiB), ("8gib", 8 * GiB),
    ("1.5TiB", int(1.5 * TiB)), (".5GiB", GiB // 2), ("2KB", 2000), ("8GB", 8 * 10**9), ("3MB", 3 * 10**6),
    ("2TB", 2 * 10**12), ("1PiB", 1 << 50), ("1PB", 10**15),  # every unit format_bytes prints parses back
])
def test_sizes_and_units(text, expected):
    assert parse_size(text, "host_limit") == expected


@pytest.mark.parametrize("bad", ["8Gx", "abc", "", "-1GiB", "1e3", "GiB", "5 X"])
def test_bad_size_strings_name_the_option(bad):
    with pytest.raises(ValueError) as e:
        parse_size(bad, "host_limit")
    assert str(e.value) == f"cxlalloc option 'host_limit': {bad!r} is not a size; use {SIZE_HELP}"


def test_negative_and_boolean_sizes():
    with pytest.raises(ValueError) as e:
        parse_size(-5, "extent_chunk")
    assert str(e.value) == f"cxlalloc option 'extent_chunk': -5 is negative; use {SIZE_HELP}"
    with pytest.raises(ValueError) as e:
        parse_size(True, "sim_vram")
    assert str(e.value) == f"cxlalloc option 'sim_vram': True is not a size; use {SIZE_HELP}"


@pytest.mark.parametrize("value,expected", [
    (0.5, 0.5), (1.0, 1.0), ("50%", 0.5), ("100%", 1.0), ("12.5%", 0.125), ("0.25", 0.25), ("1.0", 1.0),
    (1, 1), ("8GiB", 8 * GiB), (3 * GiB, 3 * GiB),
])
def test_size_or_fraction(value, expected):
    got = parse_size_or_fraction(value, "device_limit")
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value,message", [
    (1.5, "1.5 is not a fraction in (0, 1]"),
    (0.0, "0.0 is not a fraction in (0, 1]"),
    ("150%", "'150%' is not a percentage in (0, 100]"),
    ("0%", "'0%' is not a percentage in (0, 100]"),
    ("x%", "'x%' is not a percentage in (0, 100]"),
    ("2.5", "2.5 is not a fraction in (0, 1]"),
    ("lots", "'lots' is not a size or fraction"),
    (-1, "-1 is negative"),
])
def test_bad_size_or_fraction(value, message):
    with pytest.raises(ValueError) as e:
        parse_size_or_fraction(value, "device_limit")
    assert str(e.value) == f"cxlalloc option 'device_limit': {message}; use {FRACTION_HELP}"


def test_every_key_parses():
    cfg = make_config(device_limit="50%", host_limit="64GiB", numa_node="2", backend="managed",
                      kv_device_limit=0.25, device_headroom="1GiB", migration_rate="4GiB", promote_after="3",
                      extent_chunk="2MiB", policy="first-fit", strict_placement="yes", simulate="0", sim_vram="24GiB",
                      libcuda="/opt/cuda/libcuda.so.1", device="cuda:1", spill_reserve="10%")
    assert cfg == Config(device_limit=0.5, host_limit=64 * GiB, numa_node=2, backend="managed", kv_device_limit=0.25,
                         device_headroom=GiB, migration_rate=float(4 * GiB), promote_after=3, extent_chunk=2 * MiB,
                         policy="first-fit", strict_placement=True, simulate=False, sim_vram=24 * GiB, libcuda="/opt/cuda/libcuda.so.1",
                         device=1, spill_reserve=0.1)


def test_defaults():
    cfg = make_config()
    assert cfg == Config()
    assert (cfg.device_limit, cfg.host_limit, cfg.numa_node, cfg.backend) == (None, None, "auto", "auto")
    assert (cfg.migration_rate, cfg.promote_after, cfg.strict_placement, cfg.simulate) == (float(8 * GiB), 2, False,
                                                                                         False)
    assert (cfg.libcuda, cfg.device, cfg.spill_reserve) == ("libcuda.so.1", None, None)
    # None keeps the default for options that have one
    assert make_config(backend=None, numa_node=None, promote_after=None) == Config()


@pytest.mark.parametrize("kwargs,message", [
    ({"numa_node": "x"}, "cxlalloc option 'numa_node': 'x' is not a NUMA node; use 'auto' or a node id 0..1023 (Linux's MAX_NUMNODES limit; the node must also exist here)"),
    ({"numa_node": -1}, "cxlalloc option 'numa_node': -1 is not a NUMA node; use 'auto' or a node id 0..1023 (Linux's MAX_NUMNODES limit; the node must also exist here)"),
    ({"numa_node": True}, "cxlalloc option 'numa_node': True is not a NUMA node; use 'auto' or a node id 0..1023 (Linux's MAX_NUMNODES limit; the node must also exist here)"),
    ({"backend": "cuda"}, "cxlalloc option 'backend': 'cuda' is not allowed; allowed: auto, host-vmm, managed, pinned"),
    ({"promote_after": 0}, "cxlalloc option 'promote_after': 0 is not a positive integer (1 .. 2**31-1)"),
    ({"promote_after": "two"}, "cxlalloc option 'promote_after': 'two' is not a positive integer (1 .. 2**31-1)"),
    ({"promote_after": 2.7}, "cxlalloc option 'promote_after': 2.7 is not a positive integer (1 .. 2**31-1)"),
    ({"strict_placement": "maybe"},
     "cxlalloc option 'strict_placement': 'maybe' is not a boolean; use true/false (or 1/0)"),
    ({"simulate": 2}, "cxlalloc option 'simulate': 2 is not a boolean; use true/false (or 1/0)"),
    ({"device": "gpu0"},
     "cxlalloc option 'device': 'gpu0' is not a device; use a CUDA ordinal (0, 1, ...) or 'cuda:N'"),
    ({"device": -1}, "cxlalloc option 'device': -1 is not a device; use a CUDA ordinal (0, 1, ...) or 'cuda:N'"),
    ({"migration_rate": "fast"}, f"cxlalloc option 'migration_rate': 'fast' is not a size; use {SIZE_HELP}"),
    ({"host_limit": "lots"}, f"cxlalloc option 'host_limit': 'lots' is not a size; use {SIZE_HELP}"),
    ({"extent_chunk": "2MB?"}, f"cxlalloc option 'extent_chunk': '2MB?' is not a size; use {SIZE_HELP}"),
    ({"sim_vram": "big"}, f"cxlalloc option 'sim_vram': 'big' is not a size; use {SIZE_HELP}"),
    ({"kv_device_limit": "200%"},
     f"cxlalloc option 'kv_device_limit': '200%' is not a percentage in (0, 100]; use {FRACTION_HELP}"),
    ({"device_headroom": 2.0},
     f"cxlalloc option 'device_headroom': 2.0 is not a fraction in (0, 1]; use {FRACTION_HELP}"),
    ({"spill_reserve": "some"},
     f"cxlalloc option 'spill_reserve': 'some' is not a size or fraction; use {FRACTION_HELP}"),
    ({"policy": "lru"}, "cxlalloc option 'policy': 'lru' is not allowed; allowed: kv-aware, first-fit"),
    ({"bogus": 1}, f"cxlalloc: unknown option 'bogus'; known options: {KEYS}"),
])
def test_bad_values_exact_messages(kwargs, message):
    with pytest.raises(ValueError) as e:
        make_config(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "yes", " 1 "])
def test_env_on_means_defaults(value):
    assert parse_env(value) == {}


@pytest.mark.parametrize("value", ["", "0", "false", "off", "no", "  "])
def test_env_off(value):
    assert parse_env(value) is None


def test_env_pairs():
    assert parse_env("device_limit:8GiB,numa_node:2,backend:managed") == {
        "device_limit": "8GiB", "numa_node": "2", "backend": "managed"}
    # spaces and empty items are tolerated; the first ':' splits (device:cuda:1)
    assert parse_env(" device_limit : 50% , ,device:cuda:1,") == {"device_limit": "50%", "device": "cuda:1"}
    cfg = make_config(**parse_env("device_limit:0.5,host_limit:64GiB,strict_placement:1,spill_reserve:0"))
    assert (cfg.device_limit, cfg.host_limit, cfg.strict_placement, cfg.spill_reserve) == (0.5, 64 * GiB, True, 0)


def test_env_reads_the_variable(monkeypatch):
    monkeypatch.setenv("CXLALLOC", "host_limit:1GiB")
    assert parse_env() == {"host_limit": "1GiB"}
    monkeypatch.delenv("CXLALLOC")
    assert parse_env() is None


def test_env_malformed_pair():
    with pytest.raises(ValueError) as e:
        parse_env("device_limit=8GiB")
    assert str(e.value) == ("CXLALLOC: 'device_limit=8GiB' is not key:value (e.g. CXLALLOC=device_limit:8GiB,"
                            f"numa_node:2); known keys: {KEYS}")


def test_env_unknown_key():
    with pytest.raises(ValueError) as e:
        parse_env("device_limit:8GiB,devise:1")
    assert str(e.value) == f"CXLALLOC: unknown key 'devise'; known keys: {KEYS}"


def test_resolve_fraction_and_format():
    assert resolve_fraction(None, 100) is None
    assert resolve_fraction(0.25, 80 * GiB) == 20 * GiB
    assert resolve_fraction(3 * GiB, 80 * GiB) == 3 * GiB
    assert [format_bytes(n) for n in (None, 0, 1023, 1024, 1536 * MiB, 3 * TiB)] == [
        "n/a", "0 B", "1023 B", "1.00 KiB", "1.50 GiB", "3.00 TiB"]
