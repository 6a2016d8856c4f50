// One function per binding area; see module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace cxl::python {
void bind_errors(pybind11::module_& m);
void bind_driver(pybind11::module_& m);
void bind_engine(pybind11::module_& m);
void bind_policy(pybind11::module_& m);
void bind_topology(pybind11::module_& m);
void bind_bench(pybind11::module_& m);    // bench timing helpers (bind_bench.cpp)
void bind_kvstore(pybind11::module_& m);  // the KV reuse store's host arena (bind_kvstore.cpp)
}  // namespace cxl::python
