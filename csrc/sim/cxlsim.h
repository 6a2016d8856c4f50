// Control interface of the simulated CUDA driver (libcxlalloc_simcuda, built as
// cxlalloc/_simcuda*.so).
//
// The simulator exports the CUDA driver entry points cxlalloc uses
// (cuGetProcAddress_v2 hands them out; see csrc/driver/driver.h for the list)
// over host memory, plus these cxlsim_* controls for tests and for the
// simulation mode of the package.  It never stands in for verification on a
// real GPU: it models the API contracts (sizes, alignment, contexts, streams,
// events, capture rules, NUMA placement, capacity), not performance.
//
// All functions are thread-safe.  Strings returned stay valid until the next
// call of the same function on the same thread.
//
// What the simulated driver models (details in the csrc/sim/*.cpp headers):
//  * Memory.  VMM: cuMemAddressReserve is PROT_NONE reserved VA; cuMemCreate
//    a memfd, touched only when used (a 64 GiB "VRAM" costs no RAM);
//    cuMemMap maps it PROT_NONE and cuMemSetAccess sets the CPU protection,
//    so touching memory without access granted is a real SIGSEGV.  Device
//    allocations become CPU-accessible with any device's grant (the CPU
//    stands in for kernels in tests); host (HOST_NUMA/HOST) allocations only
//    with a host location's grant, as on real hardware.  cuMemAlloc,
//    cuMemAllocManaged and cuMemHostAlloc memory is read-write to the CPU.
//    Sizes, alignments, reservation bounds, overlaps and whole-mapping rules
//    return the CUresult cuda.h documents; where cuda.h leaves behaviour
//    undefined (released/unknown handle, freeing VA that is still mapped)
//    the simulator returns CUDA_ERROR_INVALID_VALUE.  cuMemMap's offset must
//    be 0 (cuda.h: "currently must be zero"); cuMemUnmap and cuMemSetAccess
//    take whole mappings (one or several adjacent ones).
//  * VRAM.  cuMemCreate(DEVICE), cuMemAlloc (in whole 4 KiB pages) and
//    managed pages prefetched to a device are charged against `vram`;
//    exceeding it is CUDA_ERROR_OUT_OF_MEMORY.  Managed memory is never
//    evicted to make room (the real driver would evict other managed pages):
//    a prefetch that does not fit fails with CUDA_ERROR_OUT_OF_MEMORY.
//    Managed residency changes when cuMemPrefetchAsync is called; the stream
//    only orders the (best-effort, real) page migration to a host node.
//  * The simulated GPU.  Copies and cxlsim_stream_write_u64 run on stream
//    worker threads and resolve their addresses when they run: memory
//    unmapped (or never granted to the stream's device) by then is an
//    asynchronous fault — a sticky CUDA_ERROR_ILLEGAL_ADDRESS returned by
//    the context's synchronize/query calls until its primary context is
//    released to zero (see cxlsim_async_faults).  cuMemUnmap does not
//    synchronize (as in CUDA); cuMemFree, cuMemFreeHost and
//    cuMemHostUnregister wait for the owning device's queued work first.
//    Kernels (write_u64) cannot reach pageable memory
//    (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 0); copies can.
//  * Streams.  One legacy NULL stream per device (handles 0, CU_STREAM_LEGACY
//    and CU_STREAM_PER_THREAD all name it) with the legacy implicit
//    ordering against blocking (flags 0) streams.  cuStreamDestroy returns at
//    once; queued work still completes.  Handles are ids, not pointers: a
//    destroyed stream/event handle is CUDA_ERROR_INVALID_HANDLE forever.
//  * Contexts.  cuInit first (else CUDA_ERROR_NOT_INITIALIZED); memory,
//    stream, event, copy, prefetch and host calls need a current context
//    whose primary context is retained (else CUDA_ERROR_INVALID_CONTEXT);
//    VMM calls, cuMemAdvise and cuMemRangeGetAttribute do not.  Releasing
//    the last retain destroys the context but, unlike CUDA, frees none of
//    its allocations: they stay in cxlsim_live so tests see the leak.
//  * fork(): the child cannot use the driver (CUDA_ERROR_NOT_INITIALIZED)
//    and exits cleanly; process exit stops the workers (queued work is
//    abandoned) without hanging.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CXLSIM_API __attribute__((visibility("default")))

// Configure the simulated machine.  `spec` is "key=value,key=value" (empty:
// defaults).  May be called before or after cuInit, but only while no
// simulated resource is live (else returns -1, see cxlsim_last_error).
//   devices=N            number of GPUs (default 1)
//   vram=SIZE            VRAM per GPU, e.g. 64MiB, 8GiB (default 1GiB)
//   granularity=SIZE     VMM granularity for device and host (default 2MiB)
//   numa=LIST            simulated host NUMA nodes, ';'-separated, each
//                        "id" (backed by the real node of the same id) or
//                        "id:real" (backed by real node `real`); default: the
//                        real machine's online memory nodes
//   gpu_numa=N           CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID of every GPU (default: first node)
//   reject_numa=LIST     nodes where cuMemCreate(HOST_NUMA)/cuMemHostAlloc fail with
//                        CUDA_ERROR_INVALID_VALUE (emulates nccl#2190)
//   relocate=A:B;...     cuMemHostRegister of pages placed on node A moves them
//                        to node B (emulates ZONE_MOVABLE long-term pins,
//                        docs/sources.md#cpu-less-nodes)
//   attr.N=V             override device attribute N (e.g. attr.141=0)
//   version=N            cuDriverGetVersion result (default 13000); cuGetProcAddress
//                        refuses versions above it (CUDA_ERROR_INVALID_VALUE), and
//                        CU_MEM_LOCATION_TYPE_HOST needs 13000
// Returns 0 on success, -1 on a bad spec (or resources live).  Applying the
// configuration already in effect is a no-op and allowed at any time.
// Reconfiguring keeps cuInit's effect, except that devices=0 makes the next
// cuInit fail with CUDA_ERROR_NO_DEVICE as on a machine without GPUs; it
// resets capture violations and asynchronous faults, not call counters or
// armed faults.  The simulated node of cuMemHostAlloc / HOST allocations /
// HOST_NUMA_CURRENT is the first simulated node backed by the calling CPU's
// real node (default: node 0 on one-node machines).
CXLSIM_API int cxlsim_configure(const char* spec);
// Message of the last failing cxlsim_* call on this thread.
CXLSIM_API const char* cxlsim_last_error(void);

// Fault injection: make the `nth` (1-based) next call of driver function
// `fn` (base name, e.g. "cuMemCreate", or "*" for any) fail with `error`
// without side effects.  Several faults may be armed at once; every matching
// fault counts each call, and a call that completes several fails once.
// Returns -1 (see cxlsim_last_error) for an unknown name, nth == 0 or
// error == CUDA_SUCCESS.  Both cuGetProcAddress forms are "cuGetProcAddress".
CXLSIM_API int cxlsim_fail(const char* fn, uint64_t nth, int error);
CXLSIM_API void cxlsim_clear_faults(void);

// Per-function call counters (base names), since the last reset.
CXLSIM_API uint64_t cxlsim_call_count(const char* fn);
CXLSIM_API void cxlsim_reset_counts(void);
// Comma-separated names of every function called at least once since reset
// (sorted).  Failed and fault-injected calls count.
CXLSIM_API const char* cxlsim_called_functions(void);
// Extension: comma-separated base names of every entry point the simulator
// implements (what cxlsim_fail and cxlsim_call_count accept).
CXLSIM_API const char* cxlsim_function_names(void);

// Live simulated resources, for leak checks.
typedef struct cxlsim_live_st {
  uint64_t phys_handles;      // cuMemCreate handles not yet fully released
  uint64_t device_bytes;      // VRAM in use (cuMemCreate DEVICE + cuMemAlloc + managed resident on device)
  uint64_t host_numa_bytes;   // cuMemCreate HOST_NUMA/HOST bytes not yet released
  uint64_t reservations;      // cuMemAddressReserve ranges
  uint64_t mappings;          // cuMemMap mappings
  uint64_t managed_allocs;    // cuMemAllocManaged allocations
  uint64_t device_allocs;     // cuMemAlloc allocations
  uint64_t host_allocs;       // cuMemHostAlloc allocations
  uint64_t registrations;     // cuMemHostRegister ranges
  uint64_t streams;           // cuStreamCreate streams
  uint64_t events;            // cuEventCreate events
  uint64_t context_refs;      // primary-context retains not released
} cxlsim_live_t;
CXLSIM_API int cxlsim_live(cxlsim_live_t* out);

// Stream simulation.  Every stream runs its queued work (copies, waits,
// event records, sleeps) in order on a worker thread, so events and
// stream-ordered frees behave asynchronously as on a GPU.
// Enqueue a busy interval of `usec` microseconds (stands in for a kernel).
CXLSIM_API int cxlsim_stream_sleep(void* stream, uint64_t usec);
// Enqueue a "kernel" that writes `value` to the uint64 at `ptr` (device or
// host-tier memory) after the work queued before it; lets tests observe
// stream ordering against frees.  `ptr` is checked when the write runs (an
// inaccessible address is an asynchronous fault).  Both return -1 for a
// stream that is not live (NULL = the current device's legacy stream).
CXLSIM_API int cxlsim_stream_write_u64(void* stream, void* ptr, uint64_t value);
// Mark a stream as capturing (CUDA graph capture) until end_capture.  While
// capturing: cuStreamIsCapturing reports ACTIVE; cuStreamSynchronize,
// cuStreamQuery, and cuEventQuery/cuEventSynchronize of events recorded on
// it fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and count a violation.
// Further rules (global capture mode, as cudaStreamBeginCapture's default):
//  * work enqueued on a capturing stream is recorded, never run; once a
//    violation invalidated the capture, enqueueing fails with
//    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED and cuStreamIsCapturing reports
//    INVALIDATED until end_capture;
//  * while any capture is active, cuMemAlloc, cuMemFree, cuMemAllocManaged,
//    cuMemHostAlloc, cuMemFreeHost, cuMemHostRegister, cuMemHostUnregister
//    and cuCtxSynchronize fail (from any thread) with
//    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, count a violation and invalidate
//    every capture.  VMM calls are allowed;
//  * using the legacy stream (enqueue, synchronize, query, cuMemcpy,
//    cuStreamIsCapturing) while a blocking stream of its device captures
//    fails with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (906) and counts a
//    violation (cuda.h: that capture is not invalidated);
//  * cuStreamWaitEvent on an event recorded inside a capture makes the
//    waiting stream join it; end_capture (on the stream that began it) ends
//    it for all, and events recorded inside it read as never recorded.
// Both return -1 (cxlsim_last_error) for the legacy stream, a stream not
// live, a second begin, or an end on a stream that did not begin a capture.
CXLSIM_API int cxlsim_begin_capture(void* stream);
CXLSIM_API int cxlsim_end_capture(void* stream);
CXLSIM_API uint64_t cxlsim_capture_violations(void);

// Extension: stream operations that faulted when they ran (see "The
// simulated GPU" above) since the last configure, and a description of the
// latest one ("" if none).
CXLSIM_API uint64_t cxlsim_async_faults(void);
CXLSIM_API const char* cxlsim_last_async_fault(void);

// NUMA: bind [p, p+len) (host memory mapped in this process) to simulated
// node `node` (mbind on its backing real node); return 0 or -1.  `p` must be
// page aligned and the range must not be memory the simulated driver owns.
// Where the kernel refuses mbind itself (EPERM/ENOSYS under seccomp) the
// node is only recorded.
CXLSIM_API int cxlsim_numa_bind(void* p, size_t len, int node);
// The simulated node recorded for the page holding `p`; -1 if `p` is not
// host-tier memory known to the simulator.  Host-tier memory is: a mapping
// of a HOST_NUMA/HOST cuMemCreate handle (its node), cuMemHostAlloc memory
// (the node it was placed on), managed pages not resident on a device (the
// node of the last host prefetch, else the preferred HOST_NUMA node, else
// -1), and pages bound with cxlsim_numa_bind (moved by relocate= when
// registered).  A cxlsim_numa_bind record whose range was since replaced
// by a new mapping reads -1.
CXLSIM_API int cxlsim_host_node_of(const void* p);

// Size string parser shared with the spec ("64MiB", "1.5GiB", "4096").
// Returns 0 and sets *out on success.
CXLSIM_API int cxlsim_parse_size(const char* s, uint64_t* out);

#ifdef __cplusplus
}
#endif
