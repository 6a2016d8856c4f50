// DeviceAllocator: construction and teardown, limits and budgets, and what
// every path shares (the capture check, device sync, the OOM message).
#include <chrono>
#include <cstdio>

#include "alloc/device_allocator.h"
#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::alloc {

DeviceAllocator::DeviceAllocator(driver::DriverPtr drv, AllocatorConfig cfg, std::shared_ptr<backend::NumaOps> numa)
    : drv_(std::move(drv)),
      cfg_(cfg),
      numa_(std::move(numa)),
      ctx_(drv_, cfg.device),
      limits_(cfg.device_limit, cfg.host_limit, cfg.kv_device_limit, cfg.device_headroom, cfg.kv_aware),
      pending_frees_(
          drv_, [this](Block* b) { retire(b); },
          [this](CUresult r) {
            // Counted and reported once: a healthy driver never gets here.
            if (stats_.on_event_record_failure())
              log_warning("cuEventRecord on a stream that used a freed block failed (" + drv_->describe(r) +
                          "); waiting for that stream instead");
          }),
      migration_budget_(cfg.migration_rate, cfg.migration_burst) {
  if (cfg_.device_limit == 0)
    throw Error(ErrorKind::InvalidArgument, "device_limit: must be > 0 bytes (a size like '8GiB' or a fraction of VRAM)");
  driver::ContextGuard guard(*drv_, ctx_.get());
  const bool host_enabled = limits_.host_enabled();
  backend::Selection chosen =
      backend::select_backends(drv_, {cfg_.device, cfg_.host_node, host_enabled, cfg_.backend, cfg_.strict_placement});
  facts_ = chosen.facts;
  support_ = std::move(chosen.support);
  const backend::FactoryConfig& fc = chosen.factory;
  // A limit below one segment makes its tier unusable: every request would
  // silently go elsewhere (or fail).  Say so now, naming the option.
  if (cfg_.device_limit < fc.device_granularity)
    throw Error(ErrorKind::InvalidArgument,
                "device_limit: " + format_bytes(cfg_.device_limit) + " is below cuda:" + std::to_string(cfg_.device) +
                    "'s allocation granularity (" + format_bytes(fc.device_granularity) +
                    "): not one segment would fit in VRAM; use at least " + format_bytes(fc.device_granularity));
  if (host_enabled && cfg_.host_limit < fc.host_granularity)
    throw Error(ErrorKind::InvalidArgument,
                "host_limit: " + format_bytes(cfg_.host_limit) + " is below the host tier's allocation granularity (" +
                    format_bytes(fc.host_granularity) + ", backend " + backend::host_backend_name(fc.host_backend) +
                    "): use at least " + format_bytes(fc.host_granularity) + ", or 0 to run without a host tier");
  // host-vmm and managed commit lazily; pinned touches and pins a whole
  // request at once: beyond the node's free memory that is the OOM killer.
  if (host_enabled && fc.host_backend == backend::HostBackend::Pinned && cfg_.host_node_free_bytes > 0 &&
      cfg_.host_limit > cfg_.host_node_free_bytes)
    throw Error(ErrorKind::InvalidArgument,
                "host_limit: " + format_bytes(cfg_.host_limit) + " is above the free memory of NUMA node " +
                    std::to_string(cfg_.host_node) + " (" + format_bytes(cfg_.host_node_free_bytes) +
                    "), and the pinned backend pins every byte it is given at once; use at most " +
                    format_bytes(cfg_.host_node_free_bytes) + ", or a lazily committed backend (host-vmm, managed)");
  factory_ = std::make_unique<backend::SegmentFactory>(drv_, fc, numa_.get());
}

DeviceAllocator::~DeviceAllocator() {
  // Destroying the allocator releases everything it holds.  Wait for the GPU
  // first (a kernel may still read memory whose owner was just freed), but a
  // failing driver must not turn teardown into a leak: every step below runs
  // whatever the previous one did, and the RAII owners log their failures.
  std::lock_guard<std::mutex> lk(mu_);
  CUcontext prev = nullptr;
  bool have_prev = drv_->api().fn_cuCtxGetCurrent(&prev) == CUDA_SUCCESS;
  if (drv_->api().fn_cuCtxSetCurrent(ctx_.get()) != CUDA_SUCCESS) note_cleanup_failure("teardown: cuCtxSetCurrent");
  if (drv_->api().fn_cuCtxSynchronize() != CUDA_SUCCESS) note_cleanup_failure("teardown: cuCtxSynchronize");
  pending_frees_.clear();
  cache_.clear();
  allocated_.clear();
  for (auto& [base, seg] : segments_) {
    Block* b = seg->head;
    while (b) {
      Block* n = b->next;
      delete b;
      b = n;
    }
    seg->head = nullptr;
  }
  segments_.clear();
  factory_.reset();
  if (have_prev) drv_->api().fn_cuCtxSetCurrent(prev);
}

std::string DeviceAllocator::host_backend_name() const {
  if (!limits_.host_enabled()) return "none";
  return backend::host_backend_name(factory_->config().host_backend);
}

bool DeviceAllocator::demotion_supported() const { return factory_->can_move_between_tiers(); }

void DeviceAllocator::set_external_device_bytes(size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  limits_.set_external_device_bytes(n);
}

void DeviceAllocator::set_device_limit(size_t bytes) {
  if (bytes == 0) throw Error(ErrorKind::InvalidArgument, "device_limit: must be > 0 bytes");
  std::lock_guard<std::mutex> lk(mu_);
  cfg_.device_limit = bytes;  // config() reports it
  limits_.set_device_limit(bytes);
}

policy::TierBudget DeviceAllocator::budget() const {
  // Reclaimable: wholly free cached segments, except those of a private pool
  // still in use (a graph may replay into them).
  size_t cached_free[kNumTiers] = {0, 0};
  for (const auto& [base, seg] : segments_) {
    if (!seg->fully_free()) continue;
    if (!seg->pool.is_default()) {
      auto it = pools_.find(seg->pool);
      if (it != pools_.end() && it->second.use_count > 0) continue;
    }
    cached_free[int(seg->tier())] += seg->size;
  }
  return limits_.snapshot(stats_.reserved(Tier::Device), stats_.reserved(Tier::Host), cached_free[int(Tier::Device)],
                          cached_free[int(Tier::Host)], stats_.kv_device_bytes);
}

bool DeviceAllocator::capturing(CUstream s) const {
  if (!cfg_.check_capture || drv_->api().fn_cuStreamIsCapturing == nullptr) return false;
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  if (drv_->api().fn_cuStreamIsCapturing(s, &st) != CUDA_SUCCESS) return false;
  return st != CU_STREAM_CAPTURE_STATUS_NONE;
}

void DeviceAllocator::check_stream(CUstream s) const {
  if (reinterpret_cast<uintptr_t>(s) <= 2) return;  // NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
  if (drv_->api().fn_cuStreamIsCapturing == nullptr) return;  // no way to ask: accepted as given
  // cuStreamIsCapturing is legal on a capturing stream (cuStreamQuery is
  // not), so it can validate a handle at any time.  The driver can only
  // judge handles it hands out; a random pointer may crash a real driver
  // before it answers, which no check of ours can prevent.
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  CUresult r = drv_->api().fn_cuStreamIsCapturing(s, &st);
  if (r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_CONTEXT ||
      r == CUDA_ERROR_CONTEXT_IS_DESTROYED) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(s)));
    throw Error(ErrorKind::InvalidArgument, std::string("cxlalloc: stream ") + buf + " is not a live CUDA stream of cuda:" +
                                                std::to_string(cfg_.device) + " (the driver says " + drv_->describe(r) +
                                                "); allowed: 0 (the default stream) or a handle from cuStreamCreate, "
                                                "e.g. torch.cuda.current_stream().cuda_stream");
  }
}

void DeviceAllocator::sync_device() {
  CXL_CU(*drv_, cuCtxSynchronize);
  stats_.on_sync_all_streams();
}

double DeviceAllocator::now_s() const {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::string DeviceAllocator::describe_tiers() const {
  const auto& d = stats_.tier[0];
  const auto& h = stats_.tier[1];
  std::string s = "device tier (cuda:" + std::to_string(cfg_.device) +
                  "): " + format_bytes(static_cast<size_t>(d.allocated_bytes.current)) + " allocated, " +
                  format_bytes(static_cast<size_t>(d.reserved_bytes.current)) + " reserved of " +
                  format_bytes(limits_.device()) + " limit";
  if (limits_.external_device_bytes())
    s += " (" + format_bytes(limits_.external_device_bytes()) + " used outside cxlalloc)";
  if (limits_.host_enabled())
    s += "; host tier (NUMA node " + std::to_string(cfg_.host_node) + ", backend " + host_backend_name() + "): " +
         format_bytes(static_cast<size_t>(h.allocated_bytes.current)) + " allocated, " +
         format_bytes(static_cast<size_t>(h.reserved_bytes.current)) + " reserved of " +
         format_bytes(cfg_.host_limit) + " limit";
  else
    s += "; host tier disabled (host_limit 0)";
  return s;
}

void DeviceAllocator::throw_oom(size_t requested, AllocClass cls, const std::string& why) {
  stats_.on_oom();
  std::string msg = "cxlalloc: out of memory: tried to allocate " + format_bytes(requested) + " (class " +
                    class_name(cls) + ") on cuda:" + std::to_string(cfg_.device) + ": " + why + ". " +
                    describe_tiers() + ". " +
                    (cfg_.oom_hint.empty() ? "Raise host_limit or device_limit (e.g. CXLALLOC=host_limit:64GiB)."
                                           : cfg_.oom_hint);
  throw OutOfMemoryError(requested, msg);
}

Segment* DeviceAllocator::segment_of(CUdeviceptr p) const {
  auto it = segments_.upper_bound(p);
  if (it == segments_.begin()) return nullptr;
  --it;
  return it->second->contains(p) ? it->second.get() : nullptr;
}

}  // namespace cxl::alloc
