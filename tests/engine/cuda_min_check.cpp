// Compile-time check that csrc/driver/cuda_min.h (the stand-in used when a
// build finds no cuda.h) agrees with the CUDA toolkit's cuda.h: every enum
// value, every type's size and alignment, the layout of the structs the
// engine fills, and the signature of every driver entry point cxlalloc loads
// (driver.h's CXL_DRIVER_FUNCTIONS against cudaTypedefs.h's PFN_<name>_v<ver>,
// the exact ABI version it asks cuGetProcAddress for).
//
// Built by tests/engine/test_cuda_min.py, which generates
// cuda_min_generated.inc (one static_assert per enumerator, macro and type of
// cuda_min.h) from the header's own text, so a new declaration is checked
// without editing this file.  Compiling is the test: it has no main().
#include <cstddef>
#include <cstdint>
#include <type_traits>

// cuda_min.h in a namespace of its own, so that both headers' declarations
// of the same names can be compared in one translation unit.
namespace mini {
#include "driver/cuda_min.h"
}

#include <cuda.h>
#include <cudaTypedefs.h>

#define CXL_HAVE_CUDA_H 1
#include "driver/driver.h"

#include "cuda_min_generated.inc"

#define SAME_OFFSET(type, field) \
  static_assert(offsetof(mini::type, field) == offsetof(::type, field), #type "." #field " offset")
SAME_OFFSET(CUmemLocation, type);
SAME_OFFSET(CUmemLocation, id);
SAME_OFFSET(CUmemAllocationProp, type);
SAME_OFFSET(CUmemAllocationProp, requestedHandleTypes);
SAME_OFFSET(CUmemAllocationProp, location);
SAME_OFFSET(CUmemAllocationProp, win32HandleMetaData);
SAME_OFFSET(CUmemAllocationProp, allocFlags);
SAME_OFFSET(CUmemAllocationProp, allocFlags.compressionType);
SAME_OFFSET(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
SAME_OFFSET(CUmemAllocationProp, allocFlags.usage);
SAME_OFFSET(CUmemAccessDesc, location);
SAME_OFFSET(CUmemAccessDesc, flags);

// The function table, as the build compiles it against cuda.h, has exactly
// the pointer type of the ABI version each entry is loaded at.
#define SAME_SIGNATURE(name, ver, req, ret, params)                                         \
  static_assert(std::is_same_v<decltype(cxl::driver::Api::fn_##name), PFN_##name##_v##ver>, \
                #name " signature differs from PFN_" #name "_v" #ver);
CXL_DRIVER_FUNCTIONS(SAME_SIGNATURE)
