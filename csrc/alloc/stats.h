// Allocator statistics: exact byte and event counters per tier and class,
// plus torch's DeviceStats vocabulary for the device tier (global mode hands
// these to torch.cuda.memory_stats; see csrc/capi), and the accounting rules
// that update them (stats.cpp).
#pragma once

#include <cstddef>
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
  // Implicit KV moves of memory another thread owns, queued for that thread
  // (device_allocator_owners.cpp), and those that failed when it ran them.
  uint64_t deferred_moves = 0;
  uint64_t deferred_moves_done = 0;
  uint64_t deferred_move_failures = 0;
};

// The counters, and the accounting rules as operations on them: the
// allocator says what happened, these say what it counts.  Every byte is
// counted on exactly one tier: the tier of the chunk holding it.
struct Stats {
  TierStats tier[kNumTiers];
  Stat class_bytes[kNumClasses][kNumTiers];  // live bytes per class per tier
  Counters counters;
  TorchStats torch;  // device tier
  // Device bytes of KV block segments and extent chunks: what the KV quota
  // (kv_device_limit) is measured against.  Not a stats key.
  size_t kv_device_bytes = 0;

  size_t reserved(Tier t) const { return static_cast<size_t>(tier[int(t)].reserved_bytes.current); }

  // ---- bytes entering or leaving a tier
  // A live block's bytes on tier `t` (an allocation or a free, or either
  // side of its segment's migration).
  void add_block(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested);
  void remove_block(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested);
  // A whole block segment's reservation on tier `t` (created or released,
  // or either side of a migration).
  void add_segment(Tier t, AllocClass cls, PoolKind kind, size_t bytes);
  void remove_segment(Tier t, AllocClass cls, PoolKind kind, size_t bytes);
  // An extent chunk on tier `t`: both reserved and allocated, for the
  // extent's class (committed or released, or either side of a migration).
  void add_chunk(Tier t, AllocClass cls, size_t bytes);
  void remove_chunk(Tier t, AllocClass cls, size_t bytes);

  // ---- events: the moves above plus the counters that go with them
  void on_block_allocated(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested);
  void on_block_freed(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested);
  // A freed block that other streams used waits for their events; torch
  // keeps its bytes "active" until they complete.
  void on_block_awaiting_events(Tier t, PoolKind kind, size_t size);
  void on_block_events_done(Tier t, PoolKind kind, size_t size);
  void on_segment_created(Tier t, AllocClass cls, PoolKind kind, size_t bytes);
  void on_segment_released(Tier t, AllocClass cls, PoolKind kind, size_t bytes);
  // An extent chunk committed as it grows; on the host tier it is spilled.
  void on_chunk_committed(Tier t, AllocClass cls, size_t bytes);
  // An extent committed whole at creation (backends that cannot remap): one
  // segment, one chunk.
  void on_fixed_extent_created(Tier t, AllocClass cls, size_t bytes);
  void on_fixed_extent_released(Tier t);
  void on_cache_hit() { counters.cache_hits++; }
  // A block served by the host tier because the device could not hold it.
  void on_spilled_block(size_t size);
  // The budget allowed a new segment on `t` but the driver had no memory.
  void on_driver_refused(Tier t) { counters.driver_refused_segments[int(t)]++; }
  // Reclaim steps before a retry of the device tier (torch's num_alloc_retries).
  void on_event_drain();            // frees pending on stream events were waited for
  void on_reclaimed(size_t bytes);  // cached free segments were released
  void on_demoted_for_room();       // cold KV was demoted
  void on_capture_refusal() { counters.capture_refusals++; }
  void on_oom();
  void on_invalid_free() { counters.invalid_frees++; }
  // Returns true for the first failure (reported once).
  bool on_event_record_failure() { return counters.event_record_failures++ == 0; }
  void on_sync_all_streams() { torch.num_sync_all_streams++; }
  void on_migration_budget_denied() { counters.migration_budget_denials++; }
  void on_move_deferred() { counters.deferred_moves++; }
  void on_deferred_move_done() { counters.deferred_moves_done++; }
  bool on_deferred_move_failure() { return counters.deferred_move_failures++ == 0; }
  // One unit (a block segment or an extent chunk) moved to `target`: a
  // demotion (host) or a promotion (device).  Its bytes are added by
  // on_moved_bytes once the batch of moves is done.
  void on_moved_unit(Tier target);
  void on_moved_bytes(Tier target, size_t bytes);

  // ---- derived values and resets
  // inactive_split: free blocks inside device segments that also hold other
  // blocks (torch's fragmentation measure), recomputed on demand.
  void clear_inactive_split();
  void add_inactive_split(PoolKind kind, size_t size);
  void reset_peaks();
  void reset_accumulated();
};

}  // namespace cxl::alloc
