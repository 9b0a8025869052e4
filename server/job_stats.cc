// Job: statistics (GetJob) and Prometheus metrics.
#include "server/job.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/status_macros.h"

namespace fulcrum {


std::vector<v1::SparseTableStats> Job::SparseTableStats() const {
  std::vector<v1::SparseTableStats> out;
  for (const auto& [name, t] : tables_) {
    if (t->is_dense()) continue;
    const auto* sp = static_cast<const SparseTable*>(t.get());
    const SparseTable::Counts c = sp->counts();
    v1::SparseTableStats& s = out.emplace_back();
    s.set_table(name);
    s.set_rows(sp->num_rows());
    s.set_bytes(sp->bytes());
    s.set_admitted(c.admitted);
    s.set_rejected(c.rejected);
    s.set_evicted_cap(c.evicted_cap);
    s.set_evicted_ttl(c.evicted_ttl);
    s.set_sketch_bytes(c.sketch_bytes);
    s.set_cold_rows(c.cold_rows);
    s.set_demoted(c.demoted);
    s.set_promoted(c.promoted);
    s.set_cold_reads(c.cold_reads);
    s.set_prefetched(c.prefetched);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.table() < b.table(); });
  return out;
}

v1::GetJobResponse Job::Stats() const {
  v1::GetJobResponse r;
  *r.mutable_spec() = spec_;
  r.set_bytes_used(quota_.used());
  r.set_quota_bytes(quota_.limit());
  r.set_pushes_applied(pushes_applied_.load());
  r.set_unclocked_pushes(unclocked_pushes_.load());
  r.set_duplicate_pushes(duplicates_.load());
  r.set_rejected_nonfinite(rejected_nonfinite_.load());
  // Tables without a lifecycle count no admissions or evictions.
  for (const v1::SparseTableStats& t : SparseTableStats()) {
    r.set_sparse_rows(r.sparse_rows() + t.rows());
    r.set_sparse_rows_admitted(r.sparse_rows_admitted() + t.admitted());
    r.set_sparse_rows_rejected(r.sparse_rows_rejected() + t.rejected());
    r.set_sparse_rows_evicted_cap(r.sparse_rows_evicted_cap() + t.evicted_cap());
    r.set_sparse_rows_evicted_ttl(r.sparse_rows_evicted_ttl() + t.evicted_ttl());
    r.set_sparse_rows_cold(r.sparse_rows_cold() + t.cold_rows());
    r.set_sparse_rows_demoted(r.sparse_rows_demoted() + t.demoted());
    r.set_sparse_rows_promoted(r.sparse_rows_promoted() + t.promoted());
  }
  absl::MutexLock lock(&mu_);
  r.set_applied_step(applied_step_);
  for (uint32_t rank = 0; rank < num_workers_; ++rank) {
    uint64_t c = clock_[rank];
    if (model_ == Model::kBsp) {
      c = applied_step_;
      for (auto it = steps_.find(c); it != steps_.end() && it->first == c; it = steps_.find(++c)) {
        const RankStep& rs = it->second[rank];
        if (!rs.complete()) break;
      }
    }
    r.add_rank_clock(c);
  }
  return r;
}

void Job::CollectMetrics(metrics::Scrape* out) const {
  const metrics::Labels job = {{"job", id()}};
  const JobMetrics& m = metrics_;
  out->Counter("fulcrum_server_requests_total", "Push and pull requests a job served", {{"job", id()}, {"op", "push"}},
               static_cast<double>(m.push_requests.load()));
  out->Counter("fulcrum_server_requests_total", "Push and pull requests a job served", {{"job", id()}, {"op", "pull"}},
               static_cast<double>(m.pull_requests.load()));
  out->Counter("fulcrum_server_payload_bytes_total", "Tensor payload bytes: gradients received, parameters sent",
               {{"job", id()}, {"op", "push"}}, m.push_bytes.load());
  out->Counter("fulcrum_server_payload_bytes_total", "Tensor payload bytes: gradients received, parameters sent",
               {{"job", id()}, {"op", "pull"}}, m.pull_bytes.load());
  out->Histogram("fulcrum_server_request_duration_seconds",
                 "Time to handle a push or pull, from receipt to reply (pulls include the consistency wait)",
                 {{"job", id()}, {"op", "push"}}, m.push_seconds);
  out->Histogram("fulcrum_server_request_duration_seconds",
                 "Time to handle a push or pull, from receipt to reply (pulls include the consistency wait)",
                 {{"job", id()}, {"op", "pull"}}, m.pull_seconds);
  out->Histogram("fulcrum_server_consistency_wait_seconds",
                 "Time a pull waited for the consistency model (BSP step or SSP bound); 0 when it did not wait",
                 job, m.pull_wait_seconds);
  out->Histogram("fulcrum_server_optimizer_apply_seconds",
                 "Time the optimizer took over one push (ASP/SSP) or one combined BSP step", job, m.apply_seconds);
  if (model_ != Model::kBsp) {
    out->Histogram("fulcrum_server_staleness_steps",
                   "SSP/ASP: how many steps a pull's clock was ahead of the slowest worker's", job, m.staleness);
    if (staleness_lr_) {
      out->Histogram("fulcrum_server_push_staleness_updates",
                     "staleness_aware_lr: updates applied between a gradient's pull and its push, plus one "
                     "(its learning rate is divided by this)",
                     job, m.push_staleness);
    }
  }
  out->Counter("fulcrum_server_pushes_applied_total", "Pushes applied to the job's tables", job,
               static_cast<double>(pushes_applied_.load()));
  out->Counter("fulcrum_server_unclocked_pushes_total",
               "Sparse rows pushed by steps inside local-steps rounds, applied on arrival", job,
               static_cast<double>(unclocked_pushes_.load()));
  out->Counter("fulcrum_server_dedup_hits_total", "Retried pushes recognised by request id and not applied again",
               job, static_cast<double>(duplicates_.load()));
  out->Counter("fulcrum_server_superseded_push_parts_total",
               "Parts of a step from a rank's lost incarnation, dropped when its replacement sent the step again",
               job, static_cast<double>(superseded_parts_.load()));
  out->Counter("fulcrum_server_nonfinite_rejected_total", "Pushes refused for a NaN or Inf gradient", job,
               static_cast<double>(rejected_nonfinite_.load()));
  out->Gauge("fulcrum_server_job_memory_bytes", "Memory the job's parameters and optimizer state use here", job,
             static_cast<double>(quota_.used()));
  out->Gauge("fulcrum_server_job_quota_bytes", "The job's memory quota on this server", job,
             static_cast<double>(quota_.limit()));
  for (const auto& [name, t] : tables_) {
    double params = 0;
    if (t->is_dense()) {
      const auto* d = static_cast<const DenseTable*>(t.get());
      params = std::min(static_cast<double>(d->materialized_chunks()) * d->chunk_elements(),
                        static_cast<double>(d->num_elements()));
    } else {
      const auto* sp = static_cast<const SparseTable*>(t.get());
      const uint64_t rows = sp->num_rows();
      params = static_cast<double>(rows) * sp->dim();
      const metrics::Labels table = {{"job", id()}, {"table", name}};
      out->Gauge("fulcrum_server_sparse_rows", "Rows a sparse table holds on this server", table,
                 static_cast<double>(rows));
      out->Gauge("fulcrum_server_sparse_table_bytes",
                 "Memory a sparse table holds here: row blocks, index, per-row fields and admission sketch", table,
                 static_cast<double>(sp->bytes()));
      if (sp->lifecycle().on()) {
        const SparseTable::Counts c = sp->counts();
        out->Counter("fulcrum_server_sparse_admitted_total", "Rows created by an admitted push", table,
                     static_cast<double>(c.admitted));
        out->Counter("fulcrum_server_sparse_rejected_total",
                     "Gradient rows dropped because their key was not admitted yet", table,
                     static_cast<double>(c.rejected));
        for (const auto& [cause, n] : {std::pair<const char*, uint64_t>{"cap", c.evicted_cap}, {"ttl", c.evicted_ttl}}) {
          out->Counter("fulcrum_server_sparse_evicted_total", "Rows dropped: past the table's cap, or unused for ttl_steps",
                       {{"job", id()}, {"table", name}, {"cause", cause}}, static_cast<double>(n));
        }
        out->Gauge("fulcrum_server_sparse_sketch_bytes", "Memory of a sparse table's admission sketches here", table,
                   static_cast<double>(c.sketch_bytes));
        out->Counter("fulcrum_server_sparse_sketch_agings_total",
                     "Times a virtual shard's admission sketch halved its counts (its window passed)", table,
                     static_cast<double>(c.sketch_agings));
        if (sp->spills()) {
          out->Gauge("fulcrum_server_sparse_cold_rows", "Rows of a sparse table on this server's disk (storage.spill)",
                     table, static_cast<double>(c.cold_rows));
          out->Counter("fulcrum_server_sparse_demoted_total", "Rows moved to disk past the table's memory budget",
                       table, static_cast<double>(c.demoted));
          out->Counter("fulcrum_server_sparse_promoted_total", "Rows brought back to memory from disk by a push",
                       table, static_cast<double>(c.promoted));
          out->Counter("fulcrum_server_sparse_cold_reads_total", "Rows a pull read from disk", table,
                       static_cast<double>(c.cold_reads));
          out->Counter("fulcrum_server_sparse_prefetched_total",
                       "Rows read from disk ahead of their pull by a worker's prefetch hint", table,
                       static_cast<double>(c.prefetched));
        }
      }
    }
    out->Gauge("fulcrum_server_parameters",
               "Parameters of a table held on this server (dense: whole chunks; sparse: rows x dim)",
               {{"job", id()}, {"table", name}}, params);
  }
  {
    absl::MutexLock lock(&mu_);
    uint64_t step = applied_step_;
    if (model_ != Model::kBsp) step = MinClockLocked();
    out->Gauge("fulcrum_server_job_step", "BSP: steps fully applied; SSP/ASP: the slowest worker's clock", job,
               static_cast<double>(step));
  }
  if (m.checkpoint_seconds.count() > 0) {
    out->Histogram("fulcrum_server_checkpoint_duration_seconds",
                   "Time to capture and durably write this server's part of a checkpoint", job, m.checkpoint_seconds);
    out->Gauge("fulcrum_server_checkpoint_bytes", "Size of the job's last checkpoint part written here", job,
               m.last_checkpoint_bytes.load());
    out->Gauge("fulcrum_server_checkpoint_timestamp_seconds", "When the job's last checkpoint part here was written",
               job, m.last_checkpoint_time.load());
    out->Gauge("fulcrum_server_checkpoint_age_seconds", "Seconds since the job's last checkpoint part here", job,
               absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) - m.last_checkpoint_time.load());
  }
}

}  // namespace fulcrum
