#include "policy/policy.h"

#include <algorithm>

namespace cxl::policy {

namespace {
size_t sub_floor(size_t a, size_t b) { return a > b ? a - b : 0; }
}  // namespace

size_t device_available(const TierBudget& b) {
  size_t used = sub_floor(b.device_reserved, b.device_cached_free);
  return sub_floor(b.device_limit, used);
}

size_t host_available(const TierBudget& b) {
  size_t used = sub_floor(b.host_reserved, b.host_cached_free);
  return sub_floor(b.host_limit, used);
}

Tier first_choice(const Request& r, const TierBudget& b) {
  if (r.private_pool || b.host_limit == 0) return Tier::Device;
  if (r.cls != AllocClass::KV) return Tier::Device;
  // KV: the device only while both the KV quota and the activation headroom
  // allow; otherwise straight to the host tier (no demotion of others for KV).
  const size_t need = r.device_bytes();
  bool quota_ok = b.kv_device_quota == SIZE_MAX || b.kv_device_bytes + need <= b.kv_device_quota;
  bool room_ok = device_available(b) >= need + b.device_headroom;
  return (quota_ok && room_ok) ? Tier::Device : Tier::Host;
}

bool may_spill(const Request& r, const TierBudget& b) { return !r.private_pool && b.host_limit > 0; }

bool may_demote_for(const Request& r) { return !r.private_pool && r.cls != AllocClass::KV; }

std::vector<uint64_t> choose_victims(size_t need, std::vector<Candidate> cands, size_t budget_bytes) {
  std::stable_sort(cands.begin(), cands.end(),
                   [](const Candidate& x, const Candidate& y) { return x.last_use < y.last_use; });
  std::vector<uint64_t> out;
  size_t got = 0;
  for (const auto& c : cands) {
    if (got >= need) break;
    if (c.in_current_step || c.bytes == 0) continue;
    if (got + c.bytes > budget_bytes) break;
    out.push_back(c.id);
    got += c.bytes;
  }
  if (got < need) out.clear();
  return out;
}

GrowthPlan plan_extent_growth(size_t new_chunks, size_t chunk_bytes, const TierBudget& b,
                              std::vector<Candidate> device_kv_chunks, size_t budget_bytes, bool can_demote,
                              bool may_use_host) {
  GrowthPlan plan;
  if (new_chunks == 0 || chunk_bytes == 0) return plan;
  if (!may_use_host) {
    plan.device_new = new_chunks;
    return plan;
  }
  // Chunks that fit on the device without touching anything else.
  size_t room = sub_floor(device_available(b), b.device_headroom);
  if (b.kv_device_quota != SIZE_MAX) room = std::min(room, sub_floor(b.kv_device_quota, b.kv_device_bytes));
  size_t free_chunks = room / chunk_bytes;
  if (free_chunks >= new_chunks) {
    plan.device_new = new_chunks;
    return plan;
  }
  // The KV share of the device, in chunks, that the newest data may occupy.
  size_t kv_cap_bytes = sub_floor(b.device_limit, b.device_headroom);
  if (b.kv_device_quota != SIZE_MAX) kv_cap_bytes = std::min(kv_cap_bytes, b.kv_device_quota);
  size_t want_device = std::min(new_chunks, kv_cap_bytes / chunk_bytes);
  size_t device_new = free_chunks;
  if (can_demote && want_device > free_chunks) {
    // Demote the oldest device chunks, one chunk of room each, within budget.
    std::stable_sort(device_kv_chunks.begin(), device_kv_chunks.end(),
                     [](const Candidate& x, const Candidate& y) { return x.last_use < y.last_use; });
    size_t spent = 0;
    for (const auto& c : device_kv_chunks) {
      if (device_new >= want_device) break;
      if (c.in_current_step) continue;
      if (spent + c.bytes > budget_bytes) break;
      plan.demote.push_back(c.id);
      spent += c.bytes;
      device_new += c.bytes / chunk_bytes;
    }
    device_new = std::min(device_new, want_device);
  }
  plan.device_new = device_new;
  plan.host_new = new_chunks - device_new;
  return plan;
}

std::vector<uint64_t> choose_promotions(const TierBudget& b, std::vector<PromoteCandidate> cands,
                                        uint32_t min_touches, size_t budget_bytes) {
  std::vector<uint64_t> out;
  size_t room = sub_floor(device_available(b), b.device_headroom);
  size_t kv_room = b.kv_device_quota == SIZE_MAX ? SIZE_MAX : sub_floor(b.kv_device_quota, b.kv_device_bytes);
  std::stable_sort(cands.begin(), cands.end(),
                   [](const PromoteCandidate& x, const PromoteCandidate& y) { return x.last_use > y.last_use; });
  size_t spent = 0, kv_spent = 0;
  for (const auto& c : cands) {
    if (c.touches < min_touches || c.bytes == 0) continue;
    if (spent + c.bytes > room || spent + c.bytes > budget_bytes) continue;
    if (c.kv && kv_room != SIZE_MAX && kv_spent + c.bytes > kv_room) continue;
    out.push_back(c.id);
    spent += c.bytes;
    if (c.kv) kv_spent += c.bytes;
  }
  return out;
}

MigrationBudget::MigrationBudget(double rate_bytes_per_s, size_t burst_bytes)
    : rate_(rate_bytes_per_s), burst_(burst_bytes), tokens_(static_cast<double>(burst_bytes)) {}

void MigrationBudget::refill(double now_s) {
  if (last_s_ >= 0 && now_s > last_s_)
    tokens_ = std::min(static_cast<double>(burst_), tokens_ + (now_s - last_s_) * rate_);
  last_s_ = now_s;
}

size_t MigrationBudget::available(double now_s) {
  if (rate_ <= 0) return 0;
  refill(now_s);
  return static_cast<size_t>(tokens_);
}

bool MigrationBudget::consume(size_t bytes, double now_s) {
  if (rate_ <= 0) return false;
  refill(now_s);
  if (static_cast<double>(bytes) > tokens_) return false;
  tokens_ -= static_cast<double>(bytes);
  return true;
}

}  // namespace cxl::policy
