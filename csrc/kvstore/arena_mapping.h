// The address range behind the KV reuse store: private anonymous memory, or
// a shared-memory file (memfd) that a kv-server hands to its clients.
#pragma once

#include <cstddef>
#include <utility>

namespace cxl::kvstore {

// One mmap of `size` bytes, reserved but not committed (MAP_NORESERVE, a
// sparse memfd): pages are allocated by the kernel when first written, so a
// store far larger than the memory in use starts at once.  Owns the mapping
// and, for a shared one, its file descriptor.
class ArenaMapping {
 public:
  ArenaMapping() = default;
  // Private anonymous memory of `size` bytes (rounded up to the page size).
  // Throws cxl::Error(OutOfMemory) with the errno text when mmap fails.
  static ArenaMapping create_private(size_t size);
  // A new memfd of `size` bytes (sparse: ftruncate, no fallocate), sealed
  // against shrinking and growing (F_SEAL_SHRINK|GROW|SEAL: no holder of the
  // fd can truncate it under another's mapping), mapped MAP_SHARED.  `name`
  // shows in /proc/<pid>/fd.  Throws Error(OutOfMemory) or Error(Unavailable)
  // (memfd_create or sealing refused) with the errno text.
  static ArenaMapping create_shared(size_t size, const char* name);
  // Map an existing shared-memory fd (received from a kv-server) whole; the
  // size is the file's.  Takes ownership of `fd` (closes it on failure too).
  // Throws Error(InvalidArgument) for an fd that is not a mappable regular
  // file or whose size is not sealed (F_SEAL_SHRINK|F_SEAL_GROW), since a
  // truncation by another holder would SIGBUS this process; Error(OutOfMemory)
  // when mmap fails.
  static ArenaMapping attach(int fd);

  ~ArenaMapping();
  ArenaMapping(ArenaMapping&& o) noexcept { swap(o); }
  ArenaMapping& operator=(ArenaMapping&& o) noexcept {
    ArenaMapping(static_cast<ArenaMapping&&>(o)).swap(*this);
    return *this;
  }
  ArenaMapping(const ArenaMapping&) = delete;
  ArenaMapping& operator=(const ArenaMapping&) = delete;

  void* base() const { return p_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }  // -1 for private memory
  bool shared() const { return fd_ >= 0; }

  void swap(ArenaMapping& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(size_, o.size_);
    std::swap(fd_, o.fd_);
  }

 private:
  void* p_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace cxl::kvstore
