#include "topology/choose.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>

#include "common/error.h"
#include "common/units.h"
#include "topology/sysfs.h"

namespace cxl::topology {

namespace {

std::string join_ids(const std::vector<int>& ids) {
  if (ids.empty()) return "none";
  std::string out;
  for (int id : ids) out += (out.empty() ? "" : ", ") + std::to_string(id);
  return out;
}

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// What kind of node it is, for the reason sentence.
std::string kind(const NumaNode& n) {
  if (n.has_cpu) {
    std::string s = "memory node with CPUs";
    if (!n.cpus.empty()) s += " " + sysfs::format_list(n.cpus);
    // Firmware may put CXL capacity on a socket's node; say so.
    if (n.cxl) s += ", partly backed by " + n.cxl_detail;
    return s;
  }
  if (n.cxl) return "CPU-less memory node backed by " + n.cxl_detail;
  return "CPU-less memory node (CXL candidate)";
}

// "distance 20 from GPU's node 0" and its unknown variants.
std::string distance_phrase(const Topology& t, const NumaNode& n, int gpu_node) {
  if (gpu_node < 0) return "GPU's host node unknown";
  const NumaNode* g = t.node(gpu_node);
  int d = g ? g->distance_to(n.id) : -1;
  if (d < 0) return "distance from GPU's node " + std::to_string(gpu_node) + " unknown";
  return "distance " + std::to_string(d) + " from GPU's node " + std::to_string(gpu_node);
}

std::string free_phrase(const NumaNode& n) { return format_bytes(n.free_bytes) + " free"; }

// Why the GPU's node could not serve as the fallback.
std::string gpu_node_note(const Topology& t, int gpu_node) {
  if (gpu_node < 0) return "GPU's host node unknown";
  const NumaNode* g = t.node(gpu_node);
  if (!g) return "GPU's node " + std::to_string(gpu_node) + " is not an online node";
  return "GPU's node " + std::to_string(gpu_node) + " has no memory";
}

// Warnings that follow the chosen node wherever it is used.
void add_zone_warnings(const NumaNode& n, NodeChoice& c) {
  if (n.movable_only) {
    c.warnings.push_back(
        "node " + std::to_string(n.id) +
        "'s memory is all ZONE_MOVABLE: the CUDA driver's pinned/page-locked memory "
        "(cuMemCreate HOST_NUMA, cuMemHostAlloc, cuMemHostRegister) cannot live there, so host-tier "
        "allocations may fail or be migrated to another node; online it as ZONE_NORMAL "
        "(daxctl reconfigure-device --mode=system-ram --no-movable) to use it for pinned memory");
  } else if (n.movable_bytes > 0) {
    c.warnings.push_back("node " + std::to_string(n.id) + " has " + format_bytes(n.movable_bytes) +
                         " of ZONE_MOVABLE memory, which pinned/page-locked memory cannot use");
  }
}

NodeChoice finish(const NumaNode& n, std::string reason) {
  NodeChoice c;
  c.node = n.id;
  add_zone_warnings(n, c);
  for (const auto& w : c.warnings) reason += "; WARNING: " + w;
  c.reason = std::move(reason);
  return c;
}

// The `numa_node` value: sets *is_auto for "auto" (any case) or "",
// otherwise returns the decimal node id; throws for anything else.
int parse_request(const std::string& requested, const std::vector<int>& allowed, bool* is_auto) {
  std::string s = sysfs::trim(requested);
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  *is_auto = lower == "auto" || lower.empty();
  if (*is_auto) return -1;
  bool digits = s.size() <= 9 && std::all_of(s.begin(), s.end(), [](unsigned char ch) {
                  return ch >= '0' && ch <= '9';
                });
  if (!digits)
    throw Error(ErrorKind::InvalidArgument, "numa_node: \"" + sysfs::printable(requested) +
                                                "\" is not \"auto\" or a node id; nodes with memory: " +
                                                join_ids(allowed) + " (or \"auto\")");
  return std::atoi(s.c_str());
}

}  // namespace

NodeChoice choose_host_node(const Topology& t, int gpu_node, const std::string& requested,
                            const std::vector<int>& exclude) {
  std::vector<const NumaNode*> candidates;
  std::vector<int> allowed;
  for (const auto& n : t.nodes)
    if (n.has_memory && !contains(exclude, n.id)) {
      candidates.push_back(&n);
      allowed.push_back(n.id);
    }
  std::sort(candidates.begin(), candidates.end(),
            [](const NumaNode* a, const NumaNode* b) { return a->id < b->id; });
  std::sort(allowed.begin(), allowed.end());

  bool is_auto = false;
  int want = parse_request(requested, allowed, &is_auto);

  // No node with memory at all: sysfs unreadable or a non-NUMA kernel.  Node
  // 0 is then the only id the driver accepts (cuMemCreate HOST_NUMA).
  if (t.nodes.empty() && (is_auto || want == 0)) {
    NodeChoice c;
    c.node = 0;
    c.reason = "node 0: assumed; no NUMA node could be read under " + t.sysfs_root +
               " (non-NUMA kernel or hidden sysfs), and 0 is the only host node id there";
    return c;
  }

  if (!is_auto) {
    const NumaNode* n = t.node(want);
    std::string tail = "; nodes with memory: " + join_ids(allowed) + " (or \"auto\")";
    if (!n)
      throw Error(ErrorKind::InvalidArgument,
                  "numa_node: node " + std::to_string(want) + " does not exist" + tail);
    if (!n->has_memory)
      throw Error(ErrorKind::InvalidArgument,
                  "numa_node: node " + std::to_string(want) + " has no memory" + tail);
    if (contains(exclude, want))
      throw Error(ErrorKind::InvalidArgument,
                  "numa_node: node " + std::to_string(want) +
                      " is the GPU's own memory, not host memory" + tail);
    return finish(*n, "node " + std::to_string(want) + ": requested (numa_node=" +
                          std::to_string(want) + "), " + kind(*n) + ", " +
                          distance_phrase(t, *n, gpu_node) + ", " + free_phrase(*n));
  }

  if (candidates.empty())
    throw Error(ErrorKind::Unavailable,
                "numa_node: no online NUMA node with memory under " + t.sysfs_root +
                    (exclude.empty() ? std::string() : " besides GPU memory nodes " + join_ids(exclude)));

  // 1. CPU-less memory nodes: nearest to the GPU, then most free, then lowest id.
  const NumaNode* gpu = gpu_node >= 0 ? t.node(gpu_node) : nullptr;
  auto dist = [&](const NumaNode* n) {
    int d = gpu ? gpu->distance_to(n->id) : -1;
    return d < 0 ? INT_MAX : d;
  };
  std::vector<const NumaNode*> cpuless;
  for (const auto* n : candidates)
    if (!n->has_cpu) cpuless.push_back(n);
  if (!cpuless.empty()) {
    std::sort(cpuless.begin(), cpuless.end(), [&](const NumaNode* a, const NumaNode* b) {
      if (dist(a) != dist(b)) return dist(a) < dist(b);
      if (a->free_bytes != b->free_bytes) return a->free_bytes > b->free_bytes;
      return a->id < b->id;
    });
    const NumaNode& n = *cpuless.front();
    return finish(n, "node " + std::to_string(n.id) + ": " + kind(n) + ", " +
                         distance_phrase(t, n, gpu_node) + ", " + free_phrase(n));
  }

  // 2. The GPU's own host node.
  if (gpu && gpu->has_memory && !contains(exclude, gpu->id))
    return finish(*gpu, "node " + std::to_string(gpu->id) +
                            ": the GPU's nearest host node (no CPU-less memory node), " +
                            free_phrase(*gpu));

  // 3. The lowest node with memory.
  const NumaNode& n = *candidates.front();
  return finish(n, "node " + std::to_string(n.id) + ": first node with memory (no CPU-less memory node; " +
                       gpu_node_note(t, gpu_node) + "), " + free_phrase(n));
}

}  // namespace cxl::topology
