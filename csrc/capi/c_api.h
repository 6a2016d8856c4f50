/* The C ABI of cxlalloc's process-wide engine.
 *
 * Two callers:
 *  - torch's CUDAPluggableAllocator / MemPool, which loads cxlalloc_malloc and
 *    cxlalloc_free (and the per-class variants) by name from cxlalloc/_C*.so
 *    with the signatures torch documents (docs/sources.md#torch-pluggable-allocator);
 *  - cxlalloc's torch adapter (csrc/torch), which needs stats, snapshots,
 *    pools and error text to give torch.cuda's memory APIs their meaning.
 *
 * No C++ exception crosses this boundary: every entry point catches, returns
 * NULL / a negative code, and leaves the message for cxlalloc_last_error()
 * (thread-local).  Only plain C types cross it, so the adapter may be built
 * with a different C++ ABI (torch's _GLIBCXX_USE_CXX11_ABI) than _C.
 */
#ifndef CXLALLOC_C_API_H_
#define CXLALLOC_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CXLALLOC_API __attribute__((visibility("default")))
/* 2: + cxlalloc_set_device_limit, cxlalloc_pool_use_count (torch adapter). */
#define CXLALLOC_C_API_VERSION 2

/* Error kinds returned by cxlalloc_last_error_kind(). */
enum {
  CXLALLOC_OK = 0,
  CXLALLOC_E_INVALID_ARGUMENT = 1,
  CXLALLOC_E_OUT_OF_MEMORY = 2,
  CXLALLOC_E_INVALID_FREE = 3,
  CXLALLOC_E_UNAVAILABLE = 4,
  CXLALLOC_E_DRIVER = 5,
  CXLALLOC_E_UNSUPPORTED = 6,
  CXLALLOC_E_CAPTURE = 7,
  CXLALLOC_E_INTERNAL = 8,
  CXLALLOC_E_NOT_ENABLED = 9
};

CXLALLOC_API int cxlalloc_api_version(void);
CXLALLOC_API const char* cxlalloc_last_error(void);
CXLALLOC_API int cxlalloc_last_error_kind(void);
CXLALLOC_API int cxlalloc_is_enabled(void);

/* torch pluggable-allocator signatures.  The class comes from the thread's
 * scope (cxlalloc.kv() / weights()) for cxlalloc_malloc; the kv/weight
 * variants fix it (for MemPools).  malloc returns NULL on failure. */
CXLALLOC_API void* cxlalloc_malloc(size_t size, int device, void* stream);
CXLALLOC_API void cxlalloc_free(void* ptr, size_t size, int device, void* stream);
CXLALLOC_API void* cxlalloc_kv_malloc(size_t size, int device, void* stream);
CXLALLOC_API void cxlalloc_kv_free(void* ptr, size_t size, int device, void* stream);
CXLALLOC_API void* cxlalloc_weight_malloc(size_t size, int device, void* stream);
CXLALLOC_API void cxlalloc_weight_free(void* ptr, size_t size, int device, void* stream);
/* Host tier only (class other): backs scoped mode's use_on_oom spill pool. */
CXLALLOC_API void* cxlalloc_host_malloc(size_t size, int device, void* stream);
CXLALLOC_API void cxlalloc_host_free(void* ptr, size_t size, int device, void* stream);

/* Hooks. */
CXLALLOC_API int cxlalloc_record_stream(void* ptr, void* stream);
CXLALLOC_API int cxlalloc_empty_cache(void);
CXLALLOC_API int cxlalloc_device_empty_cache(int device);
/* GPU `peer` may read and write GPU `device`'s cxlalloc memory from now on
 * (torch's enablePeerAccess(peer, device)): 0, or -CXLALLOC_E_* with the
 * error (INVALID_ARGUMENT: a device or peer that is not a visible GPU;
 * DRIVER: a cuMemSetAccess failed, and the peer is not recorded, so a later
 * call grants again).  Granting it again is a no-op. */
CXLALLOC_API int cxlalloc_enable_peer_access(int device, int peer);
CXLALLOC_API size_t cxlalloc_allocation_size(void* ptr, int device);
CXLALLOC_API int cxlalloc_push_class(int cls); /* 0 other, 1 kv, 2 weight */
CXLALLOC_API int cxlalloc_pop_class(void);
CXLALLOC_API int cxlalloc_tier_of(const void* ptr, int device); /* 0 device, 1 host, <0 error */

/* Private pools (CUDA graphs, torch.cuda.MemPool in global mode). The filter
 * decides per stream; ctx_free (may be NULL) is called when the route ends. */
typedef int (*cxlalloc_stream_filter_fn)(void* ctx, void* stream);
CXLALLOC_API int cxlalloc_create_pool(int device, uint64_t id_a, uint64_t id_b);
CXLALLOC_API int cxlalloc_begin_allocate_to_pool(int device, uint64_t id_a, uint64_t id_b,
                                                 cxlalloc_stream_filter_fn filter, void* ctx,
                                                 void (*ctx_free)(void*));
CXLALLOC_API int cxlalloc_end_allocate_to_pool(int device, uint64_t id_a, uint64_t id_b);
CXLALLOC_API int cxlalloc_release_pool(int device, uint64_t id_a, uint64_t id_b);
/* References held on a pool (create/begin add one, release drops one);
 * 0 if the pool does not exist (as torch's getPoolUseCount), < 0 on error. */
CXLALLOC_API int cxlalloc_pool_use_count(int device, uint64_t id_a, uint64_t id_b);

/* Statistics of the device tier in torch's DeviceStats vocabulary. */
typedef struct cxlalloc_stat_st {
  int64_t current, peak, allocated, freed;
} cxlalloc_stat_t;
typedef struct cxlalloc_torch_stats_st {
  cxlalloc_stat_t allocation[3], segment[3], active[3], inactive_split[3];
  cxlalloc_stat_t allocated_bytes[3], reserved_bytes[3], active_bytes[3], inactive_split_bytes[3],
      requested_bytes[3];
  int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free;
} cxlalloc_torch_stats_t;
CXLALLOC_API int cxlalloc_torch_stats(int device, cxlalloc_torch_stats_t* out);
CXLALLOC_API int cxlalloc_reset_peak_stats(int device);
CXLALLOC_API int cxlalloc_reset_accumulated_stats(int device);
CXLALLOC_API size_t cxlalloc_device_limit(int device);
/* A new VRAM cap for `device` (torch.cuda.set_per_process_memory_fraction in
 * global mode): later requests beyond it spill; held memory stays. */
CXLALLOC_API int cxlalloc_set_device_limit(int device, size_t bytes);
/* One line describing both tiers' use (for OOM messages); thread-local buffer. */
CXLALLOC_API const char* cxlalloc_describe_tiers(int device);

/* Snapshot: one callback per segment with its blocks. */
typedef struct cxlalloc_block_info_st {
  uint64_t ptr;
  size_t size, requested;
  int allocated, pending;
} cxlalloc_block_info_t;
typedef struct cxlalloc_segment_info_st {
  uint64_t base;
  size_t size, allocated;
  int tier; /* 0 device, 1 host, 2 mixed */
  int is_small;
  int is_extent;
  uint64_t stream;
  uint64_t pool_a, pool_b;
} cxlalloc_segment_info_t;
typedef void (*cxlalloc_segment_fn)(void* ctx, const cxlalloc_segment_info_t* seg,
                                    const cxlalloc_block_info_t* blocks, size_t nblocks);
CXLALLOC_API int cxlalloc_snapshot(int device, cxlalloc_segment_fn fn, void* ctx);

#ifdef __cplusplus
}
#endif

#endif /* CXLALLOC_C_API_H_ */
