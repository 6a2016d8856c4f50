// CxlAllocator: lifecycle, cache, memory fraction and DeviceStats.
//
// Stats semantics: torch.cuda.memory_stats()/memory_allocated()/... report
// cxlalloc's DEVICE tier only (VRAM), in torch's vocabulary, so that
// "allocated <= what fits on the GPU" keeps its meaning.  Host-tier bytes
// are in cxlalloc.stats() (docs/pytorch-integration.md, "Stats").
#include <algorithm>
#include <map>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "allocator.h"

namespace cxlt {

namespace {
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;

void copy_stat(Stat& dst, const cxlalloc_stat_t& src) {
  dst.current = src.current;
  dst.peak = src.peak;
  dst.allocated = src.allocated;
  dst.freed = src.freed;
}

template <typename Arr>
void copy_array(Arr& dst, const cxlalloc_stat_t (&src)[3]) {
  for (size_t i = 0; i < 3; ++i) copy_stat(dst[i], src[i]);
}

struct SnapshotAcc {
  std::map<c10::MempoolId_t, int64_t> device_bytes_by_pool;
  size_t largest_free_device_block = 0;
};

// Device-tier facts the stats do not carry: bytes per private pool and the
// largest free cached block.
SnapshotAcc scan_device_tier(const CApi& c, c10::DeviceIndex device, bool* ok) {
  SnapshotAcc acc;
  *ok = for_each_segment(c, device, [&](const cxlalloc_segment_info_t& seg, const cxlalloc_block_info_t* blocks,
                                        size_t n) {
          if (seg.tier != 0) return;  // device tier only
          if (seg.pool_a || seg.pool_b)
            acc.device_bytes_by_pool[{seg.pool_a, seg.pool_b}] += static_cast<int64_t>(seg.size);
          for (size_t i = 0; i < n; ++i)
            if (!blocks[i].allocated && !blocks[i].pending)
              acc.largest_free_device_block = std::max(acc.largest_free_device_block, blocks[i].size);
        }) == 0;
  return acc;
}

// Whether the current stream of the current device is being captured.
bool current_stream_capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  if (cudaStreamIsCapturing(s, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

std::pair<size_t, size_t> mem_info(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  size_t free_b = 0, total_b = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return {free_b, total_b};
}
}  // namespace

void CxlAllocator::init(int device_count) {
  // torch's lazy CUDA init calls this after changeCurrentAllocator; the
  // engine's per-device allocators were configured by cxlalloc.enable() and
  // are created on first use.  From here on torch refuses to swap us out.
  std::lock_guard<std::mutex> lk(fraction_mu_);
  if (fraction_.size() < static_cast<size_t>(std::max(device_count, 0))) fraction_.resize(device_count, -1.0);
  initialized_ = true;
}

bool CxlAllocator::initialized() { return initialized_; }

std::string CxlAllocator::name() { return "cxlalloc"; }

void CxlAllocator::emptyCache(c10::MempoolId_t mempool_id) {
  // A pool id (from ~MemPool): the engine already released that pool's
  // cached segments when its last reference went (releasePool), and
  // releasing the default pool here would not be what torch asked for.
  if (mempool_id.first != 0 || mempool_id.second != 0) return;
  // Releasing memory synchronizes the device, which is illegal while a
  // stream of ours is being captured; torch's native allocator refuses too.
  TORCH_CHECK(!current_stream_capturing(),
              "cxlalloc: torch.cuda.empty_cache() is not allowed during CUDA graph capture");
  if (c_.empty_cache() != 0) fail("empty_cache");
}

void CxlAllocator::cacheInfo(c10::DeviceIndex device, size_t* largest_block) {
  // cuDNN sizes its benchmark workspaces with this (case C10).  The answer
  // is the largest block cxlalloc could hand out from VRAM without
  // spilling: a cached free device block, or the device tier's unreserved
  // headroom (never more than the driver reports free).
  bool ok = false;
  SnapshotAcc acc = scan_device_tier(c_, device, &ok);
  if (!ok) fail("cacheInfo");
  cxlalloc_torch_stats_t st;
  if (c_.torch_stats(device, &st) != 0) fail("cacheInfo");
  size_t limit = c_.device_limit(device);
  auto reserved = static_cast<size_t>(std::max<int64_t>(st.reserved_bytes[0].current, 0));
  size_t headroom = limit > reserved ? limit - reserved : 0;
  if (!capture_possible()) headroom = std::min(headroom, mem_info(device).first);
  size_t best = std::max(headroom, acc.largest_free_device_block);
  if (largest_block) *largest_block = std::max(*largest_block, best);
}

double CxlAllocator::getMemoryFraction(c10::DeviceIndex device) {
  {
    std::lock_guard<std::mutex> lk(fraction_mu_);
    if (device >= 0 && static_cast<size_t>(device) < fraction_.size() && fraction_[device] >= 0)
      return fraction_[device];
  }
  // Never set: the device tier's cap as a fraction of the GPU's VRAM.
  size_t total = mem_info(device).second;
  return total ? std::min(1.0, static_cast<double>(c_.device_limit(device)) / static_cast<double>(total)) : 1.0;
}

void CxlAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  // torch.cuda.set_per_process_memory_fraction caps what the allocator may
  // take from VRAM; for cxlalloc that is the device tier's limit (requests
  // beyond it spill to the host tier instead of failing).
  TORCH_CHECK(fraction > 0.0 && fraction <= 1.0, "cxlalloc: memory fraction must be in (0, 1], got ", fraction);
  size_t total = mem_info(device).second;
  auto bytes = static_cast<size_t>(fraction * static_cast<double>(total));
  TORCH_CHECK(bytes > 0, "cxlalloc: memory fraction ", fraction, " of ", format_size(total), " is 0 bytes");
  if (c_.set_device_limit(device, bytes) != 0) fail("set_per_process_memory_fraction");
  std::lock_guard<std::mutex> lk(fraction_mu_);
  if (fraction_.size() <= static_cast<size_t>(device)) fraction_.resize(static_cast<size_t>(device) + 1, -1.0);
  fraction_[device] = fraction;
}

std::vector<CCA::StreamSegmentSize> CxlAllocator::getExpandableSegmentSizes(c10::DeviceIndex) {
  // torch's expandable segments are a native-allocator feature; cxlalloc's
  // growable KV extents are not exposed through this interface.
  return {};
}

DeviceStats CxlAllocator::getDeviceStats(c10::DeviceIndex device) {
  cxlalloc_torch_stats_t s;
  if (c_.torch_stats(device, &s) != 0) fail("memory_stats");
  DeviceStats out;
  copy_array(out.allocation, s.allocation);
  copy_array(out.segment, s.segment);
  copy_array(out.active, s.active);
  copy_array(out.inactive_split, s.inactive_split);
  copy_array(out.allocated_bytes, s.allocated_bytes);
  copy_array(out.reserved_bytes, s.reserved_bytes);
  copy_array(out.active_bytes, s.active_bytes);
  copy_array(out.inactive_split_bytes, s.inactive_split_bytes);
  copy_array(out.requested_bytes, s.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  // cxlalloc splits blocks of any size (torch's default max_split_size,
  // "unlimited", which torch reports as -1): no oversize blocks exist.
  out.oversize_allocations = Stat{};
  out.oversize_segments = Stat{};
  out.max_split_size = -1;
#if CXLT_TORCH_AT_LEAST(2, 13)
  // cxlalloc never rejects an allocation preemptively: it spills instead.
  out.num_oom_rejections = 0;
  // Device-tier bytes held by each private pool (graphs, MemPools).  Only
  // the current value is known (peak = current; no allocated/freed counts).
  bool ok = false;
  SnapshotAcc acc = scan_device_tier(c_, device, &ok);
  if (!ok) fail("memory_stats");
  for (const auto& [id, bytes] : acc.device_bytes_by_pool) {
    auto& arr = out.reserved_bytes_by_private_pools[id];
    arr[0].current = arr[0].peak = bytes;
  }
#endif
  return out;
}

void CxlAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  if (c_.reset_accumulated_stats(device) != 0) fail("reset_accumulated_memory_stats");
}

void CxlAllocator::resetPeakStats(c10::DeviceIndex device) {
  if (c_.reset_peak_stats(device) != 0) fail("reset_peak_memory_stats");
}

}  // namespace cxlt
