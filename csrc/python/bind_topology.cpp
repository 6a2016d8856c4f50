// Topology layer for Python: sysfs NUMA/CXL discovery, host node choice,
// page placement, GPU capabilities.  Plain dicts cross the boundary so the
// CLI can print them, tests can edit them, and JSON can carry them (integer
// keys may come back as strings; both are accepted).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "backend/placement.h"
#include "common/error.h"
#include "driver/driver.h"
#include "python/bindings.h"
#include "python/convert.h"
#include "topology/choose.h"
#include "topology/gpu.h"
#include "topology/numa.h"

namespace py = pybind11;

namespace cxl::python {

namespace {

using topology::GpuCaps;
using topology::NumaNode;
using topology::Topology;

py::dict node_to_dict(const NumaNode& n) {
  py::dict d;
  d["id"] = n.id;
  d["total_bytes"] = n.total_bytes;
  d["free_bytes"] = n.free_bytes;
  d["cpus"] = n.cpus;
  d["has_cpu"] = n.has_cpu;
  d["has_memory"] = n.has_memory;
  d["movable_only"] = n.movable_only;
  d["movable_bytes"] = n.movable_bytes;
  d["memory_tier"] = n.memory_tier;
  py::dict dist;  // only known distances: {node id: distance}
  for (size_t j = 0; j < n.distance.size(); ++j)
    if (n.distance[j] >= 0) dist[py::int_(j)] = n.distance[j];
  d["distance"] = dist;
  d["cxl"] = n.cxl;
  d["cxl_detail"] = n.cxl_detail;
  return d;
}

py::dict topology_to_dict(const Topology& t) {
  py::dict d;
  d["sysfs_root"] = t.sysfs_root;
  py::list nodes;
  for (const auto& n : t.nodes) nodes.append(node_to_dict(n));
  d["nodes"] = nodes;
  d["cxl_bus_present"] = t.cxl_bus_present;
  d["cxl_regions"] = t.cxl_regions;
  d["cxl_memdevs"] = t.cxl_memdevs;
  d["demotion_enabled"] = t.demotion_enabled;
  py::dict tiers;
  for (const auto& [k, ids] : t.memory_tiers) tiers[py::int_(k)] = ids;
  d["memory_tiers"] = tiers;
  d["warnings"] = t.warnings;
  return d;
}

// int(h): accepts "3" too, as JSON object keys come back as strings.
int as_int(py::handle h) { return py::int_(py::reinterpret_borrow<py::object>(h)).cast<int>(); }

template <typename T>
T get(const py::dict& d, const char* key, T dflt) {
  return d.contains(key) && !d[key].is_none() ? d[key].cast<T>() : dflt;
}

// Inverse of topology_to_dict, tolerant of missing keys (they take their
// "unknown" values) so a hand-written dict is enough for a what-if.
Topology dict_to_topology(const py::dict& d) {
  Topology t;
  t.sysfs_root = get<std::string>(d, "sysfs_root", "");
  if (d.contains("nodes")) {
    for (auto item : d["nodes"]) {
      py::dict nd = item.cast<py::dict>();
      NumaNode n;
      n.id = get<int>(nd, "id", -1);
      if (n.id < 0) throw Error(ErrorKind::InvalidArgument, "topology: every node needs an 'id' >= 0");
      n.total_bytes = get<uint64_t>(nd, "total_bytes", 0);
      n.free_bytes = get<uint64_t>(nd, "free_bytes", 0);
      n.cpus = get<std::vector<int>>(nd, "cpus", {});
      n.has_cpu = get<bool>(nd, "has_cpu", !n.cpus.empty());
      n.has_memory = get<bool>(nd, "has_memory", n.total_bytes > 0);
      n.movable_only = get<bool>(nd, "movable_only", false);
      n.movable_bytes = get<uint64_t>(nd, "movable_bytes", 0);
      n.memory_tier = get<int>(nd, "memory_tier", -1);
      n.cxl = get<bool>(nd, "cxl", false);
      n.cxl_detail = get<std::string>(nd, "cxl_detail", "");
      if (nd.contains("distance") && !nd["distance"].is_none()) {
        py::object dist = nd["distance"];
        if (py::isinstance<py::dict>(dist)) {
          for (auto kv : dist.cast<py::dict>()) {
            int j = as_int(kv.first), v = as_int(kv.second);
            if (j < 0) continue;
            if (n.distance.size() <= static_cast<size_t>(j)) n.distance.resize(static_cast<size_t>(j) + 1, -1);
            n.distance[static_cast<size_t>(j)] = v;
          }
        } else {
          n.distance = dist.cast<std::vector<int>>();
        }
      }
      t.nodes.push_back(std::move(n));
    }
  }
  t.cxl_bus_present = get<bool>(d, "cxl_bus_present", false);
  t.cxl_regions = get<std::vector<std::string>>(d, "cxl_regions", {});
  t.cxl_memdevs = get<std::vector<std::string>>(d, "cxl_memdevs", {});
  t.demotion_enabled = get<bool>(d, "demotion_enabled", false);
  if (d.contains("memory_tiers") && !d["memory_tiers"].is_none())
    for (auto kv : d["memory_tiers"].cast<py::dict>())
      t.memory_tiers[as_int(kv.first)] = kv.second.cast<std::vector<int>>();
  t.warnings = get<std::vector<std::string>>(d, "warnings", {});
  return t;
}

// None -> the default root; a str/PathLike -> read that root; a dict -> as given.
Topology topology_arg(const py::object& o) {
  if (o.is_none()) return topology::read_topology();
  if (py::isinstance<py::dict>(o)) return dict_to_topology(o.cast<py::dict>());
  if (py::isinstance<py::str>(o) || py::hasattr(o, "__fspath__"))
    return topology::read_topology(py::str(py::module_::import("os").attr("fspath")(o)).cast<std::string>());
  throw py::type_error("topology: expected a dict from read_topology(), a sysfs root path, or None");
}

std::string requested_arg(const py::object& o) {
  if (o.is_none()) return "auto";
  if (py::isinstance<py::bool_>(o))
    throw Error(ErrorKind::InvalidArgument, "numa_node: expected \"auto\" or a node id, got a bool");
  if (py::isinstance<py::int_>(o)) return std::to_string(o.cast<long long>());
  return o.cast<std::string>();
}

std::unique_ptr<backend::NumaOps> ops_for(const py::object& simulated_driver) {
  if (simulated_driver.is_none()) return backend::linux_numa_ops();
  auto drv = driver::Driver::open(py::str(simulated_driver).cast<std::string>(), true);
  return backend::sim_numa_ops(drv);
}

py::dict gpu_to_dict(const GpuCaps& g) {
  py::dict d;
  d["device"] = g.device;
  d["name"] = g.name;
  d["total_bytes"] = g.total_bytes;
  d["cc_major"] = g.cc_major;
  d["cc_minor"] = g.cc_minor;
  d["host_numa_id"] = g.host_numa_id;
  d["numa_config"] = g.numa_config;
  d["numa_id"] = g.numa_id;
  d["pci_domain"] = g.pci_domain;
  d["pci_bus"] = g.pci_bus;
  d["pci_device"] = g.pci_device;
  d["vmm"] = g.vmm;
  d["host_numa_vmm"] = g.host_numa_vmm;
  d["host_vmm"] = g.host_vmm;
  d["managed"] = g.managed;
  d["concurrent_managed"] = g.concurrent_managed;
  d["pageable_access"] = g.pageable_access;
  d["uses_host_page_tables"] = g.uses_host_page_tables;
  d["host_register"] = g.host_register;
  d["can_use_host_ptr"] = g.can_use_host_ptr;
  d["unified_addressing"] = g.unified_addressing;
  d["memory_pools"] = g.memory_pools;
  d["host_numa_pools"] = g.host_numa_pools;
  d["host_pools"] = g.host_pools;
  d["can_map_host"] = g.can_map_host;
  d["attributes"] = g.attributes;
  d["notes"] = g.notes;
  d["gpu_memory_nodes"] = topology::gpu_memory_nodes(g);
  d["backend_support"] = topology::describe_backend_support(g);
  return d;
}

GpuCaps dict_to_gpu(const py::dict& d) {
  GpuCaps g;
  g.device = get<int>(d, "device", -1);
  g.host_numa_id = get<int>(d, "host_numa_id", -1);
  g.numa_config = get<int>(d, "numa_config", 0);
  g.numa_id = get<int>(d, "numa_id", -1);
  g.pci_domain = get<int>(d, "pci_domain", -1);
  g.pci_bus = get<int>(d, "pci_bus", -1);
  g.pci_device = get<int>(d, "pci_device", -1);
  return g;
}

}  // namespace

void bind_topology(py::module_& m) {
  m.def(
      "read_topology", [](const py::object& root) {
        return topology_to_dict(root.is_none() ? topology::read_topology()
                                               : topology::read_topology(py::str(root).cast<std::string>()));
      },
      py::arg("sysfs_root") = py::none(),
      "Read host NUMA nodes, memory tiers and CXL devices from sysfs.\n\n"
      "sysfs_root: default $CXLALLOC_SYSFS_ROOT or '/sys'.  Never raises for missing or\n"
      "garbled files; they are listed in 'warnings'.  Returns {'sysfs_root', 'nodes': [{'id',\n"
      "'total_bytes', 'free_bytes', 'cpus', 'has_cpu', 'has_memory', 'movable_only',\n"
      "'movable_bytes', 'memory_tier', 'distance': {node: slit}, 'cxl', 'cxl_detail'}],\n"
      "'cxl_bus_present', 'cxl_regions', 'cxl_memdevs', 'demotion_enabled',\n"
      "'memory_tiers': {tier: [nodes]}, 'warnings'}.  Sizes are bytes.");

  m.def(
      "choose_host_node",
      [](const py::object& topo, int gpu_near_node, const py::object& requested,
         const std::vector<int>& exclude_nodes) {
        auto c = topology::choose_host_node(topology_arg(topo), gpu_near_node, requested_arg(requested),
                                            exclude_nodes);
        py::dict d;
        d["node"] = c.node;
        d["reason"] = c.reason;
        d["warnings"] = c.warnings;
        return d;
      },
      py::arg("topology") = py::none(), py::arg("gpu_near_node") = -1, py::arg("requested") = "auto",
      py::arg("exclude_nodes") = std::vector<int>{},
      "Choose the host NUMA node for the spill tier.\n\n"
      "topology: a read_topology() dict, a sysfs root path, or None (read the default root).\n"
      "gpu_near_node: the GPU's nearest host node, -1 unknown.  requested: 'auto' or a node id.\n"
      "exclude_nodes: GPU-memory NUMA nodes never to choose.  Returns {'node', 'reason',\n"
      "'warnings'}.  Raises ValueError naming numa_node and the allowed values.");

  m.def(
      "numa_bind",
      [](uintptr_t ptr, size_t length, int node, const py::object& simulated_driver) {
        ops_for(simulated_driver)->bind(reinterpret_cast<void*>(ptr), length, node);
      },
      py::arg("ptr"), py::arg("length"), py::arg("node"), py::arg("simulated_driver") = py::none(),
      "Bind [ptr, ptr+length) (bytes, page-aligned, mapped, not yet touched) to host node `node`\n"
      "with MPOL_BIND.  simulated_driver: path of the simulated driver library to bind through\n"
      "its cxlsim_numa_bind instead of mbind.  Raises ValueError (bad range or node) or\n"
      "CudaUnavailableError (memory policies refused here) with the errno text.");

  m.def(
      "page_nodes",
      [](uintptr_t ptr, size_t length, const py::object& simulated_driver) {
        return ops_for(simulated_driver)->page_nodes(reinterpret_cast<const void*>(ptr), length);
      },
      py::arg("ptr"), py::arg("length"), py::arg("simulated_driver") = py::none(),
      "Bytes of [ptr, ptr+length) backed by each NUMA node now: {node: bytes}; pages never\n"
      "touched count under -1.  Faults nothing in (move_pages status query).");

  m.def(
      "check_placement",
      [](uintptr_t ptr, size_t length, int node, const py::object& simulated_driver) {
        auto ops = ops_for(simulated_driver);
        return placement_dict(backend::check_placement(*ops, reinterpret_cast<const void*>(ptr), length, node));
      },
      py::arg("ptr"), py::arg("length"), py::arg("node"), py::arg("simulated_driver") = py::none(),
      "Verify that every byte of [ptr, ptr+length) is populated and on `node`: {'ok',\n"
      "'on_node', 'elsewhere', 'unpopulated' (bytes), 'method', 'detail'}.");

  m.def(
      "query_gpu",
      [](const std::string& libcuda, int device, bool simulated) {
        auto drv = driver::Driver::open(libcuda, simulated);
        return gpu_to_dict(topology::query_gpu(*drv, device));
      },
      py::arg("libcuda") = "libcuda.so.1", py::arg("device") = 0, py::arg("simulated") = false,
      "Capabilities of GPU `device` relevant to host-tier memory: flags, ids, raw\n"
      "'attributes' by CU_DEVICE_ATTRIBUTE_ name, 'notes' on attributes the driver rejected,\n"
      "'gpu_memory_nodes', 'backend_support'.  Raises CudaUnavailableError without a driver.");

  m.def(
      "gpu_nearest_node",
      [](const py::dict& gpu, const py::object& topo) {
        return topology::gpu_nearest_node(dict_to_gpu(gpu), topology_arg(topo));
      },
      py::arg("gpu"), py::arg("topology") = py::none(),
      "The GPU's nearest host node: gpu['host_numa_id'] if >= 0, else the numa_node of its\n"
      "PCI function under the topology's sysfs root, else -1.");
}

}  // namespace cxl::python
