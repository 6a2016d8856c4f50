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
    if (!any_capturing) events = pending_frees_.acquire(b->stream_uses.size());
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
    pending_frees_.defer(b);
    return;
  }
  pending_frees_.wait_for_uses(b, std::move(events));
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

// PendingFrees' retire hook: a freed block whose uses are complete.
void DeviceAllocator::retire(Block* b) {
  stats_.on_block_events_done(b->segment->tier(), b->segment->kind, b->size);
  cache_.give_back(b);
}

}  // namespace cxl::alloc
