// Clock: where a component reads the time of day for its decisions
// (liveness, deadlines, schedules), injected so tests can move it by hand
// instead of sleeping. Waits on a DeadlineTimer or a mutex stay on real time.
#ifndef FULCRUM_COMMON_CLOCK_H_
#define FULCRUM_COMMON_CLOCK_H_

#include "absl/time/time.h"

namespace fulcrum {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;

  // The process's clock (absl::Now); never destroyed.
  static const Clock* Real();
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_CLOCK_H_
