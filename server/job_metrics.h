// What a server measures of one job, kept next to the job and rendered at
// scrape time (docs/metrics.md lists the series). Lock-free to update.
#ifndef FULCRUM_SERVER_JOB_METRICS_H_
#define FULCRUM_SERVER_JOB_METRICS_H_

#include <atomic>
#include <cstdint>

#include "common/metrics/metrics.h"

namespace fulcrum {

struct JobMetrics {
  std::atomic<uint64_t> push_requests{0};
  std::atomic<uint64_t> pull_requests{0};
  std::atomic<double> push_bytes{0};  // gradient payload received
  std::atomic<double> pull_bytes{0};  // parameter payload sent
  metrics::Histogram push_seconds;    // handling, from receipt to reply
  metrics::Histogram pull_seconds;    // including the consistency wait
  metrics::Histogram pull_wait_seconds;  // the BSP/SSP wait alone (0 when none)
  metrics::Histogram apply_seconds;      // the optimizer over one push (or BSP step)
  metrics::Histogram staleness{metrics::StalenessBuckets()};  // SSP/ASP: pull clock - slowest clock
  metrics::Histogram push_staleness{metrics::StalenessBuckets()};  // staleness_aware_lr: a push's divisor
  // Checkpoints this server wrote for the job.
  metrics::Histogram checkpoint_seconds;
  std::atomic<double> last_checkpoint_bytes{0};
  std::atomic<double> last_checkpoint_time{0};  // Unix seconds; 0: none yet
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_JOB_METRICS_H_
