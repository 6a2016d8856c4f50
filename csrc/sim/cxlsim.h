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
//                        to node B (emulates ZONE_MOVABLE long-term pins, §1.7)
//   attr.N=V             override device attribute N (e.g. attr.141=0)
//   version=N            cuDriverGetVersion result (default 13000)
// Returns 0 on success, -1 on a bad spec.
CXLSIM_API int cxlsim_configure(const char* spec);
CXLSIM_API const char* cxlsim_last_error(void);

// Fault injection: make the `nth` (1-based) next call of driver function
// `fn` (base name, e.g. "cuMemCreate", or "*" for any) fail with `error`
// without side effects.  Several faults may be armed at once.
CXLSIM_API int cxlsim_fail(const char* fn, uint64_t nth, int error);
CXLSIM_API void cxlsim_clear_faults(void);

// Per-function call counters (base names), since the last reset.
CXLSIM_API uint64_t cxlsim_call_count(const char* fn);
CXLSIM_API void cxlsim_reset_counts(void);
// Comma-separated names of every function called at least once since reset.
CXLSIM_API const char* cxlsim_called_functions(void);

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
// stream ordering against frees.
CXLSIM_API int cxlsim_stream_write_u64(void* stream, void* ptr, uint64_t value);
// Mark a stream as capturing (CUDA graph capture) until end_capture.  While
// capturing: cuStreamIsCapturing reports ACTIVE; cuStreamSynchronize,
// cuStreamQuery, and cuEventQuery/cuEventSynchronize of events recorded on
// it fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and count a violation.
CXLSIM_API int cxlsim_begin_capture(void* stream);
CXLSIM_API int cxlsim_end_capture(void* stream);
CXLSIM_API uint64_t cxlsim_capture_violations(void);

// NUMA: bind [p, p+len) (host memory mapped in this process) to simulated
// node `node` (mbind on its backing real node); return 0 or -1.
CXLSIM_API int cxlsim_numa_bind(void* p, size_t len, int node);
// The simulated node recorded for the page holding `p`; -1 if `p` is not
// host-tier memory known to the simulator.
CXLSIM_API int cxlsim_host_node_of(const void* p);

// Size string parser shared with the spec ("64MiB", "1.5GiB", "4096").
// Returns 0 and sets *out on success.
CXLSIM_API int cxlsim_parse_size(const char* s, uint64_t* out);

#ifdef __cplusplus
}
#endif
