// The simulated GPU's stream executor: streams with worker threads, events,
// stream capture state, and the sticky error of an asynchronous fault.
//
// Every stream (each cuStreamCreate stream, and one legacy NULL stream per
// device) has a FIFO of operations run in order by its own worker thread.
// An operation may depend on positions in other streams (cuStreamWaitEvent,
// and the implicit legacy-stream ordering between the NULL stream and
// blocking streams); the worker waits for those first.  Positions are
// sequence numbers: an operation at seq N of stream S is complete once
// S.completed >= N.  Because dependencies only ever name work enqueued
// before them, the graph is acyclic and no worker can deadlock.
//
// Locking: one executor mutex guards every stream, event and capture field;
// one condition variable is notified on every enqueue and completion.
// Operations that touch memory run without the executor mutex (the memory
// registry has its own).  The executor mutex is innermost: it is never held
// while taking another simulator lock (the registry's may be held around
// it, see memory.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "sim/api.h"

namespace cxlsim {

struct Stream;

enum class OpKind { Marker, Copy, Sleep, WriteU64, Prefetch };

struct Op {
  OpKind kind = OpKind::Marker;
  uint64_t dst = 0, src = 0, n = 0, value = 0;  // Copy / WriteU64 / Prefetch range; Sleep: value = usec
  int real_node = -1;                           // Prefetch to host: real node the pages migrate to
  std::shared_ptr<CUresult> result;             // set: a synchronous caller takes the op's error itself
  const char* what = "";                        // API name for fault messages
};

// Resolve a stream handle as seen by a thread whose current context is on
// `device`: NULL / CU_STREAM_LEGACY / CU_STREAM_PER_THREAD name that device's
// legacy stream.  CUDA_ERROR_INVALID_HANDLE for anything not live.
CUresult find_stream(CUstream h, int device, std::shared_ptr<Stream>* out);
int stream_device(const Stream& s);
bool stream_is_legacy(const Stream& s);

// Enqueue `op` (seq of the op in *seq; 0 when it was captured instead of
// queued).  Capturing streams record nothing runnable: captured work never
// executes.  Fails with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT when `s` is the
// legacy stream and a blocking stream of its device is capturing.
CUresult submit(const std::shared_ptr<Stream>& s, Op op, uint64_t* seq);
// Wait until op `seq` of `s` completed (no capture checks).
void wait_for(const std::shared_ptr<Stream>& s, uint64_t seq);

CUresult stream_create(int device, unsigned flags, CUstream* out);
CUresult stream_destroy(CUstream h);
CUresult stream_synchronize(const std::shared_ptr<Stream>& s);
CUresult stream_query(const std::shared_ptr<Stream>& s);
CUresult stream_wait_event(const std::shared_ptr<Stream>& s, CUevent e, unsigned flags);
CUresult stream_is_capturing(const std::shared_ptr<Stream>& s, CUstreamCaptureStatus* status);

CUresult event_create(int device, unsigned flags, CUevent* out);
CUresult event_destroy(CUevent e);
CUresult event_record(CUevent e, const std::shared_ptr<Stream>& s);
CUresult event_query(CUevent e);
CUresult event_synchronize(CUevent e);

// Wait for all work queued so far on every stream of `device` and return its
// sticky error (cuCtxSynchronize and the implicitly synchronizing frees).
CUresult device_synchronize(int device);

// Global capture mode: while any stream captures, "unsafe" calls from any
// thread (allocation, free, registration, context synchronize) fail with
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, count a violation and invalidate
// the captures.  Returns CUDA_SUCCESS when no capture is active.
CUresult check_capture_safe();

// The sticky error of `device`'s context after an asynchronous fault.
CUresult sticky_error(int device);
// The primary context of `device` was destroyed: its sticky error clears.
void context_destroyed(int device);

// Live user streams and events.
void live_streams_and_events(uint64_t* streams, uint64_t* events);
// Drain and stop the legacy streams and clear counters (cxlsim_configure
// with nothing live).
void executor_reset();
// True once process exit began stopping the workers (or in a fork() child).
bool executor_shut_down();
// True in the child of a fork() (the driver is unusable there).
bool executor_forked();

}  // namespace cxlsim

namespace cxlsim {

// cxlsim_* capture and fault controls (0 / -1 with cxlsim_last_error set).
int capture_begin(CUstream h);
int capture_end(CUstream h);
uint64_t capture_violations();
uint64_t async_fault_count();
std::string last_async_fault();

}  // namespace cxlsim
