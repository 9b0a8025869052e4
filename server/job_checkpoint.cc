// Job: checkpoint capture at a step boundary, and restore.
#include "server/job.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/status_macros.h"

namespace fulcrum {


absl::StatusOr<JobState> Job::Capture(uint64_t at_step, absl::Time deadline, const std::string& cold_cut_dir) {
  JobState state;
  const bool bsp = model_ == Model::kBsp;
  {
    absl::MutexLock lock(&mu_);
    if (bsp) {
      if (applied_step_ > at_step) {
        return absl::FailedPreconditionError(absl::StrCat("job '", id(), "': a cut at step ", at_step,
                                                          " is too late, step ", applied_step_ - 1,
                                                          " is already applied on this server"));
      }
      holds_.insert(at_step);
      auto reached = [this, at_step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return shut_down_ || (applied_step_ == at_step && !applying_);
      };
      const bool ok = mu_.AwaitWithDeadline(absl::Condition(&reached), deadline);
      if (!ok || shut_down_) {
        holds_.erase(holds_.find(at_step));
        if (shut_down_) return shutdown_reason_;
        return absl::DeadlineExceededError(absl::StrCat("job '", id(), "': a cut at step ", at_step,
                                                        " timed out with step ", applied_step_,
                                                        " next to apply (", WaitReasonLocked(applied_step_), ")"));
      }
      applying_ = true;  // nothing applies while the state is taken
      state.held = true;
      state.held_step = at_step;
    }
    state.paused = absl::Now();
    state.step = bsp ? applied_step_ : MinClockLocked();
  }
  v1::GetJobResponse stats = Stats();
  state.rank_clock.assign(stats.rank_clock().begin(), stats.rank_clock().end());
  std::vector<std::string> names;
  for (const auto& [name, t] : tables_) names.push_back(name);
  std::sort(names.begin(), names.end());
  // The tables that spill: their shards' marks, then one cut of the tier
  // (hard links, after a flush), which their records link to.
  std::map<std::string, std::vector<uint64_t>> marks;
  if (cold_tier_ != nullptr && !cold_cut_dir.empty()) {
    for (const std::string& name : names) {
      const Table* t = tables_.at(name).get();
      if (!t->is_dense() && static_cast<const SparseTable*>(t)->spills()) {
        marks[name] = static_cast<const SparseTable*>(t)->MoveMarks();
      }
    }
    std::error_code ec;
    if (!marks.empty() && std::filesystem::exists(cold_cut_dir, ec)) {
      FLOG(WARNING) << "job '" << id() << "': " << cold_cut_dir << " is already there; the cut copies its rows on disk";
      marks.clear();
    } else if (!marks.empty()) {
      const absl::Time t0 = absl::Now();
      if (absl::Status s = cold_tier_->Checkpoint(cold_cut_dir); !s.ok()) {
        FLOG(WARNING) << "job '" << id() << "': " << s << "; the cut copies its rows on disk";
        marks.clear();
        std::filesystem::remove_all(cold_cut_dir, ec);
      } else {
        state.cold_cut_dir = cold_cut_dir;
        FLOG(INFO) << "job '" << id() << "': cold tier cut into " << cold_cut_dir << " in "
                   << absl::ToDoubleSeconds(absl::Now() - t0) << " s";
      }
    }
  }
  uint64_t copied = 0;
  bool streamed = false;
  for (const std::string& name : names) {
    const Table* t = tables_.at(name).get();
    if (t->is_dense()) {
      const auto* d = static_cast<const DenseTable*>(t);
      state.dense.push_back({d, d->Capture()});
      continue;
    }
    const auto* s = static_cast<const SparseTable*>(t);
    JobState::Sparse& sparse = state.sparse.emplace_back();
    sparse.table = s;
    if (auto m = marks.find(name); m != marks.end()) sparse.marks = std::move(m->second);
    const std::vector<uint64_t>* linked = sparse.marks.empty() ? nullptr : &sparse.marks;
    // A capped table was given a memory bound: its cut is never a second
    // copy of it. Others are copied when the copy fits the quota twice (so
    // rows made while it is written still have room); it is held once.
    const uint64_t bytes = s->CaptureBytes();
    if (!s->capped() && quota_.Reserve(2 * bytes, "a checkpoint's copy").ok()) {
      quota_.Release(bytes);
      copied += bytes;
      sparse.shards = s->Capture(linked);
    } else {
      sparse.stream = s->CapturedShards();
      streamed = true;
    }
  }
  if (copied != 0) state.copies = PoolHold(std::shared_ptr<MemoryQuota>(shared_from_this(), &quota_), copied);
  if (bsp && streamed) return state;  // held until EndCapture
  if (!bsp) state.pause_seconds = absl::ToDoubleSeconds(absl::Now() - state.paused);
  RETURN_IF_ERROR(EndCapture(&state));
  return state;
}

absl::Status Job::EndCapture(JobState* state) {
  if (!state->held) return absl::OkStatus();
  state->held = false;
  std::vector<std::function<void(absl::Status)>> ready;
  bool drain;
  {
    absl::MutexLock lock(&mu_);
    applying_ = false;
    holds_.erase(holds_.find(state->held_step));
    drain = StepCompleteLocked(applied_step_);
  }
  state->pause_seconds = absl::ToDoubleSeconds(absl::Now() - state->paused);
  // Steps that completed meanwhile apply now.
  return Resume(drain, &ready);
}

absl::Status Job::RestoreDense(const std::string& table, uint32_t chunk, uint64_t updates, uint32_t length,
                               uint32_t slots, const void* block) {
  absl::StatusOr<Table*> t = FindTable(table, /*dense=*/true);
  if (!t.ok()) return absl::DataLossError(absl::StrCat("checkpoint record for job '", id(), "': ", t.status().message()));
  return static_cast<DenseTable*>(*t)->Restore(chunk, updates, length, slots, block);
}

absl::Status Job::RestoreSparse(const std::string& table, uint32_t vshard, uint32_t dim, uint32_t slots, size_t n,
                                const uint64_t* keys, const uint32_t* updates, const float* rows, uint64_t step,
                                const SparseShardLife* life) {
  absl::StatusOr<Table*> t = FindTable(table, /*dense=*/false);
  if (!t.ok()) return absl::DataLossError(absl::StrCat("checkpoint record for job '", id(), "': ", t.status().message()));
  return static_cast<SparseTable*>(*t)->Restore(vshard, dim, slots, n, keys, updates, rows, step, life);
}

absl::Status Job::RestoreClocks(uint64_t step, const std::vector<uint64_t>& rank_clock) {
  if (rank_clock.size() != num_workers_) {
    return absl::InvalidArgumentError(absl::StrCat("job '", id(), "': a checkpoint with ", rank_clock.size(),
                                                   " ranks restored into a job of ", num_workers_, " workers"));
  }
  absl::MutexLock lock(&mu_);
  steps_.clear();
  for (auto& d : done_ahead_) d.clear();
  if (model_ == Model::kBsp) {
    applied_step_ = step;
  } else {
    clock_ = rank_clock;
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
