// Live allocations handed to torch: pointer -> device, size, stream, context.
//
// Why the adapter keeps this although the engine knows its blocks: torch
// frees through a plain `void(void*)` deleter (and raw_delete(void*)) that
// carries no device, while the engine's C ABI frees per device.  The entry
// also carries what torch's tooling wants back later: the requested size
// (free traces), the allocation's Python/C++ stack (snapshot frames) and
// whether the pointer is ours at all (record_stream on foreign DataPtrs,
// frees of pointers we never returned).
//
// Sharded by address so concurrent allocations on many threads rarely meet
// on one mutex.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <c10/core/Allocator.h>

namespace cxlt {

struct Allocation {
  int device = 0;
  size_t size = 0;       // bytes torch asked for
  void* stream = nullptr;  // cudaStream_t of the allocation
  std::shared_ptr<c10::GatheredContext> context;  // set while history is recorded
};

class Registry {
 public:
  void insert(const void* p, Allocation a) {
    Shard& s = shard(p);
    std::lock_guard<std::mutex> lk(s.mu);
    s.map[p] = std::move(a);
  }
  // Removes and returns the entry; nullopt if `p` is not a live allocation.
  std::optional<Allocation> erase(const void* p) {
    Shard& s = shard(p);
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.map.find(p);
    if (it == s.map.end()) return std::nullopt;
    Allocation a = std::move(it->second);
    s.map.erase(it);
    return a;
  }
  std::optional<Allocation> find(const void* p) const {
    const Shard& s = shard(p);
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.map.find(p);
    if (it == s.map.end()) return std::nullopt;
    return it->second;
  }

 private:
  static constexpr size_t kShards = 64;
  struct Shard {
    mutable std::mutex mu;
    std::unordered_map<const void*, Allocation> map;
  };
  // Blocks are 512-byte aligned: drop those bits before picking a shard.
  static size_t index(const void* p) { return (reinterpret_cast<uintptr_t>(p) >> 9) % kShards; }
  Shard& shard(const void* p) { return shards_[index(p)]; }
  const Shard& shard(const void* p) const { return shards_[index(p)]; }

  std::array<Shard, kShards> shards_;
};

}  // namespace cxlt
