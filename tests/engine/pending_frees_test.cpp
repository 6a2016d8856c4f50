// Unit test of alloc::PendingFrees, the stream-ordered frees DeviceAllocator
// owns, on the simulated driver (its path is argv[1]): events recorded per
// stream use, a busy stream holding its block back until waited for, the
// tier filter, frees deferred during capture, a failing cuEventRecord and
// all-or-nothing event acquisition.  Blocks live in fake segments (an address
// range, no memory): PendingFrees never touches memory.  Built and run by
// tests/engine/test_pending_frees.py; prints "ok: N checks" and exits 0, or
// names every failed check and exits 1.
#include <cstdio>
#include <memory>
#include <vector>

#include "alloc/pending_frees.h"
#include "common/error.h"

#include "unit_check.h"

using namespace cxl;
using namespace cxl::alloc;


namespace {

using SleepFn = int (*)(void*, uint64_t);
using FailFn = int (*)(const char*, uint64_t, int);

struct Harness {
  driver::DriverPtr drv;
  std::vector<Block*> retired;
  std::vector<CUresult> record_failures;
  std::unique_ptr<PendingFrees> frees;
  explicit Harness(driver::DriverPtr d) : drv(std::move(d)) {
    frees = std::make_unique<PendingFrees>(
        drv, [this](Block* b) { retired.push_back(b); }, [this](CUresult r) { record_failures.push_back(r); });
  }
};

std::unique_ptr<Segment> fake_segment(Tier tier) {
  auto seg = std::make_unique<Segment>();
  seg->base = 0x100000;
  seg->size = 2 << 20;
  backend::Chunk c;
  c.size = seg->size;
  c.tier = tier;
  c.committed = true;
  seg->chunks.push_back(std::move(c));
  return seg;
}

Block block_on(Segment& seg, std::vector<CUstream> uses) {
  Block b;
  b.segment = &seg;
  b.ptr = seg.base;
  b.size = seg.size;
  for (CUstream s : uses) b.stream_uses.insert(s);
  return b;
}

void idle_streams_retire_on_query(const driver::DriverPtr& drv, CUstream s1, CUstream s2) {
  Harness h(drv);
  auto seg = fake_segment(Tier::Device);
  Block b = block_on(*seg, {s1, s2});
  auto events = h.frees->acquire(3);  // one more than needed: it goes back to the pool
  CHECK(events.size() == 3);
  h.frees->wait_for_uses(&b, std::move(events));
  CHECK(b.event_count == 2);
  CHECK(b.stream_uses.empty());
  CHECK(h.frees->waiting());
  CHECK(h.frees->waiting_on(Tier::Device));
  CHECK(!h.frees->waiting_on(Tier::Host));
  CHECK(h.frees->idle_events() == 1);
  CHECK(h.frees->blocks().size() == 2);  // one entry per event
  CHECK(h.retired.empty());
  CHECK(drv->api().fn_cuCtxSynchronize() == CUDA_SUCCESS);
  h.frees->collect(false);
  CHECK(h.retired.size() == 1 && h.retired[0] == &b);  // retired once, after its last event
  CHECK(b.event_count == 0);
  CHECK(!h.frees->waiting());
  CHECK(h.frees->idle_events() == 3);  // events are reused, not destroyed
}

void no_stream_uses_retire_at_once(const driver::DriverPtr& drv) {
  Harness h(drv);
  auto seg = fake_segment(Tier::Device);
  Block b = block_on(*seg, {});
  h.frees->wait_for_uses(&b, h.frees->acquire(0));
  CHECK(h.retired.size() == 1);
  CHECK(!h.frees->waiting());
}

void busy_stream_waits_and_tier_filter(const driver::DriverPtr& drv, SleepFn sleep, CUstream s1, CUstream s2) {
  Harness h(drv);
  auto dev = fake_segment(Tier::Device);
  auto host = fake_segment(Tier::Host);
  Block bd = block_on(*dev, {s1});
  Block bh = block_on(*host, {s2});
  CHECK(sleep(s1, 300000) == 0);  // 0.3 s of "kernel" before the event
  CHECK(sleep(s2, 300000) == 0);
  h.frees->wait_for_uses(&bd, h.frees->acquire(1));
  h.frees->wait_for_uses(&bh, h.frees->acquire(1));
  h.frees->collect(false);  // not ready yet: nothing retired, nothing lost
  CHECK(h.retired.empty());
  CHECK(h.frees->waiting_on(Tier::Device) && h.frees->waiting_on(Tier::Host));
  h.frees->collect(true, int(Tier::Host));  // waits for the host block's event only
  CHECK(h.retired.size() == 1 && h.retired[0] == &bh);
  CHECK(h.frees->waiting_on(Tier::Device));
  CHECK(!h.frees->waiting_on(Tier::Host));
  h.frees->collect(true);
  CHECK(h.retired.size() == 2 && h.retired[1] == &bd);
  CHECK(!h.frees->waiting());
}

void deferred_during_capture(const driver::DriverPtr& drv, CUstream s1) {
  Harness h(drv);
  auto seg = fake_segment(Tier::Device);
  Block b = block_on(*seg, {s1});
  h.frees->defer(&b);
  CHECK(h.frees->has_deferred());
  CHECK(!h.frees->waiting());
  CHECK(b.event_count == 1);  // counted as waiting until its events exist
  CHECK(h.frees->blocks().size() == 1 && h.frees->blocks()[0] == &b);
  h.frees->flush_deferred();
  CHECK(!h.frees->has_deferred());
  CHECK(h.frees->waiting());
  CHECK(b.event_count == 1);
  h.frees->collect(true);
  CHECK(h.retired.size() == 1 && h.retired[0] == &b);
}

void failed_record_waits_for_the_stream(const driver::DriverPtr& drv, FailFn fail, CUstream s1) {
  Harness h(drv);
  auto seg = fake_segment(Tier::Device);
  Block b = block_on(*seg, {s1});
  auto events = h.frees->acquire(1);
  CHECK(fail("cuEventRecord", 1, CUDA_ERROR_INVALID_HANDLE) == 0);
  h.frees->wait_for_uses(&b, std::move(events));
  CHECK(h.record_failures.size() == 1 && h.record_failures[0] == CUDA_ERROR_INVALID_HANDLE);
  CHECK(h.retired.size() == 1);  // the stream was synchronized instead: reusable now
  CHECK(!h.frees->waiting());
  CHECK(h.frees->idle_events() == 1);  // the unused event is kept
}

void acquire_is_all_or_nothing(const driver::DriverPtr& drv, FailFn fail) {
  Harness h(drv);
  CHECK(fail("cuEventCreate", 2, CUDA_ERROR_OUT_OF_MEMORY) == 0);
  bool threw = false;
  try {
    h.frees->acquire(3);
  } catch (const Error&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(h.frees->idle_events() == 1);  // the one made before the failure is pooled, not lost
  CHECK(h.frees->acquire(2).size() == 2);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::printf("usage: %s PATH_OF_SIMCUDA_SO\n", argv[0]);
    return 2;
  }
  driver::DriverPtr drv = driver::Driver::open(argv[1], true);
  auto sleep = reinterpret_cast<SleepFn>(drv->symbol("cxlsim_stream_sleep"));
  auto fail = reinterpret_cast<FailFn>(drv->symbol("cxlsim_fail"));
  CHECK(sleep != nullptr && fail != nullptr);
  if (!sleep || !fail) return 1;
  driver::PrimaryContext ctx(drv, 0);
  driver::ContextGuard guard(*drv, ctx.get());
  {
    driver::Stream s1(drv), s2(drv);
    idle_streams_retire_on_query(drv, s1.get(), s2.get());
    no_stream_uses_retire_at_once(drv);
    busy_stream_waits_and_tier_filter(drv, sleep, s1.get(), s2.get());
    deferred_during_capture(drv, s1.get());
    failed_record_waits_for_the_stream(drv, fail, s1.get());
    acquire_is_all_or_nothing(drv, fail);
  }
  if (failures) {
    std::printf("%d of %d checks failed\n", failures, checks);
    return 1;
  }
  std::printf("ok: %d checks\n", checks);
  return 0;
}
