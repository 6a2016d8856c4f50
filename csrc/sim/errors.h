// Error reporting: CUresult names/strings (cuGetErrorName/cuGetErrorString)
// and the per-thread message behind cxlsim_last_error().
#pragma once

#include <string>

#include "sim/api.h"

namespace cxlsim {

// Codes the simulator returns that cuda_min.h does not name (values from
// CUDA 13.0's cuda.h).
constexpr CUresult kErrContextIsDestroyed = static_cast<CUresult>(709);
constexpr CUresult kErrStreamCaptureImplicit = static_cast<CUresult>(906);

// Name and description of the CUresult value `code`, or nullptr when the
// simulator does not know it (every value in cuda_min.h plus the two above).
const char* error_name(int code);
const char* error_string(int code);

// Set the calling thread's cxlsim_last_error() message.
void set_last_error(std::string msg);

}  // namespace cxlsim
