// Future<T>: the result of an asynchronous call, completed once by a Promise.
// Wait() blocks on a condition variable; Then() runs a callback on completion
// (on the completing thread, or inline when already complete). Thread-safe.
//
// A promise may carry a helper: a function that completes pending work
// without blocking (ShmConn::Poll reads answers out of shared memory).
// Wait() first calls it in a loop, for at most the helper's time and only
// while the host has a core to spare (common/spare_core.h), so the waiting
// thread takes the answer itself the moment it lands instead of sleeping
// until another thread wakes it (a wake-up costs tens of microseconds on a
// virtual machine's idle core).
#ifndef FULCRUM_COMMON_FUTURE_H_
#define FULCRUM_COMMON_FUTURE_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/spare_core.h"

namespace fulcrum {

template <typename T>
class Future;

template <typename T>
class Promise {
 public:
  Promise() : state_(std::make_shared<State>()) {}
  Future<T> future() const { return Future<T>(state_); }
  // Before the future is handed out: Wait() calls `helper` until the value
  // is set or `spin` has passed, then blocks. `helper` returns whether it
  // made progress; it must not block.
  // `spare`: asked before and while the helper is called (PollWhileSpare).
  void SetHelper(std::function<bool()> helper, absl::Duration spin, SpareCoreProbe spare = &SpareCore) const {
    state_->helper = std::move(helper);
    state_->spin = absl::ToChronoNanoseconds(spin);
    state_->spare = spare;
  }
  // Completes the future; later calls are ignored.
  void Set(T value) const {
    std::vector<std::function<void(const T&)>> callbacks;
    const T* set = nullptr;  // immutable once set, so readable after unlocking
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->value.has_value()) return;
      set = &state_->value.emplace(std::move(value));
      state_->ready.store(true, std::memory_order_release);
      callbacks.swap(state_->callbacks);
    }
    for (auto& cb : callbacks) cb(*set);
  }

 private:
  friend class Future<T>;
  struct State {
    absl::Mutex mu;
    std::optional<T> value ABSL_GUARDED_BY(mu);
    std::vector<std::function<void(const T&)>> callbacks ABSL_GUARDED_BY(mu);
    std::atomic<bool> ready{false};   // value is set
    std::function<bool()> helper;     // set before the future is shared
    std::chrono::nanoseconds spin{0};
    SpareCoreProbe spare = &SpareCore;
  };
  std::shared_ptr<State> state_;
};

template <typename T>
class Future {
 public:
  Future() = default;
  bool valid() const { return state_ != nullptr; }
  bool Ready() const {
    absl::MutexLock lock(&state_->mu);
    return state_->value.has_value();
  }
  // Blocks until complete; the value stays owned by the future.
  const T& Wait() const {
    Help();
    absl::MutexLock lock(&state_->mu);
    state_->mu.Await(absl::Condition(
        +[](std::optional<T>* v) { return v->has_value(); }, &state_->value));
    return *state_->value;
  }
  // False on timeout.
  bool WaitFor(absl::Duration timeout) const {
    absl::MutexLock lock(&state_->mu);
    return state_->mu.AwaitWithTimeout(
        absl::Condition(+[](std::optional<T>* v) { return v->has_value(); }, &state_->value),
        timeout);
  }
  void Then(std::function<void(const T&)> cb) const {
    {
      absl::MutexLock lock(&state_->mu);
      if (!state_->value.has_value()) {
        state_->callbacks.push_back(std::move(cb));
        return;
      }
    }
    cb(*state_->value);
  }

 private:
  friend class Promise<T>;
  void Help() const {
    const auto& st = *state_;
    if (!st.helper || st.ready.load(std::memory_order_acquire)) return;
    // Only while the host has a core to spare (common/spare_core.h).
    PollWhileSpare(
        st.spin,
        [&st] {
          st.helper();
          return st.ready.load(std::memory_order_acquire);
        },
        st.spare);
  }
  explicit Future(std::shared_ptr<typename Promise<T>::State> s) : state_(std::move(s)) {}
  std::shared_ptr<typename Promise<T>::State> state_;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_FUTURE_H_
