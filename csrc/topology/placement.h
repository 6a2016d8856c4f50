// Binding host pages to a NUMA node and verifying where they really are.
// (Interface shared with the topology layer; implementations in placement.cpp.)
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>

namespace cxl::driver {
class Driver;
}

namespace cxl::topology {

class NumaOps {
 public:
  virtual ~NumaOps() = default;
  // Bind [p, p+len) to `node` before first touch.  Throws cxl::Error.
  virtual void bind(void* p, size_t len, int node) = 0;
  // Bytes per node actually backing [p, p+len); faults nothing in.
  // Unpopulated pages are counted under key -1.
  virtual std::map<int, size_t> page_nodes(const void* p, size_t len) = 0;
  // "move_pages" or "simulated".
  virtual std::string method() const = 0;
};

std::unique_ptr<NumaOps> linux_numa_ops();
std::unique_ptr<NumaOps> sim_numa_ops(std::shared_ptr<const driver::Driver> drv);

}  // namespace cxl::topology
