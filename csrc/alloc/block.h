// A block: a sub-range of a block-cache segment, allocated or free.
//
// Same semantics as torch's CUDACachingAllocator blocks: blocks of one
// segment form a doubly linked list in address order; a free block is merged
// with free neighbours; a block freed while other streams used it
// (record_stream) waits for events on those streams before it can be reused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <thread>

#include "alloc/segment.h"
#include "common/types.h"

namespace cxl::alloc {

struct Block {
  Segment* segment = nullptr;
  CUdeviceptr ptr = 0;
  size_t size = 0;       // rounded size (what accounting counts)
  size_t requested = 0;  // what the caller asked for
  CUstream stream = nullptr;
  bool allocated = false;
  // Owned by a tensor (a DLPack export): only that tensor's deleter frees it,
  // so a user's free() of the pointer cannot leave the tensor dangling.
  bool owned = false;
  int event_count = 0;  // outstanding events before a freed block is reusable
  std::set<CUstream> stream_uses;
  Block* prev = nullptr;
  Block* next = nullptr;
  uint64_t seq = 0;  // allocation sequence number
  // The thread that allocated it: the one that uses it, so the only one
  // allowed to move it implicitly (device_allocator_owners.cpp).
  std::thread::id owner;
};

// Key of a free list: blocks are only reused within one pool, tier, class
// and pool kind.
struct FreeListKey {
  PoolId pool;
  Tier tier = Tier::Device;
  AllocClass cls = AllocClass::Other;
  PoolKind kind = PoolKind::Large;
  bool operator<(const FreeListKey& o) const {
    if (!(pool == o.pool)) return pool < o.pool;
    if (tier != o.tier) return tier < o.tier;
    if (cls != o.cls) return cls < o.cls;
    return kind < o.kind;
  }
};

// Best-fit order within a free list: stream first (a block is reused only on
// its own stream), then size, then address (deterministic, low addresses first).
struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return reinterpret_cast<uintptr_t>(a->stream) < reinterpret_cast<uintptr_t>(b->stream);
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

using FreeList = std::set<Block*, BlockOrder>;

}  // namespace cxl::alloc
