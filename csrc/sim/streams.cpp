// Stream, event and copy entry points, and the cxlsim_* stream controls.
// The execution model lives in stream_executor.cpp; this file validates
// arguments and contexts the way the driver does and turns calls into
// executor operations.
#include <string>

#include "sim/stream_executor.h"
#include "sim/errors.h"
#include "sim/faults.h"
#include "sim/memory.h"
#include "sim/state.h"

namespace cxlsim {

namespace {

// Current device, then the stream handle as that context sees it.
CUresult stream_arg(CUstream h, std::shared_ptr<Stream>* s, int* device) {
  CUresult r = current_device(device);
  if (r != CUDA_SUCCESS) return r;
  return find_stream(h, *device, s);
}

// Validate both sides of a copy as the copy engine of `device` sees them now.
CUresult check_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, int device) {
  std::vector<Span> spans;
  std::string why;
  CUresult r = resolve(src, n, false, Agent::Copy, device, &spans, &why);
  if (r == CUDA_SUCCESS) r = resolve(dst, n, true, Agent::Copy, device, &spans, &why);
  return r;
}

}  // namespace

CUresult api_cuStreamCreate(CUstream* stream, unsigned int flags) {
  return guarded(Fn::cuStreamCreate, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    if (stream == nullptr || (flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING)) != 0)
      return CUDA_ERROR_INVALID_VALUE;
    return stream_create(dev, flags, stream);
  });
}

CUresult api_cuStreamDestroy(CUstream stream) {
  return guarded(Fn::cuStreamDestroy, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    return stream_destroy(stream);  // the NULL/legacy stream cannot be destroyed: INVALID_HANDLE
  });
}

CUresult api_cuStreamSynchronize(CUstream stream) {
  return guarded(Fn::cuStreamSynchronize, [&] {
    std::shared_ptr<Stream> s;
    int dev;
    CUresult r = stream_arg(stream, &s, &dev);
    return r != CUDA_SUCCESS ? r : stream_synchronize(s);
  });
}

CUresult api_cuStreamQuery(CUstream stream) {
  return guarded(Fn::cuStreamQuery, [&] {
    std::shared_ptr<Stream> s;
    int dev;
    CUresult r = stream_arg(stream, &s, &dev);
    return r != CUDA_SUCCESS ? r : stream_query(s);
  });
}

CUresult api_cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  return guarded(Fn::cuStreamWaitEvent, [&] {
    std::shared_ptr<Stream> s;
    int dev;
    CUresult r = stream_arg(stream, &s, &dev);
    return r != CUDA_SUCCESS ? r : stream_wait_event(s, event, flags);
  });
}

CUresult api_cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  return guarded(Fn::cuStreamIsCapturing, [&] {
    std::shared_ptr<Stream> s;
    int dev;
    CUresult r = stream_arg(stream, &s, &dev);
    if (r != CUDA_SUCCESS) return r;
    if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
    return stream_is_capturing(s, status);
  });
}

CUresult api_cuEventCreate(CUevent* event, unsigned int flags) {
  return guarded(Fn::cuEventCreate, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    // DEFAULT 0, BLOCKING_SYNC 1, DISABLE_TIMING 2, INTERPROCESS 4 (which
    // requires DISABLE_TIMING).
    if (event == nullptr || (flags & ~0x7u) != 0 || ((flags & 0x4u) && !(flags & 0x2u)))
      return CUDA_ERROR_INVALID_VALUE;
    return event_create(dev, flags, event);
  });
}

CUresult api_cuEventRecord(CUevent event, CUstream stream) {
  return guarded(Fn::cuEventRecord, [&] {
    std::shared_ptr<Stream> s;
    int dev;
    CUresult r = stream_arg(stream, &s, &dev);
    return r != CUDA_SUCCESS ? r : event_record(event, s);
  });
}

CUresult api_cuEventQuery(CUevent event) {
  return guarded(Fn::cuEventQuery, [&] {
    int dev;
    CUresult r = current_device(&dev);
    return r != CUDA_SUCCESS ? r : event_query(event);
  });
}

CUresult api_cuEventSynchronize(CUevent event) {
  return guarded(Fn::cuEventSynchronize, [&] {
    int dev;
    CUresult r = current_device(&dev);
    return r != CUDA_SUCCESS ? r : event_synchronize(event);
  });
}

CUresult api_cuEventDestroy(CUevent event) {
  return guarded(Fn::cuEventDestroy, [&] {
    int dev;
    CUresult r = current_device(&dev);
    return r != CUDA_SUCCESS ? r : event_destroy(event);
  });
}

CUresult api_cuCtxSynchronize() {
  return guarded(Fn::cuCtxSynchronize, [&] {
    int dev;
    CUresult r = current_device(&dev);
    if (r != CUDA_SUCCESS) return r;
    r = check_capture_safe();
    return r != CUDA_SUCCESS ? r : device_synchronize(dev);
  });
}

// Synchronous: runs on the legacy stream (so it is ordered after prior
// legacy and blocking-stream work, as in CUDA) and waits for itself.
namespace {
Op copy_op(CUdeviceptr dst, CUdeviceptr src, size_t bytes, const char* what) {
  Op op;
  op.kind = OpKind::Copy;
  op.dst = dst;
  op.src = src;
  op.n = bytes;
  op.what = what;
  return op;
}
}  // namespace

CUresult api_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  return guarded(Fn::cuMemcpy, [&] {
    std::shared_ptr<Stream> s;
    int dev;
    CUresult r = stream_arg(nullptr, &s, &dev);
    if (r != CUDA_SUCCESS) return r;
    if (bytes == 0) return CUDA_SUCCESS;
    r = check_copy(dst, src, bytes, dev);
    if (r != CUDA_SUCCESS) return r;
    Op op = copy_op(dst, src, bytes, "cuMemcpy");
    op.result = std::make_shared<CUresult>(CUDA_SUCCESS);
    uint64_t seq;
    r = submit(s, op, &seq);
    if (r != CUDA_SUCCESS) return r;
    wait_for(s, seq);
    if (*op.result != CUDA_SUCCESS) return *op.result;
    return sticky_error(dev);
  });
}

CUresult api_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  return guarded(Fn::cuMemcpyAsync, [&] {
    std::shared_ptr<Stream> s;
    int dev;
    CUresult r = stream_arg(stream, &s, &dev);
    if (r != CUDA_SUCCESS) return r;
    if (bytes == 0) return CUDA_SUCCESS;
    // Checked now (a bad pointer is a synchronous error) and again when the
    // copy runs (memory unmapped meanwhile is an asynchronous fault).
    r = check_copy(dst, src, bytes, stream_device(*s));
    if (r != CUDA_SUCCESS) return r;
    Op op = copy_op(dst, src, bytes, "cuMemcpyAsync");
    uint64_t seq;
    return submit(s, op, &seq);
  });
}

}  // namespace cxlsim

using namespace cxlsim;

namespace {

// Controls take any stream handle; the NULL stream means the legacy stream
// of the current context's device (device 0 without a context).
int control_stream(const char* who, void* h, std::shared_ptr<Stream>* s) {
  int dev = 0;
  if (current_device(&dev) != CUDA_SUCCESS) dev = 0;
  if (!valid_device(dev) || find_stream(static_cast<CUstream>(h), dev, s) != CUDA_SUCCESS) {
    set_last_error(std::string(who) + ": " + hex(reinterpret_cast<uint64_t>(h)) + " is not a live stream");
    return -1;
  }
  return 0;
}

int control_submit(const char* who, const std::shared_ptr<Stream>& s, const Op& op) {
  uint64_t seq;
  CUresult r = submit(s, op, &seq);
  if (r != CUDA_SUCCESS) {
    set_last_error(std::string(who) + ": enqueue failed with " + (error_name(raw(r)) ? error_name(raw(r)) : "an error"));
    return -1;
  }
  return 0;
}

}  // namespace

extern "C" {

CXLSIM_API int cxlsim_stream_sleep(void* stream, uint64_t usec) {
  try {
    std::shared_ptr<Stream> s;
    if (control_stream("cxlsim_stream_sleep", stream, &s) != 0) return -1;
    Op op;
    op.kind = OpKind::Sleep;
    op.value = usec;
    op.what = "cxlsim_stream_sleep";
    return control_submit("cxlsim_stream_sleep", s, op);
  } catch (...) {
    set_last_error("cxlsim_stream_sleep: out of memory");
    return -1;
  }
}

CXLSIM_API int cxlsim_stream_write_u64(void* stream, void* ptr, uint64_t value) {
  try {
    if (ptr == nullptr) {
      set_last_error("cxlsim_stream_write_u64: ptr is NULL");
      return -1;
    }
    std::shared_ptr<Stream> s;
    if (control_stream("cxlsim_stream_write_u64", stream, &s) != 0) return -1;
    Op op;
    op.kind = OpKind::WriteU64;
    op.dst = reinterpret_cast<uint64_t>(ptr);
    op.value = value;
    op.what = "cxlsim_stream_write_u64";
    return control_submit("cxlsim_stream_write_u64", s, op);
  } catch (...) {
    set_last_error("cxlsim_stream_write_u64: out of memory");
    return -1;
  }
}

CXLSIM_API int cxlsim_begin_capture(void* stream) {
  try {
    return capture_begin(static_cast<CUstream>(stream));
  } catch (...) {
    return -1;
  }
}

CXLSIM_API int cxlsim_end_capture(void* stream) {
  try {
    return capture_end(static_cast<CUstream>(stream));
  } catch (...) {
    return -1;
  }
}

CXLSIM_API uint64_t cxlsim_capture_violations(void) { return capture_violations(); }

CXLSIM_API uint64_t cxlsim_async_faults(void) { return async_fault_count(); }

CXLSIM_API const char* cxlsim_last_async_fault(void) {
  thread_local std::string out;
  try {
    out = last_async_fault();
  } catch (...) {
    out.clear();
  }
  return out.c_str();
}

}  // extern "C"
