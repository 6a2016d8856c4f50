// Host NUMA placement: real mbind/move_pages plus the simulated-node records
// behind cxlsim_numa_bind, cxlsim_host_node_of and the relocate= rule.
//
// Locking: records live under `g_bind_mu`, taken after (never while holding)
// the memory registry's lock.
#include "sim/numa.h"

#include <linux/mempolicy.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>

#include "sim/config.h"
#include "sim/errors.h"
#include "sim/memory.h"
#include "sim/range_map.h"

namespace cxlsim {

namespace {

constexpr unsigned long kMaskBits = kMaxNumaNode + 1;
constexpr size_t kMaskWords = kMaskBits / (8 * sizeof(unsigned long));

std::mutex g_bind_mu;
RangeMap<int> g_bindings;
std::atomic<bool> g_binding_blocked{false};

std::vector<int> parse_node_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty() || part == "\n") continue;
    size_t dash = part.find('-');
    try {
      int lo = std::stoi(part.substr(0, dash));
      int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
      for (int n = lo; n <= hi && n <= kMaxNumaNode; ++n) out.push_back(n);
    } catch (...) {
    }
  }
  return out;
}

long sys_mbind(void* addr, unsigned long len, int mode, const unsigned long* mask, unsigned long maxnode,
               unsigned flags) {
  return syscall(SYS_mbind, addr, len, mode, mask, maxnode, flags);
}

}  // namespace

std::vector<int> real_memory_nodes() {
  static const std::vector<int> nodes = [] {
    for (const char* f : {"/sys/devices/system/node/has_memory", "/sys/devices/system/node/online"}) {
      std::ifstream in(f);
      std::string line;
      if (in && std::getline(in, line)) {
        auto v = parse_node_list(line);
        if (!v.empty()) return v;
      }
    }
    return std::vector<int>{0};
  }();
  return nodes;
}

int real_node_of(int sim) {
  auto c = config();
  const SimNode* n = c->node(sim);
  return n ? n->real : -1;
}

int current_sim_node() {
  auto c = config();
  unsigned cpu = 0, node = 0;
  if (syscall(SYS_getcpu, &cpu, &node, nullptr) == 0)
    for (const auto& n : c->nodes)
      if (n.real == static_cast<int>(node)) return n.id;
  return c->gpu_numa;
}

bool bind_pages(void* addr, size_t len, int real_node, bool move) {
  if (len == 0) return true;
  if (g_binding_blocked.load(std::memory_order_relaxed)) return true;
  if (real_node < 0 || real_node > kMaxNumaNode) {
    errno = EINVAL;
    return false;
  }
  unsigned long mask[kMaskWords] = {};
  mask[real_node / (8 * sizeof(unsigned long))] |= 1ul << (real_node % (8 * sizeof(unsigned long)));
  // maxnode counts one past the last bit: the kernel reads maxnode-1 bits.
  long r = sys_mbind(addr, page_up(len), MPOL_BIND, mask, kMaskBits + 1, move ? MPOL_MF_MOVE : 0);
  if (r == 0) return true;
  if (errno == EPERM || errno == ENOSYS) {
    g_binding_blocked.store(true, std::memory_order_relaxed);
    return true;
  }
  return false;
}

bool real_binding_works() { return !g_binding_blocked.load(std::memory_order_relaxed); }

int real_node_of_page(const void* p) {
  void* pages[1] = {const_cast<void*>(reinterpret_cast<const void*>(page_down(reinterpret_cast<uint64_t>(p))))};
  int status[1] = {-1};
  if (syscall(SYS_move_pages, 0, 1ul, pages, nullptr, status, 0) != 0) return -errno;
  return status[0];
}

void record_binding(uint64_t b, uint64_t e, int node) {
  std::lock_guard<std::mutex> lk(g_bind_mu);
  g_bindings.assign(page_down(b), page_up(e), node);
}

void relocate_on_register(uint64_t b, uint64_t e) {
  auto c = config();
  if (c->relocate.empty()) return;
  b = page_down(b);
  e = page_up(e);
  struct Move {
    uint64_t lo, hi;
    int to;
  };
  std::vector<Move> moves;
  {
    std::lock_guard<std::mutex> lk(g_bind_mu);
    g_bindings.for_each(b, e, [&](uint64_t lo, uint64_t hi, const int& node) {
      auto it = c->relocate.find(node);
      if (it != c->relocate.end()) moves.push_back(Move{lo, hi, it->second});
    });
    for (const auto& m : moves) g_bindings.assign(m.lo, m.hi, m.to);
  }
  // Like the kernel migrating long-term-pinned movable pages, the move is
  // best effort: the record is what the simulator reports either way.
  for (const auto& m : moves) bind_pages(reinterpret_cast<void*>(m.lo), m.hi - m.lo, real_node_of(m.to), true);
}

int recorded_node(uint64_t p) {
  std::lock_guard<std::mutex> lk(g_bind_mu);
  const int* node = g_bindings.find(p);
  if (node == nullptr) return -1;
  if (real_binding_works()) {
    // The record is stale if the page's policy is no longer our binding
    // (munmap + a new mapping at the same address) or nothing is mapped.
    int mode = -1;
    unsigned long mask[kMaskWords] = {};
    long r = syscall(SYS_get_mempolicy, &mode, mask, kMaskBits, reinterpret_cast<void*>(page_down(p)),
                     MPOL_F_ADDR);
    int real = real_node_of(*node);
    bool ours = r == 0 && mode == MPOL_BIND && real >= 0 &&
                (mask[real / (8 * sizeof(unsigned long))] >> (real % (8 * sizeof(unsigned long))) & 1ul);
    if (!ours && !(r != 0 && (errno == EPERM || errno == ENOSYS))) {
      g_bindings.erase(page_down(p), page_down(p) + kPageSize);
      return -1;
    }
  }
  return *node;
}

void clear_bindings() {
  std::lock_guard<std::mutex> lk(g_bind_mu);
  g_bindings.clear();
}

}  // namespace cxlsim

using namespace cxlsim;

extern "C" {

CXLSIM_API int cxlsim_numa_bind(void* p, size_t len, int node) {
  try {
    uint64_t b = reinterpret_cast<uint64_t>(p);
    if (p == nullptr || len == 0 || b % kPageSize != 0) {
      set_last_error("cxlsim_numa_bind: need a page-aligned, non-null pointer and len > 0");
      return -1;
    }
    int real = real_node_of(node);
    if (real < 0) {
      set_last_error("cxlsim_numa_bind: node " + std::to_string(node) + " is not a simulated node");
      return -1;
    }
    if (overlaps_simulated_memory(b, b + len)) {
      set_last_error("cxlsim_numa_bind: the range overlaps memory owned by the simulated driver; bind only "
                     "plain host memory (mmap) that cxlalloc manages itself");
      return -1;
    }
    if (!bind_pages(p, len, real, true)) {
      set_last_error(std::string("cxlsim_numa_bind: mbind to real node ") + std::to_string(real) +
                     " failed: " + std::strerror(errno));
      return -1;
    }
    record_binding(b, b + len, node);
    return 0;
  } catch (...) {
    set_last_error("cxlsim_numa_bind: out of memory");
    return -1;
  }
}

CXLSIM_API int cxlsim_host_node_of(const void* p) {
  try {
    uint64_t a = reinterpret_cast<uint64_t>(p);
    int node = -1;
    if (simulated_host_node(a, &node)) return node;
    return recorded_node(a);
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
