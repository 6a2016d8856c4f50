// RAII owners for every driver resource the engine creates.
//
// Each owner holds a shared_ptr to the Driver so the function table outlives
// it, is move-only, and releases in its destructor.  A release that fails in a
// destructor cannot throw: it is logged and counted (cxl::cleanup_failures) so
// tests still see it.  Constructors throw DriverError with the failing call.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>

#include "driver/driver.h"

namespace cxl::driver {

using DriverPtr = std::shared_ptr<const Driver>;

// The device's primary context, retained for the owner's lifetime (the same
// context torch's runtime uses, so pointers are valid in both).
class PrimaryContext {
 public:
  PrimaryContext() = default;
  PrimaryContext(DriverPtr drv, int device);
  ~PrimaryContext();
  PrimaryContext(PrimaryContext&& o) noexcept { swap(o); }
  PrimaryContext& operator=(PrimaryContext&& o) noexcept {
    PrimaryContext(std::move(o)).swap(*this);
    return *this;
  }
  CUcontext get() const { return ctx_; }
  int device() const { return device_; }
  void swap(PrimaryContext& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(ctx_, o.ctx_);
    std::swap(device_, o.device_);
  }

 private:
  DriverPtr drv_;
  CUcontext ctx_ = nullptr;
  int device_ = -1;
};

// Makes `ctx` current on this thread for the guard's scope, restoring the
// previous context after.  Needed because frees arrive on arbitrary threads
// (Python GC, torch's deleters) that may have no context bound.
class ContextGuard {
 public:
  ContextGuard(const Driver& drv, CUcontext ctx);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const Driver& drv_;
  CUcontext prev_ = nullptr;
  bool switched_ = false;
};

// A reserved virtual address range (cuMemAddressReserve).
class VaRange {
 public:
  VaRange() = default;
  VaRange(DriverPtr drv, size_t size, size_t alignment);
  ~VaRange();
  VaRange(VaRange&& o) noexcept { swap(o); }
  VaRange& operator=(VaRange&& o) noexcept {
    VaRange(std::move(o)).swap(*this);
    return *this;
  }
  CUdeviceptr base() const { return base_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return base_ != 0; }
  void swap(VaRange& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(base_, o.base_);
    std::swap(size_, o.size_);
  }

 private:
  DriverPtr drv_;
  CUdeviceptr base_ = 0;
  size_t size_ = 0;
};

// Physical memory from cuMemCreate at a location (device or host NUMA node).
class PhysicalMemory {
 public:
  PhysicalMemory() = default;
  PhysicalMemory(DriverPtr drv, size_t size, const CUmemLocation& loc);
  ~PhysicalMemory();
  PhysicalMemory(PhysicalMemory&& o) noexcept { swap(o); }
  PhysicalMemory& operator=(PhysicalMemory&& o) noexcept {
    PhysicalMemory(std::move(o)).swap(*this);
    return *this;
  }
  CUmemGenericAllocationHandle handle() const { return handle_; }
  size_t size() const { return size_; }
  const CUmemLocation& location() const { return loc_; }
  explicit operator bool() const { return handle_ != 0; }
  void swap(PhysicalMemory& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(handle_, o.handle_);
    std::swap(size_, o.size_);
    std::swap(loc_, o.loc_);
  }

 private:
  DriverPtr drv_;
  CUmemGenericAllocationHandle handle_ = 0;
  size_t size_ = 0;
  CUmemLocation loc_{CU_MEM_LOCATION_TYPE_INVALID, 0};
};

// A mapping of physical memory at a VA (cuMemMap + cuMemSetAccess).  Access
// is granted to the device and, when `host_access`, to the CPU: host-tier
// memory must stay readable by the CPU for placement checks and CPU tensors.
class Mapping {
 public:
  Mapping() = default;
  Mapping(DriverPtr drv, CUdeviceptr va, const PhysicalMemory& mem, int device, bool host_access,
          int host_node);
  ~Mapping();
  Mapping(Mapping&& o) noexcept { swap(o); }
  Mapping& operator=(Mapping&& o) noexcept {
    Mapping(std::move(o)).swap(*this);
    return *this;
  }
  CUdeviceptr va() const { return va_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return va_ != 0; }
  // Unmap now, throwing DriverError on failure (the mapping then stays owned
  // and valid), for callers that must not go on after a failed unmap.
  void unmap();
  void swap(Mapping& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(va_, o.va_);
    std::swap(size_, o.size_);
  }

 private:
  DriverPtr drv_;
  CUdeviceptr va_ = 0;
  size_t size_ = 0;
};

// cuMemAllocManaged memory.
class ManagedMemory {
 public:
  ManagedMemory() = default;
  ManagedMemory(DriverPtr drv, size_t size);
  ~ManagedMemory();
  ManagedMemory(ManagedMemory&& o) noexcept { swap(o); }
  ManagedMemory& operator=(ManagedMemory&& o) noexcept {
    ManagedMemory(std::move(o)).swap(*this);
    return *this;
  }
  CUdeviceptr ptr() const { return ptr_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return ptr_ != 0; }
  void swap(ManagedMemory& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
  }

 private:
  DriverPtr drv_;
  CUdeviceptr ptr_ = 0;
  size_t size_ = 0;
};

// Plain device memory from cuMemAlloc: the device tier when the GPU lacks VMM
// (then segments cannot be remapped between tiers).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(DriverPtr drv, size_t size);
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& o) noexcept { swap(o); }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    DeviceMemory(std::move(o)).swap(*this);
    return *this;
  }
  CUdeviceptr ptr() const { return ptr_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return ptr_ != 0; }
  void swap(DeviceMemory& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
  }

 private:
  DriverPtr drv_;
  CUdeviceptr ptr_ = 0;
  size_t size_ = 0;
};

// A page-locked, device-mapped registration of existing host memory.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(DriverPtr drv, void* p, size_t size, unsigned flags);
  ~HostRegistration();
  HostRegistration(HostRegistration&& o) noexcept { swap(o); }
  HostRegistration& operator=(HostRegistration&& o) noexcept {
    HostRegistration(std::move(o)).swap(*this);
    return *this;
  }
  void* ptr() const { return p_; }
  CUdeviceptr device_ptr() const { return dptr_; }
  explicit operator bool() const { return p_ != nullptr; }
  void swap(HostRegistration& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(p_, o.p_);
    std::swap(dptr_, o.dptr_);
  }

 private:
  DriverPtr drv_;
  void* p_ = nullptr;
  CUdeviceptr dptr_ = 0;
};

class Event {
 public:
  Event() = default;
  explicit Event(DriverPtr drv);
  ~Event();
  Event(Event&& o) noexcept { swap(o); }
  Event& operator=(Event&& o) noexcept {
    Event(std::move(o)).swap(*this);
    return *this;
  }
  CUevent get() const { return ev_; }
  explicit operator bool() const { return ev_ != nullptr; }
  void swap(Event& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(ev_, o.ev_);
  }

 private:
  DriverPtr drv_;
  CUevent ev_ = nullptr;
};

class Stream {
 public:
  Stream() = default;
  explicit Stream(DriverPtr drv);
  ~Stream();
  Stream(Stream&& o) noexcept { swap(o); }
  Stream& operator=(Stream&& o) noexcept {
    Stream(std::move(o)).swap(*this);
    return *this;
  }
  CUstream get() const { return s_; }
  explicit operator bool() const { return s_ != nullptr; }
  void swap(Stream& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(s_, o.s_);
  }

 private:
  DriverPtr drv_;
  CUstream s_ = nullptr;
};

}  // namespace cxl::driver
