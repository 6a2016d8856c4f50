// DeviceAllocator: the allocation path, from a request to a block (the
// order of resort is in device_allocator.h; docs/DESIGN.md follows one
// allocation through it).
#include <algorithm>
#include <thread>

#include "alloc/device_allocator.h"
#include "alloc/sizes.h"
#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::alloc {

// The order of resort (device_allocator.h): each step below runs only when
// the one before it could not serve the request.
void* DeviceAllocator::malloc(size_t nbytes, CUstream stream, AllocClass cls, bool only_host) {
  if (nbytes == 0) return nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  AllocRequest r = make_request(nbytes, stream, cls, only_host);
  // Frees whose events completed and parked frees become reusable first, so
  // the cache below sees them.  During capture no event may be queried and
  // nothing may synchronize (C14): skipped.
  if (!r.capturing) reclaim_finished();
  if (only_host && (r.capturing || !limits_.host_enabled()))
    throw Error(ErrorKind::Unsupported, r.capturing ? "cxlalloc: host-tier allocation refused during CUDA graph capture"
                                                    : "cxlalloc: host-tier allocation asked for, but the host tier is "
                                                      "disabled (host_limit 0)");
  // 1. A cached device block: already reserved, so it costs no budget.
  if (Block* b = only_host ? nullptr : cache_.find(r.key, stream, r.size)) {
    stats_.on_cache_hit();
    return reinterpret_cast<void*>(take_block(b, r.size, nbytes, stream)->ptr);
  }
  // 2. A new segment on the policy's first-choice tier, each tier with its
  //    own reclaim steps (try_device, try_host), then the other tier.
  plan_new_segment(r);
  Block* b = nullptr;
  if (r.first == Tier::Device) {
    b = try_device(r, true);
    // Graph-captured memory must stay in VRAM (C10): never spilled.
    if (!b && !r.capturing) b = try_host(r);
  } else {
    b = try_host(r);
    // The host tier is full: a KV block still beats an OOM while VRAM has room.
    if (!b && !only_host) b = try_device(r, false);
  }
  // 3. Nothing fits: say why, with both tiers' numbers.
  if (!b) refuse(r);
  return reinterpret_cast<void*>(b->ptr);
}

DeviceAllocator::AllocRequest DeviceAllocator::make_request(size_t nbytes, CUstream stream, AllocClass cls,
                                                            bool only_host) {
  AllocRequest r;
  r.nbytes = nbytes;
  r.size = round_size(nbytes);
  r.stream = stream;
  r.cls = cls;
  r.only_host = only_host;
  // Absurd sizes fail here, before any driver call or page touch.
  if (r.size == 0 || r.size > limits_.largest())
    throw_oom(nbytes, cls, "the request is larger than either tier's whole limit");
  const PoolId pool = pool_for(stream);
  r.capturing = capturing(stream);
  r.key = FreeListKey{pool, Tier::Device, cls, r.size <= kSmallSize ? PoolKind::Small : PoolKind::Large};
  return r;
}

void DeviceAllocator::reclaim_finished() {
  run_owned_moves();
  if (!parked_.empty() || !parked_extents_.empty()) retry_parked();
  if (pending_frees_.has_deferred()) pending_frees_.flush_deferred();
  if (pending_frees_.waiting()) pending_frees_.collect(false);
}

void DeviceAllocator::plan_new_segment(AllocRequest& r) {
  for (int t = 0; t < kNumTiers; ++t) r.refused_before[t] = stats_.counters.driver_refused_segments[t];
  r.seg_bytes = segment_size(r.size);
  // alloc_in falls back to a segment of the request's own size when torch's
  // size class does not fit: room, quota and demotion are judged by that.
  r.min_seg = std::min(r.seg_bytes, round_up(r.size, factory_->segment_alignment()));
  r.policy = policy::Request{r.cls, r.seg_bytes, r.capturing, r.min_seg};
  r.budget = budget();
  r.first = r.only_host ? Tier::Host : policy::first_choice(r.policy, r.budget);
}

// A new device segment, then (outside capture) three ways to make room, each
// followed by one more try.
Block* DeviceAllocator::try_device(const AllocRequest& r, bool allow_demote) {
  auto again = [&] { return alloc_in(Tier::Device, r.key, r.size, r.nbytes, r.stream, true); };
  if (Block* b = again()) return b;
  if (r.capturing) return nullptr;
  // a. Frees still waiting on stream events: wait for all of them (not
  //    FIFO-until-first-pending, the C06 failure) and retry.
  if (pending_frees_.waiting_on(Tier::Device)) {
    stats_.on_event_drain();
    pending_frees_.collect(true, int(Tier::Device));
    if (Block* b = again()) return b;
  }
  // b. Cached free device segments of any class go back before we spill
  //    (C11: the pool that never released its cache).  Within the budget
  //    the driver refused: give back one segment's worth.
  const size_t over = limits_.over_by(Tier::Device, stats_.reserved(Tier::Device), r.seg_bytes);
  if (size_t released = release_free_segments(Tier::Device, over ? over : r.seg_bytes, false)) {
    stats_.on_reclaimed(released);
    if (Block* b = again()) return b;
  }
  // c. Demote cold KV to make room (never for KV itself).
  if (allow_demote && cfg_.kv_aware && policy::may_demote_for(r.policy) && demotion_supported()) {
    const size_t need = limits_.over_by(Tier::Device, stats_.reserved(Tier::Device), r.min_seg);
    if (need > 0 && demote_for(need, true) > 0) {
      stats_.on_demoted_for_room();
      if (Block* b = again()) return b;
    }
  }
  return nullptr;
}

// The spill: the same reclaim order as the device tier, within the host
// budget.  A drained free is reused before cached segments are given back
// (which costs a device-wide sync and a new registration).
Block* DeviceAllocator::try_host(const AllocRequest& r) {
  if (!policy::may_spill(r.policy, r.budget)) return nullptr;
  Block* b = alloc_in(Tier::Host, r.key, r.size, r.nbytes, r.stream, true);
  if (!b && pending_frees_.waiting()) {
    pending_frees_.collect(true, int(Tier::Host));
    b = alloc_in(Tier::Host, r.key, r.size, r.nbytes, r.stream, false);
  }
  if (!b) {
    release_free_segments(Tier::Host, r.seg_bytes, false);
    b = alloc_in(Tier::Host, r.key, r.size, r.nbytes, r.stream, true);
  }
  if (b) stats_.on_spilled_block(b->size);
  return b;
}

void DeviceAllocator::refuse(const AllocRequest& r) {
  if (r.capturing && r.first == Tier::Device) {
    stats_.on_capture_refusal();
    throw Error(ErrorKind::Capture,
                "cxlalloc: cannot allocate " + format_bytes(r.nbytes) +
                    " during CUDA graph capture on cuda:" + std::to_string(cfg_.device) +
                    ": VRAM is full and graph-captured memory must stay in VRAM (never spilled to the host "
                    "tier). " +
                    describe_tiers() + ". Raise device_limit or capture with a smaller working set.");
  }
  std::string why = "neither tier can hold it";
  // The budget had room but the driver did not (another process, another
  // allocator, the CUDA context itself): say so, or the tier numbers below
  // would make no sense.
  for (int t = 0; t < kNumTiers; ++t)
    if (stats_.counters.driver_refused_segments[t] > r.refused_before[t])
      why += std::string("; the driver refused a new ") + tier_name(static_cast<Tier>(t)) +
             "-tier segment although the budget allowed it (out of memory outside cxlalloc's accounting: another "
             "process or allocator holds it)";
  throw_oom(r.nbytes, r.cls, why);
}

// A block of `size` on `tier`: a cached one, else a new segment if allowed.
Block* DeviceAllocator::alloc_in(Tier tier, const FreeListKey& base_key, size_t size, size_t requested,
                                 CUstream stream, bool allow_new_segment) {
  FreeListKey key = base_key;
  key.tier = tier;
  if (Block* b = cache_.find(key, stream, size)) {
    stats_.on_cache_hit();
    return take_block(b, size, requested, stream);
  }
  if (!allow_new_segment) return nullptr;
  const size_t standard = segment_size(size);
  Segment* seg = new_segment(tier, key, standard, stream);
  if (!seg) {
    // torch's size classes give a 1-10 MiB request a 20 MiB segment; when
    // only the request itself fits the tier, an exact-size segment beats a
    // spill (or an OOM) caused by rounding alone.
    const size_t exact = round_up(size, factory_->segment_alignment());
    if (exact < standard) seg = new_segment(tier, key, exact, stream);
  }
  if (!seg) return nullptr;
  return take_block(seg->head, size, requested, stream);
}

Segment* DeviceAllocator::new_segment(Tier tier, const FreeListKey& key, size_t size, CUstream stream) {
  if (!limits_.fits(tier, stats_.reserved(tier), size)) return nullptr;
  std::unique_ptr<Segment> seg;
  try {
    // Made in a local, so that what a failing factory made is released
    // before the failure is handled.
    auto fresh = std::make_unique<Segment>();
    factory_->create_block_segment(*fresh, size, tier, key.cls);
    seg = std::move(fresh);
  } catch (const Error& e) {
    // The physical tier is fuller than our budget thinks (another process,
    // the CUDA context, a driver limit): report "does not fit" and let the
    // caller move on; any other failure is an error the user must see.
    if (is_out_of_memory(e)) {
      stats_.on_driver_refused(tier);
      log_debug(std::string("segment allocation on ") + tier_name(tier) + " failed: " + e.what());
      return nullptr;
    }
    throw;
  }
  seg->id = next_segment_id_++;
  seg->cls = key.cls;
  seg->kind = key.kind;
  seg->pool = key.pool;
  seg->stream = stream;
  Segment* raw = seg.get();
  segments_[seg->base] = std::move(seg);
  stats_.on_segment_created(tier, raw->cls, raw->kind, raw->size);
  cache_.add_segment(raw, stream);
  return raw;
}

// Carve `size` bytes off the front of free block `b` and hand them out.
Block* DeviceAllocator::take_block(Block* b, size_t size, size_t requested, CUstream stream) {
  cache_.take(b, size);
  Segment* seg = b->segment;
  b->allocated = true;
  b->requested = requested;
  b->stream = stream;
  b->seq = ++seq_;
  b->owner = std::this_thread::get_id();
  allocated_[b->ptr] = b;
  seg->allocated += b->size;
  seg->last_use = b->seq;
  seg->touches++;
  stats_.on_block_allocated(seg->tier(), seg->cls, seg->kind, b->size, b->requested);
  return b;
}

size_t DeviceAllocator::segment_size(size_t rounded) const {
  size_t s = alloc_segment_size(rounded);
  return round_up(s, factory_->segment_alignment());
}

}  // namespace cxl::alloc
