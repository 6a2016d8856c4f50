// The check macro of tests/engine's C++ unit tests (*_test.cpp): counts every
// check, prints each failed one with its file and line, never stops early, so
// one run names every failure.  The test's main() prints "ok: N checks" and
// exits 0 when `failures` is 0 (tests/engine/cpp_unit.py reads that line).
#pragma once

#include <cstdio>

static int checks = 0, failures = 0;
#define CHECK(cond)                                                 \
  do {                                                              \
    ++checks;                                                       \
    if (!(cond)) {                                                  \
      ++failures;                                                   \
      std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
    }                                                               \
  } while (0)
