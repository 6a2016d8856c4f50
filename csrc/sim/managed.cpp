// Managed (unified) memory: cuMemAllocManaged, cuMemAdvise,
// cuMemPrefetchAsync, cuMemRangeGetAttribute.
//
// Pages are anonymous host memory the CPU can always touch.  The simulator
// tracks, per page, the advice given and where prefetches placed the data:
//  * a prefetch to a device moves the pages' residency to that device and
//    charges its VRAM; one to a host location uncharges it and, in stream
//    order, migrates the real pages to the backing real node (mbind MOVE);
//  * residency and VRAM change when cuMemPrefetchAsync is called, not when
//    the stream reaches it (the data never actually moves);
//  * when the pages do not fit in the target device's free VRAM the call
//    fails with CUDA_ERROR_OUT_OF_MEMORY.  The real driver would evict other
//    managed pages to host memory instead: the simulator never evicts.
//  * SET_PREFERRED_LOCATION to a host NUMA node also binds the pages there
//    (no migration), so first touch lands on that node as under UVM.
#include <algorithm>

#include "sim/config.h"
#include "sim/stream_executor.h"
#include "sim/faults.h"
#include "sim/memory.h"
#include "sim/numa.h"
#include "sim/state.h"

namespace cxlsim {

namespace {

constexpr int kDeviceCpu = -1;      // CU_DEVICE_CPU
constexpr int kDeviceInvalid = -2;  // CU_DEVICE_INVALID

// The managed allocation holding [ptr, ptr+count), page-rounded into [*b, *e).
ManagedAlloc* managed_range(Registry& reg, CUdeviceptr ptr, size_t count, uint64_t* b, uint64_t* e) {
  if (count == 0 || ptr + count < ptr) return nullptr;
  auto it = containing(reg.managed, ptr);
  if (it == reg.managed.end()) return nullptr;
  *b = page_down(ptr);
  *e = page_up(ptr + count);
  if (*e > it->second.base + it->second.size) return nullptr;
  return &it->second;
}

bool same(const CUmemLocation& a, const CUmemLocation& b) { return a.type == b.type && a.id == b.id; }

// A device location usable for managed memory (cuda.h: a valid ordinal with
// CONCURRENT_MANAGED_ACCESS).
CUresult check_managed_device(int id) {
  if (!valid_device(id) || attribute(id, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS) == 0)
    return CUDA_ERROR_INVALID_DEVICE;
  return CUDA_SUCCESS;
}

// Normalize a host-side location: HOST ignores its id; HOST_NUMA_CURRENT is
// the calling thread's node.  INVALID_VALUE for unknown nodes/types.
CUresult host_location(const CUmemLocation& in, CUmemLocation* out) {
  switch (raw(in.type)) {
    case CU_MEM_LOCATION_TYPE_HOST:
      *out = CUmemLocation{CU_MEM_LOCATION_TYPE_HOST, 0};
      return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
      if (!config()->node(in.id)) return CUDA_ERROR_INVALID_VALUE;
      *out = in;
      return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
      *out = CUmemLocation{CU_MEM_LOCATION_TYPE_HOST_NUMA, current_sim_node()};
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
}

// The legacy int form of a location (device id, CU_DEVICE_CPU, or invalid).
int legacy_id(const CUmemLocation& l) {
  if (l.type == CU_MEM_LOCATION_TYPE_DEVICE) return l.id;
  if (l.type == CU_MEM_LOCATION_TYPE_HOST || l.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) return kDeviceCpu;
  return kDeviceInvalid;
}

}  // namespace

CUresult api_cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) {
  return guarded(Fn::cuMemAllocManaged, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    r = check_capture_safe();
    if (r != CUDA_SUCCESS) return r;
    if (attribute(dev, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY) == 0) return CUDA_ERROR_NOT_SUPPORTED;
    if (dptr == nullptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
    const uint64_t size = page_up(bytesize);
    if (size < bytesize) return CUDA_ERROR_OUT_OF_MEMORY;
    auto mem = map_anonymous(size);
    if (!mem) return CUDA_ERROR_OUT_OF_MEMORY;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    uint64_t base = reinterpret_cast<uint64_t>(mem->base());
    ManagedAlloc a;
    a.base = base;
    a.size = size;
    a.device = dev;
    a.mem = mem;
    a.pages.assign(base, base + size, ManagedPages{});
    reg.managed.emplace(base, std::move(a));
    *dptr = base;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemAdvise(CUdeviceptr dev_ptr, size_t count, CUmem_advise advice, CUmemLocation location) {
  return guarded(Fn::cuMemAdvise, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    const int adv = raw(advice);
    const bool on_device = raw(location.type) == CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemLocation loc{CU_MEM_LOCATION_TYPE_INVALID, 0};  // the validated location
    switch (adv) {
      case CU_MEM_ADVISE_SET_READ_MOSTLY:
      case CU_MEM_ADVISE_UNSET_READ_MOSTLY:
      case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION:
        break;  // cuda.h: location ignored
      case CU_MEM_ADVISE_SET_PREFERRED_LOCATION:
        if (on_device) {
          r = check_managed_device(location.id);
          loc = CUmemLocation{CU_MEM_LOCATION_TYPE_DEVICE, location.id};
        } else {
          r = host_location(location, &loc);
        }
        if (r != CUDA_SUCCESS) return r;
        break;
      case CU_MEM_ADVISE_SET_ACCESSED_BY:
      case CU_MEM_ADVISE_UNSET_ACCESSED_BY:
        // cuda.h: only DEVICE or HOST; every other type is invalid.
        if (on_device) {
          r = check_managed_device(location.id);
          if (r != CUDA_SUCCESS) return r;
          loc = CUmemLocation{CU_MEM_LOCATION_TYPE_DEVICE, location.id};
        } else if (raw(location.type) == CU_MEM_LOCATION_TYPE_HOST) {
          loc = CUmemLocation{CU_MEM_LOCATION_TYPE_HOST, 0};
        } else {
          return CUDA_ERROR_INVALID_VALUE;
        }
        break;
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    uint64_t b, e;
    ManagedAlloc* a = managed_range(reg, dev_ptr, count, &b, &e);
    // Pageable memory would need CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS.
    if (a == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const int bit = loc.type == CU_MEM_LOCATION_TYPE_DEVICE ? loc.id : ManagedPages::kCpuBit;
    a->pages.update(b, e, [&](ManagedPages& p) {
      switch (adv) {
        case CU_MEM_ADVISE_SET_READ_MOSTLY: p.read_mostly = true; break;
        case CU_MEM_ADVISE_UNSET_READ_MOSTLY: p.read_mostly = false; break;
        case CU_MEM_ADVISE_SET_PREFERRED_LOCATION: p.preferred = loc; break;
        case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION: p.preferred = CUmemLocation{CU_MEM_LOCATION_TYPE_INVALID, 0}; break;
        case CU_MEM_ADVISE_SET_ACCESSED_BY: p.accessed_by |= 1ull << bit; break;
        case CU_MEM_ADVISE_UNSET_ACCESSED_BY: p.accessed_by &= ~(1ull << bit); break;
        default: break;
      }
    });
    if (adv == CU_MEM_ADVISE_SET_PREFERRED_LOCATION && loc.type == CU_MEM_LOCATION_TYPE_HOST_NUMA)
      bind_pages(reinterpret_cast<void*>(b), e - b, real_node_of(loc.id), false);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemPrefetchAsync(CUdeviceptr dev_ptr, size_t count, CUmemLocation location, unsigned int flags,
                                CUstream stream) {
  return guarded(Fn::cuMemPrefetchAsync, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    std::shared_ptr<Stream> s;
    r = find_stream(stream, dev, &s);
    if (r != CUDA_SUCCESS) return r;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUmemLocation loc{CU_MEM_LOCATION_TYPE_INVALID, 0};  // the validated target
    int host_node = -1;
    if (raw(location.type) == CU_MEM_LOCATION_TYPE_DEVICE) {
      loc = CUmemLocation{CU_MEM_LOCATION_TYPE_DEVICE, location.id};
      r = check_managed_device(loc.id);
      if (r != CUDA_SUCCESS) return r;
      // cuda.h: the stream's device must support concurrent managed access too.
      if (attribute(stream_device(*s), CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS) == 0)
        return CUDA_ERROR_INVALID_DEVICE;
    } else {
      r = host_location(location, &loc);
      if (r != CUDA_SUCCESS) return r;
      host_node = loc.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ? loc.id : current_sim_node();
    }
    // Lock order: registry, then the executor inside submit().
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    uint64_t b, e;
    ManagedAlloc* a = managed_range(reg, dev_ptr, count, &b, &e);
    if (a == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (loc.type == CU_MEM_LOCATION_TYPE_DEVICE) {
      uint64_t needed = 0;
      a->pages.for_each(b, e, [&](uint64_t lo, uint64_t hi, const ManagedPages& p) {
        if (p.resident_device != loc.id) needed += hi - lo;
      });
      const uint64_t cap = config()->vram;
      if (needed > cap || reg.vram_used[loc.id] > cap - needed) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    Op op;
    op.kind = host_node >= 0 ? OpKind::Prefetch : OpKind::Marker;
    op.dst = b;
    op.n = e - b;
    op.real_node = host_node >= 0 ? real_node_of(host_node) : -1;
    op.what = "cuMemPrefetchAsync";
    uint64_t seq;
    r = submit(s, op, &seq);
    if (r != CUDA_SUCCESS || seq == 0) return r;  // failed, or captured (not run): no state change
    // Move the VRAM charge piece by piece, then record the new residency.
    std::vector<std::pair<uint64_t, int>> pieces;  // (bytes, device holding them or -1)
    a->pages.for_each(b, e, [&](uint64_t lo, uint64_t hi, const ManagedPages& p) {
      pieces.emplace_back(hi - lo, p.resident_device);
    });
    for (const auto& [len, holder] : pieces) {
      if (holder >= 0) uncharge_vram(reg, holder, len);
      if (loc.type == CU_MEM_LOCATION_TYPE_DEVICE) reg.vram_used[loc.id] += len;
    }
    a->pages.update(b, e, [&](ManagedPages& p) {
      p.last_prefetch = loc;
      p.resident_device = loc.type == CU_MEM_LOCATION_TYPE_DEVICE ? loc.id : -1;
      p.host_node = host_node;
    });
    return CUDA_SUCCESS;
  });
}

CUresult api_cuMemRangeGetAttribute(void* data, size_t data_size, CUmem_range_attribute attribute,
                                    CUdeviceptr dev_ptr, size_t count) {
  return guarded(Fn::cuMemRangeGetAttribute, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (data == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const int attr = raw(attribute);
    const bool array = attr == CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY;
    if (attr < CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY || attr > CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID)
      return CUDA_ERROR_INVALID_VALUE;
    if (array ? (data_size == 0 || data_size % 4 != 0) : data_size != 4) return CUDA_ERROR_INVALID_VALUE;
    Registry& reg = registry();
    std::lock_guard<std::mutex> lk(reg.mu);
    uint64_t b, e;
    ManagedAlloc* a = managed_range(reg, dev_ptr, count, &b, &e);
    if (a == nullptr) return CUDA_ERROR_INVALID_VALUE;

    // Fold the pages of the range: a location is reported only when every
    // page agrees on it.
    bool first = true, read_mostly = true, pref_same = true, pf_same = true;
    CUmemLocation pref{}, pf{};
    uint64_t accessed = ~0ull;
    a->pages.for_each(b, e, [&](uint64_t, uint64_t, const ManagedPages& p) {
      read_mostly &= p.read_mostly;
      accessed &= p.accessed_by;
      if (first) {
        pref = p.preferred;
        pf = p.last_prefetch;
        first = false;
      }
      pref_same &= same(pref, p.preferred);
      pf_same &= same(pf, p.last_prefetch);
    });
    if (!pref_same) pref = CUmemLocation{CU_MEM_LOCATION_TYPE_INVALID, 0};
    if (!pf_same) pf = CUmemLocation{CU_MEM_LOCATION_TYPE_INVALID, 0};
    // The legacy int forms collapse all host locations to CU_DEVICE_CPU.
    auto legacy_fold = [&](CUmemLocation ManagedPages::*field) {
      int id = 0;
      bool init = false, agree = true;
      a->pages.for_each(b, e, [&](uint64_t, uint64_t, const ManagedPages& p) {
        int v = legacy_id(p.*field);
        if (!init) id = v, init = true;
        agree &= (v == id);
      });
      return agree ? id : kDeviceInvalid;
    };
    auto id_of = [](const CUmemLocation& l) {
      return l.type == CU_MEM_LOCATION_TYPE_INVALID ? kDeviceInvalid : l.id;
    };

    int* out = static_cast<int*>(data);
    switch (attr) {
      case CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY:
        *out = read_mostly ? 1 : 0;
        break;
      case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION:
        *out = legacy_fold(&ManagedPages::preferred);
        break;
      case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION:
        *out = legacy_fold(&ManagedPages::last_prefetch);
        break;
      case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE:
        *static_cast<CUmemLocationType*>(data) = pref.type;
        break;
      case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID:
        *out = id_of(pref);
        break;
      case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE:
        *static_cast<CUmemLocationType*>(data) = pf.type;
        break;
      case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID:
        *out = id_of(pf);
        break;
      case CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY: {
        // Devices in ordinal order, then the CPU; CU_DEVICE_INVALID fills the rest.
        size_t n = data_size / 4, k = 0;
        for (int d = 0; d < device_count() && k < n; ++d)
          if (accessed >> d & 1ull) out[k++] = d;
        if (k < n && (accessed >> ManagedPages::kCpuBit & 1ull)) out[k++] = kDeviceCpu;
        for (; k < n; ++k) out[k] = kDeviceInvalid;
        break;
      }
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
  });
}

}  // namespace cxlsim
