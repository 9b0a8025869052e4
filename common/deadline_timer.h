// DeadlineTimer: runs callbacks at deadlines on one background thread. Used
// to fail consistency waits whose deadline passed without blocking a gRPC
// thread. Thread-safe; the destructor cancels pending callbacks.
#ifndef FULCRUM_COMMON_DEADLINE_TIMER_H_
#define FULCRUM_COMMON_DEADLINE_TIMER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace fulcrum {

class DeadlineTimer {
 public:
  DeadlineTimer();
  ~DeadlineTimer();
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Schedules fn at `when`; returns an id for Cancel.
  uint64_t Schedule(absl::Time when, std::function<void()> fn);
  // Cancels if not yet run; returns false when it already ran or is running.
  bool Cancel(uint64_t id);

 private:
  void Loop();
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::pair<absl::Time, uint64_t>, std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::Time> when_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_DEADLINE_TIMER_H_
