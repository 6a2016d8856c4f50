// The engine: one loaded driver and one DeviceAllocator per GPU.
//
// A Python `cxlalloc.Allocator` owns an engine of its own; global and scoped
// modes install one process-wide engine (Engine::set_current) that the C ABI
// (csrc/capi) serves torch from.  Device allocators are created lazily, on a
// device's first allocation, from the configuration set for that device.
#pragma once

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "alloc/device_allocator.h"
#include "backend/placement.h"
#include "driver/driver.h"

namespace cxl::alloc {

class Engine {
 public:
  // Loads the driver (throws Error(Unavailable) "CUDA unavailable: ...").
  Engine(const std::string& driver_path, bool simulated);
  ~Engine();

  const std::shared_ptr<const driver::Driver>& driver() const { return drv_; }
  int device_count() const { return drv_->device_count(); }
  // Configuration used when device `d`'s allocator is first created.
  // Throws InvalidArgument for a bad ordinal, or if `d` already exists.
  void configure_device(int d, const AllocatorConfig& cfg);
  bool has_config(int d) const;
  // The allocator of device `d`, created on first use.
  DeviceAllocator& device(int d);
  // Existing allocator or nullptr (stats of a device never used).
  DeviceAllocator* existing(int d) const;
  std::shared_ptr<backend::NumaOps> numa() const { return numa_; }
  // (free, total) VRAM of device `d` now, via its primary context.
  std::pair<size_t, size_t> mem_info(int d) const;
  // A device attribute (CU_DEVICE_ATTRIBUTE_*); `fallback` if the driver rejects it.
  int attribute(int d, int attr, int fallback) const;
  std::string device_name(int d) const;

  // The process-wide engine behind the C ABI (nullptr until enabled).
  // Replacing the current engine waits until no C ABI call that may still
  // hold the previous one is in flight (see Use), then drops it.
  static void set_current(std::shared_ptr<Engine> e);
  static std::shared_ptr<Engine> current();

  // A lock-free use of the current engine for the allocation hot path (the
  // C ABI): two atomic increments instead of a mutex and a shared_ptr copy.
  // Epoch-based, like sleepable RCU: set_current waits only for uses that
  // began before it, so a steady stream of allocations cannot starve it.
  class Use {
   public:
    Use();
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    Engine* get() const { return e_; }

   private:
    Engine* e_;
    uint64_t epoch_;
  };

 private:
  std::shared_ptr<const driver::Driver> drv_;
  std::shared_ptr<backend::NumaOps> numa_;
  static constexpr int kMaxDevices = 256;
  mutable std::mutex mu_;  // creation and configuration; lookups are lock-free
  std::map<int, AllocatorConfig> configs_;
  std::map<int, std::unique_ptr<DeviceAllocator>> devices_;
  std::array<std::atomic<DeviceAllocator*>, kMaxDevices> fast_{};
};

}  // namespace cxl::alloc
