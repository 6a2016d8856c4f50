// The tier budget's arithmetic (tier_limits.h).
#include "alloc/tier_limits.h"

namespace cxl::alloc {

TierLimits::TierLimits(size_t device_limit, size_t host_limit, size_t kv_device_limit, size_t device_headroom,
                       bool kv_aware)
    : device_limit_(device_limit),
      host_limit_(host_limit),
      kv_device_limit_(kv_device_limit),
      device_headroom_(device_headroom),
      kv_aware_(kv_aware) {}

bool TierLimits::fits(Tier t, size_t reserved, size_t add) const {
  // reserved + add wrapping around would look small: a huge request (from a
  // bad size computation) must not pass as "fits".
  return reserved + add >= reserved && reserved + add <= limit(t);
}

size_t TierLimits::over_by(Tier t, size_t reserved, size_t add) const {
  const size_t lim = limit(t);
  return reserved + add > lim ? reserved + add - lim : 0;
}

size_t TierLimits::room(Tier t, size_t reserved) const {
  const size_t lim = limit(t);
  return lim > reserved ? lim - reserved : 0;
}

policy::TierBudget TierLimits::snapshot(size_t device_reserved, size_t host_reserved, size_t device_cached_free,
                                        size_t host_cached_free, size_t kv_device_bytes) const {
  policy::TierBudget b;
  b.device_limit = device();
  b.device_reserved = device_reserved;
  b.device_cached_free = device_cached_free;
  b.host_limit = host();
  b.host_reserved = host_reserved;
  b.host_cached_free = host_cached_free;
  // The first-fit baseline takes VRAM first-come: no quota, no headroom.
  b.kv_device_quota = kv_aware_ ? kv_device_limit_ : SIZE_MAX;
  b.kv_device_bytes = kv_device_bytes;
  b.device_headroom = kv_aware_ ? device_headroom_ : 0;
  return b;
}

}  // namespace cxl::alloc
