#include "backend/host_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::backend {

HostPages::HostPages(size_t size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw OutOfMemoryError(size, "mmap of " + format_bytes(size) + " of host memory failed: " + std::strerror(errno));
  p_ = p;
  size_ = size;
}

HostPages::~HostPages() {
  if (p_ && munmap(p_, size_) != 0) note_cleanup_failure(std::string("munmap: ") + std::strerror(errno));
}

HostPages& HostPages::operator=(HostPages&& o) noexcept {
  if (this != &o) {
    HostPages tmp(std::move(o));
    std::swap(p_, tmp.p_);
    std::swap(size_, tmp.size_);
  }
  return *this;
}

void touch_pages(void* p, size_t size) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  volatile char* c = static_cast<volatile char*>(p);
  for (size_t off = 0; off < size; off += page) c[off] = 0;
}

}  // namespace cxl::backend
