// GPU time of one rank: the seconds its worker held a GPU for it while
// training, split into busy and idle by the GPU's utilization as NVML
// reports it. What a job costs is its GPU-seconds (fulcrumctl status shows
// GPU-hours); the idle share is what better overlap could win back.
//
// Time counts between Start and Stop (the Runner starts the meter at its
// first epoch and stops it when the rank finishes, fails or is withdrawn:
// loading data and waiting for an assignment do not count). Each Sample
// attributes the time since the previous one at the utilization read then
// (NVML's figure covers its last sample period, 1/6 s to 1 s); when the
// utilization cannot be read the time counts as busy, so the total is
// always right and the split errs on the side of reporting less waste.
#ifndef FULCRUM_WORKER_DAEMON_GPU_TIME_H_
#define FULCRUM_WORKER_DAEMON_GPU_TIME_H_

#include <functional>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace fulcrum {

class GpuTimeMeter {
 public:
  // `utilization` returns the GPU's busy fraction (0-1) now, or nullopt.
  explicit GpuTimeMeter(std::function<std::optional<double>()> utilization)
      : utilization_(std::move(utilization)) {}

  void Start(absl::Time now);
  void Sample(absl::Time now);
  void Stop(absl::Time now);  // samples, then stops counting

  bool running() const;
  double busy_seconds() const;
  double idle_seconds() const;

 private:
  void SampleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::function<std::optional<double>()> utilization_;
  mutable absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_ ABSL_GUARDED_BY(mu_);
  double busy_ ABSL_GUARDED_BY(mu_) = 0;
  double idle_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_DAEMON_GPU_TIME_H_
