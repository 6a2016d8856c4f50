// Internal: the parts of read_topology() that each read one sysfs area and
// fill their fields of a Topology whose `nodes` are already known.  Split out
// so each file has one job; none of them throws for missing or odd files
// (they append to Topology::warnings instead).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "topology/numa.h"

namespace cxl::topology::detail {

// movable_only / movable_bytes from has_normal_memory (when the kernel
// exposes it; nullopt otherwise) and the memory blocks' valid_zones
// (zones.cpp).
void read_memory_zones(Topology& t, const std::optional<std::vector<int>>& has_normal_memory);

// memory_tiers, NumaNode::memory_tier and demotion_enabled (tiers.cpp).
void read_memory_tiers(Topology& t);

// cxl_bus_present, cxl_regions, cxl_memdevs and NumaNode::cxl/cxl_detail
// from bus/cxl and bus/dax (cxl.cpp).
void read_cxl(Topology& t);

// Mutable access by id (nullptr when absent).
NumaNode* find_node(Topology& t, int id);

}  // namespace cxl::topology::detail
