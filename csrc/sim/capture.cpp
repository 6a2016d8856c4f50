// Stream capture (global mode): begin/end, the rules that make calls illegal
// while a capture is active, and the violation count (see cxlsim.h).
#include "sim/stream_executor_impl.h"
#include "sim/errors.h"
#include "sim/memory.h"

namespace cxlsim {

// An illegal call during capture: count it and invalidate that capture
// (origin 0: every active capture, for the global-mode unsafe calls).
void violation_locked(StreamExecutor& e, uint64_t origin) {
  ++e.violations;
  for (auto& [id, s] : e.streams)
    if (s->capture != Capture::None && (origin == 0 || s->capture_origin == origin))
      s->capture = Capture::Invalidated;
}

// Capture rules shared by synchronize and query of a stream.
CUresult capture_check_locked(StreamExecutor& e, const std::shared_ptr<Stream>& s) {
  if (s->capture != Capture::None) {
    violation_locked(e, s->capture_origin);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  if (s->legacy && blocking_capture_locked(e, s->device)) {
    ++e.violations;
    return kErrStreamCaptureImplicit;
  }
  return CUDA_SUCCESS;
}

void end_capture_locked(StreamExecutor& e, uint64_t origin) {
  for (auto& [id, s] : e.streams)
    if (s->capture_origin == origin) {
      s->capture = Capture::None;
      s->capture_origin = 0;
    }
  // Events recorded inside the capture named graph nodes, not stream work;
  // outside it they read as never recorded.
  for (auto& [id, ev] : e.events)
    if (ev->capture_origin == origin) {
      ev->capture_origin = 0;
      ev->recorded = false;
      ev->stream.reset();
    }
}

CUresult stream_is_capturing(const std::shared_ptr<Stream>& s, CUstreamCaptureStatus* status) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  if (s->legacy) {
    if (blocking_capture_locked(e, s->device)) {
      ++e.violations;  // cuda.h: IMPLICIT, and the capture is not invalidated
      return kErrStreamCaptureImplicit;
    }
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
  }
  *status = s->capture == Capture::Active        ? CU_STREAM_CAPTURE_STATUS_ACTIVE
            : s->capture == Capture::Invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                                 : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

CUresult check_capture_safe() {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  for (const auto& [id, s] : e.streams)
    if (s->capture != Capture::None) {
      violation_locked(e, 0);
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
  return CUDA_SUCCESS;
}

int capture_begin(CUstream h) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  auto v = reinterpret_cast<uint64_t>(h);
  auto it = (v & ~kIdMask) == kStreamTag ? e.streams.find(v & kIdMask) : e.streams.end();
  if (it == e.streams.end()) {
    set_last_error("cxlsim_begin_capture: " + hex(v) +
                   " is not a live cuStreamCreate stream (the legacy/NULL stream cannot be captured)");
    return -1;
  }
  auto& s = it->second;
  if (s->capture != Capture::None) {
    set_last_error("cxlsim_begin_capture: stream " + hex(v) + " is already capturing");
    return -1;
  }
  s->capture = Capture::Active;
  s->capture_origin = s->id;
  return 0;
}

int capture_end(CUstream h) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  auto v = reinterpret_cast<uint64_t>(h);
  auto it = (v & ~kIdMask) == kStreamTag ? e.streams.find(v & kIdMask) : e.streams.end();
  if (it == e.streams.end() || it->second->capture == Capture::None || it->second->capture_origin != it->second->id) {
    set_last_error("cxlsim_end_capture: " + hex(v) + " is not a stream that began a capture");
    return -1;
  }
  end_capture_locked(e, it->second->id);
  return 0;
}

uint64_t capture_violations() {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.violations;
}

}  // namespace cxlsim
