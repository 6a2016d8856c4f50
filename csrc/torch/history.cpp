#include "history.h"

#include <chrono>
#include <cstdio>

#include <c10/util/Exception.h>

namespace cxlt {

namespace {
// Action names as torch's _record_memory_history(skip_actions=...) spells them.
int parse_action(const std::string& s) {
  using A = CDA::TraceEntry::Action;
  static const std::pair<const char*, A> table[] = {
      {"alloc", A::ALLOC},
      {"free_requested", A::FREE_REQUESTED},
      {"free_completed", A::FREE_COMPLETED},
      {"segment_alloc", A::SEGMENT_ALLOC},
      {"segment_free", A::SEGMENT_FREE},
      {"segment_map", A::SEGMENT_MAP},
      {"segment_unmap", A::SEGMENT_UNMAP},
      {"snapshot", A::SNAPSHOT},
      {"oom", A::OOM},
  };
  for (const auto& [name, a] : table)
    if (s == name) return static_cast<int>(a);
  TORCH_CHECK(false, "cxlalloc: unknown memory-history action '", s,
              "' in skip_actions; known: alloc, free_requested, free_completed, segment_alloc, segment_free, "
              "segment_map, segment_unmap, snapshot, oom");
}

// Microseconds since the epoch: what torch's snapshot converter reads from
// TraceEntry::time_.t_ after its own clock conversion.
time_t now_us() {
  using namespace std::chrono;
  return static_cast<time_t>(duration_cast<microseconds>(system_clock::now().time_since_epoch()).count());
}
}  // namespace

void History::configure(bool enabled, CDA::CreateContextFn recorder, size_t max_entries, CDA::RecordContext when,
                        bool clear, const std::vector<std::string>& skip_actions) {
  std::set<int> skip;
  for (const auto& s : skip_actions) skip.insert(parse_action(s));  // may throw: before any change
  std::lock_guard<std::mutex> lk(mu_);
  skip_ = std::move(skip);
  max_entries_ = max_entries;
  recorder_.store(enabled ? recorder : nullptr);
  when_.store(enabled ? when : CDA::RecordContext::NEVER);
  enabled_.store(enabled);
  if (clear) rings_.clear();
  for (auto& [dev, ring] : rings_)
    while (ring.size() > max_entries_) ring.pop_front();
}

std::shared_ptr<c10::GatheredContext> History::gather(CDA::RecordContext level) const {
  if (!trace_stacks(level)) return nullptr;
  CDA::CreateContextFn fn = recorder_.load();
  return fn ? fn() : nullptr;
}

void History::record(CDA::TraceEntry::Action action, int device, uintptr_t addr, size_t size, void* stream,
                     c10::MempoolId_t pool, std::shared_ptr<c10::GatheredContext> context) {
  if (!enabled() && !has_trackers_.load(std::memory_order_relaxed)) return;
  CDA::TraceEntry te(action, static_cast<c10::DeviceIndex>(device), addr, size, stream, pool, 0, std::move(context));
  te.time_.t_ = now_us();
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& t : trackers_) {
    // A tracker (c10d's NCCL registration) failing must not turn an
    // allocation or free that already happened into an error.
    try {
      t(te);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cxlalloc: warning: allocator trace tracker failed: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "cxlalloc: warning: allocator trace tracker failed\n");
    }
  }
  if (!enabled_.load() || max_entries_ == 0 || skip_.count(static_cast<int>(action))) return;
  auto& ring = rings_[device];
  if (ring.size() >= max_entries_) ring.pop_front();
  ring.push_back(std::move(te));
}

void History::attach_tracker(CDA::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> lk(mu_);
  trackers_.push_back(std::move(tracker));
  has_trackers_.store(true);
}

std::vector<std::vector<CDA::TraceEntry>> History::traces(int device_count) const {
  std::lock_guard<std::mutex> lk(mu_);
  int n = device_count;
  if (!rings_.empty()) n = std::max(n, rings_.rbegin()->first + 1);
  std::vector<std::vector<CDA::TraceEntry>> out(static_cast<size_t>(std::max(n, 0)));
  for (const auto& [dev, ring] : rings_)
    if (dev >= 0) out[static_cast<size_t>(dev)].assign(ring.begin(), ring.end());
  return out;
}

}  // namespace cxlt
