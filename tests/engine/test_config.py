"""Option parsing and validation (cxlalloc.config)."""

import pytest

from cxlalloc.config import make_config, parse_env, parse_size, parse_size_or_fraction

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("4096", 4096), ("512MiB", 512 * MiB), ("8GiB", 8 * GiB), ("1.5GiB", 3 * GiB // 2),
    ("4KiB", 4096), ("2TiB", 2 << 40), ("8GB", 8_000_000_000), ("10MB", 10_000_000), ("100B", 100),
    (" 64 MiB ", 64 * MiB), ("64mib", 64 * MiB),
])
def test_sizes(text, expected):
    assert parse_size(text, "host_limit") == expected


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-1", -5, "1e3", True, None, 3.5, "GiB", "0.5", "1.5B"])
def test_bad_sizes_name_the_option(bad):
    with pytest.raises(ValueError, match="cxlalloc option 'host_limit'") as e:
        parse_size(bad, "host_limit")
    assert "512MiB" in str(e.value)


def test_fractions_and_percentages():
    assert parse_size_or_fraction(0.5, "device_limit") == 0.5
    assert parse_size_or_fraction("25%", "device_limit") == 0.25
    assert parse_size_or_fraction("0.75", "device_limit") == 0.75
    assert parse_size_or_fraction("8GiB", "device_limit") == 8 * GiB
    assert parse_size_or_fraction(1, "device_limit") == 1  # an int is bytes
    for bad in (0.0, 1.5, "150%", "0%", "x%"):
        with pytest.raises(ValueError, match="'device_limit'"):
            parse_size_or_fraction(bad, "device_limit")


def test_make_config_validates_every_option():
    c = make_config(device_limit="50%", host_limit="64GiB", numa_node="2", backend="managed",
                    kv_device_limit=0.25, device_headroom="1GiB", migration_rate="4GiB", promote_after=3,
                    extent_chunk="4MiB", strict_placement="true", simulate="1", sim_vram="2GiB",
                    libcuda="/x/libcuda.so.1", device="cuda:1")
    assert c.device_limit == 0.5 and c.host_limit == 64 * GiB and c.numa_node == 2
    assert c.backend == "managed" and c.kv_device_limit == 0.25 and c.device_headroom == GiB
    assert c.migration_rate == 4 * GiB and c.promote_after == 3 and c.extent_chunk == 4 * MiB
    assert c.strict_placement and c.simulate and c.sim_vram == 2 * GiB and c.device == 1


@pytest.mark.parametrize("kw,match", [
    (dict(backend="fast"), "allowed: auto, host-vmm, managed, pinned"),
    (dict(numa_node=-1), "'numa_node'.*'auto' or a node id"),
    (dict(numa_node="near"), "'numa_node'"),
    (dict(promote_after=0), "'promote_after'.*positive integer"),
    (dict(strict_placement="maybe"), "'strict_placement'.*boolean"),
    (dict(device="gpu0"), "'device'.*CUDA ordinal"),
    (dict(devicelimit="1GiB"), "unknown option 'devicelimit'; known options: device_limit"),
])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        make_config(**kw)


def test_parse_env_forms():
    assert parse_env("1") == {} and parse_env("true") == {}
    assert parse_env("") is None and parse_env("0") is None and parse_env("off") is None
    assert parse_env("device_limit:8GiB,numa_node:2,backend:managed") == {
        "device_limit": "8GiB", "numa_node": "2", "backend": "managed"}
    with pytest.raises(ValueError, match="CXLALLOC: unknown key 'limit'"):
        parse_env("limit:8GiB")
    with pytest.raises(ValueError, match="is not key:value"):
        parse_env("device_limit=8GiB")
    # env values validate like kwargs
    with pytest.raises(ValueError, match="'device_limit'"):
        make_config(**parse_env("device_limit:lots"))
