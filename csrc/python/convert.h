// Engine values as Python objects, shared by several binding files: a byte
// view as a DLPack capsule (torch.from_dlpack takes it without a copy), and a
// placement check as a dict.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "backend/placement.h"
#include "python/dlpack.h"

namespace cxl::python {

// A 1-D uint8 "dltensor" capsule over [data, data + nbytes) on `device`.
// `manager_ctx` owns whatever keeps the memory alive and holds `shape` and
// `strides` (one element each; they must live as long as the tensor);
// `deleter` frees it and the DLManagedTensor.  If the capsule cannot be made,
// the deleter runs at once and the Python error is thrown, so nothing leaks.
pybind11::capsule byte_capsule(void* data, size_t nbytes, DLDevice device, void* manager_ctx, int64_t* shape,
                               int64_t* strides, void (*deleter)(DLManagedTensor*));

// {"ok", "on_node", "elsewhere", "unpopulated", "method", "detail"}.
pybind11::dict placement_dict(const backend::PlacementCheck& c);

}  // namespace cxl::python
