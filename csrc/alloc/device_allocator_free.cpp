// DeviceAllocator: frees and stream-ordered reuse (record_stream uses,
// events, frees deferred during graph capture).
#include <cstdio>

#include "alloc/device_allocator.h"
#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::alloc {

namespace {
std::string hex(CUdeviceptr p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(p));
  return buf;
}
}  // namespace

std::string DeviceAllocator::diagnose_bad_free(CUdeviceptr p) const {
  Segment* seg = segment_of(p);
  if (!seg) return "cxlalloc: free of " + hex(p) + ", which was not allocated by cxlalloc on cuda:" + std::to_string(cfg_.device);
  if (seg->extent)
    return "cxlalloc: free of " + hex(p) + ", which belongs to a KV extent (release the extent instead)";
  for (Block* b = seg->head; b; b = b->next) {
    if (p >= b->ptr && p < b->ptr + b->size) {
      if (b->allocated)
        return "cxlalloc: free of " + hex(p) + ", an interior pointer of the live block at " + hex(b->ptr) + " (" +
               format_bytes(b->size) + ")";
      return "cxlalloc: double free of " + hex(p) + " (the block is already free)";
    }
  }
  return "cxlalloc: free of " + hex(p) + ", not the start of any block";
}

void DeviceAllocator::free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  retry_parked();
  free_locked(reinterpret_cast<CUdeviceptr>(ptr), false);
}

void DeviceAllocator::free_owned(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  free_locked(reinterpret_cast<CUdeviceptr>(ptr), true);
}

void DeviceAllocator::free_owned_or_park(void* ptr) noexcept {
  if (ptr == nullptr) return;
  try {
    std::lock_guard<std::mutex> lk(mu_);
    try {
      driver::ContextGuard guard(*drv_, ctx_.get());
      free_locked(reinterpret_cast<CUdeviceptr>(ptr), true);
      return;
    } catch (const std::exception& e) {
      // A deleter cannot report a failure to its caller (torch, the DLPack
      // consumer): keep the block allocated and owned, and free it at the
      // next engine call, when the driver may work again.  Nothing leaks and
      // nothing is freed twice: the block stays in allocated_ until then.
      if (parked_.insert(reinterpret_cast<CUdeviceptr>(ptr)).second)
        note_cleanup_failure(std::string("tensor free deferred (retried at the next allocator call): ") + e.what());
    }
  } catch (...) {
    note_cleanup_failure("tensor free: could not take the allocator's lock");
  }
}

void DeviceAllocator::free_or_park(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard guard(*drv_, ctx_.get());
  retry_parked();
  try {
    free_locked(reinterpret_cast<CUdeviceptr>(ptr), false);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::InvalidFree) throw;  // nothing was modified: the caller's mistake
    // torch's free callback returns void: a driver failure cannot reach the
    // program, and torch forgets the pointer.  Park it instead of leaking it.
    if (parked_.insert(reinterpret_cast<CUdeviceptr>(ptr)).second)
      note_cleanup_failure(std::string("free deferred (retried at the next allocator call): ") + e.what());
  }
}

void DeviceAllocator::retry_parked() {
  const std::vector<uint64_t> extents(parked_extents_.begin(), parked_extents_.end());
  for (uint64_t id : extents) extent_free_locked(id);  // never throws once the context is current
  // free_locked removes a freed pointer from parked_ itself: iterate a copy.
  const std::vector<CUdeviceptr> todo(parked_.begin(), parked_.end());
  for (CUdeviceptr p : todo) {
    try {
      free_locked(p, true);
    } catch (const std::exception&) {
      // The driver still fails: the block stays parked (nothing was changed).
    }
  }
}

size_t DeviceAllocator::parked_frees() const {
  std::lock_guard<std::mutex> lk(mu_);
  return parked_.size();
}

size_t DeviceAllocator::parked_extents() const {
  std::lock_guard<std::mutex> lk(mu_);
  return parked_extents_.size();
}

void DeviceAllocator::adopt(void* ptr) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = allocated_.find(reinterpret_cast<CUdeviceptr>(ptr));
  if (it == allocated_.end() || it->second->owned)
    throw Error(ErrorKind::InvalidArgument, "adopt: " + hex(reinterpret_cast<CUdeviceptr>(ptr)) +
                                                (it == allocated_.end() ? " is not a live cxlalloc allocation"
                                                                        : " is already owned by a tensor"));
  it->second->owned = true;
}

void DeviceAllocator::free_locked(CUdeviceptr p, bool by_owner) {
  auto it = allocated_.find(p);
  if (it == allocated_.end()) {
    // Detected before anything is touched: no corruption, just the error.
    stats_.on_invalid_free();
    throw Error(ErrorKind::InvalidFree, diagnose_bad_free(p));
  }
  if (it->second->owned && !by_owner) {
    stats_.on_invalid_free();
    throw Error(ErrorKind::InvalidFree, "cxlalloc: free of " + hex(p) +
                                            ", which a live tensor owns (it is freed when the tensor dies: drop "
                                            "the tensor instead)");
  }
  Block* b = it->second;
  Segment* seg = b->segment;
  // All or nothing: everything that can fail (the capture queries, the
  // events that order reuse after other streams) happens before the block
  // leaves allocated_, so a failure leaves it allocated and the error raised.
  bool any_capturing = false;
  std::vector<driver::Event> events;
  if (!b->stream_uses.empty()) {
    any_capturing = capturing(b->stream);
    for (CUstream s : b->stream_uses) any_capturing = any_capturing || capturing(s);
    if (!any_capturing) events = acquire_events(b->stream_uses.size());
  }
  b->owned = false;
  allocated_.erase(it);
  parked_.erase(p);
  stats_.on_block_freed(seg->tier(), seg->cls, seg->kind, b->size, b->requested);
  seg->allocated -= b->size;
  b->allocated = false;
  if (b->stream_uses.empty()) {
    // Reusable at once on its own stream: later work on that stream is
    // ordered after the work that used it (torch's semantics).
    cache_.give_back(b);
    return;
  }
  // Other streams used it: reusable only once their work has passed it.
  // The bytes stay "active" in torch's sense until the events complete.
  stats_.on_block_awaiting_events(seg->tier(), seg->kind, b->size);
  if (any_capturing) {
    // Recording an event on a capturing stream is illegal (C14): defer.
    b->event_count = 1;  // placeholder until flush_deferred records real events
    deferred_.push_back(b);
    return;
  }
  wait_for_uses(b, std::move(events));
}

void DeviceAllocator::record_stream(void* ptr, CUstream stream) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = allocated_.find(reinterpret_cast<CUdeviceptr>(ptr));
  if (it == allocated_.end())
    throw Error(ErrorKind::InvalidArgument,
                "record_stream: " + hex(reinterpret_cast<CUdeviceptr>(ptr)) + " is not a live cxlalloc allocation");
  if (stream != it->second->stream) it->second->stream_uses.insert(stream);
}

size_t DeviceAllocator::allocation_size(void* ptr) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = allocated_.find(reinterpret_cast<CUdeviceptr>(ptr));
  return it == allocated_.end() ? 0 : it->second->requested;
}

driver::Event DeviceAllocator::acquire_event() {
  if (!event_pool_.empty()) {
    driver::Event ev = std::move(event_pool_.back());
    event_pool_.pop_back();
    return ev;
  }
  return driver::Event(drv_);
}

std::vector<driver::Event> DeviceAllocator::acquire_events(size_t n) {
  std::vector<driver::Event> out;
  out.reserve(n);
  try {
    while (out.size() < n) out.push_back(acquire_event());
  } catch (...) {
    for (auto& ev : out) event_pool_.push_back(std::move(ev));  // nothing taken is lost
    throw;
  }
  return out;
}

void DeviceAllocator::wait_for_uses(Block* b, std::vector<driver::Event> events) {
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
      // every list.  Counted and reported once: a healthy driver never gets here.
      if (stats_.on_event_record_failure())
        log_warning("cuEventRecord on a stream that used a freed block failed (" + drv_->describe(r) +
                    "); waiting for that stream instead");
      event_pool_.push_back(std::move(ev));
      if (drv_->api().fn_cuStreamSynchronize(s) != CUDA_SUCCESS &&
          drv_->api().fn_cuCtxSynchronize() != CUDA_SUCCESS)
        note_cleanup_failure("free: neither the stream that used the block nor the context could be synchronized; "
                             "the context is unusable, so nothing can still touch the block");
      continue;
    }
    b->event_count++;
    pending_.push_back(PendingFree{std::move(ev), b});
  }
  for (; next < events.size(); ++next) event_pool_.push_back(std::move(events[next]));
  b->stream_uses.clear();
  if (b->event_count == 0) retire(b);
}

void DeviceAllocator::retire(Block* b) {
  stats_.on_block_events_done(b->segment->tier(), b->segment->kind, b->size);
  cache_.give_back(b);
}

void DeviceAllocator::flush_deferred() {
  std::vector<Block*> later;
  later.swap(deferred_);
  for (size_t i = 0; i < later.size(); ++i) {
    std::vector<driver::Event> events;
    try {
      events = acquire_events(later[i]->stream_uses.size());
    } catch (...) {
      // No event now: the blocks stay deferred (still counted as awaiting
      // events) and the next call tries again.
      deferred_.insert(deferred_.end(), later.begin() + i, later.end());
      return;
    }
    wait_for_uses(later[i], std::move(events));
  }
}

// Every pending event is checked, not just the queue's head: one slow stream
// must not hold back frees on all the others (case C06, pytorch#71616).
void DeviceAllocator::process_events(bool wait, int only_tier) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (only_tier >= 0 && int(it->block->segment->tier()) != only_tier) {
      ++it;
      continue;
    }
    CUresult r = wait ? drv_->api().fn_cuEventSynchronize(it->event.get()) : drv_->api().fn_cuEventQuery(it->event.get());
    if (r == CUDA_ERROR_NOT_READY) {
      ++it;
      continue;
    }
    drv_->check(r, wait ? "cuEventSynchronize" : "cuEventQuery");
    Block* b = it->block;
    event_pool_.push_back(std::move(it->event));
    it = pending_.erase(it);
    if (--b->event_count == 0) retire(b);
  }
}

}  // namespace cxl::alloc
