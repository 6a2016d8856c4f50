// A segment: one contiguous GPU virtual address range obtained from a tier.
//
// Block-cache segments hold blocks of one class, one pool kind and one
// stream (like torch's segments) and are always uniformly placed: all their
// chunks live on one tier, and demotion/promotion moves the whole segment.
// Extent segments (growable KV buffers) reserve a large range and commit
// chunks on demand; each chunk is placed independently, so old KV can live
// on the host tier while recent KV stays in VRAM under one contiguous view.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/host_pages.h"
#include "common/types.h"
#include "driver/resources.h"

namespace cxl::alloc {

struct Block;

enum class Backing : uint8_t {
  Vmm,        // VA reservation + per-chunk cuMemCreate handles (device or HOST_NUMA)
  DeviceMem,  // cuMemAlloc (GPU without VMM): device tier only, fixed
  Managed,    // cuMemAllocManaged with per-chunk preferred location
  Pinned,     // mmap + mbind + cuMemHostRegister: host tier only, fixed
};
const char* backing_name(Backing b);

struct Chunk {
  size_t offset = 0;
  size_t size = 0;
  Tier tier = Tier::Device;
  bool committed = false;       // physically backed (extents commit lazily)
  driver::PhysicalMemory phys;  // Backing::Vmm only; released after `map`
  driver::Mapping map;          // Backing::Vmm only; unmapped first
  uint64_t seq = 0;             // commit order across the allocator: smaller is older
  uint32_t touches = 0;         // uses since the last migration (promotion rule)
  uint64_t last_touch = 0;      // sequence number of the last use (extent_touch)
  // Host placement as verified after commit: bytes on the chosen node,
  // elsewhere, and unverifiable.  Never assumed.
  size_t placed_ok = 0, placed_wrong = 0, placed_unknown = 0;
};

class Segment {
 public:
  uint64_t id = 0;
  int device = 0;
  AllocClass cls = AllocClass::Other;
  PoolKind kind = PoolKind::Large;
  PoolId pool;
  CUstream stream = nullptr;
  bool extent = false;
  Backing backing = Backing::Vmm;
  CUdeviceptr base = 0;
  size_t size = 0;

  // Declaration order is destruction order in reverse: chunks (unmap, then
  // release) go before the VA reservation; the registration before the pages.
  driver::VaRange va;
  driver::ManagedMemory managed;
  driver::DeviceMemory devmem;
  backend::HostPages pages;
  driver::HostRegistration reg;
  std::vector<Chunk> chunks;

  Block* head = nullptr;   // first block (block-cache segments)
  size_t allocated = 0;    // bytes of live blocks (or committed bytes for an extent)
  uint64_t last_use = 0;   // allocator sequence number of the last allocation/touch
  uint32_t touches = 0;    // allocations served since the last migration
  bool in_migration = false;

  Tier tier() const { return chunks.empty() ? Tier::Device : chunks.front().tier; }
  // Committed bytes on a tier.
  size_t bytes_on(Tier t) const;
  // The chunk holding `offset`, or nullptr.
  const Chunk* chunk_at(size_t offset) const;
  Chunk* chunk_at(size_t offset);
  bool contains(CUdeviceptr p) const { return p >= base && p < base + size; }
  bool fully_free() const;  // block segment with one free block covering it
};

}  // namespace cxl::alloc
