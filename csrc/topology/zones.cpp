// Which nodes' memory is ZONE_MOVABLE.
//
// Why it matters: the CUDA driver's pinned memory (cuMemCreate HOST_NUMA,
// cuMemHostAlloc, cuMemHostRegister's FOLL_LONGTERM pins) never lives in
// ZONE_MOVABLE, and daxctl onlines CXL capacity as movable by default
// (docs/sources.md#cpu-less-nodes).  Two sources:
//   * has_normal_memory (N_NORMAL_MEMORY): nodes with memory in DMA/DMA32/
//     Normal.  On 64-bit kernels (no highmem) a node in has_memory but not in
//     has_normal_memory has only ZONE_MOVABLE memory.  Authoritative, cheap.
//   * memory blocks (Documentation/ABI/testing/sysfs-devices-memory): each
//     online block's valid_zones names its zone ("Movable", "Normal", "DMA32",
//     or "None"/"none" for a block spanning zones).  Gives movable_bytes and
//     the fallback when has_normal_memory is absent.
#include <algorithm>
#include <cctype>
#include <map>

#include "topology/readers.h"
#include "topology/sysfs.h"

namespace cxl::topology::detail {

using sysfs::join;

namespace {

struct BlockCounts {
  uint64_t online = 0;
  uint64_t movable = 0;
};

bool iequals(const std::string& a, const char* b) {
  std::string lb = b;
  if (a.size() != lb.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(lb[i])))
      return false;
  return true;
}

// Counts for the blocks at `block_dirs`.  Offline blocks are skipped: their
// valid_zones lists the zones they *could* be onlined into.
BlockCounts count_blocks(Topology& t, const std::vector<std::string>& block_dirs, int* unreadable) {
  BlockCounts c;
  for (const auto& dir : block_dirs) {
    auto state = sysfs::read_trimmed(join(dir, "state"));
    if (state && *state != "online") continue;
    auto zones = sysfs::read_trimmed(join(dir, "valid_zones"));
    if (!zones) {
      ++*unreadable;
      continue;
    }
    ++c.online;
    std::string first = zones->substr(0, zones->find(' '));
    if (iequals(first, "Movable")) ++c.movable;
  }
  return c;
}

}  // namespace

void read_memory_zones(Topology& t, const std::optional<std::vector<int>>& has_normal_memory) {
  const std::string node_dir = join(t.sysfs_root, "devices/system/node");
  const std::string mem_dir = join(t.sysfs_root, "devices/system/memory");

  uint64_t block_bytes = 0;
  if (auto text = sysfs::read_trimmed(join(mem_dir, "block_size_bytes"))) {
    // Printed in hex without "0x" (e.g. "8000000" = 128 MiB).
    if (auto v = sysfs::parse_u64(*text, 16)) block_bytes = *v;
  }

  // Blocks per node: its nodeN/memoryM links (CONFIG_NUMA); for a node
  // without them, the memoryM/nodeN links of the global memory directory
  // (scanned once, only when needed).
  std::map<int, std::vector<std::string>> blocks;
  bool need_scan = false;
  for (const auto& n : t.nodes) {
    std::string dir = join(node_dir, "node" + std::to_string(n.id));
    for (const auto& name : sysfs::list_dir(dir))
      if (sysfs::suffix_number(name, "memory")) blocks[n.id].push_back(join(dir, name));
    if (n.has_memory && blocks[n.id].empty()) need_scan = true;
  }
  if (need_scan) {
    std::map<int, std::vector<std::string>> by_link;
    for (const auto& name : sysfs::list_dir(mem_dir)) {
      if (!sysfs::suffix_number(name, "memory")) continue;
      std::string bdir = join(mem_dir, name);
      for (const auto& entry : sysfs::list_dir(bdir))
        if (auto id = sysfs::suffix_number(entry, "node")) by_link[*id].push_back(bdir);
    }
    for (auto& [id, dirs] : by_link)
      if (blocks[id].empty()) blocks[id] = std::move(dirs);
  }

  for (auto& n : t.nodes) {
    const std::string where = "node " + std::to_string(n.id);
    int unreadable = 0;
    BlockCounts c;
    auto it = blocks.find(n.id);
    if (it != blocks.end()) c = count_blocks(t, it->second, &unreadable);
    if (unreadable > 0)
      t.warnings.push_back(where + ": valid_zones unreadable for " + std::to_string(unreadable) +
                           " memory block(s)");
    n.movable_bytes = c.movable * block_bytes;
    bool blocks_say_movable_only = c.online > 0 && c.movable == c.online;

    if (has_normal_memory && n.has_memory) {
      bool normal = std::binary_search(has_normal_memory->begin(), has_normal_memory->end(), n.id);
      n.movable_only = !normal;
      // Disagreement means a captured tree is inconsistent, or a zone we do
      // not model (highmem on 32-bit); say so rather than guess silently.
      if (c.online > 0 && blocks_say_movable_only != n.movable_only)
        t.warnings.push_back(
            where + ": has_normal_memory says its memory is " +
            (n.movable_only ? "all ZONE_MOVABLE" : "not all ZONE_MOVABLE") + " but " +
            std::to_string(c.movable) + " of " + std::to_string(c.online) +
            " online memory blocks are Movable; using has_normal_memory");
    } else if (n.has_memory) {
      n.movable_only = blocks_say_movable_only;
      if (c.online == 0)
        t.warnings.push_back(where + ": neither has_normal_memory nor memory blocks are readable; "
                                     "whether its memory is ZONE_MOVABLE is unknown");
    }
  }
}

}  // namespace cxl::topology::detail
