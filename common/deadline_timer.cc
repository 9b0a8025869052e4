#include "common/deadline_timer.h"

namespace fulcrum {

DeadlineTimer::DeadlineTimer() : thread_([this] { Loop(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

uint64_t DeadlineTimer::Schedule(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  queue_.emplace(std::make_pair(when, id), std::move(fn));
  when_.emplace(id, when);
  return id;
}

bool DeadlineTimer::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return false;
  queue_.erase({it->second, id});
  when_.erase(it);
  return true;
}

void DeadlineTimer::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    if (queue_.empty()) {
      mu_.Await(absl::Condition(
          +[](DeadlineTimer* t) ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->stop_ || !t->queue_.empty(); },
          this));
      continue;
    }
    const absl::Time next = queue_.begin()->first.first;
    if (absl::Now() < next) {
      // Wakes early only on stop or when an earlier deadline is scheduled:
      // not on every Schedule and Cancel (callers schedule and cancel one
      // per request, thousands a second). A cancelled front entry just
      // costs one wake-up at its old deadline.
      struct Args { DeadlineTimer* t; absl::Time next; } args{this, next};
      mu_.AwaitWithDeadline(
          absl::Condition(
              +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                return a->t->stop_ || (!a->t->queue_.empty() && a->t->queue_.begin()->first.first < a->next);
              },
              &args),
          next);
      continue;
    }
    auto it = queue_.begin();
    std::function<void()> fn = std::move(it->second);
    when_.erase(it->first.second);
    queue_.erase(it);
    mu_.Unlock();
    fn();
    // Whatever the closure holds goes here, outside the lock: its
    // destructors may schedule or cancel (a deadlock under mu_).
    fn = nullptr;
    mu_.Lock();
  }
}

}  // namespace fulcrum
