// Pending frees: freed blocks that other streams used (record_stream), whose
// reuse must wait until those streams' work has passed them.
//
// One job: the events that order a freed block's reuse after its streams
// (torch's stream-ordered reuse, c10/cuda/CUDACachingAllocator.cpp's
// cuda_events), the blocks freed during graph capture that cannot record an
// event yet (case C14), and the pool of idle events they reuse.  A block
// whose last event completes is handed to the `retire` hook (the allocator
// puts it back in its BlockCache); a failed cuEventRecord goes to the
// `record_failed` hook (counted and logged once) after the stream is waited
// for instead.  It owns driver::Event objects (RAII) but no memory and no
// accounting.  Not thread-safe: the allocator's mutex guards it, and the
// device's context must be current for every call.  Unit-tested on the
// simulated driver (tests/engine/pending_frees_test.cpp).
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <vector>

#include "alloc/block.h"
#include "driver/resources.h"

namespace cxl::alloc {

class PendingFrees {
 public:
  using RetireFn = std::function<void(Block*)>;
  using RecordFailedFn = std::function<void(CUresult)>;

  PendingFrees(driver::DriverPtr drv, RetireFn retire, RecordFailedFn record_failed);
  PendingFrees(const PendingFrees&) = delete;
  PendingFrees& operator=(const PendingFrees&) = delete;

  // `n` events, or none: on a failure (throws the driver's error) the pool
  // is as it was.  Taken before a free changes anything, so that the free
  // is all or nothing.
  std::vector<driver::Event> acquire(size_t n);
  // Order `b`'s reuse after every stream in b->stream_uses, with one of
  // `events` (from acquire) per stream; retire it at once when none is left
  // to wait for.  Never throws.
  void wait_for_uses(Block* b, std::vector<driver::Event> events);
  // Freed during graph capture: no event may be recorded on a capturing
  // stream, so the block waits here until flush_deferred.
  void defer(Block* b);
  // Record the deferred blocks' events (capture is over).  A block whose
  // events cannot be had now stays deferred for the next call.
  void flush_deferred();
  // Retire the blocks whose events have all completed; with `wait`,
  // synchronize each event first.  only_tier >= 0 restricts the pass to
  // blocks on that tier.  Every event is checked, not just the queue's head:
  // one slow stream must not hold back the frees of all others (case C06,
  // pytorch#71616).  Throws the driver's error for a failing event query.
  void collect(bool wait, int only_tier = -1);

  bool waiting() const { return !pending_.empty(); }  // events outstanding
  bool has_deferred() const { return !deferred_.empty(); }
  bool waiting_on(Tier t) const;  // an outstanding event holds a block of tier t
  // Every block waiting (on an event or deferred), for check_invariants.
  std::vector<const Block*> blocks() const;
  size_t idle_events() const { return event_pool_.size(); }
  // Teardown: drop every event (the context was synchronized).
  void clear();

 private:
  struct Pending {
    driver::Event event;
    Block* block;
  };
  driver::Event acquire_one();

  driver::DriverPtr drv_;
  RetireFn retire_;
  RecordFailedFn record_failed_;
  std::deque<Pending> pending_;
  std::vector<Block*> deferred_;
  std::vector<driver::Event> event_pool_;
};

}  // namespace cxl::alloc
