// CxlAllocator: torch.cuda.memory._snapshot() and memory history.
//
// The snapshot lists every cxlalloc segment of every device, both tiers,
// with its blocks.  torch's SegmentInfo has no notion of a tier, so each
// host-tier (or mixed) segment is also named in `external_annotations` as
// {"cxlalloc_tier": "host"|"mixed", "address": ..., "size": ...}; tools that
// sum segment sizes should filter those out to match memory_reserved(),
// which counts the device tier only.
#include <chrono>

#include <c10/cuda/CUDAFunctions.h>

#include "allocator.h"

namespace cxlt {

namespace {
time_t now_us() {
  using namespace std::chrono;
  return static_cast<time_t>(duration_cast<microseconds>(system_clock::now().time_since_epoch()).count());
}

// One engine segment as torch's SegmentInfo (+ an annotation if it is not
// on the device tier).
void add_segment(const Registry& registry, int device, const cxlalloc_segment_info_t& seg,
                 const cxlalloc_block_info_t* blocks, size_t n, CCA::SnapshotInfo& out) {
  CDA::SegmentInfo s;
  s.device = static_cast<c10::DeviceIndex>(device);
  s.address = static_cast<size_t>(seg.base);
  s.total_size = seg.size;
  s.stream = reinterpret_cast<void*>(seg.stream);
  s.is_large = !seg.is_small;
  s.is_expandable = seg.is_extent != 0;  // a growable KV extent (VMM, commits on demand)
  s.owner_private_pool_id = {seg.pool_a, seg.pool_b};
  for (size_t i = 0; i < n; ++i) {
    const auto& b = blocks[i];
    CDA::BlockInfo bi;
    bi.size = b.size;
    bi.requested_size = b.allocated ? b.requested : 0;
    bi.allocated = b.allocated != 0;
    bi.active = b.allocated || b.pending;
    if (b.allocated) {
      if (auto a = registry.find(reinterpret_cast<const void*>(b.ptr))) bi.context_when_allocated = a->context;
      s.allocated_size += b.size;
      s.requested_size += b.requested;
    }
    if (bi.active) s.active_size += b.size;
    s.blocks.push_back(std::move(bi));
  }
  out.segments.push_back(std::move(s));

  if (seg.tier != 0) {
    CDA::AnnotationEntry ae(static_cast<c10::DeviceIndex>(device), 0);
    ae.time_.t_ = now_us();
    ae.recordUserMetadata("cxlalloc_tier", seg.tier == 1 ? "host" : "mixed");
    ae.recordUserMetadata("address", std::to_string(seg.base));
    ae.recordUserMetadata("size", std::to_string(seg.size));
    out.external_annotations.push_back(std::move(ae));
  }
}
}  // namespace

CCA::SnapshotInfo CxlAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  CCA::SnapshotInfo out{};  // value-initialized: config_metadata has plain fields
  const int ndev = static_cast<int>(c10::cuda::device_count());
  const bool all = mempool_id.first == 0 && mempool_id.second == 0;
  for (int d = 0; d < ndev; ++d) {
    int r = for_each_segment(c_, d, [&](const cxlalloc_segment_info_t& seg, const cxlalloc_block_info_t* blocks,
                                        size_t n) {
      if (all || c10::MempoolId_t{seg.pool_a, seg.pool_b} == mempool_id) add_segment(registry_, d, seg, blocks, n, out);
    });
    if (r != 0) fail("memory snapshot");
    history_.record(CDA::TraceEntry::SNAPSHOT, d, 0, 0, nullptr, mempool_id, nullptr);
  }
  if (include_traces) out.device_traces = history_.traces(ndev);
  else out.device_traces.resize(static_cast<size_t>(ndev));
  // What torch's tooling prints as the allocator's configuration.
  out.config_metadata.garbage_collection_threshold = 0.0;
  out.config_metadata.max_split_size = SIZE_MAX;
  out.config_metadata.expandable_segments = false;
  out.config_metadata.last_allocator_settings = "cxlalloc (global mode; see cxlalloc.stats())";
  return out;
}

void CxlAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                                 CCA::RecordContext when, bool clear_history,
                                 const std::vector<std::string>& skip_actions) {
  history_.configure(enabled, context_recorder, alloc_trace_max_entries, when, clear_history, skip_actions);
}

bool CxlAllocator::isHistoryEnabled() { return history_.enabled(); }

void CxlAllocator::attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) {
  history_.attach_tracker(std::move(tracker));
}

#if CXLT_TORCH_AT_LEAST(2, 13)
std::shared_ptr<c10::GatheredContext> CxlAllocator::getContextForPointer(const void* ptr) {
  auto a = registry_.find(ptr);
  return a ? a->context : nullptr;
}
#endif

}  // namespace cxlt
