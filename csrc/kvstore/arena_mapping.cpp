#include "kvstore/arena_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "common/units.h"

namespace cxl::kvstore {

namespace {

size_t page_round(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

std::string errno_text() { return std::strerror(errno); }

// The seals every shared pool carries.  Any process holding the fd (every client of a kv-server, an LMCache
// engine) could otherwise ftruncate it: every mapping beyond the new end then raises SIGBUS at its next touch,
// killing the server and every worker on the pool (issue 29, item 2).  SHRINK/GROW fix the size for the fd's
// life; SEAL makes the set final, so no client can lift them.  Writes stay allowed (clients write blocks).
constexpr int kPoolSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

void* map_or_throw(size_t size, int flags, int fd) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, flags | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED)
    throw OutOfMemoryError(size, "kv store: mmap of " + format_bytes(size) + " failed: " + errno_text());
  return p;
}

}  // namespace

ArenaMapping ArenaMapping::create_private(size_t size) {
  if (size == 0) throw_error(ErrorKind::InvalidArgument, "kv store: the arena size must be > 0 bytes");
  ArenaMapping m;
  m.size_ = page_round(size);
  m.p_ = map_or_throw(m.size_, MAP_PRIVATE | MAP_ANONYMOUS, -1);
  return m;
}

ArenaMapping ArenaMapping::create_shared(size_t size, const char* name) {
  if (size == 0) throw_error(ErrorKind::InvalidArgument, "kv store: the arena size must be > 0 bytes");
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) throw_error(ErrorKind::Unavailable, "kv store: memfd_create failed: " + errno_text());
  ArenaMapping m;
  m.fd_ = fd;  // closed by ~ArenaMapping if anything below throws
  m.size_ = page_round(size);
  // ftruncate only: the file stays sparse, so nothing is committed until a
  // block is written (fallocate would commit the whole pool up front).
  if (ftruncate(fd, static_cast<off_t>(m.size_)) != 0)
    throw OutOfMemoryError(m.size_, "kv store: ftruncate of the shared pool to " + format_bytes(m.size_) +
                                        " failed: " + errno_text());
  if (fcntl(fd, F_ADD_SEALS, kPoolSeals) != 0)
    throw_error(ErrorKind::Unavailable, "kv store: sealing the shared pool's size failed: " + errno_text());
  m.p_ = map_or_throw(m.size_, MAP_SHARED, fd);
  return m;
}

ArenaMapping ArenaMapping::attach(int fd) {
  ArenaMapping m;
  m.fd_ = fd;
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0)
    throw_error(ErrorKind::InvalidArgument,
                "kv store: fd " + std::to_string(fd) + " is not a shared-memory pool (a non-empty regular file)");
  // Map only a pool whose size nobody can change: an unsealed fd could be truncated under this mapping by any
  // other holder, and the next touch of a page past the new end would be a SIGBUS in this process.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    throw_error(ErrorKind::InvalidArgument, "kv store: fd " + std::to_string(fd) +
                                                " is not a sealed pool (its size could be changed under the mapping; "
                                                "a kv-server seals F_SEAL_SHRINK|F_SEAL_GROW)");
  m.size_ = static_cast<size_t>(st.st_size);
  m.p_ = map_or_throw(m.size_, MAP_SHARED, fd);
  return m;
}

ArenaMapping::~ArenaMapping() {
  if (p_ && munmap(p_, size_) != 0) note_cleanup_failure("kv store: munmap: " + errno_text());
  if (fd_ >= 0 && close(fd_) != 0) note_cleanup_failure("kv store: close: " + errno_text());
}

}  // namespace cxl::kvstore
