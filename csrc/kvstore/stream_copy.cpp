// Streaming-store copy into the KV pool (see stream_copy.h for why).
#include "kvstore/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define CXL_STREAM_SSE2 1
#endif

namespace cxl::kvstore {

namespace {

#ifdef CXL_STREAM_SSE2
bool cpu_has_sse2() noexcept {
  // SSE2 is part of x86-64, but the check is cheap and keeps the rule
  // "never run an instruction the CPU did not say it has" without exceptions.
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse2") != 0;
}

void copy_streaming(uint8_t* d, const uint8_t* s, size_t n) noexcept {
  // Head: plain bytes until d is 16-byte aligned (_mm_stream_si128 needs it;
  // the source is read unaligned, a tensor's data may start anywhere).
  size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  // A whole cache line per step: the write-combining buffer flushes full
  // lines without reading them first.
  for (; n >= 64; n -= 64, d += 64, s += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  for (; n >= 16; n -= 16, d += 16, s += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  std::memcpy(d, s, n);  // tail: under 16 bytes
  // Streaming stores are weakly ordered: without the fence a commit sent
  // after this copy could publish a block whose last lines are still in a
  // write-combining buffer.
  _mm_sfence();
}
#endif

}  // namespace

bool stream_copy_available() noexcept {
#ifdef CXL_STREAM_SSE2
  static const bool has = cpu_has_sse2();
  return has;
#else
  return false;
#endif
}

bool stream_copy(void* dst, const void* src, size_t n, bool allow_stream) noexcept {
#ifdef CXL_STREAM_SSE2
  if (allow_stream && n >= kStreamMinBytes && stream_copy_available()) {
    copy_streaming(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
    return true;
  }
#endif
  (void)allow_stream;
  std::memcpy(dst, src, n);
  return false;
}

}  // namespace cxl::kvstore
