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

void DeviceAllocator::free(void* ptr) { free_block_of(ptr, false); }
void DeviceAllocator::free_owned(void* ptr) { free_block_of(ptr, true); }

void DeviceAllocator::adopt(void* ptr) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = allocated_.find(reinterpret_cast<CUdeviceptr>(ptr));
  if (it == allocated_.end() || it->second->owned)
    throw Error(ErrorKind::InvalidArgument, "adopt: " + hex(reinterpret_cast<CUdeviceptr>(ptr)) +
                                                (it == allocated_.end() ? " is not a live cxlalloc allocation"
                                                                        : " is already owned by a tensor"));
  it->second->owned = true;
}

void DeviceAllocator::free_block_of(void* ptr, bool by_owner) {
  if (ptr == nullptr) return;
  auto p = reinterpret_cast<CUdeviceptr>(ptr);
  std::lock_guard<std::mutex> lk(mu_);
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
  driver::ContextGuard guard(*drv_, ctx_.get());
  Block* b = it->second;
  b->owned = false;
  allocated_.erase(it);
  Segment* seg = b->segment;
  stats_.on_block_freed(seg->tier(), seg->cls, seg->kind, b->size, b->requested);
  seg->allocated -= b->size;
  b->allocated = false;
  if (b->stream_uses.empty()) {
    // Reusable at once on its own stream: later work on that stream is
    // ordered after the work that used it (torch's semantics).
    free_block(b);
    return;
  }
  // Other streams used it: reusable only once their work has passed it.
  // Recording an event on a capturing stream is illegal (C14): defer.
  bool any_capturing = capturing(b->stream);
  for (CUstream s : b->stream_uses) any_capturing = any_capturing || capturing(s);
  // The bytes stay "active" in torch's sense until the events complete.
  stats_.on_block_awaiting_events(seg->tier(), seg->kind, b->size);
  if (any_capturing) {
    b->event_count = 1;  // placeholder until flush_deferred records real events
    deferred_.push_back(b);
    return;
  }
  wait_for_uses(b);
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

void DeviceAllocator::wait_for_uses(Block* b) {
  b->event_count = 0;
  for (CUstream s : b->stream_uses) {
    driver::Event ev = acquire_event();
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
  b->stream_uses.clear();
  if (b->event_count == 0) retire(b);
}

void DeviceAllocator::retire(Block* b) {
  stats_.on_block_events_done(b->segment->tier(), b->segment->kind, b->size);
  free_block(b);
}

void DeviceAllocator::flush_deferred() {
  std::vector<Block*> later;
  later.swap(deferred_);
  for (Block* b : later) wait_for_uses(b);
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
