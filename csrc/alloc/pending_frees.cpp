// Pending frees: stream-ordered reuse of freed blocks (pending_frees.h).
#include "alloc/pending_frees.h"

#include "alloc/segment.h"
#include "common/log.h"

namespace cxl::alloc {

PendingFrees::PendingFrees(driver::DriverPtr drv, RetireFn retire, RecordFailedFn record_failed)
    : drv_(std::move(drv)), retire_(std::move(retire)), record_failed_(std::move(record_failed)) {}

driver::Event PendingFrees::acquire_one() {
  if (!event_pool_.empty()) {
    driver::Event ev = std::move(event_pool_.back());
    event_pool_.pop_back();
    return ev;
  }
  return driver::Event(drv_);
}

std::vector<driver::Event> PendingFrees::acquire(size_t n) {
  std::vector<driver::Event> out;
  out.reserve(n);
  try {
    while (out.size() < n) out.push_back(acquire_one());
  } catch (...) {
    for (auto& ev : out) event_pool_.push_back(std::move(ev));  // nothing taken is lost
    throw;
  }
  return out;
}

void PendingFrees::wait_for_uses(Block* b, std::vector<driver::Event> events) {
  b->event_count = 0;
  size_t next = 0;
  for (CUstream s : b->stream_uses) {
    driver::Event ev = std::move(events[next++]);
    CUresult r = drv_->api().fn_cuEventRecord(ev.get(), s);
    if (r != CUDA_SUCCESS) {
      // Reuse cannot be ordered after that stream's work: wait for it now
      // instead (slow but safe).  A stream that is no longer valid (destroyed
      // after record_stream) may still have work queued: wait for the whole
      // context then.  The free itself never fails half-way: the block's
      // state was already changed, and a throw here would strand it outside
      // every list.
      record_failed_(r);
      event_pool_.push_back(std::move(ev));
      if (drv_->api().fn_cuStreamSynchronize(s) != CUDA_SUCCESS && drv_->api().fn_cuCtxSynchronize() != CUDA_SUCCESS)
        note_cleanup_failure(
            "free: neither the stream that used the block nor the context could be synchronized; "
            "the context is unusable, so nothing can still touch the block");
      continue;
    }
    b->event_count++;
    pending_.push_back(Pending{std::move(ev), b});
  }
  for (; next < events.size(); ++next) event_pool_.push_back(std::move(events[next]));
  b->stream_uses.clear();
  if (b->event_count == 0) retire_(b);
}

void PendingFrees::defer(Block* b) {
  b->event_count = 1;  // placeholder until flush_deferred records real events
  deferred_.push_back(b);
}

void PendingFrees::flush_deferred() {
  std::vector<Block*> later;
  later.swap(deferred_);
  for (size_t i = 0; i < later.size(); ++i) {
    std::vector<driver::Event> events;
    try {
      events = acquire(later[i]->stream_uses.size());
    } catch (...) {
      // No event now: the blocks stay deferred (still counted as awaiting
      // events) and the next call tries again.
      deferred_.insert(deferred_.end(), later.begin() + i, later.end());
      return;
    }
    wait_for_uses(later[i], std::move(events));
  }
}

void PendingFrees::collect(bool wait, int only_tier) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (only_tier >= 0 && int(it->block->segment->tier()) != only_tier) {
      ++it;
      continue;
    }
    CUresult r =
        wait ? drv_->api().fn_cuEventSynchronize(it->event.get()) : drv_->api().fn_cuEventQuery(it->event.get());
    if (r == CUDA_ERROR_NOT_READY) {
      ++it;
      continue;
    }
    drv_->check(r, wait ? "cuEventSynchronize" : "cuEventQuery");
    Block* b = it->block;
    event_pool_.push_back(std::move(it->event));
    it = pending_.erase(it);
    if (--b->event_count == 0) retire_(b);
  }
}

bool PendingFrees::waiting_on(Tier t) const {
  for (const auto& p : pending_)
    if (p.block->segment->tier() == t) return true;
  return false;
}

std::vector<const Block*> PendingFrees::blocks() const {
  std::vector<const Block*> out;
  for (const auto& p : pending_) out.push_back(p.block);
  out.insert(out.end(), deferred_.begin(), deferred_.end());
  return out;
}

void PendingFrees::clear() {
  pending_.clear();
  event_pool_.clear();
}

}  // namespace cxl::alloc
