/* A stand-in CUDA driver for tests/topology/test_topology.py: just enough of the
 * driver API for Driver::open() and query_gpu(), plus the simulator's NUMA
 * exports (cxlsim_numa_bind, cxlsim_host_node_of) unless built with
 * -DNO_CXLSIM.  Not the project's simulator (csrc/sim); it lets the topology
 * tests run without it.
 *
 * Device: 2 GPUs "Fake H200", 141 GiB, CC 9.0, PCI 0000:17:00.0 / 0000:c1:00.0,
 * HOST_NUMA_ID -1 (as on a driver that cannot tell), and the attributes of an
 * older driver: 141/142/144/145 are rejected with CUDA_ERROR_INVALID_VALUE. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
typedef int CUresult;

static int init_done;

static CUresult cuInit(unsigned flags) { (void)flags; init_done = 1; return 0; }
static CUresult cuDriverGetVersion(int* v) { *v = 12040; return 0; }
static CUresult cuDeviceGetCount(int* n) { *n = 2; return 0; }
static CUresult cuDeviceGet(int* d, int ordinal) {
  if (ordinal < 0 || ordinal > 1) return 101; /* CUDA_ERROR_INVALID_DEVICE */
  *d = ordinal;
  return 0;
}
static CUresult cuDeviceGetName(char* name, int len, int dev) {
  (void)dev;
  strncpy(name, "Fake H200", (size_t)len);
  return 0;
}
static CUresult cuDeviceTotalMem(size_t* bytes, int dev) { (void)dev; *bytes = (size_t)141 << 30; return 0; }
static CUresult cuDeviceGetAttribute(int* v, int attr, int dev) {
  switch (attr) {
    case 16: *v = 132; return 0;
    case 19: case 41: case 83: case 89: case 91: case 99: case 102: case 115: case 116: *v = 1; return 0;
    case 88: case 100: case 101: *v = 0; return 0;
    case 33: *v = dev == 0 ? 0x17 : 0xc1; return 0;
    case 34: case 50: *v = 0; return 0;
    case 36: *v = 3201000; return 0;
    case 37: *v = 6144; return 0;
    case 75: *v = 9; return 0;
    case 76: *v = 0; return 0;
    case 130: *v = 0; return 0;
    case 131: *v = -1; return 0;
    case 134: *v = -1; return 0;
    default: return 1; /* CUDA_ERROR_INVALID_VALUE: unknown to this "driver" */
  }
}
static CUresult cuGetErrorName(CUresult e, const char** s) {
  *s = e == 1 ? "CUDA_ERROR_INVALID_VALUE" : e == 101 ? "CUDA_ERROR_INVALID_DEVICE" : "CUDA_ERROR_UNKNOWN";
  return 0;
}
static CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == 1 ? "invalid argument" : e == 101 ? "invalid device ordinal" : "unknown error";
  return 0;
}
/* Every other entry point: present (Driver::open requires them) but unusable. */
static CUresult not_implemented(void) { return 999; }

EXPORT CUresult cuGetProcAddress_v2(const char* sym, void** pfn, int ver, uint64_t flags, int* status) {
  (void)ver; (void)flags;
  static const struct { const char* name; void* fn; } table[] = {
    {"cuInit", (void*)cuInit}, {"cuDriverGetVersion", (void*)cuDriverGetVersion},
    {"cuDeviceGetCount", (void*)cuDeviceGetCount}, {"cuDeviceGet", (void*)cuDeviceGet},
    {"cuDeviceGetName", (void*)cuDeviceGetName}, {"cuDeviceTotalMem", (void*)cuDeviceTotalMem},
    {"cuDeviceGetAttribute", (void*)cuDeviceGetAttribute}, {"cuGetErrorName", (void*)cuGetErrorName},
    {"cuGetErrorString", (void*)cuGetErrorString},
  };
  *pfn = (void*)not_implemented;
  for (size_t i = 0; i < sizeof table / sizeof table[0]; ++i)
    if (strcmp(sym, table[i].name) == 0) *pfn = table[i].fn;
  if (status) *status = 0;
  return 0;
}

#ifndef NO_CXLSIM
/* Simulated host nodes 0 and 1; bindings recorded per range. */
static struct { uintptr_t lo, hi; int node; } ranges[64];
static int nranges;

EXPORT const char* cxlsim_last_error(void) { return "fake: no such simulated node"; }
EXPORT int cxlsim_numa_bind(void* p, size_t len, int node) {
  if (node < 0 || node > 1 || nranges == 64) { errno = EINVAL; return -1; }
  ranges[nranges].lo = (uintptr_t)p;
  ranges[nranges].hi = (uintptr_t)p + len;
  ranges[nranges].node = node;
  ++nranges;
  return 0;
}
EXPORT int cxlsim_host_node_of(const void* p) {
  for (int i = nranges - 1; i >= 0; --i)
    if ((uintptr_t)p >= ranges[i].lo && (uintptr_t)p < ranges[i].hi) return ranges[i].node;
  return -1;
}
#endif
