// The exported ABI: cuGetProcAddress (both forms) handing out every entry
// point by base name and ABI version, and the same entry points as
// dlsym-able symbols under the versioned names the real libcuda exports for
// that ABI (cuMemAlloc -> cuMemAlloc_v2, ...).
#include <cstring>
#include <type_traits>

#include "sim/config.h"
#include "sim/faults.h"

namespace cxlsim {

namespace {

struct ProcEntry {
  const char* name;  // base name
  int version;       // ABI version this implementation has
  void* fn;
};

// Every function of driver.h's table at exactly the version cxlalloc asks
// for (a mismatch between that list and our definitions fails to link).
const ProcEntry kProcs[] = {
#define CXLSIM_PROC(name, ver, req, ret, params) {#name, ver, reinterpret_cast<void*>(&api_##name)},
    CXL_DRIVER_FUNCTIONS(CXLSIM_PROC)
#undef CXLSIM_PROC
    {"cuGetProcAddress", 11030, reinterpret_cast<void*>(&api_cuGetProcAddress)},
    {"cuGetProcAddress", 12000, reinterpret_cast<void*>(&api_cuGetProcAddress_v2)},
};

// cuda.h: a version above the driver's is INVALID_VALUE; an unknown symbol,
// or one whose ABI is newer than `version`, is CUDA_SUCCESS with a NULL
// pointer and the reason in *status.  The simulator implements one ABI per
// function (the one cxlalloc uses), so asking for an older ABI of a
// function that had one (e.g. cuMemAdvise at 8000) reports
// VERSION_NOT_SUFFICIENT where the real driver would return the old entry.
CUresult lookup(const char* symbol, void** pfn, int version, cuuint64_t flags,
                CUdriverProcAddressQueryResult* status) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // DEFAULT, LEGACY_STREAM, PER_THREAD_DEFAULT_STREAM: the simulator has no
  // _ptsz/_ptds variants, so all three return the same functions.
  if (flags > 2) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
  auto set = [&](CUdriverProcAddressQueryResult q) {
    if (status) *status = q;
  };
  if (version > config()->version) {
    set(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    return CUDA_ERROR_INVALID_VALUE;
  }
  const ProcEntry* best = nullptr;
  bool known = false;
  for (const auto& p : kProcs) {
    if (std::strcmp(p.name, symbol) != 0) continue;
    known = true;
    if (p.version <= version && (best == nullptr || p.version > best->version)) best = &p;
  }
  if (best == nullptr) {
    set(known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    return CUDA_SUCCESS;
  }
  *pfn = best->fn;
  set(CU_GET_PROC_ADDRESS_SUCCESS);
  return CUDA_SUCCESS;
}

}  // namespace

CUresult api_cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult* status) {
  return guarded(Fn::cuGetProcAddress, [&] { return lookup(symbol, pfn, cuda_version, flags, status); });
}

CUresult api_cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags) {
  return guarded(Fn::cuGetProcAddress, [&] { return lookup(symbol, pfn, cuda_version, flags, nullptr); });
}

}  // namespace cxlsim

// dlsym-able entry points.  The static_assert pins each wrapper to the exact
// prototype of its api_ function (itself declared from driver.h's table).
#define CXLSIM_EXPORT(sym, name, params, args)                                                     \
  extern "C" CXLSIM_API CUresult sym params { return cxlsim::api_##name args; }                    \
  static_assert(std::is_same_v<decltype(&sym), decltype(&cxlsim::api_##name)>, #sym " prototype");

CXLSIM_EXPORT(cuInit, cuInit, (unsigned int f), (f))
CXLSIM_EXPORT(cuDriverGetVersion, cuDriverGetVersion, (int* v), (v))
CXLSIM_EXPORT(cuDeviceGet, cuDeviceGet, (CUdevice * d, int o), (d, o))
CXLSIM_EXPORT(cuDeviceGetCount, cuDeviceGetCount, (int* c), (c))
CXLSIM_EXPORT(cuDeviceGetName, cuDeviceGetName, (char* n, int l, CUdevice d), (n, l, d))
CXLSIM_EXPORT(cuDeviceTotalMem_v2, cuDeviceTotalMem, (size_t * b, CUdevice d), (b, d))
CXLSIM_EXPORT(cuDeviceGetAttribute, cuDeviceGetAttribute, (int* p, CUdevice_attribute a, CUdevice d), (p, a, d))
CXLSIM_EXPORT(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (CUcontext * c, CUdevice d), (c, d))
CXLSIM_EXPORT(cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease, (CUdevice d), (d))
CXLSIM_EXPORT(cuCtxGetCurrent, cuCtxGetCurrent, (CUcontext * c), (c))
CXLSIM_EXPORT(cuCtxSetCurrent, cuCtxSetCurrent, (CUcontext c), (c))
CXLSIM_EXPORT(cuCtxSynchronize, cuCtxSynchronize, (), ())
CXLSIM_EXPORT(cuMemGetInfo_v2, cuMemGetInfo, (size_t * f, size_t* t), (f, t))
CXLSIM_EXPORT(cuMemAlloc_v2, cuMemAlloc, (CUdeviceptr * p, size_t n), (p, n))
CXLSIM_EXPORT(cuMemFree_v2, cuMemFree, (CUdeviceptr p), (p))
CXLSIM_EXPORT(cuMemAddressReserve, cuMemAddressReserve,
              (CUdeviceptr * p, size_t s, size_t a, CUdeviceptr h, unsigned long long f), (p, s, a, h, f))
CXLSIM_EXPORT(cuMemAddressFree, cuMemAddressFree, (CUdeviceptr p, size_t s), (p, s))
CXLSIM_EXPORT(cuMemCreate, cuMemCreate,
              (CUmemGenericAllocationHandle * h, size_t s, const CUmemAllocationProp* p, unsigned long long f),
              (h, s, p, f))
CXLSIM_EXPORT(cuMemRelease, cuMemRelease, (CUmemGenericAllocationHandle h), (h))
CXLSIM_EXPORT(cuMemMap, cuMemMap,
              (CUdeviceptr p, size_t s, size_t o, CUmemGenericAllocationHandle h, unsigned long long f),
              (p, s, o, h, f))
CXLSIM_EXPORT(cuMemUnmap, cuMemUnmap, (CUdeviceptr p, size_t s), (p, s))
CXLSIM_EXPORT(cuMemSetAccess, cuMemSetAccess, (CUdeviceptr p, size_t s, const CUmemAccessDesc* d, size_t c),
              (p, s, d, c))
CXLSIM_EXPORT(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity,
              (size_t * g, const CUmemAllocationProp* p, CUmemAllocationGranularity_flags o), (g, p, o))
CXLSIM_EXPORT(cuMemAllocManaged, cuMemAllocManaged, (CUdeviceptr * p, size_t n, unsigned int f), (p, n, f))
CXLSIM_EXPORT(cuMemAdvise_v2, cuMemAdvise, (CUdeviceptr p, size_t n, CUmem_advise a, CUmemLocation l),
              (p, n, a, l))
CXLSIM_EXPORT(cuMemPrefetchAsync_v2, cuMemPrefetchAsync,
              (CUdeviceptr p, size_t n, CUmemLocation l, unsigned int f, CUstream s), (p, n, l, f, s))
CXLSIM_EXPORT(cuMemRangeGetAttribute, cuMemRangeGetAttribute,
              (void* d, size_t ds, CUmem_range_attribute a, CUdeviceptr p, size_t n), (d, ds, a, p, n))
CXLSIM_EXPORT(cuPointerGetAttribute, cuPointerGetAttribute, (void* d, CUpointer_attribute a, CUdeviceptr p),
              (d, a, p))
CXLSIM_EXPORT(cuMemHostRegister_v2, cuMemHostRegister, (void* p, size_t n, unsigned int f), (p, n, f))
CXLSIM_EXPORT(cuMemHostUnregister, cuMemHostUnregister, (void* p), (p))
CXLSIM_EXPORT(cuMemHostGetDevicePointer_v2, cuMemHostGetDevicePointer, (CUdeviceptr * d, void* p, unsigned int f),
              (d, p, f))
CXLSIM_EXPORT(cuMemHostAlloc, cuMemHostAlloc, (void** p, size_t n, unsigned int f), (p, n, f))
CXLSIM_EXPORT(cuMemFreeHost, cuMemFreeHost, (void* p), (p))
CXLSIM_EXPORT(cuMemcpy, cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
CXLSIM_EXPORT(cuMemcpyAsync, cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
CXLSIM_EXPORT(cuStreamCreate, cuStreamCreate, (CUstream * s, unsigned int f), (s, f))
CXLSIM_EXPORT(cuStreamDestroy_v2, cuStreamDestroy, (CUstream s), (s))
CXLSIM_EXPORT(cuStreamSynchronize, cuStreamSynchronize, (CUstream s), (s))
CXLSIM_EXPORT(cuStreamQuery, cuStreamQuery, (CUstream s), (s))
CXLSIM_EXPORT(cuStreamWaitEvent, cuStreamWaitEvent, (CUstream s, CUevent e, unsigned int f), (s, e, f))
CXLSIM_EXPORT(cuStreamIsCapturing, cuStreamIsCapturing, (CUstream s, CUstreamCaptureStatus * c), (s, c))
CXLSIM_EXPORT(cuEventCreate, cuEventCreate, (CUevent * e, unsigned int f), (e, f))
CXLSIM_EXPORT(cuEventRecord, cuEventRecord, (CUevent e, CUstream s), (e, s))
CXLSIM_EXPORT(cuEventQuery, cuEventQuery, (CUevent e), (e))
CXLSIM_EXPORT(cuEventSynchronize, cuEventSynchronize, (CUevent e), (e))
CXLSIM_EXPORT(cuEventDestroy_v2, cuEventDestroy, (CUevent e), (e))
CXLSIM_EXPORT(cuGetErrorName, cuGetErrorName, (CUresult e, const char** s), (e, s))
CXLSIM_EXPORT(cuGetErrorString, cuGetErrorString, (CUresult e, const char** s), (e, s))
CXLSIM_EXPORT(cuGetProcAddress, cuGetProcAddress, (const char* s, void** p, int v, cuuint64_t f), (s, p, v, f))
CXLSIM_EXPORT(cuGetProcAddress_v2, cuGetProcAddress_v2,
              (const char* s, void** p, int v, cuuint64_t f, CUdriverProcAddressQueryResult* q), (s, p, v, f, q))

#undef CXLSIM_EXPORT
