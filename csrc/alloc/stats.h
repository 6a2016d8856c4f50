// Allocator statistics: exact byte and event counters per tier and class,
// plus torch's DeviceStats vocabulary for the device tier (global mode hands
// these to torch.cuda.memory_stats; see csrc/capi).
#pragma once

#include <cstdint>

#include "common/types.h"

namespace cxl::alloc {

// torch's Stat: current value, its peak, and cumulative increments/decrements.
struct Stat {
  int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void increase(int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

// Index into torch's per-pool arrays: aggregate, small pool, large pool.
enum StatIndex { kAggregate = 0, kSmall = 1, kLarge = 2 };

// Device-tier statistics in torch's vocabulary (c10::CachingDeviceAllocator::DeviceStats).
struct TorchStats {
  Stat allocation[3], segment[3], active[3], inactive_split[3];
  Stat allocated_bytes[3], reserved_bytes[3], active_bytes[3], inactive_split_bytes[3], requested_bytes[3];
  int64_t num_alloc_retries = 0, num_ooms = 0, num_sync_all_streams = 0;
  int64_t num_device_alloc = 0, num_device_free = 0;
};

struct TierStats {
  Stat allocated_bytes;  // bytes of live blocks / committed extent bytes on this tier
  Stat reserved_bytes;   // physical bytes held on this tier (live + cached)
  Stat segments;
};

struct Counters {
  uint64_t allocations = 0, frees = 0;
  uint64_t spilled_bytes = 0;        // cumulative bytes served by the host tier
  uint64_t spilled_allocations = 0;
  uint64_t demoted_bytes = 0, demotions = 0;
  uint64_t promoted_bytes = 0, promotions = 0;
  uint64_t reclaimed_bytes = 0;      // cached device bytes released to avoid a spill
  uint64_t event_drains = 0;         // times pending stream events were waited for to avoid a spill
  uint64_t cache_hits = 0;           // allocations served from cached free blocks
  uint64_t new_segments[kNumTiers] = {0, 0};
  uint64_t released_segments[kNumTiers] = {0, 0};
  // The budget allowed a new segment but the driver had no memory for it
  // (another process, the CUDA context, pinned-memory limits): the request
  // moved on as if the tier were full.
  uint64_t driver_refused_segments[kNumTiers] = {0, 0};
  uint64_t invalid_frees = 0;
  uint64_t ooms = 0;
  uint64_t capture_refusals = 0;     // host placement refused during graph capture
  uint64_t migration_budget_denials = 0;
  uint64_t extent_copy_bytes = 0;    // bytes copied by extent growth (0 with lazy extents)
  uint64_t event_record_failures = 0;  // cuEventRecord failed on a use stream: waited for it instead
};

struct Stats {
  TierStats tier[kNumTiers];
  Stat class_bytes[kNumClasses][kNumTiers];  // live bytes per class per tier
  Counters counters;
  TorchStats torch;  // device tier
};

}  // namespace cxl::alloc
