// Exponential backoff with jitter for the loops that retry a call to the
// coordinator (node agents' heartbeats, workers' reports, fulcrumctl watch),
// in the shape of gRPC's connection backoff: the first delay is `initial`,
// each next one `multiplier` times the last up to `max`, and each is
// randomized by +-`jitter`, so that the many nodes a coordinator restart
// cut off together do not come back in lockstep. Not thread-safe.
#ifndef FULCRUM_COMMON_BACKOFF_H_
#define FULCRUM_COMMON_BACKOFF_H_

#include <cstdint>
#include <random>

#include "absl/time/time.h"

namespace fulcrum {

class Backoff {
 public:
  struct Options {
    absl::Duration initial = absl::Milliseconds(250);
    absl::Duration max = absl::Seconds(2);
    double multiplier = 2;
    double jitter = 0.2;  // each delay within +-20% of its base, never over max
  };
  // `seed` 0: a random one (tests give a fixed one).
  explicit Backoff(Options options, uint64_t seed = 0);

  // The delay before the next try.
  absl::Duration Next();
  // After a success: the next failure waits `initial` again.
  void Reset();
  // Next() calls since the last Reset.
  int failures() const { return failures_; }

 private:
  const Options options_;
  absl::Duration base_;
  int failures_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_BACKOFF_H_
