// The engine's C ABI as the torch adapter sees it: a table of function
// pointers resolved from the cxlalloc/_C*.so that Python has already loaded.
//
// Why not link against _C or use its C++ types: _C is built with the system
// compiler and pybind11 against no torch at all, while this adapter is built
// at run time against whatever torch is installed (its own C++ ABI and
// standard library flags).  Only the plain-C boundary of csrc/capi/c_api.h is
// safe across that gap, and dlopen(RTLD_NOLOAD) guarantees we talk to the
// very engine instance Python configured, never a second copy.
#pragma once

#include <exception>
#include <string>

#include "../capi/c_api.h"

namespace cxlt {

struct CApi {
  decltype(&cxlalloc_api_version) api_version;
  decltype(&cxlalloc_last_error) last_error;
  decltype(&cxlalloc_last_error_kind) last_error_kind;
  decltype(&cxlalloc_is_enabled) is_enabled;
  decltype(&cxlalloc_malloc) malloc;
  decltype(&cxlalloc_free) free;
  decltype(&cxlalloc_record_stream) record_stream;
  decltype(&cxlalloc_empty_cache) empty_cache;
  decltype(&cxlalloc_device_empty_cache) device_empty_cache;
  decltype(&cxlalloc_enable_peer_access) enable_peer_access;
  decltype(&cxlalloc_create_pool) create_pool;
  decltype(&cxlalloc_begin_allocate_to_pool) begin_allocate_to_pool;
  decltype(&cxlalloc_end_allocate_to_pool) end_allocate_to_pool;
  decltype(&cxlalloc_release_pool) release_pool;
  decltype(&cxlalloc_pool_use_count) pool_use_count;
  decltype(&cxlalloc_torch_stats) torch_stats;
  decltype(&cxlalloc_reset_peak_stats) reset_peak_stats;
  decltype(&cxlalloc_reset_accumulated_stats) reset_accumulated_stats;
  decltype(&cxlalloc_device_limit) device_limit;
  decltype(&cxlalloc_set_device_limit) set_device_limit;
  decltype(&cxlalloc_describe_tiers) describe_tiers;
  decltype(&cxlalloc_snapshot) snapshot;

  // The thread's last engine error as an owned string (the C buffer is
  // overwritten by the next call on this thread).
  std::string error() const;
};

// Walk cxlalloc_snapshot(device) with a C++ callable.  The engine calls back
// through a plain C function pointer; an exception thrown by `fn` is caught
// here, before it could unwind through the engine's frames, and rethrown once
// cxlalloc_snapshot has returned.  Returns cxlalloc_snapshot's result.
template <typename Fn>
int for_each_segment(const CApi& c, int device, Fn&& fn) {
  struct Ctx {
    Fn* fn;
    std::exception_ptr error;
  } ctx{&fn, nullptr};
  auto tramp = [](void* p, const cxlalloc_segment_info_t* seg, const cxlalloc_block_info_t* blocks, size_t n) {
    auto* x = static_cast<Ctx*>(p);
    if (x->error) return;
    try {
      (*x->fn)(*seg, blocks, n);
    } catch (...) {
      x->error = std::current_exception();
    }
  };
  int r = c.snapshot(device, tramp, &ctx);
  if (ctx.error) std::rethrow_exception(ctx.error);
  return r;
}

// Resolve every entry point from the shared object at `path`, which must
// already be loaded in this process (it is: `import cxlalloc` loaded it).
// The handle is never closed, so the table stays valid for the process's
// life, including frees during interpreter shutdown (case C12).  Throws
// std::runtime_error naming the path or the missing symbol; requires
// CXLALLOC_C_API_VERSION >= 2.
const CApi& load_capi(const std::string& path);

// The table loaded by load_capi; nullptr before that.
const CApi* capi();

}  // namespace cxlt
