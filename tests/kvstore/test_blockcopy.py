"""The streaming copy into pool slots (csrc/kvstore/stream_copy.cpp, cxlalloc.kvstore.blockcopy):
bit-exact for any size and alignment, with streaming stores and with the memcpy fallback."""

import pytest
import torch

from cxlalloc import _C
from cxlalloc.kvstore.blockcopy import streaming_available, write_blocks


@pytest.mark.parametrize("allow_stream", [True, False])
def test_copies_are_bit_exact_at_unaligned_sizes_and_offsets(allow_stream):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    cases = [(0, 0, 4096), (1, 3, 4096 + 1), (15, 7, 65536 - 5), (8, 9, 100_003), (3, 0, 63), (0, 1, 4095),
             (17, 33, 5000)]
    dsts, srcs, sizes = [], [], []
    at = 0
    for d_off, s_off, n in cases:
        dsts.append(dst.data_ptr() + at + d_off)
        srcs.append(src.data_ptr() + s_off)
        sizes.append(n)
        at += d_off + n + 64
    streamed = _C.stream_copy_many(dsts, srcs, sizes, allow_stream)
    # >= 4 KiB copies stream where the CPU has SSE2 (x86-64 always): 5 of the 7 cases here
    assert streamed == (5 if allow_stream and streaming_available() else 0)
    at = 0
    for d_off, s_off, n in cases:
        assert torch.equal(dst[at + d_off:at + d_off + n], src[s_off:s_off + n]), (d_off, s_off, n)
        assert not dst[at + d_off + n:at + d_off + n + 64].any()  # nothing written past the end
        if d_off:
            assert not dst[at:at + d_off].any()                    # nor before the start
        at += d_off + n + 64


def test_mismatched_lists_are_refused():
    with pytest.raises(ValueError, match="same length"):
        _C.stream_copy_many([0, 0], [0], [0, 0], True)


def test_write_blocks_falls_back_to_copy_for_non_contiguous_and_checks_sizes():
    dst = torch.zeros(3, 8192, dtype=torch.uint8)
    views = list(dst.unbind(0))
    a = torch.arange(8192, dtype=torch.int32).to(torch.uint8)
    b = torch.arange(2 * 8192, dtype=torch.int32).to(torch.uint8)[::2]   # non-contiguous
    c = torch.arange(4096, dtype=torch.int16).view(64, 64)                 # another dtype and shape
    assert write_blocks(views, [a, b, c]) == 3
    assert torch.equal(views[0], a) and torch.equal(views[1], b)
    assert torch.equal(views[2].view(torch.int16).view(64, 64), c)
    assert write_blocks([views[0], None], [None, a]) == 0
    with pytest.raises(ValueError, match="2 sources for 3 slots"):
        write_blocks(views, [a, b])
    with pytest.raises(ValueError, match="source 0 has 8191 bytes, its slot 8192"):
        write_blocks(views[:1], [a[:-1]])
