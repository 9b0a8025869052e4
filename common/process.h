// Process-wide set-up done once in main(): allocator tuning and signals.
#ifndef FULCRUM_COMMON_PROCESS_H_
#define FULCRUM_COMMON_PROCESS_H_

#include <string>

#include "absl/time/time.h"

namespace fulcrum {

// Set-up for a serving binary (server, bench):
// - glibc's adaptive mmap threshold makes every fresh multi-MiB message buffer
//   fault its pages in again (shared/ENVIRONMENT.md: 1.4-2x on big messages):
//   the thresholds are pinned so freed buffers are reused from the heap;
// - Debian's Abseil is built with mutex deadlock detection on, which costs
//   about 1% of a busy server's CPU: it is turned off (tests keep it).
// - protobuf's log lines are rate-limited (at most 10 a minute, with counts
//   of those dropped);
// - every `trim_every`, freed heap memory is returned to the system
//   (malloc_trim), so memory taken by a burst comes back; for that the
//   process allocates from one malloc arena (process.cc says why), unless
//   GLIBC_TUNABLES sets glibc.malloc.arena_max.
// The coordinator passes pin_malloc_thresholds = false: its messages are
// small, and a refused flood must not stay in its heap.
struct ServingProcessOptions {
  bool pin_malloc_thresholds = true;
  absl::Duration trim_every = absl::Seconds(10);
};
void InitServingProcess(const ServingProcessOptions& options = {});

// The serving binaries' heap settings for a client process that moves
// messages of a megabyte or more call after call (the Python package's
// tables, docs/benchmarks.md "Python: push+pull from NumPy"): one malloc
// arena, the mmap and trim thresholds pinned, freed memory returned every
// `trim_every`. Applied once per process; left alone, and says so, when
// GLIBC_TUNABLES already sets any glibc.malloc tunable (the user's choice).
// Returns what it did, for the caller's log.
std::string TuneHeapForLargeMessages(absl::Duration trim_every = absl::Seconds(10));

// For the daemons: when the process dies of SIGSEGV, SIGABRT (glibc's heap
// checks, failed assertions), SIGBUS, SIGFPE, SIGILL or SIGTRAP, prints the
// signal and a symbolized stack trace of the failing thread to stderr (the
// daemon's log), then dies of that signal as before, so an operator and a
// failed test see where it crashed. A signal that already has a handler
// (ASan's for SIGSEGV, SIGBUS and SIGFPE, whose reports say more) keeps it.
// `argv0` finds the binary's symbols.
void InstallCrashHandler(const char* argv0);

// Blocks SIGINT/SIGTERM in all threads (call before starting any) and
// returns a function that waits for one of them; returns the signal number.
int WaitForTerminationSignal();
void BlockTerminationSignals();

// This machine's host name ("localhost" when it has none).
std::string HostName();

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_PROCESS_H_
