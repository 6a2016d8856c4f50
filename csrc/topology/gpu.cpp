#include "topology/gpu.h"

#include <cstdio>

#include "common/error.h"
#include "driver/driver.h"
#include "topology/sysfs.h"

namespace cxl::topology {

namespace {

struct AttrSpec {
  int number;
  const char* name;  // without the CU_DEVICE_ATTRIBUTE_ prefix
  int if_rejected;   // 0 for flags/counts, -1 for ids
};

// The attributes the host tier cares about (cuda.h CUDA 13.0 numbering).
constexpr AttrSpec kAttrs[] = {
    {16, "MULTIPROCESSOR_COUNT", 0},
    {19, "CAN_MAP_HOST_MEMORY", 0},
    {33, "PCI_BUS_ID", -1},
    {34, "PCI_DEVICE_ID", -1},
    {36, "MEMORY_CLOCK_RATE", 0},
    {37, "GLOBAL_MEMORY_BUS_WIDTH", 0},
    {41, "UNIFIED_ADDRESSING", 0},
    {50, "PCI_DOMAIN_ID", -1},
    {75, "COMPUTE_CAPABILITY_MAJOR", 0},
    {76, "COMPUTE_CAPABILITY_MINOR", 0},
    {83, "MANAGED_MEMORY", 0},
    {88, "PAGEABLE_MEMORY_ACCESS", 0},
    {89, "CONCURRENT_MANAGED_ACCESS", 0},
    {91, "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", 0},
    {99, "HOST_REGISTER_SUPPORTED", 0},
    {100, "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES", 0},
    {101, "DIRECT_MANAGED_MEM_ACCESS_FROM_HOST", 0},
    {102, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 0},
    {115, "MEMORY_POOLS_SUPPORTED", 0},
    {116, "GPU_DIRECT_RDMA_SUPPORTED", 0},
    {130, "NUMA_CONFIG", 0},
    {131, "NUMA_ID", -1},
    {134, "HOST_NUMA_ID", -1},
    {141, "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 0},
    {142, "HOST_NUMA_MEMORY_POOLS_SUPPORTED", 0},
    {144, "HOST_MEMORY_POOLS_SUPPORTED", 0},
    {145, "HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 0},
};

constexpr int kNumaConfigNumaNode = 1;  // CU_DEVICE_NUMA_CONFIG_NUMA_NODE

}  // namespace

GpuCaps query_gpu(const driver::Driver& drv, int device) {
  if (device < 0 || device >= drv.device_count())
    throw Error(ErrorKind::InvalidArgument, "device: " + std::to_string(device) +
                                                " does not exist; the driver reports " +
                                                std::to_string(drv.device_count()) + " device(s) (0.." +
                                                std::to_string(drv.device_count() - 1) + ")");
  GpuCaps g;
  g.device = device;
  CUdevice dev = 0;
  CXL_CU(drv, cuDeviceGet, &dev, device);

  char name[256] = {0};
  CUresult r = CXL_CU_TRY(drv, cuDeviceGetName, name, static_cast<int>(sizeof name - 1), dev);
  if (r == CUDA_SUCCESS)
    g.name = name;
  else
    g.notes.push_back("cuDeviceGetName: " + drv.describe(r));
  size_t total = 0;
  r = CXL_CU_TRY(drv, cuDeviceTotalMem, &total, dev);
  if (r == CUDA_SUCCESS)
    g.total_bytes = total;
  else
    g.notes.push_back("cuDeviceTotalMem: " + drv.describe(r));

  std::map<int, int> v;
  for (const auto& a : kAttrs) {
    int value = 0;
    r = CXL_CU_TRY(drv, cuDeviceGetAttribute, &value, static_cast<CUdevice_attribute>(a.number), dev);
    std::string full = std::string("CU_DEVICE_ATTRIBUTE_") + a.name;
    if (r == CUDA_SUCCESS) {
      g.attributes[full] = value;
      v[a.number] = value;
    } else {
      v[a.number] = a.if_rejected;
      g.notes.push_back(full + " (" + std::to_string(a.number) + "): " + drv.describe(r) + "; read as " +
                        std::to_string(a.if_rejected));
    }
  }
  g.cc_major = v[75];
  g.cc_minor = v[76];
  g.host_numa_id = v[134];
  g.numa_config = v[130];
  g.numa_id = v[131];
  g.pci_domain = v[50];
  g.pci_bus = v[33];
  g.pci_device = v[34];
  g.vmm = v[102] != 0;
  g.host_numa_vmm = v[141] != 0;
  g.host_vmm = v[145] != 0;
  g.managed = v[83] != 0;
  g.concurrent_managed = v[89] != 0;
  g.pageable_access = v[88] != 0;
  g.uses_host_page_tables = v[100] != 0;
  g.host_register = v[99] != 0;
  g.can_use_host_ptr = v[91] != 0;
  g.unified_addressing = v[41] != 0;
  g.memory_pools = v[115] != 0;
  g.host_numa_pools = v[142] != 0;
  g.host_pools = v[144] != 0;
  g.can_map_host = v[19] != 0;
  return g;
}

int gpu_nearest_node(const GpuCaps& gpu, const Topology& topo) {
  if (gpu.host_numa_id >= 0) return gpu.host_numa_id;
  if (gpu.pci_domain < 0 || gpu.pci_bus < 0 || gpu.pci_device < 0) return -1;
  // A GPU is function 0 of its PCI device.
  char bdf[32];
  std::snprintf(bdf, sizeof bdf, "%04x:%02x:%02x.0", gpu.pci_domain, gpu.pci_bus, gpu.pci_device);
  auto text = sysfs::read_trimmed(sysfs::join(topo.sysfs_root, std::string("bus/pci/devices/") + bdf + "/numa_node"));
  if (!text) return -1;
  auto v = sysfs::parse_int(*text);
  // -1 is what the kernel prints when firmware gave the device no proximity.
  return v && *v >= 0 ? static_cast<int>(*v) : -1;
}

std::vector<int> gpu_memory_nodes(const GpuCaps& gpu) {
  if (gpu.numa_config == kNumaConfigNumaNode && gpu.numa_id >= 0) return {gpu.numa_id};
  return {};
}

std::string describe_backend_support(const GpuCaps& g) {
  auto yn = [](bool b) { return b ? "yes" : "no"; };
  std::string s;
  s += std::string("device (cuMemCreate on the GPU, VMM): ") + yn(g.vmm) + " (attr 102)\n";
  s += std::string("host-vmm (cuMemCreate HOST_NUMA): ") + yn(g.host_numa_vmm && g.vmm) + " (attr 141" +
       (g.host_numa_vmm && !g.vmm ? ", but VMM (102) is off" : "") + ")\n";
  s += std::string("host-numa pool (cuMemPoolCreate HOST_NUMA): ") + yn(g.host_numa_pools && g.memory_pools) +
       " (attr 142)\n";
  s += std::string("managed (cuMemAllocManaged + advise/prefetch to HOST_NUMA): ") + yn(g.managed) +
       " (attr 83); oversubscription/prefetch to GPU: " + yn(g.concurrent_managed) + " (attr 89)\n";
  s += std::string("pinned (mbind + cuMemHostRegister DEVICEMAP): ") + yn(g.host_register && g.can_map_host) +
       " (attrs 99, 19); host pointer usable on GPU: " + yn(g.can_use_host_ptr) + " (attr 91)\n";
  s += std::string("pageable (GPU access to plain malloc/mmap memory): ") + yn(g.pageable_access) +
       " (attr 88" + (g.uses_host_page_tables ? ", via host page tables/ATS" : "") + ")";
  return s;
}

}  // namespace cxl::topology
