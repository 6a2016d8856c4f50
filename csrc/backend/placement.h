// Binding host memory to a NUMA node and verifying where its pages are.
//
// A placement is never claimed without verification: the driver may reject
// or relocate pages on CPU-less / ZONE_MOVABLE nodes (nccl#2190,
// open-gpu-kernel-modules#885, long-term pins migrating out of ZONE_MOVABLE;
// docs/sources.md#cpu-less-nodes), so backends bind(), touch or register,
// then ask page_nodes() where the bytes really are.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>

namespace cxl::driver {
class Driver;
}

namespace cxl::backend {

class NumaOps {
 public:
  virtual ~NumaOps();

  // Bind [p, p+len) (len in bytes; p page-aligned, mapped in this process)
  // to host node `node` with a strict policy (MPOL_BIND), before first
  // touch, so the pages are allocated there when faulted in; pages already
  // present are moved (MPOL_MF_MOVE) or the call fails (MPOL_MF_STRICT).
  // len == 0 is a no-op.
  // Throws cxl::Error(InvalidArgument) for a bad address, an unmapped range
  // or a node that is not an online node with memory, and
  // cxl::Error(Unavailable) when the kernel refuses memory policies here
  // (non-NUMA kernel, seccomp) or pages cannot be moved; messages carry the
  // errno text.
  virtual void bind(void* p, size_t len, int node) = 0;

  // Bytes of [p, p+len) backed by each node right now.  Faults nothing in:
  // pages never touched (and the shared zero page) count under key -1.  The
  // values sum to len (partial pages at the ends count their overlap).
  // Throws InvalidArgument for an unmapped range, Unavailable when the
  // kernel refuses the query.
  virtual std::map<int, size_t> page_nodes(const void* p, size_t len) = 0;

  // How page_nodes() knows: "move_pages" (the kernel's page tables) or
  // "simulated" (the simulated driver's records).
  virtual std::string method() const = 0;
};

// Real placement: SYS_mbind(MPOL_BIND, MPOL_MF_STRICT|MPOL_MF_MOVE) and a
// SYS_move_pages(nodes=NULL) status query; no libnuma needed.
std::unique_ptr<NumaOps> linux_numa_ops();

// Placement through the simulated driver's exports cxlsim_numa_bind and
// cxlsim_host_node_of (csrc/sim/cxlsim.h), found with drv->symbol().
// Throws cxl::Error(Unavailable) when `drv` does not export them.
std::unique_ptr<NumaOps> sim_numa_ops(std::shared_ptr<const driver::Driver> drv);

// "4.00 MiB on node 0, 1.00 MiB not populated" for messages.
std::string describe_page_nodes(const std::map<int, size_t>& bytes_per_node);

// Where [p, p+len) really is, compared with where it should be.
struct PlacementCheck {
  bool ok = false;           // every byte is populated and on `node`
  size_t on_node = 0;        // bytes on `node`
  size_t elsewhere = 0;      // bytes on other nodes
  size_t unpopulated = 0;    // bytes not backed by a page yet
  std::string method;        // NumaOps::method()
  std::string detail;        // "verified by move_pages: 2.00 MiB on node 1, 2.00 MiB on node 0"
};

// Verify a placement after the memory was touched or registered (a
// placement is never claimed without this).  Throws what page_nodes() throws.
PlacementCheck check_placement(NumaOps& ops, const void* p, size_t len, int node);

}  // namespace cxl::backend
