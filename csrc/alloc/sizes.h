// Size classes of the block cache, the same as torch's native caching
// allocator (c10/cuda/CUDACachingAllocator.cpp; docs/sources.md
// #torch-size-classes) so that fragmentation behaves as users know it:
//   requests round up to 512 B; <= 1 MiB goes to the small pool, packed in
//   2 MiB segments; 1-10 MiB requests get a 20 MiB segment; larger ones a
//   segment rounded up to 2 MiB.  A free remainder is split off a block if it
//   is >= 512 B (small pool) or > 1 MiB (large pool).
#pragma once

#include <cstddef>

#include "common/units.h"

namespace cxl::alloc {

constexpr size_t kMinBlockSize = 512;
constexpr size_t kSmallSize = 1 * MiB;
constexpr size_t kSmallSegment = 2 * MiB;
constexpr size_t kMinLargeAlloc = 10 * MiB;
constexpr size_t kLargeSegment = 20 * MiB;
constexpr size_t kLargeSegmentRound = 2 * MiB;

// 0 when n is so large that rounding overflows.
inline size_t round_size(size_t n) { return n < kMinBlockSize ? kMinBlockSize : round_up(n, kMinBlockSize); }

inline size_t alloc_segment_size(size_t rounded) {
  if (rounded <= kSmallSize) return kSmallSegment;
  if (rounded < kMinLargeAlloc) return kLargeSegment;
  return round_up(rounded, kLargeSegmentRound);
}

inline bool should_split(size_t block_size, size_t size, bool small) {
  size_t remaining = block_size - size;
  return small ? remaining >= kMinBlockSize : remaining > kSmallSize;
}

}  // namespace cxl::alloc
