// Page placement: mbind before first touch, move_pages to verify.
// (Interim implementation in main; the topology branch carries the full one.)
#include "topology/placement.h"

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "driver/driver.h"

namespace cxl::topology {

namespace {

class LinuxNumaOps : public NumaOps {
 public:
  void bind(void* p, size_t len, int node) override {
    if (node < 0 || node >= 1024) throw Error(ErrorKind::InvalidArgument, "numa_node: invalid node " + std::to_string(node));
    std::vector<unsigned long> mask(1024 / (8 * sizeof(unsigned long)), 0);
    mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
    long r = syscall(SYS_mbind, p, len, MPOL_BIND, mask.data(), 1024 + 1, MPOL_MF_STRICT | MPOL_MF_MOVE);
    if (r != 0)
      throw Error(ErrorKind::Unavailable, "mbind to NUMA node " + std::to_string(node) + " failed: " + std::strerror(errno));
  }
  std::map<int, size_t> page_nodes(const void* p, size_t len) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    auto start = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
    auto end = reinterpret_cast<uintptr_t>(p) + len;
    std::map<int, size_t> out;
    const size_t batch = 4096;
    std::vector<void*> pages;
    std::vector<int> status;
    for (uintptr_t a = start; a < end;) {
      pages.clear();
      for (size_t i = 0; i < batch && a < end; ++i, a += page) pages.push_back(reinterpret_cast<void*>(a));
      status.assign(pages.size(), 0);
      long r = syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr, status.data(), 0);
      for (size_t i = 0; i < pages.size(); ++i) {
        // -ENOENT: not populated; other negatives: not queryable (driver pages).
        int node = r != 0 ? -2 : (status[i] >= 0 ? status[i] : (status[i] == -ENOENT ? -1 : -2));
        out[node < 0 ? -1 : node] += page;
      }
    }
    return out;
  }
  std::string method() const override { return "move_pages"; }
};

class SimNumaOps : public NumaOps {
 public:
  explicit SimNumaOps(std::shared_ptr<const driver::Driver> drv) : drv_(std::move(drv)) {
    bind_ = reinterpret_cast<int (*)(void*, size_t, int)>(drv_->symbol("cxlsim_numa_bind"));
    node_of_ = reinterpret_cast<int (*)(const void*)>(drv_->symbol("cxlsim_host_node_of"));
  }
  void bind(void* p, size_t len, int node) override {
    if (!bind_ || bind_(p, len, node) != 0)
      throw Error(ErrorKind::Unavailable, "simulated mbind to NUMA node " + std::to_string(node) + " failed");
  }
  std::map<int, size_t> page_nodes(const void* p, size_t len) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    std::map<int, size_t> out;
    for (size_t off = 0; off < len; off += page) {
      int n = node_of_ ? node_of_(static_cast<const char*>(p) + off) : -1;
      out[n < 0 ? -1 : n] += std::min(page, len - off);
    }
    return out;
  }
  std::string method() const override { return "simulated"; }

 private:
  std::shared_ptr<const driver::Driver> drv_;
  int (*bind_)(void*, size_t, int) = nullptr;
  int (*node_of_)(const void*) = nullptr;
};

}  // namespace

std::unique_ptr<NumaOps> linux_numa_ops() { return std::make_unique<LinuxNumaOps>(); }
std::unique_ptr<NumaOps> sim_numa_ops(std::shared_ptr<const driver::Driver> drv) {
  return std::make_unique<SimNumaOps>(std::move(drv));
}

}  // namespace cxl::topology
