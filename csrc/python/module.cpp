// cxlalloc._C: Python bindings of the engine.  Each bind_*.cpp file adds one
// area; this file only wires them together.
#include <pybind11/pybind11.h>

#include "python/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "cxlalloc native engine (tiered CUDA caching allocator)";
  cxl::python::bind_errors(m);
  cxl::python::bind_driver(m);
  cxl::python::bind_engine(m);
  cxl::python::bind_policy(m);
  cxl::python::bind_topology(m);
  cxl::python::bind_bench(m);
  cxl::python::bind_kvstore(m);
}
