#include "topology/sysfs.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace cxl::topology::sysfs {

namespace {
constexpr size_t kMaxFileBytes = size_t(1) << 20;
constexpr long long kMaxRangeIds = 1 << 20;

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
struct DirCloser {
  void operator()(DIR* d) const { closedir(d); }
};
}  // namespace

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  bool a_slash = a.back() == '/', b_slash = b.front() == '/';
  if (a_slash && b_slash) return a + b.substr(1);
  if (a_slash || b_slash) return a + b;
  return a + "/" + b;
}

std::optional<std::string> read_file(const std::string& path) {
  std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "re"));
  if (!f) return std::nullopt;
  std::string out;
  char buf[4096];
  for (;;) {
    size_t n = std::fread(buf, 1, sizeof buf, f.get());
    out.append(buf, n);
    if (n < sizeof buf) break;
    if (out.size() > kMaxFileBytes) return std::nullopt;
  }
  // A sysfs attribute whose show() fails reports the error on read (e.g.
  // EIO); that is "unreadable", not "empty".
  if (std::ferror(f.get())) return std::nullopt;
  return out;
}

std::optional<std::string> read_trimmed(const std::string& path) {
  auto s = read_file(path);
  if (!s) return std::nullopt;
  return trim(*s);
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  std::unique_ptr<DIR, DirCloser> d(opendir(path.c_str()));
  if (!d) return out;
  while (struct dirent* e = readdir(d.get())) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(std::move(n));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return "";
  return buf;
}

std::string link_basename(const std::string& path) {
  char buf[PATH_MAX];
  ssize_t n = ::readlink(path.c_str(), buf, sizeof buf - 1);
  if (n <= 0) return "";
  std::string target(buf, static_cast<size_t>(n));
  while (!target.empty() && target.back() == '/') target.pop_back();
  auto slash = target.rfind('/');
  return slash == std::string::npos ? target : target.substr(slash + 1);
}

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n\v\f";
  auto b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  auto e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

std::string printable(const std::string& s, size_t max_len) {
  std::string out;
  for (unsigned char c : s) {
    if (out.size() >= max_len) {
      out += "...";
      break;
    }
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

std::optional<long long> parse_int(const std::string& s_in, int base) {
  std::string s = trim(s_in);
  if (s.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, base);
  if (errno != 0 || end == s.c_str() || *end != '\0') return std::nullopt;
  return v;
}

std::optional<uint64_t> parse_u64(const std::string& s_in, int base) {
  std::string s = trim(s_in);
  if (s.empty() || s[0] == '-' || s[0] == '+') return std::nullopt;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, base);
  if (errno != 0 || end == s.c_str() || *end != '\0') return std::nullopt;
  return static_cast<uint64_t>(v);
}

std::optional<int> suffix_number(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0)
    return std::nullopt;
  std::string digits = name.substr(prefix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  if (digits.size() > 9) return std::nullopt;
  return std::atoi(digits.c_str());
}

std::optional<std::vector<int>> parse_list(const std::string& text, std::string* error) {
  std::vector<int> out;
  std::string s = trim(text);
  if (s.empty()) return out;
  auto fail = [&](const std::string& why) -> std::optional<std::vector<int>> {
    if (error) *error = why;
    return std::nullopt;
  };
  const std::string shown = printable(s);
  auto number = [](const std::string& t) -> std::optional<long long> {
    if (t.empty() ||
        !std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return std::nullopt;
    if (t.size() > 9) return std::nullopt;
    return std::atoll(t.c_str());
  };
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string tok = trim(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (tok.empty()) return fail("empty item in list '" + shown + "'");
    size_t dash = tok.find('-');
    if (dash == std::string::npos) {
      auto v = number(tok);
      if (!v) return fail("bad item '" + printable(tok) + "' in list '" + shown + "'");
      out.push_back(static_cast<int>(*v));
    } else {
      auto lo = number(trim(tok.substr(0, dash)));
      auto hi = number(trim(tok.substr(dash + 1)));
      if (!lo || !hi || *hi < *lo) return fail("bad range '" + printable(tok) + "' in list '" + shown + "'");
      if (*hi - *lo >= kMaxRangeIds) return fail("range '" + printable(tok) + "' is implausibly wide");
      for (long long i = *lo; i <= *hi; ++i) out.push_back(static_cast<int>(i));
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string format_list(const std::vector<int>& ids_in) {
  std::vector<int> ids = ids_in;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ids[i]);
    if (j > i) out += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace cxl::topology::sysfs
