// DeviceAllocator: the allocation path, from a request to a block (the
// order of resort is in device_allocator.h).
#include <algorithm>
#include <thread>

#include "alloc/device_allocator.h"
#include "alloc/sizes.h"
#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::alloc {

void* DeviceAllocator::malloc(size_t nbytes, CUstream stream, AllocClass cls, bool only_host) {
  if (nbytes == 0) return nullptr;
  const size_t size = round_size(nbytes);
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());

  // Absurd sizes fail here, before any driver call or page touch.
  size_t largest_tier = std::max(device_limit_eff(), host_enabled_ ? cfg_.host_limit : size_t(0));
  if (size == 0 || size > largest_tier)
    throw_oom(nbytes, cls, "the request is larger than either tier's whole limit");

  const PoolId pool = pool_for(stream);
  // During capture no event may be queried or recorded on the capturing
  // stream and nothing may synchronize (case C14), and nothing graph-captured
  // may live on the host tier (C10): device only, no reclaim.
  const bool cap = capturing(stream);
  if (!cap) {
    run_owned_moves();
    if (!parked_.empty() || !parked_extents_.empty()) retry_parked();
    if (!deferred_.empty()) flush_deferred();
    if (!pending_.empty()) process_events(false);
  }

  const PoolKind kind = size <= kSmallSize ? PoolKind::Small : PoolKind::Large;
  const FreeListKey key{pool, Tier::Device, cls, kind};

  if (only_host && (cap || !host_enabled_))
    throw Error(ErrorKind::Unsupported, cap ? "cxlalloc: host-tier allocation refused during CUDA graph capture"
                                            : "cxlalloc: host-tier allocation asked for, but the host tier is disabled (host_limit 0)");
  // Fast path: a cached device block (already reserved: costs no budget).
  if (Block* b = only_host ? nullptr : cache_.find(key, stream, size)) {
    stats_.on_cache_hit();
    return reinterpret_cast<void*>(take_block(b, size, nbytes, stream)->ptr);
  }

  uint64_t refused_before[kNumTiers];
  for (int t = 0; t < kNumTiers; ++t) refused_before[t] = stats_.counters.driver_refused_segments[t];
  const size_t seg_bytes = segment_size(size);
  // alloc_in falls back to a segment of the request's own size when torch's
  // size class does not fit: room, quota and demotion are judged by that.
  const size_t min_seg = std::min(seg_bytes, round_up(size, factory_->segment_alignment()));
  policy::Request req{cls, seg_bytes, cap, min_seg};
  policy::TierBudget tb = budget();
  Tier first = only_host ? Tier::Host : policy::first_choice(req, tb);

  auto try_device = [&](bool allow_demote) -> Block* {
    if (Block* b = alloc_in(Tier::Device, key, size, nbytes, stream, true)) return b;
    if (cap) return nullptr;
    // 1. Frees still waiting on stream events: wait for all of them (not
    //    FIFO-until-first-pending, the C06 failure) and retry.
    bool device_pending = false;
    for (const auto& pf : pending_) device_pending = device_pending || pf.block->segment->tier() == Tier::Device;
    if (device_pending) {
      stats_.on_event_drain();
      process_events(true, int(Tier::Device));
      if (Block* b = alloc_in(Tier::Device, key, size, nbytes, stream, true)) return b;
    }
    // 2. Cached free device segments of any class go back before we spill
    //    (C11: the pool that never released its cache).
    size_t used = stats_.reserved(Tier::Device);
    size_t need = used + seg_bytes > device_limit_eff() ? used + seg_bytes - device_limit_eff() : seg_bytes;
    size_t released = release_free_segments(Tier::Device, need, false);
    if (released > 0) {
      stats_.on_reclaimed(released);
      if (Block* b = alloc_in(Tier::Device, key, size, nbytes, stream, true)) return b;
    }
    // 3. Demote cold KV to make room (never for KV itself).
    if (allow_demote && cfg_.kv_aware && policy::may_demote_for(req) && demotion_supported()) {
      used = stats_.reserved(Tier::Device);
      need = used + min_seg > device_limit_eff() ? used + min_seg - device_limit_eff() : 0;
      if (need > 0 && demote_for(need, true) > 0) {
        stats_.on_demoted_for_room();
        if (Block* b = alloc_in(Tier::Device, key, size, nbytes, stream, true)) return b;
      }
    }
    return nullptr;
  };
  auto try_host = [&]() -> Block* {
    if (!policy::may_spill(req, tb)) return nullptr;
    Block* b = alloc_in(Tier::Host, key, size, nbytes, stream, true);
    // Same reclaim order as the device tier, within the host budget: a
    // drained free is reused before cached segments are given back (which
    // costs a device-wide sync and a new registration).
    if (!b && !pending_.empty()) {
      process_events(true, int(Tier::Host));
      b = alloc_in(Tier::Host, key, size, nbytes, stream, false);
    }
    if (!b) {
      release_free_segments(Tier::Host, seg_bytes, false);
      b = alloc_in(Tier::Host, key, size, nbytes, stream, true);
    }
    if (b) {
      stats_.on_spilled_block(b->size);
    }
    return b;
  };

  Block* b = nullptr;
  if (first == Tier::Device) {
    b = try_device(true);
    if (!b && cap) {
      stats_.on_capture_refusal();
      throw Error(ErrorKind::Capture,
                  "cxlalloc: cannot allocate " + format_bytes(nbytes) + " during CUDA graph capture on cuda:" +
                      std::to_string(cfg_.device) +
                      ": VRAM is full and graph-captured memory must stay in VRAM (never spilled to the host "
                      "tier). " +
                      describe_tiers() + ". Raise device_limit or capture with a smaller working set.");
    }
    if (!b) b = try_host();
  } else {
    b = try_host();
    // The host tier is full: a KV block still beats an OOM while VRAM has room.
    if (!b && !only_host) b = try_device(false);
  }
  if (!b) {
    std::string why = "neither tier can hold it";
    // The budget had room but the driver did not (another process, another
    // allocator, the CUDA context itself): say so, or the tier numbers below
    // would make no sense.
    for (int t = 0; t < kNumTiers; ++t)
      if (stats_.counters.driver_refused_segments[t] > refused_before[t])
        why += std::string("; the driver refused a new ") + tier_name(static_cast<Tier>(t)) +
               "-tier segment although the budget allowed it (out of memory outside cxlalloc's accounting: another "
               "process or allocator holds it)";
    throw_oom(nbytes, cls, why);
  }
  return reinterpret_cast<void*>(b->ptr);
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
  size_t limit = tier == Tier::Device ? device_limit_eff() : cfg_.host_limit;
  size_t reserved = stats_.reserved(tier);
  if (reserved + size > limit || reserved + size < reserved) return nullptr;
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
