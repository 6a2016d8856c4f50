// Host NUMA placement: the real kernel calls (mbind, get_mempolicy,
// move_pages, issued as raw syscalls: no libnuma), the mapping from
// simulated nodes to the real nodes backing them, and the simulated node
// recorded for pages bound with cxlsim_numa_bind.
//
// The recorded simulated node is the truth the simulator reports
// (cxlsim_host_node_of); the real binding is what makes it physically true on
// a multi-node machine.  Several simulated nodes may share one real node (the
// CI machine has a single node 0), so real placement alone cannot tell them
// apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cxlsim {

constexpr size_t kPageSize = 4096;

inline uint64_t page_down(uint64_t x) { return x & ~static_cast<uint64_t>(kPageSize - 1); }
inline uint64_t page_up(uint64_t x) { return (x + kPageSize - 1) & ~static_cast<uint64_t>(kPageSize - 1); }

// The real machine's online memory nodes (sysfs has_memory; {0} without sysfs).
std::vector<int> real_memory_nodes();

// The real node backing simulated node `sim` under the current config, or -1.
int real_node_of(int sim);

// The simulated node nearest the calling thread's CPU: the first simulated
// node backed by the CPU's real node, else the GPUs' host node (gpu_numa).
int current_sim_node();

// mbind [addr, addr+len) (page-aligned addr) to `real_node` with MPOL_BIND;
// `move` adds MPOL_MF_MOVE so pages already present migrate.  Returns true on
// success.  When the kernel refuses the call itself (EPERM/ENOSYS, e.g. a
// seccomp filter in a container) it returns true too and binding becomes a
// record-only simulation (see real_binding_works()).
bool bind_pages(void* addr, size_t len, int real_node, bool move);
bool real_binding_works();

// The real node holding the page at `p` (move_pages query), or a negative
// errno (-ENOENT: page not present yet).
int real_node_of_page(const void* p);

// Record simulated node `node` for the pages of [b, e).
void record_binding(uint64_t b, uint64_t e, int node);
// cuMemHostRegister hook: pages of [b, e) recorded on a node that the
// `relocate=A:B` rule moves are moved to B (record and real pages).
void relocate_on_register(uint64_t b, uint64_t e);
// The node recorded for the page holding p, or -1.  A record whose real
// binding has since been replaced (the range was unmapped and reused) is
// dropped.
int recorded_node(uint64_t p);
// Forget every record (cxlsim_configure).
void clear_bindings();

}  // namespace cxlsim
