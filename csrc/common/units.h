// Byte-size helpers shared by the engine.  Sizes are always bytes (size_t).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cxl {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;
constexpr size_t GiB = size_t(1) << 30;

// Round n up to a multiple of align (a power of two or not).  Returns 0 when
// the result would overflow size_t, which callers treat as "impossibly large".
inline size_t round_up(size_t n, size_t align) {
  if (align == 0) return n;
  size_t rem = n % align;
  if (rem == 0) return n;
  size_t add = align - rem;
  if (n > SIZE_MAX - add) return 0;
  return n + add;
}

// "1.50 GiB", "512.00 MiB", "123 B": for error messages and summaries.
std::string format_bytes(size_t n);

}  // namespace cxl
