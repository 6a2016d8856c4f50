// The physical side of a segment: its GPU virtual address range and the
// memory behind it, chunk by chunk, each chunk on one tier.
//
// What a backend makes, commits and moves (backend/segment_factory.h).  The
// block cache's view of a segment (blocks, pool, stream, class) is
// alloc::Segment, which extends this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/host_pages.h"
#include "common/types.h"
#include "driver/resources.h"

namespace cxl::backend {

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

class SegmentMemory {
 public:
  int device = 0;
  Backing backing = Backing::Vmm;
  CUdeviceptr base = 0;
  size_t size = 0;

  // Declaration order is destruction order in reverse: chunks (unmap, then
  // release) go before the VA reservation; the registration before the pages.
  driver::VaRange va;
  driver::ManagedMemory managed;
  driver::DeviceMemory devmem;
  HostPages pages;
  driver::HostRegistration reg;
  std::vector<Chunk> chunks;

  Tier tier() const { return chunks.empty() ? Tier::Device : chunks.front().tier; }
  // Committed bytes on a tier.
  size_t bytes_on(Tier t) const;
  // The chunk holding `offset`, or nullptr.
  const Chunk* chunk_at(size_t offset) const;
  Chunk* chunk_at(size_t offset);
  bool contains(CUdeviceptr p) const { return p >= base && p < base + size; }
};

}  // namespace cxl::backend
