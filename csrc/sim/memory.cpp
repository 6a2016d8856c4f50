// The simulated address space registry and the simulated GPU's view of it.
#include "sim/memory.h"

#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "sim/numa.h"
#include "sim/state.h"

namespace cxlsim {

namespace {

// Copy with the kernel checking both sides (process_vm_readv on ourselves):
// a bad pageable pointer handed to cuMemcpyAsync becomes an error, not a
// crash of the process in a worker thread.  Falls back to memcpy where the
// syscall is unavailable (seccomp).
bool safe_copy(void* dst, const void* src, size_t n) {
  static std::atomic<int> usable{1};
  if (usable.load(std::memory_order_relaxed)) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    while (n > 0) {
      iovec local{d, n}, remote{const_cast<char*>(s), n};
      ssize_t got = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
      if (got > 0) {
        d += got;
        s += got;
        n -= static_cast<size_t>(got);
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == ENOSYS || errno == EPERM)) {
        usable.store(0, std::memory_order_relaxed);
        std::memmove(d, s, n);
        return true;
      }
      return false;
    }
    return true;
  }
  std::memmove(dst, src, n);
  return true;
}

// Copy between two span lists of equal total length.
bool copy_spans(const std::vector<Span>& dst, const std::vector<Span>& src) {
  size_t di = 0, si = 0, doff = 0, soff = 0;
  while (di < dst.size() && si < src.size()) {
    size_t n = std::min(dst[di].n - doff, src[si].n - soff);
    if (!safe_copy(dst[di].p + doff, src[si].p + soff, n)) return false;
    doff += n;
    soff += n;
    if (doff == dst[di].n) ++di, doff = 0;
    if (soff == src[si].n) ++si, soff = 0;
  }
  return true;
}

template <typename M>
bool whole_range_in(M& m, uint64_t addr, uint64_t end, const char* what, std::vector<Span>* out,
                    std::string* why, bool* found) {
  auto it = containing(m, addr);
  if (it == m.end()) return true;
  *found = true;
  if (end > it->first + it->second.size) {
    *why = "range " + hex(addr) + "+" + std::to_string(end - addr) + " runs past the end of its " + what + " (" +
           hex(it->first) + "+" + std::to_string(it->second.size) + ")";
    return false;
  }
  out->push_back(Span{reinterpret_cast<char*>(addr), static_cast<size_t>(end - addr), nullptr});
  return true;
}

}  // namespace

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

Backing::~Backing() {
  if (base_) munmap(base_, len_);
}

std::shared_ptr<Backing> map_anonymous(size_t len) {
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  return std::make_shared<Backing>(p, len);
}

PhysAlloc::~PhysAlloc() {
  if (fd >= 0) close(fd);
}

Registry& registry() {
  static Registry* r = new Registry();  // leaked on purpose: workers may run during exit
  return *r;
}

bool charge_vram(Registry& r, int dev, uint64_t bytes) {
  uint64_t cap = config()->vram;
  if (bytes > cap || r.vram_used[dev] > cap - bytes) return false;
  r.vram_used[dev] += bytes;
  return true;
}

void uncharge_vram(Registry& r, int dev, uint64_t bytes) {
  r.vram_used[dev] = bytes > r.vram_used[dev] ? 0 : r.vram_used[dev] - bytes;
}

void maybe_free_phys(Registry& r, const std::shared_ptr<PhysAlloc>& phys) {
  if (!phys->released || phys->maps > 0) return;
  if (phys->type == CU_MEM_LOCATION_TYPE_DEVICE)
    uncharge_vram(r, phys->device, phys->size);
  else
    r.host_tier_bytes -= phys->size;
  r.handles.erase(phys->handle);
}

CUresult resolve(uint64_t addr, uint64_t n, bool write, Agent agent, int device, std::vector<Span>* out,
                 std::string* why) {
  out->clear();
  if (n == 0) return CUDA_SUCCESS;
  uint64_t end = addr + n;
  if (end < addr || addr == 0) {
    *why = "range " + hex(addr) + "+" + std::to_string(n) + " is not a valid address range";
    return CUDA_ERROR_INVALID_VALUE;
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);

  auto res = containing(r.reservations, addr);
  if (res != r.reservations.end()) {
    if (end > res->first + res->second.size) {
      *why = "range " + hex(addr) + "+" + std::to_string(n) + " runs past the end of its VA reservation";
      return CUDA_ERROR_INVALID_VALUE;
    }
    const uint8_t need = write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
    for (uint64_t cur = addr; cur < end;) {
      auto m = containing(r.mappings, cur);
      if (m == r.mappings.end()) {
        *why = "address " + hex(cur) + " is reserved but not mapped (cuMemMap missing, or already unmapped)";
        return CUDA_ERROR_INVALID_VALUE;
      }
      const Mapping& map = m->second;
      if ((map.dev_access[device] & need) != need) {
        *why = "mapping at " + hex(map.va) + " grants device " + std::to_string(device) + " no " +
               (write ? "write" : "read") + " access (cuMemSetAccess missing?)";
        return CUDA_ERROR_INVALID_VALUE;
      }
      uint64_t piece = std::min(end, map.va + map.size) - cur;
      out->push_back(Span{map.phys->view->base() + map.offset + (cur - map.va), static_cast<size_t>(piece),
                          map.phys->view});
      cur += piece;
    }
    return CUDA_SUCCESS;
  }

  // Other allocations must contain the whole range: CUDA never lets one
  // access run from one allocation into another.
  bool found = false;
  auto with_keep = [&](auto& m, const char* what) {
    auto it = containing(m, addr);
    if (it == m.end()) return true;
    found = true;
    if (end > it->first + it->second.size) {
      *why = "range " + hex(addr) + "+" + std::to_string(n) + " runs past the end of its " + what + " (" +
             hex(it->first) + "+" + std::to_string(it->second.size) + ")";
      return false;
    }
    out->push_back(Span{reinterpret_cast<char*>(addr), static_cast<size_t>(n), it->second.mem});
    return true;
  };
  if (!with_keep(r.dev_allocs, "cuMemAlloc allocation")) return CUDA_ERROR_INVALID_VALUE;
  if (!found && !with_keep(r.managed, "managed allocation")) return CUDA_ERROR_INVALID_VALUE;
  if (!found && !with_keep(r.host_allocs, "cuMemHostAlloc allocation")) return CUDA_ERROR_INVALID_VALUE;
  if (!found) {
    auto reg = containing(r.registrations, addr);
    if (reg != r.registrations.end() && write && (reg->second.flags & CU_MEMHOSTREGISTER_READ_ONLY)) {
      *why = "registration at " + hex(reg->first) + " is read-only for the device";
      return CUDA_ERROR_INVALID_VALUE;
    }
    if (!whole_range_in(r.registrations, addr, end, "host registration", out, why, &found))
      return CUDA_ERROR_INVALID_VALUE;
  }
  if (found) return CUDA_SUCCESS;

  // Plain (pageable) host memory.
  if (overlaps(r.reservations, addr, end) || overlaps(r.dev_allocs, addr, end) || overlaps(r.managed, addr, end) ||
      overlaps(r.host_allocs, addr, end) || overlaps(r.registrations, addr, end)) {
    *why = "range " + hex(addr) + "+" + std::to_string(n) + " runs from unknown memory into a driver allocation";
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (agent == Agent::Kernel && attribute(device, CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS) == 0) {
    *why = "address " + hex(addr) +
           " is pageable host memory the device cannot access (not registered, not a driver allocation, and "
           "CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0)";
    return CUDA_ERROR_INVALID_VALUE;
  }
  out->push_back(Span{reinterpret_cast<char*>(addr), static_cast<size_t>(n), nullptr});
  return CUDA_SUCCESS;
}

CUresult device_copy(uint64_t dst, uint64_t src, uint64_t n, int device, std::string* why) {
  std::vector<Span> d, s;
  CUresult r = resolve(src, n, false, Agent::Copy, device, &s, why);
  if (r == CUDA_SUCCESS) r = resolve(dst, n, true, Agent::Copy, device, &d, why);
  if (r != CUDA_SUCCESS) return r;
  if (!copy_spans(d, s)) {
    *why = "host memory in " + hex(src) + "+" + std::to_string(n) + " or " + hex(dst) + "+" + std::to_string(n) +
           " is not mapped in the process";
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult device_write_u64(uint64_t dst, uint64_t value, int device, std::string* why) {
  std::vector<Span> d;
  CUresult r = resolve(dst, sizeof value, true, Agent::Kernel, device, &d, why);
  if (r != CUDA_SUCCESS) return r;
  std::vector<Span> s{Span{reinterpret_cast<char*>(&value), sizeof value, nullptr}};
  if (!copy_spans(d, s)) {
    *why = "address " + hex(dst) + " is not mapped in the process";
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

bool overlaps_simulated_memory(uint64_t b, uint64_t e) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  return overlaps(r.reservations, b, e) || overlaps(r.dev_allocs, b, e) || overlaps(r.managed, b, e) ||
         overlaps(r.host_allocs, b, e);
}

bool simulated_host_node(uint64_t p, int* node) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  *node = -1;
  if (containing(r.reservations, p) != r.reservations.end()) {
    auto m = containing(r.mappings, p);
    if (m != r.mappings.end() && m->second.phys->host_tier()) *node = m->second.phys->node;
    return true;
  }
  if (containing(r.dev_allocs, p) != r.dev_allocs.end()) return true;
  auto ma = containing(r.managed, p);
  if (ma != r.managed.end()) {
    const ManagedPages* pg = ma->second.pages.find(p);
    if (pg && pg->resident_device < 0) {
      if (pg->host_node >= 0)
        *node = pg->host_node;
      else if (pg->preferred.type == CU_MEM_LOCATION_TYPE_HOST_NUMA)
        *node = pg->preferred.id;  // first touch lands on the preferred node
    }
    return true;
  }
  auto ha = containing(r.host_allocs, p);
  if (ha != r.host_allocs.end()) {
    *node = ha->second.node;
    return true;
  }
  return false;
}

void live_memory(cxlsim_live_t* out) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  out->phys_handles = r.handles.size();
  out->device_bytes = 0;
  for (uint64_t v : r.vram_used) out->device_bytes += v;
  out->host_numa_bytes = r.host_tier_bytes;
  out->reservations = r.reservations.size();
  out->mappings = r.mappings.size();
  out->managed_allocs = r.managed.size();
  out->device_allocs = r.dev_allocs.size();
  out->host_allocs = r.host_allocs.size();
  out->registrations = r.registrations.size();
}

void reset_memory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (auto& v : r.vram_used) v = 0;
  r.host_tier_bytes = 0;
}

}  // namespace cxlsim
