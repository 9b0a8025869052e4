// The Coordinator's checkpoints: cuts, rollbacks and restores, exports, and
// the calls to servers the scheduler runs in the background.
#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/config/job_spec.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/coordinator/coordinator_internal.h"
#include "server/coordinator/cut_schedule.h"

namespace fulcrum {

using coordinator_internal::kInstallingShardMap;
using coordinator_internal::kJobPrefix;
using coordinator_internal::RollingBack;

// ---------------------------------------------------------------- checkpoints

namespace {

// What a rollback to cut `cut_id` does, in messages (cut 0: the job's start).
std::string RestoreWhat(uint64_t cut_id) {
  return cut_id == 0 ? std::string("starting again from step 0") : absl::StrCat("restoring checkpoint ", cut_id);
}

}  // namespace

void Coordinator::SucceedLocked(JobRecord& r, const std::string& note) {
  const v1::JobStatus& s = r.job.status();
  // The figure users of the task read: AUC for binary labels, RMSE for
  // real ones, accuracy for classes.
  const std::string figure = s.test_auc() > 0 ? absl::StrCat("test AUC ", s.test_auc())
                             : s.test_rmse() > 0 && s.test_accuracy() == 0
                                 ? absl::StrCat("test RMSE ", s.test_rmse())
                                 : absl::StrCat("test accuracy ", s.test_accuracy());
  FinishLocked(r, v1::SUCCEEDED, "JobSucceeded", absl::StrCat("all ", r.ranks.size(), " ranks finished; ", figure, note));
  FLOG(INFO) << "job " << r.job.id() << " succeeded: " << figure << ", " << s.step() << " steps per rank" << note;
}

bool Coordinator::CountFailureLocked(JobRecord& r, const std::string& message) {
  v1::JobStatus* st = r.job.mutable_status();
  st->set_restarts(st->restarts() + 1);
  ++reassignments_;
  // Progress since the last failure starts the count again.
  if (st->failures_in_a_row() > 0 && st->step() > st->step_at_last_failure()) st->set_failures_in_a_row(0);
  st->set_failures_in_a_row(st->failures_in_a_row() + 1);
  st->set_step_at_last_failure(std::max(st->step_at_last_failure(), st->step()));
  const uint32_t limit =
      r.job.spec().run_policy().backoff_limit() == 0 ? 6 : r.job.spec().run_policy().backoff_limit();
  if (st->failures_in_a_row() <= limit) return false;
  FinishLocked(r, v1::FAILED, "BackoffLimitExceeded",
               absl::StrCat(message, "; ", st->failures_in_a_row(), " failures in a row without progress (stuck at "
                            "step ", st->step_at_last_failure(), ") exceed the backoff limit of ", limit));
  return true;
}

bool Coordinator::BeginRollbackLocked(JobRecord& r, uint64_t cut_id, const std::string& reason,
                                      const std::string& message, bool counts_as_restart, bool or_start) {
  v1::JobStatus* st = r.job.mutable_status();
  const v1::CheckpointInfo* cut = FindCut(*st, cut_id);
  // No cut committed yet: back to the start, when the caller allows it.
  const bool to_start = cut == nullptr && or_start && cut_id == 0 && st->checkpoints_size() == 0;
  if (cut == nullptr && !to_start) return false;
  const uint64_t id = to_start ? 0 : cut->cut_id(), step = to_start ? 0 : cut->step();
  if (counts_as_restart && CountFailureLocked(r, message)) return true;
  st->set_restoring_cut(id);
  st->set_restarting(to_start);
  st->set_rollbacks(st->rollbacks() + 1);
  st->set_end_time_unix_ms(0);
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    r.ranks[i].node_id.clear();
    r.ranks[i].finished = false;
    st->mutable_workers(static_cast<int>(i))->set_state("restoring");
  }
  r.final_cut_pending = false;
  checkpoints_.RollbackBegan(r.job.id(), Now());
  if (r.started == absl::InfinitePast()) r.started = Now();
  const std::string where = to_start ? std::string("starting again from step 0 (no checkpoint committed yet)")
                                     : absl::StrCat("rolling back to checkpoint ", id, " (step ", step, ")");
  SetStateLocked(r, v1::RUNNING, "Restarting", reason, absl::StrCat(message, "; ", where));
  RecomputeLocked(r);
  SaveJobLocked(r, true);
  BumpGenerationLocked();
  FLOG(WARNING) << "job " << r.job.id() << ": " << message << "; " << where;
  return true;
}

void Coordinator::ScheduleCheckpointsLocked() {
  if (shard_maps_.version() == 0 || shutdown_) return;
  const std::vector<std::string> live = LiveServersLocked();
  const std::set<std::string> live_set(live.begin(), live.end());
  // A restore waits for the map to list exactly the live servers (it may
  // land on another number of servers); a cut needs only the map's own
  // servers live and holding it: a server that joins while jobs run is
  // listed once none does, and holds up none of their cuts meanwhile.
  const bool map_ready = shard_maps_.HeldBy(live);
  const bool cut_ready = shard_maps_.HeldByItsServers(live);
  const absl::Time now = Now();
  for (auto& [jid, r] : jobs_) {
    if (r.job.status().state() == v1::RUNNING && RollingBack(r.job.status())) {
      MaybeStartRestoreLocked(jid, r, live_set, map_ready, now);
    } else if (cut_ready && !checkpoints_.CutInFlight(jid)) {
      MaybeStartCutLocked(jid, r, now);
    }
  }
}

void Coordinator::MaybeStartRestoreLocked(const std::string& jid, JobRecord& r, const std::set<std::string>& live,
                                          bool map_ready, absl::Time now) {
  const CheckpointManager::Book book = checkpoints_.Of(jid);
  if (book.restore_in_flight || r.release_pending) return;
  v1::JobStatus* st = r.job.mutable_status();
  // Starting again from step 0: cut 0, which no server reads.
  v1::CheckpointInfo start;
  const v1::CheckpointInfo* cut = st->restarting() ? &start : FindCut(*st, st->restoring_cut());
  if (cut == nullptr) {
    FinishLocked(r, v1::FAILED, "CheckpointLost",
                 absl::StrCat("checkpoint ", st->restoring_cut(), " is no longer recorded"));
    return;
  }
  // Restore once every server holding the cut is back and the map is in place.
  std::vector<std::string> missing;
  for (const std::string& s : cut->servers()) {
    if (!live.count(s)) missing.push_back(s);
  }
  if (!missing.empty() || !map_ready) {
    const std::string what = RestoreWhat(cut->cut_id());
    if (now - book.restore_since > options_.restore_timeout) {
      const std::string after = absl::FormatDuration(options_.restore_timeout);
      if (missing.empty()) {
        FinishLocked(r, v1::FAILED, "RestoreFailed",
                     absl::StrCat(what, ": the live servers did not take the shard map within ", after));
      } else {
        FinishLocked(r, v1::FAILED, "ServerLost",
                     absl::StrCat("checkpoint ", cut->cut_id(), " has parts on ", absl::StrJoin(missing, ", "),
                                  ", not back after ", after));
      }
      return;
    }
    const std::string why =
        missing.empty() ? absl::StrCat("installing the shard map before ", what)
                        : absl::StrCat("waiting for ", absl::StrJoin(missing, ", "),
                                       " to come back: it holds part of checkpoint ", cut->cut_id());
    if (st->message() != why) {
      st->set_message(why);
      SaveJobLocked(r, false);
    }
    return;
  }
  RestoreTask t;
  t.job_id = jid;
  t.cut = *cut;
  t.targets = shard_maps_.servers();
  for (const RankSlot& s : r.ranks) t.min_incarnation = std::max(t.min_incarnation, s.incarnation);
  ++t.min_incarnation;
  checkpoints_.SetRestoreInFlight(jid, true);
  if (st->restarting()) {
    FLOG(INFO) << "job " << jid << ": starting again from step 0 on " << absl::StrJoin(t.targets, ", ");
  } else {
    FLOG(INFO) << "job " << jid << ": restoring checkpoint " << cut->cut_id() << " (step " << cut->step()
               << ", written by " << absl::StrJoin(cut->servers(), ", ") << ") onto "
               << absl::StrJoin(t.targets, ", ");
  }
  Spawn([this, t = std::move(t)]() mutable { RunRestore(std::move(t)); });
}

void Coordinator::MaybeStartCutLocked(const std::string& jid, JobRecord& r, absl::Time now) {
  v1::JobStatus* st = r.job.mutable_status();
  if (st->state() != v1::RUNNING || r.ranks.empty()) return;
  cut_schedule::JobView view;
  view.spec = &r.job.spec();
  view.status = st;
  view.final_pending = r.final_cut_pending;
  checkpoints_.FillView(jid, &view);
  view.now = now;
  view.started = r.started;
  const cut_schedule::Due due = cut_schedule::NextCut(view);
  if (due.kind == cut_schedule::Due::Kind::kSucceed) {
    SucceedLocked(r, "");
    return;
  }
  if (due.kind != cut_schedule::Due::Kind::kCut) return;
  checkpoints_.SetBoundaryAsked(jid, due.steps_boundary_asked);
  const v1::JobSpec& spec = r.job.spec();
  CutTask t;
  t.trigger = due.trigger;
  t.at_step = due.at_step;
  if (due.trigger == "manual") t.manual_ticket = checkpoints_.Of(jid).manual_requested;
  const uint64_t spe = due.steps_per_epoch;
  // No cut while state cannot be saved: a cut id is never used twice.
  if (!store_->AllSaved()) return;
  t.job_id = jid;
  t.cut_id = st->next_cut_id() == 0 ? 1 : st->next_cut_id();
  st->set_next_cut_id(t.cut_id + 1);
  t.servers = shard_maps_.servers();
  t.map_version = shard_maps_.version();
  t.steps_per_epoch = spe;
  t.spec = spec;
  t.rollbacks = st->rollbacks();
  SaveJobLocked(r, true);
  if (!store_->Saved(kJobPrefix + jid)) return;
  checkpoints_.CutStarted(jid);
  Spawn([this, t = std::move(t)]() mutable { RunCut(std::move(t)); });
}

void Coordinator::RunCut(CutTask t) {
  const absl::Time t0 = Now();
  absl::StatusOr<std::vector<v1::ShardCutMeta>> metas = checkpoints_.TakeCut(t);
  absl::Status failed = metas.status();
  CutList to_delete;
  std::set<uint64_t> kept;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(t.job_id);
    if (it == jobs_.end()) {
      to_delete.emplace_back(t.cut_id, t.servers);
    } else {
      JobRecord& r = it->second;
      v1::JobStatus* st = r.job.mutable_status();
      const bool current = st->state() == v1::RUNNING && !RollingBack(*st) &&
                           (t.trigger != "final" || r.final_cut_pending);
      if (failed.ok() && !current) failed = absl::AbortedError("the job changed state while the cut was taken");
      // Parts captured on both sides of a rollback would mix two histories
      // of the job: a cut commits only if no rollback began while it ran.
      if (failed.ok() && st->rollbacks() != t.rollbacks) {
        failed = absl::AbortedError("the job rolled back while the cut was taken");
      }
      if (failed.ok() && shard_maps_.version() != t.map_version) {
        failed = absl::AbortedError("the shard map changed while the cut was taken");
      }
      const bool too_late = failed.code() == absl::StatusCode::kFailedPrecondition &&
                            absl::StrContains(failed.message(), "too late");
      // A manual cut answers the requests made before it; the final cut
      // answers every one still waiting.
      const uint64_t answers = t.trigger == "final" ? checkpoints_.Of(t.job_id).manual_requested : t.manual_ticket;
      if (failed.ok()) {
        const v1::CheckpointInfo info = checkpoints_.Committed(t, *metas);
        kept = CommitCutLocked(info, r, &to_delete);
        checkpoints_.CutEnded(t, CheckpointManager::Outcome::kCommitted, info, answers);
        FLOG(INFO) << "job " << t.job_id << ": checkpoint " << t.cut_id << " committed (" << t.trigger << ", step "
                   << info.step() << ", " << info.bytes() << " bytes on " << t.servers.size() << " servers, pause "
                   << info.pause_seconds() << " s, " << absl::FormatDuration(Now() - t0) << " in all)";
      } else if (too_late) {
        // The step went by before a server was asked: ask again at once,
        // further ahead (a manual request stays pending).
        const uint64_t lead = checkpoints_.CutEnded(t, CheckpointManager::Outcome::kTooLate, failed, answers);
        to_delete.emplace_back(t.cut_id, t.servers);
        FLOG(INFO) << "job " << t.job_id << ": checkpoint " << t.cut_id << " at step " << t.at_step
                   << " came too late; asking again " << lead << " steps further ahead";
      } else {
        st->set_last_checkpoint_error(absl::StrCat("checkpoint ", t.cut_id, ": ", failed.message()));
        checkpoints_.CutEnded(t, CheckpointManager::Outcome::kFailed, failed, answers);
        SaveJobLocked(r, false);
        to_delete.emplace_back(t.cut_id, t.servers);
        FLOG(WARNING) << "job " << t.job_id << ": checkpoint " << t.cut_id << " (" << t.trigger << ") failed: " << failed;
      }
      if (t.trigger == "final" && r.final_cut_pending && st->state() == v1::RUNNING && !RollingBack(*st)) {
        SucceedLocked(r, failed.ok() ? absl::StrCat("; final checkpoint ", t.cut_id)
                                     : absl::StrCat("; no final checkpoint (", failed.message(), ")"));
      }
      // Its waiters learn the answer (a cut that came too late saves nothing).
      WakeJobLocked(t.job_id);
    }
  }
  checkpoints_.DeleteCuts(t.job_id, to_delete);
  if (!failed.ok()) return;
  if (t.trigger == "final") return;  // the job's tables are being released
  // Parts of cuts this coordinator never committed (it stopped mid-cut, or
  // a server failed one) go once a later cut commits.
  checkpoints_.DeleteStrayCuts(t, kept);
}

std::set<uint64_t> Coordinator::CommitCutLocked(const v1::CheckpointInfo& info, JobRecord& r, CutList* to_delete) {
  v1::JobStatus* st = r.job.mutable_status();
  std::set<uint64_t> kept = CheckpointManager::Record(info, r.job.spec().checkpoint().keep(), st, to_delete);
  st->clear_last_checkpoint_error();
  SaveJobLocked(r, true);
  return kept;
}

void Coordinator::RunRestore(RestoreTask t) {
  const absl::Time t0 = Now();
  const absl::Status failed = checkpoints_.Restore(t);
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(t.job_id);
  if (it == jobs_.end()) return;
  JobRecord& r = it->second;
  checkpoints_.SetRestoreInFlight(t.job_id, false);
  v1::JobStatus* st = r.job.mutable_status();
  const bool to_start = t.cut.cut_id() == 0;
  // Superseded: the job ended, or rolls back elsewhere now.
  if (st->state() != v1::RUNNING || !RollingBack(*st) || st->restoring_cut() != t.cut.cut_id()) return;
  const std::string what = RestoreWhat(t.cut.cut_id());
  if (!failed.ok()) {
    st->set_last_checkpoint_error(absl::StrCat(what, ": ", failed.message()));
    FLOG(WARNING) << "job " << t.job_id << ": " << what << " failed: " << failed;
    if (!to_start &&
        (failed.code() == absl::StatusCode::kNotFound || failed.code() == absl::StatusCode::kDataLoss)) {
      // That cut is gone or damaged: fall back to the one before it.
      auto* cps = st->mutable_checkpoints();
      for (int i = 0; i < cps->size(); ++i) {
        if (cps->Get(i).cut_id() == t.cut.cut_id()) {
          cps->DeleteSubrange(i, 1);
          break;
        }
      }
      if (cps->empty()) {
        FinishLocked(r, v1::FAILED, "CheckpointLost",
                     absl::StrCat("no usable checkpoint left: ", failed.message()));
        return;
      }
      st->set_restoring_cut(cps->rbegin()->cut_id());
    } else if (Now() - checkpoints_.Of(t.job_id).restore_since > options_.restore_timeout) {
      // Retried at every tick until then; a failure that persists (a server
      // that cannot hold the job, a source that never answers) must end the
      // job with its cause, not leave it restoring for ever.
      FinishLocked(r, v1::FAILED, "RestoreFailed",
                   absl::StrCat(what, " still failed after ",
                                absl::FormatDuration(options_.restore_timeout), ": ", failed.message()));
      return;
    }
    SaveJobLocked(r, true);
    return;
  }
  // Every server holds the cut: the ranks start again from it, as new
  // incarnations (the servers refuse the old ones).
  st->set_restoring_cut(0);
  st->set_restarting(false);
  uint32_t min_epoch = to_start ? 0 : UINT32_MAX;
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    r.ranks[i].node_id.clear();
    r.ranks[i].finished = false;
    r.ranks[i].incarnation = t.min_incarnation - 1;  // the reassignment bumps it to min_incarnation
    v1::WorkerProgress* w = st->mutable_workers(static_cast<int>(i));
    w->set_state("restored");
    if (to_start) {
      w->set_step(0);
      w->set_epoch(0);
    } else if (i < static_cast<size_t>(t.cut.positions_size())) {
      w->set_step(t.cut.positions(static_cast<int>(i)).step());
      w->set_epoch(t.cut.positions(static_cast<int>(i)).epoch());
      min_epoch = std::min(min_epoch, w->epoch());
    }
  }
  // Epochs from the cut's on will be trained (and reported) again.
  auto* epochs = st->mutable_epochs();
  for (int i = epochs->size() - 1; i >= 0; --i) {
    if (epochs->Get(i).epoch() >= min_epoch) {
      epochs->DeleteSubrange(i, 1);
    }
  }
  st->clear_weights_fingerprint();
  const std::string done =
      to_start ? absl::StrCat("started again from step 0 on ", t.targets.size(), " servers in ",
                              absl::FormatDuration(Now() - t0), "; workers begin anew")
               : absl::StrCat("restored checkpoint ", t.cut.cut_id(), " (step ", t.cut.step(), ") onto ",
                              t.targets.size(), " servers in ", absl::FormatDuration(Now() - t0),
                              "; workers resume there");
  SetStateLocked(r, v1::RUNNING, "Running", to_start ? "JobRestarted" : "CheckpointRestored", done);
  RecomputeLocked(r);
  SaveJobLocked(r, true);
  BumpGenerationLocked();
  FLOG(INFO) << "job " << t.job_id << ": " << done;
}

void Coordinator::InstallOnServers(const v1::ShardMap& map, const std::vector<std::string>& servers) {
  const std::vector<absl::Status> results = CallEachServer<absl::Status>(
      servers, [&](const std::string& s) { return servers_->InstallShardMap(s, map); });
  std::vector<bool> took;
  for (const absl::Status& r : results) took.push_back(r.ok());
  absl::MutexLock lock(&mu_);
  if (!shard_maps_.EndInstall(map.version(), servers, took)) return;  // replaced meanwhile
  for (size_t i = 0; i < servers.size(); ++i) {
    NoteRetriedCallLocked("install_shard_map", kInstallingShardMap, servers[i], results[i]);
    if (results[i].ok()) kick_ = true;  // pending jobs may start now (failures wait for the next tick)
  }
}

void Coordinator::NoteRetriedCallLocked(const char* call, const std::string& what, const std::string& server,
                                        const absl::Status& s) {
  const auto key = std::make_pair(what, server);
  auto it = failing_calls_.find(key);
  const absl::Time now = Now();
  if (s.ok()) {
    if (it != failing_calls_.end()) {
      FLOG(INFO) << what << " on " << server << " worked after " << it->second.failures << " failed tries over "
                 << absl::FormatDuration(absl::Trunc(now - it->second.first_failure, absl::Milliseconds(1)));
      failing_calls_.erase(it);
    }
    return;
  }
  ++call_failures_[call];
  RetriedCall& f = failing_calls_[key];
  if (f.failures++ == 0) f.first_failure = now;
  f.last_failure = now;
  f.error = s.ToString();
  if (f.failures == 1 || now - f.last_logged >= absl::Minutes(1)) {
    FLOG(WARNING) << what << " on " << server << " failed: " << f.error << " (" << f.failures
                  << (f.failures == 1 ? " failure" : " failures in a row")
                  << "; retried every tick, logged once a minute)";
    f.last_logged = now;
  }
}

void Coordinator::ReleaseOnServers(const std::string& job_id, const std::vector<std::string>& servers) {
  const std::vector<absl::Status> results = CallEachServer<absl::Status>(
      servers, [&](const std::string& s) { return servers_->DeleteJob(s, job_id); });
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  it->second.release_in_flight = false;
  bool all = true;
  for (size_t i = 0; i < servers.size(); ++i) {
    NoteRetriedCallLocked("delete_job", absl::StrCat("releasing job ", job_id), servers[i], results[i]);
    all = all && results[i].ok();
  }
  if (all && it->second.release_pending) {
    it->second.release_pending = false;
    FLOG(INFO) << "job " << job_id << " released: tables dropped on every server";
  }
}

uint64_t Coordinator::CheckpointJobAsync(const std::string& job_id, absl::Duration timeout,
                                         CheckpointCallback done) {
  absl::MutexLock lock(&mu_);
  auto at_once = [&](absl::Status refused) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return polls_.Park(PollKind::kCheckpoint, job_id, true, absl::InfinitePast(),
                      [refused, done = std::move(done)]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                        return std::function<void()>([done, refused] { done(refused); });
                      });
  };
  if (shutdown_) return at_once(absl::UnavailableError("coordinator is shutting down"));
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return at_once(coordinator_internal::NoJobError(job_id));
  const v1::JobStatus& st = it->second.job.status();
  if (st.state() != v1::RUNNING) {
    return at_once(absl::FailedPreconditionError(
        absl::StrCat("job '", job_id, "' is ", v1::JobState_Name(st.state()),
                     "; only a running job can be checkpointed (its checkpoints: ", CutIds(st), ")")));
  }
  const uint64_t ticket = checkpoints_.RequestManual(job_id);
  kick_ = true;
  // Real time: the waker's, which answers the call at its deadline.
  const absl::Time deadline = absl::Now() + timeout;
  auto answer = [this, job_id, ticket, timeout, deadline, done = std::move(done)]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> std::function<void()> {
    absl::StatusOr<v1::CheckpointInfo> r;
    auto j = jobs_.find(job_id);
    if (shutdown_) {
      r = absl::UnavailableError("coordinator is shutting down");
    } else if (j == jobs_.end()) {
      r = absl::NotFoundError(absl::StrCat("job '", job_id, "' was deleted"));
    } else if (auto answer = checkpoints_.ManualAnswer(job_id, ticket); answer.has_value()) {
      r = *std::move(answer);
    } else if (config::JobEnded(j->second.job.status().state()) && !j->second.final_cut_pending &&
               !checkpoints_.CutInFlight(job_id)) {
      r = absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' ended before the checkpoint was taken"));
    } else if (absl::Now() >= deadline) {
      r = absl::DeadlineExceededError(absl::StrCat(
          "checkpoint of job '", job_id, "' not committed within ", absl::FormatDuration(timeout),
          store_->AllSaved() ? std::string() : absl::StrCat("; ", store_->Trouble(), ", and starts no cut until it can")));
    } else {
      return nullptr;  // not yet
    }
    return [done, r = std::move(r)]() mutable { done(std::move(r)); };
  };
  return polls_.Park(PollKind::kCheckpoint, job_id, false, deadline, std::move(answer));
}

absl::StatusOr<v1::Job> Coordinator::RestoreJob(const std::string& job_id, uint64_t cut_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return coordinator_internal::NoJobError(job_id);
  JobRecord& r = it->second;
  const v1::JobStatus& st = r.job.status();
  if (FindCut(st, cut_id) == nullptr) return NoCutError(job_id, st, cut_id);
  if (st.state() == v1::PENDING) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' has not started"));
  }
  auto restore = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (config::JobEnded(r.job.status().state())) r.started = Now();
    BeginRollbackLocked(r, cut_id, "RestoreRequested", "restore requested", false);
  };
  RETURN_IF_ERROR(ChangeJobLocked(r, absl::StrCat("job '", job_id, "' was not restored"), restore));
  kick_ = true;
  return r.job;
}

absl::Status Coordinator::ExportCheckpoint(const std::string& job_id, uint64_t cut_id,
                                           const std::function<bool(const v1::ExportCheckpointChunk&)>& write) {
  v1::CheckpointInfo info;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return coordinator_internal::NoJobError(job_id);
    const v1::CheckpointInfo* cut = FindCut(it->second.job.status(), cut_id);
    if (cut == nullptr) return NoCutError(job_id, it->second.job.status(), cut_id);
    info = *cut;
  }
  return checkpoints_.Export(job_id, info, write);
}

}  // namespace fulcrum
