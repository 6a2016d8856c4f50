// Driver-wide state outside memory and streams: cuInit, devices and their
// attributes, primary contexts and the per-thread current context.
//
// Locking: `ctx` refcounts are guarded by one mutex (state.cpp); the current
// context is thread_local.  Contexts are slots of a static array, so a
// CUcontext stays a valid pointer for the life of the process and can be
// validated by address.
#pragma once

#include <cstdint>

#include "sim/api.h"

namespace cxlsim {

// CUDA_ERROR_NOT_INITIALIZED until cuInit succeeded (and always in a fork()
// child), CUDA_ERROR_DEINITIALIZED once the process is exiting.
CUresult check_init();
void set_initialized(bool v);

// Number of simulated GPUs and the validity of an ordinal.
int device_count();
bool valid_device(int dev);

// Device attribute `attr` of `dev` (defaults overridden by attr.N=V); 0 for
// attributes the simulator does not model.
int attribute(int dev, int attr);

// The device of the calling thread's current context.  Fails with
// check_init()'s error, or CUDA_ERROR_INVALID_CONTEXT when no context is
// current or the current one was released (primary refcount 0).
CUresult current_device(int* dev);

// Primary context handle of `dev` and the reverse (-1: not a context).
CUcontext context_of(int dev);
int device_of_context(CUcontext ctx);
bool context_active(int dev);

// Sum of primary-context retains not released.
uint64_t context_refs();
// Forget every retain (cxlsim_configure with nothing live).
void reset_contexts();

}  // namespace cxlsim
