// CxlAllocator: allocation, frees, streams, and the OutOfMemoryError path.
#include <cstdio>
#include <optional>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "allocator.h"

namespace cxlt {

namespace {
std::atomic<CxlAllocator*> g_instance{nullptr};

// The deleter of every DataPtr we return: a plain function, so that torch's
// "is this pointer ours" checks (recordStream, getBaseAllocation) and frees
// after the Python objects are gone (interpreter shutdown) both work.
void delete_fn(void* ptr) {
  if (CxlAllocator* a = CxlAllocator::instance()) a->free_noexcept(ptr);
}

// While a capture may be underway, engine calls that create or map memory
// must not be "unsafe" for a capturing thread in global capture mode
// (cudaStreamCaptureModeGlobal would invalidate the capture).  torch's
// native allocator does the same around cudaMalloc during capture.
struct MaybeRelaxed {
  std::optional<c10::cuda::CUDAStreamCaptureModeGuard> guard;
  explicit MaybeRelaxed(bool on) {
    if (on) guard.emplace(cudaStreamCaptureModeRelaxed);
  }
};
}  // namespace

std::string format_size(size_t bytes) {
  char buf[64];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
    return buf;
  }
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int i = -1;
  do {
    v /= 1024.0;
    ++i;
  } while (v >= 1024.0 && i < 4);
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[i]);
  return buf;
}

CxlAllocator* CxlAllocator::instance() { return g_instance.load(std::memory_order_acquire); }
void CxlAllocator::set_instance(CxlAllocator* a) { g_instance.store(a, std::memory_order_release); }

// The base class wants alloc/free functions; they are never called because
// every path that would call them is overridden here.
CxlAllocator::CxlAllocator(const CApi& c)
    : Base(
          [](size_t, int, cudaStream_t) -> void* {
            TORCH_CHECK(false, "cxlalloc: internal error: CUDAPluggableAllocator::malloc reached");
          },
          [](void*, size_t, int, cudaStream_t) {}),
      c_(c) {}

void CxlAllocator::fail(const std::string& what) const {
  TORCH_CHECK(false, "cxlalloc: ", what, ": ", c_.error());
}

void* CxlAllocator::alloc(size_t nbytes, int device, cudaStream_t stream) {
  if (nbytes == 0) return nullptr;
  // The stack is gathered before any lock is taken (it may take the GIL).
  auto context = history_.gather(CDA::RecordContext::STATE);
  void* p = nullptr;
  {
    MaybeRelaxed relaxed(capture_possible());
    p = c_.malloc(nbytes, device, stream);
  }
  if (!p) fail_alloc(nbytes, device, stream);
  registry_.insert(p, Allocation{device, nbytes, stream, context});
  history_.record(CDA::TraceEntry::ALLOC, device, reinterpret_cast<uintptr_t>(p), nbytes, stream, {0, 0},
                  history_.trace_stacks(CDA::RecordContext::ALLOC) ? context : nullptr);
  return p;
}

void CxlAllocator::notify_oom(int device, size_t nbytes, size_t device_free) {
  std::vector<CCA::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lk(observers_mu_);
    observers = oom_observers_;
  }
  // No lock of ours is held: observers are often Python callbacks.
  size_t limit = c_.device_limit(device);
  for (const auto& o : observers) o(device, nbytes, limit, device_free);
}

void CxlAllocator::fail_alloc(size_t nbytes, int device, cudaStream_t stream) {
  const int kind = c_.last_error_kind();
  const std::string why = c_.error();
  if (kind != CXLALLOC_E_OUT_OF_MEMORY && kind != CXLALLOC_E_CAPTURE)
    TORCH_CHECK(false, "cxlalloc: allocating ", format_size(nbytes), " on cuda:", device, " failed: ", why);

  // What the driver says is free, like torch's message (skipped while a
  // capture may be underway: the query is not capture-safe everywhere).
  size_t free_b = 0, total_b = 0;
  std::string gpu_line;
  if (!capture_possible()) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      gpu_line = "GPU " + std::to_string(device) + " has a total capacity of " + format_size(total_b) +
                 " of which " + format_size(free_b) + " is free. ";
    else
      (void)cudaGetLastError();  // not sticky: clear it
  }
  history_.record(CDA::TraceEntry::OOM, device, free_b, nbytes, stream, {0, 0},
                  history_.gather(CDA::RecordContext::ALLOC));
  notify_oom(device, nbytes, free_b);
  // The message starts like torch's so that tools matching "CUDA out of
  // memory." (accelerate's batch-size finder) keep working (case C08).
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", format_size(nbytes),
                   kind == CXLALLOC_E_CAPTURE ? " during CUDA graph capture" : "", ". ", gpu_line, why);
}

c10::DataPtr CxlAllocator::allocate(size_t nbytes) {
  c10::DeviceIndex device = c10::cuda::current_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  void* p = alloc(nbytes, device, stream);
  return {p, p, &delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr CxlAllocator::raw_deleter() const { return &delete_fn; }

void* CxlAllocator::raw_alloc(size_t nbytes) {
  c10::DeviceIndex device = c10::cuda::current_device();
  return alloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* CxlAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  return alloc(nbytes, c10::cuda::current_device(), stream);
}

void CxlAllocator::release(void* ptr, bool from_deleter) {
  if (ptr == nullptr) return;
  std::optional<Allocation> a = registry_.erase(ptr);
  if (!a) {
    // Nothing is freed: the engine would refuse it anyway, and a pointer we
    // never returned must not reach any tier's free (case C12).
    if (from_deleter) {
      std::fprintf(stderr, "cxlalloc: warning: free of %p, which cxlalloc did not allocate (ignored)\n", ptr);
      return;
    }
    TORCH_CHECK(false, "cxlalloc: free of ", ptr, ", which cxlalloc did not allocate");
  }
  auto context = history_.gather(CDA::RecordContext::ALL);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  history_.record(CDA::TraceEntry::FREE_REQUESTED, a->device, addr, a->size, a->stream, {0, 0}, context);
  {
    MaybeRelaxed relaxed(capture_possible());
    c_.free(ptr, a->size, a->device, a->stream);  // reports its own errors; returns void
  }
  history_.record(CDA::TraceEntry::FREE_COMPLETED, a->device, addr, a->size, a->stream, {0, 0}, context);
}

void CxlAllocator::raw_delete(void* ptr) { release(ptr, false); }

void CxlAllocator::free_noexcept(void* ptr) noexcept {
  try {
    release(ptr, true);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "cxlalloc: warning: free of %p failed: %s\n", ptr, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cxlalloc: warning: free of %p failed: %s\n", ptr, e.what());
  } catch (...) {
    std::fprintf(stderr, "cxlalloc: warning: free of %p failed (unknown exception)\n", ptr);
  }
}

void CxlAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  // torch calls this for every CUDA tensor, including ones from other
  // allocators (IPC, DLPack imports): those are not ours to track.
  if (!ptr.get() || ptr.get_deleter() != &delete_fn) return;
  if (c_.record_stream(ptr.get(), stream.stream()) != 0) fail("record_stream");
}

void* CxlAllocator::getBaseAllocation(void* ptr, size_t* size) {
  // cxlalloc has no IPC-shareable base segments (shareIpcHandle refuses),
  // so an allocation is its own base.
  std::optional<Allocation> a = registry_.find(ptr);
  TORCH_CHECK(a.has_value(), "cxlalloc: getBaseAllocation: ", ptr, " is not a live cxlalloc allocation");
  if (size) *size = a->size;
  return ptr;
}

}  // namespace cxlt
