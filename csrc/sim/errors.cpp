// cuGetErrorName / cuGetErrorString and cxlsim_last_error.
//
// Names are the enumerator spellings of cuda.h; strings are the ones the real
// driver returns for them.  Unknown codes fail with CUDA_ERROR_INVALID_VALUE
// and a NULL string, as the driver documents.
#include "sim/errors.h"

#include "sim/faults.h"

namespace cxlsim {

namespace {

struct ErrorInfo {
  int code;
  const char* name;
  const char* text;
};

constexpr ErrorInfo kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {kErrContextIsDestroyed, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {kErrStreamCaptureImplicit, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ErrorInfo* find(int code) {
  for (const auto& e : kErrors)
    if (e.code == code) return &e;
  return nullptr;
}

thread_local std::string t_last_error;

}  // namespace

const char* error_name(int code) {
  const ErrorInfo* e = find(code);
  return e ? e->name : nullptr;
}

const char* error_string(int code) {
  const ErrorInfo* e = find(code);
  return e ? e->text : nullptr;
}

void set_last_error(std::string msg) { t_last_error = std::move(msg); }

// No cuInit needed: callers describe cuInit's own failure with these.
CUresult api_cuGetErrorName(CUresult error, const char** str) {
  return guarded(Fn::cuGetErrorName, [&] {
    if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *str = error_name(raw(error));
    return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  });
}

CUresult api_cuGetErrorString(CUresult error, const char** str) {
  return guarded(Fn::cuGetErrorString, [&] {
    if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *str = error_string(raw(error));
    return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  });
}

}  // namespace cxlsim

extern "C" CXLSIM_API const char* cxlsim_last_error(void) { return cxlsim::t_last_error.c_str(); }
