// CxlAllocator: private pools (CUDA graph capture, torch.cuda.MemPool,
// use_mem_pool) in global mode.
//
// The engine keeps torch's semantics: begin/create take a reference,
// releasePool drops one and frees the pool's cached segments at zero, and
// the most recently begun matching route wins (LIFO, pytorch#161193).
// Allocations during a capture never go to the host tier: the engine
// refuses (OutOfMemoryError "... during CUDA graph capture") rather than
// put a host-backed block in a graph silently (cases C10, C14).
#include <c10/util/Exception.h>

#include "allocator.h"

namespace cxlt {

namespace {
using Filter = std::function<bool(cudaStream_t)>;

// Called by the engine under its lock for each allocation while the route
// is open; torch's filters only compare streams / thread ids or query the
// capture state, so this is cheap and never re-enters the allocator.
int filter_trampoline(void* ctx, void* stream) {
  try {
    return (*static_cast<Filter*>(ctx))(static_cast<cudaStream_t>(stream)) ? 1 : 0;
  } catch (...) {
    return 0;  // a filter that throws matches nothing
  }
}

void filter_free(void* ctx) { delete static_cast<Filter*>(ctx); }
}  // namespace

void CxlAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id, Filter filter) {
  auto* ctx = new Filter(std::move(filter));
  // The engine owns ctx from here, also when the call fails (it frees it).
  if (c_.begin_allocate_to_pool(device, id.first, id.second, &filter_trampoline, ctx, &filter_free) != 0)
    fail("beginAllocateToPool");
  std::lock_guard<std::mutex> lk(routes_mu_);
  routes_.emplace_back(device, id);
  routes_open_.store(static_cast<int>(routes_.size()));
}

void CxlAllocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) {
  if (c_.end_allocate_to_pool(device, id.first, id.second) != 0) fail("endAllocateToPool");
  std::lock_guard<std::mutex> lk(routes_mu_);
  // torch 2.14 may end a route twice (capture_end, then reset): only a
  // route that is open counts.
  for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
    if (it->first == device && it->second == id) {
      routes_.erase(std::next(it).base());
      break;
    }
  }
  routes_open_.store(static_cast<int>(routes_.size()));
}

void CxlAllocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t id) {
  if (c_.release_pool(device, id.first, id.second) != 0) fail("releasePool");
}

int CxlAllocator::getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) {
  int n = c_.pool_use_count(device, id.first, id.second);
  if (n < 0) fail("getPoolUseCount");
  return n;
}

void CxlAllocator::createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                                      std::shared_ptr<CCA::CUDAAllocator> allocator) {
  // A MemPool with its own allocator (NCCL symmetric memory, another
  // pluggable allocator) would need cxlalloc to hand that pool's segments to
  // a foreign allocator: not supported, and saying so beats a silent mix.
  TORCH_CHECK(allocator == nullptr,
              "cxlalloc: torch.cuda.MemPool(allocator=...) is not supported while cxlalloc is torch's CUDA "
              "allocator (global mode): the pool's memory would bypass cxlalloc's tiers. Use MemPool() "
              "without an allocator (cxlalloc serves it), or run cxlalloc in scoped mode (call "
              "cxlalloc.enable() after CUDA is initialised, without CXLALLOC set).");
  if (c_.create_pool(device, id.first, id.second) != 0) fail("createOrIncrefPool");
}

void CxlAllocator::setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) {
  // A use-on-OOM pool is torch's last resort before OutOfMemoryError; in
  // global mode cxlalloc's host tier already is that last resort, for every
  // allocation.  Accepted and ignored.
}

void CxlAllocator::setNoSplit(c10::DeviceIndex, c10::MempoolId_t) {
  // cxlalloc always splits blocks within a segment; no_split pools (used
  // for symmetric-memory registration) get ordinary splitting semantics.
}

bool CxlAllocator::checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                            const std::unordered_set<void*>& expected) {
  // torch.compile's cudagraph trees ask whether exactly `expected` is alive
  // in the graph's pool (pytorch#163257, case C10).
  int uses = c_.pool_use_count(device, id.first, id.second);
  if (uses < 0) fail("checkPoolLiveAllocations");
  size_t live = 0;
  bool all_expected = true;
  int r = for_each_segment(c_, device, [&](const cxlalloc_segment_info_t& seg, const cxlalloc_block_info_t* blocks,
                                           size_t n) {
    if (c10::MempoolId_t{seg.pool_a, seg.pool_b} != id) return;
    for (size_t i = 0; i < n; ++i) {
      if (!blocks[i].allocated) continue;
      ++live;
      if (!expected.count(reinterpret_cast<void*>(blocks[i].ptr))) all_expected = false;
    }
  });
  if (r != 0) fail("checkPoolLiveAllocations");
  return all_expected && live == expected.size();
}

#if CXLT_TORCH_AT_LEAST(2, 13)
void CxlAllocator::markCaptureBegin(c10::DeviceIndex) { captures_.fetch_add(1); }
void CxlAllocator::markCaptureEnd(c10::DeviceIndex) {
  int n = captures_.load();
  while (n > 0 && !captures_.compare_exchange_weak(n, n - 1)) {
  }
}
#endif

}  // namespace cxlt
