// Placement and migration policy: pure decision code, no driver calls, so it
// is unit-tested directly (tests/engine/test_policy.py through _C.policy_*).
//
// The rules, and where they come from:
//  * VRAM first for everything while it has room; KV cache is what spills:
//    it is large, grows predictably and is read in long sequential runs
//    (docs/sources.md#kv-first).
//  * A KV allocation goes to the host tier once the KV device quota is used,
//    or when placing it on the device would eat the headroom kept for
//    activations and workspaces (hot, short-lived: TPP's lesson that new
//    allocations are hot, docs/sources.md#tiering-policy).
//  * Other/weight allocations that do not fit may demote KV, coldest first,
//    never what the current step is using.
//  * Migrations (demotion and promotion) draw on a byte budget (a token
//    bucket), so they cannot thrash: TPP / MICRO'23 measured migrations
//    costing more than they save when unbounded (docs/sources.md#tiering-policy).
#pragma once

#include <algorithm>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/types.h"

namespace cxl::policy {

// A snapshot of one device's tiers, all in bytes.
struct TierBudget {
  size_t device_limit = 0;        // effective device budget (limit minus external use)
  size_t device_reserved = 0;     // physical device bytes held (live + cached)
  size_t device_cached_free = 0;  // device bytes in wholly free cached segments (reclaimable)
  size_t host_limit = 0;
  size_t host_reserved = 0;
  size_t host_cached_free = 0;
  size_t kv_device_quota = SIZE_MAX;  // SIZE_MAX: no separate KV quota
  size_t kv_device_bytes = 0;         // device bytes held by KV segments and extent chunks
  size_t device_headroom = 0;         // device bytes a KV placement must leave free
};

// Device bytes that could be made free without migrating live data.
size_t device_available(const TierBudget& b);
size_t host_available(const TierBudget& b);

struct Request {
  AllocClass cls = AllocClass::Other;
  size_t bytes = 0;           // bytes of the new segment
  bool private_pool = false;  // CUDA graph capture / private pool: device only
  // The least the device must give: a request torch's size classes would put
  // in a 20 MiB segment can also take a segment of its own size (the
  // allocator tries both), so VRAM room is judged by this.  0: same as bytes.
  size_t min_bytes = 0;
  size_t device_bytes() const { return min_bytes ? std::min(min_bytes, bytes) : bytes; }
};

// The tier a new segment should come from first.  The allocator falls back to
// the other tier (if allowed) when the first choice cannot be satisfied.
Tier first_choice(const Request& r, const TierBudget& b);
// May the allocator fall back to the host tier for this request at all?
bool may_spill(const Request& r, const TierBudget& b);
// May the allocator demote KV data to make device room for this request?
bool may_demote_for(const Request& r);

// Something that could be demoted (a KV segment, or a KV extent chunk).
struct Candidate {
  uint64_t id = 0;
  size_t bytes = 0;
  uint64_t last_use = 0;         // larger is more recent
  bool in_current_step = false;  // used since the last mark_step(): never a victim
};

// Coldest-first victims whose bytes reach `need`, spending at most
// `budget_bytes`.  Returns an empty list if `need` cannot be reached: a partial
// demotion frees too little to help and still costs the copies.
std::vector<uint64_t> choose_victims(size_t need, std::vector<Candidate> cands, size_t budget_bytes);

// Growing a KV extent by `new_chunks` chunks of `chunk_bytes`.  Newest chunks
// go to the device (up to the KV quota and device room); to keep the newest
// on the device, the oldest device KV chunks (anywhere) may be demoted within
// the migration budget.  New chunks that do not get device room are placed
// on the host directly (the oldest positions of the growth).
struct GrowthPlan {
  size_t host_new = 0;    // first host_new of the new chunks go to the host tier
  size_t device_new = 0;  // the remaining (newest) ones go to the device
  std::vector<uint64_t> demote;  // existing device KV chunks to demote first
};
GrowthPlan plan_extent_growth(size_t new_chunks, size_t chunk_bytes, const TierBudget& b,
                              std::vector<Candidate> device_kv_chunks, size_t budget_bytes, bool can_demote,
                              bool may_use_host);

// Host-resident candidates worth promoting back to the device when it has
// room beyond the headroom: most recently used first, only those touched at
// least `min_touches` times since they were demoted (TPP's promote-after-
// repeated-use rule), within the budget.
struct PromoteCandidate {
  uint64_t id = 0;
  size_t bytes = 0;
  uint64_t last_use = 0;
  uint32_t touches = 0;
  bool kv = false;
};
std::vector<uint64_t> choose_promotions(const TierBudget& b, std::vector<PromoteCandidate> cands,
                                        uint32_t min_touches, size_t budget_bytes);

// Token bucket for migration bytes.  rate_bytes_per_s == 0 disables
// migration; burst_bytes is the bucket size (and its initial fill).
class MigrationBudget {
 public:
  MigrationBudget(double rate_bytes_per_s = 0, size_t burst_bytes = 0);
  size_t available(double now_s);
  bool consume(size_t bytes, double now_s);
  double rate() const { return rate_; }
  size_t burst() const { return burst_; }

 private:
  void refill(double now_s);
  double rate_;
  size_t burst_;
  double tokens_;
  double last_s_ = -1;
};

}  // namespace cxl::policy
