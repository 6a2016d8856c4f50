// The per-device tiered caching allocator.
//
// One instance per GPU.  A best-fit block cache with split/merge and
// stream-ordered reuse (torch's CUDACachingAllocator semantics) sits on top
// of segments that come from two tiers: VRAM and host memory on one NUMA node.
// The policy (csrc/policy) decides the tier of each new segment, what to
// demote when VRAM is short and what to promote when it has room again.
//
// Thread safety: every public method takes the allocator's mutex, and binds
// the device's primary context for its driver calls, so it may be called
// from any thread (Python GC, torch deleters, worker threads).
//
// Order of resort when a request does not fit (compare torch's native order,
// docs/sources.md#torch-oom-order): cached block -> new segment on
// the first-choice tier -> wait for stream-pending frees (all of them, not
// FIFO: case C06) -> release cached free segments (C11) -> demote cold KV
// (for non-KV requests) -> the host tier (spill) -> OutOfMemoryError.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "alloc/block.h"
#include "alloc/block_cache.h"
#include "alloc/pending_frees.h"
#include "alloc/segment.h"
#include "alloc/stats.h"
#include "alloc/tier_limits.h"
#include "backend/backends.h"
#include "backend/placement.h"
#include "backend/segment_factory.h"
#include "backend/selection.h"
#include "driver/resources.h"
#include "policy/policy.h"

namespace cxl::alloc {

struct AllocatorConfig {
  int device = 0;
  size_t device_limit = 0;  // bytes of VRAM the allocator may hold (required, > 0)
  size_t host_limit = 0;    // bytes on the host tier; 0 disables spilling
  int host_node = 0;        // host NUMA node of the host tier (chosen by topology)
  // Free memory of host_node when configured (from topology; 0: unknown).
  // The pinned backend pins every byte of a request at once, so a host_limit
  // above it is refused rather than left to the OOM killer.
  size_t host_node_free_bytes = 0;
  std::optional<backend::HostBackend> backend;  // nullopt: choose (host-vmm > managed > pinned)
  size_t kv_device_limit = SIZE_MAX;  // KV bytes allowed in VRAM; SIZE_MAX: no separate quota
  size_t device_headroom = 0;         // VRAM a KV placement must leave free for activations
  double migration_rate = 8.0 * (1ull << 30);  // bytes/s of demotion+promotion; 0 disables
  size_t migration_burst = size_t(4) << 30;    // token bucket size, bytes
  uint32_t promote_after = 2;  // uses since demotion before a host chunk is promoted
  size_t extent_chunk = 0;     // bytes per extent chunk; 0: the segment alignment (2 MiB)
  bool strict_placement = false;
  bool check_capture = true;   // ask the driver whether the stream is capturing
  // false: "first-fit", the policy-free baseline the benchmarks compare
  // against: everything takes VRAM first-come until it is full, then the
  // host tier; no KV quota or headroom, no demotion, no promotion.
  bool kv_aware = true;
  // true: implicit moves (demotion for another request, extent growth,
  // rebalance) may move memory any thread uses, at once; only safe when no
  // other host thread reads or launches work on KV memory while the
  // allocator runs.  false (default): such moves wait for the owner thread.
  bool implicit_moves_any_thread = false;
  // The last sentence of an out-of-memory message: how to raise the limits,
  // in the words of the call that configured this allocator (Python passes
  // e.g. "... cxlalloc.hf.wrap(model, ..., host_limit=...)"); empty: the
  // CXLALLOC form.
  std::string oom_hint;
};

// One row of a memory snapshot (segment + its blocks), like torch's SegmentInfo.
struct BlockSnapshot {
  uint64_t ptr;
  size_t size, requested;
  bool allocated, pending_events;
};
struct SegmentSnapshot {
  uint64_t id, base;
  size_t size, allocated;
  std::string tier;  // "device" | "host" | "mixed"
  std::string cls, backing, kind;
  uint64_t stream;
  PoolId pool;
  bool extent;
  size_t device_bytes, host_bytes;
  std::vector<BlockSnapshot> blocks;
};

struct TierRange {
  size_t offset, length;
  std::string tier;  // "device" | "host" | "none" (not committed)
};

struct ExtentInfo {
  uint64_t id;
  uint64_t base;
  size_t capacity;
  size_t chunk_bytes;
  bool lazy;  // chunks commit on demand and place independently
};

// Where a host tier's pages were verified to be.
struct PlacementStats {
  size_t ok = 0, wrong = 0, unknown = 0;
  std::string method;
};

class DeviceAllocator {
 public:
  using Filter = std::function<bool(CUstream)>;

  DeviceAllocator(driver::DriverPtr drv, AllocatorConfig cfg, std::shared_ptr<backend::NumaOps> numa);
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // ---- block cache (global mode, pluggable allocator, Python malloc)
  // nbytes == 0 returns nullptr.  Throws OutOfMemoryError / Error(Capture).
  // `only_host`: serve from the host tier only (the scoped-mode spill pool,
  // whose whole point is memory that is not VRAM).
  void* malloc(size_t nbytes, CUstream stream, AllocClass cls, bool only_host = false);
  // Throws Error(InvalidFree) for pointers not allocated here, freed twice,
  // or owned by a tensor (see adopt); nothing is modified then.  nullptr is a
  // no-op.
  void free(void* ptr);
  // Hand a live block to a tensor: from now on only free_owned (the tensor's
  // deleter) releases it.  Throws Error(InvalidArgument) for an unknown or
  // already owned pointer.
  void adopt(void* ptr);
  void free_owned(void* ptr);
  // The deleter's free: never throws.  If the free fails (a driver error),
  // the block stays allocated and owned, "parked", and every later free()
  // and malloc() retries it first, so it is neither leaked nor freed twice.
  void free_owned_or_park(void* ptr) noexcept;
  size_t parked_frees() const;  // tensor frees waiting for a retry
  // The C ABI's free (torch's free callback returns void): invalid frees
  // throw as free() does, any other failure parks the block as above.
  void free_or_park(void* ptr);
  void record_stream(void* ptr, CUstream stream);
  // Throws Error(InvalidArgument) naming `stream` when the driver says `s`
  // is not a stream (destroyed, never created, another context's).  0 and
  // the special handles 1, 2 are always valid.
  void check_stream(CUstream s) const;
  // Wait for pending frees and release every wholly free cached segment of
  // both tiers (except those of private pools in use).  Returns bytes released.
  size_t empty_cache();
  // Give GPU `peer` read/write access to this GPU's memory, both tiers: every
  // VMM mapping now and later (torch's enablePeerAccess(peer, this GPU)).
  // Returns false when `peer` had it already or is this GPU.
  bool add_peer(int peer);
  // Requested size of a live allocation (the base pointer); 0 if unknown.
  size_t allocation_size(void* ptr) const;

  // ---- private pools (CUDA graph capture, torch.cuda.MemPool in global mode)
  void create_pool(PoolId id);  // or incref
  void begin_allocate_to_pool(PoolId id, Filter filter);
  void end_allocate_to_pool(PoolId id);
  void release_pool(PoolId id);  // decref; frees its cached segments at 0
  // References held on a private pool (torch's getPoolUseCount); -1 if unknown.
  int pool_use_count(PoolId id) const;

  // ---- extents: growable KV buffers at a fixed address
  ExtentInfo extent_create(size_t capacity, AllocClass cls);
  // Commit chunks so that [0, bytes) is backed.  New chunks are placed by the
  // policy (newest on the device up to the KV quota).  Throws OutOfMemoryError.
  void extent_grow(uint64_t id, size_t bytes);
  // Release chunks wholly beyond `bytes` (crop/reset).
  void extent_trim(uint64_t id, size_t bytes);
  void extent_touch(uint64_t id);
  void extent_free(uint64_t id);
  // The destructor's release: never throws; a failure (the context cannot
  // be made current) parks the extent, released by the next malloc/free.
  void extent_free_or_park(uint64_t id) noexcept;
  size_t parked_extents() const;
  std::vector<TierRange> extent_tiers(uint64_t id) const;
  size_t extent_committed(uint64_t id) const;
  // Bytes of the committed chunks at the start of the extent, [0, n): what a
  // view may cover (beyond it nothing is mapped).
  size_t extent_committed_prefix(uint64_t id) const;

  // ---- placement and migration
  // Tier of the byte at `ptr` (any address inside a live block or extent).
  // Throws InvalidArgument for addresses this allocator does not own.
  Tier tier_of(const void* ptr) const;
  // Move the segment (or extent range [ptr, ptr+len)) holding `ptr` to
  // `target`, data intact.  Returns bytes moved.  Throws Unsupported when the
  // backend cannot remap.  Not budgeted: an explicit request.
  size_t migrate(const void* ptr, size_t len, Tier target);
  // Promote hot host-tier KV back to the device while it has room (budgeted).
  size_t rebalance();
  // Start a new step: what is used from now on is the current working set
  // that demotion never picks.
  void mark_step();
  // Carry out the implicit moves queued for the calling thread (memory it
  // owns that another thread's request wanted moved).  Every malloc, extent
  // grow/touch, mark_step and rebalance of the owner does this first.
  void run_deferred_moves();
  size_t deferred_moves() const;  // queued, all threads
  // VRAM used outside this allocator (torch's own cache in scoped mode);
  // subtracted from device_limit.
  void set_external_device_bytes(size_t n);
  // A new VRAM cap (torch.cuda.set_per_process_memory_fraction in global
  // mode).  Held segments stay; later requests beyond the cap go to the host
  // tier.  Throws InvalidArgument for 0.
  void set_device_limit(size_t bytes);

  // ---- introspection
  Stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  std::vector<SegmentSnapshot> snapshot() const;
  PlacementStats placement() const;
  // Recompute every counter from the segments and blocks and compare; throws
  // Error(Internal) on any mismatch (tests call it after random sequences).
  void check_invariants() const;
  const AllocatorConfig& config() const { return cfg_; }
  const backend::DeviceFacts& facts() const { return facts_; }
  std::string host_backend_name() const;
  // Per-backend support on this device: name -> (ok, reason).
  std::map<std::string, backend::Support> backend_support() const { return support_; }
  bool demotion_supported() const;
  std::string describe_tiers() const;  // one line for OOM messages and logs
  int device() const { return cfg_.device; }

 private:
  // Helpers below assume mu_ is held and the context is current.
  struct PrivatePool {
    int use_count = 0;
  };
  struct Route {
    PoolId pool;
    Filter filter;
  };

  // device_allocator.cpp: the policy's budget snapshot and shared helpers
  // limits_ (tier_limits.h) plus what the segments hold.
  policy::TierBudget budget() const;
  bool capturing(CUstream s) const;
  void sync_device();
  double now_s() const;
  // `remedy` replaces the "raise the limits" ending when the limits are not what is full.
  [[noreturn]] void throw_oom(size_t requested, AllocClass cls, const std::string& why,
                              const std::string& remedy = std::string());
  Segment* segment_of(CUdeviceptr p) const;

  // device_allocator_malloc.cpp: the allocation path
  // One allocation's facts and decisions, carried through the order of
  // resort step by step (torch's AllocParams in CUDACachingAllocator.cpp):
  // what was asked, where it may come from, and what the policy chose.
  struct AllocRequest {
    size_t nbytes = 0;  // as asked
    size_t size = 0;    // rounded (sizes.h): the block's size
    CUstream stream = nullptr;
    AllocClass cls = AllocClass::Other;
    bool only_host = false;                       // the scoped mode's spill pool
    bool capturing = false;                       // graph capture: device only, no reclaim (C10, C14)
    FreeListKey key{};                            // pool, device tier, class, small/large
    size_t seg_bytes = 0;                         // a new segment's size class
    size_t min_seg = 0;                           // the least a new segment may be (alloc_in's exact-size fallback)
    policy::Request policy{};                     // what the policy judges
    policy::TierBudget budget{};                  // both tiers when the cache missed
    Tier first = Tier::Device;                    // the policy's first choice
    uint64_t refused_before[kNumTiers] = {0, 0};  // driver refusals so far (for the OOM message)
  };
  AllocRequest make_request(size_t nbytes, CUstream stream, AllocClass cls, bool only_host);
  void reclaim_finished();                 // owned moves, parked frees, completed events
  void plan_new_segment(AllocRequest& r);  // sizes, the budget and the policy's first tier
  Block* try_device(const AllocRequest& r, bool allow_demote);
  Block* try_host(const AllocRequest& r);
  [[noreturn]] void refuse(const AllocRequest& r);  // capture error or OutOfMemoryError
  Block* alloc_in(Tier tier, const FreeListKey& key, size_t size, size_t requested, CUstream stream,
                  bool allow_new_segment);
  Segment* new_segment(Tier tier, const FreeListKey& key, size_t size, CUstream stream);
  // Take `size` bytes of free block `b` from the cache and hand them out.
  Block* take_block(Block* b, size_t size, size_t requested, CUstream stream);
  size_t segment_size(size_t rounded) const;

  // device_allocator_pools.cpp: private pools, release of cached segments
  // The pool a request on `stream` allocates from (default: no route claims it).
  PoolId pool_for(CUstream stream) const;
  size_t release_free_segments(Tier tier, size_t want, bool include_private);
  void release_segment(Segment* seg);

  // device_allocator_free.cpp: frees and stream-ordered reuse
  // All or nothing: a failure leaves the block allocated and throws.
  void free_locked(CUdeviceptr p, bool by_owner);
  void extent_free_locked(uint64_t id);
  void retry_parked();
  std::string diagnose_bad_free(CUdeviceptr p) const;
  // PendingFrees' hook: a freed block whose uses are complete joins its free list.
  void retire(Block* b);

  // device_allocator_migration.cpp: demotion and promotion
  // A movable unit of KV: one extent chunk, or one whole block segment.
  struct KvUnit {
    Segment* seg;
    Chunk* chunk;  // nullptr: the whole block segment
  };
  std::vector<KvUnit> kv_units(Tier tier);
  size_t move_unit(const KvUnit& u, Tier target);  // returns bytes moved
  size_t demote_for(size_t need, bool budgeted);
  void migrate_segment(Segment& seg, Tier target);
  void migrate_chunk(Segment& seg, Chunk& c, Tier target);

  // device_allocator_owners.cpp: who may move what, moves deferred to owners
  struct DeferredMove {
    std::thread::id owner;
    uint64_t segment_id;
    size_t chunk;  // index in the extent, or SIZE_MAX: the whole block segment
    Tier target;
  };
  // The one thread using the unit's memory; nullopt when several do.
  std::optional<std::thread::id> owner_of(const KvUnit& u) const;
  bool may_move_now(const KvUnit& u) const;
  void defer_move(const KvUnit& u, Tier target);
  void run_owned_moves();
  void forget_moves_of(uint64_t segment_id);  // the segment is being released

  driver::DriverPtr drv_;
  AllocatorConfig cfg_;
  std::shared_ptr<backend::NumaOps> numa_;
  driver::PrimaryContext ctx_;
  backend::DeviceFacts facts_;
  std::map<std::string, backend::Support> support_;
  std::unique_ptr<backend::SegmentFactory> factory_;
  TierLimits limits_;  // the tier budget: limits, room, the policy's snapshot (tier_limits.h)

  mutable std::mutex mu_;
  std::map<CUdeviceptr, std::unique_ptr<Segment>> segments_;  // by base address
  std::unordered_map<CUdeviceptr, Block*> allocated_;         // live blocks by pointer
  BlockCache cache_;  // the free blocks: best fit, split, merge (block_cache.h)
  PendingFrees pending_frees_;    // frees waiting on other streams' events (pending_frees.h)
  std::set<CUdeviceptr> parked_;  // owned blocks whose deleter's free failed (retried)
  std::set<uint64_t> parked_extents_;  // extents whose release in a destructor failed (retried)
  std::map<PoolId, PrivatePool> pools_;
  std::vector<Route> routes_;
  std::map<uint64_t, Segment*> extents_;

  Stats stats_;  // every counter; its operations are the accounting rules (stats.cpp)
  uint64_t seq_ = 0;            // allocation / commit sequence
  uint64_t step_start_seq_ = 0;
  bool steps_marked_ = false;
  uint64_t next_segment_id_ = 1;
  policy::MigrationBudget migration_budget_;
  std::vector<DeferredMove> deferred_moves_;
};

}  // namespace cxl::alloc
