// The Coordinator's life cycle, loading and saving its records (through
// CoordinatorStore, coordinator_store.cc) and the watch poll (parked in
// ParkedPolls, parked_polls.cc). The job API is in coordinator_jobs.cc,
// membership in coordinator_nodes.cc, the scheduler in coordinator_scheduler.cc,
// checkpoints in coordinator_checkpoints.cc and metrics in coordinator_metrics.cc.
#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>


#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/config/job_spec.h"
#include "common/logging.h"
#include "common/shard_map.h"
#include "common/status_macros.h"
#include "server/coordinator/coordinator_internal.h"

namespace fulcrum {

using coordinator_internal::kJobPrefix;
using coordinator_internal::RollingBack;
using coordinator_internal::kMetaKey;
using coordinator_internal::kNodePrefix;
using coordinator_internal::Serial;

namespace {


// What is wrong with a job record that parsed, or "": a record can still be
// damaged (or written by hand), and the rest of the coordinator relies on
// these holding.
std::string JobRecordProblem(const std::string& key, const v1::Job& job) {
  if (key != kJobPrefix + job.id()) return absl::StrCat("it holds job '", job.id(), "'");
  const uint32_t n = job.spec().num_workers();
  if (n < 1 || n > config::kMaxWorkers) return absl::StrCat("num_workers ", n, " is not 1 to ", config::kMaxWorkers);
  // One progress entry per rank, in rank order, as SubmitJob made them.
  const auto& workers = job.status().workers();
  for (int i = 0; i < workers.size(); ++i) {
    if (workers[i].rank() != static_cast<uint32_t>(i)) {
      return absl::StrCat("worker entry ", i, " is for rank ", workers[i].rank());
    }
  }
  if (static_cast<uint32_t>(workers.size()) != n) {
    return absl::StrCat(workers.size(), " worker entries for num_workers ", n);
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Open(CoordinatorOptions options,
                                                               std::unique_ptr<ServerControl> servers) {
  ASSIGN_OR_RETURN(std::unique_ptr<CoordinatorStore> store,
                   CoordinatorStore::Open({.dir = options.data_dir,
                                           .env = options.env,
                                           .retry = options.store_retry,
                                           .clock = options.clock}));
  std::unique_ptr<Coordinator> c(new Coordinator(std::move(options), std::move(servers), std::move(store)));
  RETURN_IF_ERROR(c->Load());
  if (c->options_.run_scheduler) c->scheduler_ = std::thread([p = c.get()] { p->SchedulerLoop(); });
  return c;
}

Coordinator::Coordinator(CoordinatorOptions options, std::unique_ptr<ServerControl> servers,
                         std::unique_ptr<CoordinatorStore> store)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      servers_(std::move(servers)),
      store_(std::move(store)) {}

Coordinator::~Coordinator() {
  Shutdown();
  if (scheduler_.joinable()) scheduler_.join();
  {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return background_ == 0; };
    mu_.Await(absl::Condition(&idle));
  }
  // Shutdown woke every parked poll: each is answered (under mu_, not held
  // here) before the members its answer reads go.
  polls_.WaitIdle();
}

void Coordinator::Spawn(std::function<void()> f) {
  // Called with mu_ held (from the scheduler); the thread takes it later.
  ++background_;
  std::thread([this, f = std::move(f)] {
    f();
    absl::MutexLock lock(&mu_);
    --background_;
  }).detach();
}

void Coordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    ++generation_;
    polls_.WakeAll();
  }
  servers_->CancelAll();
}

absl::Status Coordinator::Load() {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const std::optional<std::string> meta_bytes, store_->Get(kMetaKey));
  if (meta_bytes) {
    v1::CoordinatorMeta m;
    if (!m.ParseFromString(*meta_bytes)) return absl::DataLossError("coordinator meta record is corrupt");
    next_job_ = m.next_job();
    members_.set_next_serial(m.next_node());
    if (m.has_shard_map()) {
      if (auto map = ShardMap::FromProto(m.shard_map()); !map.ok()) {
        return absl::DataLossError(
            absl::StrCat("coordinator meta record is corrupt: its shard map: ", map.status().message()));
      }
      shard_maps_.Restore(m.shard_map());
    }
  }
  const absl::Time now = Now();
  RETURN_IF_ERROR(store_->Scan([&](const std::string& key, const std::string& value) -> absl::Status {
    mu_.AssertHeld();
    auto corrupt = [&key](absl::string_view why) {
      return absl::DataLossError(
          absl::StrCat("coordinator record '", key, "' is corrupt", why.empty() ? "" : ": ", why));
    };
    if (absl::StartsWith(key, kJobPrefix)) {
      JobRecord r;
      if (!r.job.ParseFromString(value)) return corrupt("");
      if (const std::string why = JobRecordProblem(key, r.job); !why.empty()) return corrupt(why);
      r.ranks.resize(r.job.spec().num_workers());
      for (const v1::WorkerProgress& w : r.job.status().workers()) {
        RankSlot& slot = r.ranks[w.rank()];
        slot.incarnation = w.incarnation();
        slot.finished = w.state() == "finished";
        if (r.job.status().state() == v1::RUNNING && !RollingBack(r.job.status()) && w.state() != "lost") {
          slot.node_id = w.worker_id();
        }
      }
      r.release_pending = config::JobEnded(r.job.status().state());
      r.final_cut_pending = r.job.status().state() == v1::RUNNING && !RollingBack(r.job.status()) &&
                            !r.ranks.empty() &&
                            std::all_of(r.ranks.begin(), r.ranks.end(), [](const RankSlot& s) { return s.finished; });
      if (r.job.status().state() == v1::RUNNING) r.started = now;
      checkpoints_.Loaded(r.job.id(),
                          r.job.status().checkpoints_size() > 0
                              ? absl::FromUnixMillis(r.job.status().checkpoints().rbegin()->created_unix_ms())
                              : absl::InfinitePast(),
                          now);
      // Ids are never given twice, even if the meta record was not saved.
      next_job_ = std::max(next_job_, Serial(r.job.id()) + 1);
      jobs_.emplace(r.job.id(), std::move(r));
    } else if (absl::StartsWith(key, kNodePrefix)) {
      v1::NodeInfo info;
      if (!info.ParseFromString(value)) return corrupt("");
      if (key != kNodePrefix + info.node_id()) return corrupt(absl::StrCat("it holds node '", info.node_id(), "'"));
      members_.Restore(info, now);  // a grace period to heartbeat again
    }
    return absl::OkStatus();
  }));
  FLOG(INFO) << "coordinator state in " << options_.data_dir << ": " << jobs_.size() << " jobs, " << members_.size()
             << " nodes, shard map "
             << (shard_maps_.version() > 0 ? absl::StrCat("version ", shard_maps_.version(), " over ",
                                                          shard_maps_.servers().size(), " servers")
                                           : std::string("not built yet"));
  return absl::OkStatus();
}

void Coordinator::SaveJobLocked(JobRecord& r, bool sync) {
  ++r.version;
  WakeJobLocked(r.job.id());
  WriteKeyLocked(kJobPrefix + r.job.id(), sync);
}

void Coordinator::SaveNodeLocked(const std::string& node_id) { WriteKeyLocked(kNodePrefix + node_id, true); }

void Coordinator::SaveMetaLocked() { WriteKeyLocked(kMetaKey, true); }

std::optional<std::string> Coordinator::ValueOfLocked(const std::string& key) const {
  if (key == kMetaKey) {
    v1::CoordinatorMeta m;
    m.set_next_job(next_job_);
    m.set_next_node(members_.next_serial());
    if (auto map = shard_maps_.map()) *m.mutable_shard_map() = *std::move(map);
    return m.SerializeAsString();
  }
  if (absl::StartsWith(key, kJobPrefix)) {
    auto it = jobs_.find(key.substr(strlen(kJobPrefix)));
    if (it != jobs_.end()) return it->second.job.SerializeAsString();
  } else if (absl::StartsWith(key, kNodePrefix)) {
    // A dead node never comes back under its id (it registers anew), so
    // a restarted coordinator must not know it: it would give it a grace
    // period and then declare it dead a second time.
    const std::optional<Membership::Node> n = members_.Get(key.substr(strlen(kNodePrefix)));
    if (n && n->alive) return n->info.SerializeAsString();
  }
  return std::nullopt;
}

void Coordinator::WriteKeyLocked(const std::string& key, bool sync) { store_->Write(key, ValueOfLocked(key), sync); }

absl::Status Coordinator::ChangeJobLocked(JobRecord& r, const std::string& what,
                                          const std::function<void()>& change) {
  JobRecord before = r;
  change();
  if (store_->Saved(kJobPrefix + r.job.id())) return absl::OkStatus();
  r = std::move(before);  // the key stays unsaved: the repair writes the job as it is again
  return store_->Unavailable(what);
}

void Coordinator::RepairStoreLocked() {
  // The store calls back for each unsaved record's bytes, on this thread,
  // with mu_ still held.
  store_->Repair([this](const std::string& key) {
    mu_.AssertHeld();
    return ValueOfLocked(key);
  });
}

void Coordinator::BumpGenerationLocked() {
  ++generation_;
  kick_ = true;
  polls_.WakeHeartbeats();
}

// ---------------------------------------------------------------- long polls

bool Coordinator::CancelWait(uint64_t ticket) { return polls_.Cancel(ticket); }

uint64_t Coordinator::WaitJobAsync(const std::string& job_id, uint64_t version, JobCallback done) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  const bool now = version == 0 || shutdown_ || it == jobs_.end() || it->second.version != version;
  return polls_.Park(PollKind::kWatch, job_id, now, absl::InfiniteFuture(),
                    [this, job_id, version, done = std::move(done)]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                        mu_) -> std::function<void()> {
                      absl::StatusOr<v1::Job> job;
                      uint64_t at = 0;
                      auto j = jobs_.find(job_id);
                      if (shutdown_) {
                        job = absl::UnavailableError("coordinator is shutting down");
                      } else if (j == jobs_.end()) {
                        job = coordinator_internal::NoJobError(job_id);
                      } else if (version != 0 && j->second.version == version) {
                        return nullptr;  // woken for its job's cut waiters: nothing new
                      } else {
                        job = j->second.job;
                        at = j->second.version;
                      }
                      return [done, job = std::move(job), at]() mutable { done(std::move(job), at); };
                    });
}

// ---------------------------------------------------------------- job API

}  // namespace fulcrum
