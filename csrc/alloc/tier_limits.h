// The tier budget: how many bytes each tier may hold, and what a request's
// room is judged against.
//
// One job: the limits (device_limit less the VRAM used outside cxlalloc,
// host_limit, the KV quota and headroom) and the arithmetic every path
// shares on them: does a new segment fit, by how much is a tier over, the
// policy's TierBudget snapshot.  It holds no memory and counts nothing: the
// reserved bytes come from Stats, the reclaimable ones from the segments,
// both passed in by DeviceAllocator.  Pure and driver-free, so it is
// unit-tested on its own (tests/engine/tier_limits_test.cpp).  Not
// thread-safe: the allocator's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/types.h"
#include "policy/policy.h"

namespace cxl::alloc {

class TierLimits {
 public:
  // host_limit 0 disables the host tier.  kv_aware false is the first-fit
  // baseline: no KV quota and no headroom reach the policy.
  TierLimits(size_t device_limit, size_t host_limit, size_t kv_device_limit, size_t device_headroom, bool kv_aware);

  // Effective VRAM budget: device_limit minus the VRAM used outside
  // cxlalloc (torch's own cache in scoped mode), never below 0.
  size_t device() const { return device_limit_ > external_device_ ? device_limit_ - external_device_ : 0; }
  size_t host() const { return host_limit_; }  // 0: the host tier is disabled
  bool host_enabled() const { return host_limit_ > 0; }
  size_t limit(Tier t) const { return t == Tier::Device ? device() : host(); }
  // The larger of the two limits: a request above it can never be served.
  size_t largest() const { return device() > host_limit_ ? device() : host_limit_; }

  // May `add` more bytes be reserved on `t` with `reserved` held already?
  // False on overflow too.
  bool fits(Tier t, size_t reserved, size_t add) const;
  // Bytes by which `reserved + add` exceeds `t`'s limit; 0 when it fits.
  size_t over_by(Tier t, size_t reserved, size_t add) const;
  // Bytes `t` may still reserve with `reserved` held (0 when at or over).
  size_t room(Tier t, size_t reserved) const;

  // The policy's view of both tiers (policy/policy.h) from what the
  // allocator holds: reserved bytes per tier, bytes in wholly free cached
  // segments per tier, and KV bytes in VRAM.
  policy::TierBudget snapshot(size_t device_reserved, size_t host_reserved, size_t device_cached_free,
                              size_t host_cached_free, size_t kv_device_bytes) const;

  // set_device_limit (torch.cuda.set_per_process_memory_fraction) and the
  // scoped mode's report of VRAM used outside cxlalloc.
  void set_device_limit(size_t bytes) { device_limit_ = bytes; }
  void set_external_device_bytes(size_t n) { external_device_ = n; }
  size_t external_device_bytes() const { return external_device_; }

 private:
  size_t device_limit_;
  size_t host_limit_;
  size_t kv_device_limit_;
  size_t device_headroom_;
  bool kv_aware_;
  size_t external_device_ = 0;
};

}  // namespace cxl::alloc
