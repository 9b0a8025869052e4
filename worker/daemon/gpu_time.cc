#include "worker/daemon/gpu_time.h"

#include <algorithm>

namespace fulcrum {

void GpuTimeMeter::Start(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (running_) return;
  running_ = true;
  last_ = now;
}

void GpuTimeMeter::Sample(absl::Time now) {
  absl::MutexLock lock(&mu_);
  SampleLocked(now);
}

void GpuTimeMeter::Stop(absl::Time now) {
  absl::MutexLock lock(&mu_);
  SampleLocked(now);
  running_ = false;
}

void GpuTimeMeter::SampleLocked(absl::Time now) {
  if (!running_ || now <= last_) return;
  const double seconds = absl::ToDoubleSeconds(now - last_);
  last_ = now;
  const std::optional<double> u = utilization_ ? utilization_() : std::nullopt;
  const double busy = u ? std::clamp(*u, 0.0, 1.0) : 1.0;
  busy_ += seconds * busy;
  idle_ += seconds * (1.0 - busy);
}

bool GpuTimeMeter::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

double GpuTimeMeter::busy_seconds() const {
  absl::MutexLock lock(&mu_);
  return busy_;
}

double GpuTimeMeter::idle_seconds() const {
  absl::MutexLock lock(&mu_);
  return idle_;
}

}  // namespace fulcrum
