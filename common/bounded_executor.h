// BoundedExecutor: runs tasks on at most `threads` threads, started as
// needed and kept, with at most `max_queued` tasks waiting for one. A task
// past that limit is refused with RESOURCE_EXHAUSTED naming the executor and
// its limits, so a flood of blocking calls cannot start a thread each.
//
//   BoundedExecutor exec("checkpoint calls", 4, 64);
//   absl::Status s = exec.Submit([] { ... });  // RESOURCE_EXHAUSTED when full
//
// The destructor refuses new tasks, runs every task already accepted and
// joins the threads.
#ifndef FULCRUM_COMMON_BOUNDED_EXECUTOR_H_
#define FULCRUM_COMMON_BOUNDED_EXECUTOR_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace fulcrum {

class BoundedExecutor {
 public:
  BoundedExecutor(std::string name, int threads, size_t max_queued);
  ~BoundedExecutor();
  BoundedExecutor(const BoundedExecutor&) = delete;
  BoundedExecutor& operator=(const BoundedExecutor&) = delete;

  // Runs `task` on one of the threads, now or when one is free; OK when
  // accepted. RESOURCE_EXHAUSTED when every thread is busy and max_queued
  // tasks wait; UNAVAILABLE once the executor is shutting down.
  absl::Status Submit(std::function<void()> task);

  // Tasks running and waiting now.
  int running() const;
  size_t queued() const;

 private:
  void Loop();

  const std::string name_;
  const int max_threads_;
  const size_t max_queued_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_BOUNDED_EXECUTOR_H_
