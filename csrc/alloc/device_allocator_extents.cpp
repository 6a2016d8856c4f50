// DeviceAllocator: extents, the storage of the KV cache.
//
// An extent reserves address space for a KV buffer's whole capacity and
// commits physical chunks as the sequence grows, so growth never copies the
// cache (transformers' DynamicLayer copies it every step with torch.cat) and
// attention reads one contiguous view whose old chunks may live on the host
// tier (the vAttention idea: virtual contiguity over physical pages placed
// at will, arXiv 2405.04437).  Where the backend cannot remap (pinned), an
// extent is committed whole at creation on one tier instead.
#include <thread>

#include "alloc/device_allocator.h"
#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::alloc {

ExtentInfo DeviceAllocator::extent_create(size_t capacity, AllocClass cls) {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  if (!parked_.empty() || !parked_extents_.empty()) retry_parked();
  const size_t align = factory_->segment_alignment();
  const size_t chunk = cfg_.extent_chunk ? round_up(cfg_.extent_chunk, align) : align;
  if (capacity == 0) throw Error(ErrorKind::InvalidArgument, "extent capacity must be > 0 bytes");
  size_t cap = round_up(capacity, chunk);
  size_t total = limits_.device() + limits_.host();
  if (cap == 0 || cap > total) throw_oom(capacity, cls, "the extent's capacity exceeds both tiers together");

  std::unique_ptr<Segment> seg;
  bool lazy = factory_->lazy_extents();
  if (lazy) {
    seg = std::make_unique<Segment>();
    try {
      factory_->create_extent(*seg, cap, chunk);
    } catch (const Error& e) {
      // The driver refusing a range this large is running out of (address)
      // memory, whatever code it returns: say so with the size and limits.
      const auto* de = dynamic_cast<const DriverError*>(&e);
      if (!is_out_of_memory(e) && !(de && de->code() == CUDA_ERROR_OUT_OF_MEMORY)) throw;
      throw_oom(capacity, cls, std::string("no GPU address range of that size could be reserved (") + e.what() + ")");
    }
  } else {
    // Fixed backends: commit the whole capacity now on the tier the policy
    // picks for it, falling back to the other tier.
    policy::Request req{cls, cap, false};
    Tier first = policy::first_choice(req, budget());
    for (Tier t : {first, first == Tier::Device ? Tier::Host : Tier::Device}) {
      if (t == Tier::Host && !limits_.host_enabled()) continue;
      size_t limit = limits_.limit(t);
      if (stats_.reserved(t) + cap > limit) continue;
      try {
        auto fresh = std::make_unique<Segment>();
        factory_->create_block_segment(*fresh, cap, t, cls);
        seg = std::move(fresh);
        break;
      } catch (const Error& e) {
        if (!is_out_of_memory(e)) throw;
      }
    }
    if (!seg) throw_oom(cap, cls, "no tier can hold the extent (this backend commits extents whole)");
    seg->chunks.front().seq = ++seq_;
  }
  seg->cls = cls;
  seg->kind = PoolKind::Large;
  seg->extent = true;
  seg->owner = std::this_thread::get_id();
  seg->id = next_segment_id_++;
  Segment* raw = seg.get();
  segments_[seg->base] = std::move(seg);
  extents_[raw->id] = raw;
  if (!lazy) {
    const Chunk& c = raw->chunks.front();
    stats_.on_fixed_extent_created(c.tier, raw->cls, c.size);
    raw->allocated += c.size;
  }
  return ExtentInfo{raw->id, raw->base, raw->size, raw->chunks.front().size, lazy};
}

static Segment* find_extent(const std::map<uint64_t, Segment*>& m, uint64_t id) {
  auto it = m.find(id);
  if (it == m.end()) throw Error(ErrorKind::InvalidArgument, "unknown or released extent id " + std::to_string(id));
  return it->second;
}

void DeviceAllocator::extent_grow(uint64_t id, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  Segment* seg = find_extent(extents_, id);
  seg->owner = std::this_thread::get_id();  // the thread that grows it is the one using it
  run_owned_moves();
  if (bytes > seg->size)
    throw Error(ErrorKind::InvalidArgument, "extent_grow: " + format_bytes(bytes) + " exceeds the extent's capacity of " +
                                                format_bytes(seg->size));
  if (!factory_->lazy_extents()) return;  // committed whole at creation
  const size_t chunk = seg->chunks.front().size;
  const size_t want = (bytes + chunk - 1) / chunk;
  std::vector<Chunk*> fresh;
  for (size_t i = 0; i < want; ++i)
    if (!seg->chunks[i].committed) fresh.push_back(&seg->chunks[i]);
  if (fresh.empty()) return;

  // Plan: the newest chunks on the device (KV quota and headroom permitting),
  // older device KV demoted to make room within the migration budget.
  std::vector<policy::Candidate> device_kv;
  std::vector<std::pair<Segment*, Chunk*>> where;
  const bool kv_policy = cfg_.kv_aware && seg->cls == AllocClass::KV;
  bool can_demote = demotion_supported() && kv_policy;
  if (can_demote) {
    for (auto& [id2, ext] : extents_) {
      if (ext->cls != AllocClass::KV || !factory_->can_migrate(*ext)) continue;
      // Another thread's extent may be read right now: its chunks make room
      // only when that thread grows it (device_allocator_owners.cpp).
      if (!may_move_now(KvUnit{ext, nullptr})) continue;
      for (Chunk& c : ext->chunks) {
        if (!c.committed || c.tier != Tier::Device) continue;
        device_kv.push_back({where.size(), c.size, c.seq, false});
        where.emplace_back(ext, &c);
      }
    }
  }
  const double now = now_s();
  size_t allowed = can_demote ? migration_budget_.available(now) : 0;
  size_t host_room = limits_.room(Tier::Host, stats_.reserved(Tier::Host));
  // Demoted chunks and host-placed new chunks share the host room; the
  // commit loop below re-checks every chunk against the limits.
  policy::GrowthPlan plan;
  if (kv_policy) {
    plan = policy::plan_extent_growth(fresh.size(), chunk, budget(), device_kv, std::min(allowed, host_room),
                                      can_demote, limits_.host_enabled());
  } else {
    // Weight/other extents, and every extent under first-fit: the device
    // while it has room, else the host (first come, first served).
    size_t room = policy::device_available(budget());
    size_t dev = std::min(fresh.size(), room / chunk);
    plan.device_new = limits_.host_enabled() ? dev : fresh.size();
    plan.host_new = fresh.size() - plan.device_new;
  }
  if (!plan.demote.empty()) {
    sync_device();
    size_t moved = 0;
    for (uint64_t v : plan.demote) {
      auto [s, c] = where[v];
      migrate_chunk(*s, *c, Tier::Host);
      migration_budget_.consume(c->size, now);
      moved += c->size;
      stats_.on_moved_unit(Tier::Host);
    }
    stats_.on_moved_bytes(Tier::Host, moved);
  }
  // Commit: the oldest positions of the growth on the host, the newest on
  // the device; each falls back to the other tier rather than fail.
  for (size_t i = 0; i < fresh.size(); ++i) {
    Chunk& c = *fresh[i];
    Tier first = i < plan.host_new ? Tier::Host : Tier::Device;
    bool done = false;
    for (Tier t : {first, first == Tier::Device ? Tier::Host : Tier::Device}) {
      if (t == Tier::Host && !limits_.host_enabled()) continue;
      size_t limit = limits_.limit(t);
      if (stats_.reserved(t) + c.size > limit) continue;
      try {
        factory_->commit_chunk(*seg, c, t);
      } catch (const Error& e) {
        if (is_out_of_memory(e)) continue;
        throw;
      }
      c.seq = ++seq_;
      stats_.on_chunk_committed(c.tier, seg->cls, c.size);
      seg->allocated += c.size;
      done = true;
      break;
    }
    if (!done) throw_oom(c.size, seg->cls, "growing a KV extent: neither tier has room for the next chunk");
  }
  seg->last_use = ++seq_;
}

void DeviceAllocator::extent_trim(uint64_t id, size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  Segment* seg = find_extent(extents_, id);
  if (!factory_->lazy_extents() || seg->backing == Backing::Managed) return;
  const size_t chunk = seg->chunks.front().size;
  const size_t keep = (bytes + chunk - 1) / chunk;
  bool synced = false;
  for (size_t i = keep; i < seg->chunks.size(); ++i) {
    Chunk& c = seg->chunks[i];
    if (!c.committed) continue;
    if (!synced) {
      sync_device();  // in-flight kernels may still read the chunk
      synced = true;
    }
    stats_.remove_chunk(c.tier, seg->cls, c.size);
    seg->allocated -= c.size;
    factory_->decommit_chunk(*seg, c);
  }
}

void DeviceAllocator::extent_touch(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  Segment* seg = find_extent(extents_, id);
  seg->owner = std::this_thread::get_id();
  if (!deferred_moves_.empty()) {  // touch needs no driver call otherwise (once per step per KV store)
    driver::ContextGuard guard(*drv_, ctx_.get());
    run_owned_moves();
  }
  const uint64_t now = ++seq_;
  for (Chunk& c : seg->chunks)
    if (c.committed) {
      c.touches++;
      c.last_touch = now;
    }
  seg->last_use = now;
}

void DeviceAllocator::extent_free(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  extent_free_locked(id);
}

void DeviceAllocator::extent_free_or_park(uint64_t id) noexcept {
  try {
    std::lock_guard<std::mutex> lk(mu_);
    try {
      driver::ContextGuard guard(*drv_, ctx_.get());
      extent_free_locked(id);
    } catch (const std::exception& e) {
      // Called from destructors (the extent's last owner dying), which
      // cannot report: keep the extent and release it at the next engine
      // call instead of leaking it for good.
      if (extents_.count(id) && parked_extents_.insert(id).second)
        note_cleanup_failure(std::string("extent release deferred (retried at the next allocator call): ") + e.what());
    }
  } catch (...) {
    note_cleanup_failure("extent release: could not take the allocator's lock");
  }
}

void DeviceAllocator::extent_free_locked(uint64_t id) {
  Segment* seg = find_extent(extents_, id);
  parked_extents_.erase(id);
  forget_moves_of(seg->id);
  // Called from destructors (the last tensor of a KV layer dying): a failed
  // sync is reported, and the memory released anyway rather than leaked.
  try {
    sync_device();
  } catch (const std::exception& e) {
    note_cleanup_failure(std::string("extent release: ") + e.what());
  }
  for (Chunk& c : seg->chunks)
    if (c.committed) {
      stats_.remove_chunk(c.tier, seg->cls, c.size);
      seg->allocated -= c.size;
    }
  if (!factory_->lazy_extents()) stats_.on_fixed_extent_released(seg->tier());
  extents_.erase(id);
  segments_.erase(seg->base);
}

size_t DeviceAllocator::extent_committed(uint64_t id) const {
  std::lock_guard<std::mutex> lk(mu_);
  Segment* seg = find_extent(extents_, id);
  size_t n = 0;
  for (const Chunk& c : seg->chunks)
    if (c.committed) n += c.size;
  return n;
}

size_t DeviceAllocator::extent_committed_prefix(uint64_t id) const {
  std::lock_guard<std::mutex> lk(mu_);
  Segment* seg = find_extent(extents_, id);
  size_t n = 0;
  for (const Chunk& c : seg->chunks) {
    if (!c.committed || c.offset != n) break;
    n += c.size;
  }
  return n;
}

std::vector<TierRange> DeviceAllocator::extent_tiers(uint64_t id) const {
  std::lock_guard<std::mutex> lk(mu_);
  Segment* seg = find_extent(extents_, id);
  std::vector<TierRange> out;
  for (const Chunk& c : seg->chunks) {
    std::string t = c.committed ? tier_name(c.tier) : "none";
    if (!out.empty() && out.back().tier == t && out.back().offset + out.back().length == c.offset)
      out.back().length += c.size;
    else
      out.push_back(TierRange{c.offset, c.size, t});
  }
  return out;
}

}  // namespace cxl::alloc
