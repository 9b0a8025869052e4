#include "common/bounded_executor.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fulcrum {

BoundedExecutor::BoundedExecutor(std::string name, int threads, size_t max_queued)
    : name_(std::move(name)), max_threads_(threads < 1 ? 1 : threads), max_queued_(max_queued) {}

BoundedExecutor::~BoundedExecutor() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    threads.swap(threads_);
  }
  // The threads run what was accepted before they see stop_ with an empty
  // queue.
  for (std::thread& t : threads) t.join();
}

absl::Status BoundedExecutor::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::UnavailableError(absl::StrCat(name_, ": shutting down"));
  // Tasks already waiting take the idle threads first.
  const bool thread_free = idle_ > static_cast<int>(queue_.size());
  if (!thread_free && static_cast<int>(threads_.size()) < max_threads_) {
    threads_.emplace_back([this] { Loop(); });
    ++idle_;
  } else if (!thread_free && queue_.size() >= max_queued_) {
    return absl::ResourceExhaustedError(absl::StrCat(name_, ": ", running_, " running on all ", max_threads_,
                                                     " threads and ", queue_.size(), " waiting, the limit; try again"));
  }
  queue_.push_back(std::move(task));
  return absl::OkStatus();
}

void BoundedExecutor::Loop() {
  mu_.Lock();
  for (;;) {
    mu_.Await(absl::Condition(
        +[](BoundedExecutor* e) ABSL_NO_THREAD_SAFETY_ANALYSIS { return e->stop_ || !e->queue_.empty(); }, this));
    if (queue_.empty()) break;  // stopping, nothing left
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    --idle_;
    ++running_;
    mu_.Unlock();
    task();
    task = nullptr;
    mu_.Lock();
    --running_;
    ++idle_;
  }
  mu_.Unlock();
}

int BoundedExecutor::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

size_t BoundedExecutor::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

}  // namespace fulcrum
