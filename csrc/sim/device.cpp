// cuInit, the driver version, devices and their attributes.
//
// The simulated GPU is H200-like: every capability cxlalloc may rely on is
// supported unless a spec overrides it with attr.N=V.  Attributes that no
// table entry names read as 0, as they would on a device lacking them.
#include <cstdio>
#include <cstring>

#include "sim/config.h"
#include "sim/stream_executor.h"
#include "sim/faults.h"
#include "sim/state.h"

namespace cxlsim {

namespace {

struct AttrDefault {
  int attr;
  int value;
};

// H200 SXM figures where a real value is meaningful; the PCI bus id is
// per-device (see attribute()).
constexpr AttrDefault kDefaults[] = {
    {1, 1024},        // MAX_THREADS_PER_BLOCK
    {2, 1024},        // MAX_BLOCK_DIM_X
    {3, 1024},        // MAX_BLOCK_DIM_Y
    {4, 64},          // MAX_BLOCK_DIM_Z
    {5, 2147483647},  // MAX_GRID_DIM_X
    {6, 65535},       // MAX_GRID_DIM_Y
    {7, 65535},       // MAX_GRID_DIM_Z
    {8, 49152},       // MAX_SHARED_MEMORY_PER_BLOCK
    {9, 65536},       // TOTAL_CONSTANT_MEMORY
    {10, 32},         // WARP_SIZE
    {11, 2147483647}, // MAX_PITCH
    {12, 65536},      // MAX_REGISTERS_PER_BLOCK
    {13, 1980000},    // CLOCK_RATE (kHz)
    {14, 512},        // TEXTURE_ALIGNMENT
    {15, 1},          // GPU_OVERLAP
    {16, 132},        // MULTIPROCESSOR_COUNT
    {19, 1},          // CAN_MAP_HOST_MEMORY
    {30, 512},        // SURFACE_ALIGNMENT
    {31, 1},          // CONCURRENT_KERNELS
    {32, 1},          // ECC_ENABLED
    {34, 0},          // PCI_DEVICE_ID
    {36, 2619000},    // MEMORY_CLOCK_RATE (kHz)
    {37, 6144},       // GLOBAL_MEMORY_BUS_WIDTH (bits)
    {38, 52428800},   // L2_CACHE_SIZE
    {39, 2048},       // MAX_THREADS_PER_MULTIPROCESSOR
    {40, 5},          // ASYNC_ENGINE_COUNT
    {41, 1},          // UNIFIED_ADDRESSING
    {50, 0},          // PCI_DOMAIN_ID
    {75, 9},          // COMPUTE_CAPABILITY_MAJOR
    {76, 0},          // COMPUTE_CAPABILITY_MINOR
    {78, 1},          // STREAM_PRIORITIES_SUPPORTED
    {79, 1},          // GLOBAL_L1_CACHE_SUPPORTED
    {80, 1},          // LOCAL_L1_CACHE_SUPPORTED
    {81, 233472},     // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    {82, 65536},      // MAX_REGISTERS_PER_MULTIPROCESSOR
    {83, 1},          // MANAGED_MEMORY
    {88, 0},          // PAGEABLE_MEMORY_ACCESS (x86 without HMM)
    {89, 1},          // CONCURRENT_MANAGED_ACCESS
    {90, 1},          // COMPUTE_PREEMPTION_SUPPORTED
    {91, 1},          // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
    {95, 1},          // COOPERATIVE_LAUNCH
    {97, 232448},     // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    {99, 1},          // HOST_REGISTER_SUPPORTED
    {100, 0},         // PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES
    {101, 0},         // DIRECT_MANAGED_MEM_ACCESS_FROM_HOST
    {102, 1},         // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    {103, 1},         // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    {106, 32},        // MAX_BLOCKS_PER_MULTIPROCESSOR
    {107, 1},         // GENERIC_COMPRESSION_SUPPORTED
    {110, 1},         // GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    {111, 1024},      // RESERVED_SHARED_MEMORY_PER_BLOCK
    {112, 1},         // SPARSE_CUDA_ARRAY_SUPPORTED
    {113, 1},         // READ_ONLY_HOST_REGISTER_SUPPORTED
    {114, 1},         // TIMELINE_SEMAPHORE_INTEROP_SUPPORTED
    {115, 1},         // MEMORY_POOLS_SUPPORTED
    {116, 1},         // GPU_DIRECT_RDMA_SUPPORTED
    {119, 1},         // MEMPOOL_SUPPORTED_HANDLE_TYPES (POSIX fd)
    {120, 1},         // CLUSTER_LAUNCH
    {121, 1},         // DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED
    {122, 1},         // CAN_USE_64_BIT_STREAM_MEM_OPS
    {123, 1},         // CAN_USE_STREAM_WAIT_VALUE_NOR
    {124, 1},         // DMA_BUF_SUPPORTED
    {125, 1},         // IPC_EVENT_SUPPORTED
    {126, 4},         // MEM_SYNC_DOMAIN_COUNT
    {127, 1},         // TENSOR_MAP_ACCESS_SUPPORTED
    {129, 1},         // UNIFIED_FUNCTION_POINTERS
    {130, 0},         // NUMA_CONFIG: GPU memory is not a NUMA node
    {131, -1},        // NUMA_ID
    {132, 1},         // MULTICAST_SUPPORTED
    {139, 0x233510de},  // GPU_PCI_DEVICE_ID: H200 SXM (0x2335), NVIDIA (0x10de)
    {140, 0x18be10de},  // GPU_PCI_SUBSYSTEM_ID
    {141, 1},         // HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    {142, 1},         // HOST_NUMA_MEMORY_POOLS_SUPPORTED
    {144, 1},         // HOST_MEMORY_POOLS_SUPPORTED
    {145, 1},         // HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
};

}  // namespace

int attribute(int dev, int attr) {
  auto c = config();
  auto it = c->attrs.find(attr);
  if (it != c->attrs.end()) return it->second;
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
      return 0x18 + 0x10 * dev;  // distinct bus per GPU, like an 8-GPU HGX board
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID:
      return c->gpu_numa;
    case 84:  // MULTI_GPU_BOARD
      return c->devices > 1 ? 1 : 0;
    default:
      break;
  }
  for (const auto& d : kDefaults)
    if (d.attr == attr) return d.value;
  return 0;
}

CUresult api_cuInit(unsigned int flags) {
  return guarded(Fn::cuInit, [&] {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (executor_shut_down()) return executor_forked() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_DEINITIALIZED;
    if (device_count() == 0) return CUDA_ERROR_NO_DEVICE;
    set_initialized(true);
    return CUDA_SUCCESS;
  });
}

// Works before cuInit, as in CUDA.
CUresult api_cuDriverGetVersion(int* version) {
  return guarded(Fn::cuDriverGetVersion, [&] {
    if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *version = config()->version;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuDeviceGet(CUdevice* device, int ordinal) {
  return guarded(Fn::cuDeviceGet, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuDeviceGetCount(int* count) {
  return guarded(Fn::cuDeviceGetCount, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *count = device_count();
    return CUDA_SUCCESS;
  });
}

CUresult api_cuDeviceGetName(char* name, int len, CUdevice dev) {
  return guarded(Fn::cuDeviceGetName, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    // Truncated to len-1 characters and always terminated, like the driver.
    std::snprintf(name, static_cast<size_t>(len), "cxlalloc simulated GPU %d", dev);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuDeviceTotalMem(size_t* bytes, CUdevice dev) {
  return guarded(Fn::cuDeviceTotalMem, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = config()->vram;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuDeviceGetAttribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  return guarded(Fn::cuDeviceGetAttribute, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (pi == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    const int a = raw(attrib);
    if (a < 1 || a > kMaxDeviceAttribute) return CUDA_ERROR_INVALID_VALUE;
    *pi = attribute(dev, a);
    return CUDA_SUCCESS;
  });
}

}  // namespace cxlsim
