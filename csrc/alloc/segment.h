// A segment: one contiguous GPU virtual address range obtained from a tier.
//
// Block-cache segments hold blocks of one class, one pool kind and one
// stream (like torch's segments) and are always uniformly placed: all their
// chunks live on one tier, and demotion/promotion moves the whole segment.
// Extent segments (growable KV buffers) reserve a large range and commit
// chunks on demand; each chunk is placed independently, so old KV can live
// on the host tier while recent KV stays in VRAM under one contiguous view.
//
// The physical memory (range, backing, chunks) is backend::SegmentMemory,
// which the backend's SegmentFactory fills; this adds what the allocator
// keeps about it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <thread>

#include "backend/segment_memory.h"
#include "common/types.h"

namespace cxl::alloc {

struct Block;

using backend::Backing;
using backend::backing_name;
using backend::Chunk;

class Segment : public backend::SegmentMemory {
 public:
  uint64_t id = 0;
  AllocClass cls = AllocClass::Other;
  PoolKind kind = PoolKind::Large;
  PoolId pool;
  CUstream stream = nullptr;
  bool extent = false;

  Block* head = nullptr;   // first block (block-cache segments)
  size_t allocated = 0;    // bytes of live blocks (or committed bytes for an extent)
  uint64_t last_use = 0;   // allocator sequence number of the last allocation/touch
  uint32_t touches = 0;    // allocations served since the last migration
  bool in_migration = false;
  // Extents: the thread that last created, grew or touched it, the only one
  // allowed to move its chunks implicitly (device_allocator_owners.cpp).
  std::thread::id owner;

  bool fully_free() const;  // block segment with one free block covering it
  // A free block still waits for stream events (a stream-ordered free): its
  // memory may be in use on a stream, so the segment must not move yet.
  bool has_event_pending_frees() const;
};

}  // namespace cxl::alloc
