#include "backend/placement.h"

#include "common/units.h"

namespace cxl::backend {

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

PlacementCheck check_placement(NumaOps& ops, const void* p, size_t len, int node) {
  PlacementCheck c;
  c.method = ops.method();
  auto m = ops.page_nodes(p, len);
  for (const auto& [n, bytes] : m) {
    if (n < 0)
      c.unpopulated += bytes;
    else if (n == node)
      c.on_node += bytes;
    else
      c.elsewhere += bytes;
  }
  c.ok = c.on_node == len;
  c.detail = "verified by " + c.method + ": " + describe_page_nodes(m);
  return c;
}

}  // namespace cxl::backend
