// Driver loading, exposed for `cxlalloc info` and the tests.
#include <pybind11/pybind11.h>

#include "common/log.h"
#include "driver/driver.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace cxl::python {

void bind_driver(py::module_& m) {
  m.def(
      "probe_driver",
      [](const std::string& path, bool simulated) {
        auto d = driver::Driver::open(path, simulated);
        py::dict out;
        out["path"] = d->path();
        out["simulated"] = d->simulated();
        out["version"] = d->version();
        out["device_count"] = d->device_count();
        return out;
      },
      py::arg("path"), py::arg("simulated") = false,
      "Load the CUDA driver at `path` and call cuInit.\n\n"
      "Returns {'path', 'simulated', 'version' (e.g. 13000), 'device_count'}.\n"
      "Raises CudaUnavailableError('CUDA unavailable: <reason>') when it cannot be used.");
  m.def("cleanup_failures", &cleanup_failures,
        "Number of driver release calls that failed in a destructor since the process started "
        "(each was logged as 'cxlalloc: warning: cleanup failed: ...').");
}

}  // namespace cxl::python
