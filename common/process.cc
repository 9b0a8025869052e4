#include "common/process.h"

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <execinfo.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <google/protobuf/stubs/logging.h>

#include <thread>

#include "absl/debugging/symbolize.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/errors.h"
#include "common/logging.h"
#include "absl/synchronization/mutex.h"

namespace fulcrum {

namespace {

// protobuf's own log lines (a request that does not parse, a string that is
// not UTF-8) come once per bad request: a flood of them, from callers with no
// credentials too, would flood the log. At most kBurst a minute get through,
// each saying how many were dropped since the last.
void LimitedProtobufLog(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  static LogLimiter* limiter = new LogLimiter(/*burst=*/10, absl::Minutes(1));
  uint64_t dropped = 0;
  if (!limiter->Allow(absl::Now(), &dropped)) return;
  LogMessage(level >= google::protobuf::LOGLEVEL_ERROR ? LogSeverity::kError : LogSeverity::kWarning, file, line)
          .stream()
      << "protobuf: " << SafeStatusMessage(message)
      << (dropped > 0 ? absl::StrCat(" (", dropped, " more protobuf messages dropped before this one)") : "");
}

}  // namespace

namespace {

void StartTrimThread(absl::Duration every) {
  // Freed memory goes back to the system every so often: a flood of large
  // messages (refused or not) leaves the heap as big as at its peak
  // otherwise, with the thresholds pinned. A buffer in use is not touched;
  // one freed just before costs its page faults once more.
  std::thread([every] {
    for (;;) {
      absl::SleepFor(every);
      malloc_trim(0);
    }
  }).detach();
}

void PinMallocThresholds() {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

}  // namespace

void InitServingProcess(const ServingProcessOptions& options) {
  // One malloc arena: glibc gives memory freed at the top of a thread's own
  // arena back only past M_TRIM_THRESHOLD, and malloc_trim does not shrink
  // those arenas, so with the thresholds pinned a burst of big messages read
  // by gRPC's threads stayed resident for good (servers kept 50-60 MiB of a
  // refused 600 MB flood). In the main arena malloc_trim gives it all back.
  // On 2 cores push+pull ran as fast or faster with one arena
  // (docs/benchmarks.md, "Memory after a flood"). An operator may still set
  // GLIBC_TUNABLES=glibc.malloc.arena_max=N, which is then left alone.
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables == nullptr || std::strstr(tunables, "arena_max") == nullptr) mallopt(M_ARENA_MAX, 1);
  if (options.pin_malloc_thresholds) PinMallocThresholds();
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  google::protobuf::SetLogHandler(&LimitedProtobufLog);
  if (options.trim_every > absl::ZeroDuration()) StartTrimThread(options.trim_every);
}

std::string TuneHeapForLargeMessages(absl::Duration trim_every) {
  static const std::string* done = [trim_every] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) {
      return new std::string("heap left as GLIBC_TUNABLES sets it");
    }
    mallopt(M_ARENA_MAX, 1);
    PinMallocThresholds();
    if (trim_every > absl::ZeroDuration()) StartTrimThread(trim_every);
    return new std::string(absl::StrCat("heap tuned for large messages: one malloc arena, mmap threshold 256 MiB, "
                                        "trim threshold 512 MiB, free memory returned every ",
                                        absl::FormatDuration(trim_every)));
  }();
  return *done;
}

namespace {

constexpr int kFatalSignals[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL, SIGTRAP};

void WriteAll(const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

// Unwinds with the DWARF unwinder behind backtrace(), which walks through
// glibc's and gRPC's frames (built without frame pointers) where a frame
// pointer walk stops at the first of them; names frames from the ELF
// symbol tables with Abseil's symbolizer, which is made for signal handlers.
void OnFatalSignal(int sig, siginfo_t* info, void*) {
  char line[512];
  char fault[64] = "";
  if (sig == SIGSEGV || sig == SIGBUS || sig == SIGFPE || sig == SIGILL) {
    std::snprintf(fault, sizeof(fault), " at address %p", info->si_addr);
  }
  int n = std::snprintf(line, sizeof(line), "*** SIG%s received%s by pid %d; stack of the thread it stopped:\n",
                        sigabbrev_np(sig), fault, static_cast<int>(getpid()));
  WriteAll(line, static_cast<size_t>(n));
  void* pcs[64];
  const int depth = backtrace(pcs, 64);
  for (int i = 0; i < depth; ++i) {
    char name[256];
    // A return address points past its call: look up the byte before it.
    const void* pc = i == 0 ? pcs[i] : static_cast<const char*>(pcs[i]) - 1;
    if (!absl::Symbolize(pc, name, sizeof(name))) std::strcpy(name, "(unknown)");
    n = std::snprintf(line, sizeof(line), "    @ %p  %s\n", pcs[i], name);
    WriteAll(line, static_cast<size_t>(n));
  }
  // SA_RESETHAND restored the default action: die of the signal as before.
  raise(sig);
}

}  // namespace

void InstallCrashHandler(const char* argv0) {
  absl::InitializeSymbolizer(argv0);
  // backtrace() loads libgcc's unwinder on first use, which allocates: not
  // inside a handler called from a corrupt heap.
  void* warm[1];
  (void)backtrace(warm, 1);
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = OnFatalSignal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  for (int sig : kFatalSignals) {
    // A handler already there (a sanitizer's, whose report says more) stays.
    struct sigaction old;
    if (sigaction(sig, nullptr, &old) == 0 && !(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL) {
      sigaction(sig, &sa, nullptr);
    }
  }
}

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForTerminationSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

std::string HostName() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == 0) return "localhost";
  return name;
}

}  // namespace fulcrum
