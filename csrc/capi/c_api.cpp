// The C ABI: thin, exception-free wrappers over the current Engine.
#include "capi/c_api.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

#include "alloc/class_scope.h"
#include "alloc/engine.h"
#include "common/error.h"
#include "common/log.h"

using cxl::AllocClass;
using cxl::Error;
using cxl::ErrorKind;
using cxl::alloc::Engine;

namespace {

thread_local std::string t_error;
thread_local int t_kind = CXLALLOC_OK;
thread_local std::string t_text;

int kind_code(ErrorKind k) {
  switch (k) {
    case ErrorKind::InvalidArgument: return CXLALLOC_E_INVALID_ARGUMENT;
    case ErrorKind::OutOfMemory: return CXLALLOC_E_OUT_OF_MEMORY;
    case ErrorKind::InvalidFree: return CXLALLOC_E_INVALID_FREE;
    case ErrorKind::Unavailable: return CXLALLOC_E_UNAVAILABLE;
    case ErrorKind::Driver: return CXLALLOC_E_DRIVER;
    case ErrorKind::Unsupported: return CXLALLOC_E_UNSUPPORTED;
    case ErrorKind::Capture: return CXLALLOC_E_CAPTURE;
    case ErrorKind::Internal: return CXLALLOC_E_INTERNAL;
  }
  return CXLALLOC_E_INTERNAL;
}

int set_error(int kind, const std::string& msg) {
  t_kind = kind;
  t_error = msg;
  return -kind;
}

// Run `f`, converting every exception into the thread's last error.
template <typename F>
int guarded(F&& f) {
  try {
    t_kind = CXLALLOC_OK;
    t_error.clear();
    f();
    return 0;
  } catch (const Error& e) {
    return set_error(kind_code(e.kind()), e.what());
  } catch (const std::bad_alloc&) {
    return set_error(CXLALLOC_E_OUT_OF_MEMORY, "cxlalloc: host memory exhausted (std::bad_alloc)");
  } catch (const std::exception& e) {
    return set_error(CXLALLOC_E_INTERNAL, e.what());
  } catch (...) {
    return set_error(CXLALLOC_E_INTERNAL, "cxlalloc: unknown exception");
  }
}

// Every entry point holds an Engine::Use for its duration (lock-free; it
// keeps the engine alive against a concurrent set_current).
Engine* engine(const Engine::Use& use) {
  if (!use.get()) throw Error(ErrorKind::Unavailable, "cxlalloc is not enabled in this process (call cxlalloc.enable())");
  return use.get();
}

void* do_malloc(size_t size, int device, void* stream, AllocClass cls, bool only_host = false) {
  void* out = nullptr;
  guarded([&] {
    Engine::Use use;
    out = engine(use)->device(device).malloc(size, static_cast<CUstream>(stream), cls, only_host);
  });
  return out;
}

void do_free(void* ptr, int device) {
  int r = guarded([&] {
    Engine::Use use;
    engine(use)->device(device).free_or_park(ptr);  // a driver failure parks the block, never leaks it
  });
  // torch's free callback returns void: an invalid free cannot be raised
  // through it, so it is reported (and counted in stats) instead.
  if (r != 0) cxl::log_warning(t_error);
}

}  // namespace

extern "C" {

int cxlalloc_api_version(void) { return CXLALLOC_C_API_VERSION; }
const char* cxlalloc_last_error(void) { return t_error.c_str(); }
int cxlalloc_last_error_kind(void) { return t_kind; }
int cxlalloc_is_enabled(void) { return Engine::current() ? 1 : 0; }

void* cxlalloc_malloc(size_t size, int device, void* stream) {
  return do_malloc(size, device, stream, cxl::alloc::current_class());
}
void cxlalloc_free(void* ptr, size_t, int device, void*) { do_free(ptr, device); }
void* cxlalloc_kv_malloc(size_t size, int device, void* stream) { return do_malloc(size, device, stream, AllocClass::KV); }
void cxlalloc_kv_free(void* ptr, size_t, int device, void*) { do_free(ptr, device); }
void* cxlalloc_weight_malloc(size_t size, int device, void* stream) {
  return do_malloc(size, device, stream, AllocClass::Weight);
}
void cxlalloc_weight_free(void* ptr, size_t, int device, void*) { do_free(ptr, device); }
void* cxlalloc_host_malloc(size_t size, int device, void* stream) {
  return do_malloc(size, device, stream, AllocClass::Other, true);
}
void cxlalloc_host_free(void* ptr, size_t, int device, void*) { do_free(ptr, device); }

int cxlalloc_record_stream(void* ptr, void* stream) {
  return guarded([&] {
    Engine::Use use;
    Engine* e = engine(use);
    for (int d = 0; d < e->device_count(); ++d) {
      auto* a = e->existing(d);
      if (a && a->allocation_size(ptr) > 0) {
        a->record_stream(ptr, static_cast<CUstream>(stream));
        return;
      }
    }
    throw Error(ErrorKind::InvalidArgument, "record_stream: pointer is not a live cxlalloc allocation");
  });
}

int cxlalloc_empty_cache(void) {
  return guarded([&] {
    Engine::Use use;
    Engine* e = engine(use);
    for (int d = 0; d < e->device_count(); ++d)
      if (auto* a = e->existing(d)) a->empty_cache();
  });
}

int cxlalloc_device_empty_cache(int device) {
  return guarded([&] {
    Engine::Use use;
    if (auto* a = engine(use)->existing(device)) a->empty_cache();
  });
}

size_t cxlalloc_allocation_size(void* ptr, int device) {
  size_t n = 0;
  guarded([&] {
    Engine::Use use;
    if (auto* a = engine(use)->existing(device)) n = a->allocation_size(ptr);
  });
  return n;
}

int cxlalloc_push_class(int cls) {
  return guarded([&] {
    if (cls < 0 || cls >= cxl::kNumClasses) throw Error(ErrorKind::InvalidArgument, "class must be 0 (other), 1 (kv) or 2 (weight)");
    cxl::alloc::push_class(static_cast<AllocClass>(cls));
  });
}

int cxlalloc_pop_class(void) {
  return guarded([&] {
    cxl::alloc::pop_class();
  });
}

int cxlalloc_tier_of(const void* ptr, int device) {
  int tier = -1;
  int r = guarded([&] {
    Engine::Use use;
    tier = static_cast<int>(engine(use)->device(device).tier_of(ptr));
  });
  return r != 0 ? r : tier;
}

int cxlalloc_create_pool(int device, uint64_t a, uint64_t b) {
  return guarded([&] {
    Engine::Use use;
    engine(use)->device(device).create_pool(cxl::PoolId{a, b});
  });
}

int cxlalloc_begin_allocate_to_pool(int device, uint64_t a, uint64_t b, cxlalloc_stream_filter_fn filter, void* ctx,
                                    void (*ctx_free)(void*)) {
  return guarded([&] {
    Engine::Use use;
    // The route owns ctx: freed with the last copy of the filter.
    std::shared_ptr<void> owner(ctx, [ctx_free](void* p) {
      if (ctx_free) ctx_free(p);
    });
    engine(use)->device(device).begin_allocate_to_pool(
        cxl::PoolId{a, b}, [filter, owner](CUstream s) { return filter(owner.get(), s) != 0;
  });
  });
}

int cxlalloc_end_allocate_to_pool(int device, uint64_t a, uint64_t b) {
  return guarded([&] {
    Engine::Use use;
    engine(use)->device(device).end_allocate_to_pool(cxl::PoolId{a, b});
  });
}

int cxlalloc_release_pool(int device, uint64_t a, uint64_t b) {
  return guarded([&] {
    Engine::Use use;
    engine(use)->device(device).release_pool(cxl::PoolId{a, b});
  });
}

int cxlalloc_pool_use_count(int device, uint64_t a, uint64_t b) {
  int n = 0;
  int r = guarded([&] {
    Engine::Use use;
    if (auto* d = engine(use)->existing(device)) n = std::max(0, d->pool_use_count(cxl::PoolId{a, b}));
  });
  return r != 0 ? r : n;
}

int cxlalloc_torch_stats(int device, cxlalloc_torch_stats_t* out) {
  return guarded([&] {
    Engine::Use use;
    std::memset(out, 0, sizeof *out);
    auto* a = engine(use)->existing(device);
    if (!a) return;  // never used: all zero
    auto s = a->stats().torch;
    auto copy = [](cxlalloc_stat_t* dst, const cxl::alloc::Stat* src) {
      for (int i = 0; i < 3; ++i) dst[i] = {src[i].current, src[i].peak, src[i].allocated, src[i].freed};
    };
    copy(out->allocation, s.allocation);
    copy(out->segment, s.segment);
    copy(out->active, s.active);
    copy(out->inactive_split, s.inactive_split);
    copy(out->allocated_bytes, s.allocated_bytes);
    copy(out->reserved_bytes, s.reserved_bytes);
    copy(out->active_bytes, s.active_bytes);
    copy(out->inactive_split_bytes, s.inactive_split_bytes);
    copy(out->requested_bytes, s.requested_bytes);
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
    out->num_sync_all_streams = s.num_sync_all_streams;
    out->num_device_alloc = s.num_device_alloc;
    out->num_device_free = s.num_device_free;
  });
}

int cxlalloc_reset_peak_stats(int device) {
  return guarded([&] {
    Engine::Use use;
    if (auto* a = engine(use)->existing(device)) a->reset_peak_stats();
  });
}

int cxlalloc_reset_accumulated_stats(int device) {
  return guarded([&] {
    Engine::Use use;
    if (auto* a = engine(use)->existing(device)) a->reset_accumulated_stats();
  });
}

size_t cxlalloc_device_limit(int device) {
  size_t n = 0;
  guarded([&] {
    Engine::Use use;
    n = engine(use)->device(device).config().device_limit;
  });
  return n;
}

int cxlalloc_enable_peer_access(int device, int peer) {
  return guarded([&] {
    Engine::Use use;
    Engine* e = engine(use);
    if (peer < 0 || peer >= e->device_count() || device < 0 || device >= e->device_count())
      throw Error(ErrorKind::InvalidArgument, "enable_peer_access: device " + std::to_string(device) + " / peer " +
                                                  std::to_string(peer) + " is not a visible GPU (0.." +
                                                  std::to_string(e->device_count() - 1) + ")");
    e->device(device).add_peer(peer);
  });
}

int cxlalloc_set_device_limit(int device, size_t bytes) {
  return guarded([&] {
    Engine::Use use;
    engine(use)->device(device).set_device_limit(bytes);
  });
}

const char* cxlalloc_describe_tiers(int device) {
  t_text.clear();
  guarded([&] {
    Engine::Use use;
    if (auto* a = engine(use)->existing(device)) t_text = a->describe_tiers();
  });
  return t_text.c_str();
}

int cxlalloc_snapshot(int device, cxlalloc_segment_fn fn, void* ctx) {
  return guarded([&] {
    Engine::Use use;
    auto* a = engine(use)->existing(device);
    if (!a) return;
    for (const auto& s : a->snapshot()) {
      cxlalloc_segment_info_t info{};
      info.base = s.base;
      info.size = s.size;
      info.allocated = s.allocated;
      info.tier = s.tier == "device" ? 0 : (s.tier == "host" ? 1 : 2);
      info.is_small = s.kind == "small";
      info.is_extent = s.extent;
      info.stream = s.stream;
      info.pool_a = s.pool.a;
      info.pool_b = s.pool.b;
      std::vector<cxlalloc_block_info_t> blocks;
      for (const auto& b : s.blocks) blocks.push_back({b.ptr, b.size, b.requested, b.allocated, b.pending_events});
      fn(ctx, &info, blocks.data(), blocks.size());
    }
  });
}

}  // extern "C"
