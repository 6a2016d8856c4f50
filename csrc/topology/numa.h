// Host NUMA topology as Linux describes it in sysfs.
//
// A CXL Type-3 memory expander appears as a CPU-less NUMA node (often onlined
// into ZONE_MOVABLE and placed in a lower memory tier); see
// docs/sources.md#linux-numa-cxl.  read_topology() gathers what the spill tier
// needs to pick and judge a host node: which nodes have memory and CPUs, how
// far they are (SLIT), which memory tier they sit in, whether their memory is
// all ZONE_MOVABLE (driver-pinned pages cannot live there,
// docs/sources.md#cpu-less-nodes) and whether a
// CXL region / dax kmem device backs them.
//
// Sources, relative to the sysfs root (kernel docs in Documentation/ABI/):
//   devices/system/node/{online,possible,has_cpu,has_memory,has_normal_memory}
//   devices/system/node/nodeN/{cpulist,meminfo,distance,memoryM}   (stable/sysfs-devices-node)
//   devices/system/memory/{block_size_bytes,memoryM/{state,valid_zones,nodeN}}
//                                                          (testing/sysfs-devices-memory)
//   devices/virtual/memory_tiering/memory_tierK/{nodelist|nodes}
//                                                          (testing/sysfs-kernel-mm-memory-tiers)
//   kernel/mm/numa/demotion_enabled                        (testing/sysfs-kernel-mm-numa)
//   bus/cxl/devices/{regionN,memN,...}                     (testing/sysfs-bus-cxl)
//   bus/dax/devices/daxX.Y/{target_node,driver}            (testing/sysfs-bus-dax)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace cxl::topology {

struct NumaNode {
  int id = -1;
  uint64_t total_bytes = 0;  // MemTotal of nodeN/meminfo, bytes
  uint64_t free_bytes = 0;   // MemFree of nodeN/meminfo, bytes (page cache not counted as free)
  std::vector<int> cpus;     // nodeN/cpulist
  bool has_cpu = false;      // in has_cpu (else: cpulist non-empty)
  bool has_memory = false;   // in has_memory (else: MemTotal > 0)
  // All of its online memory is ZONE_MOVABLE: in has_memory but not in
  // has_normal_memory (x86-64/arm64 have no highmem), or, when that file is
  // absent, every online memory block's valid_zones is "Movable".
  bool movable_only = false;
  // Online memory of this node in ZONE_MOVABLE, bytes (from memory blocks;
  // 0 when blocks are not visible).
  uint64_t movable_bytes = 0;
  int memory_tier = -1;       // K of the memory_tierK holding it; -1 unknown.  Larger K = slower.
  // SLIT row indexed by node id (distance[j] = distance to node j); -1 where
  // unknown.  The kernel prints one value per *online* node in id order, so
  // the row is re-indexed here; 10 = local.
  std::vector<int> distance;
  bool cxl = false;        // backed by a CXL region, or by dax kmem (soft-reserved) memory
  std::string cxl_detail;  // how that was established, e.g. "CXL region0 (ram, 64.00 GiB) via dax0.0 (kmem)"

  // Distance to node `other`, -1 unknown.
  int distance_to(int other) const {
    return other >= 0 && other < static_cast<int>(distance.size()) ? distance[other] : -1;
  }
};

struct Topology {
  std::string sysfs_root;
  std::vector<NumaNode> nodes;  // online nodes, by id
  bool cxl_bus_present = false;  // bus/cxl exists (CONFIG_CXL_BUS)
  std::vector<std::string> cxl_regions;  // "region0", ... (bus/cxl/devices/regionN)
  std::vector<std::string> cxl_memdevs;  // "mem0", ... (bus/cxl/devices/memN)
  bool demotion_enabled = false;          // kernel/mm/numa/demotion_enabled
  std::map<int, std::vector<int>> memory_tiers;  // tier K -> node ids
  // Everything that was missing or odd, one human sentence each.  Optional
  // features that a kernel may simply lack (CXL bus, memory tiers, demotion)
  // are not warnings when absent.
  std::vector<std::string> warnings;

  // The node with this id, or nullptr.
  const NumaNode* node(int id) const;
  // Ids of nodes with memory, ascending.
  std::vector<int> memory_node_ids() const;
};

// The sysfs root to read by default: $CXLALLOC_SYSFS_ROOT when set and
// non-empty (tests, `cxlalloc info` on a captured tree), else "/sys".
std::string default_sysfs_root();

// Read the topology under `sysfs_root`.  Never throws for missing, unreadable
// or garbled files: each problem is recorded in Topology::warnings and the
// affected field keeps its "unknown" value.  (It can still throw
// std::bad_alloc.)
Topology read_topology(const std::string& sysfs_root = default_sysfs_root());

}  // namespace cxl::topology
