// read_topology(): the node list and per-node files; the other sysfs areas
// (memory zones, memory tiers, CXL) are read by zones.cpp, tiers.cpp, cxl.cpp.
#include "topology/numa.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "topology/readers.h"
#include "topology/sysfs.h"

namespace cxl::topology {

using sysfs::join;

const NumaNode* Topology::node(int id) const {
  for (const auto& n : nodes)
    if (n.id == id) return &n;
  return nullptr;
}

std::vector<int> Topology::memory_node_ids() const {
  std::vector<int> out;
  for (const auto& n : nodes)
    if (n.has_memory) out.push_back(n.id);
  std::sort(out.begin(), out.end());
  return out;
}

std::string default_sysfs_root() {
  const char* env = std::getenv("CXLALLOC_SYSFS_ROOT");
  return env && *env ? std::string(env) : std::string("/sys");
}

namespace detail {
NumaNode* find_node(Topology& t, int id) {
  for (auto& n : t.nodes)
    if (n.id == id) return &n;
  return nullptr;
}
}  // namespace detail

namespace {

constexpr int kMaxNodeId = 4095;

// One of the node-state lists (online, has_cpu, ...).  nullopt when the file
// is missing or garbled; a garbled file is always a warning, a missing one
// only when `warn_missing`.
std::optional<std::vector<int>> read_node_list(Topology& t, const std::string& node_dir,
                                               const char* name, bool warn_missing) {
  std::string path = join(node_dir, name);
  auto text = sysfs::read_file(path);
  if (!text) {
    if (warn_missing) t.warnings.push_back(path + " is missing or unreadable");
    return std::nullopt;
  }
  std::string err;
  auto ids = sysfs::parse_list(*text, &err);
  if (!ids) t.warnings.push_back(path + ": cannot parse (" + err + "); ignored");
  return ids;
}

bool contains(const std::vector<int>& v, int x) {
  return std::binary_search(v.begin(), v.end(), x);
}

// "Node 0 MemTotal:  5466328 kB" -> bytes; nullopt when the key is absent or odd.
std::optional<uint64_t> meminfo_bytes(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    auto k = line.find(" " + key + ":");
    if (k == std::string::npos) continue;
    std::istringstream rest(line.substr(k + key.size() + 2));
    std::string num, unit;
    rest >> num >> unit;
    auto v = sysfs::parse_u64(num);
    if (!v) return std::nullopt;
    if (unit == "kB") return *v * 1024;
    if (unit.empty()) return *v;  // page counts never appear for these keys
    return std::nullopt;
  }
  return std::nullopt;
}

void read_node_files(Topology& t, NumaNode& n, const std::string& dir,
                     const std::vector<int>& distance_order) {
  std::string where = "node " + std::to_string(n.id);

  // CPUs.  An empty cpulist is normal for a CPU-less (CXL) node.
  std::string cpulist = join(dir, "cpulist");
  if (auto text = sysfs::read_file(cpulist)) {
    std::string err;
    if (auto cpus = sysfs::parse_list(*text, &err))
      n.cpus = *cpus;
    else
      t.warnings.push_back(cpulist + ": cannot parse (" + err + "); CPUs unknown");
  } else {
    t.warnings.push_back(cpulist + " is missing or unreadable; CPUs unknown");
  }

  // Memory sizes.
  std::string meminfo = join(dir, "meminfo");
  if (auto text = sysfs::read_file(meminfo)) {
    auto total = meminfo_bytes(*text, "MemTotal");
    auto free = meminfo_bytes(*text, "MemFree");
    if (total) n.total_bytes = *total;
    if (free) n.free_bytes = *free;
    if (!total || !free)
      t.warnings.push_back(meminfo + ": no parsable MemTotal/MemFree; " + where +
                           " memory size unknown");
  } else {
    t.warnings.push_back(meminfo + " is missing or unreadable; " + where + " memory size unknown");
  }

  // SLIT row: one value per online node, in id order.
  std::string dpath = join(dir, "distance");
  if (auto text = sysfs::read_file(dpath)) {
    std::istringstream in(*text);
    std::vector<int> row;
    std::string tok;
    bool bad = false;
    while (in >> tok) {
      auto v = sysfs::parse_int(tok);
      if (!v || *v < 0 || *v > 255) {
        bad = true;
        break;
      }
      row.push_back(static_cast<int>(*v));
    }
    int width = distance_order.empty() ? 0 : distance_order.back() + 1;
    n.distance.assign(static_cast<size_t>(width), -1);
    if (bad) {
      t.warnings.push_back(dpath + ": cannot parse '" + sysfs::printable(sysfs::trim(*text)) +
                           "'; distances of " + where + " unknown");
    } else if (row.size() != distance_order.size()) {
      t.warnings.push_back(dpath + ": " + std::to_string(row.size()) +
                           " values for " + std::to_string(distance_order.size()) +
                           " online nodes; distances of " + where + " unknown");
    } else {
      for (size_t i = 0; i < row.size(); ++i) n.distance[static_cast<size_t>(distance_order[i])] = row[i];
    }
  } else {
    t.warnings.push_back(dpath + " is missing or unreadable; distances of " + where + " unknown");
  }
}

}  // namespace

Topology read_topology(const std::string& sysfs_root) {
  Topology t;
  t.sysfs_root = sysfs_root.empty() ? std::string("/sys") : sysfs_root;
  const std::string node_dir = join(t.sysfs_root, "devices/system/node");

  if (!sysfs::is_dir(node_dir)) {
    t.warnings.push_back("no NUMA node information: " + node_dir +
                         " does not exist (kernel without CONFIG_NUMA, or sysfs not mounted)");
  } else {
    // Which nodes: `online`, cross-checked with the nodeN directories.
    std::vector<int> dir_ids;
    for (const auto& name : sysfs::list_dir(node_dir))
      if (auto id = sysfs::suffix_number(name, "node")) dir_ids.push_back(*id);
    std::sort(dir_ids.begin(), dir_ids.end());

    auto online = read_node_list(t, node_dir, "online", true);
    // Linux caps node ids at MAX_NUMNODES (NODES_SHIFT <= 10); a larger id is
    // a garbled tree and would size every distance row by it.
    auto drop_huge = [&](std::vector<int>& ids, const std::string& from) {
      auto bad = std::find_if(ids.begin(), ids.end(), [](int id) { return id > kMaxNodeId; });
      if (bad == ids.end()) return;
      t.warnings.push_back(from + ": node id " + std::to_string(*bad) + " exceeds " +
                           std::to_string(kMaxNodeId) + "; ids above it ignored");
      ids.erase(std::remove_if(ids.begin(), ids.end(), [](int id) { return id > kMaxNodeId; }), ids.end());
    };
    drop_huge(dir_ids, node_dir);
    if (online) drop_huge(*online, join(node_dir, "online"));
    std::vector<int> ids;
    if (online) {
      for (int id : *online) {
        if (contains(dir_ids, id))
          ids.push_back(id);
        else
          t.warnings.push_back("node " + std::to_string(id) + " is listed in " +
                               join(node_dir, "online") + " but " +
                               join(node_dir, "node" + std::to_string(id)) + " is missing; skipped");
      }
      for (int id : dir_ids)
        if (!contains(*online, id)) {
          t.warnings.push_back(join(node_dir, "node" + std::to_string(id)) +
                               " exists but node " + std::to_string(id) +
                               " is not listed as online; included");
          ids.push_back(id);
        }
      std::sort(ids.begin(), ids.end());
    } else {
      ids = dir_ids;
    }
    // The kernel's distance rows follow the online set; without `online`
    // the directories are the best guess.
    std::vector<int> distance_order = online ? *online : dir_ids;

    auto has_cpu = read_node_list(t, node_dir, "has_cpu", true);
    auto has_memory = read_node_list(t, node_dir, "has_memory", true);
    // Nodes with memory in a kernel zone (DMA/DMA32/Normal).  Always there
    // with CONFIG_NUMA, but a captured tree may lack it; zones.cpp then falls
    // back to the memory blocks.
    auto has_normal = read_node_list(t, node_dir, "has_normal_memory", false);

    for (int id : ids) {
      NumaNode n;
      n.id = id;
      read_node_files(t, n, join(node_dir, "node" + std::to_string(id)), distance_order);
      n.has_cpu = has_cpu ? contains(*has_cpu, id) : !n.cpus.empty();
      n.has_memory = has_memory ? contains(*has_memory, id) : n.total_bytes > 0;
      t.nodes.push_back(std::move(n));
    }
    if (t.nodes.empty()) t.warnings.push_back("no online NUMA node found under " + node_dir);

    detail::read_memory_zones(t, has_normal);
  }
  detail::read_memory_tiers(t);
  detail::read_cxl(t);
  return t;
}

}  // namespace cxl::topology
