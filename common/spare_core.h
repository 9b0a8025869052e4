// SpareCore: whether this host has a core that no runnable thread is using
// right now, so a thread may poll for a message instead of sleeping without
// taking time another thread needs.
//
// Polling saves the wake-up of a sleeping thread (50-100 us on a virtual
// machine, whose idle virtual CPUs halt), but a poller on a busy machine
// takes a share of a core from real work however often it yields: several
// pollers yield to one another. So the pollers (Future::Wait's helper,
// shm::Wait) ask this first and again while they poll, and sleep as soon as
// the answer is no.
#ifndef FULCRUM_COMMON_SPARE_CORE_H_
#define FULCRUM_COMMON_SPARE_CORE_H_

#include <sched.h>

#include <chrono>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace fulcrum {

// True when the host's runnable threads (the calling one included) are no
// more than this process's usable cores. From /proc/loadavg's running count,
// read with one pread (about a microsecond); false when it cannot be read.
bool SpareCore();

// What a poller asks before and while it polls: SpareCore in use. Passed in
// by whoever configures the poller (a client's or server's options), so a
// test of polling gives one that answers as it needs, whatever the load of
// the machine it runs on.
using SpareCoreProbe = bool (*)();

// The running count in a /proc/loadavg line ("0.52 0.58 0.59 3/345 12345"
// -> 3); nullopt when the line has no such field. Exposed for tests.
std::optional<uint32_t> RunnableFromLoadavg(absl::string_view line);

// Cores this process may run on (its affinity mask; at least 1).
uint32_t UsableCores();

// The CPU's spin-wait hint (x86 PAUSE): eases a busy-wait loop on the core
// and its hyperthread sibling.
inline void CpuPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The check both daemons make of --shared_memory_poll: from 0 (never poll)
// to 1 s. INVALID_ARGUMENT naming the flag and the value otherwise.
absl::Status CheckPollFlag(absl::Duration poll);

// Calls `done()` until it returns true (then true), `spin` passes or the
// host has no core to spare (then false). Yields the core every 16 calls
// and asks `spare` before starting and every 256 calls, so a poller only
// takes time no other thread wants.
template <typename Done>
bool PollWhileSpare(std::chrono::nanoseconds spin, Done done, SpareCoreProbe spare) {
  if (!spare()) return false;
  const auto until = std::chrono::steady_clock::now() + spin;
  for (uint32_t i = 1;; ++i) {
    if (done()) return true;
    CpuPause();
    if (i % 16 == 0) {
      sched_yield();
      if (std::chrono::steady_clock::now() >= until || (i % 256 == 0 && !spare())) return false;
    }
  }
}

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_SPARE_CORE_H_
