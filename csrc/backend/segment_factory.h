// Creates, commits and migrates segments' memory on one device, for each
// backing.  Knows the backends; knows nothing of blocks, budgets or policy
// (alloc::DeviceAllocator decides).
//
// Every method needs the device's primary context current (the caller holds
// a ContextGuard) and the allocator mutex (no internal locking).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "backend/backends.h"
#include "backend/placement.h"
#include "backend/segment_memory.h"
#include "driver/resources.h"

namespace cxl::backend {

struct FactoryConfig {
  int device = 0;
  int host_node = 0;                 // the host/CXL NUMA node of the host tier
  HostBackend host_backend = HostBackend::HostVmm;
  bool host_enabled = true;          // false: no host tier at all (host_limit 0 or unsupported)
  bool device_vmm = true;            // false: cuMemAlloc device segments
  size_t device_granularity = 2u << 20;
  size_t host_granularity = 2u << 20;
  bool strict_placement = false;     // misplaced host pages fail the allocation
};

class SegmentFactory {
 public:
  SegmentFactory(driver::DriverPtr drv, FactoryConfig cfg, NumaOps* numa);

  const FactoryConfig& config() const { return cfg_; }
  // Alignment every segment size is rounded to: a multiple of both tiers'
  // granularity so any VMM segment can migrate.
  size_t segment_alignment() const { return align_; }

  // Fill `seg` (fresh) with a block-cache segment of `size` bytes (a
  // multiple of segment_alignment) fully committed on `tier`; `cls` picks
  // the backing (KV is managed under the managed backend).  Throws
  // DriverError / OutOfMemoryError; what was made is then released with
  // `seg`.
  void create_block_segment(SegmentMemory& seg, size_t size, Tier tier, AllocClass cls);

  // Whether extents can commit chunks lazily and place each independently
  // (VMM with host-vmm, or managed).  Otherwise an extent is a fixed segment.
  bool lazy_extents() const;
  // Fill `seg` (fresh) with an extent: `capacity` bytes of address space in
  // chunks of `chunk_bytes` (both multiples of segment_alignment), nothing
  // committed.
  void create_extent(SegmentMemory& seg, size_t capacity, size_t chunk_bytes);
  void commit_chunk(SegmentMemory& seg, Chunk& c, Tier tier);
  void decommit_chunk(SegmentMemory& seg, Chunk& c);

  // Whether memory can move between the tiers at a fixed address at all
  // (demotion, promotion): managed, or host-vmm over device VMM.
  bool can_move_between_tiers() const;
  // Whether this segment's pages can move between tiers at a fixed address.
  bool can_migrate(const SegmentMemory& seg) const;
  // Move one committed chunk to `target`, bytes intact, address unchanged.
  // The caller has synchronized the device (no kernel may touch the chunk).
  // On failure the chunk is left as it was and the error is rethrown.
  void migrate_chunk(SegmentMemory& seg, Chunk& c, Tier target);

  // Re-read where a host chunk's pages are (numa ops) into c.placed_*.
  void verify_host_placement(const SegmentMemory& seg, Chunk& c);

  // Peer access: `peer` (another GPU) gets read/write access to every VMM
  // mapping made from now on (a VMM mapping is accessible only to the
  // devices cuMemSetAccess names, so a copy run by another GPU's context,
  // e.g. torch's peer copy with P2P enabled, fails without it).  Returns
  // false when it already had it (or is this GPU).
  bool add_peer(int peer);
  bool has_peer(int peer) const;
  const std::vector<int>& peers() const { return peers_; }
  // Grant `peer` access to the committed VMM chunks of `seg` (mappings made
  // before add_peer).
  void grant_peer(const SegmentMemory& seg, int peer);

 private:
  CUmemLocation location(Tier t) const;
  void advise_managed(const SegmentMemory& seg, const Chunk& c, Tier t);
  CUstream stream();
  // Grant every peer access to a mapping just made at [va, va + size).
  void grant_peers(CUdeviceptr va, size_t size);

  driver::DriverPtr drv_;
  FactoryConfig cfg_;
  NumaOps* numa_;
  size_t align_;
  driver::Stream stream_;  // prefetches; created on first use
  std::vector<int> peers_;  // devices granted access to new VMM mappings (add_peer)
};

}  // namespace cxl::backend
