#include "python/convert.h"

namespace py = pybind11;

namespace cxl::python {

namespace {

// A capsule torch never consumed (renamed "used_dltensor" once it is) still
// owns its tensor, so the tensor's deleter must run with the capsule.
void unconsumed_capsule_destructor(PyObject* cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (t && t->deleter) t->deleter(t);
  }
}

}  // namespace

py::capsule byte_capsule(void* data, size_t nbytes, DLDevice device, void* manager_ctx, int64_t* shape,
                         int64_t* strides, void (*deleter)(DLManagedTensor*)) {
  auto* t = new DLManagedTensor();
  shape[0] = static_cast<int64_t>(nbytes);
  strides[0] = 1;
  t->dl_tensor.data = data;
  t->dl_tensor.device = device;
  t->dl_tensor.ndim = 1;
  t->dl_tensor.dtype = DLDataType{kDLUInt, 8, 1};
  t->dl_tensor.shape = shape;
  t->dl_tensor.strides = strides;
  t->dl_tensor.byte_offset = 0;
  t->manager_ctx = manager_ctx;
  t->deleter = deleter;
  PyObject* cap = PyCapsule_New(t, "dltensor", unconsumed_capsule_destructor);
  if (!cap) {
    deleter(t);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

py::dict placement_dict(const backend::PlacementCheck& c) {
  py::dict d;
  d["ok"] = c.ok;
  d["on_node"] = c.on_node;
  d["elsewhere"] = c.elsewhere;
  d["unpopulated"] = c.unpopulated;
  d["method"] = c.method;
  d["detail"] = c.detail;
  return d;
}

}  // namespace cxl::python
