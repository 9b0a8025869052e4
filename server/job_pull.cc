// Job: pulls (validated, served, or parked until the consistency model
// allows them).
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
#include "server/job_internal.h"

namespace fulcrum {

using job_internal::CheckDType;
using job_internal::CheckKeyCount;
using job_internal::DecodeKeys;
using job_internal::kMaxPendingSteps;
using job_internal::Who;

absl::Status Job::ValidatePull(const PullMessage& m, const ShardMap& map, uint32_t self,
                              std::vector<KeyGroups>* sparse) const {
  RETURN_IF_ERROR(CheckIncarnation(m.incarnation, m.worker_id, m.rank, "pull"));
  RETURN_IF_ERROR(CheckDType(m.dtype, "<response>", "pull"));
  if (m.prefetch && !m.dense.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch hint from ", Who(m.worker_id, m.rank),
                                                   " names dense table '", m.dense.front().table,
                                                   "'; hints name sparse keys only"));
  }
  if (m.unclocked && !m.dense.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unclocked pull from ", Who(m.worker_id, m.rank),
                                                   " names dense table '", m.dense.front().table,
                                                   "'; unclocked pulls read sparse rows only"));
  }
  if (m.rank >= num_workers_) {
    return absl::InvalidArgumentError(absl::StrCat("pull from worker '", m.worker_id, "' has rank ",
                                                   m.rank, " but job '", id(), "' has ",
                                                   num_workers_, " workers"));
  }
  for (const DenseChunkRef& d : m.dense) {
    ASSIGN_OR_RETURN(Table * table, FindTable(d.table, true));
    auto* t = static_cast<DenseTable*>(table);
    if (d.chunk >= t->num_chunks()) {
      return absl::InvalidArgumentError(absl::StrCat("table '", d.table, "' has ", t->num_chunks(),
                                                     " chunks; pull names chunk ", d.chunk));
    }
    RETURN_IF_ERROR(CheckOwned(VShardOfChunk(t->name_hash(), d.chunk, num_virtual_shards_),
                               absl::StrCat("table '", d.table, "' chunk ", d.chunk), map, self,
                               m.shard_map_version));
  }
  size_t pull_keys = 0;
  for (const SparseKeysView& s : m.sparse) pull_keys += s.keys.size() / 8;
  RETURN_IF_ERROR(CheckKeyCount(pull_keys, "pull"));
  for (const SparseKeysView& s : m.sparse) {
    ASSIGN_OR_RETURN(Table * table, FindTable(s.table, false));
    if (s.keys.size() % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("table '", s.table, "': keys field has ",
                                                     s.keys.size(),
                                                     " bytes, not a multiple of 8 (uint64)"));
    }
    KeyGroups& g = sparse->emplace_back(
        GroupKeys(*static_cast<const SparseTable*>(table), DecodeKeys(s.keys)));
    size_t begin = 0;
    for (const auto& [v, end] : g.runs) {
      RETURN_IF_ERROR(CheckOwned(v, absl::StrCat("table '", s.table, "' key ", g.keys[g.idx[begin]]),
                                 map, self, m.shard_map_version));
      begin = end;
    }
  }
  return absl::OkStatus();
}

absl::Status Job::ReadSparse(SparseTable* table, const KeyGroups& g, float* out) {
  if (table->spills()) return table->ReadShards(g.keys.data(), g.idx.data(), g.runs, out);
  size_t begin = 0;
  for (const auto& [v, end] : g.runs) {
    RETURN_IF_ERROR(table->Read(v, g.keys.data(), g.idx.data() + begin, end - begin, out));
    begin = end;
  }
  return absl::OkStatus();
}

uint64_t Job::StalenessLocked(uint32_t rank, uint64_t step) const {
  const auto& reads = reads_[rank];
  auto it = reads.upper_bound(step);  // the read for `step`, or the latest before it
  if (it == reads.begin()) return 1;   // no pull seen: counted fresh
  return updates_ - std::prev(it)->second + 1;
}

void Job::RecordReadLocked(uint32_t rank, uint64_t step) {
  auto& reads = reads_[rank];
  // A step's first pull counts: its later parts read weights at least as new.
  reads.try_emplace(step, updates_);
  // A client pulling far ahead without pushing (ASP allows it) keeps only
  // the latest entries.
  while (reads.size() > kMaxReadsPerRank) reads.erase(reads.begin());
}

absl::StatusOr<PullResult> Job::Serve(const PullMessage& m, const std::vector<KeyGroups>& sparse) {
  PullResult result;
  if (staleness_lr_ && !m.unclocked) {
    // Before the weights are read: an update landing during the read counts
    // as not seen, so staleness errs high (a smaller rate), never low.
    absl::MutexLock lock(&mu_);
    RecordReadLocked(m.rank, m.step);
  }
  const size_t esize = DTypeSize(m.dtype);
  thread_local std::vector<float> scratch;
  for (const DenseChunkRef& d : m.dense) {
    auto* t = static_cast<DenseTable*>(tables_.find(d.table)->second.get());
    const size_t n = t->ChunkLength(d.chunk);
    PullResult::Dense& out = result.dense.emplace_back();
    out.table = d.table;
    out.chunk = d.chunk;
    out.dtype = m.dtype;
    if (m.dtype == DType::kFp32) {
      // Served from the chunk's memory: no copy (the chunk copies itself if
      // updated before gRPC has sent it).
      ASSIGN_OR_RETURN(std::shared_ptr<const float[]> weights, t->Snapshot(d.chunk));
      out.shared = weights.get();
      out.shared_size = n * sizeof(float);
      out.owner = std::move(weights);
    } else {
      out.data = OwnedBuffer::Allocate(n * esize);
      RETURN_IF_ERROR(t->Read(d.chunk, m.dtype, out.data.data.get()));
    }
  }
  for (size_t i = 0; i < m.sparse.size(); ++i) {
    const SparseKeysView& s = m.sparse[i];
    auto* t = static_cast<SparseTable*>(tables_.find(s.table)->second.get());
    const size_t n = sparse[i].keys.size() * t->dim();
    PullResult::Sparse& out = result.sparse.emplace_back();
    out.table = s.table;
    out.dtype = m.dtype;
    out.values = OwnedBuffer::Allocate(n * esize);
    float* dst = reinterpret_cast<float*>(out.values.data.get());
    if (m.dtype != DType::kFp32) {
      scratch.resize(n);
      dst = scratch.data();
    }
    RETURN_IF_ERROR(ReadSparse(t, sparse[i], dst));
    if (m.dtype != DType::kFp32) EncodeFloats(dst, n, m.dtype, out.values.data.get());
  }
  absl::MutexLock lock(&mu_);
  result.applied_step = applied_step_;
  return result;
}

absl::Status Job::Prefetch(const PullMessage& m, const std::vector<KeyGroups>& sparse) {
  for (size_t i = 0; i < m.sparse.size(); ++i) {
    auto* t = static_cast<SparseTable*>(tables_.find(m.sparse[i].table)->second.get());
    if (!t->spills()) continue;
    RETURN_IF_ERROR(t->Prefetch(sparse[i].keys.data(), sparse[i].idx.data(), sparse[i].runs).status());
  }
  return absl::OkStatus();
}

void Job::Pull(std::shared_ptr<const PullMessage> m, std::shared_ptr<const ShardMap> map,
               uint32_t self, absl::Time deadline, PullCallback done) {
  auto sparse = std::make_shared<std::vector<KeyGroups>>();
  absl::Status valid = ValidatePull(*m, *map, self, sparse.get());
  if (!valid.ok()) {
    done(valid);
    return;
  }
  std::shared_ptr<Job> me = shared_from_this();
  auto serve = [me, m, sparse, done](absl::Status s) {
    if (!s.ok()) {
      done(s);
      return;
    }
    done(me->Serve(*m, *sparse));
  };
  absl::Status refused;
  if (m->prefetch) {
    // A hint: read ahead now, whatever the clocks; the answer has no rows
    // and nothing counts as read.
    PullResult ahead;
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) refused = shutdown_reason_;
      ahead.applied_step = applied_step_;
    }
    if (refused.ok()) refused = Prefetch(*m, *sparse);
    if (!refused.ok()) {
      done(refused);
    } else {
      done(std::move(ahead));
    }
    return;
  }
  if (m->unclocked) {
    // A step's sparse rows inside a local round: read as they are now.
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) refused = shutdown_reason_;
    }
    metrics_.pull_wait_seconds.Observe(0);
    serve(refused);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    if (model_ != Model::kBsp && !shut_down_) {
      const uint64_t min = MinClockLocked();
      metrics_.staleness.Observe(m->step > min ? static_cast<double>(m->step - min) : 0.0);
    }
    // A pull no worker could legitimately make waits for nothing but its
    // deadline: refuse it, and bound how many may wait (a hostile client
    // could otherwise park pulls until memory runs out).
    const uint64_t reachable = model_ == Model::kBsp   ? applied_step_ + kMaxPendingSteps + 1
                               : model_ == Model::kSsp ? MinClockLocked() + staleness_ + kMaxPendingSteps + 1
                                                       : ~uint64_t{0};
    const size_t max_waiters = size_t{16} * num_workers_ + 256;
    if (shut_down_) {
      refused = shutdown_reason_;
    } else if (m->step > reachable) {
      refused = absl::FailedPreconditionError(absl::StrCat(
          "pull for step ", m->step, " by ", Who(m->worker_id, m->rank), " is beyond step ", reachable,
          ", the furthest any worker of job '", id(), "' can be ahead"));
    } else if (ReadyLocked(m->step)) {
      // served below
    } else if (waiters_.size() >= max_waiters) {
      refused = absl::ResourceExhaustedError(absl::StrCat("job '", id(), "' already has ", waiters_.size(),
                                                          " pulls waiting; the limit is ", max_waiters,
                                                          " (16 per worker + 256)"));
    } else {
      const uint64_t wid = next_waiter_++;
      Waiter& w = waiters_[wid];
      w.step = m->step;
      w.rank = m->rank;
      w.worker = m->worker_id;
      w.start = absl::Now();
      w.resume = [me, start = w.start, serve = std::move(serve)](absl::Status s) {
        me->metrics_.pull_wait_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - start));
        serve(std::move(s));
      };
      std::weak_ptr<Job> weak = me;
      w.timer_id = timer_->Schedule(deadline, [weak, wid] {
        if (auto job = weak.lock()) job->Expire(wid);
      });
      return;
    }
  }
  metrics_.pull_wait_seconds.Observe(0);
  serve(refused);  // serves when OK; otherwise reports why not
}

}  // namespace fulcrum
