// The simulator's internal view of the driver API: one `api_<name>` function
// per entry of CXL_DRIVER_FUNCTIONS (csrc/driver/driver.h), declared from that
// very list so the compiler rejects any prototype that drifts from what
// cxlalloc loads, and the linker rejects a missing one.
//
// Every sim .cpp includes this header first.
#pragma once

// Always compile against our own cuda_min.h, never the toolkit's cuda.h: cuda.h
// `#define`s base names to versioned ones (cuMemAlloc -> cuMemAlloc_v2,
// cuGetProcAddress -> cuGetProcAddress_v2), which would silently rename the
// functions defined here.  tests/engine/test_cuda_min.py checks that both
// headers agree on every value and layout, so the ABI is the same.
#ifdef CXL_HAVE_CUDA_H
#undef CXL_HAVE_CUDA_H
#endif
#include <cstring>

#include "driver/driver.h"
#include "sim/cxlsim.h"

namespace cxlsim {

// The integer a caller passed in an enum-typed parameter or field.  Callers
// may pass values no enumerator names (rejecting them is what
// CUDA_ERROR_INVALID_VALUE is for), and reading such an object as the enum
// type is undefined behaviour in C++, so every caller-supplied enum is read
// through its bytes and validated as an int.
template <typename E>
int raw(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "CUDA enums are int-sized");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

#define CXLSIM_DECLARE_API(name, ver, req, ret, params) ret api_##name params;
CXL_DRIVER_FUNCTIONS(CXLSIM_DECLARE_API)
#undef CXLSIM_DECLARE_API

// Not in driver.h's table (cxlalloc dlsyms them), but entry points all the same.
CUresult api_cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult* status);
CUresult api_cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags);

// Identifies an entry point for call counting and fault injection.  Both
// cuGetProcAddress forms share one base name, as cuGetProcAddress itself
// treats them.
enum class Fn : int {
#define CXLSIM_FN_ID(name, ...) name,
  CXL_DRIVER_FUNCTIONS(CXLSIM_FN_ID)
#undef CXLSIM_FN_ID
  cuGetProcAddress,
  kCount
};
constexpr int kFnCount = static_cast<int>(Fn::kCount);

// Base name of `fn` ("cuMemCreate").
const char* fn_name(Fn fn);
// The Fn whose base name is `name`, or -1.
int fn_lookup(const char* name);

}  // namespace cxlsim
