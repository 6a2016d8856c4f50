// cxlsim_configure's spec parser and the configuration snapshot.
#include "sim/config.h"

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "sim/api.h"
#include "sim/numa.h"

namespace cxlsim {

namespace {

const char* const kAllowedKeys =
    "devices, vram, granularity, numa, gpu_numa, reject_numa, relocate, attr.N, version";

std::mutex g_config_mu;  // guards the pointer swap only
std::shared_ptr<const Config> g_config;

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    out.push_back(trim(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start)));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

bool parse_int(const std::string& s, long long lo, long long hi, long long* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

std::string list_nodes(const std::vector<int>& v) {
  std::string s;
  for (int n : v) s += (s.empty() ? "" : ";") + std::to_string(n);
  return s.empty() ? "none" : s;
}

std::shared_ptr<const Config> default_config() {
  auto c = std::make_shared<Config>();
  for (int real : real_memory_nodes()) c->nodes.push_back(SimNode{real, real});
  c->gpu_numa = c->nodes.front().id;
  return c;
}

}  // namespace

const SimNode* Config::node(int id) const {
  for (const auto& n : nodes)
    if (n.id == id) return &n;
  return nullptr;
}

bool Config::operator==(const Config& o) const {
  return devices == o.devices && vram == o.vram && granularity == o.granularity && nodes == o.nodes &&
         gpu_numa == o.gpu_numa && reject_numa == o.reject_numa && relocate == o.relocate && attrs == o.attrs &&
         version == o.version;
}

std::shared_ptr<const Config> config() {
  std::lock_guard<std::mutex> lk(g_config_mu);
  if (!g_config) g_config = default_config();
  return g_config;
}

void set_config(std::shared_ptr<const Config> c) {
  std::lock_guard<std::mutex> lk(g_config_mu);
  g_config = std::move(c);
}

bool parse_size(const std::string& text, uint64_t* out) {
  std::string s = trim(text);
  if (s.empty()) return false;
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  std::string num = s.substr(0, i), unit = trim(s.substr(i));
  if (num.empty() || num == "." || num.find('.') != num.rfind('.')) return false;
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  uint64_t mul;
  if (unit.empty() || unit == "b") mul = 1;
  else if (unit == "k" || unit == "kib") mul = 1ull << 10;
  else if (unit == "m" || unit == "mib") mul = 1ull << 20;
  else if (unit == "g" || unit == "gib") mul = 1ull << 30;
  else if (unit == "t" || unit == "tib") mul = 1ull << 40;
  else return false;
  size_t dot = num.find('.');
  if (dot == std::string::npos) {
    errno = 0;
    char* end = nullptr;
    unsigned long long v = std::strtoull(num.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') return false;
    if (v != 0 && mul > UINT64_MAX / v) return false;
    *out = v * mul;
    return true;
  }
  // Fractions: exact only when the result is a whole number of bytes.
  std::string whole = num.substr(0, dot), frac = num.substr(dot + 1);
  if (frac.size() > 12) return false;
  unsigned long long w = whole.empty() ? 0 : std::strtoull(whole.c_str(), nullptr, 10);
  unsigned long long f = frac.empty() ? 0 : std::strtoull(frac.c_str(), nullptr, 10);
  unsigned long long scale = 1;
  for (size_t k = 0; k < frac.size(); ++k) scale *= 10;
  if (w != 0 && mul > UINT64_MAX / w) return false;
  unsigned __int128 fbytes = static_cast<unsigned __int128>(f) * mul;
  if (fbytes % scale != 0) return false;
  unsigned __int128 total = static_cast<unsigned __int128>(w) * mul + fbytes / scale;
  if (total > UINT64_MAX) return false;
  *out = static_cast<uint64_t>(total);
  return true;
}

bool parse_config(const char* spec, Config* out, std::string* err) {
  Config c;
  std::vector<int> real = real_memory_nodes();
  for (int r : real) c.nodes.push_back(SimNode{r, r});
  bool have_gpu_numa = false;
  int gpu_numa = 0;
  std::vector<int> reject;
  std::vector<std::pair<int, int>> relocate;
  std::set<std::string> seen;

  auto fail = [&](const std::string& msg) {
    *err = "cxlsim_configure: " + msg;
    return false;
  };
  auto bad_value = [&](const std::string& key, const std::string& value, const std::string& expected) {
    return fail("bad value '" + value + "' for key '" + key + "': expected " + expected);
  };
  auto parse_node_list = [&](const std::string& key, const std::string& value, std::vector<int>* nodes) {
    for (const auto& item : split(value, ';')) {
      long long id;
      if (!parse_int(item, 0, kMaxNumaNode, &id))
        return bad_value(key, value, "a ';'-separated list of simulated node ids, e.g. 1;2");
      nodes->push_back(static_cast<int>(id));
    }
    return true;
  };

  std::string text = spec ? spec : "";
  for (const auto& item : split(text, ',')) {
    if (item.empty()) continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos)
      return fail("item '" + item + "' is not key=value (allowed keys: " + kAllowedKeys + ")");
    std::string key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
    if (!seen.insert(key).second) return fail("key '" + key + "' given twice");
    long long v;
    if (key == "devices") {
      if (!parse_int(value, 0, kMaxDevices, &v))
        return bad_value(key, value, "an integer from 0 to " + std::to_string(kMaxDevices));
      c.devices = static_cast<int>(v);
    } else if (key == "vram") {
      if (!parse_size(value, &c.vram)) return bad_value(key, value, "a size such as 64MiB, 8GiB, 1.5GiB, 4096");
    } else if (key == "granularity") {
      uint64_t g;
      if (!parse_size(value, &g) || g < 4096 || g > (1ull << 30) || (g & (g - 1)) != 0)
        return bad_value(key, value, "a power-of-two size from 4KiB to 1GiB, e.g. 2MiB");
      c.granularity = g;
    } else if (key == "numa") {
      c.nodes.clear();
      for (const auto& n : split(value, ';')) {
        // "id" is backed by the real node of the same id, "id:real" by `real`.
        size_t colon = n.find(':');
        std::string id_text = colon == std::string::npos ? n : trim(n.substr(0, colon));
        std::string real_text = colon == std::string::npos ? n : trim(n.substr(colon + 1));
        long long id, backing;
        if (!parse_int(id_text, 0, kMaxNumaNode, &id) || !parse_int(real_text, 0, kMaxNumaNode, &backing))
          return bad_value(key, value, "';'-separated nodes, each 'id' or 'id:real', e.g. 0;1:0;2:0");
        if (c.node(static_cast<int>(id))) return fail("numa: node " + std::to_string(id) + " listed twice");
        bool online = false;
        for (int r : real) online |= (r == backing);
        if (!online)
          return fail("numa: real node " + std::to_string(backing) + " backing simulated node " +
                      std::to_string(id) + " is not an online memory node of this machine (online: " +
                      list_nodes(real) + "); use 'id:real' to back it with an existing node");
        c.nodes.push_back(SimNode{static_cast<int>(id), static_cast<int>(backing)});
      }
    } else if (key == "gpu_numa") {
      if (!parse_int(value, 0, kMaxNumaNode, &v)) return bad_value(key, value, "a simulated node id");
      have_gpu_numa = true;
      gpu_numa = static_cast<int>(v);
    } else if (key == "reject_numa") {
      if (!parse_node_list(key, value, &reject)) return false;
    } else if (key == "relocate") {
      for (const auto& pair : split(value, ';')) {
        size_t colon = pair.find(':');
        long long a, b;
        if (colon == std::string::npos || !parse_int(trim(pair.substr(0, colon)), 0, kMaxNumaNode, &a) ||
            !parse_int(trim(pair.substr(colon + 1)), 0, kMaxNumaNode, &b))
          return bad_value(key, value, "';'-separated A:B node pairs, e.g. 1:0;2:0");
        relocate.emplace_back(static_cast<int>(a), static_cast<int>(b));
      }
    } else if (key == "version") {
      if (!parse_int(value, 1000, 1000000, &v)) return bad_value(key, value, "a CUDA version such as 13000 or 12020");
      c.version = static_cast<int>(v);
    } else if (key.rfind("attr.", 0) == 0) {
      long long n;
      if (!parse_int(key.substr(5), 1, kMaxDeviceAttribute, &n))
        return fail("bad key '" + key + "': expected attr.N with N a CUdevice_attribute from 1 to " +
                    std::to_string(kMaxDeviceAttribute));
      if (!parse_int(value, INT32_MIN, INT32_MAX, &v)) return bad_value(key, value, "a 32-bit integer");
      c.attrs[static_cast<int>(n)] = static_cast<int>(v);
    } else {
      return fail("unknown key '" + key + "' (allowed keys: " + kAllowedKeys + ")");
    }
  }

  std::vector<int> ids;
  for (const auto& n : c.nodes) ids.push_back(n.id);
  if (c.nodes.empty()) return fail("numa: at least one node is required");
  c.gpu_numa = have_gpu_numa ? gpu_numa : c.nodes.front().id;
  if (!c.node(c.gpu_numa))
    return fail("gpu_numa=" + std::to_string(c.gpu_numa) + " is not a simulated node (nodes: " + list_nodes(ids) +
                ")");
  for (int r : reject) {
    if (!c.node(r))
      return fail("reject_numa: node " + std::to_string(r) + " is not a simulated node (nodes: " + list_nodes(ids) +
                  ")");
    c.reject_numa.insert(r);
  }
  for (const auto& [a, b] : relocate) {
    if (!c.node(a) || !c.node(b))
      return fail("relocate: " + std::to_string(a) + ":" + std::to_string(b) +
                  " names a node that is not simulated (nodes: " + list_nodes(ids) + ")");
    if (a == b) return fail("relocate: " + std::to_string(a) + ":" + std::to_string(b) + " moves a node onto itself");
    if (!c.relocate.emplace(a, b).second) return fail("relocate: node " + std::to_string(a) + " listed twice");
  }
  *out = std::move(c);
  return true;
}

}  // namespace cxlsim

extern "C" CXLSIM_API int cxlsim_parse_size(const char* s, uint64_t* out) {
  if (s == nullptr || out == nullptr) return -1;
  try {
    uint64_t v;
    if (!cxlsim::parse_size(s, &v)) return -1;
    *out = v;
    return 0;
  } catch (...) {
    return -1;
  }
}
