#include "alloc/engine.h"

#include <atomic>
#include <thread>

#include "common/error.h"
#include "driver/resources.h"

namespace cxl::alloc {

namespace {
// The current engine lives in a leaked holder so that frees arriving during
// interpreter shutdown (C12) never find the holder destroyed.
std::mutex g_current_mu;
std::shared_ptr<Engine>* g_current = new std::shared_ptr<Engine>();
std::atomic<Engine*> g_current_raw{nullptr};
std::atomic<uint64_t> g_epoch{0};
std::atomic<int64_t> g_in_flight[2];
}  // namespace

Engine::Engine(const std::string& driver_path, bool simulated)
    : drv_(driver::Driver::open(driver_path, simulated)),
      numa_(simulated ? std::shared_ptr<backend::NumaOps>(backend::sim_numa_ops(drv_))
                      : std::shared_ptr<backend::NumaOps>(backend::linux_numa_ops())) {}

Engine::~Engine() = default;

void Engine::configure_device(int d, const AllocatorConfig& cfg) {
  std::lock_guard<std::mutex> lk(mu_);
  if (d < 0 || d >= drv_->device_count())
    throw Error(ErrorKind::InvalidArgument, "device: " + std::to_string(d) + " is not a CUDA device ordinal (0.." +
                                                std::to_string(drv_->device_count() - 1) + ")");
  if (devices_.count(d))
    throw Error(ErrorKind::InvalidArgument, "device " + std::to_string(d) + " is already in use; configure it before its first allocation");
  AllocatorConfig c = cfg;
  c.device = d;
  configs_[d] = c;
}

bool Engine::has_config(int d) const {
  std::lock_guard<std::mutex> lk(mu_);
  return configs_.count(d) > 0;
}

DeviceAllocator& Engine::device(int d) {
  if (d >= 0 && d < kMaxDevices) {
    if (DeviceAllocator* a = fast_[d].load(std::memory_order_acquire)) return *a;
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto it = devices_.find(d);
  if (it != devices_.end()) return *it->second;
  auto c = configs_.find(d);
  if (c == configs_.end())
    throw Error(ErrorKind::InvalidArgument, "device " + std::to_string(d) + " has no cxlalloc configuration (not enabled for it)");
  auto a = std::make_unique<DeviceAllocator>(drv_, c->second, numa_);
  DeviceAllocator& ref = *a;
  devices_[d] = std::move(a);
  if (d >= 0 && d < kMaxDevices) fast_[d].store(&ref, std::memory_order_release);
  return ref;
}

DeviceAllocator* Engine::existing(int d) const {
  if (d >= 0 && d < kMaxDevices) {
    if (DeviceAllocator* a = fast_[d].load(std::memory_order_acquire)) return a;
  }
  std::lock_guard<std::mutex> lk(mu_);
  auto it = devices_.find(d);
  return it == devices_.end() ? nullptr : it->second.get();
}

std::pair<size_t, size_t> Engine::mem_info(int d) const {
  driver::PrimaryContext ctx(drv_, d);
  driver::ContextGuard g(*drv_, ctx.get());
  size_t free_b = 0, total = 0;
  CXL_CU(*drv_, cuMemGetInfo, &free_b, &total);
  return {free_b, total};
}

int Engine::attribute(int d, int attr, int fallback) const {
  int v = 0;
  if (drv_->api().fn_cuDeviceGetAttribute(&v, static_cast<CUdevice_attribute>(attr), d) != CUDA_SUCCESS) return fallback;
  return v;
}

std::string Engine::device_name(int d) const {
  char buf[256] = {0};
  CXL_CU(*drv_, cuDeviceGetName, buf, int(sizeof buf - 1), d);
  return buf;
}

void Engine::set_current(std::shared_ptr<Engine> e) {
  std::shared_ptr<Engine> old;
  {
    std::lock_guard<std::mutex> lk(g_current_mu);
    g_current_raw.store(e.get(), std::memory_order_seq_cst);
    old = std::move(*g_current);
    *g_current = std::move(e);
    // Uses from now on count in the other epoch; wait out this one's.
    uint64_t ep = g_epoch.fetch_add(1, std::memory_order_seq_cst);
    while (g_in_flight[ep & 1].load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  }
  // `old` is released here, after every use that might have seen it ended.
}

std::shared_ptr<Engine> Engine::current() {
  std::lock_guard<std::mutex> lk(g_current_mu);
  return *g_current;
}

Engine::Use::Use() {
  for (;;) {
    epoch_ = g_epoch.load(std::memory_order_seq_cst);
    g_in_flight[epoch_ & 1].fetch_add(1, std::memory_order_seq_cst);
    if (g_epoch.load(std::memory_order_seq_cst) == epoch_) break;
    g_in_flight[epoch_ & 1].fetch_sub(1, std::memory_order_seq_cst);  // raced a set_current: retry
  }
  e_ = g_current_raw.load(std::memory_order_seq_cst);
}

Engine::Use::~Use() { g_in_flight[epoch_ & 1].fetch_sub(1, std::memory_order_seq_cst); }

}  // namespace cxl::alloc
