// The CUDA driver API, loaded at run time.
//
// Why dlopen + cuGetProcAddress instead of linking libcuda: the package must
// build and import on machines with no GPU and no driver (CI), report *why*
// CUDA is unavailable instead of failing to load, and run the same code against
// the simulated driver (csrc/sim) in tests.  Symbols are resolved by base name
// and the ABI version they were introduced with (docs/sources.md#driver-abi,
// the same table NCCL's cudawrap.cc uses), so a CUDA 13 header never
// silently binds a function with a different signature on an older driver.
#pragma once

#include <memory>
#include <string>

#include "driver/cuda_types.h"

namespace cxl::driver {

// X(name, cuda_version, required, return, params)
//   name          base symbol passed to cuGetProcAddress ("cuMemAdvise", not "_v2")
//   cuda_version  the ABI version we want (the PFN suffix in cudaTypedefs.h)
//   required      1: loading fails without it; 0: optional, checked where used
#define CXL_DRIVER_FUNCTIONS(X)                                                                    \
  X(cuInit, 2000, 1, CUresult, (unsigned int flags))                                               \
  X(cuDriverGetVersion, 2020, 1, CUresult, (int* version))                                        \
  X(cuDeviceGet, 2000, 1, CUresult, (CUdevice* device, int ordinal))                               \
  X(cuDeviceGetCount, 2000, 1, CUresult, (int* count))                                            \
  X(cuDeviceGetName, 2000, 1, CUresult, (char* name, int len, CUdevice dev))                       \
  X(cuDeviceTotalMem, 3020, 1, CUresult, (size_t * bytes, CUdevice dev))                           \
  X(cuDeviceGetAttribute, 2000, 1, CUresult, (int* pi, CUdevice_attribute attrib, CUdevice dev))   \
  X(cuDevicePrimaryCtxRetain, 7000, 1, CUresult, (CUcontext * pctx, CUdevice dev))                 \
  X(cuDevicePrimaryCtxRelease, 11000, 1, CUresult, (CUdevice dev))                                 \
  X(cuCtxGetCurrent, 4000, 1, CUresult, (CUcontext * pctx))                                        \
  X(cuCtxSetCurrent, 4000, 1, CUresult, (CUcontext ctx))                                           \
  X(cuCtxSynchronize, 2000, 1, CUresult, ())                                                      \
  X(cuMemGetInfo, 3020, 1, CUresult, (size_t * free_bytes, size_t * total_bytes))                  \
  X(cuMemAlloc, 3020, 1, CUresult, (CUdeviceptr * dptr, size_t bytesize))                          \
  X(cuMemFree, 3020, 1, CUresult, (CUdeviceptr dptr))                                              \
  X(cuMemAddressReserve, 10020, 0, CUresult,                                                       \
    (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags)) \
  X(cuMemAddressFree, 10020, 0, CUresult, (CUdeviceptr ptr, size_t size))                          \
  X(cuMemCreate, 10020, 0, CUresult,                                                               \
    (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp* prop,          \
     unsigned long long flags))                                                                    \
  X(cuMemRelease, 10020, 0, CUresult, (CUmemGenericAllocationHandle handle))                       \
  X(cuMemMap, 10020, 0, CUresult,                                                                  \
    (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,             \
     unsigned long long flags))                                                                    \
  X(cuMemUnmap, 10020, 0, CUresult, (CUdeviceptr ptr, size_t size))                                \
  X(cuMemSetAccess, 10020, 0, CUresult,                                                            \
    (CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count))                     \
  X(cuMemGetAllocationGranularity, 10020, 0, CUresult,                                             \
    (size_t * granularity, const CUmemAllocationProp* prop,                                        \
     CUmemAllocationGranularity_flags option))                                                     \
  X(cuMemAllocManaged, 6000, 0, CUresult, (CUdeviceptr * dptr, size_t bytesize, unsigned int flags)) \
  X(cuMemAdvise, 12020, 0, CUresult,                                                               \
    (CUdeviceptr dev_ptr, size_t count, CUmem_advise advice, CUmemLocation location))              \
  X(cuMemPrefetchAsync, 12020, 0, CUresult,                                                        \
    (CUdeviceptr dev_ptr, size_t count, CUmemLocation location, unsigned int flags,                \
     CUstream stream))                                                                             \
  X(cuMemRangeGetAttribute, 8000, 0, CUresult,                                                     \
    (void* data, size_t data_size, CUmem_range_attribute attribute, CUdeviceptr dev_ptr,           \
     size_t count))                                                                                \
  X(cuPointerGetAttribute, 4000, 0, CUresult,                                                      \
    (void* data, CUpointer_attribute attribute, CUdeviceptr ptr))                                  \
  X(cuMemHostRegister, 6050, 0, CUresult, (void* p, size_t bytesize, unsigned int flags))          \
  X(cuMemHostUnregister, 4000, 0, CUresult, (void* p))                                             \
  X(cuMemHostGetDevicePointer, 3020, 0, CUresult,                                                  \
    (CUdeviceptr * pdptr, void* p, unsigned int flags))                                            \
  X(cuMemHostAlloc, 2020, 0, CUresult, (void** pp, size_t bytesize, unsigned int flags))           \
  X(cuMemFreeHost, 2000, 0, CUresult, (void* p))                                                   \
  X(cuMemcpy, 4000, 1, CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t bytes))                 \
  X(cuMemcpyAsync, 4000, 1, CUresult,                                                              \
    (CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream))                             \
  X(cuStreamCreate, 2000, 1, CUresult, (CUstream * stream, unsigned int flags))                    \
  X(cuStreamDestroy, 4000, 1, CUresult, (CUstream stream))                                         \
  X(cuStreamSynchronize, 2000, 1, CUresult, (CUstream stream))                                     \
  X(cuStreamQuery, 2000, 1, CUresult, (CUstream stream))                                           \
  X(cuStreamWaitEvent, 3020, 1, CUresult, (CUstream stream, CUevent event, unsigned int flags))    \
  X(cuStreamIsCapturing, 10000, 0, CUresult, (CUstream stream, CUstreamCaptureStatus * status))    \
  X(cuEventCreate, 2000, 1, CUresult, (CUevent * event, unsigned int flags))                       \
  X(cuEventRecord, 2000, 1, CUresult, (CUevent event, CUstream stream))                            \
  X(cuEventQuery, 2000, 1, CUresult, (CUevent event))                                              \
  X(cuEventSynchronize, 2000, 1, CUresult, (CUevent event))                                        \
  X(cuEventDestroy, 4000, 1, CUresult, (CUevent event))                                            \
  X(cuGetErrorName, 6000, 1, CUresult, (CUresult error, const char** str))                        \
  X(cuGetErrorString, 6000, 1, CUresult, (CUresult error, const char** str))

// The table of resolved entry points.  Members are named fn_<symbol> so that
// cuda.h's `#define cuMemAdvise cuMemAdvise_v2` style macros never rename them.
struct Api {
#define CXL_DECLARE_FN(name, ver, req, ret, params) ret(*fn_##name) params = nullptr;
  CXL_DRIVER_FUNCTIONS(CXL_DECLARE_FN)
#undef CXL_DECLARE_FN
};

// A loaded driver (real libcuda or the simulator).  Shared by every device's
// allocator; lives as long as any of them (shared_ptr), and never dlcloses:
// unloading a CUDA driver while torch or a deleter may still call into it is
// not safe, and the process exits soon after anyway.
class Driver {
 public:
  // Load the driver at `path` ("libcuda.so.1" by default) and call cuInit.
  // Throws cxl::Error(Unavailable) with "CUDA unavailable: <reason>".
  static std::shared_ptr<Driver> open(const std::string& path, bool simulated);

  // The simulated driver shipped with the package (cxlalloc/_simcuda*.so);
  // `path` is found by the Python layer and passed to open().
  bool simulated() const { return simulated_; }
  const std::string& path() const { return path_; }
  int version() const { return version_; }  // e.g. 13000
  int device_count() const { return device_count_; }
  const Api& api() const { return api_; }

  // Throw DriverError "<call> failed: CUDA_ERROR_X (<string>)" unless r == CUDA_SUCCESS.
  void check(CUresult r, const char* call) const;
  // Call an entry point, throwing Unsupported when the driver lacks it (an
  // optional symbol) and DriverError when it fails.
  template <typename F, typename... A>
  void call(F fn, const char* name, A... args) const {
    if (fn == nullptr) missing(name);
    check(fn(args...), name);
  }
  template <typename F, typename... A>
  CUresult try_call(F fn, const char* name, A... args) const {
    if (fn == nullptr) missing(name);
    return fn(args...);
  }
  [[noreturn]] void missing(const char* name) const;
  // "CUDA_ERROR_OUT_OF_MEMORY (out of memory)", also for unknown codes.
  std::string describe(CUresult r) const;
  // Address of an extra symbol of the loaded library (the simulator's cxlsim_*
  // controls); nullptr when absent.
  void* symbol(const char* name) const;

  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

 private:
  Driver() = default;
  void* handle_ = nullptr;
  bool simulated_ = false;
  std::string path_;
  int version_ = 0;
  int device_count_ = 0;
  Api api_;
};

}  // namespace cxl::driver

// Call a driver function through the table and throw on failure:
//   CXL_CU(drv, cuMemCreate, &h, bytes, &prop, 0);
#define CXL_CU(drv, name, ...) (drv).call((drv).api().fn_##name, #name, ##__VA_ARGS__)
// Same call, returning the CUresult for callers that handle failure themselves
// (still throws Unsupported if the symbol is missing).
#define CXL_CU_TRY(drv, name, ...) (drv).try_call((drv).api().fn_##name, #name, ##__VA_ARGS__)
