// Unit test of alloc::TierLimits, the tier budget DeviceAllocator owns: the
// effective device limit, fits / over_by / room on both tiers (with
// overflow), and the policy snapshot (quota and headroom, off in the
// first-fit baseline).  Pure arithmetic: no driver.  Built and run by
// tests/engine/test_tier_limits.py; prints "ok: N checks" and exits 0, or
// names every failed check and exits 1.
#include <cstdint>
#include <cstdio>

#include "alloc/tier_limits.h"

#include "unit_check.h"

using namespace cxl;
using namespace cxl::alloc;


namespace {

constexpr size_t MiB = size_t(1) << 20;

void effective_device_limit() {
  TierLimits l(100 * MiB, 50 * MiB, SIZE_MAX, 0, true);
  CHECK(l.device() == 100 * MiB);
  CHECK(l.limit(Tier::Device) == 100 * MiB);
  CHECK(l.limit(Tier::Host) == 50 * MiB);
  CHECK(l.largest() == 100 * MiB);
  // VRAM used outside cxlalloc comes off the device budget, never below 0.
  l.set_external_device_bytes(70 * MiB);
  CHECK(l.external_device_bytes() == 70 * MiB);
  CHECK(l.device() == 30 * MiB);
  CHECK(l.largest() == 50 * MiB);  // now the host tier is the larger
  l.set_external_device_bytes(200 * MiB);
  CHECK(l.device() == 0);
  // A new cap (set_per_process_memory_fraction) still has the external use taken off.
  l.set_external_device_bytes(10 * MiB);
  l.set_device_limit(40 * MiB);
  CHECK(l.device() == 30 * MiB);
}

void host_tier_enabled_or_not() {
  TierLimits off(64 * MiB, 0, SIZE_MAX, 0, true);
  CHECK(!off.host_enabled());
  CHECK(off.host() == 0);
  CHECK(!off.fits(Tier::Host, 0, 2 * MiB));
  CHECK(off.room(Tier::Host, 0) == 0);
  TierLimits on(64 * MiB, 8 * MiB, SIZE_MAX, 0, true);
  CHECK(on.host_enabled());
  CHECK(on.fits(Tier::Host, 6 * MiB, 2 * MiB));
  CHECK(!on.fits(Tier::Host, 6 * MiB, 2 * MiB + 1));
}

void fits_over_by_room() {
  TierLimits l(20 * MiB, 10 * MiB, SIZE_MAX, 0, true);
  CHECK(l.fits(Tier::Device, 0, 20 * MiB));  // exactly the limit fits
  CHECK(!l.fits(Tier::Device, 2 * MiB, 20 * MiB));
  CHECK(l.over_by(Tier::Device, 2 * MiB, 20 * MiB) == 2 * MiB);
  CHECK(l.over_by(Tier::Device, 0, 20 * MiB) == 0);
  CHECK(l.over_by(Tier::Host, 9 * MiB, 2 * MiB) == 1 * MiB);
  CHECK(l.room(Tier::Device, 5 * MiB) == 15 * MiB);
  CHECK(l.room(Tier::Device, 25 * MiB) == 0);  // already over (the limit was lowered)
  CHECK(l.room(Tier::Host, 4 * MiB) == 6 * MiB);
  // A size that wraps around must not pass as small.
  CHECK(!l.fits(Tier::Device, 4 * MiB, SIZE_MAX - MiB));
}

void snapshot_for_the_policy() {
  TierLimits l(100 * MiB, 50 * MiB, 30 * MiB, 10 * MiB, true);
  l.set_external_device_bytes(20 * MiB);
  policy::TierBudget b = l.snapshot(40 * MiB, 5 * MiB, 4 * MiB, 2 * MiB, 12 * MiB);
  CHECK(b.device_limit == 80 * MiB);
  CHECK(b.device_reserved == 40 * MiB);
  CHECK(b.device_cached_free == 4 * MiB);
  CHECK(b.host_limit == 50 * MiB);
  CHECK(b.host_reserved == 5 * MiB);
  CHECK(b.host_cached_free == 2 * MiB);
  CHECK(b.kv_device_quota == 30 * MiB);
  CHECK(b.kv_device_bytes == 12 * MiB);
  CHECK(b.device_headroom == 10 * MiB);
  // The first-fit baseline: no quota, no headroom reach the policy.
  TierLimits ff(100 * MiB, 50 * MiB, 30 * MiB, 10 * MiB, false);
  policy::TierBudget f = ff.snapshot(0, 0, 0, 0, 0);
  CHECK(f.kv_device_quota == SIZE_MAX);
  CHECK(f.device_headroom == 0);
  CHECK(f.device_limit == 100 * MiB);
}

}  // namespace

int main() {
  effective_device_limit();
  host_tier_enabled_or_not();
  fits_over_by_room();
  snapshot_for_the_policy();
  if (failures) {
    std::printf("%d of %d checks failed\n", failures, checks);
    return 1;
  }
  std::printf("ok: %d checks\n", checks);
  return 0;
}
