// Events: create, record (or capture), query, synchronize, destroy.
// An event is a position (stream, sequence number) in a stream's queue.
#include "sim/stream_executor_impl.h"

namespace cxlsim {

std::shared_ptr<Event> find_event_locked(StreamExecutor& e, CUevent h) {
  auto v = reinterpret_cast<uint64_t>(h);
  if ((v & ~kIdMask) != kEventTag) return nullptr;
  auto it = e.events.find(v & kIdMask);
  return it == e.events.end() ? nullptr : it->second;
}

CUresult event_create(int device, unsigned flags, CUevent* out) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  auto ev = std::make_shared<Event>();
  ev->id = e.next_id++;
  ev->device = device;
  ev->flags = flags;
  e.events.emplace(ev->id, ev);
  *out = event_handle(ev->id);
  return CUDA_SUCCESS;
}

CUresult event_destroy(CUevent h) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  e.events.erase(ev->id);  // pending waits hold the stream position, not the event
  return CUDA_SUCCESS;
}

CUresult event_record(CUevent h, const std::shared_ptr<Stream>& s) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  if (ev->device != s->device) return CUDA_ERROR_INVALID_HANDLE;  // event and stream of different contexts
  if (s->capture == Capture::Invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  if (s->capture == Capture::Active) {
    ++s->captured;
    ev->recorded = true;
    ev->stream.reset();
    ev->capture_origin = s->capture_origin;
    return CUDA_SUCCESS;
  }
  uint64_t seq;
  Op op;
  op.what = "cuEventRecord";
  CUresult r = submit_locked(e, s, op, {}, &seq);
  if (r != CUDA_SUCCESS) return r;
  ev->recorded = true;
  ev->stream = s;
  ev->seq = seq;
  ev->capture_origin = 0;
  return CUDA_SUCCESS;
}

namespace {
// What query and synchronize both check first: the handle, whether there is
// anything to wait for (*out stays null if not), and that the event was not
// recorded inside a capture.  Caller holds e.mu.
CUresult waitable_event_locked(StreamExecutor& e, CUevent h, std::shared_ptr<Event>* out) {
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  if (!ev->recorded) return CUDA_SUCCESS;
  if (ev->capture_origin != 0) {
    violation_locked(e, ev->capture_origin);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  *out = std::move(ev);
  return CUDA_SUCCESS;
}
}  // namespace

CUresult event_query(CUevent h) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  std::shared_ptr<Event> ev;
  CUresult r = waitable_event_locked(e, h, &ev);
  if (r != CUDA_SUCCESS || !ev) return r;
  if (e.sticky[ev->device] != CUDA_SUCCESS) return e.sticky[ev->device];
  return ev->stream->completed >= ev->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult event_synchronize(CUevent h) {
  StreamExecutor& e = executor();
  std::unique_lock<std::mutex> lk(e.mu);
  std::shared_ptr<Event> ev;
  CUresult r = waitable_event_locked(e, h, &ev);
  if (r != CUDA_SUCCESS || !ev) return r;
  auto s = ev->stream;
  uint64_t seq = ev->seq;
  e.cv.wait(lk, [&] { return e.shutdown || s->completed >= seq; });
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  return e.sticky[ev->device];
}

}  // namespace cxlsim
