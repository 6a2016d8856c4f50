// Python bindings of the KV reuse store's host memory: _C.HostArena.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "alloc/engine.h"
#include "common/error.h"
#include "common/log.h"
#include "common/write_guard.h"
#include "kvstore/host_arena.h"
#include "kvstore/stream_copy.h"
#include "python/bindings.h"
#include "python/convert.h"

namespace py = pybind11;
using namespace cxl;

namespace cxl::python {

namespace {

// A CPU tensor over the whole arena keeps the arena alive until torch drops it.
struct ArenaView {
  std::shared_ptr<kvstore::HostArena> arena;
  int64_t shape[1];
  int64_t strides[1];
};

void arena_view_deleter(DLManagedTensor* self) {
  delete static_cast<ArenaView*>(self->manager_ctx);
  delete self;
}

py::capsule arena_capsule(std::shared_ptr<kvstore::HostArena> a) {
  auto* ctx = new ArenaView{a, {0}, {0}};
  return byte_capsule(a->base(), a->size(), DLDevice{kDLCPU, 0}, ctx, ctx->shape, ctx->strides, arena_view_deleter);
}

}  // namespace

void bind_kvstore(py::module_& m) {
  // The weights' write guard (common/write_guard.h): used by cxlalloc.kvstore.keys.WeightsWatch.
  m.def("guard_page_size", &guard::page_size, "The page size in bytes.");
  m.def("guard_protect", [](std::uintptr_t addr, std::size_t len) { return guard::protect(addr, len); },
        py::arg("addr"), py::arg("len"),
        "Make the page-aligned range [addr, addr+len) read-only and watch it for writes; returns its id.");
  m.def("guard_written", &guard::written, py::arg("id"), "Whether a write faulted into range id since it was guarded.");
  m.def("guard_release", &guard::release, py::arg("id"), py::arg("restore"),
        "Forget range id; restore=True makes it writable again when it was not written.");
  m.def("guard_handler_installed", &guard::handler_installed, "Whether the guard's SIGSEGV handler is installed now.");
  m.def("guard_install_handler", &guard::install_handler,
        "Install the guard's SIGSEGV handler (chaining the previous).");
  m.def("guard_verify", &guard::verify,
        "Mark written every guarded range no longer read-only in /proc/self/maps; returns how many.");
  m.def("guard_stats", []() { return py::make_tuple(guard::active_ranges(), guard::faults_handled()); },
        "(guarded ranges, faults handled).");

  // Writes into the pool (cxlalloc.kvstore.blockcopy): the Python side passes only pointers and sizes of tensors
  // it checked (CPU, contiguous, same byte count), so nothing here can be handed a Python object it misreads.
  m.def("stream_copy_available", &kvstore::stream_copy_available,
        "Whether this CPU has the streaming stores stream_copy_many uses (SSE2 on x86-64; checked at run time).");
  m.def(
      "stream_copy_many",
      [](const std::vector<std::uintptr_t>& dsts, const std::vector<std::uintptr_t>& srcs,
         const std::vector<size_t>& sizes, bool allow_stream) {
        if (dsts.size() != srcs.size() || dsts.size() != sizes.size())
          throw py::value_error("stream_copy_many: dsts, srcs and sizes must have the same length");
        size_t streamed = 0;
        py::gil_scoped_release nogil;  // a 4 MiB batch takes ~1 ms: other threads of the process run meanwhile
        for (size_t i = 0; i < dsts.size(); ++i)
          streamed += kvstore::stream_copy(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]),
                                           sizes[i], allow_stream)
                          ? 1
                          : 0;
        return streamed;
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("allow_stream") = true,
      "Copy sizes[i] bytes from address srcs[i] to dsts[i] for each i (non-overlapping), with streaming stores where "
      "available and a copy is >= 4 KiB (else memcpy); returns how many copies streamed.  The GIL is released.");

  py::class_<kvstore::HostArena, std::shared_ptr<kvstore::HostArena>>(
      m, "HostArena",
      "Host memory of the KV reuse store on one NUMA node: bound before first touch, committed as it is written, "
      "registered for the GPU chunk by chunk (csrc/kvstore/host_arena.h).")
      .def(py::init([](const std::shared_ptr<alloc::Engine>& engine, size_t size, int node, bool shared, int attach_fd,
                       size_t register_chunk, int device) {
             kvstore::ArenaConfig c;
             c.size = size;
             c.node = node;
             c.shared = shared;
             c.attach_fd = attach_fd;
             c.register_chunk = register_chunk;
             c.device = device;
             py::gil_scoped_release nogil;
             // No engine: a process with no GPU (the kv-server) places pages
             // with the kernel's own mbind/move_pages and never registers.
             if (!engine) return std::make_shared<kvstore::HostArena>(nullptr, backend::linux_numa_ops(), c);
             return std::make_shared<kvstore::HostArena>(engine->driver(), engine->numa(), c);
           }),
           py::arg("engine").none(true), py::arg("size"), py::arg("node"), py::arg("shared") = false, py::arg("attach_fd") = -1,
           py::arg("register_chunk") = 0, py::arg("device") = 0)
      .def_property_readonly("base", [](const kvstore::HostArena& a) { return reinterpret_cast<uint64_t>(a.base()); })
      .def_property_readonly("size", &kvstore::HostArena::size)
      .def_property_readonly("fd", &kvstore::HostArena::fd)
      .def_property_readonly("node", &kvstore::HostArena::node)
      .def_property_readonly("shared", &kvstore::HostArena::shared)
      .def_property_readonly("register_chunk", &kvstore::HostArena::register_chunk)
      .def_property_readonly("numa_method", &kvstore::HostArena::numa_method)
      .def("ensure_registered", &kvstore::HostArena::ensure_registered, py::arg("offset"), py::arg("length"),
           py::call_guard<py::gil_scoped_release>(),
           "Register the chunks overlapping [offset, offset+length) for the GPU; returns bytes newly registered.")
      .def(
          "verify",
          [](const kvstore::HostArena& a, size_t off, size_t len) {
            backend::PlacementCheck c;
            {
              py::gil_scoped_release nogil;
              c = a.verify(off, len);
            }
            return placement_dict(c);
          },
          py::arg("offset"), py::arg("length"))
      .def("stats",
           [](const kvstore::HostArena& a) {
             auto s = a.stats();
             py::dict d;
             d["size"] = s.size;
             d["registered_bytes"] = s.registered_bytes;
             d["registered_chunks"] = s.registered_chunks;
             d["register_failures"] = s.register_failures;
             return d;
           })
      .def("dlpack", [](std::shared_ptr<kvstore::HostArena> a) { return arena_capsule(std::move(a)); },
           "A DLPack capsule of the whole arena as a 1-D uint8 CPU tensor (keeps the arena alive).");
}

}  // namespace cxl::python
