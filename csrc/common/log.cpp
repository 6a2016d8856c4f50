#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace cxl {

namespace {
std::atomic<uint64_t> g_cleanup_failures{0};

bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CXLALLOC_DEBUG");
    return v && std::strcmp(v, "0") != 0 && *v != '\0';
  }();
  return on;
}
}  // namespace

void log_warning(const std::string& msg) { std::fprintf(stderr, "cxlalloc: warning: %s\n", msg.c_str()); }

void log_debug(const std::string& msg) {
  if (debug_enabled()) std::fprintf(stderr, "cxlalloc: debug: %s\n", msg.c_str());
}

void note_cleanup_failure(const std::string& msg) {
  g_cleanup_failures.fetch_add(1, std::memory_order_relaxed);
  log_warning("cleanup failed: " + msg);
}

uint64_t cleanup_failures() { return g_cleanup_failures.load(std::memory_order_relaxed); }

}  // namespace cxl
