// Call counters and fault injection for every driver entry point.
//
// Each entry point runs its body through guarded(), which first counts the
// call and then fires an armed fault (cxlsim_fail) before the body can touch
// any state, so an injected failure has no side effects.  guarded() is also
// the one place where C++ exceptions are turned into a CUresult: nothing
// escapes the C ABI.
#pragma once

#include <new>

#include "sim/api.h"

namespace cxlsim {

// Count a call of `fn` and check the armed faults.  Returns CUDA_SUCCESS to
// let the call proceed, or the injected error.  Thread-safe; lock-free while
// no fault is armed.
CUresult enter(Fn fn) noexcept;

template <typename F>
CUresult guarded(Fn fn, F&& body) noexcept {
  CUresult r = enter(fn);
  if (r != CUDA_SUCCESS) return r;
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  } catch (...) {
    return CUDA_ERROR_UNKNOWN;
  }
}

}  // namespace cxlsim
