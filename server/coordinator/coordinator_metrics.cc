// The Coordinator's Prometheus series (docs/metrics.md).
#include "server/coordinator/coordinator.h"

#include <algorithm>

namespace fulcrum {


void Coordinator::CollectMetrics(metrics::Scrape* out) const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  std::map<int, double> by_state;
  for (int st = v1::PENDING; st <= v1::CANCELLED; ++st) by_state[st] = 0;
  for (const auto& [id, r] : jobs_) by_state[r.job.status().state()] += 1;
  for (const auto& [st, n] : by_state) {
    out->Gauge("fulcrum_coordinator_jobs", "Jobs in the registry, by state",
               {{"state", metrics::LabelValue(v1::JobState_Name(static_cast<v1::JobState>(st)))}}, n);
  }
  double live[2][2] = {{0, 0}, {0, 0}};  // [role: server, worker][alive]
  for (const auto& [id, n] : members_.All()) {
    const bool worker = n.info.role() == v1::WORKER;
    const std::string role = worker ? "worker" : "server";
    live[worker ? 1 : 0][n.alive ? 1 : 0] += 1;
    if (!n.alive) continue;
    out->Gauge("fulcrum_coordinator_node_heartbeat_age_seconds", "Seconds since a live node's last heartbeat",
               {{"node", id}, {"role", role}}, absl::ToDoubleSeconds(now - n.last_heard));
  }
  for (int role = 0; role < 2; ++role) {
    for (int alive = 0; alive < 2; ++alive) {
      out->Gauge("fulcrum_coordinator_nodes", "Registered nodes, by role and liveness",
                 {{"role", role ? "worker" : "server"}, {"state", alive ? "live" : "dead"}}, live[role][alive]);
    }
  }
  for (const char* call : {"install_shard_map", "delete_job"}) {
    auto it = call_failures_.find(call);
    out->Counter("fulcrum_coordinator_server_call_failures_total",
                 "Failed calls to parameter servers that the scheduler retries (since this coordinator started)",
                 {{"call", call}}, it == call_failures_.end() ? 0.0 : static_cast<double>(it->second));
  }
  out->Counter("fulcrum_coordinator_store_write_failures_total",
               "Failed writes of the coordinator's state to RocksDB (since this coordinator started)", {},
               static_cast<double>(store_->write_failures()));
  out->Gauge("fulcrum_coordinator_store_unsaved_records",
             "Records (jobs, nodes, the meta record) whose last write failed and is not yet redone", {},
             static_cast<double>(store_->unsaved()));
  const ParkedPolls::Counts polls = polls_.counts();
  const char* help = "Heartbeats, WatchJob streams and CheckpointJob calls waiting for a change, by call";
  out->Gauge("fulcrum_coordinator_long_polls", help, {{"call", "heartbeat"}}, static_cast<double>(polls.heartbeats));
  out->Gauge("fulcrum_coordinator_long_polls", help, {{"call", "watch_job"}}, static_cast<double>(polls.watches));
  out->Gauge("fulcrum_coordinator_long_polls", help, {{"call", "checkpoint_job"}},
             static_cast<double>(polls.checkpoints));
  out->Counter("fulcrum_coordinator_reassignments_total",
               "Ranks handed to another worker after one was lost (since this coordinator started)", {},
               static_cast<double>(reassignments_));
  if (const uint64_t version = shard_maps_.version(); version > 0) {
    out->Gauge("fulcrum_coordinator_shard_map_version", "Version of the current shard map", {},
               static_cast<double>(version));
  }
  for (const auto& [id, r] : jobs_) CollectJobMetricsLocked(id, r, now, out);
}

// One job's series: state, progress, restarts, GPU time and checkpoints.
void Coordinator::CollectJobMetricsLocked(const std::string& id, const JobRecord& r, absl::Time now,
                                          metrics::Scrape* out) const {
  const v1::JobStatus& st = r.job.status();
  const metrics::Labels job = {{"job", id}};
  out->Gauge("fulcrum_coordinator_job_state", "1 for the job's current state",
             {{"job", id}, {"state", metrics::LabelValue(v1::JobState_Name(st.state()))}}, 1);
  out->Gauge("fulcrum_coordinator_job_epoch", "The epoch the job's slowest rank is in", job, st.epoch());
  out->Gauge("fulcrum_coordinator_job_step", "Steps the job's slowest rank completed", job,
             static_cast<double>(st.step()));
  out->Gauge("fulcrum_coordinator_job_total_steps", "Steps per rank over all epochs (0 until known)", job,
             static_cast<double>(st.total_steps()));
  out->Gauge("fulcrum_coordinator_job_loss", "The job's latest training loss, as its workers report it", job,
             st.loss());
  out->Gauge("fulcrum_coordinator_job_train_accuracy", "Training accuracy over the current epoch (0-1)", job,
             st.train_accuracy());
  out->Gauge("fulcrum_coordinator_job_test_accuracy", "Test accuracy after the last evaluated epoch (0-1)", job,
             st.test_accuracy());
  if (st.test_auc() > 0) {
    out->Gauge("fulcrum_coordinator_job_test_auc", "Binary tasks: test AUC after the last evaluated epoch", job,
               st.test_auc());
    out->Gauge("fulcrum_coordinator_job_test_log_loss", "Binary tasks: test log loss after the last evaluated epoch",
               job, st.test_loss());
  }
  if (st.progressive_examples() > 0) {
    out->Gauge("fulcrum_coordinator_job_progressive_auc",
               "Binary tasks: AUC of the ranks' trailing windows of batches, each scored before it was trained on",
               job, st.progressive_auc());
    out->Gauge("fulcrum_coordinator_job_progressive_log_loss",
               "Binary tasks: log loss of the ranks' trailing windows of batches, each scored before it was trained on",
               job, st.progressive_log_loss());
  }
  if (st.test_rmse() > 0) {
    out->Gauge("fulcrum_coordinator_job_test_rmse", "Regression tasks: test RMSE after the last evaluated epoch", job,
               st.test_rmse());
  }
  out->Gauge("fulcrum_coordinator_job_samples_per_second", "The job's training throughput over all ranks", job,
             st.samples_per_second());
  out->Gauge("fulcrum_coordinator_job_active_workers", "Ranks with a worker running them", job,
             st.active_workers());
  out->Gauge("fulcrum_coordinator_job_restarts", "Worker replacements so far (counts toward backoffLimit)", job,
             st.restarts());
  out->Gauge("fulcrum_coordinator_job_rollbacks", "Rollbacks to a checkpoint so far", job, st.rollbacks());
  if (st.gpu_busy_seconds() + st.gpu_idle_seconds() > 0) {
    const char* help = "GPU time the job's ranks held while training, every incarnation, split by NVML utilization";
    metrics::Labels busy = job, idle = job;
    busy.push_back({"state", "busy"});
    idle.push_back({"state", "idle"});
    out->Counter("fulcrum_coordinator_job_gpu_seconds_total", help, busy, st.gpu_busy_seconds());
    out->Counter("fulcrum_coordinator_job_gpu_seconds_total", help, idle, st.gpu_idle_seconds());
  }
  if (st.batch_size() > 0) {
    out->Gauge("fulcrum_coordinator_job_batch_size", "The batch batch_size auto chose for every rank", job,
               st.batch_size());
  }
  if (st.checkpoints_size() > 0) {
    const double created = static_cast<double>(st.checkpoints(st.checkpoints_size() - 1).created_unix_ms()) / 1e3;
    out->Gauge("fulcrum_coordinator_job_checkpoint_timestamp_seconds", "When the job's last committed cut was taken",
               job, created);
    out->Gauge("fulcrum_coordinator_job_checkpoint_age_seconds", "Seconds since the job's last committed cut", job,
               absl::ToDoubleSeconds(now - absl::UnixEpoch()) - created);
  }
  // The interval cuts are expected at: every_seconds, or every_steps at
  // the job's pace so far; absent when neither applies yet.
  if (st.state() == v1::RUNNING) {
    const v1::CheckpointPolicy& p = r.job.spec().checkpoint();
    double interval = p.every_seconds();
    if (p.every_steps() > 0 && st.step() > 0 && r.started != absl::InfinitePast()) {
      const double per_step = absl::ToDoubleSeconds(now - r.started) / static_cast<double>(st.step());
      const double by_steps = per_step * p.every_steps();
      interval = interval > 0 ? std::min(interval, by_steps) : by_steps;
    }
    if (interval > 0) {
      out->Gauge("fulcrum_coordinator_job_checkpoint_interval_seconds",
                 "How often the job's policy asks for a cut, in seconds (every_steps at the job's pace)", job,
                 interval);
    }
  }
}

}  // namespace fulcrum
