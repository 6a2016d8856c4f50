#include "alloc/block_cache.h"

#include "alloc/sizes.h"
#include "common/error.h"

namespace cxl::alloc {

FreeListKey BlockCache::key_of(const Block* b) {
  return FreeListKey{b->segment->pool, b->segment->tier(), b->segment->cls, b->segment->kind};
}

Block* BlockCache::add_segment(Segment* seg, CUstream stream) {
  auto* head = new Block();
  head->segment = seg;
  head->ptr = seg->base;
  head->size = seg->size;
  head->stream = stream;
  seg->head = head;
  insert(head);
  return head;
}

void BlockCache::remove_segment(Segment* seg) {
  erase(seg->head);
  delete seg->head;
  seg->head = nullptr;
}

Block* BlockCache::find(const FreeListKey& key, CUstream stream, size_t size) const {
  auto it = lists_.find(key);
  if (it == lists_.end() || it->second.empty()) return nullptr;
  // BlockOrder sorts by (stream, size, address): the first block not below
  // (stream, size, 0) is the best fit on that stream, if it is on it.
  Block probe;
  probe.stream = stream;
  probe.size = size;
  probe.ptr = 0;
  auto bit = it->second.lower_bound(&probe);
  if (bit == it->second.end() || (*bit)->stream != stream) return nullptr;
  return *bit;
}

Block* BlockCache::take(Block* b, size_t size) {
  erase(b);
  Segment* seg = b->segment;
  if (should_split(b->size, size, seg->kind == PoolKind::Small)) {
    auto* rest = new Block();
    rest->segment = seg;
    rest->ptr = b->ptr + size;
    rest->size = b->size - size;
    rest->stream = b->stream;
    rest->prev = b;
    rest->next = b->next;
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    insert(rest);
  }
  return b;
}

void BlockCache::give_back(Block* b) {
  // A neighbour still waiting for stream events may be in use on a stream:
  // it is merged when it comes back itself.
  auto mergeable = [](Block* n) { return n && !n->allocated && n->event_count == 0; };
  if (mergeable(b->prev)) {
    Block* p = b->prev;
    erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    p->stream = b->stream;
    delete b;
    b = p;
  }
  if (mergeable(b->next)) {
    Block* n = b->next;
    erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  insert(b);
}

void BlockCache::insert(Block* b) {
  bool ok = lists_[key_of(b)].insert(b).second;
  CXL_CHECK(ok, "block already in its free list");
}

void BlockCache::erase(Block* b) {
  auto it = lists_.find(key_of(b));
  CXL_CHECK(it != lists_.end() && it->second.erase(b) == 1, "free block missing from its free list");
}

bool BlockCache::contains(const Block* b) const {
  auto it = lists_.find(key_of(b));
  return it != lists_.end() && it->second.count(const_cast<Block*>(b)) > 0;
}

size_t BlockCache::listed() const {
  size_t n = 0;
  for (const auto& [key, list] : lists_) n += list.size();
  return n;
}

}  // namespace cxl::alloc
