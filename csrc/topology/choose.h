// Choosing the host NUMA node for the spill tier.
#pragma once

#include <string>
#include <vector>

#include "topology/numa.h"

namespace cxl::topology {

struct NodeChoice {
  int node = -1;
  // One human sentence saying why, e.g. "node 2: CPU-less memory node (CXL
  // candidate), distance 20 from GPU's node 0, 128.00 GiB free".  Any
  // warning below is appended to it too, so logging the reason alone never
  // hides one.
  std::string reason;
  // Risks of this choice (e.g. the node's memory is all ZONE_MOVABLE).
  std::vector<std::string> warnings;
};

// Pick the host node for host-tier memory.
//
//   requested      "auto" or a decimal node id (the `numa_node` option).
//   gpu_near_node  the GPU's nearest host node (gpu_nearest_node()), -1 unknown.
//   exclude_nodes  nodes that are not host memory and must never be chosen:
//                  the GPU's own memory exposed as a NUMA node (Grace Hopper,
//                  CU_DEVICE_ATTRIBUTE_NUMA_CONFIG=NUMA_NODE; gpu_memory_nodes()).
//
// "auto": among nodes with memory, prefer CPU-less nodes (CXL candidates),
// nearest to the GPU's node by SLIT distance (ties: more free bytes, then the
// lower id); if there is none, the GPU's node; else the lowest node with
// memory; with no readable topology at all, node 0 (the only valid host NUMA
// id on a non-NUMA kernel).
// An explicit id must name an online node with memory.  A chosen node whose
// memory is all ZONE_MOVABLE gets a warning (docs/sources.md#cpu-less-nodes).
//
// An empty `requested` means "auto".
//
// Throws cxl::Error(InvalidArgument), naming the option and the allowed
// values, e.g.  numa_node: node 5 does not exist; nodes with memory: 0, 1, 2 (or "auto")
// and cxl::Error(Unavailable) for "auto" when nodes were read but none has
// memory (a broken or partial sysfs; guessing would hide it).
NodeChoice choose_host_node(const Topology& topo, int gpu_near_node, const std::string& requested,
                            const std::vector<int>& exclude_nodes = {});

}  // namespace cxl::topology
