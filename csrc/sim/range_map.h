// A map from disjoint address intervals [start, end) to values, used for
// per-range state that callers set on arbitrary sub-ranges: cuMemAdvise /
// cuMemPrefetchAsync attributes of managed memory, and the simulated NUMA
// node recorded for host pages.  Setting a sub-range splits the intervals it
// cuts; adjacent equal values are merged back so the map stays small.
//
// Not thread-safe: owners guard it with their own mutex.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>

namespace cxlsim {

template <typename V>
class RangeMap {
 public:
  // Set [b, e) to `v`, replacing whatever was there.
  void assign(uint64_t b, uint64_t e, const V& v) {
    if (b >= e) return;
    erase(b, e);
    map_.emplace(b, Entry{e, v});
    merge_around(b, e);
  }

  // Remove [b, e).
  void erase(uint64_t b, uint64_t e) {
    if (b >= e) return;
    split(b);
    split(e);
    map_.erase(map_.lower_bound(b), map_.lower_bound(e));
  }

  // Call f(V&) on every stored interval inside [b, e), after splitting at b
  // and e so that f only changes values inside the range.  Gaps stay gaps.
  template <typename F>
  void update(uint64_t b, uint64_t e, F&& f) {
    if (b >= e) return;
    split(b);
    split(e);
    for (auto it = map_.lower_bound(b); it != map_.end() && it->first < e; ++it) f(it->second.value);
    merge_around(b, e);
  }

  // Call f(lo, hi, const V&) for each stored piece of [b, e), clipped to it,
  // in address order.
  template <typename F>
  void for_each(uint64_t b, uint64_t e, F&& f) const {
    if (b >= e) return;
    auto it = map_.upper_bound(b);
    if (it != map_.begin() && std::prev(it)->second.end > b) --it;
    for (; it != map_.end() && it->first < e; ++it) {
      uint64_t lo = it->first < b ? b : it->first;
      uint64_t hi = it->second.end > e ? e : it->second.end;
      f(lo, hi, it->second.value);
    }
  }

  // The value at address x, or nullptr.
  const V* find(uint64_t x) const {
    auto it = map_.upper_bound(x);
    if (it == map_.begin()) return nullptr;
    --it;
    return x < it->second.end ? &it->second.value : nullptr;
  }

  // True when every byte of [b, e) has a value.
  bool covers(uint64_t b, uint64_t e) const {
    uint64_t at = b;
    for_each(b, e, [&](uint64_t lo, uint64_t hi, const V&) {
      if (lo == at) at = hi;
    });
    return at >= e;
  }

  bool empty() const { return map_.empty(); }
  size_t intervals() const { return map_.size(); }
  void clear() { map_.clear(); }

 private:
  struct Entry {
    uint64_t end;
    V value;
  };

  // Make x an interval boundary if it falls strictly inside one.
  void split(uint64_t x) {
    auto it = map_.upper_bound(x);
    if (it == map_.begin()) return;
    --it;
    if (it->first < x && x < it->second.end) {
      Entry tail{it->second.end, it->second.value};
      it->second.end = x;
      map_.emplace(x, tail);
    }
  }

  // Merge equal, touching neighbours over [b, e] and its two outer edges.
  void merge_around(uint64_t b, uint64_t e) {
    auto it = map_.upper_bound(b);
    if (it != map_.begin()) --it;
    if (it != map_.begin()) --it;
    while (it != map_.end()) {
      auto next = std::next(it);
      if (next == map_.end()) break;
      if (it->second.end == next->first && it->second.value == next->second.value) {
        it->second.end = next->second.end;
        map_.erase(next);
        continue;
      }
      if (it->first > e) break;
      it = next;
    }
  }

  std::map<uint64_t, Entry> map_;
};

}  // namespace cxlsim
