"""Messages a user reads from the Allocator: tier_of() of a tensor never prints
its values, an extent_chunk the engine rounds is said, and an out-of-memory
hint names the call that made the allocator, not CXLALLOC."""

import warnings

import pytest

import cxlalloc
from cxlalloc.engine import extent_chunk_message, oom_hint

torch = pytest.importorskip("torch")
MiB = 1 << 20


# ----------------------------------------------------------------- tier_of
def test_tier_of_a_tensor_of_this_allocator(make_alloc):
    a = make_alloc()
    t = a.tensor((256, 256), torch.float32)
    assert a.tier_of(t) == "device" == a.tier_of(t.data_ptr())


def test_tier_of_errors_never_print_the_tensor(make_alloc):
    a = make_alloc()
    foreign = torch.arange(100_000, dtype=torch.float32) + 0.5  # its repr would show "0.5000"
    with pytest.raises(ValueError) as e:
        a.tier_of(foreign)
    msg = str(e.value)
    assert "0.5000" not in msg and "tensor(" not in msg and len(msg) < 200, msg
    assert msg.startswith("cxlalloc: the storage of a torch.Tensor of shape (100000,) and dtype torch.float32 on cpu")
    assert msg.endswith("is not memory of this allocator")
    for bad in (foreign.numpy(), [1, 2, 3] * 1000):
        with pytest.raises(ValueError) as e:
            a.record_stream(0, bad)
        assert len(str(e.value)) < 200 and "0.5" not in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:
        a.free(foreign)
    assert "a torch.Tensor of shape (100000,)" in str(e.value) and "its .data_ptr()" in str(e.value)


def test_pytorch_tier_of_errors_never_print_the_tensor(make_alloc, monkeypatch):
    """cxlalloc.tier_of() (global/scoped mode) over a stand-in process state:
    the simulated engine of an Allocator serving "cuda:0" (monkeypatch after
    make_alloc: the state is restored before the leak check runs)."""
    from cxlalloc.pytorch import memory, state

    a = make_alloc()
    fake = state.State(mode="scoped", settings={}, source="test", config=a.config, engine=a._engine,
                       devices={0: {}})
    monkeypatch.setattr(state, "current", fake)
    t = torch.full((1000, 1000), 0.25)
    with pytest.raises(ValueError) as e:
        memory.tier_of(t, device=0)
    msg = str(e.value)
    assert "0.2500" not in msg and len(msg) < 300, msg
    assert msg.startswith("cxlalloc.tier_of: the storage of a tensor of shape (1000, 1000) and dtype torch.float32")
    assert "not cxlalloc memory on cuda:0" in msg and "scoped mode" in msg
    with pytest.raises(ValueError, match="not CUDA memory"):
        memory.tier_of(t)  # a CPU tensor, no device given
    with pytest.raises(ValueError, match="a list is neither a tensor nor an address"):
        memory.tier_of([0.25] * 100)
    assert memory.tier_of(a.tensor((4,), torch.float32).data_ptr(), device=0) == "device"


# ----------------------------------------------------------------- extent_chunk
def test_extent_chunk_below_the_granularity_is_rounded_with_a_warning(make_alloc):
    with pytest.warns(UserWarning) as w:
        a = make_alloc(extent_chunk="4KiB")
    (msg,) = [str(x.message) for x in w if "extent_chunk" in str(x.message)]
    assert msg == ("cxlalloc option 'extent_chunk': 4.00 KiB is not a multiple of the allocation granularity "
                   "(2.00 MiB); KV extents commit chunks of 2.00 MiB (use a multiple of 2.00 MiB to silence this)")
    e = a.extent(8 * MiB)
    assert e.chunk_bytes == 2 * MiB  # what the warning said
    del e
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = make_alloc(extent_chunk="4MiB")  # a multiple: as given, no warning
        assert b.extent(8 * MiB).chunk_bytes == 4 * MiB


def test_extent_chunk_message_rule():
    info = {"device_granularity": 2 * MiB, "host_granularity": 2 * MiB}
    assert extent_chunk_message(None, info) is None and extent_chunk_message(6 * MiB, info) is None
    assert "chunks of 4.00 MiB" in extent_chunk_message(3 * MiB, info)
    assert "granularity (6.00 MiB)" in extent_chunk_message(MiB, {"device_granularity": 2 * MiB,
                                                                   "host_granularity": 3 * MiB})


# ----------------------------------------------------------------- out-of-memory hints
def test_oom_hint_names_the_allocator_call_not_cxlalloc(make_alloc):
    a = make_alloc(device_limit=4 * MiB, host_limit=0)
    with pytest.raises(cxlalloc.OutOfMemoryError) as e:
        a.malloc(64 * MiB)
    msg = str(e.value)
    assert "CXLALLOC" not in msg, msg
    assert msg.endswith(oom_hint('cxlalloc.Allocator(..., host_limit="64GiB")'))
    assert msg.endswith('Raise host_limit or device_limit where this allocator is made (e.g. '
                        'cxlalloc.Allocator(..., host_limit="64GiB")).')


def test_enable_names_enable_and_the_variable_keeps_cxlalloc():
    from cxlalloc.pytorch.devices import made_by

    assert made_by("cxlalloc.enable()") == 'cxlalloc.enable(..., host_limit="64GiB")'
    assert made_by("the CXLALLOC environment variable") is None  # the engine's own CXLALLOC=host_limit:... hint
