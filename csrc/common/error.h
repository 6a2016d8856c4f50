// Error types that cross the engine's C++ API.  Python sees them through the
// translator in csrc/python/errors.cpp; the C ABI (csrc/capi) catches them all
// and turns them into return codes plus a thread-local message, because torch's
// pluggable allocator calls us through plain C function pointers.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace cxl {

enum class ErrorKind {
  InvalidArgument,  // bad option or argument: message names it and the allowed values
  OutOfMemory,      // neither tier could serve the request
  InvalidFree,      // free of a pointer we do not own, or a double free
  Unavailable,      // CUDA (or a backend) cannot be used here; message says why
  Driver,           // a driver call failed unexpectedly
  Unsupported,      // the operation is not possible with this backend/config
  Capture,          // refused because a CUDA graph capture is in progress
  Internal,         // a broken invariant: a bug in cxlalloc
};

const char* error_kind_name(ErrorKind k);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

class DriverError : public Error {
 public:
  DriverError(const std::string& call, int code, const std::string& msg)
      : Error(ErrorKind::Driver, msg), call_(call), code_(code) {}
  const std::string& call() const { return call_; }
  int code() const { return code_; }

 private:
  std::string call_;
  int code_;
};

class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(size_t requested, const std::string& msg)
      : Error(ErrorKind::OutOfMemory, msg), requested_(requested) {}
  size_t requested() const { return requested_; }

 private:
  size_t requested_;
};

[[noreturn]] void throw_error(ErrorKind kind, const std::string& msg);

// True for our OutOfMemory and for a driver call that failed with
// CUDA_ERROR_OUT_OF_MEMORY: "that tier is fuller than the budget thought".
bool is_out_of_memory(const Error& e);

}  // namespace cxl

// Invariant check that stays on in release builds: a violated invariant in an
// allocator means corrupted memory later, so fail loudly now.
#define CXL_CHECK(cond, msg)                                                        \
  do {                                                                              \
    if (!(cond))                                                                    \
      ::cxl::throw_error(::cxl::ErrorKind::Internal,                                \
                         std::string("cxlalloc internal error: ") + (msg) + " [" + \
                             __FILE__ + ":" + std::to_string(__LINE__) + "]");     \
  } while (0)
