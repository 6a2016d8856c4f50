// DeviceAllocator: private pools and the routes that send a stream's
// requests to them, and the release of cached segments (the free blocks
// themselves are the BlockCache's, block_cache.h).
#include <algorithm>

#include "alloc/device_allocator.h"
#include "common/error.h"

namespace cxl::alloc {

// Private pools (graph capture, MemPool) claim matching streams; the most
// recently begun matching route wins, as in torch since #161193 (nested
// use_mem_pool: the inner pool gets the allocations).
PoolId DeviceAllocator::pool_for(CUstream stream) const {
  for (auto r = routes_.rbegin(); r != routes_.rend(); ++r)
    if (r->filter(stream)) return r->pool;
  return PoolId{};
}

void DeviceAllocator::create_pool(PoolId id) {
  std::lock_guard<std::mutex> lk(mu_);
  pools_[id].use_count++;
}

int DeviceAllocator::pool_use_count(PoolId id) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = pools_.find(id);
  return it == pools_.end() ? -1 : it->second.use_count;
}

void DeviceAllocator::begin_allocate_to_pool(PoolId id, Filter filter) {
  std::lock_guard<std::mutex> lk(mu_);
  // torch's beginAllocateToPool creates or increfs the pool; releasePool
  // drops that reference (docs/sources.md#torch-allocator-interface).
  pools_[id].use_count++;
  routes_.push_back(Route{id, std::move(filter)});
}

void DeviceAllocator::end_allocate_to_pool(PoolId id) {
  std::lock_guard<std::mutex> lk(mu_);
  // Remove the newest route of this pool (routes nest like scopes).
  for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
    if (it->pool == id) {
      routes_.erase(std::next(it).base());
      return;
    }
  }
}

void DeviceAllocator::release_pool(PoolId id) {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  auto it = pools_.find(id);
  if (it == pools_.end()) return;
  if (--it->second.use_count > 0) return;
  // Free the pool's cached segments now; segments with live blocks are
  // released by empty_cache once those blocks are freed.
  std::vector<Segment*> victims;
  for (const auto& [base, seg] : segments_)
    if (seg->pool == id && seg->fully_free()) victims.push_back(seg.get());
  if (!victims.empty()) sync_device();
  for (Segment* s : victims) release_segment(s);
}

void DeviceAllocator::release_segment(Segment* seg) {
  CXL_CHECK(seg->fully_free(), "release of a segment in use");
  Tier t = seg->tier();
  cache_.remove_segment(seg);
  stats_.on_segment_released(t, seg->cls, seg->kind, seg->size);
  forget_moves_of(seg->id);
  segments_.erase(seg->base);  // RAII: unmap, release, free the VA
}

size_t DeviceAllocator::release_free_segments(Tier tier, size_t want, bool include_private) {
  std::vector<Segment*> victims;
  for (const auto& [base, seg] : segments_) {
    if (seg->extent || seg->tier() != tier || !seg->fully_free()) continue;
    if (!seg->pool.is_default()) {
      auto it = pools_.find(seg->pool);
      bool in_use = it != pools_.end() && it->second.use_count > 0;
      if (in_use && !include_private) continue;
    }
    victims.push_back(seg.get());
  }
  if (victims.empty()) return 0;
  // Release the smallest set that covers `want`: largest first.
  std::sort(victims.begin(), victims.end(), [](Segment* a, Segment* b) { return a->size > b->size; });
  // The GPU may still be using memory freed on its stream: unmapping does
  // not wait for it (unlike cudaFree), so we do.
  sync_device();
  size_t released = 0;
  for (Segment* s : victims) {
    if (released >= want) break;
    released += s->size;
    release_segment(s);
  }
  return released;
}

size_t DeviceAllocator::empty_cache() {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  if (pending_frees_.waiting()) pending_frees_.collect(true);
  size_t n = release_free_segments(Tier::Device, SIZE_MAX, false);
  n += release_free_segments(Tier::Host, SIZE_MAX, false);
  return n;
}

bool DeviceAllocator::add_peer(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  if (factory_->has_peer(peer)) return false;
  // Existing mappings first: if a grant fails, the peer is not recorded and a
  // later call grants again (cuMemSetAccess is idempotent).
  for (auto& [base, seg] : segments_) factory_->grant_peer(*seg, peer);
  return factory_->add_peer(peer);
}

}  // namespace cxl::alloc
