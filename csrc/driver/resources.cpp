#include "driver/resources.h"

#include <string>

#include "common/error.h"
#include "common/log.h"

namespace cxl::driver {

void report_release_failure(const Driver& drv, const char* call, CUresult r) {
  note_cleanup_failure(std::string(call) + ": " + drv.describe(r));
}

namespace {
// Undo a half-made resource in a constructor that is about to throw (a
// throwing constructor runs no destructor): never throws, always reports.
template <typename F, typename... A>
void undo(const DriverPtr& drv, F fn, const char* name, A... args) {
  if (!drv || fn == nullptr) return;
  CUresult r = fn(args...);
  if (r != CUDA_SUCCESS) report_release_failure(*drv, name, r);
}
}  // namespace

// ---------------------------------------------------------------- contexts
PrimaryContext::PrimaryContext(DriverPtr drv, int device) : DriverHandle(std::move(drv)) {
  state().device = device;
  CUdevice dev = 0;
  CXL_CU(*this->drv(), cuDeviceGet, &dev, device);
  CXL_CU(*this->drv(), cuDevicePrimaryCtxRetain, &state().ctx, dev);
}

ContextGuard::ContextGuard(const Driver& drv, CUcontext ctx) : drv_(drv) {
  CXL_CU(drv_, cuCtxGetCurrent, &prev_);
  if (prev_ != ctx) {
    CXL_CU(drv_, cuCtxSetCurrent, ctx);
    switched_ = true;
  }
}

ContextGuard::~ContextGuard() {
  if (!switched_) return;
  CUresult r = drv_.api().fn_cuCtxSetCurrent(prev_);
  if (r != CUDA_SUCCESS) note_cleanup_failure("cuCtxSetCurrent (restore): " + drv_.describe(r));
}

// ---------------------------------------------------------------- VA ranges
VaRange::VaRange(DriverPtr drv, size_t size, size_t alignment) : DriverHandle(std::move(drv)) {
  CUdeviceptr p = 0;
  CXL_CU(*this->drv(), cuMemAddressReserve, &p, size, alignment, CUdeviceptr(0), 0ULL);
  state() = {p, size};
}

// ---------------------------------------------------------------- physical memory
PhysicalMemory::PhysicalMemory(DriverPtr drv, size_t size, const CUmemLocation& loc) : DriverHandle(std::move(drv)) {
  state().loc = loc;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location = loc;
  CUmemGenericAllocationHandle h = 0;
  CXL_CU(*this->drv(), cuMemCreate, &h, size, &prop, 0ULL);
  state().handle = h;
  state().size = size;
}

// ---------------------------------------------------------------- mappings
Mapping::Mapping(DriverPtr drv, CUdeviceptr va, const PhysicalMemory& mem, int device, bool host_access, int host_node)
    : DriverHandle(std::move(drv)) {
  const Driver& d = *this->drv();
  CXL_CU(d, cuMemMap, va, mem.size(), size_t(0), mem.handle(), 0ULL);
  CUmemAccessDesc desc[2]{};
  size_t n = 0;
  desc[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc[n].location.id = device;
  desc[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ++n;
  // CPU access can only be granted to memory created on a host location
  // (cuda.h: "cannot specify HOST_NUMA accessibility for allocations created
  // on other location types"); without it the CPU faults on HOST_NUMA pages
  // (open-mpi/ompi#12751).
  if (host_access && mem.location().type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
    desc[n].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    desc[n].location.id = host_node;
    desc[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ++n;
  }
  try {
    CXL_CU(d, cuMemSetAccess, va, mem.size(), static_cast<const CUmemAccessDesc*>(desc), n);
  } catch (...) {
    undo(this->drv(), d.api().fn_cuMemUnmap, "cuMemUnmap", va, mem.size());
    throw;
  }
  state() = {va, mem.size()};
}

void Mapping::unmap() {
  if (!state().va) return;
  CXL_CU(*drv(), cuMemUnmap, state().va, state().size);
  state() = {};
}

// ---------------------------------------------------------------- managed memory
ManagedMemory::ManagedMemory(DriverPtr drv, size_t size) : DriverHandle(std::move(drv)) {
  CUdeviceptr p = 0;
  CXL_CU(*this->drv(), cuMemAllocManaged, &p, size, static_cast<unsigned>(CU_MEM_ATTACH_GLOBAL));
  state() = {p, size};
}

// ---------------------------------------------------------------- plain device memory
DeviceMemory::DeviceMemory(DriverPtr drv, size_t size) : DriverHandle(std::move(drv)) {
  CUdeviceptr p = 0;
  CXL_CU(*this->drv(), cuMemAlloc, &p, size);
  state() = {p, size};
}

// ---------------------------------------------------------------- host registration
HostRegistration::HostRegistration(DriverPtr drv, void* p, size_t size, unsigned flags) : DriverHandle(std::move(drv)) {
  const Driver& d = *this->drv();
  CXL_CU(d, cuMemHostRegister, p, size, flags);
  CUdeviceptr dptr = 0;
  try {
    CXL_CU(d, cuMemHostGetDevicePointer, &dptr, p, 0u);
  } catch (...) {
    undo(this->drv(), d.api().fn_cuMemHostUnregister, "cuMemHostUnregister", p);
    throw;
  }
  state() = {p, dptr};
}

// ---------------------------------------------------------------- events and streams
Event::Event(DriverPtr drv) : DriverHandle(std::move(drv)) {
  CUevent e = nullptr;
  CXL_CU(*this->drv(), cuEventCreate, &e, static_cast<unsigned>(CU_EVENT_DISABLE_TIMING));
  state().ev = e;
}

Stream::Stream(DriverPtr drv) : DriverHandle(std::move(drv)) {
  CUstream s = nullptr;
  CXL_CU(*this->drv(), cuStreamCreate, &s, static_cast<unsigned>(CU_STREAM_NON_BLOCKING));
  state().s = s;
}

}  // namespace cxl::driver
