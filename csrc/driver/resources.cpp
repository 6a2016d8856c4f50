#include "driver/resources.h"

#include <string>

#include "common/error.h"
#include "common/log.h"

namespace cxl::driver {

namespace {
// Run a release call from a destructor: never throws, always reports.
template <typename F, typename... A>
void release(const DriverPtr& drv, F fn, const char* name, A... args) {
  if (!drv || fn == nullptr) return;
  CUresult r = fn(args...);
  if (r != CUDA_SUCCESS) note_cleanup_failure(std::string(name) + ": " + drv->describe(r));
}
}  // namespace

// ---------------------------------------------------------------- contexts
PrimaryContext::PrimaryContext(DriverPtr drv, int device) : drv_(std::move(drv)), device_(device) {
  CUdevice dev = 0;
  CXL_CU(*drv_, cuDeviceGet, &dev, device);
  CXL_CU(*drv_, cuDevicePrimaryCtxRetain, &ctx_, dev);
}

PrimaryContext::~PrimaryContext() {
  if (ctx_) release(drv_, drv_->api().fn_cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", device_);
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
VaRange::VaRange(DriverPtr drv, size_t size, size_t alignment) : drv_(std::move(drv)) {
  CUdeviceptr p = 0;
  CXL_CU(*drv_, cuMemAddressReserve, &p, size, alignment, CUdeviceptr(0), 0ULL);
  base_ = p;
  size_ = size;
}

VaRange::~VaRange() {
  if (base_) release(drv_, drv_->api().fn_cuMemAddressFree, "cuMemAddressFree", base_, size_);
}

// ---------------------------------------------------------------- physical memory
PhysicalMemory::PhysicalMemory(DriverPtr drv, size_t size, const CUmemLocation& loc)
    : drv_(std::move(drv)), loc_(loc) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location = loc;
  CUmemGenericAllocationHandle h = 0;
  CXL_CU(*drv_, cuMemCreate, &h, size, &prop, 0ULL);
  handle_ = h;
  size_ = size;
}

PhysicalMemory::~PhysicalMemory() {
  if (handle_) release(drv_, drv_->api().fn_cuMemRelease, "cuMemRelease", handle_);
}

// ---------------------------------------------------------------- mappings
Mapping::Mapping(DriverPtr drv, CUdeviceptr va, const PhysicalMemory& mem, int device, bool host_access,
                 int host_node)
    : drv_(std::move(drv)) {
  CXL_CU(*drv_, cuMemMap, va, mem.size(), size_t(0), mem.handle(), 0ULL);
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
    CXL_CU(*drv_, cuMemSetAccess, va, mem.size(), static_cast<const CUmemAccessDesc*>(desc), n);
  } catch (...) {
    // A throwing constructor runs no destructor: undo the map here.
    release(drv_, drv_->api().fn_cuMemUnmap, "cuMemUnmap", va, mem.size());
    throw;
  }
  va_ = va;
  size_ = mem.size();
}

void Mapping::unmap() {
  if (!va_) return;
  CXL_CU(*drv_, cuMemUnmap, va_, size_);
  va_ = 0;
  size_ = 0;
}

Mapping::~Mapping() {
  if (va_) release(drv_, drv_->api().fn_cuMemUnmap, "cuMemUnmap", va_, size_);
}

// ---------------------------------------------------------------- managed memory
ManagedMemory::ManagedMemory(DriverPtr drv, size_t size) : drv_(std::move(drv)) {
  CUdeviceptr p = 0;
  CXL_CU(*drv_, cuMemAllocManaged, &p, size, static_cast<unsigned>(CU_MEM_ATTACH_GLOBAL));
  ptr_ = p;
  size_ = size;
}

ManagedMemory::~ManagedMemory() {
  if (ptr_) release(drv_, drv_->api().fn_cuMemFree, "cuMemFree", ptr_);
}

// ---------------------------------------------------------------- plain device memory
DeviceMemory::DeviceMemory(DriverPtr drv, size_t size) : drv_(std::move(drv)) {
  CUdeviceptr p = 0;
  CXL_CU(*drv_, cuMemAlloc, &p, size);
  ptr_ = p;
  size_ = size;
}

DeviceMemory::~DeviceMemory() {
  if (ptr_) release(drv_, drv_->api().fn_cuMemFree, "cuMemFree", ptr_);
}

// ---------------------------------------------------------------- host registration
HostRegistration::HostRegistration(DriverPtr drv, void* p, size_t size, unsigned flags) : drv_(std::move(drv)) {
  CXL_CU(*drv_, cuMemHostRegister, p, size, flags);
  CUdeviceptr d = 0;
  try {
    CXL_CU(*drv_, cuMemHostGetDevicePointer, &d, p, 0u);
  } catch (...) {
    release(drv_, drv_->api().fn_cuMemHostUnregister, "cuMemHostUnregister", p);
    throw;
  }
  p_ = p;
  dptr_ = d;
}

HostRegistration::~HostRegistration() {
  if (p_) release(drv_, drv_->api().fn_cuMemHostUnregister, "cuMemHostUnregister", p_);
}

// ---------------------------------------------------------------- events and streams
Event::Event(DriverPtr drv) : drv_(std::move(drv)) {
  CUevent e = nullptr;
  CXL_CU(*drv_, cuEventCreate, &e, static_cast<unsigned>(CU_EVENT_DISABLE_TIMING));
  ev_ = e;
}

Event::~Event() {
  if (ev_) release(drv_, drv_->api().fn_cuEventDestroy, "cuEventDestroy", ev_);
}

Stream::Stream(DriverPtr drv) : drv_(std::move(drv)) {
  CUstream s = nullptr;
  CXL_CU(*drv_, cuStreamCreate, &s, static_cast<unsigned>(CU_STREAM_NON_BLOCKING));
  s_ = s;
}

Stream::~Stream() {
  if (s_) release(drv_, drv_->api().fn_cuStreamDestroy, "cuStreamDestroy", s_);
}

}  // namespace cxl::driver
