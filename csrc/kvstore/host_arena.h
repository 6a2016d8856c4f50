// Host memory of the KV reuse store on one NUMA node (a CXL node where one
// is chosen): bound before first touch, committed lazily as blocks are
// written, its placement verified page by page, and registered for the GPU's
// copy engines chunk by chunk, on first use.
//
// Why chunked, lazy registration: one cuMemHostRegister of 512 GiB or more
// fails on current drivers, and pinning costs about 0.1 s/GB, so registering
// a terabyte pool up front would block start-up for minutes
// (docs/sources.md#host-pinning).  Registering a chunk when the store first
// places a block in it spreads that cost over the fill and keeps memory that
// holds no block unpinned and uncommitted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "driver/driver.h"
#include "driver/resources.h"
#include "kvstore/arena_mapping.h"
#include "backend/placement.h"

namespace cxl::kvstore {

struct ArenaConfig {
  size_t size = 0;             // bytes (rounded up to the page size); ignored when attaching
  int node = 0;                // host NUMA node the pages must land on
  bool shared = false;         // a memfd another process can map (kv-server pool)
  int attach_fd = -1;          // >= 0: map this shared pool (a client); takes ownership
  size_t register_chunk = 0;   // bytes per GPU registration; 0: never register (no GPU)
  int device = 0;              // CUDA device whose primary context registers
};

struct ArenaStats {
  size_t size = 0;
  size_t registered_bytes = 0;
  size_t registered_chunks = 0;
  size_t register_failures = 0;
};

class HostArena {
 public:
  // Maps the arena and binds all of it to `cfg.node` (MPOL_BIND) before any
  // page is touched.  `numa` may be null (placement then unverified); `drv`
  // may be null when register_chunk is 0 (a kv-server with no GPU).
  // Throws Error(InvalidArgument) for a register_chunk above 64 GiB or not
  // page-aligned, and what ArenaMapping and NumaOps::bind throw.
  HostArena(driver::DriverPtr drv, std::shared_ptr<backend::NumaOps> numa, const ArenaConfig& cfg);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  uint8_t* base() const { return static_cast<uint8_t*>(map_.base()); }
  size_t size() const { return map_.size(); }
  int fd() const { return map_.fd(); }
  int node() const { return cfg_.node; }
  bool shared() const { return map_.shared(); }
  size_t register_chunk() const { return cfg_.register_chunk; }

  // Register every chunk overlapping [off, off+len) that is not registered
  // yet (page-locked and mapped for the GPU), so copies between it and VRAM
  // run on the copy engines at link speed.  Returns the bytes newly
  // registered (0 when registration is off).  Thread-safe.  Throws
  // Error(InvalidArgument) for a range outside the arena and the driver's
  // error when registration fails (the chunk stays unregistered: the caller
  // may still copy through pageable memory, slower).
  size_t ensure_registered(size_t off, size_t len);

  // Where the pages of [off, off+len) are now (populated bytes per node;
  // never faults anything in).  Throws Error(InvalidArgument) for a range
  // outside the arena, and Unavailable without NUMA support.
  backend::PlacementCheck verify(size_t off, size_t len) const;
  std::string numa_method() const { return numa_ ? numa_->method() : "none"; }

  ArenaStats stats() const;

 private:
  void check_range(size_t off, size_t len) const;

  driver::DriverPtr drv_;
  std::shared_ptr<backend::NumaOps> numa_;
  ArenaConfig cfg_;
  ArenaMapping map_;
  driver::PrimaryContext ctx_;  // retained only when registration is on
  mutable std::mutex mu_;       // guards regs_ and the counters
  std::vector<driver::HostRegistration> regs_;  // one slot per chunk, empty until registered
  size_t registered_bytes_ = 0;
  size_t registered_chunks_ = 0;
  size_t register_failures_ = 0;
};

}  // namespace cxl::kvstore
