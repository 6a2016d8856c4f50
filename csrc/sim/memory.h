// The simulated address space: every range the driver hands out, in one
// registry, plus what the simulated GPU sees when it touches an address.
//
// Memory model (see cxlsim.h for the contract):
//  * cuMemAddressReserve -> a PROT_NONE, MAP_NORESERVE reservation.
//  * cuMemCreate -> a memfd (never touched, so free until used) plus a
//    private read-write "view" of it: the physical pages as the GPU's copy
//    engine sees them.  HOST_NUMA/HOST handles bind the memfd's pages (shared
//    policy) to the real node backing the simulated node.
//  * cuMemMap -> the memfd mapped MAP_SHARED|MAP_FIXED into the reservation,
//    PROT_NONE; cuMemSetAccess sets the CPU protection, so a CPU touch
//    without access granted is a real SIGSEGV.  The CPU protection of a
//    device allocation follows the access granted to any device (the CPU
//    stands in for kernels in tests); that of a host allocation follows the
//    access granted to a host location, as on real hardware.
//  * cuMemAlloc, cuMemAllocManaged, cuMemHostAlloc -> anonymous
//    MAP_NORESERVE pages, read-write.
//  * The simulated GPU (copies, cxlsim_stream_write_u64) reaches memory only
//    through resolve(), which enforces mapping and per-device access at the
//    moment the work runs, so stream work that outlives cuMemUnmap or lacks
//    cuMemSetAccess is reported, not silently performed.
//
// Locking: Registry::mu guards everything in the registry.  The executor
// mutex may be taken while holding it (cuMemPrefetchAsync enqueues under it
// so the residency it records and the stream operation agree), never the
// reverse: stream workers drop the executor mutex before touching memory.
// numa.cpp's record lock is only taken after releasing it.  Backings are
// shared_ptr so stream work keeps pages alive while it copies without
// holding the lock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sim/api.h"
#include "sim/config.h"
#include "sim/range_map.h"

namespace cxlsim {

// A host mapping the simulator owns; unmapped when its last owner drops it.
class Backing {
 public:
  Backing(void* base, size_t len) : base_(base), len_(len) {}
  ~Backing();
  Backing(const Backing&) = delete;
  Backing& operator=(const Backing&) = delete;
  char* base() const { return static_cast<char*>(base_); }
  size_t len() const { return len_; }

 private:
  void* base_;
  size_t len_;
};

// Anonymous read-write MAP_NORESERVE pages, or nullptr.
std::shared_ptr<Backing> map_anonymous(size_t len);

// Physical memory from cuMemCreate.
struct PhysAlloc {
  CUmemGenericAllocationHandle handle = 0;
  size_t size = 0;
  CUmemLocationType type = CU_MEM_LOCATION_TYPE_INVALID;  // DEVICE, HOST_NUMA or HOST
  int device = -1;  // DEVICE: owning GPU
  int node = -1;    // HOST_NUMA/HOST: simulated host node of the pages
  int fd = -1;
  std::shared_ptr<Backing> view;  // the pages as the simulated GPU reaches them
  bool released = false;          // cuMemRelease called; freed when maps == 0
  int maps = 0;

  ~PhysAlloc();
  bool host_tier() const { return type != CU_MEM_LOCATION_TYPE_DEVICE; }
};

struct Mapping {
  uint64_t va = 0, size = 0, offset = 0;
  std::shared_ptr<PhysAlloc> phys;
  uint8_t dev_access[kMaxDevices] = {};  // CUmemAccess_flags per device
  uint8_t host_access = 0;               // CUmemAccess_flags for the CPU
};

struct Reservation {
  uint64_t base = 0, size = 0;
};

struct DevAlloc {  // cuMemAlloc
  uint64_t base = 0, size = 0, charged = 0;
  int device = 0;
  std::shared_ptr<Backing> mem;
};

// Per-page state of managed memory (cuMemAdvise / cuMemPrefetchAsync).
struct ManagedPages {
  CUmemLocation preferred{CU_MEM_LOCATION_TYPE_INVALID, 0};
  CUmemLocation last_prefetch{CU_MEM_LOCATION_TYPE_INVALID, 0};
  uint64_t accessed_by = 0;  // bit d: device d; bit kCpuBit: the host
  bool read_mostly = false;
  int resident_device = -1;  // device whose VRAM holds the pages, or -1
  int host_node = -1;        // simulated node the pages were prefetched to, or -1

  static constexpr int kCpuBit = 63;
  bool operator==(const ManagedPages& o) const {
    return preferred.type == o.preferred.type && preferred.id == o.preferred.id &&
           last_prefetch.type == o.last_prefetch.type && last_prefetch.id == o.last_prefetch.id &&
           accessed_by == o.accessed_by && read_mostly == o.read_mostly && resident_device == o.resident_device &&
           host_node == o.host_node;
  }
};

struct ManagedAlloc {
  uint64_t base = 0, size = 0;  // size rounded up to whole pages
  int device = 0;
  std::shared_ptr<Backing> mem;
  RangeMap<ManagedPages> pages;  // covers [base, base+size) at all times
};

struct HostAlloc {  // cuMemHostAlloc
  uint64_t base = 0, size = 0;
  unsigned flags = 0;
  int node = -1;
  int device = 0;
  std::shared_ptr<Backing> mem;
};

struct Registration {  // cuMemHostRegister
  uint64_t base = 0, size = 0;
  unsigned flags = 0;
  int device = 0;
};

struct Registry {
  std::mutex mu;
  std::map<CUmemGenericAllocationHandle, std::shared_ptr<PhysAlloc>> handles;  // not yet freed
  std::map<uint64_t, Reservation> reservations;
  std::map<uint64_t, Mapping> mappings;
  std::map<uint64_t, DevAlloc> dev_allocs;
  std::map<uint64_t, ManagedAlloc> managed;
  std::map<uint64_t, HostAlloc> host_allocs;
  std::map<uint64_t, Registration> registrations;
  uint64_t vram_used[kMaxDevices] = {};
  uint64_t host_tier_bytes = 0;
  CUmemGenericAllocationHandle next_handle = 0x100000;
};

// The process-wide registry (never destroyed, so stream workers may use it
// during exit).
Registry& registry();

// The entry of a base-keyed map whose [base, base+size) contains x, or end().
template <typename M>
typename M::iterator containing(M& m, uint64_t x) {
  auto it = m.upper_bound(x);
  if (it == m.begin()) return m.end();
  --it;
  const auto& v = it->second;
  uint64_t base = it->first, size = v.size;
  return x - base < size ? it : m.end();
}

// True when some entry of a base-keyed map overlaps [b, e).
template <typename M>
bool overlaps(const M& m, uint64_t b, uint64_t e) {
  auto it = m.lower_bound(e);  // first entry starting at or after e
  if (it == m.begin()) return false;
  --it;
  return it->first + it->second.size > b;
}

// VRAM accounting (Registry::mu held).  charge() fails without side effects
// when `bytes` does not fit in device `dev`'s configured capacity.
bool charge_vram(Registry& r, int dev, uint64_t bytes);
void uncharge_vram(Registry& r, int dev, uint64_t bytes);

// Drop one mapping of `phys` / a release; frees the allocation (VRAM or host
// bytes, the handle) when it was released and has no mapping left.
void maybe_free_phys(Registry& r, const std::shared_ptr<PhysAlloc>& phys);

// Who touches the memory: the copy engine may read and write pageable host
// memory (the driver stages it); kernels only memory the device can address.
enum class Agent { Copy, Kernel };

// A piece of a resolved device range: where its bytes live in this process.
struct Span {
  char* p;
  size_t n;
  std::shared_ptr<Backing> keep;  // keeps simulator-owned pages alive
};

// Resolve [addr, addr+n) as device `device` accessing it (`write`: needs
// write access) into host spans.  CUDA_ERROR_INVALID_VALUE with *why when any
// byte is not accessible to the device.  Takes Registry::mu.
CUresult resolve(uint64_t addr, uint64_t n, bool write, Agent agent, int device, std::vector<Span>* out,
                 std::string* why);

// Copy / store as the simulated GPU `device` would, re-resolving the ranges
// now.  CUDA_ERROR_INVALID_VALUE with *why on an inaccessible byte.
CUresult device_copy(uint64_t dst, uint64_t src, uint64_t n, int device, std::string* why);
CUresult device_write_u64(uint64_t dst, uint64_t value, int device, std::string* why);

// True when [b, e) overlaps any range the simulator owns (reservations,
// device/managed/host allocations).  Registrations are user memory and do
// not count.
bool overlaps_simulated_memory(uint64_t b, uint64_t e);
// The simulated host node of simulator-owned memory at p (-1 for device
// memory); false when p is not simulator-owned.
bool simulated_host_node(uint64_t p, int* node);

// Fill the memory fields of cxlsim_live_t.
void live_memory(cxlsim_live_t* out);
// Forget every allocation (only used when nothing is live).
void reset_memory();

// "0x7f..." for messages.
std::string hex(uint64_t v);

}  // namespace cxlsim
