// Vocabulary shared by the policy (pure) and the allocator (driver-facing).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cxl {

// Where bytes physically live.  Device = the GPU's VRAM (HBM); Host = memory
// on the chosen host NUMA node (DRAM or a CXL expander), mapped for the GPU.
enum class Tier : uint8_t { Device = 0, Host = 1 };
constexpr int kNumTiers = 2;

// What an allocation holds.  Classes never share a segment, so a KV segment
// can be demoted alone (docs/DESIGN.md, "Segments, chunks, blocks").
enum class AllocClass : uint8_t { Other = 0, KV = 1, Weight = 2 };
constexpr int kNumClasses = 3;

// torch's two block pools: <= 1 MiB requests are packed into 2 MiB segments.
enum class PoolKind : uint8_t { Small = 0, Large = 1 };

const char* tier_name(Tier t);
const char* class_name(AllocClass c);
// "kv" | "weight" | "other" -> class; throws InvalidArgument naming `option`.
AllocClass parse_class(const std::string& s, const char* option = "tag");

// A private pool (CUDA graph capture or torch.cuda.MemPool) is identified by
// torch's MempoolId_t pair; {0, 0} is the default pool.
struct PoolId {
  uint64_t a = 0, b = 0;
  bool is_default() const { return a == 0 && b == 0; }
  bool operator<(const PoolId& o) const { return a != o.a ? a < o.a : b < o.b; }
  bool operator==(const PoolId& o) const { return a == o.a && b == o.b; }
};

}  // namespace cxl
