#include "driver/driver.h"

#include <dlfcn.h>

#include <cstdio>

#include "common/error.h"

namespace cxl::driver {

namespace {

// cuGetProcAddress_v2 (CUDA 12.0+) reports *why* a symbol is missing; the
// 11.3 form lacks the last argument.  Both take the base name and a version.
using GetProcV2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using GetProcV1 = CUresult (*)(const char*, void**, int, cuuint64_t);

[[noreturn]] void unavailable(const std::string& why) {
  throw Error(ErrorKind::Unavailable, "CUDA unavailable: " + why);
}

}  // namespace

std::shared_ptr<Driver> Driver::open(const std::string& path, bool simulated) {
  // RTLD_LOCAL: the simulator exports cu* symbols too; they must never
  // interpose on a real libcuda that torch may load into the same process.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    unavailable("cannot load the CUDA driver library '" + path + "': " + (e ? e : "unknown error") +
                " (no NVIDIA driver installed? use simulate=True, or --simulate on the command line, to run on the "
                "simulated driver)");
  }
  std::shared_ptr<Driver> d(new Driver());
  d->handle_ = h;
  d->simulated_ = simulated;
  d->path_ = path;

  auto v2 = reinterpret_cast<GetProcV2>(dlsym(h, "cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcV1>(dlsym(h, "cuGetProcAddress"));
  if (!v2 && !v1) unavailable("'" + path + "' exports no cuGetProcAddress (driver older than CUDA 11.3?)");

  auto resolve = [&](const char* name, int version, bool required, void** slot) {
    CUresult r;
    CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SUCCESS;
    if (v2)
      r = v2(name, slot, version, CU_GET_PROC_ADDRESS_DEFAULT, &q);
    else
      r = v1(name, slot, version, CU_GET_PROC_ADDRESS_DEFAULT);
    if (r != CUDA_SUCCESS || q != CU_GET_PROC_ADDRESS_SUCCESS || *slot == nullptr) {
      *slot = nullptr;
      if (required)
        unavailable(std::string("driver '") + path + "' lacks " + name + " (ABI version " +
                    std::to_string(version) + ")" +
                    (q == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT ? ": driver too old" : ""));
    }
  };
#define CXL_RESOLVE(name, ver, req, ret, params) \
  resolve(#name, ver, req != 0, reinterpret_cast<void**>(&d->api_.fn_##name));
  CXL_DRIVER_FUNCTIONS(CXL_RESOLVE)
#undef CXL_RESOLVE

  CUresult r = d->api_.fn_cuInit(0);
  if (r != CUDA_SUCCESS) unavailable("cuInit failed: " + d->describe(r));
  if (d->api_.fn_cuDriverGetVersion(&d->version_) != CUDA_SUCCESS) d->version_ = 0;
  r = d->api_.fn_cuDeviceGetCount(&d->device_count_);
  if (r != CUDA_SUCCESS) unavailable("cuDeviceGetCount failed: " + d->describe(r));
  if (d->device_count_ <= 0) unavailable("the driver reports no CUDA device");
  return d;
}

std::string Driver::describe(CUresult r) const {
  const char* name = nullptr;
  const char* str = nullptr;
  if (api_.fn_cuGetErrorName) api_.fn_cuGetErrorName(r, &name);
  if (api_.fn_cuGetErrorString) api_.fn_cuGetErrorString(r, &str);
  std::string out = name ? name : ("CUresult " + std::to_string(static_cast<int>(r)));
  if (str) out += std::string(" (") + str + ")";
  return out;
}

void Driver::check(CUresult r, const char* call) const {
  if (r == CUDA_SUCCESS) return;
  throw DriverError(call, static_cast<int>(r), std::string(call) + " failed: " + describe(r));
}

void Driver::missing(const char* name) const {
  throw Error(ErrorKind::Unsupported, std::string("the CUDA driver '") + path_ + "' (version " +
                                          std::to_string(version_) + ") does not provide " + name);
}

void* Driver::symbol(const char* name) const { return handle_ ? dlsym(handle_, name) : nullptr; }

}  // namespace cxl::driver
