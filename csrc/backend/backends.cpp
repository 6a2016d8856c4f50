#include "backend/backends.h"

#include "common/error.h"
#include "driver/resources.h"

namespace cxl::backend {

const char* host_backend_name(HostBackend b) {
  switch (b) {
    case HostBackend::HostVmm: return "host-vmm";
    case HostBackend::Managed: return "managed";
    case HostBackend::Pinned: return "pinned";
  }
  return "?";
}

std::optional<HostBackend> parse_host_backend(const std::string& s) {
  if (s == "auto") return std::nullopt;
  if (s == "host-vmm") return HostBackend::HostVmm;
  if (s == "managed") return HostBackend::Managed;
  if (s == "pinned") return HostBackend::Pinned;
  throw Error(ErrorKind::InvalidArgument,
              "backend: '" + s + "' is not a backend; allowed: auto, host-vmm, managed, pinned");
}

namespace {
bool attr(const driver::Driver& drv, int device, CUdevice_attribute a) {
  int v = 0;
  // An attribute unknown to an older driver reads as "unsupported".
  if (drv.api().fn_cuDeviceGetAttribute(&v, a, device) != CUDA_SUCCESS) return false;
  return v != 0;
}

size_t granularity(const driver::Driver& drv, CUmemLocationType type, int id) {
  if (drv.api().fn_cuMemGetAllocationGranularity == nullptr) return 0;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  size_t g = 0;
  if (drv.api().fn_cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS)
    return 0;
  return g;
}
}  // namespace

DeviceFacts read_device_facts(const driver::Driver& drv, int device, int host_node) {
  DeviceFacts f;
  f.device = device;
  f.driver_version = drv.version();
  f.vmm = attr(drv, device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  f.host_numa_vmm = attr(drv, device, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  f.managed = attr(drv, device, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY);
  f.concurrent_managed = attr(drv, device, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS);
  f.host_register = attr(drv, device, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED);
  f.can_map_host = attr(drv, device, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY);
  f.can_use_host_ptr = attr(drv, device, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM);
  if (f.vmm) f.device_granularity = granularity(drv, CU_MEM_LOCATION_TYPE_DEVICE, device);
  if (f.host_numa_vmm && host_node >= 0)
    f.host_granularity = granularity(drv, CU_MEM_LOCATION_TYPE_HOST_NUMA, host_node);
  CXL_CU(drv, cuDeviceTotalMem, &f.total_bytes, device);
  CXL_CU(drv, cuMemGetInfo, &f.free_bytes, &f.total_bytes);
  return f;
}

Support device_vmm_support(const DeviceFacts& f) {
  if (!f.vmm) return {false, "the GPU does not support the virtual memory management API (attribute 102)"};
  if (f.device_granularity == 0) return {false, "cuMemGetAllocationGranularity failed for the device"};
  return {true, ""};
}

Support host_support(HostBackend b, const DeviceFacts& f) {
  switch (b) {
    case HostBackend::HostVmm:
      if (f.driver_version < 12020)
        return {false, "CU_MEM_LOCATION_TYPE_HOST_NUMA needs a CUDA 12.2+ driver (have " +
                           std::to_string(f.driver_version) + ")"};
      if (!f.vmm) return {false, "no VMM support (attribute 102)"};
      if (!f.host_numa_vmm) return {false, "no HOST_NUMA support in cuMemCreate (attribute 141)"};
      if (f.host_granularity == 0) return {false, "cuMemGetAllocationGranularity failed for HOST_NUMA"};
      return {true, ""};
    case HostBackend::Managed:
      if (!f.managed) return {false, "no managed memory (attribute 83)"};
      if (!f.concurrent_managed)
        return {false, "no concurrent managed access (attribute 89): advise/prefetch to the GPU is unavailable"};
      if (f.driver_version < 12020)
        return {false, "cuMemAdvise/cuMemPrefetchAsync with a HOST_NUMA location need a CUDA 12.2+ driver"};
      return {true, ""};
    case HostBackend::Pinned:
      if (!f.host_register) return {false, "cuMemHostRegister unsupported (attribute 99)"};
      if (!f.can_map_host) return {false, "the GPU cannot map host memory (attribute 19)"};
      return {true, ""};
  }
  return {false, "unknown backend"};
}

Support probe_host_vmm(const std::shared_ptr<const driver::Driver>& drv, int node, size_t granularity) {
  try {
    CUmemLocation loc{CU_MEM_LOCATION_TYPE_HOST_NUMA, node};
    driver::PhysicalMemory probe(drv, granularity, loc);
    return {true, ""};
  } catch (const Error& e) {
    return {false, "the driver rejected cuMemCreate on host NUMA node " + std::to_string(node) + ": " + e.what()};
  }
}

}  // namespace cxl::backend
