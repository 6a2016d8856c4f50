// Minimal diagnostics.  Warnings go to stderr prefixed "cxlalloc:"; a failure
// inside a destructor (where throwing is not allowed) is counted so tests can
// assert that cleanup never failed silently.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace cxl {

void log_warning(const std::string& msg);
void log_debug(const std::string& msg);  // only when CXLALLOC_DEBUG=1
// A driver call in a destructor failed; message is logged, counter bumped.
void note_cleanup_failure(const std::string& msg);
uint64_t cleanup_failures();

}  // namespace cxl
