#include "common/parallel.h"

#include <algorithm>

namespace fulcrum {

ParallelRunner::ParallelRunner(int helpers) {
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { Loop(); });
}

ParallelRunner::~ParallelRunner() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

int ParallelRunner::DefaultHelpers() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores - 1, 0, 7);
}

void ParallelRunner::ForEach(size_t n, absl::FunctionRef<void(size_t)> f) {
  if (n <= 1 || threads_.empty() || !call_mu_.TryLock()) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    next_.store(0, std::memory_order_relaxed);
    fn_ = &f;
    n_ = n;
    ++generation_;
  }
  for (size_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
  {
    // Helpers that have not woken yet must not start on a finished loop;
    // the ones already in it may still be running their last iteration.
    absl::MutexLock lock(&mu_);
    fn_ = nullptr;
    mu_.Await(absl::Condition(+[](int* busy) { return *busy == 0; }, &busy_));
  }
  call_mu_.Unlock();
}

void ParallelRunner::Loop() {
  struct Wake {
    ParallelRunner* runner;
    uint64_t seen;
  } wake{this, 0};
  for (;;) {
    const absl::FunctionRef<void(size_t)>* fn;
    size_t n;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Wake* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->runner->stop_ || w->runner->generation_ != w->seen;
          },
          &wake));
      if (stop_) return;
      wake.seen = generation_;
      // A helper that wakes after the caller finished the loop skips it.
      if (fn_ == nullptr) continue;
      fn = fn_;
      n = n_;
      ++busy_;
    }
    for (size_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n;) (*fn)(i);
    absl::MutexLock lock(&mu_);
    --busy_;
  }
}

}  // namespace fulcrum
