// Streams, events, capture and the sticky error: the simulated GPU's
// execution engine (see engine.h for the model and the locking rule).
#include "sim/engine.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "sim/config.h"
#include "sim/errors.h"
#include "sim/memory.h"
#include "sim/numa.h"

namespace cxlsim {

namespace {

enum class Capture { None, Active, Invalidated };

// Handles are tagged ids, not pointers: a destroyed handle never aliases a
// new object, so every use after destroy is CUDA_ERROR_INVALID_HANDLE.
constexpr uint64_t kIdMask = (1ull << 48) - 1;
constexpr uint64_t kStreamTag = 0x5157ull << 48;
constexpr uint64_t kEventTag = 0x5e5eull << 48;

struct Dep {
  std::shared_ptr<Stream> stream;
  uint64_t seq;
};

struct Queued {
  Op op;
  uint64_t seq;
  std::vector<Dep> deps;
};

struct Event {
  uint64_t id = 0;
  int device = 0;
  unsigned flags = 0;
  bool recorded = false;
  std::shared_ptr<Stream> stream;  // where the last record sits
  uint64_t seq = 0;
  uint64_t capture_origin = 0;     // recorded inside this capture (origin stream id)
};

}  // namespace

struct Stream {
  uint64_t id = 0;
  int device = 0;
  unsigned flags = 0;
  bool legacy = false;
  std::deque<Queued> queue;
  uint64_t submitted = 0, completed = 0;
  bool closing = false;  // destroyed: drain the queue, then stop
  bool exited = false;
  Capture capture = Capture::None;
  uint64_t capture_origin = 0;  // id of the stream that began the capture
  uint64_t captured = 0;        // operations recorded (not run) while capturing

  bool blocking() const { return !legacy && (flags & CU_STREAM_NON_BLOCKING) == 0; }
};

namespace {

struct Engine {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> shutdown{false};
  uint64_t next_id = 1;
  std::map<uint64_t, std::shared_ptr<Stream>> streams;  // live user streams
  std::shared_ptr<Stream> legacy[kMaxDevices];
  std::map<uint64_t, std::shared_ptr<Event>> events;
  std::vector<std::pair<std::shared_ptr<Stream>, std::thread>> workers;
  CUresult sticky[kMaxDevices] = {};
  uint64_t violations = 0;
  uint64_t async_faults = 0;
  std::string last_fault;
};

// Leaked on purpose: workers and late callers may touch it during exit.
Engine& eng() {
  static Engine* e = new Engine();
  return *e;
}

CUstream stream_handle(uint64_t id) { return reinterpret_cast<CUstream>(kStreamTag | id); }
CUevent event_handle(uint64_t id) { return reinterpret_cast<CUevent>(kEventTag | id); }

std::shared_ptr<Event> find_event_locked(Engine& e, CUevent h) {
  auto v = reinterpret_cast<uint64_t>(h);
  if ((v & ~kIdMask) != kEventTag) return nullptr;
  auto it = e.events.find(v & kIdMask);
  return it == e.events.end() ? nullptr : it->second;
}

bool deps_done(const std::vector<Dep>& deps) {
  for (const auto& d : deps)
    if (d.stream->completed < d.seq) return false;
  return true;
}

void record_fault_locked(Engine& e, int device, const std::string& msg) {
  if (e.sticky[device] == CUDA_SUCCESS) e.sticky[device] = CUDA_ERROR_ILLEGAL_ADDRESS;
  ++e.async_faults;
  e.last_fault = msg;
}

CUresult execute(const Op& op, int device, std::string* why) {
  switch (op.kind) {
    case OpKind::Copy:
      return device_copy(op.dst, op.src, op.n, device, why);
    case OpKind::WriteU64:
      return device_write_u64(op.dst, op.value, device, why);
    case OpKind::Prefetch:
      // Migrate pages already present; new ones follow the binding.  Best
      // effort, as page migration is on real systems.
      if (op.real_node >= 0)
        bind_pages(reinterpret_cast<void*>(page_down(op.dst)), page_up(op.dst + op.n) - page_down(op.dst),
                   op.real_node, true);
      return CUDA_SUCCESS;
    default:
      return CUDA_SUCCESS;
  }
}

void run_worker(std::shared_ptr<Stream> s) {
  Engine& e = eng();
  std::unique_lock<std::mutex> lk(e.mu);
  for (;;) {
    e.cv.wait(lk, [&] { return e.shutdown || !s->queue.empty() || s->closing; });
    if (e.shutdown || s->queue.empty()) break;
    Queued& q = s->queue.front();  // deque references survive push_back
    e.cv.wait(lk, [&] { return e.shutdown || deps_done(q.deps); });
    if (e.shutdown) break;
    const Op op = q.op;
    const uint64_t seq = q.seq;
    if (op.kind == OpKind::Sleep) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(op.value);
      e.cv.wait_until(lk, until, [&] { return e.shutdown.load(); });
      if (e.shutdown) break;
    } else if (op.kind != OpKind::Marker) {
      lk.unlock();
      std::string why;
      CUresult r = execute(op, s->device, &why);
      lk.lock();
      if (op.result)
        *op.result = r;
      else if (r != CUDA_SUCCESS)
        record_fault_locked(e, s->device,
                            std::string(op.what) + " on stream " + hex(reinterpret_cast<uint64_t>(
                                                                       s->legacy ? nullptr : stream_handle(s->id))) +
                                " faulted on device " + std::to_string(s->device) + ": " + why);
    }
    s->queue.pop_front();
    s->completed = seq;
    e.cv.notify_all();
  }
  s->exited = true;
  e.cv.notify_all();
}

std::shared_ptr<Stream> start_stream_locked(Engine& e, int device, unsigned flags, bool legacy) {
  auto s = std::make_shared<Stream>();
  s->id = e.next_id++;
  s->device = device;
  s->flags = flags;
  s->legacy = legacy;
  e.workers.emplace_back(s, std::thread(run_worker, s));
  return s;
}

std::shared_ptr<Stream> legacy_locked(Engine& e, int device) {
  if (!e.legacy[device]) e.legacy[device] = start_stream_locked(e, device, 0, true);
  return e.legacy[device];
}

// Join workers whose stream was destroyed and has drained.
void reap_locked(Engine& e) {
  for (auto it = e.workers.begin(); it != e.workers.end();) {
    if (it->first->exited) {
      it->second.join();  // the worker holds no lock once `exited` is visible
      it = e.workers.erase(it);
    } else {
      ++it;
    }
  }
}

bool blocking_capture_locked(Engine& e, int device) {
  for (const auto& [id, s] : e.streams)
    if (s->device == device && s->blocking() && s->capture != Capture::None) return true;
  return false;
}

// An illegal call during capture: count it and invalidate that capture
// (origin 0: every active capture, for the global-mode unsafe calls).
void violation_locked(Engine& e, uint64_t origin) {
  ++e.violations;
  for (auto& [id, s] : e.streams)
    if (s->capture != Capture::None && (origin == 0 || s->capture_origin == origin))
      s->capture = Capture::Invalidated;
}

// The implicit ordering of the legacy stream: its work waits for all prior
// work of the device's blocking streams, and theirs for its prior work.
std::vector<Dep> implicit_deps_locked(Engine& e, const std::shared_ptr<Stream>& s) {
  std::vector<Dep> deps;
  if (s->legacy) {
    for (const auto& [id, u] : e.streams)
      if (u->device == s->device && u->blocking() && u->submitted > u->completed)
        deps.push_back(Dep{u, u->submitted});
  } else if (s->blocking()) {
    const auto& l = e.legacy[s->device];
    if (l && l->submitted > l->completed) deps.push_back(Dep{l, l->submitted});
  }
  return deps;
}

CUresult submit_locked(Engine& e, const std::shared_ptr<Stream>& s, Op op, std::vector<Dep> deps,
                       uint64_t* seq) {
  *seq = 0;
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  if (s->closing) return CUDA_ERROR_INVALID_HANDLE;
  if (s->capture == Capture::Invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  if (s->capture == Capture::Active) {
    ++s->captured;  // recorded into the graph being captured, never run here
    return CUDA_SUCCESS;
  }
  if (s->legacy && blocking_capture_locked(e, s->device)) {
    ++e.violations;
    return kErrStreamCaptureImplicit;
  }
  auto implicit = implicit_deps_locked(e, s);
  deps.insert(deps.end(), implicit.begin(), implicit.end());
  *seq = ++s->submitted;
  s->queue.push_back(Queued{std::move(op), *seq, std::move(deps)});
  e.cv.notify_all();
  return CUDA_SUCCESS;
}

// Positions a synchronize of `s` must reach: its own tail, and for the
// legacy stream the tails of the blocking streams it implicitly waits for.
std::vector<Dep> sync_targets_locked(Engine& e, const std::shared_ptr<Stream>& s) {
  std::vector<Dep> t{Dep{s, s->submitted}};
  if (s->legacy)
    for (const auto& [id, u] : e.streams)
      if (u->device == s->device && u->blocking()) t.push_back(Dep{u, u->submitted});
  return t;
}

// Capture rules shared by synchronize and query of a stream.
CUresult capture_check_locked(Engine& e, const std::shared_ptr<Stream>& s) {
  if (s->capture != Capture::None) {
    violation_locked(e, s->capture_origin);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  if (s->legacy && blocking_capture_locked(e, s->device)) {
    ++e.violations;
    return kErrStreamCaptureImplicit;
  }
  return CUDA_SUCCESS;
}

void end_capture_locked(Engine& e, uint64_t origin) {
  for (auto& [id, s] : e.streams)
    if (s->capture_origin == origin) {
      s->capture = Capture::None;
      s->capture_origin = 0;
    }
  // Events recorded inside the capture named graph nodes, not stream work;
  // outside it they read as never recorded.
  for (auto& [id, ev] : e.events)
    if (ev->capture_origin == origin) {
      ev->capture_origin = 0;
      ev->recorded = false;
      ev->stream.reset();
    }
}

struct ShutdownAtExit {
  // Process exit: stop every worker (queued work is abandoned, as a GPU's
  // is when the process dies) and join them, so no thread runs while the
  // process tears down.
  ~ShutdownAtExit() {
    Engine& e = eng();
    std::vector<std::pair<std::shared_ptr<Stream>, std::thread>> workers;
    {
      std::lock_guard<std::mutex> lk(e.mu);
      e.shutdown = true;
      workers.swap(e.workers);
      e.cv.notify_all();
    }
    for (auto& w : workers)
      if (w.second.joinable()) w.second.join();
  }
} g_shutdown_at_exit;

}  // namespace

int stream_device(const Stream& s) { return s.device; }
bool stream_is_legacy(const Stream& s) { return s.legacy; }

CUresult find_stream(CUstream h, int device, std::shared_ptr<Stream>* out) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  auto v = reinterpret_cast<uint64_t>(h);
  // 0 = the NULL stream, 1 = CU_STREAM_LEGACY, 2 = CU_STREAM_PER_THREAD (the
  // simulator runs per-thread default streams on the legacy stream: stricter
  // ordering than CUDA, never weaker).
  if (v <= 2) {
    *out = legacy_locked(e, device);
    return CUDA_SUCCESS;
  }
  if ((v & ~kIdMask) != kStreamTag) return CUDA_ERROR_INVALID_HANDLE;
  auto it = e.streams.find(v & kIdMask);
  if (it == e.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  *out = it->second;
  return CUDA_SUCCESS;
}

CUresult submit(const std::shared_ptr<Stream>& s, Op op, uint64_t* seq) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  return submit_locked(e, s, std::move(op), {}, seq);
}

void wait_for(const std::shared_ptr<Stream>& s, uint64_t seq) {
  Engine& e = eng();
  std::unique_lock<std::mutex> lk(e.mu);
  e.cv.wait(lk, [&] { return e.shutdown || s->completed >= seq; });
}

CUresult stream_create(int device, unsigned flags, CUstream* out) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  reap_locked(e);
  auto s = start_stream_locked(e, device, flags, false);
  e.streams.emplace(s->id, s);
  *out = stream_handle(s->id);
  return CUDA_SUCCESS;
}

CUresult stream_destroy(CUstream h, int device) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  auto v = reinterpret_cast<uint64_t>(h);
  if ((v & ~kIdMask) != kStreamTag) return CUDA_ERROR_INVALID_HANDLE;
  auto it = e.streams.find(v & kIdMask);
  if (it == e.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  auto s = it->second;
  // Destroying a capturing stream abandons its part of the capture (and the
  // whole capture when it began it).
  if (s->capture != Capture::None) {
    if (s->capture_origin == s->id) end_capture_locked(e, s->id);
    s->capture = Capture::None;
    s->capture_origin = 0;
  }
  // CUDA returns at once and releases the stream after its queued work
  // completes: the worker drains, then exits and is reaped later.
  s->closing = true;
  e.streams.erase(it);
  e.cv.notify_all();
  reap_locked(e);
  (void)device;
  return CUDA_SUCCESS;
}

CUresult stream_synchronize(const std::shared_ptr<Stream>& s) {
  Engine& e = eng();
  std::unique_lock<std::mutex> lk(e.mu);
  CUresult r = capture_check_locked(e, s);
  if (r != CUDA_SUCCESS) return r;
  auto targets = sync_targets_locked(e, s);
  e.cv.wait(lk, [&] { return e.shutdown || deps_done(targets); });
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  return e.sticky[s->device];
}

CUresult stream_query(const std::shared_ptr<Stream>& s) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  CUresult r = capture_check_locked(e, s);
  if (r != CUDA_SUCCESS) return r;
  if (e.sticky[s->device] != CUDA_SUCCESS) return e.sticky[s->device];
  return deps_done(sync_targets_locked(e, s)) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult stream_wait_event(const std::shared_ptr<Stream>& s, CUevent h, unsigned flags) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  // CU_EVENT_WAIT_EXTERNAL (1) is only valid while capturing.
  if (flags > 1 || (flags == 1 && s->capture == Capture::None)) return CUDA_ERROR_INVALID_VALUE;
  if (!ev->recorded) return CUDA_SUCCESS;  // waiting on a never-recorded event is a no-op
  if (ev->capture_origin != 0 && s->capture == Capture::None) {
    // Waiting on an event recorded inside a capture joins the capture
    // (the fork pattern of multi-stream capture).
    if (s->legacy) {
      violation_locked(e, ev->capture_origin);
      return kErrStreamCaptureImplicit;
    }
    Capture state = Capture::Active;
    for (const auto& [id, u] : e.streams)
      if (u->id == ev->capture_origin) state = u->capture;
    s->capture = state;
    s->capture_origin = ev->capture_origin;
    return CUDA_SUCCESS;
  }
  uint64_t seq;
  std::vector<Dep> deps;
  if (ev->capture_origin == 0) deps.push_back(Dep{ev->stream, ev->seq});
  Op op;
  op.what = "cuStreamWaitEvent";
  return submit_locked(e, s, op, std::move(deps), &seq);
}

CUresult stream_is_capturing(const std::shared_ptr<Stream>& s, CUstreamCaptureStatus* status) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  if (s->legacy) {
    if (blocking_capture_locked(e, s->device)) {
      ++e.violations;  // cuda.h: IMPLICIT, and the capture is not invalidated
      return kErrStreamCaptureImplicit;
    }
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
  }
  *status = s->capture == Capture::Active        ? CU_STREAM_CAPTURE_STATUS_ACTIVE
            : s->capture == Capture::Invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                                 : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

CUresult event_create(int device, unsigned flags, CUevent* out) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  auto ev = std::make_shared<Event>();
  ev->id = e.next_id++;
  ev->device = device;
  ev->flags = flags;
  e.events.emplace(ev->id, ev);
  *out = event_handle(ev->id);
  return CUDA_SUCCESS;
}

CUresult event_destroy(CUevent h) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  e.events.erase(ev->id);  // pending waits hold the stream position, not the event
  return CUDA_SUCCESS;
}

CUresult event_record(CUevent h, const std::shared_ptr<Stream>& s) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  if (ev->device != s->device) return CUDA_ERROR_INVALID_HANDLE;  // event and stream of different contexts
  if (s->capture == Capture::Invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  if (s->capture == Capture::Active) {
    ++s->captured;
    ev->recorded = true;
    ev->stream.reset();
    ev->capture_origin = s->capture_origin;
    return CUDA_SUCCESS;
  }
  uint64_t seq;
  Op op;
  op.what = "cuEventRecord";
  CUresult r = submit_locked(e, s, op, {}, &seq);
  if (r != CUDA_SUCCESS) return r;
  ev->recorded = true;
  ev->stream = s;
  ev->seq = seq;
  ev->capture_origin = 0;
  return CUDA_SUCCESS;
}

CUresult event_query(CUevent h) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  if (!ev->recorded) return CUDA_SUCCESS;
  if (ev->capture_origin != 0) {
    violation_locked(e, ev->capture_origin);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  if (e.sticky[ev->device] != CUDA_SUCCESS) return e.sticky[ev->device];
  return ev->stream->completed >= ev->seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult event_synchronize(CUevent h) {
  Engine& e = eng();
  std::unique_lock<std::mutex> lk(e.mu);
  auto ev = find_event_locked(e, h);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  if (!ev->recorded) return CUDA_SUCCESS;
  if (ev->capture_origin != 0) {
    violation_locked(e, ev->capture_origin);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  auto s = ev->stream;
  uint64_t seq = ev->seq;
  e.cv.wait(lk, [&] { return e.shutdown || s->completed >= seq; });
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  return e.sticky[ev->device];
}

CUresult device_synchronize(int device) {
  Engine& e = eng();
  std::unique_lock<std::mutex> lk(e.mu);
  std::vector<Dep> targets;
  for (const auto& [id, s] : e.streams)
    if (s->device == device) targets.push_back(Dep{s, s->submitted});
  // Destroyed streams still draining are device work too.
  for (const auto& w : e.workers)
    if (w.first->device == device) targets.push_back(Dep{w.first, w.first->submitted});
  e.cv.wait(lk, [&] { return e.shutdown || deps_done(targets); });
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  return e.sticky[device];
}

CUresult check_capture_safe() {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  for (const auto& [id, s] : e.streams)
    if (s->capture != Capture::None) {
      violation_locked(e, 0);
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
  return CUDA_SUCCESS;
}

CUresult sticky_error(int device) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.sticky[device];
}

void context_destroyed(int device) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  e.sticky[device] = CUDA_SUCCESS;
}

void live_engine(uint64_t* streams, uint64_t* events) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  *streams = e.streams.size();
  *events = e.events.size();
}

void engine_reset() {
  Engine& e = eng();
  std::vector<std::pair<std::shared_ptr<Stream>, std::thread>> workers;
  {
    std::lock_guard<std::mutex> lk(e.mu);
    for (auto& l : e.legacy)
      if (l) l->closing = true;
    for (auto& l : e.legacy) l.reset();
    workers.swap(e.workers);  // every remaining worker drains and exits
    e.cv.notify_all();
  }
  for (auto& w : workers)
    if (w.second.joinable()) w.second.join();
  std::lock_guard<std::mutex> lk(e.mu);
  for (auto& s : e.sticky) s = CUDA_SUCCESS;
  e.violations = 0;
  e.async_faults = 0;
  e.last_fault.clear();
}

bool engine_shut_down() { return eng().shutdown.load(std::memory_order_acquire); }

int capture_begin(CUstream h) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  auto v = reinterpret_cast<uint64_t>(h);
  auto it = (v & ~kIdMask) == kStreamTag ? e.streams.find(v & kIdMask) : e.streams.end();
  if (it == e.streams.end()) {
    set_last_error("cxlsim_begin_capture: " + hex(v) +
                   " is not a live cuStreamCreate stream (the legacy/NULL stream cannot be captured)");
    return -1;
  }
  auto& s = it->second;
  if (s->capture != Capture::None) {
    set_last_error("cxlsim_begin_capture: stream " + hex(v) + " is already capturing");
    return -1;
  }
  s->capture = Capture::Active;
  s->capture_origin = s->id;
  return 0;
}

int capture_end(CUstream h) {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  auto v = reinterpret_cast<uint64_t>(h);
  auto it = (v & ~kIdMask) == kStreamTag ? e.streams.find(v & kIdMask) : e.streams.end();
  if (it == e.streams.end() || it->second->capture == Capture::None || it->second->capture_origin != it->second->id) {
    set_last_error("cxlsim_end_capture: " + hex(v) + " is not a stream that began a capture");
    return -1;
  }
  end_capture_locked(e, it->second->id);
  return 0;
}

uint64_t capture_violations() {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.violations;
}

uint64_t async_fault_count() {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.async_faults;
}

std::string last_async_fault() {
  Engine& e = eng();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.last_fault;
}

}  // namespace cxlsim
