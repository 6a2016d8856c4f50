// Unit test of alloc::BlockCache on fake segments: plain alloc::Segment
// objects with an address range and one chunk but no memory and no driver
// behind them (the cache never touches either).  Built and run by
// tests/engine/test_block_cache.py; prints "ok: N checks" and exits 0, or
// names every failed check and exits 1.
#include <cstdio>
#include <memory>
#include <vector>

#include "alloc/block_cache.h"
#include "alloc/sizes.h"

#include "unit_check.h"

using namespace cxl;
using namespace cxl::alloc;


namespace {

CUstream stream(uintptr_t n) { return reinterpret_cast<CUstream>(n); }

// A segment of `size` bytes at `base` on `tier`, as the factory would leave
// it, but with nothing allocated.
std::unique_ptr<Segment> fake_segment(CUdeviceptr base, size_t size, PoolKind kind, Tier tier = Tier::Device,
                                      AllocClass cls = AllocClass::Other) {
  auto seg = std::make_unique<Segment>();
  seg->base = base;
  seg->size = size;
  seg->kind = kind;
  seg->cls = cls;
  backend::Chunk c;
  c.size = size;
  c.tier = tier;
  c.committed = true;
  seg->chunks.push_back(std::move(c));
  return seg;
}

FreeListKey key_of(const Segment& s) { return FreeListKey{s.pool, s.tier(), s.cls, s.kind}; }

// What DeviceAllocator::take_block does around the cache: take, mark live.
Block* allocate(BlockCache& cache, Block* b, size_t size) {
  cache.take(b, size);
  b->allocated = true;
  return b;
}
void release(BlockCache& cache, Block* b) {
  b->allocated = false;
  cache.give_back(b);
}

size_t blocks_in(const Segment& s) {
  size_t n = 0;
  for (const Block* b = s.head; b; b = b->next) ++n;
  return n;
}

void test_best_fit_split_merge() {
  BlockCache cache;
  auto seg = fake_segment(0x100000000ull, 20 * MiB, PoolKind::Large);
  const FreeListKey key = key_of(*seg);
  Block* head = cache.add_segment(seg.get(), stream(0));
  CHECK(head == seg->head && head->size == 20 * MiB && cache.listed() == 1);
  CHECK(cache.find(key, stream(0), 20 * MiB) == head);
  CHECK(cache.find(key, stream(0), 20 * MiB + 512) == nullptr);

  // Carve the segment into A 4 | B 3 | C 4 | D 2 | E 4 | F 3 MiB: each take
  // splits (the remainder is > 1 MiB) until the last one, which takes all.
  const size_t sizes[] = {4 * MiB, 3 * MiB, 4 * MiB, 2 * MiB, 4 * MiB, 3 * MiB};
  std::vector<Block*> blk;
  for (size_t s : sizes) {
    Block* b = cache.find(key, stream(0), s);
    CHECK(b != nullptr);
    if (!b) return;
    blk.push_back(allocate(cache, b, s));
  }
  CHECK(blocks_in(*seg) == 6 && cache.listed() == 0);
  CHECK(blk[1]->ptr == seg->base + 4 * MiB && blk[5]->ptr == seg->base + 17 * MiB && blk[5]->size == 3 * MiB);

  // Free B (3), D (2), F (3): none has a free neighbour, nothing merges.
  release(cache, blk[1]);
  release(cache, blk[3]);
  release(cache, blk[5]);
  CHECK(cache.listed() == 3 && blocks_in(*seg) == 6);
  // Best fit: the smallest block that holds the request ...
  CHECK(cache.find(key, stream(0), 1 * MiB + 512) == blk[3]);
  CHECK(cache.find(key, stream(0), 2 * MiB) == blk[3]);
  // ... the lowest address among equal sizes (B before F) ...
  CHECK(cache.find(key, stream(0), 2 * MiB + 512) == blk[1]);
  // ... and none when no free block is large enough.
  CHECK(cache.find(key, stream(0), 3 * MiB + 512) == nullptr);

  // Large pool: a remainder of exactly 1 MiB stays with the block (split
  // only above kSmallSize), one above 1 MiB is split off and listed.
  Block* d = allocate(cache, cache.find(key, stream(0), 1 * MiB), 1 * MiB);
  CHECK(d == blk[3] && d->size == 2 * MiB && cache.listed() == 2);
  release(cache, d);
  CHECK(cache.listed() == 3 && d->size == 2 * MiB);
  // B (the first 3 MiB block) split: 1 MiB + 512 B taken, the rest listed.
  Block* small = allocate(cache, cache.find(key, stream(0), 2 * MiB + 512), 1 * MiB + 512);
  CHECK(small == blk[1] && small->size == 1 * MiB + 512);
  CHECK(small->next && !small->next->allocated && small->next->size == 2 * MiB - 512 &&
        small->next->ptr == small->ptr + 1 * MiB + 512 && small->next->next == blk[2]);
  CHECK(cache.contains(small->next) && !cache.contains(small));
  release(cache, small);  // merges with the remainder it left: B is whole again
  CHECK(blk[1]->size == 3 * MiB && blocks_in(*seg) == 6 && cache.listed() == 3);

  // Merge: freeing C joins B | C | D into one 9 MiB block at B's address.
  release(cache, blk[2]);
  CHECK(blk[1]->size == 9 * MiB && blk[1]->next == blk[4] && blk[4]->prev == blk[1]);
  CHECK(blocks_in(*seg) == 4 && cache.listed() == 2);
  CHECK(cache.find(key, stream(0), 9 * MiB) == blk[1]);

  // A neighbour still waiting for stream events is not merged.
  Block* e = blk[4];
  e->allocated = false;
  e->event_count = 1;      // freed, its uses on other streams not yet complete
  release(cache, blk[0]);  // A's next (B|C|D) is free: A absorbs it
  CHECK(seg->head == blk[0] && blk[0]->size == 13 * MiB && blk[0]->next == e);
  CHECK(blocks_in(*seg) == 3 && cache.listed() == 2 && !cache.contains(e));
  e->event_count = 0;  // the events completed: the block comes back and merges both ways
  cache.give_back(e);
  CHECK(blocks_in(*seg) == 1 && seg->head->size == 20 * MiB && cache.listed() == 1);
  CHECK(seg->fully_free());

  cache.remove_segment(seg.get());
  CHECK(seg->head == nullptr && cache.listed() == 0 && cache.find(key, stream(0), 512) == nullptr);
}

void test_small_pool_split() {
  BlockCache cache;
  auto seg = fake_segment(0x200000000ull, kSmallSegment, PoolKind::Small);
  const FreeListKey key = key_of(*seg);
  cache.add_segment(seg.get(), stream(0));
  // Small pool: a remainder of 512 B is split off ...
  Block* a = allocate(cache, cache.find(key, stream(0), kSmallSegment - 512), kSmallSegment - 512);
  CHECK(a->size == kSmallSegment - 512 && a->next && a->next->size == 512 && cache.listed() == 1);
  Block* b = allocate(cache, cache.find(key, stream(0), 512), 512);
  CHECK(b == a->next && b->size == 512 && cache.listed() == 0);  // none left: no split
  release(cache, a);
  release(cache, b);
  CHECK(blocks_in(*seg) == 1 && seg->fully_free());
  cache.remove_segment(seg.get());
}

void test_streams_and_keys() {
  BlockCache cache;
  auto s1 = fake_segment(0x300000000ull, 20 * MiB, PoolKind::Large);
  auto s2 = fake_segment(0x400000000ull, 20 * MiB, PoolKind::Large);
  auto host = fake_segment(0x500000000ull, 20 * MiB, PoolKind::Large, Tier::Host);
  auto kv = fake_segment(0x600000000ull, 20 * MiB, PoolKind::Large, Tier::Device, AllocClass::KV);
  auto priv = fake_segment(0x700000000ull, 20 * MiB, PoolKind::Large);
  priv->pool = PoolId{7, 1};
  Block* b1 = cache.add_segment(s1.get(), stream(1));
  Block* b2 = cache.add_segment(s2.get(), stream(2));
  Block* bh = cache.add_segment(host.get(), stream(1));
  Block* bk = cache.add_segment(kv.get(), stream(1));
  Block* bp = cache.add_segment(priv.get(), stream(1));
  CHECK(cache.listed() == 5);
  const FreeListKey dev = key_of(*s1);
  // Per stream: a block is found only on the stream it belongs to.
  CHECK(cache.find(dev, stream(1), 4 * MiB) == b1);
  CHECK(cache.find(dev, stream(2), 4 * MiB) == b2);
  CHECK(cache.find(dev, stream(3), 4 * MiB) == nullptr);
  // Per key: tier, class and pool are separate lists.
  CHECK(cache.find(key_of(*host), stream(1), 4 * MiB) == bh);
  CHECK(cache.find(key_of(*kv), stream(1), 4 * MiB) == bk);
  CHECK(cache.find(key_of(*priv), stream(1), 4 * MiB) == bp);
  CHECK(cache.find(FreeListKey{PoolId{}, Tier::Host, AllocClass::KV, PoolKind::Large}, stream(1), 512) == nullptr);

  // A freed block is found again, on its stream, at its address.
  Block* x = allocate(cache, cache.find(dev, stream(1), 6 * MiB), 6 * MiB);
  CHECK(x == b1 && cache.find(dev, stream(1), 15 * MiB) == nullptr);
  Block* y = allocate(cache, cache.find(dev, stream(1), 4 * MiB), 4 * MiB);  // from the 14 MiB rest
  CHECK(y->ptr == s1->base + 6 * MiB);
  release(cache, x);
  CHECK(cache.find(dev, stream(1), 6 * MiB) == x && x->ptr == s1->base && x->size == 6 * MiB);
  CHECK(cache.find(dev, stream(2), 6 * MiB) == b2);  // stream 2 still gets its own segment
  release(cache, y);
  CHECK(s1->fully_free() && cache.listed() == 5);

  // Relisting after a tier change (migration): erase, change, insert.
  cache.erase(b1);
  s1->chunks.front().tier = Tier::Host;
  cache.insert(b1);
  CHECK(cache.find(dev, stream(1), 4 * MiB) == nullptr);
  CHECK(cache.find(key_of(*s1), stream(1), 20 * MiB) == b1);

  for (Segment* s : {s1.get(), s2.get(), host.get(), kv.get(), priv.get()}) cache.remove_segment(s);
  CHECK(cache.listed() == 0);
}

}  // namespace

int main() {
  test_best_fit_split_merge();
  test_small_pool_split();
  test_streams_and_keys();
  if (failures) {
    std::printf("%d of %d checks failed\n", failures, checks);
    return 1;
  }
  std::printf("ok: %d checks\n", checks);
  return 0;
}
