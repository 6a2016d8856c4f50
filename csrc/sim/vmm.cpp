// Virtual memory management: cuMemAddressReserve/Free, cuMemCreate/Release,
// cuMemMap/Unmap, cuMemSetAccess, cuMemGetAllocationGranularity.
//
// None of these needs a current context (as in CUDA).  Validation follows
// cuda.h's contracts; where cuda.h leaves the error unspecified (an address
// freed with live mappings, a released or unknown handle) the simulator
// returns CUDA_ERROR_INVALID_VALUE rather than invoking undefined behaviour.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "sim/config.h"
#include "sim/faults.h"
#include "sim/memory.h"
#include "sim/numa.h"
#include "sim/state.h"

namespace cxlsim {

namespace {

constexpr int kReserveFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

bool aligned(uint64_t v, uint64_t a) { return v % a == 0; }

int cpu_prot(uint8_t flags) {
  if ((flags & CU_MEM_ACCESS_FLAGS_PROT_READWRITE) == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return PROT_READ | PROT_WRITE;
  return (flags & CU_MEM_ACCESS_FLAGS_PROT_READ) ? PROT_READ : PROT_NONE;
}

// The mappings that exactly tile [ptr, ptr+size): the range must start at a
// mapping, end at one's end, and have no hole (cuMemUnmap and cuMemSetAccess
// operate on whole mappings).  Registry lock held.
bool whole_mappings(Registry& r, uint64_t ptr, uint64_t size, std::vector<Mapping*>* out) {
  out->clear();
  uint64_t end = ptr + size;
  if (end < ptr) return false;
  for (uint64_t cur = ptr; cur < end;) {
    auto it = r.mappings.find(cur);
    if (it == r.mappings.end()) return false;
    Mapping& m = it->second;
    if (m.va + m.size > end) return false;
    out->push_back(&m);
    cur = m.va + m.size;
  }
  return true;
}

bool vmm_supported() { return attribute(0, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0; }

// Validate prop->location for cuMemCreate/granularity queries; sets *node.
CUresult check_location(const CUmemAllocationProp* prop, bool creating, int* node) {
  auto c = config();
  const CUmemLocation& loc = prop->location;
  *node = -1;
  switch (raw(loc.type)) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      if (!valid_device(loc.id)) return CUDA_ERROR_INVALID_DEVICE;
      return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
      if (attribute(0, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) == 0)
        return CUDA_ERROR_NOT_SUPPORTED;
      if (!c->node(loc.id)) return CUDA_ERROR_INVALID_VALUE;
      // The driver refuses some nodes outright (nccl#2190: CPU-less nodes).
      if (creating && c->reject_numa.count(loc.id)) return CUDA_ERROR_INVALID_VALUE;
      *node = loc.id;
      return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST:
      // A CUDA 13.0 addition: older drivers do not know the location type.
      if (c->version < 13000) return CUDA_ERROR_INVALID_VALUE;
      if (attribute(0, CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) == 0)
        return CUDA_ERROR_NOT_SUPPORTED;
      // cuda.h: HOST allocations are not IPC capable.
      if (raw(prop->requestedHandleTypes) != CU_MEM_HANDLE_TYPE_NONE) return CUDA_ERROR_INVALID_VALUE;
      *node = current_sim_node();  // "no specific node": placed near the calling CPU
      return CUDA_SUCCESS;
    default:  // INVALID, HOST_NUMA_CURRENT (cuda.h: INVALID_VALUE), anything else
      return CUDA_ERROR_INVALID_VALUE;
  }
}

}  // namespace

CUresult api_cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags) {
  return guarded(Fn::cuMemAddressReserve, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!vmm_supported()) return CUDA_ERROR_NOT_SUPPORTED;
    if (ptr == nullptr || size == 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (!aligned(size, kPageSize) || !aligned(addr, kPageSize)) return CUDA_ERROR_INVALID_VALUE;
    if (alignment != 0 && (alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
    // Reservations start on a granularity boundary so their start can be mapped.
    uint64_t align = std::max<uint64_t>(alignment, config()->granularity);
    if (size > UINT64_MAX - align) return CUDA_ERROR_OUT_OF_MEMORY;

    void* p = MAP_FAILED;
    if (addr != 0 && aligned(addr, align)) {  // the hint, if free
      p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE, kReserveFlags | MAP_FIXED_NOREPLACE, -1, 0);
      if (p != MAP_FAILED && p != reinterpret_cast<void*>(addr)) {  // kernel without NOREPLACE
        munmap(p, size);
        p = MAP_FAILED;
      }
    }
    if (p == MAP_FAILED) {
      void* raw = mmap(nullptr, size + align, PROT_NONE, kReserveFlags, -1, 0);
      if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
      uint64_t b = reinterpret_cast<uint64_t>(raw), a = (b + align - 1) / align * align;
      if (a > b) munmap(raw, a - b);
      if (b + size + align > a + size) munmap(reinterpret_cast<void*>(a + size), b + size + align - (a + size));
      p = reinterpret_cast<void*>(a);
    }
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    uint64_t base = reinterpret_cast<uint64_t>(p);
    reg.reservations[base] = Reservation{base, size};
    *ptr = base;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  return guarded(Fn::cuMemAddressFree, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    auto it = reg.reservations.find(ptr);
    // cuda.h: ptr and size must be exactly what cuMemAddressReserve gave.
    if (it == reg.reservations.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
    // Freeing VA that still has mappings would orphan them.
    if (overlaps(reg.mappings, ptr, ptr + size)) return CUDA_ERROR_INVALID_VALUE;
    munmap(reinterpret_cast<void*>(ptr), size);
    reg.reservations.erase(it);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                         unsigned long long flags) {
  return guarded(Fn::cuMemCreate, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!vmm_supported()) return CUDA_ERROR_NOT_SUPPORTED;
    if (handle == nullptr || prop == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (raw(prop->type) != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    auto c = config();
    if (size == 0 || !aligned(size, c->granularity)) return CUDA_ERROR_INVALID_VALUE;
    int node;
    r = check_location(prop, true, &node);
    if (r != CUDA_SUCCESS) return r;
    // NONE and POSIX fd are accepted (nothing here exports handles); other
    // shareable types need facilities the simulator does not model.
    const int ht = raw(prop->requestedHandleTypes);
    if (ht != 0 && ht != 1) return CUDA_ERROR_NOT_SUPPORTED;

    const bool device = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    if (device && !charge_vram(reg, prop->location.id, size)) return CUDA_ERROR_OUT_OF_MEMORY;
    auto undo_charge = [&] {
      if (device) uncharge_vram(reg, prop->location.id, size);
    };
    auto phys = std::make_shared<PhysAlloc>();
    phys->fd = memfd_create("cxlsim-phys", MFD_CLOEXEC);
    if (phys->fd < 0 || ftruncate(phys->fd, static_cast<off_t>(size)) != 0) {
      undo_charge();
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void* view = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, phys->fd, 0);
    if (view == MAP_FAILED) {
      undo_charge();
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    phys->view = std::make_shared<Backing>(view, size);
    // A memfd's NUMA policy is shared by every mapping of it: binding the
    // view once places the pages wherever they are later touched from.
    if (!device && !bind_pages(view, size, real_node_of(node), false)) {
      undo_charge();
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    phys->handle = reg.next_handle++;
    phys->size = size;
    phys->type = prop->location.type;
    phys->device = device ? prop->location.id : -1;
    phys->node = node;
    if (!device) reg.host_tier_bytes += size;
    reg.handles.emplace(phys->handle, phys);
    *handle = phys->handle;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemRelease(CUmemGenericAllocationHandle handle) {
  return guarded(Fn::cuMemRelease, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    auto it = reg.handles.find(handle);
    if (it == reg.handles.end() || it->second->released) return CUDA_ERROR_INVALID_VALUE;
    auto phys = it->second;
    phys->released = true;
    // Still-mapped memory lives on until its last cuMemUnmap (cuda.h).
    maybe_free_phys(reg, phys);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags) {
  return guarded(Fn::cuMemMap, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (flags != 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
    const uint64_t g = config()->granularity;
    if (!aligned(ptr, g) || !aligned(size, g) || !aligned(offset, g)) return CUDA_ERROR_INVALID_VALUE;
    if (offset != 0) return CUDA_ERROR_INVALID_VALUE;  // cuda.h: "currently must be zero"
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    auto h = reg.handles.find(handle);
    if (h == reg.handles.end() || h->second->released) return CUDA_ERROR_INVALID_VALUE;
    auto phys = h->second;
    if (offset + size > phys->size) return CUDA_ERROR_INVALID_VALUE;
    auto res = containing(reg.reservations, ptr);
    if (res == reg.reservations.end() || ptr + size > res->first + res->second.size) return CUDA_ERROR_INVALID_VALUE;
    if (overlaps(reg.mappings, ptr, ptr + size)) return CUDA_ERROR_INVALID_VALUE;  // only unmapped VA

    // Mapped with no access: cuMemSetAccess grants it.
    void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, phys->fd,
                   static_cast<off_t>(offset));
    if (p == MAP_FAILED) {
      mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, kReserveFlags | MAP_FIXED, -1, 0);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    Mapping m;
    m.va = ptr;
    m.size = size;
    m.offset = offset;
    m.phys = phys;
    reg.mappings.emplace(ptr, m);
    ++phys->maps;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemUnmap(CUdeviceptr ptr, size_t size) {
  return guarded(Fn::cuMemUnmap, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    std::vector<Mapping*> maps;
    // cuda.h: whole mappings only, never a sub-range of one.
    if (!whole_mappings(reg, ptr, size, &maps)) return CUDA_ERROR_INVALID_VALUE;
    // No implicit synchronization (PyTorch's expandable segments synchronize
    // the stream themselves before unmapping for this reason): stream work
    // that touches the range later faults asynchronously.
    for (Mapping* m : maps) {
      uint64_t va = m->va, len = m->size;
      auto phys = m->phys;
      mmap(reinterpret_cast<void*>(va), len, PROT_NONE, kReserveFlags | MAP_FIXED, -1, 0);
      reg.mappings.erase(va);
      --phys->maps;
      maybe_free_phys(reg, phys);
    }
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  return guarded(Fn::cuMemSetAccess, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    std::vector<Mapping*> maps;
    if (!whole_mappings(reg, ptr, size, &maps)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; ++i) {
      const CUmemAccessDesc& d = desc[i];
      const int fl = raw(d.flags);
      if (fl != CU_MEM_ACCESS_FLAGS_PROT_NONE && fl != CU_MEM_ACCESS_FLAGS_PROT_READ &&
          fl != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        return CUDA_ERROR_INVALID_VALUE;
      switch (raw(d.location.type)) {
        case CU_MEM_LOCATION_TYPE_DEVICE:
          if (!valid_device(d.location.id)) return CUDA_ERROR_INVALID_DEVICE;
          break;
        case CU_MEM_LOCATION_TYPE_HOST_NUMA:
          // cuda.h: no HOST_NUMA access for allocations of other location types.
          for (Mapping* m : maps)
            if (m->phys->type != CU_MEM_LOCATION_TYPE_HOST_NUMA) return CUDA_ERROR_INVALID_VALUE;
          break;
        case CU_MEM_LOCATION_TYPE_HOST:
          // The CPU cannot map device memory.
          for (Mapping* m : maps)
            if (!m->phys->host_tier()) return CUDA_ERROR_INVALID_VALUE;
          break;
        default:
          return CUDA_ERROR_INVALID_VALUE;
      }
    }
    for (Mapping* m : maps) {
      for (size_t i = 0; i < count; ++i) {
        if (raw(desc[i].location.type) == CU_MEM_LOCATION_TYPE_DEVICE)
          m->dev_access[desc[i].location.id] = static_cast<uint8_t>(raw(desc[i].flags));
        else
          m->host_access = static_cast<uint8_t>(raw(desc[i].flags));
      }
      // See memory.h: host memory follows the CPU's grant; device memory
      // follows any device's grant, so tests can inspect it from the CPU.
      uint8_t effective = m->host_access;
      if (!m->phys->host_tier()) {
        effective = 0;
        for (int dev = 0; dev < kMaxDevices; ++dev) effective |= m->dev_access[dev];
      }
      if (mprotect(reinterpret_cast<void*>(m->va), m->size, cpu_prot(effective)) != 0) return CUDA_ERROR_UNKNOWN;
    }
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                           CUmemAllocationGranularity_flags option) {
  return guarded(Fn::cuMemGetAllocationGranularity, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!vmm_supported()) return CUDA_ERROR_NOT_SUPPORTED;
    if (granularity == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (raw(option) != CU_MEM_ALLOC_GRANULARITY_MINIMUM && raw(option) != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
      return CUDA_ERROR_INVALID_VALUE;
    if (raw(prop->type) != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    int node;
    r = check_location(prop, false, &node);
    if (r != CUDA_SUCCESS) return r;
    // One granularity for minimum and recommended, device and host (the
    // real driver reports 2 MiB for both on H100/H200).
    *granularity = config()->granularity;
    return CUDA_SUCCESS;
  });
}

}  // namespace cxlsim
