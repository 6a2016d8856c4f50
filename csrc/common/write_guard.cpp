// See write_guard.h.  The signal handler reads only lock-free atomics and
// calls mprotect (a system call; used from SIGSEGV handlers by write-barrier
// garbage collectors the same way).
#include "common/write_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>
#include <mutex>
#include <string>

#include "common/error.h"

namespace cxl::guard {

namespace {

constexpr int kSlots = 1 << 16;

struct Slot {
  std::atomic<std::uintptr_t> lo{0};
  std::atomic<std::uintptr_t> hi{0};
  std::atomic<int> state{0};  // 0 free, 1 guarded, 2 written
};

Slot g_slots[kSlots];
std::atomic<int> g_high{0};  // slots [0, g_high) may be in use
std::atomic<std::uint64_t> g_faults{0};
std::mutex g_mu;  // protect/release (never taken in the handler)
struct sigaction g_prev;
std::atomic<bool> g_installed{false};

bool is_write_fault(void* ctx) {
#if defined(__x86_64__)
  auto* uc = static_cast<ucontext_t*>(ctx);
  return (uc->uc_mcontext.gregs[REG_ERR] & 0x2) != 0;  // page-fault error code bit 1: a write
#else
  (void)ctx;
  return true;
#endif
}

void on_segv(int sig, siginfo_t* si, void* ctx) {
  if (si != nullptr && si->si_code == SEGV_ACCERR && is_write_fault(ctx)) {
    auto a = reinterpret_cast<std::uintptr_t>(si->si_addr);
    int n = g_high.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      Slot& s = g_slots[i];
      if (s.state.load(std::memory_order_acquire) == 0) continue;
      std::uintptr_t lo = s.lo.load(std::memory_order_acquire), hi = s.hi.load(std::memory_order_acquire);
      if (a < lo || a >= hi) continue;
      int saved = errno;
      // Mark first (a reader that sees the pages writable sees "written" too), and every range that
      // shares a page with this one: making this range writable makes those pages writable for them.
      for (int j = 0; j < n; ++j) {
        Slot& o = g_slots[j];
        if (o.state.load(std::memory_order_acquire) == 0) continue;
        if (o.lo.load(std::memory_order_acquire) < hi && o.hi.load(std::memory_order_acquire) > lo)
          o.state.store(2, std::memory_order_release);
      }
      ::mprotect(reinterpret_cast<void*>(lo), hi - lo, PROT_READ | PROT_WRITE);
      g_faults.fetch_add(1, std::memory_order_relaxed);
      errno = saved;
      return;  // the write is retried and goes through
    }
  }
  // A SIGSEGV this process raised itself while ranges are guarded: a handler installed after ours (Python's
  // faulthandler) that restored ours and re-raised the fault's signal.  Returning re-executes the faulting
  // instruction, which then reaches this handler with its address (handled above, or chained below).
  if (si != nullptr && si->si_code <= 0 && si->si_pid == ::getpid() && g_high.load(std::memory_order_acquire) > 0)
    return;
  // Not ours: hand the signal to the handler that was there before.
  if (g_prev.sa_flags & SA_SIGINFO) {
    if (g_prev.sa_sigaction != nullptr) {
      g_prev.sa_sigaction(sig, si, ctx);
      return;
    }
  } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN) {
    g_prev.sa_handler(sig);
    return;
  }
  // The default action: restore it; a fault re-executes and ends the process as it would have.
  ::signal(sig, SIG_DFL);
  if (si == nullptr || si->si_code <= 0) ::raise(sig);
}

bool ours_now() {
  struct sigaction cur;
  if (::sigaction(SIGSEGV, nullptr, &cur) != 0) return false;
  return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == &on_segv;
}

}  // namespace

std::size_t page_size() {
  static const std::size_t ps = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return ps;
}

bool handler_installed() { return ours_now(); }

bool install_handler() {
  std::lock_guard<std::mutex> lk(g_mu);
  if (ours_now()) return true;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = &on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  struct sigaction prev;
  if (::sigaction(SIGSEGV, &sa, &prev) != 0) return false;
  g_prev = prev;
  g_installed.store(true);
  return true;
}

int64_t protect(std::uintptr_t addr, std::size_t len) {
  const std::size_t ps = page_size();
  if (len == 0 || addr % ps != 0 || len % ps != 0)
    throw Error(ErrorKind::InvalidArgument,
                "write guard: range " + std::to_string(addr) + "+" + std::to_string(len) + " is not page-aligned");
  if (!install_handler()) throw Error(ErrorKind::Unavailable, "write guard: cannot install the SIGSEGV handler");
  std::lock_guard<std::mutex> lk(g_mu);
  int n = g_high.load();
  int id = -1;
  for (int i = 0; i < n; ++i)
    if (g_slots[i].state.load() == 0) {
      id = i;
      break;
    }
  if (id < 0) {
    if (n >= kSlots)
      throw Error(ErrorKind::Unavailable, "write guard: no slot left (" + std::to_string(kSlots) + " ranges guarded)");
    id = n;
  }
  Slot& s = g_slots[id];
  s.lo.store(addr);
  s.hi.store(addr + len);
  s.state.store(1, std::memory_order_release);
  if (id == n) g_high.store(n + 1, std::memory_order_release);
  if (::mprotect(reinterpret_cast<void*>(addr), len, PROT_READ) != 0) {
    int e = errno;
    s.state.store(0);
    throw Error(ErrorKind::Unavailable, std::string("write guard: mprotect: ") + std::strerror(e));
  }
  return id;
}

bool written(int64_t id) {
  if (id < 0 || id >= g_high.load()) return false;
  return g_slots[id].state.load(std::memory_order_acquire) == 2;
}

void release(int64_t id, bool restore) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (id < 0 || id >= g_high.load()) return;
  Slot& s = g_slots[id];
  int st = s.state.load();
  if (st == 0) return;
  std::uintptr_t lo = s.lo.load(), hi = s.hi.load();
  s.state.store(0, std::memory_order_release);
  if (st == 1 && restore) {
    // Pages shared with another guarded range become writable for it too: it counts as written.
    int n = g_high.load();
    for (int j = 0; j < n; ++j) {
      Slot& o = g_slots[j];
      if (o.state.load() == 1 && o.lo.load() < hi && o.hi.load() > lo) o.state.store(2);
    }
    ::mprotect(reinterpret_cast<void*>(lo), hi - lo, PROT_READ | PROT_WRITE);
  }
}

std::size_t verify() {
  // Runs of mappings without write permission: [lo, hi), adjacent ones merged.
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ro;
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (f == nullptr) return 0;
  char line[4096];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {0};
    if (std::sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if (perms[1] == 'w') continue;
    if (!ro.empty() && ro.back().second == lo)
      ro.back().second = hi;
    else
      ro.emplace_back(lo, hi);
  }
  std::fclose(f);
  std::lock_guard<std::mutex> lk(g_mu);
  std::size_t marked = 0;
  int n = g_high.load();
  for (int i = 0; i < n; ++i) {
    Slot& s = g_slots[i];
    if (s.state.load() != 1) continue;
    std::uintptr_t lo = s.lo.load(), hi = s.hi.load();
    // The run that starts at or before lo (ro is sorted: /proc/self/maps lists mappings in address order).
    std::size_t a = 0, b = ro.size();
    while (a < b) {
      std::size_t m = (a + b) / 2;
      if (ro[m].first <= lo)
        a = m + 1;
      else
        b = m;
    }
    bool ok = a > 0 && ro[a - 1].second >= hi;
    if (!ok) {
      s.state.store(2);
      ++marked;
    }
  }
  return marked;
}

std::size_t active_ranges() {
  std::size_t c = 0;
  int n = g_high.load();
  for (int i = 0; i < n; ++i) c += g_slots[i].state.load() != 0;
  return c;
}

std::uint64_t faults_handled() { return g_faults.load(); }

}  // namespace cxl::guard
