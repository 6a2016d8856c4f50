// Write guard: page ranges made read-only so that any later user-space write
// into them is seen (a SIGSEGV handler marks the range written, makes it
// writable again and lets the write go on).  Used by the KV reuse
// fingerprint (cxlalloc/kvstore/keys.py, WeightsWatch "guarded") to know
// that model weights did not change since they were digested, whatever
// alias wrote them (.data, .numpy(), ctypes): torch's version counter and
// the storage address miss those writes.
//
// What it cannot see: a write by the kernel (read(2) into the range fails
// with EFAULT instead) and a device's DMA into the pages (pinned memory),
// so callers guard only pageable CPU memory they checked.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cxl::guard {

// The page size (bytes).
std::size_t page_size();

// Make [addr, addr + len) read-only and remember it; addr and len must be
// page-aligned (len > 0).  Installs the SIGSEGV handler on first use (the
// previous handler is chained for faults outside every guarded range).
// Returns the range's id (>= 0).  Throws cxl::Error when mprotect fails or
// no slot is left.
int64_t protect(std::uintptr_t addr, std::size_t len);

// Whether a write faulted into range `id` since protect() (the range is
// writable again then).  False for an unknown id.
bool written(int64_t id);

// Forget range `id`.  With restore = true and the range not written, it is
// made writable again (the caller checked the memory is still the one it
// guarded); with restore = false the pages are left as they are.
void release(int64_t id, bool restore);

// Whether our handler is the process's SIGSEGV handler now (another library
// may have replaced it; then faults may not reach us).
bool handler_installed();

// (Re)install our handler on top of whatever is there now (which is then
// chained).  Returns true when it is installed.
bool install_handler();

// Check every guarded, unwritten range against /proc/self/maps: a range
// not wholly inside mappings without write permission lost its guard (its
// address was mapped again, e.g. by a driver) and is marked written, since a
// write to it since would not have faulted.  Returns how many were marked.
std::size_t verify();

// Number of guarded ranges and of faults handled since start.
std::size_t active_ranges();
std::uint64_t faults_handled();

}  // namespace cxl::guard
