// Small, non-throwing readers for sysfs-style trees.
//
// Why a layer of its own: every topology fact comes from a short text file
// that may be absent (older kernel, no CONFIG_CXL_BUS, a container hiding
// /sys), unreadable, or odd (a fake tree in a test).  These helpers never
// throw; they return std::nullopt / empty and let the caller decide whether
// the absence deserves a warning.  All paths are plain strings joined with
// '/', so a fake tree under tmp_path works exactly like /sys.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cxl::topology::sysfs {

// "a" + "b" -> "a/b" (no doubled '/').
std::string join(const std::string& a, const std::string& b);

// Whole file, or nullopt when it cannot be opened or read.  Capped at 1 MiB:
// sysfs attributes are at most a page; anything larger is not sysfs.
std::optional<std::string> read_file(const std::string& path);
// read_file() with surrounding whitespace removed.
std::optional<std::string> read_trimmed(const std::string& path);

bool is_dir(const std::string& path);
bool exists(const std::string& path);
// Names in a directory (not "." or ".."), sorted; empty if not a directory.
std::vector<std::string> list_dir(const std::string& path);
// Canonical absolute path (symlinks resolved), or "" if it does not exist.
std::string real_path(const std::string& path);
// Last path component a symlink points to ("kmem" for .../drivers/kmem), or "".
std::string link_basename(const std::string& path);

std::string trim(const std::string& s);

// File content made safe to quote in a warning: printable ASCII kept, other
// bytes as \xNN (warnings become Python str, which must be valid UTF-8),
// cut to `max_len` characters with "...".
std::string printable(const std::string& s, size_t max_len = 64);

// Kernel list syntax used by cpulist, node lists and memory tier nodelists:
// "0-3,8,10-11", "" (empty set).  Returns the sorted, de-duplicated ids, or
// nullopt with `error` set ("bad range '5-2'") when any token is malformed;
// ranges wider than 1<<20 ids are rejected as garbled.
std::optional<std::vector<int>> parse_list(const std::string& text, std::string* error);
// Inverse of parse_list: {0,1,2,3,8} -> "0-3,8".
std::string format_list(const std::vector<int>& ids);

// Strict integer parsers for a whole (trimmed) string; nullopt on garbage.
std::optional<long long> parse_int(const std::string& s, int base = 10);
std::optional<uint64_t> parse_u64(const std::string& s, int base = 10);

// If `name` is prefix + decimal digits ("node12" with prefix "node"), the number.
std::optional<int> suffix_number(const std::string& name, const std::string& prefix);

}  // namespace cxl::topology::sysfs
