// Memory tiers and demotion (Documentation/ABI/testing/
// sysfs-kernel-mm-memory-tiers, admin-guide/mm/numaperf.rst).
//
// memory_tierK groups nodes of similar abstract distance (K = adistance >> 7:
// DRAM is memory_tier4; dax/kmem (CXL) defaults to a larger K, i.e. a lower,
// slower tier).  The ABI document names the node file `nodes`; the kernel
// exposes `nodelist` (mm/memory-tiers.c, DEVICE_ATTR_RO(nodelist); observed
// on 6.18), so both are read, `nodelist` first.
#include <algorithm>

#include "topology/readers.h"
#include "topology/sysfs.h"

namespace cxl::topology::detail {

using sysfs::join;

void read_memory_tiers(Topology& t) {
  const std::string tier_dir = join(t.sysfs_root, "devices/virtual/memory_tiering");
  // Numeric order (memory_tier4 before memory_tier22), so a node listed
  // twice keeps the faster tier.
  std::vector<int> ks;
  for (const auto& name : sysfs::list_dir(tier_dir))
    if (auto k = sysfs::suffix_number(name, "memory_tier")) ks.push_back(*k);
  std::sort(ks.begin(), ks.end());
  for (int k : ks) {
    std::string dir = join(tier_dir, "memory_tier" + std::to_string(k));
    std::string path = join(dir, "nodelist");
    auto text = sysfs::read_file(path);
    if (!text) {
      path = join(dir, "nodes");
      text = sysfs::read_file(path);
    }
    if (!text) {
      t.warnings.push_back(dir + " has neither a readable nodelist nor nodes file");
      continue;
    }
    std::string err;
    auto ids = sysfs::parse_list(*text, &err);
    if (!ids) {
      t.warnings.push_back(path + ": cannot parse (" + err + "); tier ignored");
      continue;
    }
    t.memory_tiers[k] = *ids;
    for (int id : *ids) {
      NumaNode* n = find_node(t, id);
      if (!n) continue;  // a tier may list a node that is not online (yet)
      if (n->memory_tier >= 0 && n->memory_tier != k)
        t.warnings.push_back("node " + std::to_string(id) + " is listed in memory_tier" +
                             std::to_string(n->memory_tier) + " and memory_tier" +
                             std::to_string(k) + "; keeping memory_tier" +
                             std::to_string(n->memory_tier));
      else
        n->memory_tier = k;
    }
  }

  // "true"/"false" on current kernels; accept kstrtobool's other spellings.
  const std::string demotion = join(t.sysfs_root, "kernel/mm/numa/demotion_enabled");
  if (auto text = sysfs::read_trimmed(demotion)) {
    const std::string& v = *text;
    if (v == "true" || v == "1" || v == "y" || v == "Y" || v == "on")
      t.demotion_enabled = true;
    else if (v == "false" || v == "0" || v == "n" || v == "N" || v == "off")
      t.demotion_enabled = false;
    else
      t.warnings.push_back(demotion + ": unexpected value '" + sysfs::printable(v) +
                           "'; assuming demotion is off");
  }
}

}  // namespace cxl::topology::detail
