// Which physical memory sources (backends) work on this GPU and host node.
//
// Device tier: VRAM through the VMM API (cuMemCreate on the device), so a
// segment's physical pages can later be swapped for host pages under the
// same virtual address; GPUs without VMM fall back to cuMemAlloc (no remap).
// Host tier, one of:
//   host-vmm  cuMemCreate on CU_MEM_LOCATION_TYPE_HOST_NUMA (pinned, no page
//             faults, remappable: demotion keeps the address)
//   managed   cuMemAllocManaged + preferred location {HOST_NUMA, node} +
//             accessed-by the GPU; migration by advise + prefetch
//   pinned    mmap + mbind(node) + cuMemHostRegister (portable fallback; a
//             segment's tier is fixed)
// Sources: docs/sources.md#host-backends (cuda.h); NCCL's probe-then-fallback
// for cuMem host allocations (src/misc/cudawrap.cc).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "driver/driver.h"

namespace cxl::backend {

enum class HostBackend : uint8_t { HostVmm = 0, Managed = 1, Pinned = 2 };
constexpr int kNumHostBackends = 3;

const char* host_backend_name(HostBackend b);
// "auto" -> nullopt; "host-vmm" | "managed" | "pinned" -> value; anything
// else throws InvalidArgument naming the option `backend` and allowed values.
std::optional<HostBackend> parse_host_backend(const std::string& s);

struct Support {
  bool ok = false;
  std::string reason;  // why not (or a note when ok)
};

// The device attributes and sizes the allocator depends on.
struct DeviceFacts {
  int device = 0;
  int driver_version = 0;
  bool vmm = false;                 // attr 102
  bool host_numa_vmm = false;       // attr 141
  bool managed = false;             // attr 83
  bool concurrent_managed = false;  // attr 89
  bool host_register = false;       // attr 99
  bool can_map_host = false;        // attr 19
  bool can_use_host_ptr = false;    // attr 91
  size_t device_granularity = 0;    // cuMemGetAllocationGranularity(MINIMUM), 0 if no VMM
  size_t host_granularity = 0;      // same for {HOST_NUMA, node}
  size_t total_bytes = 0;
  size_t free_bytes = 0;
};

// Reads attributes and granularities; needs the device's context current.
DeviceFacts read_device_facts(const driver::Driver& drv, int device, int host_node);

Support device_vmm_support(const DeviceFacts& f);
// Attribute-level support of a host backend (no allocation made).
Support host_support(HostBackend b, const DeviceFacts& f);
// host-vmm only: allocate and free one granule on `node`, as NCCL does,
// because some drivers reject CPU-less nodes at cuMemCreate (nccl#2190).
Support probe_host_vmm(const std::shared_ptr<const driver::Driver>& drv, int node, size_t granularity);

}  // namespace cxl::backend
