// Which NUMA nodes are backed by CXL memory.
//
// How CXL RAM reaches the page allocator (Documentation/driver-api/cxl/linux/
// cxl-driver.rst, dax-driver.rst; ABI testing/sysfs-bus-cxl, sysfs-bus-dax):
//   bus/cxl/devices/regionN           a committed CXL memory region (mode "ram")
//     regionN/dax_regionN/daxN.M      its DAX device (also bus/cxl/devices/dax_regionN)
//   bus/dax/devices/daxN.M            symlink to that device, with
//     target_node                     the NUMA node its memory becomes when onlined
//     driver -> .../kmem              bound to dax_kmem: hot-plugged as System RAM
// A dax device not under a CXL region is either hmem (EFI soft-reserved
// memory, typically CXL that firmware configured; path under .../hmem.N/) or
// an NVDIMM namespace (path under .../ndbusN/, not CXL).  Only kmem-bound
// devices put memory on their target node; device_dax mode leaves a
// /dev/daxN.M that the page allocator never sees.
#include <algorithm>

#include "common/units.h"
#include "topology/readers.h"
#include "topology/sysfs.h"

namespace cxl::topology::detail {

using sysfs::join;

namespace {

struct Region {
  std::string name;  // "region0"
  std::string real;  // canonical path of its device directory
  std::string mode;  // "ram", "pmem", ...
  uint64_t size = 0;
  std::vector<std::string> dax;  // "dax0.0", ... found below it
};

bool is_dax_name(const std::string& n) {
  // daxX.Y
  if (n.size() < 6 || n.compare(0, 3, "dax") != 0) return false;
  auto dot = n.find('.');
  if (dot == std::string::npos || dot == 3 || dot + 1 == n.size()) return false;
  for (size_t i = 3; i < n.size(); ++i)
    if (i != dot && !(n[i] >= '0' && n[i] <= '9')) return false;
  return true;
}

// Names matching `prefix`<digits> in dir, in numeric order.
std::vector<std::string> numbered(const std::string& dir, const std::string& prefix) {
  std::vector<std::pair<int, std::string>> v;
  for (const auto& name : sysfs::list_dir(dir))
    if (auto k = sysfs::suffix_number(name, prefix)) v.emplace_back(*k, name);
  std::sort(v.begin(), v.end());
  std::vector<std::string> out;
  for (auto& p : v) out.push_back(p.second);
  return out;
}

// DAX device names in the dax_region* children of `dir`.
void collect_dax(const std::string& dir, std::vector<std::string>* out) {
  for (const auto& sub : sysfs::list_dir(dir)) {
    if (sub.compare(0, 10, "dax_region") != 0) continue;
    for (const auto& d : sysfs::list_dir(join(dir, sub)))
      if (is_dax_name(d)) out->push_back(d);
  }
}

// Some component of `path` starts with `prefix` ("/.../ndbus0/..." for "ndbus").
bool path_has_component_prefix(const std::string& path, const std::string& prefix) {
  return path.find('/' + prefix) != std::string::npos;
}

}  // namespace

void read_cxl(Topology& t) {
  const std::string cxl_devs = join(t.sysfs_root, "bus/cxl/devices");
  t.cxl_bus_present = sysfs::is_dir(join(t.sysfs_root, "bus/cxl"));

  std::vector<Region> regions;
  if (t.cxl_bus_present) {
    t.cxl_memdevs = numbered(cxl_devs, "mem");
    for (const auto& name : numbered(cxl_devs, "region")) {
      Region r;
      r.name = name;
      std::string dir = join(cxl_devs, name);
      r.real = sysfs::real_path(dir);
      r.mode = sysfs::printable(sysfs::read_trimmed(join(dir, "mode")).value_or(""), 16);
      if (auto s = sysfs::read_trimmed(join(dir, "size")))
        r.size = sysfs::parse_u64(*s, 0).value_or(0);  // "0x1000000000"
      collect_dax(dir, &r.dax);
      t.cxl_regions.push_back(name);
      regions.push_back(std::move(r));
    }
  }

  const std::string dax_devs = join(t.sysfs_root, "bus/dax/devices");
  for (const auto& name : sysfs::list_dir(dax_devs)) {
    if (!is_dax_name(name)) continue;
    std::string dir = join(dax_devs, name);
    std::string driver = sysfs::link_basename(join(dir, "driver"));
    if (driver != "kmem") continue;  // not System RAM: nothing lands on a node

    auto tn_text = sysfs::read_trimmed(join(dir, "target_node"));
    auto tn = tn_text ? sysfs::parse_int(*tn_text) : std::nullopt;
    if (!tn) {
      t.warnings.push_back(join(dir, "target_node") + " is missing or garbled; cannot tell which node " +
                           name + " (kmem) backs");
      continue;
    }
    NumaNode* node = find_node(t, static_cast<int>(*tn));
    if (!node) continue;  // its memory is not online as a node (yet)

    std::string real = sysfs::real_path(dir);
    const Region* region = nullptr;
    for (const auto& r : regions) {
      bool listed = std::find(r.dax.begin(), r.dax.end(), name) != r.dax.end();
      bool below = !r.real.empty() && real.compare(0, r.real.size() + 1, r.real + "/") == 0;
      if (listed || below) {
        region = &r;
        break;
      }
    }

    std::string what;
    bool is_cxl = true;
    if (region) {
      what = "CXL " + region->name + " (" + (region->mode.empty() ? "mode unknown" : region->mode) +
             (region->size ? ", " + format_bytes(region->size) : "") + ")";
    } else if (path_has_component_prefix(real, "ndbus")) {
      what = "NVDIMM namespace (not CXL)";
      is_cxl = false;
    } else if (path_has_component_prefix(real, "hmem")) {
      what = "soft-reserved memory (hmem; typically firmware-configured CXL)";
    } else {
      what = "dax memory of unknown origin (no CXL region links to it)";
    }
    std::string detail = what + " via " + name + " (kmem)";
    node->cxl = node->cxl || is_cxl;
    node->cxl_detail = node->cxl_detail.empty() ? detail : node->cxl_detail + "; " + detail;
  }
}

}  // namespace cxl::topology::detail
