// Call counters and armed faults (cxlsim_fail, cxlsim_call_count, ...).
//
// Locking: counters are relaxed atomics (a count is exact once the counted
// calls have returned).  Armed faults live under `g_faults_mu`; `g_armed`
// mirrors their number so the common no-fault path takes no lock.
#include "sim/faults.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "sim/errors.h"

namespace cxlsim {

namespace {

constexpr const char* kNames[kFnCount] = {
#define CXLSIM_FN_NAME(name, ...) #name,
    CXL_DRIVER_FUNCTIONS(CXLSIM_FN_NAME)
#undef CXLSIM_FN_NAME
    "cuGetProcAddress",
};

std::array<std::atomic<uint64_t>, kFnCount> g_counts{};

struct Fault {
  int fn;              // Fn index, or -1 for "*" (any entry point)
  uint64_t remaining;  // calls to go; fires when it reaches 0
  CUresult error;
};
std::mutex g_faults_mu;
std::vector<Fault> g_faults;
std::atomic<size_t> g_armed{0};

std::string all_names() {
  std::string s;
  for (const char* n : kNames) {
    if (!s.empty()) s += ", ";
    s += n;
  }
  return s;
}

}  // namespace

const char* fn_name(Fn fn) { return kNames[static_cast<int>(fn)]; }

int fn_lookup(const char* name) {
  if (name == nullptr) return -1;
  for (int i = 0; i < kFnCount; ++i)
    if (std::strcmp(kNames[i], name) == 0) return i;
  return -1;
}

CUresult enter(Fn fn) noexcept {
  const int id = static_cast<int>(fn);
  g_counts[id].fetch_add(1, std::memory_order_relaxed);
  if (g_armed.load(std::memory_order_acquire) == 0) return CUDA_SUCCESS;
  std::lock_guard<std::mutex> lk(g_faults_mu);
  // Every matching fault counts this call; all that reach zero are spent by
  // it (the call fails once), and the earliest armed one gives the error.
  CUresult fired = CUDA_SUCCESS;
  for (auto it = g_faults.begin(); it != g_faults.end();) {
    if (it->fn == -1 || it->fn == id) {
      if (--it->remaining == 0) {
        if (fired == CUDA_SUCCESS) fired = it->error;
        it = g_faults.erase(it);
        continue;
      }
    }
    ++it;
  }
  g_armed.store(g_faults.size(), std::memory_order_release);
  return fired;
}

}  // namespace cxlsim

using namespace cxlsim;

extern "C" {

CXLSIM_API int cxlsim_fail(const char* fn, uint64_t nth, int error) {
  try {
    int id = -1;
    if (fn == nullptr || (std::strcmp(fn, "*") != 0 && (id = fn_lookup(fn)) < 0)) {
      set_last_error(std::string("cxlsim_fail: unknown driver function '") + (fn ? fn : "(null)") +
                     "' (use a base name or \"*\"; known: " + all_names() + ")");
      return -1;
    }
    if (nth == 0) {
      set_last_error("cxlsim_fail: nth must be >= 1 (1 = the next call)");
      return -1;
    }
    // 1..999 is CUresult's range in cuda.h; other values are not CUresults.
    if (error < 1 || error > 999) {
      set_last_error("cxlsim_fail: error " + std::to_string(error) +
                     " is not a failing CUresult (1..999; CUDA_SUCCESS is 0)");
      return -1;
    }
    std::lock_guard<std::mutex> lk(g_faults_mu);
    g_faults.push_back(Fault{id, nth, static_cast<CUresult>(error)});
    g_armed.store(g_faults.size(), std::memory_order_release);
    return 0;
  } catch (...) {
    set_last_error("cxlsim_fail: out of memory");
    return -1;
  }
}

CXLSIM_API void cxlsim_clear_faults(void) {
  std::lock_guard<std::mutex> lk(g_faults_mu);
  g_faults.clear();
  g_armed.store(0, std::memory_order_release);
}

CXLSIM_API uint64_t cxlsim_call_count(const char* fn) {
  int id = fn_lookup(fn);
  return id < 0 ? 0 : g_counts[id].load(std::memory_order_relaxed);
}

CXLSIM_API void cxlsim_reset_counts(void) {
  for (auto& c : g_counts) c.store(0, std::memory_order_relaxed);
}

CXLSIM_API const char* cxlsim_called_functions(void) {
  thread_local std::string out;
  out.clear();
  // kNames order is driver.h's table order; sort for a stable, readable list.
  std::vector<std::string> names;
  for (int i = 0; i < kFnCount; ++i)
    if (g_counts[i].load(std::memory_order_relaxed) > 0) names.emplace_back(kNames[i]);
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    if (!out.empty()) out += ',';
    out += n;
  }
  return out.c_str();
}

CXLSIM_API const char* cxlsim_function_names(void) {
  thread_local std::string out;
  out.clear();
  for (const char* n : kNames) {
    if (!out.empty()) out += ',';
    out += n;
  }
  return out.c_str();
}

}  // extern "C"
