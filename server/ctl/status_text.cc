// fulcrumctl's text for people: a job's line in `list`, its status in
// detail, a checkpoint's line.
#include "server/ctl/status_text.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/config/job_spec.h"
#include "common/logging.h"

namespace fulcrum::ctl {

using v1::Job;
using v1::JobState;

std::string State(JobState s) { return fulcrum::v1::JobState_Name(s); }

std::string Duration(double seconds) {
  if (seconds <= 0) return "-";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

Task TaskOf(const Job& j) {
  const v1::ModelSpec& m = j.spec().model();
  const std::string& kind = j.spec().data().train().label_kind();
  if (m.type() == "mf" || kind == "real") return Task::kRegression;
  if (m.type() == "sparse_lr" || m.type() == "fm" || kind == "binary") return Task::kBinary;
  for (const v1::GraphNode& n : m.graph()) {
    if (n.op() != "loss") continue;
    if (n.loss() == "squared_error") return Task::kRegression;
    if (n.loss() == "binary_cross_entropy") return Task::kBinary;
  }
  // A user_workers job has no model here: by the figures its ranks report.
  const auto& s = j.status();
  if (s.test_rmse() > 0 && s.test_accuracy() == 0) return Task::kRegression;
  if (s.test_auc() > 0) return Task::kBinary;
  return Task::kClasses;
}

namespace {

// The training loss as people read it: regression losses are half the
// squared error, shown as the RMSE.
double TrainRmse(double half_mse) { return std::sqrt(std::max(0.0, 2 * half_mse)); }

// An epoch's figures for `status`: "train rmse X, test rmse Y" and so on.
std::string EpochFigures(Task task, const v1::EpochSummary& e) {
  std::string train, test;
  switch (task) {
    case Task::kRegression:
      train = absl::StrFormat("train rmse %.4f", TrainRmse(e.train_loss()));
      test = absl::StrFormat("test rmse %.4f", e.test_rmse());
      break;
    case Task::kBinary:
      train = absl::StrFormat("train auc %.4f log loss %.4f", e.train_auc(), e.train_loss());
      test = absl::StrFormat("test auc %.4f log loss %.4f", e.test_auc(), e.test_loss());
      break;
    case Task::kClasses:
      train = absl::StrFormat("train loss %.4f acc %.4f", e.train_loss(), e.train_accuracy());
      test = absl::StrFormat("test loss %.4f acc %.4f", e.test_loss(), e.test_accuracy());
      break;
  }
  return absl::StrCat(train, ", ", e.tested() ? test : std::string("not tested"));
}

}  // namespace

std::string FinalFigures(const Job& j) {
  const auto& s = j.status();
  switch (TaskOf(j)) {
    case Task::kRegression: return absl::StrFormat("test RMSE %.4f", s.test_rmse());
    case Task::kBinary: return absl::StrFormat("test AUC %.4f, log loss %.4f", s.test_auc(), s.test_loss());
    case Task::kClasses: break;
  }
  return absl::StrFormat("test accuracy %.4f", s.test_accuracy());
}

// " test_acc X" (" test_rmse X" for regression, " test_auc X test_logloss
// Y" for binary tasks) of the last epoch whose test set was evaluated;
// empty before rank 0 evaluated one. The other ranks report an epoch before
// rank 0 has finished evaluating it, so an epoch that exists is not yet an
// epoch with test figures.
std::string TestFigure(const Job& j) {
  const auto& s = j.status();
  const Task task = TaskOf(j);
  for (int i = s.epochs_size() - 1; i >= 0; --i) {
    const auto& e = s.epochs(i);
    if (!e.tested()) continue;
    if (task == Task::kRegression) return absl::StrFormat(" test_rmse %.4f", e.test_rmse());
    if (task == Task::kBinary) return absl::StrFormat(" test_auc %.4f test_logloss %.4f", e.test_auc(), e.test_loss());
    return absl::StrFormat(" test_acc %.4f", e.test_accuracy());
  }
  return "";
}

std::string JobLine(const Job& j) {
  const auto& s = j.status();
  std::string line = absl::StrFormat("%-20s %-9s", j.id(), State(s.state()));
  if (s.state() == fulcrum::v1::RUNNING || fulcrum::config::JobEnded(s.state())) {
    absl::StrAppendFormat(&line, " epoch %u/%u", std::min(s.epoch() + 1, j.spec().epochs()), j.spec().epochs());
    if (s.total_steps() > 0) {  // 0 until a worker has read its data shard
      absl::StrAppendFormat(&line, " step %llu/%llu (%.0f%%)", static_cast<unsigned long long>(s.step()),
                            static_cast<unsigned long long>(s.total_steps()), 100.0 * s.step() / s.total_steps());
    }
    if (s.loss() > 0) {
      switch (TaskOf(j)) {
        case Task::kRegression: absl::StrAppendFormat(&line, " rmse %.4f", TrainRmse(s.loss())); break;
        case Task::kBinary: absl::StrAppendFormat(&line, " logloss %.4f", s.loss()); break;
        case Task::kClasses: absl::StrAppendFormat(&line, " loss %.4f acc %.4f", s.loss(), s.train_accuracy()); break;
      }
    }
    absl::StrAppend(&line, TestFigure(j));
    if (s.progressive_examples() > 0 && TaskOf(j) == Task::kBinary) {
      absl::StrAppendFormat(&line, " prog_auc %.4f prog_logloss %.4f", s.progressive_auc(), s.progressive_log_loss());
    }
    if (s.samples_per_second() > 0 && s.state() == fulcrum::v1::RUNNING) {
      absl::StrAppendFormat(&line, " %.0f samples/s ETA %s", s.samples_per_second(), Duration(s.eta_seconds()));
    }
  }
  // A running job says what it waits for while nothing trains (a rollback
  // waiting for a server, ranks waiting for workers).
  if (!s.message().empty() && (s.state() != fulcrum::v1::RUNNING || s.samples_per_second() == 0)) {
    absl::StrAppend(&line, " - ", s.message());
  }
  return line;
}

std::vector<std::string> WorkerLines(const Job& j) {
  std::vector<std::string> out;
  for (const auto& w : j.status().workers()) {
    if (w.worker_id().empty() && w.step() == 0 && w.epoch() == 0) {
      // Nothing to report until a worker takes the rank; zeros would read as
      // a worker that trains and learns nothing.
      out.push_back(absl::StrFormat("  rank %-3u %-10s %-10s waiting for a worker", w.rank(), "-", w.state()));
      continue;
    }
    if (w.step() == 0 && w.epoch() == 0 && w.samples_per_second() == 0) {  // taken, no step reported yet
      out.push_back(absl::StrFormat("  rank %-3u %-10s %-10s no step yet%s", w.rank(), w.worker_id(), w.state(),
                                    w.incarnation() > 0 ? absl::StrCat(" (replacement ", w.incarnation(), ")") : ""));
      continue;
    }
    out.push_back(absl::StrFormat("  rank %-3u %-10s %-10s epoch %u step %llu loss %.4f acc %.4f %.0f samples/s%s%s",
                                  w.rank(), w.worker_id().empty() ? "-" : w.worker_id(), w.state(), w.epoch() + 1,
                                  static_cast<unsigned long long>(w.step()), w.loss(), w.train_accuracy(),
                                  w.samples_per_second(),
                                  w.learning_rate() > 0 ? absl::StrFormat(" lr %.3g", w.learning_rate()) : "",
                                  w.incarnation() > 0 ? absl::StrCat(" (replacement ", w.incarnation(), ")") : ""));
  }
  return out;
}

// "512", "auto: 2048", "auto (choosing)".
std::string BatchText(const Job& j) {
  // A user_workers job may leave its batch to its processes.
  if (j.spec().user_workers() && j.spec().batch_size() == 0) return "the processes' own";
  if (!j.spec().batch_size_auto().enabled() || j.spec().batch_size() > 0) return absl::StrCat(j.spec().batch_size());
  return j.status().batch_size() > 0 ? absl::StrCat("auto: ", j.status().batch_size()) : "auto (choosing)";
}

// Local steps: "37 of 177 done (16 inner steps each; an epoch ends a
// round)", from the slowest rank's step; empty for other models.
std::string RoundsText(const Job& j) {
  const auto& c = j.spec().consistency();
  const auto& s = j.status();
  if (c.model() != fulcrum::v1::ConsistencySpec::LOCAL || c.sync_every_steps() == 0 || s.total_steps() == 0 ||
      j.spec().epochs() == 0) {
    return "";
  }
  const uint64_t h = c.sync_every_steps(), spe = std::max<uint64_t>(1, s.total_steps() / j.spec().epochs());
  const uint64_t per_epoch = (spe + h - 1) / h;
  const uint64_t done = s.step() / spe * per_epoch + (s.step() % spe) / h;
  return absl::StrCat(done, " of ", per_epoch * j.spec().epochs(), " done (", h,
                      " inner steps each; an epoch ends a round)");
}

// "1.25 GPU-hours (busy 0.98, idle 0.27: 78% busy)".
std::string GpuTimeText(const fulcrum::v1::JobStatus& s) {
  const double busy = s.gpu_busy_seconds() / 3600, idle = s.gpu_idle_seconds() / 3600;
  return absl::StrFormat("%.4g GPU-hours (busy %.4g, idle %.4g: %.0f%% busy)", busy + idle, busy, idle,
                         100 * busy / std::max(1e-12, busy + idle));
}

void PrintStatus(const Job& j) {
  const auto& s = j.status();
  std::cout << "job " << j.id() << "\n"
            << "  state:     " << State(s.state()) << (s.reason().empty() ? "" : " (" + s.reason() + ")") << "\n"
            << "  message:   " << s.message() << "\n"
            << (j.owner().empty() ? "" : "  owner:     " + j.owner() + "\n")
            << "  model:     " << (j.spec().user_workers() ? "the user processes' own" : j.spec().model().type()) << ", " << j.spec().num_workers() << " workers, batch "
            << BatchText(j) << ", " << j.spec().epochs() << " epochs, "
            << fulcrum::v1::ConsistencySpec::Model_Name(j.spec().consistency().model()) << "\n"
            << "  progress:  " << JobLine(j) << "\n";
  if (!s.batch_size_choice().empty()) std::cout << "  batch size: " << s.batch_size_choice() << "\n";
  if (const std::string r = RoundsText(j); !r.empty()) std::cout << "  rounds:    " << r << "\n";
  if (s.gpu_busy_seconds() + s.gpu_idle_seconds() > 0) std::cout << "  GPU time:  " << GpuTimeText(s) << "\n";
  if (s.has_train_data()) std::cout << "  train data: " << fulcrum::config::DataSummaryLine(s.train_data()) << "\n";
  if (s.has_test_data()) std::cout << "  test data:  " << fulcrum::config::DataSummaryLine(s.test_data()) << "\n";
  for (const auto& l : WorkerLines(j)) std::cout << l << "\n";
  const Task task = TaskOf(j);
  for (const auto& e : s.epochs()) {
    std::cout << absl::StrFormat("  epoch %u: %s, %.1fs\n", e.epoch() + 1, EpochFigures(task, e), e.seconds());
  }
  if (!s.weights_fingerprint().empty()) std::cout << "  weights:   fingerprint " << s.weights_fingerprint() << "\n";
  std::cout << "  restarts:  " << s.restarts() << (s.rollbacks() > 0 ? absl::StrCat(", rollbacks: ", s.rollbacks()) : "")
            << "\n";
  for (const auto& t : s.sparse_tables()) std::cout << SparseTableLine(t) << "\n";
  for (const auto& c : s.checkpoints()) std::cout << CheckpointLine(c) << "\n";
  if (!s.last_checkpoint_error().empty()) std::cout << "  last checkpoint error: " << s.last_checkpoint_error() << "\n";
  for (const auto& c : s.conditions()) {
    std::cout << "  " << absl::FormatTime("%H:%M:%S", absl::FromUnixMillis(c.time_unix_ms()), absl::LocalTimeZone())
              << " " << c.type() << " " << c.reason() << ": " << c.message() << "\n";
  }
}

std::string SparseTableLine(const fulcrum::v1::SparseTableStats& t) {
  std::string line = absl::StrCat("  table ", t.table(), ": ", t.rows(), " rows, ", fulcrum::HumanBytes(t.bytes()));
  const uint64_t evicted = t.evicted_cap() + t.evicted_ttl();
  if (t.admitted() + t.rejected() + evicted + t.sketch_bytes() > 0) {
    absl::StrAppend(&line, "; admitted ", t.admitted(), ", rejected ", t.rejected(), ", evicted ", evicted, " (cap ",
                    t.evicted_cap(), ", ttl ", t.evicted_ttl(), ")");
  }
  if (t.sketch_bytes() > 0) absl::StrAppend(&line, "; sketch ", fulcrum::HumanBytes(t.sketch_bytes()));
  if (t.cold_rows() + t.demoted() + t.cold_reads() > 0) {
    absl::StrAppend(&line, "; on disk ", t.cold_rows(), " rows (moved there ", t.demoted(), ", back ", t.promoted(),
                    ", read there ", t.cold_reads(), ", read ahead ", t.prefetched(), ")");
  }
  return line;
}

std::string CheckpointLine(const fulcrum::v1::CheckpointInfo& c) {
  return absl::StrFormat("  checkpoint %llu: step %llu (%s), %s on %d servers, pause %.1f ms, %s",
                         static_cast<unsigned long long>(c.cut_id()), static_cast<unsigned long long>(c.step()),
                         c.trigger(), fulcrum::HumanBytes(c.bytes()), c.servers_size(), c.pause_seconds() * 1e3,
                         absl::FormatTime("%H:%M:%S", absl::FromUnixMillis(c.created_unix_ms()), absl::LocalTimeZone()));
}

}  // namespace fulcrum::ctl
