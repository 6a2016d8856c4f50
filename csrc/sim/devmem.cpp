// Device memory outside VMM: cuMemAlloc / cuMemFree (also frees managed
// memory), cuMemGetInfo, and pointer queries (cuPointerGetAttribute).
#include <cstring>

#include "sim/config.h"
#include "sim/stream_executor.h"
#include "sim/faults.h"
#include "sim/memory.h"
#include "sim/numa.h"
#include "sim/state.h"

namespace cxlsim {

CUresult api_cuMemAlloc(CUdeviceptr* dptr, size_t bytesize) {
  return guarded(Fn::cuMemAlloc, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    r = check_capture_safe();
    if (r != CUDA_SUCCESS) return r;
    if (dptr == nullptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    // Charged in whole host pages (the real driver rounds too, by more).
    const uint64_t charged = page_up(bytesize);
    if (charged < bytesize) return CUDA_ERROR_OUT_OF_MEMORY;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    if (!charge_vram(reg, dev, charged)) return CUDA_ERROR_OUT_OF_MEMORY;
    auto mem = map_anonymous(charged);
    if (!mem) {
      uncharge_vram(reg, dev, charged);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t base = reinterpret_cast<uint64_t>(mem->base());
    DevAlloc a;
    a.base = base;
    a.size = bytesize;
    a.charged = charged;
    a.device = dev;
    a.mem = mem;
    reg.dev_allocs.emplace(base, std::move(a));
    *dptr = base;
    return CUDA_SUCCESS;
  });
}

// Frees cuMemAlloc and cuMemAllocManaged memory.  Synchronizes the owning
// device first, as cuda.h allows ("may perform implicit synchronization")
// and the real driver does: stream work never outlives this free.
CUresult api_cuMemFree(CUdeviceptr dptr) {
  return guarded(Fn::cuMemFree, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    r = check_capture_safe();
    if (r != CUDA_SUCCESS) return r;
    if (dptr == 0) return CUDA_SUCCESS;  // like cudaFree(NULL)
    Registry& reg = registry();
    int owner;
    {
      std::lock_guard<std::mutex> lk(reg.mu);
      auto d = reg.dev_allocs.find(dptr);
      auto m = reg.managed.find(dptr);
      if (d != reg.dev_allocs.end())
        owner = d->second.device;
      else if (m != reg.managed.end())
        owner = m->second.device;
      else
        return CUDA_ERROR_INVALID_VALUE;  // not the base of a live allocation
    }
    device_synchronize(owner);
    std::lock_guard<std::mutex> lk(reg.mu);
    auto d = reg.dev_allocs.find(dptr);
    if (d != reg.dev_allocs.end()) {
      uncharge_vram(reg, d->second.device, d->second.charged);
      reg.dev_allocs.erase(d);
      return CUDA_SUCCESS;
    }
    auto m = reg.managed.find(dptr);
    if (m == reg.managed.end()) return CUDA_ERROR_INVALID_VALUE;  // freed concurrently
    m->second.pages.for_each(m->second.base, m->second.base + m->second.size,
                             [&](uint64_t lo, uint64_t hi, const ManagedPages& p) {
                               if (p.resident_device >= 0) uncharge_vram(reg, p.resident_device, hi - lo);
                             });
    reg.managed.erase(m);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  return guarded(Fn::cuMemGetInfo, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    if (free_bytes == nullptr || total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const uint64_t total = config()->vram;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    *total_bytes = total;
    *free_bytes = total - std::min(total, reg.vram_used[dev]);
    return CUDA_SUCCESS;
  });
}

namespace {

// What a pointer refers to, for cuPointerGetAttribute.
struct PointerInfo {
  bool known = false;       // inside a driver allocation, registration or reservation
  bool mapped = false;      // backed by memory the device can address
  bool host = false;        // CU_MEMORYTYPE_HOST (else DEVICE)
  bool managed = false;
  int device = -1;          // owning / registering device, -1 when none
  bool has_context = false; // allocated through a context (not VMM)
  uint64_t base = 0, size = 0;
};

PointerInfo classify(uint64_t p) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lk(reg.mu);
  PointerInfo i;
  auto res = containing(reg.reservations, p);
  if (res != reg.reservations.end()) {
    i.known = true;
    i.base = res->first;
    i.size = res->second.size;
    auto m = containing(reg.mappings, p);
    if (m != reg.mappings.end()) {
      i.mapped = true;
      i.host = m->second.phys->host_tier();
      i.device = m->second.phys->device;
    }
    return i;
  }
  auto fill = [&](auto& map, bool host, bool managed) {
    auto it = containing(map, p);
    if (it == map.end()) return false;
    i.known = i.mapped = i.has_context = true;
    i.host = host;
    i.managed = managed;
    i.device = it->second.device;
    i.base = it->first;
    i.size = it->second.size;
    return true;
  };
  if (fill(reg.dev_allocs, false, false) || fill(reg.managed, false, true) || fill(reg.host_allocs, true, false) ||
      fill(reg.registrations, true, false))
    return i;
  return i;
}

}  // namespace

// Modelled: CONTEXT, MEMORY_TYPE, DEVICE_POINTER, HOST_POINTER, IS_MANAGED,
// DEVICE_ORDINAL, RANGE_START_ADDR, RANGE_SIZE, MAPPED.  The other
// attributes of cuda.h return CUDA_ERROR_NOT_SUPPORTED.  Boolean attributes
// are written as unsigned int, as the real driver does.  VMM memory belongs
// to no context (CONTEXT reads NULL); host-tier VMM memory reads as HOST
// memory with device ordinal -1.  Managed memory reads as DEVICE memory
// with IS_MANAGED = 1.  All simulated memory has one address for host and
// device (CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 1).
CUresult api_cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  return guarded(Fn::cuPointerGetAttribute, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (data == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const int a = raw(attribute);
    const bool modelled = a == 1 || a == 2 || a == 3 || a == 4 || a == 8 || a == 9 || a == 11 || a == 12 || a == 13;
    if (!modelled) return (a >= 5 && a <= 21) ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
    if (a == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) {
      int dev;
      r = current_device(&dev);
      if (r != CUDA_SUCCESS) return r;
    }
    const PointerInfo i = classify(ptr);
    if (!i.known) return CUDA_ERROR_INVALID_VALUE;
    switch (a) {
      case 11:  // RANGE_START_ADDR
        *static_cast<CUdeviceptr*>(data) = i.base;
        return CUDA_SUCCESS;
      case 12:  // RANGE_SIZE
        *static_cast<size_t*>(data) = i.size;
        return CUDA_SUCCESS;
      case 13:  // MAPPED
        *static_cast<unsigned*>(data) = i.mapped ? 1u : 0u;
        return CUDA_SUCCESS;
      default:
        break;
    }
    if (!i.mapped) return CUDA_ERROR_INVALID_VALUE;  // reserved VA with nothing behind it
    switch (a) {
      case CU_POINTER_ATTRIBUTE_CONTEXT:
        *static_cast<CUcontext*>(data) = i.has_context ? context_of(i.device) : nullptr;
        return CUDA_SUCCESS;
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *static_cast<unsigned*>(data) = i.host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        return CUDA_SUCCESS;
      case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        *static_cast<CUdeviceptr*>(data) = ptr;
        return CUDA_SUCCESS;
      case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (!i.host && !i.managed) return CUDA_ERROR_INVALID_VALUE;  // device memory has no host address
        *static_cast<void**>(data) = reinterpret_cast<void*>(ptr);
        return CUDA_SUCCESS;
      case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *static_cast<unsigned*>(data) = i.managed ? 1u : 0u;
        return CUDA_SUCCESS;
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *static_cast<int*>(data) = i.device;
        return CUDA_SUCCESS;
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
  });
}

}  // namespace cxlsim
