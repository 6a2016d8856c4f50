// torch.cuda.memory._record_memory_history for cxlalloc: settings, the
// per-device trace rings, and the trace trackers (c10d's NCCL registration).
//
// Semantics follow torch's native allocator: traces are kept while history
// is enabled, each action can be skipped by name, stacks come from the
// context recorder torch hands us, gathered at the levels RecordContext
// names (STATE: live blocks only; ALLOC: + alloc traces; ALL: + free traces).
// Trackers see every event whether or not history is on.
//
// What cxlalloc cannot show: segment_alloc/segment_free/map events (the
// engine owns segments and has no C-ABI event stream) and the delay between
// free_requested and free_completed for record_stream'd blocks (both are
// recorded when torch frees the block).  docs/pytorch-integration.md says so.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <c10/core/CachingDeviceAllocator.h>

namespace cxlt {

namespace CDA = c10::CachingDeviceAllocator;

class History {
 public:
  void configure(bool enabled, CDA::CreateContextFn recorder, size_t max_entries, CDA::RecordContext when,
                 bool clear, const std::vector<std::string>& skip_actions);
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // The current stack if recording asks for stacks at `level`, else null.
  // The recorder gathers Python frames (it takes the GIL): never call this
  // while holding a lock of ours.
  std::shared_ptr<c10::GatheredContext> gather(CDA::RecordContext level) const;
  // Whether trace entries (as opposed to live-block state) keep stacks.
  bool trace_stacks(CDA::RecordContext level) const {
    return static_cast<int>(when_.load(std::memory_order_relaxed)) >= static_cast<int>(level);
  }

  void record(CDA::TraceEntry::Action action, int device, uintptr_t addr, size_t size, void* stream,
              c10::MempoolId_t pool, std::shared_ptr<c10::GatheredContext> context);
  void attach_tracker(CDA::AllocatorTraceTracker tracker);
  // A copy of every device's ring, indexed by device (size >= device_count).
  std::vector<std::vector<CDA::TraceEntry>> traces(int device_count) const;

 private:
  mutable std::mutex mu_;
  std::atomic<bool> enabled_{false};
  std::atomic<bool> has_trackers_{false};
  std::atomic<CDA::CreateContextFn> recorder_{nullptr};
  std::atomic<CDA::RecordContext> when_{CDA::RecordContext::NEVER};
  size_t max_entries_ = 0;
  std::set<int> skip_;                                // TraceEntry::Action values
  std::map<int, std::deque<CDA::TraceEntry>> rings_;  // by device
  std::vector<CDA::AllocatorTraceTracker> trackers_;
};

}  // namespace cxlt
