// Page-locked host memory: cuMemHostAlloc / cuMemFreeHost and
// cuMemHostRegister / cuMemHostUnregister / cuMemHostGetDevicePointer.
//
// The simulator does not page-lock anything (mlock would cost real RAM and
// limits); it tracks the ranges so every overlap, base-address and flag rule
// is enforced, and applies the relocate=A:B rule on registration.
// cuMemHostAlloc pages go to the simulated node nearest the calling CPU (as
// pinned allocations do), which reject_numa can refuse.
#include <sys/mman.h>

#include "sim/config.h"
#include "sim/stream_executor.h"
#include "sim/faults.h"
#include "sim/memory.h"
#include "sim/numa.h"
#include "sim/state.h"

namespace cxlsim {

namespace {

constexpr unsigned kHostAllocFlags = 0x7;  // PORTABLE | DEVICEMAP | WRITECOMBINED
constexpr unsigned kRegisterIoMemory = 0x4;
constexpr unsigned kRegisterFlags = 0xF;   // PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY

// Pinning works on whole pages, so two ranges sharing a page overlap.
template <typename M>
bool overlaps_pages(const M& m, uint64_t b, uint64_t e) {
  b = page_down(b);
  e = page_up(e);
  for (const auto& [base, v] : m)
    if (page_down(base) < e && page_up(base + v.size) > b) return true;
  return false;
}

// cuMemFreeHost and cuMemHostUnregister: `p` must be an entry's base
// (else `missing`); both are implicitly synchronizing (like cudaFreeHost), so
// the owner device's work finishes before the entry goes.
template <typename M>
CUresult release_after_sync(M& entries, void* p, CUresult missing) {
  int dev;
  CUresult r = current_device(&dev);
  if (r != CUDA_SUCCESS) return r;
  r = check_capture_safe();
  if (r != CUDA_SUCCESS) return r;
  Registry& reg = registry();
  const auto key = reinterpret_cast<uint64_t>(p);
  int owner;
  {
    std::lock_guard<std::mutex> lk(reg.mu);
    auto it = entries.find(key);
    if (it == entries.end()) return missing;
    owner = it->second.device;
  }
  device_synchronize(owner);
  std::lock_guard<std::mutex> lk(reg.mu);
  return entries.erase(key) == 0 ? missing : CUDA_SUCCESS;
}

}  // namespace

CUresult api_cuMemHostAlloc(void** pp, size_t bytesize, unsigned int flags) {
  return guarded(Fn::cuMemHostAlloc, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    r = check_capture_safe();
    if (r != CUDA_SUCCESS) return r;
    if (pp == nullptr || bytesize == 0 || (flags & ~kHostAllocFlags) != 0) return CUDA_ERROR_INVALID_VALUE;
    const int node = current_sim_node();
    if (config()->reject_numa.count(node)) return CUDA_ERROR_INVALID_VALUE;  // nccl#2190 / open-gpu-kernel-modules#885
    const uint64_t size = page_up(bytesize);
    if (size < bytesize) return CUDA_ERROR_OUT_OF_MEMORY;
    auto mem = map_anonymous(size);
    if (!mem || !bind_pages(mem->base(), size, real_node_of(node), false)) return CUDA_ERROR_OUT_OF_MEMORY;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    uint64_t base = reinterpret_cast<uint64_t>(mem->base());
    HostAlloc h;
    h.base = base;
    h.size = bytesize;
    h.flags = flags;
    h.node = node;
    h.device = dev;
    h.mem = mem;
    reg.host_allocs.emplace(base, std::move(h));
    *pp = mem->base();
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemFreeHost(void* p) {
  return guarded(Fn::cuMemFreeHost,
                 [&] { return release_after_sync(registry().host_allocs, p, CUDA_ERROR_INVALID_VALUE); });
}

CUresult api_cuMemHostRegister(void* p, size_t bytesize, unsigned int flags) {
  return guarded(Fn::cuMemHostRegister, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    r = check_capture_safe();
    if (r != CUDA_SUCCESS) return r;
    if (attribute(dev, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) == 0) return CUDA_ERROR_NOT_SUPPORTED;
    if (p == nullptr || bytesize == 0 || (flags & ~kRegisterFlags) != 0) return CUDA_ERROR_INVALID_VALUE;
    if (flags & kRegisterIoMemory) return CUDA_ERROR_NOT_SUPPORTED;  // no PCI BAR to map here
    if ((flags & CU_MEMHOSTREGISTER_READ_ONLY) &&
        attribute(dev, 113 /* READ_ONLY_HOST_REGISTER_SUPPORTED */) == 0)
      return CUDA_ERROR_NOT_SUPPORTED;
    const uint64_t b = reinterpret_cast<uint64_t>(p), e = b + bytesize;
    if (e < b) return CUDA_ERROR_INVALID_VALUE;
    // The whole range must be mapped in the process (msync fails with ENOMEM
    // on any hole).
    if (msync(reinterpret_cast<void*>(page_down(b)), page_up(e) - page_down(b), MS_ASYNC) != 0)
      return CUDA_ERROR_INVALID_VALUE;
    {
      Registry& reg = registry();
      std::lock_guard<std::mutex> lk(reg.mu);
      // Device and managed memory is the driver's own, not registrable.
      if (overlaps(reg.reservations, b, e) || overlaps(reg.dev_allocs, b, e) || overlaps(reg.managed, b, e))
        return CUDA_ERROR_INVALID_VALUE;
      if (overlaps_pages(reg.registrations, b, e) || overlaps_pages(reg.host_allocs, b, e))
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
      Registration reg_entry;
      reg_entry.base = b;
      reg_entry.size = bytesize;
      reg_entry.flags = flags;
      reg_entry.device = dev;
      reg.registrations.emplace(b, reg_entry);
    }
    // Long-term pinning migrates ZONE_MOVABLE pages off their node
    // (docs/sources.md#cpu-less-nodes).
    relocate_on_register(b, e);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemHostUnregister(void* p) {
  // cuda.h: p must be the base address given to cuMemHostRegister.
  return guarded(Fn::cuMemHostUnregister, [&] {
    return release_after_sync(registry().registrations, p, CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  });
}

// The device address of mapped pinned memory.  Every simulated GPU has
// CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, so it is the host address itself
// (an attr.91=0 override changes the attribute, not this address).
CUresult api_cuMemHostGetDevicePointer(CUdeviceptr* pdptr, void* p, unsigned int flags) {
  return guarded(Fn::cuMemHostGetDevicePointer, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    if (pdptr == nullptr || p == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (attribute(dev, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY) == 0) return CUDA_ERROR_INVALID_VALUE;
    const uint64_t a = reinterpret_cast<uint64_t>(p);
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    unsigned f;
    auto h = containing(reg.host_allocs, a);
    auto g = containing(reg.registrations, a);
    if (h != reg.host_allocs.end())
      f = h->second.flags;
    else if (g != reg.registrations.end())
      f = g->second.flags;
    else
      return CUDA_ERROR_INVALID_VALUE;
    // cuda.h: fails unless the memory was allocated/registered with DEVICEMAP.
    if ((f & CU_MEMHOSTALLOC_DEVICEMAP) == 0) return CUDA_ERROR_INVALID_VALUE;
    *pdptr = a;
    return CUDA_SUCCESS;
  });
}

}  // namespace cxlsim
