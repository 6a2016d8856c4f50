// Anonymous host pages (mmap/munmap) owned RAII-style: the raw memory of the
// `pinned` backend before it is bound to a NUMA node and registered.
#pragma once

#include <cstddef>

namespace cxl::backend {

class HostPages {
 public:
  HostPages() = default;
  // mmap `size` bytes (a multiple of the page size), not yet touched.
  // Throws cxl::Error(OutOfMemory) with the errno text on failure.
  explicit HostPages(size_t size);
  ~HostPages();
  HostPages(HostPages&& o) noexcept : p_(o.p_), size_(o.size_) { o.p_ = nullptr, o.size_ = 0; }
  HostPages& operator=(HostPages&& o) noexcept;
  HostPages(const HostPages&) = delete;
  HostPages& operator=(const HostPages&) = delete;
  void* get() const { return p_; }
  size_t size() const { return size_; }

 private:
  void* p_ = nullptr;
  size_t size_ = 0;
};

// Fault every page in (write one byte per page) so the NUMA policy applied
// before takes effect now, not at the GPU's first access.
void touch_pages(void* p, size_t size);

}  // namespace cxl::backend
