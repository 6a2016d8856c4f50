// Internals of the stream executor shared by stream_executor.cpp (workers,
// streams, synchronization), events.cpp and capture.cpp.  See
// stream_executor.h for the model and the locking rule: every field below is
// guarded by StreamExecutor::mu.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sim/config.h"
#include "sim/stream_executor.h"

namespace cxlsim {

enum class Capture { None, Active, Invalidated };

// Handles are tagged ids, not pointers: a destroyed handle never aliases a
// new object, so every use after destroy is CUDA_ERROR_INVALID_HANDLE.
constexpr uint64_t kIdMask = (1ull << 48) - 1;
constexpr uint64_t kStreamTag = 0x5157ull << 48;
constexpr uint64_t kEventTag = 0x5e5eull << 48;

// A position an operation waits for: op `seq` of `stream` completed.
struct Dep {
  std::shared_ptr<Stream> stream;
  uint64_t seq;
};

// An operation in a stream's FIFO, with the positions it must wait for.
struct Queued {
  Op op;
  uint64_t seq;
  std::vector<Dep> deps;
};

// An event is the position of its last record (none until recorded).
struct Event {
  uint64_t id = 0;
  int device = 0;
  unsigned flags = 0;
  bool recorded = false;
  std::shared_ptr<Stream> stream;  // where the last record sits
  uint64_t seq = 0;
  uint64_t capture_origin = 0;     // recorded inside this capture (origin stream id)
};

// A stream: its FIFO, worker progress (ops up to `completed` have run) and
// capture state.  A user stream or one device's legacy NULL stream.
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

struct StreamExecutor {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> shutdown{false};
  uint64_t next_id = 1;
  std::map<uint64_t, std::shared_ptr<Stream>> streams;  // live user streams
  std::shared_ptr<Stream> legacy[kMaxDevices];
  std::map<uint64_t, std::shared_ptr<Event>> events;
  std::vector<std::pair<std::shared_ptr<Stream>, std::unique_ptr<std::thread>>> workers;
  bool forked = false;  // this process is a fork() child of one that used the executor
  CUresult sticky[kMaxDevices] = {};
  uint64_t violations = 0;
  uint64_t async_faults = 0;
  std::string last_fault;
};

// The process-wide executor (never destroyed: workers and late callers may
// touch it during exit).
StreamExecutor& executor();

inline CUstream stream_handle(uint64_t id) { return reinterpret_cast<CUstream>(kStreamTag | id); }
inline CUevent event_handle(uint64_t id) { return reinterpret_cast<CUevent>(kEventTag | id); }

// All *_locked functions expect StreamExecutor::mu held.
bool deps_done(const std::vector<Dep>& deps);
CUresult submit_locked(StreamExecutor& e, const std::shared_ptr<Stream>& s, Op op, std::vector<Dep> deps, uint64_t* seq);
std::shared_ptr<Event> find_event_locked(StreamExecutor& e, CUevent h);
// Whether a blocking stream of `device` is capturing (the legacy stream then
// may not be used).
bool blocking_capture_locked(StreamExecutor& e, int device);
// An illegal call during capture: count it and invalidate that capture
// (origin 0: every active capture, for the global-mode unsafe calls).
void violation_locked(StreamExecutor& e, uint64_t origin);
// Capture rules shared by synchronize and query of a stream.
CUresult capture_check_locked(StreamExecutor& e, const std::shared_ptr<Stream>& s);
// End the capture begun on stream `origin`, for every stream that joined it.
void end_capture_locked(StreamExecutor& e, uint64_t origin);

}  // namespace cxlsim
