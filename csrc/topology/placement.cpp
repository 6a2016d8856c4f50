#include "topology/placement.h"

#include "common/units.h"

namespace cxl::topology {

// Out of line so the vtable has one home.
NumaOps::~NumaOps() = default;

std::string describe_page_nodes(const std::map<int, size_t>& m) {
  if (m.empty()) return "nothing";
  std::string out;
  for (const auto& [node, bytes] : m) {
    if (!out.empty()) out += ", ";
    out += format_bytes(bytes) + (node < 0 ? std::string(" not populated")
                                           : " on node " + std::to_string(node));
  }
  return out;
}

}  // namespace cxl::topology
