// DeviceAllocator: who may move a piece of KV, and moves deferred to its
// owner.
//
// A move (demotion or promotion) changes the physical memory under a live
// address.  With VMM the old pages are unmapped before the new ones are
// mapped at the same address (the driver cannot replace a mapping in place),
// so for a moment the address is not mapped: a read from another host thread
// then faults, and on a GPU a kernel touching it kills the CUDA context.  The
// allocator cannot see who reads memory, but it knows who uses it: the thread
// that allocated a block, or last grew or touched an extent.  An implicit
// move (one that the policy chose because of some other request) is made at
// once only when the calling thread owns what moves; otherwise it is queued
// for the owner, which carries it out at its next engine call, when it is
// inside the allocator and so not reading that memory.  Explicit requests
// (migrate()) move at once: the caller asked for that memory to move.
#include <algorithm>
#include <thread>

#include "alloc/device_allocator.h"
#include "common/error.h"
#include "common/log.h"

namespace cxl::alloc {

std::optional<std::thread::id> DeviceAllocator::owner_of(const KvUnit& u) const {
  if (u.seg->extent) return u.seg->owner;  // a chunk of it, or the whole extent
  std::optional<std::thread::id> who;
  for (Block* b = u.seg->head; b; b = b->next) {
    if (!b->allocated) continue;
    if (who && *who != b->owner) return std::nullopt;  // shared by several threads: no single owner
    who = b->owner;
  }
  return who ? who : std::optional<std::thread::id>(std::this_thread::get_id());  // nothing live: anyone
}

bool DeviceAllocator::may_move_now(const KvUnit& u) const {
  if (cfg_.implicit_moves_any_thread) return true;
  auto who = owner_of(u);
  return who && *who == std::this_thread::get_id();
}

void DeviceAllocator::defer_move(const KvUnit& u, Tier target) {
  auto who = owner_of(u);
  if (!who) return;  // used by several threads: never moved implicitly
  const size_t index = u.chunk ? static_cast<size_t>(u.chunk - u.seg->chunks.data()) : SIZE_MAX;
  for (const DeferredMove& m : deferred_moves_)
    if (m.segment_id == u.seg->id && m.chunk == index) return;  // already queued
  deferred_moves_.push_back(DeferredMove{*who, u.seg->id, index, target});
  stats_.on_move_deferred();
}

void DeviceAllocator::run_owned_moves() {
  if (deferred_moves_.empty()) return;
  const std::thread::id me = std::this_thread::get_id();
  std::vector<DeferredMove> mine;
  for (auto it = deferred_moves_.begin(); it != deferred_moves_.end();) {
    if (it->owner == me) {
      mine.push_back(*it);
      it = deferred_moves_.erase(it);
    } else {
      ++it;
    }
  }
  if (mine.empty()) return;
  const double now = now_s();
  bool synced = false;
  size_t moved[kNumTiers] = {0, 0};
  for (const DeferredMove& m : mine) {
    // Re-checked now: since it was queued the segment may be gone, moved,
    // shared with another thread, or its target tier full.
    Segment* seg = nullptr;
    for (const auto& [base, sp] : segments_)
      if (sp->id == m.segment_id) seg = sp.get();
    if (!seg || seg->cls != AllocClass::KV || !factory_->can_migrate(*seg)) continue;
    KvUnit u{seg, nullptr};
    size_t bytes = seg->size;
    if (m.chunk != SIZE_MAX) {
      if (!seg->extent || m.chunk >= seg->chunks.size()) continue;
      u.chunk = &seg->chunks[m.chunk];
      if (!u.chunk->committed || u.chunk->tier == m.target) continue;
      bytes = u.chunk->size;
    } else if (seg->extent || seg->tier() == m.target || !seg->pool.is_default() || seg->has_event_pending_frees()) {
      continue;
    }
    if (!may_move_now(u)) continue;
    const size_t limit = limits_.limit(m.target);
    if (stats_.reserved(m.target) + bytes > limit) continue;
    if (!migration_budget_.consume(bytes, now)) {
      stats_.on_migration_budget_denied();
      continue;
    }
    try {
      if (!synced) {
        sync_device();
        synced = true;
      }
      move_unit(u, m.target);
    } catch (const std::exception& e) {
      // A deferred move is an optimisation the owner did not ask for: its
      // failure (rolled back by the factory) must not fail the owner's call.
      if (stats_.on_deferred_move_failure())
        log_warning(std::string("a deferred KV move failed and was dropped (reported once): ") + e.what());
      continue;
    }
    moved[int(m.target)] += bytes;
    stats_.on_moved_unit(m.target);
    stats_.on_deferred_move_done();
  }
  for (int t = 0; t < kNumTiers; ++t)
    if (moved[t]) stats_.on_moved_bytes(static_cast<Tier>(t), moved[t]);
}

void DeviceAllocator::forget_moves_of(uint64_t segment_id) {
  // A released segment's id is never reused, but its queued moves would
  // stay forever if their owner thread never calls again.
  deferred_moves_.erase(std::remove_if(deferred_moves_.begin(), deferred_moves_.end(),
                                       [&](const DeferredMove& m) { return m.segment_id == segment_id; }),
                        deferred_moves_.end());
}

size_t DeviceAllocator::deferred_moves() const {
  std::lock_guard<std::mutex> lk(mu_);
  return deferred_moves_.size();
}

void DeviceAllocator::run_deferred_moves() {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  run_owned_moves();
}

}  // namespace cxl::alloc
