// The Coordinator's job API: submit, get, list, cancel, and a job's state
// changes.
#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/config/job_spec.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/coordinator/coordinator_internal.h"

namespace fulcrum {

using coordinator_internal::kJobPrefix;
using coordinator_internal::kMetaKey;
using coordinator_internal::Serial;

absl::StatusOr<std::string> Coordinator::SubmitJob(const v1::JobSpec& spec_in, bool validate_only,
                                                   const std::string& owner) {
  v1::JobSpec spec = spec_in;
  config::NormalizeJobSpec(&spec);
  RETURN_IF_ERROR(config::ValidateJobSpec(spec));
  if (validate_only) return std::string();
  if (spec.seed() == 0) spec.set_seed(1);
  if (spec.consistency().model() == v1::ConsistencySpec::MODEL_UNSPECIFIED) {
    spec.mutable_consistency()->set_model(v1::ConsistencySpec::BSP);
  }
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
  if (!owner.empty() && options_.max_active_jobs_per_user > 0) {
    uint32_t active = 0;
    for (const auto& [_, other] : jobs_) {
      active += other.job.owner() == owner && !config::JobEnded(other.job.status().state());
    }
    if (active >= options_.max_active_jobs_per_user) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "user '", owner, "' has ", active, " jobs pending or running; the limit is ",
          options_.max_active_jobs_per_user, " (--max_active_jobs_per_user): cancel one or wait for one to end"));
    }
  }
  JobRecord r;
  const std::string id = absl::StrCat(spec.name(), "-", next_job_++);
  SaveMetaLocked();
  r.job.set_id(id);
  r.job.set_owner(owner);
  *r.job.mutable_spec() = spec;
  r.job.mutable_status()->set_create_time_unix_ms(NowMs());
  r.ranks.resize(spec.num_workers());
  for (uint32_t i = 0; i < spec.num_workers(); ++i) {
    v1::WorkerProgress* w = r.job.mutable_status()->add_workers();
    w->set_rank(i);
    w->set_state("pending");
  }
  SetStateLocked(r, v1::PENDING, "Created", "JobCreated", "accepted; waiting for servers and workers");
  auto [it, inserted] = jobs_.emplace(id, std::move(r));
  SaveJobLocked(it->second, true);
  if (!store_->Saved(kJobPrefix + id) || !store_->Saved(kMetaKey)) {
    // Its key stays unsaved: the repair deletes whatever part reached the
    // disk. The id is not given again (next_job_ moved on).
    jobs_.erase(it);
    return store_->Unavailable("the job was not submitted");
  }
  kick_ = true;
  FLOG(INFO) << "job " << id << " submitted: "
             << (spec.user_workers() ? std::string("user processes as workers")
                                     : absl::StrCat("model ", spec.model().type()))
             << ", " << spec.num_workers() << " workers, " << spec.epochs() << " epochs, "
             << v1::ConsistencySpec::Model_Name(spec.consistency().model());
  return id;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return coordinator_internal::NoJobError(job_id);
  return it->second.job;
}

absl::StatusOr<Coordinator::JobPage> Coordinator::ListJobs(
    int page_size, const std::string& page_token, const std::function<bool(const v1::Job&)>& visible) const {
  if (page_size < 0 || page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: ", page_size, " must be 0 to ", kMaxPageSize, " (0 means ", kDefaultPageSize, ")"));
  }
  const size_t limit = page_size == 0 ? kDefaultPageSize : static_cast<size_t>(page_size);
  // The token is the serial number of the last job of the previous page: a
  // job forgotten meanwhile (ttl_seconds_after_finished) breaks nothing.
  uint64_t after = 0;
  if (!page_token.empty() &&
      (!absl::StartsWith(page_token, "after-") || !absl::SimpleAtoi(page_token.substr(6), &after))) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token: '", page_token.substr(0, 64), "' is not a next_page_token this coordinator gave"));
  }
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, const JobRecord*>> rs;
  for (const auto& [id, r] : jobs_) {
    const uint64_t serial = Serial(id);
    if (serial > after) rs.emplace_back(serial, &r);
  }
  std::sort(rs.begin(), rs.end());
  JobPage page;
  uint64_t last = 0;
  for (const auto& [serial, r] : rs) {
    if (!visible(r->job)) continue;
    if (page.jobs.size() == limit) {
      page.next_page_token = absl::StrCat("after-", last);
      break;
    }
    page.jobs.push_back(r->job);
    last = serial;
  }
  return page;
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return coordinator_internal::NoJobError(job_id);
  JobRecord& r = it->second;
  if (config::JobEnded(r.job.status().state())) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' already ended: ",
                                                      v1::JobState_Name(r.job.status().state())));
  }
  auto cancel = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FinishLocked(r, v1::CANCELLED, "JobCancelled", "cancelled by request");
  };
  RETURN_IF_ERROR(ChangeJobLocked(r, absl::StrCat("job '", job_id, "' was not cancelled"), cancel));
  FLOG(INFO) << "job " << job_id << " cancelled";
  return r.job;
}

void Coordinator::SetStateLocked(JobRecord& r, v1::JobState state, const std::string& type,
                                 const std::string& reason, const std::string& message) {
  v1::JobStatus* st = r.job.mutable_status();
  st->set_state(state);
  st->set_reason(reason);
  st->set_message(message);
  v1::JobCondition* c = st->add_conditions();
  c->set_type(type);
  c->set_reason(reason);
  c->set_message(message);
  c->set_time_unix_ms(NowMs());
}

void Coordinator::FinishLocked(JobRecord& r, v1::JobState state, const std::string& reason,
                               const std::string& message) {
  static const std::map<v1::JobState, std::string> kType = {
      {v1::SUCCEEDED, "Succeeded"}, {v1::FAILED, "Failed"}, {v1::CANCELLED, "Cancelled"}};
  SetStateLocked(r, state, kType.at(state), reason, message);
  r.final_cut_pending = false;
  v1::JobStatus* st = r.job.mutable_status();
  st->set_end_time_unix_ms(NowMs());
  st->set_eta_seconds(0);
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    v1::WorkerProgress* w = st->mutable_workers(static_cast<int>(i));
    if (w->state() != "finished" && w->state() != "failed") w->set_state(state == v1::CANCELLED ? "cancelled" : "stopped");
    r.ranks[i].node_id.clear();
  }
  RecomputeLocked(r);
  r.release_pending = true;
  SaveJobLocked(r, true);
  BumpGenerationLocked();
}

void Coordinator::RecomputeLocked(JobRecord& r) {
  v1::JobStatus* st = r.job.mutable_status();
  uint64_t min_step = UINT64_MAX;
  uint32_t min_epoch = UINT32_MAX;
  double loss = 0, acc = 0, sps = 0;
  double prog_auc = 0, prog_loss = 0;
  uint64_t prog_examples = 0;
  int n = 0;
  uint32_t active = 0, succeeded = 0, failed = 0;
  for (const v1::WorkerProgress& w : st->workers()) {
    min_step = std::min<uint64_t>(min_step, w.step());
    min_epoch = std::min(min_epoch, w.epoch());
    if (w.state() == "finished") ++succeeded;
    else if (w.state() == "failed") ++failed;
    else if (!r.ranks.empty() && w.rank() < r.ranks.size() && !r.ranks[w.rank()].node_id.empty()) ++active;
    // Ranks that just (re)started have no figures yet: averaging their
    // zeros in would halve the job's accuracy after every rollback.
    if ((w.state() == "training" || w.state() == "evaluating") && w.has_metrics()) {
      loss += w.loss();
      acc += w.train_accuracy();
      sps += w.samples_per_second();
      ++n;
    }
    // Progressive validation: every rank's latest window, weighted by its
    // examples (a finished rank's last one too).
    if (w.progressive_examples() > 0) {
      const double weight = static_cast<double>(w.progressive_examples());
      prog_auc += weight * w.progressive_auc();
      prog_loss += weight * w.progressive_log_loss();
      prog_examples += w.progressive_examples();
    }
  }
  if (prog_examples > 0) {
    st->set_progressive_auc(prog_auc / static_cast<double>(prog_examples));
    st->set_progressive_log_loss(prog_loss / static_cast<double>(prog_examples));
    st->set_progressive_examples(prog_examples);
  }
  if (min_step != UINT64_MAX) st->set_step(min_step);
  if (min_epoch != UINT32_MAX) st->set_epoch(min_epoch);
  if (n > 0) {
    st->set_loss(loss / n);
    st->set_train_accuracy(acc / n);
    st->set_samples_per_second(sps);
    const double steps_per_second = sps / std::max(1u, r.job.spec().num_workers()) / std::max(1u, std::max(r.job.spec().batch_size(), st->batch_size()));
    if (steps_per_second > 0 && st->total_steps() > st->step()) {
      st->set_eta_seconds(static_cast<double>(st->total_steps() - st->step()) / steps_per_second);
    }
  } else if (!config::JobEnded(st->state()) && succeeded < static_cast<uint32_t>(st->workers_size())) {
    // Nothing trains (restoring, waiting for a worker or a server): no
    // speed and no ETA rather than the last ones. A job whose ranks all
    // finished, or that ended, keeps its last figures.
    st->set_samples_per_second(0);
    st->set_eta_seconds(0);
  }
  st->set_active_workers(active);
  st->set_succeeded_workers(succeeded);
  st->set_failed_workers(failed);
}

}  // namespace fulcrum
