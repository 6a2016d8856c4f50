#include "common/error.h"

namespace cxl {

const char* error_kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::InvalidArgument: return "InvalidArgument";
    case ErrorKind::OutOfMemory: return "OutOfMemory";
    case ErrorKind::InvalidFree: return "InvalidFree";
    case ErrorKind::Unavailable: return "Unavailable";
    case ErrorKind::Driver: return "Driver";
    case ErrorKind::Unsupported: return "Unsupported";
    case ErrorKind::Capture: return "Capture";
    case ErrorKind::Internal: return "Internal";
  }
  return "Unknown";
}

bool is_out_of_memory(const Error& e) {
  if (e.kind() == ErrorKind::OutOfMemory) return true;
  auto* d = dynamic_cast<const DriverError*>(&e);
  return d && d->code() == 2;  // CUDA_ERROR_OUT_OF_MEMORY
}

void throw_error(ErrorKind kind, const std::string& msg) {
  if (kind == ErrorKind::OutOfMemory) throw OutOfMemoryError(0, msg);
  throw Error(kind, msg);
}

}  // namespace cxl
