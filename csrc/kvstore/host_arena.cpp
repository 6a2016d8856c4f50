#include "kvstore/host_arena.h"

#include <unistd.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "common/units.h"

namespace cxl::kvstore {

namespace {
// vLLM registers its CPU KV region in chunks of at most 64 GiB because one
// registration fails at >= 512 GiB (docs/sources.md#host-pinning).
constexpr size_t kMaxRegisterChunk = size_t(64) << 30;
}  // namespace

HostArena::HostArena(driver::DriverPtr drv, std::shared_ptr<backend::NumaOps> numa, const ArenaConfig& cfg)
    : drv_(std::move(drv)), numa_(std::move(numa)), cfg_(cfg) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (cfg_.register_chunk > kMaxRegisterChunk || cfg_.register_chunk % page != 0)
    throw_error(ErrorKind::InvalidArgument, "kv store: register_chunk must be a multiple of the page size and at "
                                            "most 64 GiB, not " + format_bytes(cfg_.register_chunk));
  if (cfg_.attach_fd >= 0)
    map_ = ArenaMapping::attach(cfg_.attach_fd);
  else if (cfg_.shared)
    map_ = ArenaMapping::create_shared(cfg_.size, "cxlalloc-kv-pool");
  else
    map_ = ArenaMapping::create_private(cfg_.size);
  // Bind before the first touch: a CPU-less (CXL) node has no local CPU
  // whose first touch would place pages there.  On a shared pool the policy
  // is the file's, so a client binding its own mapping agrees with the
  // server's.
  if (numa_) numa_->bind(map_.base(), map_.size(), cfg_.node);
  if (cfg_.register_chunk > 0) {
    if (!drv_) throw_error(ErrorKind::InvalidArgument, "kv store: GPU registration needs a CUDA driver");
    ctx_ = driver::PrimaryContext(drv_, cfg_.device);
    regs_.resize((map_.size() + cfg_.register_chunk - 1) / cfg_.register_chunk);
  }
}

// Registrations are dropped before the mapping they pin (members are
// destroyed in reverse order, but regs_ needs the context current).
HostArena::~HostArena() {
  if (regs_.empty()) return;
  try {
    driver::ContextGuard g(*drv_, ctx_.get());
    regs_.clear();
  } catch (...) {
    regs_.clear();  // HostRegistration never throws; the guard may have
  }
}

void HostArena::check_range(size_t off, size_t len) const {
  if (off > map_.size() || len > map_.size() - off)
    throw_error(ErrorKind::InvalidArgument, "kv store: range [" + std::to_string(off) + ", +" + std::to_string(len) +
                                                ") is outside the arena of " + format_bytes(map_.size()));
}

size_t HostArena::ensure_registered(size_t off, size_t len) {
  check_range(off, len);
  if (regs_.empty() || len == 0) return 0;
  const size_t chunk = cfg_.register_chunk;
  size_t added = 0;
  std::lock_guard<std::mutex> lk(mu_);
  driver::ContextGuard g(*drv_, ctx_.get());
  for (size_t i = off / chunk; i <= (off + len - 1) / chunk; ++i) {
    if (regs_[i]) continue;
    size_t start = i * chunk, n = std::min(chunk, map_.size() - start);
    try {
      regs_[i] = driver::HostRegistration(drv_, base() + start, n,
                                          CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
    } catch (...) {
      ++register_failures_;
      throw;
    }
    registered_bytes_ += n;
    ++registered_chunks_;
    added += n;
  }
  return added;
}

backend::PlacementCheck HostArena::verify(size_t off, size_t len) const {
  check_range(off, len);
  if (!numa_) throw_error(ErrorKind::Unavailable, "kv store: no NUMA support here: placement cannot be verified");
  return backend::check_placement(*numa_, base() + off, len, cfg_.node);
}

ArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  ArenaStats s;
  s.size = map_.size();
  s.registered_bytes = registered_bytes_;
  s.registered_chunks = registered_chunks_;
  s.register_failures = register_failures_;
  return s;
}

}  // namespace cxl::kvstore
