#include "alloc/stats.h"

namespace cxl::alloc {

namespace {
// torch counts device-tier stats twice: in the aggregate and in the pool
// (small or large) of the segment.
int pool_index(PoolKind k) { return k == PoolKind::Small ? kSmall : kLarge; }
}  // namespace

void Stats::add_block(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested) {
  auto n = static_cast<int64_t>(size);
  tier[int(t)].allocated_bytes.increase(n);
  class_bytes[int(cls)][int(t)].increase(n);
  if (t == Tier::Device) {
    for (int i : {int(kAggregate), pool_index(kind)}) {
      torch.allocation[i].increase(1);
      torch.allocated_bytes[i].increase(n);
      torch.active[i].increase(1);
      torch.active_bytes[i].increase(n);
      torch.requested_bytes[i].increase(static_cast<int64_t>(requested));
    }
  }
}

void Stats::remove_block(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested) {
  auto n = static_cast<int64_t>(size);
  tier[int(t)].allocated_bytes.decrease(n);
  class_bytes[int(cls)][int(t)].decrease(n);
  if (t == Tier::Device) {
    for (int i : {int(kAggregate), pool_index(kind)}) {
      torch.allocation[i].decrease(1);
      torch.allocated_bytes[i].decrease(n);
      torch.active[i].decrease(1);
      torch.active_bytes[i].decrease(n);
      torch.requested_bytes[i].decrease(static_cast<int64_t>(requested));
    }
  }
}

void Stats::add_segment(Tier t, AllocClass cls, PoolKind kind, size_t bytes) {
  auto n = static_cast<int64_t>(bytes);
  tier[int(t)].reserved_bytes.increase(n);
  tier[int(t)].segments.increase(1);
  if (cls == AllocClass::KV && t == Tier::Device) kv_device_bytes += bytes;
  if (t == Tier::Device) {
    for (int i : {int(kAggregate), pool_index(kind)}) {
      torch.reserved_bytes[i].increase(n);
      torch.segment[i].increase(1);
    }
    torch.num_device_alloc++;
  }
}

void Stats::remove_segment(Tier t, AllocClass cls, PoolKind kind, size_t bytes) {
  auto n = static_cast<int64_t>(bytes);
  tier[int(t)].reserved_bytes.decrease(n);
  tier[int(t)].segments.decrease(1);
  if (cls == AllocClass::KV && t == Tier::Device) kv_device_bytes -= bytes;
  if (t == Tier::Device) {
    for (int i : {int(kAggregate), pool_index(kind)}) {
      torch.reserved_bytes[i].decrease(n);
      torch.segment[i].decrease(1);
    }
    torch.num_device_free++;
  }
}

// Extent chunks count in torch's large pool (an extent segment's kind is Large).
void Stats::add_chunk(Tier t, AllocClass cls, size_t bytes) {
  auto n = static_cast<int64_t>(bytes);
  tier[int(t)].reserved_bytes.increase(n);
  tier[int(t)].allocated_bytes.increase(n);
  class_bytes[int(cls)][int(t)].increase(n);
  if (cls == AllocClass::KV && t == Tier::Device) kv_device_bytes += bytes;
  if (t == Tier::Device) {
    for (int i : {int(kAggregate), int(kLarge)}) {
      torch.reserved_bytes[i].increase(n);
      torch.allocated_bytes[i].increase(n);
      torch.active_bytes[i].increase(n);
    }
  }
}

void Stats::remove_chunk(Tier t, AllocClass cls, size_t bytes) {
  auto n = static_cast<int64_t>(bytes);
  tier[int(t)].reserved_bytes.decrease(n);
  tier[int(t)].allocated_bytes.decrease(n);
  class_bytes[int(cls)][int(t)].decrease(n);
  if (cls == AllocClass::KV && t == Tier::Device) kv_device_bytes -= bytes;
  if (t == Tier::Device) {
    for (int i : {int(kAggregate), int(kLarge)}) {
      torch.reserved_bytes[i].decrease(n);
      torch.allocated_bytes[i].decrease(n);
      torch.active_bytes[i].decrease(n);
    }
  }
}

void Stats::on_block_allocated(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested) {
  add_block(t, cls, kind, size, requested);
  counters.allocations++;
}

void Stats::on_block_freed(Tier t, AllocClass cls, PoolKind kind, size_t size, size_t requested) {
  remove_block(t, cls, kind, size, requested);
  counters.frees++;
}

void Stats::on_block_awaiting_events(Tier t, PoolKind kind, size_t size) {
  if (t != Tier::Device) return;
  for (int i : {int(kAggregate), pool_index(kind)}) torch.active_bytes[i].increase(static_cast<int64_t>(size));
}

void Stats::on_block_events_done(Tier t, PoolKind kind, size_t size) {
  if (t != Tier::Device) return;
  for (int i : {int(kAggregate), pool_index(kind)}) torch.active_bytes[i].decrease(static_cast<int64_t>(size));
}

void Stats::on_segment_created(Tier t, AllocClass cls, PoolKind kind, size_t bytes) {
  add_segment(t, cls, kind, bytes);
  counters.new_segments[int(t)]++;
}

void Stats::on_segment_released(Tier t, AllocClass cls, PoolKind kind, size_t bytes) {
  remove_segment(t, cls, kind, bytes);
  counters.released_segments[int(t)]++;
}

void Stats::on_chunk_committed(Tier t, AllocClass cls, size_t bytes) {
  add_chunk(t, cls, bytes);
  if (t == Tier::Host) counters.spilled_bytes += bytes;
}

void Stats::on_fixed_extent_created(Tier t, AllocClass cls, size_t bytes) {
  on_chunk_committed(t, cls, bytes);
  counters.new_segments[int(t)]++;
}

void Stats::on_fixed_extent_released(Tier t) { counters.released_segments[int(t)]++; }

void Stats::on_spilled_block(size_t size) {
  counters.spilled_bytes += size;
  counters.spilled_allocations++;
}

void Stats::on_event_drain() {
  counters.event_drains++;
  torch.num_alloc_retries++;
}

void Stats::on_reclaimed(size_t bytes) {
  counters.reclaimed_bytes += bytes;
  torch.num_alloc_retries++;
}

void Stats::on_demoted_for_room() { torch.num_alloc_retries++; }

void Stats::on_oom() {
  counters.ooms++;
  torch.num_ooms++;
}

void Stats::on_moved_unit(Tier target) {
  if (target == Tier::Host)
    counters.demotions++;
  else
    counters.promotions++;
}

void Stats::on_moved_bytes(Tier target, size_t bytes) {
  if (target == Tier::Host)
    counters.demoted_bytes += bytes;
  else
    counters.promoted_bytes += bytes;
}

void Stats::clear_inactive_split() {
  for (int i = 0; i < 3; ++i) torch.inactive_split[i] = Stat{}, torch.inactive_split_bytes[i] = Stat{};
}

void Stats::add_inactive_split(PoolKind kind, size_t size) {
  for (int i : {int(kAggregate), pool_index(kind)}) {
    torch.inactive_split[i].increase(1);
    torch.inactive_split_bytes[i].increase(static_cast<int64_t>(size));
  }
}

void Stats::reset_peaks() {
  for (auto& t : tier) {
    t.allocated_bytes.reset_peak();
    t.reserved_bytes.reset_peak();
    t.segments.reset_peak();
  }
  for (auto& c : class_bytes)
    for (auto& t : c) t.reset_peak();
  auto& T = torch;
  for (int i = 0; i < 3; ++i)
    for (Stat* st : {&T.allocation[i], &T.segment[i], &T.active[i], &T.inactive_split[i], &T.allocated_bytes[i],
                     &T.reserved_bytes[i], &T.active_bytes[i], &T.inactive_split_bytes[i], &T.requested_bytes[i]})
      st->reset_peak();
}

void Stats::reset_accumulated() {
  for (auto& t : tier) {
    t.allocated_bytes.reset_accumulated();
    t.reserved_bytes.reset_accumulated();
    t.segments.reset_accumulated();
  }
  for (auto& c : class_bytes)
    for (auto& t : c) t.reset_accumulated();
  auto& T = torch;
  for (int i = 0; i < 3; ++i)
    for (Stat* st : {&T.allocation[i], &T.segment[i], &T.active[i], &T.inactive_split[i], &T.allocated_bytes[i],
                     &T.reserved_bytes[i], &T.active_bytes[i], &T.inactive_split_bytes[i], &T.requested_bytes[i]})
      st->reset_accumulated();
  T.num_alloc_retries = T.num_ooms = T.num_sync_all_streams = T.num_device_alloc = T.num_device_free = 0;
  counters = Counters{};
}

}  // namespace cxl::alloc
