// A Clock tests move by hand (common/clock.h): what waited on real time
// for a timeout now advances past it at once.
#ifndef FULCRUM_TESTS_TESTING_FAKE_CLOCK_H_
#define FULCRUM_TESTS_TESTING_FAKE_CLOCK_H_

#include "absl/synchronization/mutex.h"
#include "common/clock.h"

namespace fulcrum::testing {

class FakeClock final : public Clock {
 public:
  // 2027-01-15, a fixed day: runs are alike.
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1800000000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_FAKE_CLOCK_H_
