// DeviceAllocator: demotion (VRAM -> host tier) and promotion (back), with
// addresses unchanged and bytes intact (VMM remap or managed prefetch).
#include <algorithm>
#include <thread>

#include "alloc/device_allocator.h"
#include "common/error.h"

namespace cxl::alloc {

void DeviceAllocator::mark_step() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!deferred_moves_.empty()) {
    driver::ContextGuard guard(*drv_, ctx_.get());
    run_owned_moves();
  }
  steps_marked_ = true;
  step_start_seq_ = ++seq_;
}

void DeviceAllocator::migrate_segment(Segment& seg, Tier target) {
  const Tier from = seg.tier();
  if (from == target) return;
  CXL_CHECK(!seg.has_event_pending_frees(), "migrating a segment with event-pending blocks");
  // Free lists are keyed by tier: take the free blocks out while it changes.
  std::vector<Block*> frees, live;
  for (Block* b = seg.head; b; b = b->next) (b->allocated ? live : frees).push_back(b);
  for (Block* b : frees) cache_.erase(b);
  for (Block* b : live) stats_.remove_block(from, seg.cls, seg.kind, b->size, b->requested);
  stats_.remove_segment(from, seg.cls, seg.kind, seg.size);
  try {
    factory_->migrate_chunk(seg, seg.chunks.front(), target);
  } catch (...) {
    stats_.add_segment(from, seg.cls, seg.kind, seg.size);
    for (Block* b : live) stats_.add_block(from, seg.cls, seg.kind, b->size, b->requested);
    for (Block* b : frees) cache_.insert(b);
    throw;
  }
  stats_.add_segment(target, seg.cls, seg.kind, seg.size);
  for (Block* b : live) stats_.add_block(target, seg.cls, seg.kind, b->size, b->requested);
  for (Block* b : frees) cache_.insert(b);
  seg.touches = 0;
}

void DeviceAllocator::migrate_chunk(Segment& seg, Chunk& c, Tier target) {
  if (c.tier == target) return;
  // The bytes leave the chunk's tier and join the one it is on afterwards
  // (the old one again if the move failed); the extent's size is unchanged.
  stats_.remove_chunk(c.tier, seg.cls, c.size);
  try {
    factory_->migrate_chunk(seg, c, target);
  } catch (...) {
    stats_.add_chunk(c.tier, seg.cls, c.size);
    throw;
  }
  stats_.add_chunk(c.tier, seg.cls, c.size);
}

std::vector<DeviceAllocator::KvUnit> DeviceAllocator::kv_units(Tier tier) {
  std::vector<KvUnit> out;
  for (const auto& [base, sp] : segments_) {
    Segment& seg = *sp;
    if (seg.cls != AllocClass::KV || !factory_->can_migrate(seg)) continue;
    if (seg.extent) {
      for (Chunk& c : seg.chunks)
        if (c.committed && c.tier == tier) out.push_back({&seg, &c});
    } else if (seg.tier() == tier && seg.pool.is_default() && !seg.has_event_pending_frees()) {
      // Graph-private pools stay put: a captured graph replays on them.
      out.push_back({&seg, nullptr});
    }
  }
  return out;
}

size_t DeviceAllocator::move_unit(const KvUnit& u, Tier target) {
  if (u.chunk) {
    migrate_chunk(*u.seg, *u.chunk, target);
    return u.chunk->size;
  }
  migrate_segment(*u.seg, target);
  return u.seg->size;
}

size_t DeviceAllocator::demote_for(size_t need, bool budgeted) {
  std::vector<KvUnit> units = kv_units(Tier::Device);
  std::vector<policy::Candidate> cands;
  size_t total = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    const KvUnit& u = units[i];
    size_t bytes = u.chunk ? u.chunk->size : u.seg->size;
    // Age: commit order for extent chunks, last allocation for segments.  A
    // chunk read in this step is the step's working set: demoting it for a
    // transient (case C04) would only bring it back over the link.
    uint64_t age = u.chunk ? u.chunk->seq : u.seg->last_use;
    uint64_t used = u.chunk ? std::max(u.chunk->seq, u.chunk->last_touch) : u.seg->last_use;
    cands.push_back({i, bytes, age, steps_marked_ && used >= step_start_seq_});
    total += bytes;
  }
  if (total < need) return 0;
  const double now = now_s();
  size_t allowed = budgeted ? migration_budget_.available(now) : SIZE_MAX;
  size_t host_room = limits_.room(Tier::Host, stats_.reserved(Tier::Host));
  // What the calling thread owns moves now; memory other threads use is
  // only queued for them (device_allocator_owners.cpp).
  std::vector<policy::Candidate> own;
  for (const auto& c : cands)
    if (may_move_now(units[c.id])) own.push_back(c);
  auto victims = policy::choose_victims(need, own, std::min(allowed, host_room));
  if (victims.empty()) {
    auto wanted = policy::choose_victims(need, cands, std::min(allowed, host_room));
    for (uint64_t id : wanted)
      if (!may_move_now(units[id])) defer_move(units[id], Tier::Host);
    if (budgeted && allowed < need) stats_.on_migration_budget_denied();
    return 0;
  }
  sync_device();
  size_t moved = 0;
  for (uint64_t id : victims) {
    size_t bytes = move_unit(units[id], Tier::Host);
    if (budgeted) migration_budget_.consume(bytes, now);
    moved += bytes;
    stats_.on_moved_unit(Tier::Host);
  }
  stats_.on_moved_bytes(Tier::Host, moved);
  return moved;
}

size_t DeviceAllocator::migrate(const void* ptr, size_t len, Tier target) {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  auto p = reinterpret_cast<CUdeviceptr>(ptr);
  Segment* seg = segment_of(p);
  if (!seg) throw Error(ErrorKind::InvalidArgument, "migrate: address is not owned by cxlalloc");
  if (!factory_->can_migrate(*seg))
    throw Error(ErrorKind::Unsupported, std::string("migrate: a ") + backing_name(seg->backing) +
                                            " segment cannot move between tiers at a fixed address (backend " +
                                            host_backend_name() + "; use host-vmm or managed)");
  // A segment's blocks share its physical pages, so moving one block moves all of them.  A segment that also
  // holds live blocks another thread allocated is refused: that thread may be reading them, and during the
  // remap their address is unmapped (a fault on the host, a dead context on a GPU).  An extent is one
  // caller's range: the chunks asked for are the caller's.  implicit_moves=any-thread lifts the rule, as for
  // the policy's own moves (the user promised that no other thread reads meanwhile).
  if (!seg->extent && !cfg_.implicit_moves_any_thread && seg->tier() != target) {
    auto who = owner_of(KvUnit{seg, nullptr});
    if (!who || *who != std::this_thread::get_id())
      throw Error(ErrorKind::Unsupported,
                  "migrate: the segment holding this address also holds live blocks another thread allocated; "
                  "moving it would remap their memory under them (free them first, allocate in an extent, or "
                  "set implicit_moves=any-thread if no other thread reads meanwhile)");
  }
  std::vector<Chunk*> chunks;
  size_t bytes = 0;
  if (seg->extent) {
    const size_t lo = p - seg->base;
    // Checked without forming lo + len, which wraps for huge lengths (and
    // then moved nothing, silently).
    if (len > seg->size - lo)
      throw Error(ErrorKind::InvalidArgument,
                  "migrate: length " + std::to_string(len) + " runs past the end of the extent (" +
                      std::to_string(seg->size - lo) + " bytes from the address to its end); allowed: 1 .. " +
                      std::to_string(seg->size - lo));
    const size_t hi = lo + std::max<size_t>(len, 1);
    for (Chunk& c : seg->chunks)
      if (c.committed && c.tier != target && c.offset < hi && c.offset + c.size > lo) {
        chunks.push_back(&c);
        bytes += c.size;
      }
  } else if (seg->tier() != target) {
    if (seg->has_event_pending_frees()) pending_frees_.collect(true);
    bytes = seg->size;
  }
  if (bytes == 0) return 0;
  size_t limit = limits_.limit(target);
  size_t used = stats_.reserved(target);
  if (used + bytes > limit)
    throw_oom(bytes, seg->cls, std::string("no room to migrate to the ") + tier_name(target) + " tier");
  sync_device();
  if (seg->extent)
    for (Chunk* c : chunks) migrate_chunk(*seg, *c, target);
  else
    migrate_segment(*seg, target);
  stats_.on_moved_bytes(target, bytes);
  stats_.on_moved_unit(target);
  return bytes;
}

size_t DeviceAllocator::rebalance() {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  if (!demotion_supported() || !cfg_.kv_aware) return 0;
  run_owned_moves();
  std::vector<KvUnit> units = kv_units(Tier::Host);
  if (units.empty()) return 0;
  std::vector<policy::PromoteCandidate> cands;
  for (size_t i = 0; i < units.size(); ++i) {
    const KvUnit& u = units[i];
    if (u.chunk)
      cands.push_back({i, u.chunk->size, u.chunk->seq, u.chunk->touches, true});
    else
      cands.push_back({i, u.seg->size, u.seg->last_use, u.seg->touches, true});
  }
  const double now = now_s();
  auto ids = policy::choose_promotions(budget(), cands, cfg_.promote_after, migration_budget_.available(now));
  if (ids.empty()) return 0;
  // The policy counts cached free device segments as room: a promotion
  // makes new device memory, so release those first, or reserved VRAM
  // would pass device_limit.
  const size_t limit = limits_.device();
  size_t want = 0;
  for (uint64_t id : ids) want += cands[id].bytes;
  const size_t free_now = limit - std::min(limit, stats_.reserved(Tier::Device));
  if (want > free_now) release_free_segments(Tier::Device, want - free_now, false);
  sync_device();
  size_t moved = 0;
  for (uint64_t id : ids) {
    // Never past the limit, whatever the release above achieved.
    if (stats_.reserved(Tier::Device) + cands[id].bytes > limit) continue;
    if (!may_move_now(units[id])) {
      defer_move(units[id], Tier::Device);  // its owner promotes it at its next call
      continue;
    }
    size_t bytes = move_unit(units[id], Tier::Device);
    migration_budget_.consume(bytes, now);
    moved += bytes;
    stats_.on_moved_unit(Tier::Device);
  }
  stats_.on_moved_bytes(Tier::Device, moved);
  return moved;
}

}  // namespace cxl::alloc
