// Timing helpers for the allocation benchmark (cxlalloc_apps/bench/allocation.py).
//
// Why in C++: one cached malloc/free pair of the engine takes well under a
// microsecond, while a Python loop around the bindings costs about as much
// again (argument conversion, GIL release/acquire), so a Python timer would
// measure Python.  Each call here times every iteration with steady_clock
// (nanoseconds) around exactly one engine or driver call, with the GIL
// released for the whole loop, and returns the raw samples; statistics are
// computed in Python.  Nothing here changes the engine: it only calls its
// public API (DeviceAllocator::malloc/free/empty_cache) and the driver table.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "alloc/engine.h"
#include "common/error.h"
#include "common/types.h"
#include "driver/resources.h"
#include "python/bindings.h"

namespace py = pybind11;
using namespace cxl;

namespace cxl::python {

namespace {

using Clock = std::chrono::steady_clock;

inline int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

struct AllocSamples {
  std::vector<int64_t> malloc_ns, free_ns;
  std::string tier;  // tier of the first block (checks only_host took effect)
};

// malloc + free of `nbytes`, `iters` times.  cold: empty_cache() after each
// free (untimed), so every malloc creates a new segment (driver calls
// included); otherwise one untimed warm-up pair first, so every timed malloc
// is served from the block cache.
AllocSamples time_alloc(alloc::DeviceAllocator& a, size_t nbytes, int iters, AllocClass cls, bool only_host,
                        bool cold) {
  AllocSamples s;
  s.malloc_ns.reserve(iters);
  s.free_ns.reserve(iters);
  if (!cold) a.free(a.malloc(nbytes, nullptr, cls, only_host));
  else a.empty_cache();
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    void* p = a.malloc(nbytes, nullptr, cls, only_host);
    s.malloc_ns.push_back(ns_since(t0));
    if (i == 0) s.tier = tier_name(a.tier_of(p));
    auto t1 = Clock::now();
    a.free(p);
    s.free_ns.push_back(ns_since(t1));
    if (cold) a.empty_cache();
  }
  return s;
}

struct DriverSamples {
  std::vector<int64_t> alloc_ns, free_ns;
};

// The raw driver calls cxlalloc competes with, on the device's primary
// context: cuMemAlloc/cuMemFree (what torch's native allocator does on a
// cache miss), cuMemHostAlloc/cuMemFreeHost (torch's pinned host allocator,
// cudaHostAlloc), cuMemAllocManaged/cuMemFree.
DriverSamples time_driver(const std::shared_ptr<const driver::Driver>& drv, int device, const std::string& kind,
                          size_t nbytes, int iters) {
  driver::PrimaryContext ctx(drv, device);
  driver::ContextGuard guard(*drv, ctx.get());
  DriverSamples s;
  for (int i = 0; i < iters; ++i) {
    if (kind == "cuMemAlloc") {
      CUdeviceptr p = 0;
      auto t0 = Clock::now();
      CXL_CU(*drv, cuMemAlloc, &p, nbytes);
      s.alloc_ns.push_back(ns_since(t0));
      auto t1 = Clock::now();
      CXL_CU(*drv, cuMemFree, p);
      s.free_ns.push_back(ns_since(t1));
    } else if (kind == "cuMemHostAlloc") {
      void* p = nullptr;
      auto t0 = Clock::now();
      CXL_CU(*drv, cuMemHostAlloc, &p, nbytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
      s.alloc_ns.push_back(ns_since(t0));
      auto t1 = Clock::now();
      CXL_CU(*drv, cuMemFreeHost, p);
      s.free_ns.push_back(ns_since(t1));
    } else if (kind == "cuMemAllocManaged") {
      CUdeviceptr p = 0;
      auto t0 = Clock::now();
      CXL_CU(*drv, cuMemAllocManaged, &p, nbytes, static_cast<unsigned int>(CU_MEM_ATTACH_GLOBAL));
      s.alloc_ns.push_back(ns_since(t0));
      auto t1 = Clock::now();
      CXL_CU(*drv, cuMemFree, p);
      s.free_ns.push_back(ns_since(t1));
    } else {
      throw Error(ErrorKind::InvalidArgument,
                  "kind: '" + kind + "' is not timed; allowed: cuMemAlloc, cuMemHostAlloc, cuMemAllocManaged");
    }
  }
  return s;
}

}  // namespace

void bind_bench(py::module_& m) {
  m.def(
      "bench_alloc",
      [](std::shared_ptr<alloc::Engine> e, int device, size_t nbytes, int iters, const std::string& tag,
         bool only_host, bool cold) {
        if (iters < 1) throw Error(ErrorKind::InvalidArgument, "iters: must be >= 1");
        AllocClass cls = parse_class(tag);
        AllocSamples s;
        {
          py::gil_scoped_release nogil;
          s = time_alloc(e->device(device), nbytes, iters, cls, only_host, cold);
        }
        py::dict d;
        d["malloc_ns"] = s.malloc_ns;
        d["free_ns"] = s.free_ns;
        d["tier"] = s.tier;
        return d;
      },
      py::arg("engine"), py::arg("device"), py::arg("nbytes"), py::arg("iters"), py::arg("tag") = "other",
      py::arg("only_host") = false, py::arg("cold") = false,
      "Time `iters` malloc/free pairs of `nbytes` on the engine's allocator of `device` (stream 0).\n\n"
      "cold=True empties the cache after each free (untimed) so every malloc makes a new segment;\n"
      "cold=False times cache hits after one untimed warm-up pair.  only_host=True forces the host tier.\n"
      "Returns {'malloc_ns': [int], 'free_ns': [int], 'tier': tier of the first block}.");
  m.def(
      "bench_driver_alloc",
      [](std::shared_ptr<alloc::Engine> e, int device, const std::string& kind, size_t nbytes, int iters) {
        if (iters < 1) throw Error(ErrorKind::InvalidArgument, "iters: must be >= 1");
        DriverSamples s;
        {
          py::gil_scoped_release nogil;
          s = time_driver(e->driver(), device, kind, nbytes, iters);
        }
        py::dict d;
        d["alloc_ns"] = s.alloc_ns;
        d["free_ns"] = s.free_ns;
        return d;
      },
      py::arg("engine"), py::arg("device"), py::arg("kind"), py::arg("nbytes"), py::arg("iters"),
      "Time `iters` raw driver allocate/free pairs: kind 'cuMemAlloc', 'cuMemHostAlloc' (portable|devicemap)\n"
      "or 'cuMemAllocManaged' (attach global), on `device`'s primary context.\n"
      "Returns {'alloc_ns': [int], 'free_ns': [int]}.");
  m.def(
      "bench_alloc_pattern",
      [](std::shared_ptr<alloc::Engine> e, int device, const std::vector<size_t>& sizes, int rounds,
         const std::string& tag) {
        if (rounds < 1) throw Error(ErrorKind::InvalidArgument, "rounds: must be >= 1");
        AllocClass cls = parse_class(tag);
        int64_t total_ns = 0;
        size_t ops = 0;
        {
          py::gil_scoped_release nogil;
          auto& a = e->device(device);
          std::vector<void*> ptrs(sizes.size(), nullptr);
          auto t0 = Clock::now();
          for (int r = 0; r < rounds; ++r) {
            for (size_t i = 0; i < sizes.size(); ++i) ptrs[i] = a.malloc(sizes[i], nullptr, cls, false);
            // Free the even positions, then the odd ones: holes first, then
            // coalescing, as a decode step's short-lived tensors do.
            for (size_t i = 0; i < sizes.size(); i += 2) a.free(ptrs[i]);
            for (size_t i = 1; i < sizes.size(); i += 2) a.free(ptrs[i]);
            ops += 2 * sizes.size();
          }
          total_ns = ns_since(t0);
        }
        py::dict d;
        d["ops"] = ops;
        d["ns"] = total_ns;
        return d;
      },
      py::arg("engine"), py::arg("device"), py::arg("sizes"), py::arg("rounds"), py::arg("tag") = "other",
      "Allocate every size of `sizes` (bytes), free them (even positions, then odd), `rounds` times.\n"
      "Returns {'ops': mallocs + frees, 'ns': total wall time}.");
}

}  // namespace cxl::python
