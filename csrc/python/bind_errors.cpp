// Map engine errors to Python exceptions.
//   OutOfMemory  -> cxlalloc.OutOfMemoryError (a MemoryError)
//   InvalidFree  -> cxlalloc.InvalidFreeError (a ValueError)
//   InvalidArgument -> ValueError
//   Unavailable  -> cxlalloc.CudaUnavailableError (a RuntimeError)
//   Unsupported  -> cxlalloc.UnsupportedError (a RuntimeError)
//   Capture      -> cxlalloc.CaptureError (a RuntimeError)
//   Driver       -> cxlalloc.DriverError (a RuntimeError; .call and .code set)
//   Internal     -> RuntimeError
#include <pybind11/pybind11.h>

#include "common/error.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace cxl::python {

void bind_errors(py::module_& m) {
  static py::exception<Error> oom(m, "OutOfMemoryError", PyExc_MemoryError);
  static py::exception<Error> invalid_free(m, "InvalidFreeError", PyExc_ValueError);
  static py::exception<Error> unavailable(m, "CudaUnavailableError", PyExc_RuntimeError);
  static py::exception<Error> unsupported(m, "UnsupportedError", PyExc_RuntimeError);
  static py::exception<Error> capture(m, "CaptureError", PyExc_RuntimeError);
  static py::exception<Error> driver(m, "DriverError", PyExc_RuntimeError);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const DriverError& e) {
      // Attach the failing call and CUresult so callers can branch on them.
      py::object inst = py::handle(driver.ptr())(e.what());
      inst.attr("call") = e.call();
      inst.attr("code") = e.code();
      PyErr_SetObject(driver.ptr(), inst.ptr());
    } catch (const Error& e) {
      switch (e.kind()) {
        case ErrorKind::OutOfMemory: PyErr_SetString(oom.ptr(), e.what()); break;
        case ErrorKind::InvalidFree: PyErr_SetString(invalid_free.ptr(), e.what()); break;
        case ErrorKind::InvalidArgument: PyErr_SetString(PyExc_ValueError, e.what()); break;
        case ErrorKind::Unavailable: PyErr_SetString(unavailable.ptr(), e.what()); break;
        case ErrorKind::Unsupported: PyErr_SetString(unsupported.ptr(), e.what()); break;
        case ErrorKind::Capture: PyErr_SetString(capture.ptr(), e.what()); break;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); break;
      }
    }
  });
}

}  // namespace cxl::python
