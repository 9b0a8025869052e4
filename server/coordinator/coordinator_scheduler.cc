// The Coordinator's scheduler: one Tick every CoordinatorOptions::tick, in
// stages (liveness, deadlines, the shard map, releases, rank assignment,
// job starts, checkpoints).
#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/config/job_spec.h"
#include "common/logging.h"
#include "common/shard_map.h"
#include "server/coordinator/coordinator_internal.h"
#include "server/coordinator/placement.h"

namespace fulcrum {

using coordinator_internal::kInstallingShardMap;
using coordinator_internal::kJobPrefix;
using coordinator_internal::RollingBack;
using coordinator_internal::kNodePrefix;
using coordinator_internal::Serial;

void Coordinator::SchedulerLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shutdown_ || kick_; };
      mu_.AwaitWithTimeout(absl::Condition(&wake), options_.tick);
      if (shutdown_) return;
      kick_ = false;
    }
    Tick();
  }
}

void Coordinator::RunSchedulerPass() {
  Tick();
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return background_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

void Coordinator::Tick() {
  absl::MutexLock lock(&mu_);
  // 0. Records a failed write left unsaved are written again.
  RepairStoreLocked();
  const absl::Time now = Now();
  // 1. Liveness. Dead nodes are forgotten after their retention.
  CheckLivenessLocked(now);
  std::erase_if(failing_calls_, [&](const auto& kv) { return now - kv.second.last_failure > absl::Minutes(10); });
  // 2. Active deadlines and TTLs.
  ExpireJobsLocked(now);
  // 3. The shard map follows the live servers while no job runs.
  const std::vector<std::string> live = LiveServersLocked();
  const bool running = AnyRunningLocked();
  FollowLiveServersLocked(live, running);
  // 4. Releases of finished jobs.
  ReleaseFinishedJobsLocked();
  // 5. Reassign lost ranks, then start pending jobs, in submission order.
  std::vector<JobRecord*> order;
  for (auto& [jid, r] : jobs_) order.push_back(&r);
  std::sort(order.begin(), order.end(),
            [](JobRecord* a, JobRecord* b) { return Serial(a->job.id()) < Serial(b->job.id()); });
  SlotPools pools;
  for (JobRecord* r : order) ReassignLostRanksLocked(*r, PoolOfLocked(*r, pools));
  StartPendingJobsLocked(order, pools, live, running);
  ScheduleCheckpointsLocked();
}

void Coordinator::CheckLivenessLocked(absl::Time now) {
  const Membership::Pass pass = members_.CheckLiveness(now);
  if (pass.stall > absl::ZeroDuration()) {
    FLOG(WARNING) << "the coordinator's scheduler did not run for " << absl::FormatDuration(pass.stall)
                  << " (lock held or process paused); " << pass.spared
                  << " node(s) get a fresh node_timeout to heartbeat before any is declared dead";
  }
  if (pass.forgotten > 0) BumpGenerationLocked();
  for (const auto& [id, n] : pass.died) NodeDiedLocked(id, n, now);
}

void Coordinator::NodeDiedLocked(const std::string& id, const Membership::Node& n, absl::Time now) {
  WriteKeyLocked(kNodePrefix + id, false);  // deletes it (ValueOfLocked)
  BumpGenerationLocked();
  if (n.leaving) {
    FLOG(INFO) << id << " left" << (n.info.job_id().empty() ? "" : absl::StrCat(" (a user process of job ",
                                                                                    n.info.job_id(), ")"));
  } else {
    FLOG(WARNING) << id << " missed heartbeats for " << absl::FormatDuration(now - n.last_heard)
                  << ": declared dead";
  }
  for (auto& [jid, r] : jobs_) {
    if (r.job.status().state() != v1::RUNNING) continue;
    if (n.info.role() == v1::SERVER) {
      if (!RollingBack(r.job.status()) && shard_maps_.Lists(n.info.address())) {
        const std::string why = absl::StrCat("parameter server ", id, " at ", n.info.address(),
                                             " stopped; its shards of this job are lost");
        BeginRollbackLocked(r, 0, "ServerLost", why, /*counts_as_restart=*/false, /*or_start=*/true);
      }
      continue;
    }
    for (uint32_t rank = 0; rank < r.ranks.size(); ++rank) {
      RankSlot& s = r.ranks[rank];
      if (s.node_id != id || s.finished) continue;
      s.node_id.clear();
      r.job.mutable_status()->mutable_workers(static_cast<int>(rank))->set_state("lost");
      if (CountFailureLocked(r, absl::StrCat("worker ", id, " (rank ", rank, ") lost"))) break;
      SetStateLocked(r, v1::RUNNING, "Restarting", "WorkerLost",
                     absl::StrCat("worker ", id, " running rank ", rank,
                                  n.leaving ? " left before the rank finished" : " stopped heartbeating",
                                  "; its rank moves to another worker"));
      SaveJobLocked(r, true);
    }
  }
}

void Coordinator::ExpireJobsLocked(absl::Time now) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    JobRecord& r = it->second;
    const uint32_t deadline = r.job.spec().run_policy().active_deadline_seconds();
    if (r.job.status().state() == v1::RUNNING && deadline > 0 && r.started != absl::InfinitePast() &&
        now - r.started > absl::Seconds(deadline)) {
      FinishLocked(r, v1::FAILED, "DeadlineExceeded",
                   absl::StrCat("the job ran longer than activeDeadlineSeconds (", deadline, " s)"));
    }
    const uint32_t ttl = r.job.spec().run_policy().ttl_seconds_after_finished();
    if (config::JobEnded(r.job.status().state()) && ttl > 0 && !r.release_pending &&
        absl::ToUnixMillis(now) - r.job.status().end_time_unix_ms() > int64_t{ttl} * 1000) {
      CutList cuts;
      for (const v1::CheckpointInfo& c : r.job.status().checkpoints()) {
        cuts.emplace_back(c.cut_id(), std::vector<std::string>(c.servers().begin(), c.servers().end()));
      }
      if (!cuts.empty()) {
        Spawn([this, jid = r.job.id(), cuts = std::move(cuts)] { checkpoints_.DeleteCuts(jid, cuts); });
      }
      FLOG(INFO) << "job " << r.job.id() << " forgotten " << ttl << " s after it ended (ttlSecondsAfterFinished)";
      const std::string key = kJobPrefix + r.job.id();
      const std::string forgotten = r.job.id();
      it = jobs_.erase(it);
      checkpoints_.Forget(forgotten);
      WakeJobLocked(forgotten);  // its watchers learn it is gone
      WriteKeyLocked(key, false);  // deletes it (ValueOfLocked)
      continue;
    }
    ++it;
  }
}

void Coordinator::FollowLiveServersLocked(const std::vector<std::string>& live, bool running) {
  if (!running) {
    if (std::optional<v1::ShardMap> m = shard_maps_.Follow(live)) {
      SaveMetaLocked();
      BumpGenerationLocked();
      FLOG(INFO) << "shard map version " << m->version() << ": " << m->num_virtual_shards()
                 << " virtual shards over " << absl::StrJoin(live, ", ");
    }
  }
  v1::ShardMap map;
  std::vector<std::string> to_install = shard_maps_.BeginInstall(live, &map);
  if (to_install.empty()) return;
  Spawn([this, map = std::move(map), to_install = std::move(to_install)] { InstallOnServers(map, to_install); });
}

void Coordinator::ReleaseFinishedJobsLocked() {
  for (auto& [jid, r] : jobs_) {
    if (!r.release_pending || r.release_in_flight || r.final_cut_pending || checkpoints_.Busy(jid) ||
        shard_maps_.version() == 0) {
      continue;
    }
    r.release_in_flight = true;
    Spawn([this, jid = jid, servers = shard_maps_.servers()] {
      ReleaseOnServers(jid, servers);
    });
  }
}

void Coordinator::ReassignLostRanksLocked(JobRecord& r, std::map<std::string, int>& free) {
  // A job rolling back gets its workers once the servers hold the cut.
  if (r.job.status().state() != v1::RUNNING || RollingBack(r.job.status())) return;
  std::set<std::string> in_job;
  for (const RankSlot& s : r.ranks) {
    if (!s.node_id.empty()) in_job.insert(s.node_id);
  }
  bool changed = false;
  for (uint32_t rank = 0; rank < r.ranks.size(); ++rank) {
    RankSlot& s = r.ranks[rank];
    if (!s.node_id.empty() || s.finished) continue;
    const std::string node = placement::TakeSlot(free, in_job);
    if (node.empty()) {
      r.job.mutable_status()->set_message(
          absl::StrCat("rank ", rank, " waits for ",
                       r.job.spec().user_workers() ? "a user process to register for this job (fulcrum.Worker)"
                                                   : "a worker with a free slot"));
      continue;
    }
    s.node_id = node;
    ++s.incarnation;
    in_job.insert(node);
    v1::WorkerProgress* w = r.job.mutable_status()->mutable_workers(static_cast<int>(rank));
    // After a rollback every rank starts again, most on the worker they
    // had: only a rank that moved had its worker replaced.
    const bool moved = !w->worker_id().empty() && w->worker_id() != node;
    w->set_worker_id(node);
    w->set_incarnation(s.incarnation);
    w->set_state("assigned");
    w->set_has_metrics(false);
    FLOG(INFO) << "job " << r.job.id() << ": rank " << rank << (moved ? " moves to " : " starts on ") << node
               << " (incarnation " << s.incarnation << ")";
    if (moved) {
      SetStateLocked(r, v1::RUNNING, "Running", "WorkerReplaced", absl::StrCat("rank ", rank, " resumed on ", node));
    } else if (s.incarnation > 1) {
      r.job.mutable_status()->set_message(absl::StrCat("rank ", rank, " resumed on ", node));
    }
    changed = true;
  }
  if (changed) {
    SaveJobLocked(r, true);
    BumpGenerationLocked();
  }
}

placement::Verdict Coordinator::ConsiderPendingLocked(const JobRecord& r, const placement::FreeSlots& free,
                                                     const std::vector<std::string>& live, bool running,
                                                     bool blocked) const {
  placement::PendingInput in;
  in.need = r.job.spec().num_workers();
  in.user_workers = r.job.spec().user_workers();
  in.free = &free;
  in.live_servers = live.size();
  in.min_servers = options_.min_servers;
  in.map_held = shard_maps_.HeldBy(live);
  in.running = running;
  for (const std::string& s : live) {
    auto f = failing_calls_.find({kInstallingShardMap, s});
    if (f != failing_calls_.end()) {
      in.install_failure = absl::StrCat(s, " fails: ", f->second.error);
      break;
    }
  }
  in.blocked = blocked;
  const Membership::WorkerCount workers = members_.LiveWorkers();
  in.live_workers = workers.heard;
  in.unheard_workers = workers.unheard;
  return placement::ConsiderPending(in);
}

std::map<std::string, int>& Coordinator::PoolOfLocked(const JobRecord& r, SlotPools& pools) const {
  const std::string pool = r.job.spec().user_workers() ? r.job.id() : std::string();
  auto it = pools.find(pool);
  if (it == pools.end()) it = pools.emplace(pool, FreeSlotsLocked(pool)).first;
  return it->second;
}

void Coordinator::StartPendingJobsLocked(const std::vector<JobRecord*>& order, SlotPools& pools,
                                         const std::vector<std::string>& live, bool running) {
  // First-come first-served among the daemons' jobs: a waiting job holds
  // back later ones. A user_workers job waits only for its own processes,
  // and holds back nothing.
  bool blocked = false;
  for (JobRecord* r : order) {
    if (r->job.status().state() != v1::PENDING) continue;
    const bool user = r->job.spec().user_workers();
    std::map<std::string, int>& free = PoolOfLocked(*r, pools);
    const placement::Verdict v = ConsiderPendingLocked(*r, free, live, running, blocked && !user);
    if (!v.start) {
      blocked = blocked || !user;
      if (r->job.status().message() != v.message) {
        r->job.mutable_status()->set_message(v.message);
        r->job.mutable_status()->set_reason(v.reason);
        SaveJobLocked(*r, false);
      }
      continue;
    }
    const uint32_t need = r->job.spec().num_workers();
    const std::vector<std::string> nodes = placement::PlaceRanks(free, need);
    for (uint32_t rank = 0; rank < need; ++rank) {
      r->ranks[rank].node_id = nodes[rank];
      r->ranks[rank].incarnation = 0;
      v1::WorkerProgress* w = r->job.mutable_status()->mutable_workers(static_cast<int>(rank));
      w->set_worker_id(nodes[rank]);
      w->set_state("assigned");
    }
    r->started = Now();
    r->job.mutable_status()->set_start_time_unix_ms(NowMs());
    SetStateLocked(*r, v1::RUNNING, "Running", "JobRunning",
                   absl::StrCat(need, " workers assigned; shard map version ", shard_maps_.version(), " over ",
                                shard_maps_.servers().size(), " servers"));
    RecomputeLocked(*r);
    SaveJobLocked(*r, true);
    BumpGenerationLocked();
    FLOG(INFO) << "job " << r->job.id() << " running on "
               << absl::StrJoin(std::set<std::string>(nodes.begin(), nodes.end()), ", ");
  }
}

}  // namespace fulcrum
