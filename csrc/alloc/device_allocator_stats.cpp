// DeviceAllocator: statistics, snapshots, placement queries and the
// invariant check.
#include <set>

#include "alloc/device_allocator.h"
#include "common/error.h"

namespace cxl::alloc {

Stats DeviceAllocator::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  Stats s = stats_;
  s.clear_inactive_split();
  for (const auto& [base, seg] : segments_) {
    if (seg->extent || seg->tier() != Tier::Device) continue;
    for (Block* b = seg->head; b; b = b->next) {
      if (b->allocated || b->event_count > 0 || (b->prev == nullptr && b->next == nullptr)) continue;
      s.add_inactive_split(seg->kind, b->size);
    }
  }
  return s;
}

void DeviceAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  stats_.reset_peaks();
}

void DeviceAllocator::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  stats_.reset_accumulated();
}

std::vector<SegmentSnapshot> DeviceAllocator::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<SegmentSnapshot> out;
  for (const auto& [base, seg] : segments_) {
    SegmentSnapshot s;
    s.id = seg->id;
    s.base = seg->base;
    s.size = seg->size;
    s.allocated = seg->allocated;
    s.device_bytes = seg->bytes_on(Tier::Device);
    s.host_bytes = seg->bytes_on(Tier::Host);
    s.tier = s.host_bytes && s.device_bytes ? "mixed" : (s.host_bytes ? "host" : "device");
    s.cls = class_name(seg->cls);
    s.backing = backing_name(seg->backing);
    s.kind = seg->extent ? "extent" : (seg->kind == PoolKind::Small ? "small" : "large");
    s.stream = reinterpret_cast<uint64_t>(seg->stream);
    s.pool = seg->pool;
    s.extent = seg->extent;
    for (Block* b = seg->head; b; b = b->next)
      s.blocks.push_back(BlockSnapshot{b->ptr, b->size, b->requested, b->allocated, b->event_count > 0});
    out.push_back(std::move(s));
  }
  return out;
}

PlacementStats DeviceAllocator::placement() const {
  std::lock_guard<std::mutex> lk(mu_);
  PlacementStats p;
  p.method = numa_ ? numa_->method() : "none (no NUMA ops: placement not verified)";
  for (const auto& [base, seg] : segments_)
    for (const Chunk& c : seg->chunks) {
      p.ok += c.placed_ok;
      p.wrong += c.placed_wrong;
      p.unknown += c.placed_unknown;
    }
  return p;
}

Tier DeviceAllocator::tier_of(const void* ptr) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto p = reinterpret_cast<CUdeviceptr>(ptr);
  Segment* seg = segment_of(p);
  if (!seg) throw Error(ErrorKind::InvalidArgument, "tier_of: address is not owned by cxlalloc");
  const Chunk* c = seg->chunk_at(p - seg->base);
  if (!c || !c->committed) throw Error(ErrorKind::InvalidArgument, "tier_of: address is in an uncommitted extent range");
  return c->tier;
}

void DeviceAllocator::check_invariants() const {
  std::lock_guard<std::mutex> lk(mu_);
  auto fail = [](const std::string& m) { throw Error(ErrorKind::Internal, "invariant violated: " + m); };
  int64_t reserved[2] = {0, 0}, allocated[2] = {0, 0}, cls_bytes[kNumClasses][2] = {};
  size_t kv_dev = 0, live_blocks = 0, free_blocks = 0, pending_blocks = 0;
  std::set<const Block*> pending_set;
  for (const Block* b : pending_frees_.blocks()) pending_set.insert(b);
  for (const auto& [base, seg] : segments_) {
    if (base != seg->base) fail("segment map key != base");
    for (const Chunk& c : seg->chunks) {
      if (!c.committed) continue;
      reserved[int(c.tier)] += static_cast<int64_t>(c.size);
      if (seg->cls == AllocClass::KV && c.tier == Tier::Device) kv_dev += c.size;
      if (seg->extent) {
        allocated[int(c.tier)] += static_cast<int64_t>(c.size);
        cls_bytes[int(seg->cls)][int(c.tier)] += static_cast<int64_t>(c.size);
      }
    }
    if (seg->extent) continue;
    if (seg->chunks.size() != 1) fail("block segment with several chunks");
    size_t covered = 0, seg_alloc = 0;
    CUdeviceptr expect = seg->base;
    const Block* prev = nullptr;
    for (const Block* b = seg->head; b; prev = b, b = b->next) {
      if (b->segment != seg.get()) fail("block points at the wrong segment");
      if (b->ptr != expect) fail("blocks do not tile their segment");
      if (b->prev != prev) fail("broken prev link");
      expect += b->size;
      covered += b->size;
      bool waiting = b->event_count > 0;
      if (b->allocated) {
        ++live_blocks;
        seg_alloc += b->size;
        allocated[int(seg->tier())] += static_cast<int64_t>(b->size);
        cls_bytes[int(seg->cls)][int(seg->tier())] += static_cast<int64_t>(b->size);
        auto it = allocated_.find(b->ptr);
        if (it == allocated_.end() || it->second != b) fail("live block missing from the allocated map");
      } else if (waiting) {
        ++pending_blocks;
        if (!pending_set.count(b)) fail("event-waiting block not pending");
      } else {
        ++free_blocks;
        if (!cache_.contains(b)) fail("free block not in its free list");
        auto free_now = [](const Block* n) { return n && !n->allocated && n->event_count == 0; };
        if (free_now(b->next)) fail("two adjacent free blocks not merged");
      }
    }
    if (covered != seg->size) fail("blocks do not cover their segment");
    if (seg_alloc != seg->allocated) fail("segment allocated bytes mismatch");
  }
  const size_t listed = cache_.listed();
  if (listed != free_blocks) fail("free lists hold blocks that are not free (" + std::to_string(listed) + " vs " + std::to_string(free_blocks) + ")");
  if (live_blocks != allocated_.size()) fail("allocated map size mismatch");
  for (int t = 0; t < 2; ++t) {
    if (reserved[t] != stats_.tier[t].reserved_bytes.current) fail(std::string("reserved bytes mismatch on ") + tier_name(Tier(t)));
    if (allocated[t] != stats_.tier[t].allocated_bytes.current) fail(std::string("allocated bytes mismatch on ") + tier_name(Tier(t)));
    for (int c = 0; c < kNumClasses; ++c)
      if (cls_bytes[c][t] != stats_.class_bytes[c][t].current) fail("class bytes mismatch");
  }
  if (kv_dev != stats_.kv_device_bytes) fail("KV device bytes mismatch");
  if (stats_.torch.allocated_bytes[kAggregate].current != allocated[0]) fail("torch allocated_bytes != device allocated");
  if (stats_.torch.reserved_bytes[kAggregate].current != reserved[0]) fail("torch reserved_bytes != device reserved");
}

}  // namespace cxl::alloc
