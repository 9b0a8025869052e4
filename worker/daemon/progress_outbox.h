// ProgressOutbox: a worker rank's progress reports on their way to the
// coordinator, sent in order on a thread of their own so that a coordinator
// that is away (restarting, rescheduled) never holds up training.
//
// A report that carries a result (an epoch's metrics, the end, a failure:
// config::CarriesResult) waits and is sent again until the coordinator takes
// it, for as long as that takes: a job cannot end without it. Of periodic
// progress only the latest waits, sent when no result is queued, and dropped
// if that one send fails. A result carries the progress of its moment, so it
// replaces any older periodic report still waiting, which would otherwise
// reach the coordinator after it.
#ifndef FULCRUM_WORKER_DAEMON_PROGRESS_OUTBOX_H_
#define FULCRUM_WORKER_DAEMON_PROGRESS_OUTBOX_H_

#include <atomic>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fulcrum/v1/cluster.pb.h"
#include "worker/rpc/coordinator_client.h"

namespace fulcrum {

struct ProgressOutboxOptions {
  absl::Duration send_timeout = absl::Seconds(10);
  absl::Duration initial_backoff = absl::Milliseconds(250);
  absl::Duration max_backoff = absl::Seconds(2);
};

class ProgressOutbox {
 public:
  // `on_stop` runs (on the sending thread) when the coordinator answers a
  // report with stop: the job was cancelled or ended, or the rank moved on.
  // The outbox stops then too.
  ProgressOutbox(CoordinatorClient* coordinator, std::string job_id, std::function<void()> on_stop,
                 ProgressOutboxOptions options = {});
  ~ProgressOutbox();  // stops and joins the sending thread
  ProgressOutbox(const ProgressOutbox&) = delete;
  ProgressOutbox& operator=(const ProgressOutbox&) = delete;

  void Post(v1::ReportProgressRequest r);
  // Blocks until every queued result is delivered (or refused for good), or
  // the outbox stops.
  void Drain();
  // Nothing more is sent; Drain returns. Queued reports are dropped.
  void Stop();
  bool stopped() const { return stopped_.load(); }
  // No send in flight (one can take up to send_timeout).
  bool idle() const;

 private:
  void SendLoop();
  // One report out of the box, or false once stopped.
  bool Next(v1::ReportProgressRequest* r, bool* must_deliver);

  CoordinatorClient* const coordinator_;
  const std::string job_id_;
  const std::function<void()> on_stop_;
  const ProgressOutboxOptions options_;
  std::atomic<bool> stopped_{false};
  mutable absl::Mutex mu_;
  std::deque<v1::ReportProgressRequest> results_ ABSL_GUARDED_BY(mu_);  // in order
  std::optional<v1::ReportProgressRequest> latest_ ABSL_GUARDED_BY(mu_);  // periodic progress
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sender_;
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_DAEMON_PROGRESS_OUTBOX_H_
