// Streams and their worker threads, enqueueing with the legacy-stream
// ordering, synchronization, the sticky error, and the process hooks (exit,
// fork).  See stream_executor.h for the model and the locking rule.
#include <chrono>

#include <pthread.h>

#include "sim/stream_executor_impl.h"
#include "sim/errors.h"
#include "sim/memory.h"
#include "sim/numa.h"

namespace cxlsim {

StreamExecutor& executor() {
  static StreamExecutor* e = new StreamExecutor();
  return *e;
}

bool deps_done(const std::vector<Dep>& deps) {
  for (const auto& d : deps)
    if (d.stream->completed < d.seq) return false;
  return true;
}

namespace {

void record_fault_locked(StreamExecutor& e, int device, const std::string& msg) {
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
  StreamExecutor& e = executor();
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

std::shared_ptr<Stream> start_stream_locked(StreamExecutor& e, int device, unsigned flags, bool legacy) {
  auto s = std::make_shared<Stream>();
  s->id = e.next_id++;
  s->device = device;
  s->flags = flags;
  s->legacy = legacy;
  e.workers.emplace_back(s, std::make_unique<std::thread>(run_worker, s));
  return s;
}

std::shared_ptr<Stream> legacy_locked(StreamExecutor& e, int device) {
  if (!e.legacy[device]) e.legacy[device] = start_stream_locked(e, device, 0, true);
  return e.legacy[device];
}

// Join workers whose stream was destroyed and has drained.
void reap_locked(StreamExecutor& e) {
  for (auto it = e.workers.begin(); it != e.workers.end();) {
    if (it->first->exited) {
      it->second->join();  // the worker holds no lock once `exited` is visible
      it = e.workers.erase(it);
    } else {
      ++it;
    }
  }
}

// The implicit ordering of the legacy stream: its work waits for all prior
// work of the device's blocking streams, and theirs for its prior work.
std::vector<Dep> implicit_deps_locked(StreamExecutor& e, const std::shared_ptr<Stream>& s) {
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

// Positions a synchronize of `s` must reach: its own tail, and for the
// legacy stream the tails of the blocking streams it implicitly waits for.
std::vector<Dep> sync_targets_locked(StreamExecutor& e, const std::shared_ptr<Stream>& s) {
  std::vector<Dep> t{Dep{s, s->submitted}};
  if (s->legacy)
    for (const auto& [id, u] : e.streams)
      if (u->device == s->device && u->blocking()) t.push_back(Dep{u, u->submitted});
  return t;
}

// fork(): the child inherits the executor's state but none of its worker
// threads, so it can never run stream work.  As with a real driver, the
// child cannot use CUDA: the executor is shut down there and the inherited
// thread objects are abandoned (joining threads of another process is
// undefined).  The registry and executor locks are held across fork() so the
// child never inherits them locked by a thread that does not exist there.
void before_fork() {
  registry().mu.lock();
  executor().mu.lock();
}
void after_fork_parent() {
  executor().mu.unlock();
  registry().mu.unlock();
}
void after_fork_child() {
  StreamExecutor& e = executor();
  e.forked = true;
  e.shutdown = true;
  for (auto& w : e.workers) w.second.release();  // leaked on purpose, see above
  e.workers.clear();
  e.mu.unlock();
  registry().mu.unlock();
}

struct ProcessHooks {
  ProcessHooks() { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }
  // Process exit: stop every worker (queued work is abandoned, as a GPU's
  // is when the process dies) and join them, so no thread runs while the
  // process tears down.
  ~ProcessHooks() {
    StreamExecutor& e = executor();
    std::vector<std::pair<std::shared_ptr<Stream>, std::unique_ptr<std::thread>>> workers;
    {
      std::lock_guard<std::mutex> lk(e.mu);
      e.shutdown = true;
      workers.swap(e.workers);
      e.cv.notify_all();
    }
    for (auto& w : workers)
      if (w.second->joinable()) w.second->join();
  }
} g_process_hooks;

}  // namespace

bool blocking_capture_locked(StreamExecutor& e, int device) {
  for (const auto& [id, s] : e.streams)
    if (s->device == device && s->blocking() && s->capture != Capture::None) return true;
  return false;
}

CUresult submit_locked(StreamExecutor& e, const std::shared_ptr<Stream>& s, Op op, std::vector<Dep> deps,
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

int stream_device(const Stream& s) { return s.device; }

bool stream_is_legacy(const Stream& s) { return s.legacy; }

CUresult find_stream(CUstream h, int device, std::shared_ptr<Stream>* out) {
  StreamExecutor& e = executor();
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
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  return submit_locked(e, s, std::move(op), {}, seq);
}

void wait_for(const std::shared_ptr<Stream>& s, uint64_t seq) {
  StreamExecutor& e = executor();
  std::unique_lock<std::mutex> lk(e.mu);
  e.cv.wait(lk, [&] { return e.shutdown || s->completed >= seq; });
}

CUresult stream_create(int device, unsigned flags, CUstream* out) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  reap_locked(e);
  auto s = start_stream_locked(e, device, flags, false);
  e.streams.emplace(s->id, s);
  *out = stream_handle(s->id);
  return CUDA_SUCCESS;
}

CUresult stream_destroy(CUstream h) {
  StreamExecutor& e = executor();
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
  return CUDA_SUCCESS;
}

CUresult stream_synchronize(const std::shared_ptr<Stream>& s) {
  StreamExecutor& e = executor();
  std::unique_lock<std::mutex> lk(e.mu);
  CUresult r = capture_check_locked(e, s);
  if (r != CUDA_SUCCESS) return r;
  auto targets = sync_targets_locked(e, s);
  e.cv.wait(lk, [&] { return e.shutdown || deps_done(targets); });
  if (e.shutdown) return CUDA_ERROR_DEINITIALIZED;
  return e.sticky[s->device];
}

CUresult stream_query(const std::shared_ptr<Stream>& s) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  CUresult r = capture_check_locked(e, s);
  if (r != CUDA_SUCCESS) return r;
  if (e.sticky[s->device] != CUDA_SUCCESS) return e.sticky[s->device];
  return deps_done(sync_targets_locked(e, s)) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult stream_wait_event(const std::shared_ptr<Stream>& s, CUevent h, unsigned flags) {
  StreamExecutor& e = executor();
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

CUresult device_synchronize(int device) {
  StreamExecutor& e = executor();
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

CUresult sticky_error(int device) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.sticky[device];
}

void context_destroyed(int device) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  e.sticky[device] = CUDA_SUCCESS;
}

void live_streams_and_events(uint64_t* streams, uint64_t* events) {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  *streams = e.streams.size();
  *events = e.events.size();
}

void executor_reset() {
  StreamExecutor& e = executor();
  std::vector<std::pair<std::shared_ptr<Stream>, std::unique_ptr<std::thread>>> workers;
  {
    std::lock_guard<std::mutex> lk(e.mu);
    for (auto& l : e.legacy)
      if (l) l->closing = true;
    for (auto& l : e.legacy) l.reset();
    workers.swap(e.workers);  // every remaining worker drains and exits
    e.cv.notify_all();
  }
  for (auto& w : workers)
    if (w.second->joinable()) w.second->join();
  std::lock_guard<std::mutex> lk(e.mu);
  for (auto& s : e.sticky) s = CUDA_SUCCESS;
  e.violations = 0;
  e.async_faults = 0;
  e.last_fault.clear();
}

bool executor_shut_down() { return executor().shutdown.load(std::memory_order_acquire); }

bool executor_forked() {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.forked;
}

uint64_t async_fault_count() {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.async_faults;
}

std::string last_async_fault() {
  StreamExecutor& e = executor();
  std::lock_guard<std::mutex> lk(e.mu);
  return e.last_fault;
}

}  // namespace cxlsim
