// One function per binding area; see module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace cxl::python {
void bind_errors(pybind11::module_& m);
void bind_driver(pybind11::module_& m);
void bind_engine(pybind11::module_& m);
void bind_policy(pybind11::module_& m);
void bind_topology(pybind11::module_& m);
}  // namespace cxl::python
