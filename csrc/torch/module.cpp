// Python entry points of the torch adapter (built by cxlalloc/pytorch/adapter_build.py
// with torch.utils.cpp_extension against the installed torch).
//
// install() is the whole of global mode's C++ side: resolve the engine's C
// ABI, create the allocator, make it torch's CUDA allocator, keep it alive
// forever.  Everything else here is for checking that it really happened
// (case C09: a failed enable must never look like success).
#include <pybind11/pybind11.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "allocator.h"

namespace py = pybind11;

namespace cxlt {
namespace {

std::mutex g_install_mu;

// Make cxlalloc torch's CUDA allocator.  Raises RuntimeError when torch's
// current allocator is already initialised (CUDA was used before), with
// torch's reason and the fix.
void install(const std::string& c_library_path) {
  std::lock_guard<std::mutex> lk(g_install_mu);
  if (CxlAllocator* a = CxlAllocator::instance()) {
    if (c10::cuda::CUDACachingAllocator::get() == a) return;  // idempotent
    throw std::runtime_error(
        "cxlalloc: the torch adapter was installed before but is no longer torch's CUDA allocator "
        "(another library replaced it)");
  }
  const CApi& c = load_capi(c_library_path);
  CCA::CUDAAllocator* current = c10::cuda::CUDACachingAllocator::get();
  if (current && current->initialized())
    throw std::runtime_error("cxlalloc: torch's CUDA allocator ('" + current->name() +
                             "') is already initialised (CUDA was used in this process before cxlalloc.enable()), "
                             "so it cannot be replaced; call cxlalloc.enable() before any CUDA use, or set "
                             "CXLALLOC=1 before starting Python");
  // Leaked on purpose: tensors may be freed during interpreter shutdown,
  // after every Python object and most C++ statics are gone (case C12).
  auto* keep = new std::shared_ptr<CxlAllocator>(std::make_shared<CxlAllocator>(c));
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(*keep);
  } catch (const c10::Error& e) {
    throw std::runtime_error(std::string("cxlalloc: torch refused the allocator swap: ") + e.what_without_backtrace());
  }
  CxlAllocator::set_instance(keep->get());
  // changeCurrentAllocator does not update c10's per-device-type registry,
  // which torch.accelerator.* and UntypedStorage(device="cuda") use; the
  // native allocator registered itself there with priority 0.
  c10::SetAllocator(c10::DeviceType::CUDA, keep->get(), /*priority=*/1);
  if (c10::cuda::CUDACachingAllocator::get() != keep->get())
    throw std::runtime_error("cxlalloc: torch's CUDA allocator did not change after changeCurrentAllocator");
}

// True iff cxlalloc is, right now, the allocator torch's CUDA tensors use.
bool is_current() {
  CxlAllocator* a = CxlAllocator::instance();
  return a != nullptr && c10::cuda::CUDACachingAllocator::get() == a &&
         c10::GetAllocator(c10::DeviceType::CUDA) == a;
}

// Name and initialisation state of torch's current CUDA allocator.
py::tuple current_allocator() {
  CCA::CUDAAllocator* a = c10::cuda::CUDACachingAllocator::get();
  if (!a) return py::make_tuple(py::none(), false);
  return py::make_tuple(a->name(), a->initialized());
}

}  // namespace
}  // namespace cxlt

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cxlalloc's torch adapter: cxlalloc as torch's CUDA caching allocator (global mode)";
  m.def("install", &cxlt::install, py::arg("c_library_path"),
        "Make cxlalloc torch's CUDA allocator (before CUDA is initialised); raises RuntimeError otherwise.");
  m.def("is_current", &cxlt::is_current, "Whether cxlalloc is torch's CUDA allocator right now.");
  m.def("current_allocator", &cxlt::current_allocator, "(name, initialized) of torch's current CUDA allocator.");
  m.attr("torch_version") = TORCH_VERSION;
}
