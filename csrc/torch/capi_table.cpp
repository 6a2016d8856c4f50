#include "capi_table.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <stdexcept>

namespace cxlt {

namespace {
std::mutex g_mu;
std::atomic<const CApi*> g_table{nullptr};

template <typename Fn>
void resolve(void* handle, const char* name, Fn& out, const std::string& path) {
  dlerror();
  void* sym = dlsym(handle, name);
  if (!sym)
    throw std::runtime_error("cxlalloc torch adapter: symbol '" + std::string(name) + "' not found in " + path +
                             " (the adapter and cxlalloc._C come from different versions; reinstall cxlalloc)");
  out = reinterpret_cast<Fn>(sym);
}
}  // namespace

std::string CApi::error() const {
  const char* e = last_error();
  return e ? std::string(e) : std::string();
}

const CApi& load_capi(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (const CApi* t = g_table.load()) return *t;
  // RTLD_NOLOAD: only an already-loaded _C is acceptable (a fresh copy would
  // have its own, unconfigured engine).
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) {
    const char* why = dlerror();
    throw std::runtime_error("cxlalloc torch adapter: " + path + " is not loaded in this process (" +
                             (why ? why : "dlopen failed") + "); import cxlalloc first");
  }
  auto* t = new CApi();  // leaked on purpose: used until the process ends
  resolve(h, "cxlalloc_api_version", t->api_version, path);
  if (t->api_version() < 2)
    throw std::runtime_error("cxlalloc torch adapter: " + path + " has C API version " +
                             std::to_string(t->api_version()) + ", need >= 2; rebuild cxlalloc");
  resolve(h, "cxlalloc_last_error", t->last_error, path);
  resolve(h, "cxlalloc_last_error_kind", t->last_error_kind, path);
  resolve(h, "cxlalloc_is_enabled", t->is_enabled, path);
  resolve(h, "cxlalloc_malloc", t->malloc, path);
  resolve(h, "cxlalloc_free", t->free, path);
  resolve(h, "cxlalloc_record_stream", t->record_stream, path);
  resolve(h, "cxlalloc_empty_cache", t->empty_cache, path);
  resolve(h, "cxlalloc_device_empty_cache", t->device_empty_cache, path);
  resolve(h, "cxlalloc_enable_peer_access", t->enable_peer_access, path);
  resolve(h, "cxlalloc_create_pool", t->create_pool, path);
  resolve(h, "cxlalloc_begin_allocate_to_pool", t->begin_allocate_to_pool, path);
  resolve(h, "cxlalloc_end_allocate_to_pool", t->end_allocate_to_pool, path);
  resolve(h, "cxlalloc_release_pool", t->release_pool, path);
  resolve(h, "cxlalloc_pool_use_count", t->pool_use_count, path);
  resolve(h, "cxlalloc_torch_stats", t->torch_stats, path);
  resolve(h, "cxlalloc_reset_peak_stats", t->reset_peak_stats, path);
  resolve(h, "cxlalloc_reset_accumulated_stats", t->reset_accumulated_stats, path);
  resolve(h, "cxlalloc_device_limit", t->device_limit, path);
  resolve(h, "cxlalloc_set_device_limit", t->set_device_limit, path);
  resolve(h, "cxlalloc_describe_tiers", t->describe_tiers, path);
  resolve(h, "cxlalloc_snapshot", t->snapshot, path);
  g_table.store(t);
  return *t;
}

const CApi* capi() { return g_table.load(); }

}  // namespace cxlt
