// NumaOps on the real kernel, through raw syscalls.
//
// Why raw syscalls: <numaif.h>/libnuma-dev is often absent (it is on the CI
// machine), and the three calls we need are stable ABI.  Constants come from
// <linux/mempolicy.h>.
#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "backend/placement.h"
#include "common/error.h"
#include "common/units.h"

namespace cxl::backend {

namespace {

// The kernel rejects node masks wider than a page of bits (get_nodes()); no
// real machine has nodes near this.
constexpr int kMaxNodeId = 32767;
// Pages per move_pages()/mincore() call: bounded buffers for any range size.
constexpr size_t kChunkPages = 4096;

size_t page_size() {
  static const size_t ps = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ps;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// "EINVAL: Invalid argument"
std::string errno_text(int e) {
  static const std::pair<int, const char*> names[] = {
      {EINVAL, "EINVAL"}, {EFAULT, "EFAULT"}, {EPERM, "EPERM"},   {ENOSYS, "ENOSYS"},
      {EIO, "EIO"},       {ENOMEM, "ENOMEM"}, {EACCES, "EACCES"}, {ESRCH, "ESRCH"}};
  for (const auto& [code, name] : names)
    if (code == e) return std::string(name) + ": " + std::strerror(e);
  return "errno " + std::to_string(e) + ": " + std::strerror(e);
}

class LinuxNumaOps final : public NumaOps {
 public:
  void bind(void* p, size_t len, int node) override {
    if (len == 0) return;
    const std::string what = "numa_bind: mbind(MPOL_BIND, node " + std::to_string(node) + ") of " +
                             format_bytes(len) + " at " + hex(p);
    if (p == nullptr) throw Error(ErrorKind::InvalidArgument, what + ": null address");
    if (reinterpret_cast<uintptr_t>(p) % page_size() != 0)
      throw Error(ErrorKind::InvalidArgument,
                  what + ": address is not page-aligned (page size " + std::to_string(page_size()) + " bytes)");
    if (node < 0 || node > kMaxNodeId)
      throw Error(ErrorKind::InvalidArgument, what + ": node id out of range 0.." + std::to_string(kMaxNodeId));

    const size_t bits_per_word = 8 * sizeof(unsigned long);
    std::vector<unsigned long> mask(static_cast<size_t>(node) / bits_per_word + 1, 0);
    mask[static_cast<size_t>(node) / bits_per_word] |= 1UL << (static_cast<size_t>(node) % bits_per_word);
    // maxnode is one more than the mask's bit count: the kernel's get_nodes()
    // historically drops the last bit (libnuma passes the same +1).
    unsigned long maxnode = mask.size() * bits_per_word + 1;
    long r = syscall(SYS_mbind, p, len, MPOL_BIND, mask.data(), maxnode, MPOL_MF_STRICT | MPOL_MF_MOVE);
    if (r == 0) return;
    int e = errno;
    std::string msg = what + " failed: " + errno_text(e);
    switch (e) {
      case EINVAL:
        throw Error(ErrorKind::InvalidArgument,
                    msg + ": node " + std::to_string(node) + " is not an online NUMA node with memory");
      case EFAULT:
        throw Error(ErrorKind::InvalidArgument, msg + ": the range is not mapped in this process");
      case EIO:
        throw Error(ErrorKind::Unavailable,
                    msg + ": pages already in the range could not be moved to node " + std::to_string(node));
      case EPERM:
        throw Error(ErrorKind::Unavailable,
                    msg + ": memory policies are not permitted here (seccomp, e.g. a container "
                          "without CAP_SYS_NICE)");
      case ENOSYS:
        throw Error(ErrorKind::Unavailable, msg + ": the kernel has no NUMA support (CONFIG_NUMA off)");
      default:
        throw Error(ErrorKind::Unavailable, msg);
    }
  }

  std::map<int, size_t> page_nodes(const void* p, size_t len) override {
    std::map<int, size_t> out;
    if (len == 0) return out;
    const std::string what = "page_nodes: " + format_bytes(len) + " at " + hex(p);
    if (p == nullptr) throw Error(ErrorKind::InvalidArgument, what + ": null address");
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    if (len > UINTPTR_MAX - begin) throw Error(ErrorKind::InvalidArgument, what + ": range wraps around");
    const uintptr_t end = begin + len;
    const size_t ps = page_size();
    const uintptr_t first = begin - begin % ps;

    std::vector<void*> pages;
    std::vector<int> status;
    std::vector<unsigned char> resident;
    pages.reserve(kChunkPages);
    for (uintptr_t chunk = first; chunk < end; chunk += kChunkPages * ps) {
      uintptr_t chunk_end = std::min<uintptr_t>(end, chunk + kChunkPages * ps);
      size_t n = (chunk_end - chunk + ps - 1) / ps;
      // mincore() fails with ENOMEM on unmapped pages without faulting
      // anything in; move_pages() would report them as -EFAULT, the same
      // as the zero page, and hide the caller's bug.
      resident.resize(n);
      if (mincore(reinterpret_cast<void*>(chunk), n * ps, resident.data()) != 0) {
        int e = errno;
        if (e == ENOMEM)
          throw Error(ErrorKind::InvalidArgument, what + ": part of the range is not mapped in this process");
        throw Error(ErrorKind::Unavailable, what + ": mincore failed: " + errno_text(e));
      }
      pages.clear();
      for (size_t i = 0; i < n; ++i) pages.push_back(reinterpret_cast<void*>(chunk + i * ps));
      status.assign(n, 0);
      // nodes == NULL: report each page's node (or -errno) without moving it.
      long r = syscall(SYS_move_pages, 0, n, pages.data(), nullptr, status.data(), 0);
      if (r != 0) {
        int e = r < 0 ? errno : 0;
        std::string hint = e == EPERM    ? ": not permitted here (seccomp, e.g. a container without CAP_SYS_NICE)"
                           : e == ENOSYS ? ": the kernel has no NUMA support (CONFIG_NUMA off)"
                                         : "";
        throw Error(ErrorKind::Unavailable,
                    what + ": move_pages status query failed: " + (r < 0 ? errno_text(e) : "returned " + std::to_string(r)) + hint);
      }
      for (size_t i = 0; i < n; ++i) {
        uintptr_t pb = std::max<uintptr_t>(begin, chunk + i * ps);
        uintptr_t pe = std::min<uintptr_t>(end, chunk + (i + 1) * ps);
        // Negative status: -ENOENT (never touched), -EFAULT (zero page), ...
        int node = status[i] >= 0 ? status[i] : -1;
        out[node] += static_cast<size_t>(pe - pb);
      }
    }
    return out;
  }

  std::string method() const override { return "move_pages"; }
};

}  // namespace

std::unique_ptr<NumaOps> linux_numa_ops() { return std::make_unique<LinuxNumaOps>(); }

}  // namespace cxl::backend
