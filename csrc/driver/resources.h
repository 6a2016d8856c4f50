// RAII owners for every driver resource the engine creates.
//
// One template, DriverHandle<Traits>, holds what every owner shares: a
// shared_ptr to the Driver (so the function table outlives the owner), the
// resource's state, move-only ownership, and the release in the destructor.
// A release that fails in a destructor cannot throw: it is logged and counted
// (cxl::cleanup_failures) so tests still see it.  Each resource is a traits
// struct (its state, when it is held, its release call and that call's name
// for the log) plus a thin class with its constructor, which throws
// DriverError with the failing call, and its accessors.
#pragma once

#include <cstddef>
#include <memory>
#include <tuple>
#include <utility>

#include "driver/driver.h"

namespace cxl::driver {

using DriverPtr = std::shared_ptr<const Driver>;

// Log and count a release that failed in a destructor (never throws a
// DriverError: there is no caller to hand it to).
void report_release_failure(const Driver& drv, const char* call, CUresult r);

// Traits: `State` (value type, default = not held), `kRelease` (the release
// call's name), `held(state)`, `fn(api)` (the release entry point) and
// `args(state)` (its arguments as a tuple).
template <class Traits>
class DriverHandle {
 public:
  using State = typename Traits::State;

  DriverHandle() = default;
  ~DriverHandle() { release(); }
  DriverHandle(const DriverHandle&) = delete;
  DriverHandle& operator=(const DriverHandle&) = delete;
  DriverHandle(DriverHandle&& o) noexcept { swap(o); }
  DriverHandle& operator=(DriverHandle&& o) noexcept {
    DriverHandle(std::move(o)).swap(*this);
    return *this;
  }
  explicit operator bool() const { return Traits::held(s_); }
  void swap(DriverHandle& o) noexcept {
    std::swap(drv_, o.drv_);
    std::swap(s_, o.s_);
  }

 protected:
  explicit DriverHandle(DriverPtr drv) : drv_(std::move(drv)) {}
  const DriverPtr& drv() const { return drv_; }
  State& state() { return s_; }
  const State& state() const { return s_; }

 private:
  void release() {
    if (!drv_ || !Traits::held(s_)) return;
    auto fn = Traits::fn(drv_->api());
    if (fn == nullptr) return;  // a driver without the symbol has nothing to release
    CUresult r = std::apply(fn, Traits::args(s_));
    if (r != CUDA_SUCCESS) report_release_failure(*drv_, Traits::kRelease, r);
  }

  DriverPtr drv_;
  State s_{};
};

// ---------------------------------------------------------------- traits
struct PrimaryContextTraits {
  struct State {
    CUcontext ctx = nullptr;
    int device = -1;
  };
  static constexpr const char* kRelease = "cuDevicePrimaryCtxRelease";
  static bool held(const State& s) { return s.ctx != nullptr; }
  static auto fn(const Api& a) { return a.fn_cuDevicePrimaryCtxRelease; }
  static auto args(const State& s) { return std::make_tuple(s.device); }
};

struct VaRangeTraits {
  struct State {
    CUdeviceptr base = 0;
    size_t size = 0;
  };
  static constexpr const char* kRelease = "cuMemAddressFree";
  static bool held(const State& s) { return s.base != 0; }
  static auto fn(const Api& a) { return a.fn_cuMemAddressFree; }
  static auto args(const State& s) { return std::make_tuple(s.base, s.size); }
};

struct PhysicalMemoryTraits {
  struct State {
    CUmemGenericAllocationHandle handle = 0;
    size_t size = 0;
    CUmemLocation loc{CU_MEM_LOCATION_TYPE_INVALID, 0};
  };
  static constexpr const char* kRelease = "cuMemRelease";
  static bool held(const State& s) { return s.handle != 0; }
  static auto fn(const Api& a) { return a.fn_cuMemRelease; }
  static auto args(const State& s) { return std::make_tuple(s.handle); }
};

struct MappingTraits {
  struct State {
    CUdeviceptr va = 0;
    size_t size = 0;
  };
  static constexpr const char* kRelease = "cuMemUnmap";
  static bool held(const State& s) { return s.va != 0; }
  static auto fn(const Api& a) { return a.fn_cuMemUnmap; }
  static auto args(const State& s) { return std::make_tuple(s.va, s.size); }
};

// cuMemAllocManaged and cuMemAlloc memory: both released by cuMemFree.
struct FreedMemoryTraits {
  struct State {
    CUdeviceptr ptr = 0;
    size_t size = 0;
  };
  static constexpr const char* kRelease = "cuMemFree";
  static bool held(const State& s) { return s.ptr != 0; }
  static auto fn(const Api& a) { return a.fn_cuMemFree; }
  static auto args(const State& s) { return std::make_tuple(s.ptr); }
};
struct ManagedMemoryTraits : FreedMemoryTraits {};
struct DeviceMemoryTraits : FreedMemoryTraits {};

struct HostRegistrationTraits {
  struct State {
    void* p = nullptr;
    CUdeviceptr dptr = 0;
  };
  static constexpr const char* kRelease = "cuMemHostUnregister";
  static bool held(const State& s) { return s.p != nullptr; }
  static auto fn(const Api& a) { return a.fn_cuMemHostUnregister; }
  static auto args(const State& s) { return std::make_tuple(s.p); }
};

struct EventTraits {
  struct State {
    CUevent ev = nullptr;
  };
  static constexpr const char* kRelease = "cuEventDestroy";
  static bool held(const State& s) { return s.ev != nullptr; }
  static auto fn(const Api& a) { return a.fn_cuEventDestroy; }
  static auto args(const State& s) { return std::make_tuple(s.ev); }
};

struct StreamTraits {
  struct State {
    CUstream s = nullptr;
  };
  static constexpr const char* kRelease = "cuStreamDestroy";
  static bool held(const State& s) { return s.s != nullptr; }
  static auto fn(const Api& a) { return a.fn_cuStreamDestroy; }
  static auto args(const State& s) { return std::make_tuple(s.s); }
};

// ---------------------------------------------------------------- owners
// The device's primary context, retained for the owner's lifetime (the same
// context torch's runtime uses, so pointers are valid in both).
class PrimaryContext : public DriverHandle<PrimaryContextTraits> {
 public:
  PrimaryContext() = default;
  PrimaryContext(DriverPtr drv, int device);
  CUcontext get() const { return state().ctx; }
  int device() const { return state().device; }
};

// Makes `ctx` current on this thread for the guard's scope, restoring the
// previous context after.  Needed because frees arrive on arbitrary threads
// (Python GC, torch's deleters) that may have no context bound.  Not an
// owner (it restores, it releases nothing), so not a DriverHandle.
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
class VaRange : public DriverHandle<VaRangeTraits> {
 public:
  VaRange() = default;
  VaRange(DriverPtr drv, size_t size, size_t alignment);
  CUdeviceptr base() const { return state().base; }
  size_t size() const { return state().size; }
};

// Physical memory from cuMemCreate at a location (device or host NUMA node).
class PhysicalMemory : public DriverHandle<PhysicalMemoryTraits> {
 public:
  PhysicalMemory() = default;
  PhysicalMemory(DriverPtr drv, size_t size, const CUmemLocation& loc);
  CUmemGenericAllocationHandle handle() const { return state().handle; }
  size_t size() const { return state().size; }
  const CUmemLocation& location() const { return state().loc; }
};

// A mapping of physical memory at a VA (cuMemMap + cuMemSetAccess).  Access
// is granted to the device and, when `host_access`, to the CPU: host-tier
// memory must stay readable by the CPU for placement checks and CPU tensors.
class Mapping : public DriverHandle<MappingTraits> {
 public:
  Mapping() = default;
  Mapping(DriverPtr drv, CUdeviceptr va, const PhysicalMemory& mem, int device, bool host_access, int host_node);
  CUdeviceptr va() const { return state().va; }
  size_t size() const { return state().size; }
  // Unmap now, throwing DriverError on failure (the mapping then stays owned
  // and valid), for callers that must not go on after a failed unmap.
  void unmap();
};

// cuMemAllocManaged memory.
class ManagedMemory : public DriverHandle<ManagedMemoryTraits> {
 public:
  ManagedMemory() = default;
  ManagedMemory(DriverPtr drv, size_t size);
  CUdeviceptr ptr() const { return state().ptr; }
  size_t size() const { return state().size; }
};

// Plain device memory from cuMemAlloc: the device tier when the GPU lacks VMM
// (then segments cannot be remapped between tiers).
class DeviceMemory : public DriverHandle<DeviceMemoryTraits> {
 public:
  DeviceMemory() = default;
  DeviceMemory(DriverPtr drv, size_t size);
  CUdeviceptr ptr() const { return state().ptr; }
  size_t size() const { return state().size; }
};

// A page-locked, device-mapped registration of existing host memory.
class HostRegistration : public DriverHandle<HostRegistrationTraits> {
 public:
  HostRegistration() = default;
  HostRegistration(DriverPtr drv, void* p, size_t size, unsigned flags);
  void* ptr() const { return state().p; }
  CUdeviceptr device_ptr() const { return state().dptr; }
};

class Event : public DriverHandle<EventTraits> {
 public:
  Event() = default;
  explicit Event(DriverPtr drv);
  CUevent get() const { return state().ev; }
};

class Stream : public DriverHandle<StreamTraits> {
 public:
  Stream() = default;
  explicit Stream(DriverPtr drv);
  CUstream get() const { return state().s; }
};

}  // namespace cxl::driver
