// The simulated machine's configuration (cxlsim_configure's spec) and its
// parser.
//
// The live configuration is an immutable snapshot behind a shared_ptr:
// readers take a copy of the pointer (config()) and never see a half-applied
// spec; cxlsim_configure swaps in a new one only while nothing is live.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace cxlsim {

constexpr int kMaxDevices = 64;
constexpr int kMaxNumaNode = 1023;       // highest simulated or real node id accepted
constexpr int kMaxDeviceAttribute = 147;  // CU_DEVICE_ATTRIBUTE_MAX - 1 in CUDA 13.0

// A simulated host NUMA node and the real node whose pages back it.
struct SimNode {
  int id;
  int real;
  bool operator==(const SimNode& o) const { return id == o.id && real == o.real; }
};

struct Config {
  int devices = 1;
  uint64_t vram = 1ull << 30;         // bytes per GPU
  uint64_t granularity = 2ull << 20;  // VMM granularity, bytes (device and host)
  std::vector<SimNode> nodes;         // in spec order
  int gpu_numa = 0;                   // CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID of every GPU
  std::set<int> reject_numa;
  std::map<int, int> relocate;        // node A -> node B on cuMemHostRegister
  std::map<int, int> attrs;           // device attribute overrides
  int version = 13000;                // cuDriverGetVersion

  // The simulated node `id`, or nullptr.
  const SimNode* node(int id) const;
  bool operator==(const Config& o) const;
};

// The current configuration (never null; defaults before any configure).
std::shared_ptr<const Config> config();
void set_config(std::shared_ptr<const Config> c);

// Parse `spec` ("key=value,..."; see cxlsim.h) into *out, starting from the
// defaults.  On failure returns false and sets *err to a message naming the
// bad key or value and what is allowed.
bool parse_config(const char* spec, Config* out, std::string* err);

// "64MiB", "1.5GiB", "4096", "2M": binary units B/K/KiB/M/MiB/G/GiB/T/TiB
// (case-insensitive).  False on junk, a fractional byte count, or overflow.
bool parse_size(const std::string& s, uint64_t* out);

}  // namespace cxlsim
