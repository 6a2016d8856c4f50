// What a GPU can do with host memory, and which host NUMA node is nearest.
//
// Attribute numbers and meanings: docs/sources.md#gpu-attributes and
// cuda.h (CUDA 13.0).  Attributes are queried by number so a build against
// an older cuda.h still asks a newer driver for them.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "topology/numa.h"

namespace cxl::driver {
class Driver;
}

namespace cxl::topology {

struct GpuCaps {
  int device = -1;
  std::string name;
  size_t total_bytes = 0;  // VRAM, bytes (cuDeviceTotalMem)
  int cc_major = 0, cc_minor = 0;
  int host_numa_id = -1;  // HOST_NUMA_ID (134): nearest host node, -1 unknown / non-NUMA
  int numa_config = 0;    // NUMA_CONFIG (130): 1 = the GPU's memory is itself a NUMA node (Grace Hopper)
  int numa_id = -1;       // NUMA_ID (131): that node, -1 none
  int pci_domain = -1, pci_bus = -1, pci_device = -1;
  bool vmm = false;                    // 102 VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  bool host_numa_vmm = false;          // 141 cuMemCreate on CU_MEM_LOCATION_TYPE_HOST_NUMA
  bool host_vmm = false;               // 145 cuMemCreate on CU_MEM_LOCATION_TYPE_HOST (CUDA 13)
  bool managed = false;                // 83 MANAGED_MEMORY
  bool concurrent_managed = false;     // 89 CONCURRENT_MANAGED_ACCESS (oversubscription, prefetch)
  bool pageable_access = false;        // 88 PAGEABLE_MEMORY_ACCESS (HMM/ATS)
  bool uses_host_page_tables = false;  // 100 PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES (ATS)
  bool host_register = false;          // 99 HOST_REGISTER_SUPPORTED
  bool can_use_host_ptr = false;       // 91 CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
  bool unified_addressing = false;     // 41 UNIFIED_ADDRESSING
  bool memory_pools = false;           // 115 MEMORY_POOLS_SUPPORTED
  bool host_numa_pools = false;        // 142 HOST_NUMA_MEMORY_POOLS_SUPPORTED
  bool host_pools = false;             // 144 HOST_MEMORY_POOLS_SUPPORTED
  bool can_map_host = false;           // 19 CAN_MAP_HOST_MEMORY
  // Every attribute the driver answered, by its CU_DEVICE_ATTRIBUTE_ name.
  std::map<std::string, int> attributes;
  // What could not be read ("CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID (134): CUDA_ERROR_INVALID_VALUE
  // (...); read as -1"): an old driver rejects newer attributes, never fatal.
  std::vector<std::string> notes;
};

// Query device `device` of `drv` (no context needed).  Attributes the driver
// rejects read as 0 (flags, counts) or -1 (ids) and are listed in notes.
// Throws cxl::Error(InvalidArgument) when `device` is not in
// [0, drv.device_count()), DriverError when cuDeviceGet itself fails.
GpuCaps query_gpu(const driver::Driver& drv, int device);

// The host node nearest to the GPU: HOST_NUMA_ID when >= 0, else the
// numa_node of its PCI function (bus/pci/devices/DDDD:BB:DD.0/numa_node
// under topo.sysfs_root, Documentation/ABI/testing/sysfs-bus-pci), else -1.
int gpu_nearest_node(const GpuCaps& gpu, const Topology& topo);

// NUMA nodes that are the GPU's own memory (NUMA_CONFIG = NUMA_NODE): pass
// to choose_host_node() as exclude_nodes so a CPU-less GPU-memory node is
// never mistaken for a CXL node.
std::vector<int> gpu_memory_nodes(const GpuCaps& gpu);

// One line per host-tier mechanism saying whether this GPU supports it and
// by which attribute, e.g. "host-vmm (cuMemCreate HOST_NUMA): yes (attr 141)".
std::string describe_backend_support(const GpuCaps& gpu);

}  // namespace cxl::topology
