// cxlalloc as torch's CUDA caching allocator ("global mode").
//
// A subclass of torch's CUDAPluggableAllocator (decision record:
// docs/pytorch-integration.md): the base implements every pure virtual of
// CUDAAllocator in torch 2.11-2.14, so new upstream virtuals do not break
// the build, and torch's changeCurrentAllocator accepts it and keeps it
// alive.  Every method that gives torch.cuda's memory APIs their meaning is
// overridden and forwarded to the engine's C ABI (capi_table.h):
// allocation with streams, record_stream, empty_cache, DeviceStats (device
// tier), snapshots, memory history, private pools for CUDA graphs and
// MemPool, cacheInfo, memory fraction and OutOfMemoryError.
//
// Thread safety: the engine is thread-safe; this class adds only a sharded
// registry, a few atomics and small mutex-guarded lists.  Callbacks that may
// take the GIL (context recorder, OOM observers) run with none of our locks
// held.  No exception leaves the deleter (torch calls it from destructors).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include "capi_table.h"
#include "history.h"
#include "registry.h"

#define CXLT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace cxlt {

namespace CCA = c10::cuda::CUDACachingAllocator;
using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

class CxlAllocator final : public Base {
 public:
  explicit CxlAllocator(const CApi& c);

  // The installed instance (leaked: it must outlive every tensor, including
  // those freed during interpreter shutdown, case C12); null before install.
  static CxlAllocator* instance();
  static void set_instance(CxlAllocator* a);

  // ---- allocation (allocator_alloc.cpp)
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  // The deleter's body: never throws (reports instead).
  void free_noexcept(void* ptr) noexcept;

  // ---- lifecycle, cache, stats (allocator_stats.cpp)
  void init(int device_count) override;
  bool initialized() override;
  std::string name() override;
  void emptyCache(c10::MempoolId_t mempool_id) override;
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;

  // ---- snapshot and history (allocator_snapshot.cpp)
  CCA::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override;
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     CCA::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override;
  bool isHistoryEnabled() override;
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override;
#if CXLT_TORCH_AT_LEAST(2, 13)
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override;
#endif

  // ---- private pools and graph capture (allocator_pools.cpp)
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;
#if CXLT_TORCH_AT_LEAST(2, 13)
  void markCaptureBegin(c10::DeviceIndex device) override;
  void markCaptureEnd(c10::DeviceIndex device) override;
#endif

  // ---- OOM observers, IPC, peers, cudagraph trees (allocator_misc.cpp)
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override;
#if CXLT_TORCH_AT_LEAST(2, 13)
  void attachOomRejectionObserver(CCA::OomRejectionObserver observer) override;
#endif
  CCA::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override;
  CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<CCA::AllocatorState> pps) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;

 private:
  void* alloc(size_t nbytes, int device, cudaStream_t stream);
  void release(void* ptr, bool from_deleter);
  [[noreturn]] void fail_alloc(size_t nbytes, int device, cudaStream_t stream);
  void notify_oom(int device, size_t nbytes, size_t device_free);
  // True while an allocation may race a stream capture: a private-pool route
  // is open (graph capture or use_mem_pool) or, on 2.13+, a capture is marked.
  bool capture_possible() const {
    return routes_open_.load(std::memory_order_relaxed) > 0 || captures_.load(std::memory_order_relaxed) > 0;
  }
  // An engine call failed: throw c10::Error with its message.
  [[noreturn]] void fail(const std::string& what) const;

  const CApi& c_;
  Registry registry_;
  History history_;

  std::atomic<int> routes_open_{0};
  std::atomic<int> captures_{0};
  std::mutex routes_mu_;
  std::vector<std::pair<int, c10::MempoolId_t>> routes_;  // (device, pool) begun and not ended

  std::mutex observers_mu_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;

  std::mutex fraction_mu_;
  std::vector<double> fraction_;  // per device; < 0: never set
};

// "2.00 GiB", "512.00 MiB", "100 B": torch's own OOM message format.
std::string format_size(size_t bytes);

}  // namespace cxlt
