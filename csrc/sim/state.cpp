// cuInit state, primary contexts, and the whole-machine controls
// (cxlsim_configure, cxlsim_live).
#include "sim/state.h"

#include <atomic>
#include <mutex>
#include <string>

#include "sim/config.h"
#include "sim/stream_executor.h"
#include "sim/errors.h"
#include "sim/faults.h"
#include "sim/memory.h"
#include "sim/numa.h"

namespace cxlsim {

namespace {

// A context handle is the address of its device's slot: stable for the
// process lifetime and checkable by range, with nothing to allocate or free.
struct ContextSlot {
  int unused;
};
ContextSlot g_slots[kMaxDevices] = {};

std::atomic<bool> g_initialized{false};
std::mutex g_ctx_mu;
int g_refs[kMaxDevices] = {};
thread_local CUcontext t_current = nullptr;

}  // namespace

CUresult check_init() {
  if (executor_shut_down()) return executor_forked() ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_DEINITIALIZED;
  return g_initialized.load(std::memory_order_acquire) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

void set_initialized(bool v) { g_initialized.store(v, std::memory_order_release); }

int device_count() { return config()->devices; }

bool valid_device(int dev) { return dev >= 0 && dev < device_count(); }

CUcontext context_of(int dev) { return reinterpret_cast<CUcontext>(&g_slots[dev]); }

int device_of_context(CUcontext ctx) {
  auto p = reinterpret_cast<uintptr_t>(ctx);
  auto base = reinterpret_cast<uintptr_t>(&g_slots[0]);
  if (p < base || p >= base + sizeof g_slots || (p - base) % sizeof(ContextSlot) != 0) return -1;
  int dev = static_cast<int>((p - base) / sizeof(ContextSlot));
  return valid_device(dev) ? dev : -1;
}

bool context_active(int dev) {
  std::lock_guard<std::mutex> lk(g_ctx_mu);
  return valid_device(dev) && g_refs[dev] > 0;
}

CUresult current_device(int* dev) {
  CUresult r = check_init();
  if (r != CUDA_SUCCESS) return r;
  int d = device_of_context(t_current);
  if (d < 0 || !context_active(d)) return CUDA_ERROR_INVALID_CONTEXT;
  *dev = d;
  return CUDA_SUCCESS;
}

uint64_t context_refs() {
  std::lock_guard<std::mutex> lk(g_ctx_mu);
  uint64_t n = 0;
  for (int r : g_refs) n += static_cast<uint64_t>(r);
  return n;
}

void reset_contexts() {
  std::lock_guard<std::mutex> lk(g_ctx_mu);
  for (int& r : g_refs) r = 0;
}

// ---------------------------------------------------------------- contexts API

CUresult api_cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  return guarded(Fn::cuDevicePrimaryCtxRetain, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> lk(g_ctx_mu);
    ++g_refs[dev];
    *pctx = context_of(dev);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuDevicePrimaryCtxRelease(CUdevice dev) {
  return guarded(Fn::cuDevicePrimaryCtxRelease, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    bool destroyed = false;
    {
      std::lock_guard<std::mutex> lk(g_ctx_mu);
      if (g_refs[dev] == 0) return CUDA_ERROR_INVALID_CONTEXT;  // cuda.h: never retained
      destroyed = --g_refs[dev] == 0;
    }
    // The last release resets the context, which clears a sticky error.
    // Allocations, streams and events of the context are NOT freed by the
    // simulator (the real driver frees them): they stay in cxlsim_live so
    // a test sees the leak.
    if (destroyed) context_destroyed(dev);
    return CUDA_SUCCESS;
  });
}

CUresult api_cuCtxGetCurrent(CUcontext* pctx) {
  return guarded(Fn::cuCtxGetCurrent, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_current;
    return CUDA_SUCCESS;
  });
}

CUresult api_cuCtxSetCurrent(CUcontext ctx) {
  return guarded(Fn::cuCtxSetCurrent, [&] {
    CUresult r = check_init();
    if (r != CUDA_SUCCESS) return r;
    if (ctx != nullptr) {
      int dev = device_of_context(ctx);
      // Binding a released primary context is binding a destroyed context.
      if (dev < 0 || !context_active(dev)) return CUDA_ERROR_INVALID_CONTEXT;
    }
    t_current = ctx;
    return CUDA_SUCCESS;
  });
}

}  // namespace cxlsim

using namespace cxlsim;

extern "C" {

CXLSIM_API int cxlsim_configure(const char* spec) {
  try {
    Config c;
    std::string err;
    if (!parse_config(spec, &c, &err)) {
      set_last_error(err);
      return -1;
    }
    // Asking for the machine as it is changes nothing, so it is allowed
    // while resources are live (a second component may re-apply the spec
    // the first one set).
    if (c == *config()) return 0;
    cxlsim_live_t live{};
    cxlsim_live(&live);
    std::string busy;
    auto note = [&](uint64_t n, const char* what) {
      if (n) busy += (busy.empty() ? "" : ", ") + std::to_string(n) + " " + what;
    };
    note(live.phys_handles, "cuMemCreate handles");
    note(live.reservations, "reservations");
    note(live.mappings, "mappings");
    note(live.managed_allocs, "managed allocations");
    note(live.device_allocs, "cuMemAlloc allocations");
    note(live.host_allocs, "cuMemHostAlloc allocations");
    note(live.registrations, "host registrations");
    note(live.streams, "streams");
    note(live.events, "events");
    note(live.context_refs, "primary-context retains");
    if (!busy.empty()) {
      set_last_error("cxlsim_configure: simulated resources are still live (" + busy +
                     "); release them before reconfiguring");
      return -1;
    }
    executor_reset();
    reset_memory();
    reset_contexts();
    clear_bindings();
    // cuInit's effect survives a reconfiguration with GPUs; with none, the
    // next cuInit reports CUDA_ERROR_NO_DEVICE as a GPU-less machine does.
    if (c.devices == 0) set_initialized(false);
    set_config(std::make_shared<const Config>(std::move(c)));
    return 0;
  } catch (...) {
    set_last_error("cxlsim_configure: out of memory");
    return -1;
  }
}

CXLSIM_API int cxlsim_live(cxlsim_live_t* out) {
  if (out == nullptr) return -1;
  try {
    *out = cxlsim_live_t{};
    live_memory(out);
    live_streams_and_events(&out->streams, &out->events);
    out->context_refs = context_refs();
    return 0;
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
