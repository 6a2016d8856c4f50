"""torch tensors whose storage comes from the tiered allocator (DLPack)."""

import gc

import pytest
import torch

MiB = 1 << 20


def test_tensor_storage_comes_from_the_allocator_and_is_freed_with_it(make_alloc):
    a = make_alloc(device_limit=16 * MiB)
    t = a.tensor((1024, 1024), torch.float32)  # 4 MiB
    assert t.shape == (1024, 1024) and t.dtype == torch.float32
    assert a.tier_of(t.data_ptr()) == "device"
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * 1024 * 1024
    big = a.tensor((4, 1024, 1024), torch.float32, tag="kv")  # 16 MiB: no longer fits the device
    assert a.tier_of(big.data_ptr()) == "host"
    big.copy_(torch.arange(4 * 1024 * 1024, dtype=torch.float32).view(4, 1024, 1024))
    assert float(big[3, 1023, 1023]) == 4 * 1024 * 1024 - 1
    s = a.stats()
    assert s["other"]["device_bytes"] == 4 * MiB and s["kv"]["host_bytes"] == 16 * MiB
    view = big[1]  # a view keeps the storage alive
    del big
    gc.collect()
    assert a.stats()["kv"]["host_bytes"] == 16 * MiB
    del view, t
    gc.collect()
    s = a.stats()
    assert s["kv"]["host_bytes"] == 0 and s["other"]["device_bytes"] == 0
    assert s["frees"] == 2


def test_tensor_dtypes_and_empty_shapes(make_alloc):
    a = make_alloc()
    for dt in (torch.float16, torch.bfloat16, torch.int64, torch.uint8):
        t = a.tensor((3, 5), dt)
        assert t.dtype == dt and t.shape == (3, 5)
        t.zero_()
    e = a.tensor((0, 7), torch.float32)
    assert e.shape == (0, 7)


def test_free_of_a_tensor_owned_pointer_is_refused(make_alloc):
    """A raw free() of the block a live tensor owns would leave the tensor
    reading whatever is allocated there next (a use-after-free): refused,
    nothing changed; the tensor frees it when it dies."""
    import cxlalloc
    import numpy as np

    a = make_alloc()
    t = a.tensor((1000,), torch.float32)
    t.fill_(7.0)
    with pytest.raises(cxlalloc.InvalidFreeError, match="a live tensor owns"):
        a.free(t.data_ptr())
    q = a.malloc(4000)
    assert q != t.data_ptr() and float(t.sum()) == 7000.0
    s = a.stats()
    assert s["invalid_frees"] == 1 and s["frees"] == 0
    del t
    gc.collect()
    a.free(q)
    s = a.stats()
    assert s["frees"] == 2 and s["device"]["allocated_bytes"] == 0
    a.check_invariants()
    # Any integer type is a dimension (NumPy, 0-d tensors); bools and floats are not.
    assert a.tensor((np.int64(3), torch.tensor(2)), torch.uint8).shape == (3, 2)
    for bad in ((True,), (2.0,), (-1,)):
        with pytest.raises(ValueError, match="must be non-negative ints"):
            a.tensor(bad)
