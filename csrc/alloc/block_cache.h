// The block cache: the free blocks of every block-cache segment, kept in
// best-fit order, split when a request takes less than a block and merged
// with free neighbours when a block comes back.
//
// torch's CUDACachingAllocator semantics (c10/cuda/CUDACachingAllocator.cpp;
// docs/sources.md#torch-size-classes): a free block is reused only within its
// pool, tier, class and pool kind (FreeListKey) and only on its own stream
// (BlockOrder); the smallest block that fits wins, the lowest address among
// equals; the split thresholds are alloc/sizes.h's should_split.
//
// It owns the Block objects of the segments it was given (add_segment ..
// remove_segment) but no memory, no driver and no accounting: DeviceAllocator
// decides when to call it and counts what it hands out.  Not thread-safe: the
// allocator's mutex guards it.
#pragma once

#include <cstddef>
#include <map>

#include "alloc/block.h"
#include "alloc/segment.h"

namespace cxl::alloc {

class BlockCache {
 public:
  BlockCache() = default;
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A new segment joins the cache as one free block covering it (its head,
  // on `stream`).  Returns that block.
  Block* add_segment(Segment* seg, CUstream stream);
  // A wholly free segment leaves the cache: its one block is unlisted and
  // deleted (seg->head becomes nullptr).  The caller checked fully_free().
  void remove_segment(Segment* seg);

  // Best fit: the smallest free block of at least `size` bytes on `stream`
  // in the free list `key` (lowest address among equal sizes); nullptr if
  // none.  Does not unlist it (take does).
  Block* find(const FreeListKey& key, CUstream stream, size_t size) const;
  // Unlist free block `b` and carve `size` bytes off its front: the
  // remainder becomes a new free block when should_split says so (>= 512 B
  // in the small pool, > 1 MiB in the large one), else `b` keeps it.
  // Returns `b`, still marked free: the caller marks it allocated.
  Block* take(Block* b, size_t size);
  // A freed block whose uses are complete comes back: merged with free
  // neighbours (those not waiting for events) and listed.
  void give_back(Block* b);

  // Unlist / relist a free block without merging (a segment changing tier
  // changes its blocks' key).
  void insert(Block* b);
  void erase(Block* b);

  bool contains(const Block* b) const;  // listed in its free list
  size_t listed() const;                // free blocks listed, all lists
  // Teardown: forget every list; the allocator deletes the blocks as it
  // walks its segments.
  void clear() { lists_.clear(); }

 private:
  static FreeListKey key_of(const Block* b);
  std::map<FreeListKey, FreeList> lists_;
};

}  // namespace cxl::alloc
