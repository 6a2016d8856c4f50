#include "backend/segment_memory.h"

namespace cxl::backend {

const char* backing_name(Backing b) {
  switch (b) {
    case Backing::Vmm: return "vmm";
    case Backing::DeviceMem: return "cuMemAlloc";
    case Backing::Managed: return "managed";
    case Backing::Pinned: return "pinned";
  }
  return "?";
}

size_t SegmentMemory::bytes_on(Tier t) const {
  size_t n = 0;
  for (const auto& c : chunks)
    if (c.committed && c.tier == t) n += c.size;
  return n;
}

const Chunk* SegmentMemory::chunk_at(size_t offset) const {
  // Chunks are equal-sized except possibly the last; index directly.
  if (chunks.empty() || offset >= size) return nullptr;
  size_t idx = offset / chunks.front().size;
  if (idx >= chunks.size()) idx = chunks.size() - 1;
  return &chunks[idx];
}

Chunk* SegmentMemory::chunk_at(size_t offset) {
  return const_cast<Chunk*>(static_cast<const SegmentMemory*>(this)->chunk_at(offset));
}

}  // namespace cxl::backend
