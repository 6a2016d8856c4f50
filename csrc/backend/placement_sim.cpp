// NumaOps backed by the simulated driver (csrc/sim/cxlsim.h).
//
// The simulator maps simulated host nodes onto real ones (numa=1:0 backs
// node 1 with real node 0), so the kernel cannot tell where a *simulated*
// page lives; the simulator records it and reports it through
// cxlsim_host_node_of().  Only those two C entry points are used, looked up
// with Driver::symbol(); they return codes and never throw.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "backend/placement.h"
#include "common/error.h"
#include "common/units.h"
#include "driver/driver.h"

namespace cxl::backend {

namespace {

using BindFn = int (*)(void*, size_t, int);
using NodeOfFn = int (*)(const void*);
using LastErrorFn = const char* (*)();

class SimNumaOps final : public NumaOps {
 public:
  SimNumaOps(std::shared_ptr<const driver::Driver> drv, BindFn bind, NodeOfFn node_of, LastErrorFn last_error)
      : drv_(std::move(drv)), bind_(bind), node_of_(node_of), last_error_(last_error) {}

  void bind(void* p, size_t len, int node) override {
    if (len == 0) return;
    const std::string what = "numa_bind (simulated): node " + std::to_string(node) + ", " + format_bytes(len);
    if (p == nullptr) throw Error(ErrorKind::InvalidArgument, what + ": null address");
    if (node < 0) throw Error(ErrorKind::InvalidArgument, what + ": negative node id");
    errno = 0;
    if (bind_(p, len, node) == 0) return;
    int e = errno;
    // errno first: the simulator binds with mbind(), which sets it;
    // cxlsim_last_error() may still hold an older, unrelated message.
    std::string why;
    if (e != 0) why = std::strerror(e);
    if (why.empty() && last_error_) {
      const char* s = last_error_();
      if (s && *s) why = s;
    }
    if (why.empty()) why = "cxlsim_numa_bind returned -1";
    // EINVAL-like failures (unknown node, bad range) are the caller's; the
    // rest mean the backing real node refused.
    ErrorKind kind = (e == 0 || e == EINVAL || e == EFAULT) ? ErrorKind::InvalidArgument : ErrorKind::Unavailable;
    throw Error(kind, what + " failed: " + why);
  }

  std::map<int, size_t> page_nodes(const void* p, size_t len) override {
    std::map<int, size_t> out;
    if (len == 0) return out;
    if (p == nullptr) throw Error(ErrorKind::InvalidArgument, "page_nodes (simulated): null address");
    const size_t ps = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    if (len > UINTPTR_MAX - begin)
      throw Error(ErrorKind::InvalidArgument, "page_nodes (simulated): range wraps around");
    const uintptr_t end = begin + len;
    for (uintptr_t page = begin - begin % ps; page < end; page += ps) {
      uintptr_t pb = std::max(begin, page), pe = std::min(end, page + ps);
      int node = node_of_(reinterpret_cast<const void*>(page));
      out[node < 0 ? -1 : node] += static_cast<size_t>(pe - pb);
    }
    return out;
  }

  std::string method() const override { return "simulated"; }

 private:
  std::shared_ptr<const driver::Driver> drv_;  // keeps the library's functions alive
  BindFn bind_;
  NodeOfFn node_of_;
  LastErrorFn last_error_;
};

}  // namespace

std::unique_ptr<NumaOps> sim_numa_ops(std::shared_ptr<const driver::Driver> drv) {
  if (!drv) throw Error(ErrorKind::InvalidArgument, "sim_numa_ops: no driver");
  auto bind = reinterpret_cast<BindFn>(drv->symbol("cxlsim_numa_bind"));
  auto node_of = reinterpret_cast<NodeOfFn>(drv->symbol("cxlsim_host_node_of"));
  if (!bind || !node_of)
    throw Error(ErrorKind::Unavailable, "the driver '" + drv->path() +
                                            "' does not export cxlsim_numa_bind/cxlsim_host_node_of "
                                            "(not the cxlalloc simulated driver?)");
  auto last_error = reinterpret_cast<LastErrorFn>(drv->symbol("cxlsim_last_error"));
  return std::make_unique<SimNumaOps>(std::move(drv), bind, node_of, last_error);
}

}  // namespace cxl::backend
