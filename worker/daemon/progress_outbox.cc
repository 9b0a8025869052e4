#include "worker/daemon/progress_outbox.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/backoff.h"
#include "common/config/job_spec.h"
#include "common/logging.h"

namespace fulcrum {

ProgressOutbox::ProgressOutbox(CoordinatorClient* coordinator, std::string job_id, std::function<void()> on_stop,
                               ProgressOutboxOptions options)
    : coordinator_(coordinator), job_id_(std::move(job_id)), on_stop_(std::move(on_stop)), options_(options) {
  sender_ = std::thread([this] { SendLoop(); });
}

ProgressOutbox::~ProgressOutbox() {
  Stop();
  sender_.join();
}

void ProgressOutbox::Post(v1::ReportProgressRequest r) {
  const bool must_deliver = config::CarriesResult(r);
  absl::MutexLock lock(&mu_);
  if (must_deliver) {
    results_.push_back(std::move(r));
    latest_.reset();
  } else {
    latest_ = std::move(r);
  }
}

void ProgressOutbox::Drain() {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (results_.empty() && !sending_) || stopped_.load();
  };
  mu_.Await(absl::Condition(&done));
}

void ProgressOutbox::Stop() {
  stopped_.store(true);
  absl::MutexLock lock(&mu_);  // wakes the sender and Drain
}

bool ProgressOutbox::idle() const {
  absl::MutexLock lock(&mu_);
  return !sending_;
}

bool ProgressOutbox::Next(v1::ReportProgressRequest* r, bool* must_deliver) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !results_.empty() || latest_.has_value() || stopped_.load();
  };
  mu_.Await(absl::Condition(&ready));
  if (stopped_.load()) return false;  // the assignment ended: nobody wants its reports
  *must_deliver = !results_.empty();
  if (*must_deliver) {
    *r = results_.front();
  } else {
    *r = std::move(*latest_);
    latest_.reset();
  }
  sending_ = true;
  return true;
}

void ProgressOutbox::SendLoop() {
  int attempt = 0;
  Backoff backoff({.initial = options_.initial_backoff, .max = options_.max_backoff});
  absl::Time failing_since, last_warning = absl::InfinitePast();
  v1::ReportProgressRequest r;
  bool must_deliver = false;
  while (Next(&r, &must_deliver)) {
    const absl::StatusOr<v1::ReportProgressResponse> resp = coordinator_->ReportProgress(r, options_.send_timeout);
    const absl::Status& s = resp.status();
    const bool retry = !s.ok() && must_deliver &&
                       (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded);
    if (s.ok()) {
      if (attempt > 0) {
        FLOG(INFO) << "progress report for job " << job_id_ << " delivered after " << attempt
                   << " failed tries over "
                   << absl::FormatDuration(absl::Trunc(absl::Now() - failing_since, absl::Seconds(1)));
      }
      attempt = 0;
      backoff.Reset();
      if (resp->stop()) {  // cancelled, ended, or the rank moved on
        stopped_.store(true);
        if (on_stop_) on_stop_();
      }
    } else {
      if (attempt++ == 0) failing_since = absl::Now();
      // The first failure, then a line a minute while the coordinator is away.
      if (!retry || absl::Now() - last_warning >= absl::Minutes(1)) {
        FLOG(WARNING) << "progress report for job " << job_id_ << " failed: " << s.message()
                      << (retry ? absl::StrCat("; sending it again until the coordinator answers (", attempt,
                                               attempt == 1 ? " try so far)" : " tries so far)")
                                : std::string());
        last_warning = absl::Now();
      }
      if (!retry) {
        attempt = 0;
        backoff.Reset();
      }
    }
    absl::MutexLock lock(&mu_);
    sending_ = false;
    if (must_deliver && !retry) results_.pop_front();  // delivered, or refused for good
    if (retry) {
      // Back off, but wake for a stop.
      auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopped_.load(); };
      mu_.AwaitWithTimeout(absl::Condition(&stopped), backoff.Next());
    }
  }
}

}  // namespace fulcrum
