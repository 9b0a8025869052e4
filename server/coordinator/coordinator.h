// Coordinator: the cluster's control plane, transport-free (the gRPC
// services in rpc/coordinator_service.h are a thin layer over it).
//
// It keeps the job registry (specs, states, progress), node membership
// (servers and workers, with heartbeats), the versioned shard map and the
// assignments of job ranks to workers, all in RocksDB: a restarted
// coordinator knows everything it knew. A scheduler thread
//   - declares nodes dead after `node_timeout` without a heartbeat; a dead
//     worker's ranks move to live workers with a free slot (or the next one
//     that registers), the job goes on; a dead server fails its jobs;
//   - rebuilds the shard map over the live servers while no job runs, and
//     installs it on every server before a job starts;
//   - starts pending jobs in submission order once enough workers are free;
//   - releases finished jobs: drops their tables on every server and frees
//     their workers.
// Nodes learn of changes through Heartbeat, a long poll that returns as soon
// as anything they should know changed; users follow a job the same way
// (WaitJobAsync, behind WatchJob) and wait for the checkpoints they ask for
// (CheckpointJobAsync). A parked long poll holds no thread: one wake-up
// thread answers them all. Thread-safe.
#ifndef FULCRUM_SERVER_COORDINATOR_COORDINATOR_H_
#define FULCRUM_SERVER_COORDINATOR_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics/metrics.h"
#include "fulcrum/v1/cluster.pb.h"
#include "fulcrum/v1/ps.pb.h"
#include "server/coordinator/checkpoint_manager.h"
#include "server/coordinator/coordinator_store.h"
#include "server/coordinator/membership.h"
#include "server/coordinator/parked_polls.h"
#include "server/coordinator/placement.h"
#include "server/coordinator/server_control.h"
#include "server/coordinator/shard_map_state.h"

namespace rocksdb {
class Env;
}

namespace fulcrum {

struct CoordinatorOptions {
  std::string data_dir;  // RocksDB directory, created when missing
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // A node that has not heartbeated for this long is dead.
  absl::Duration node_timeout = absl::Seconds(5);
  // A dead node stays listed (GetCluster, `fulcrumctl cluster`, the nodes
  // gauge) this long after it was declared dead, then is forgotten: nodes
  // that come and go (pods rescheduled) do not pile up.
  absl::Duration dead_node_retention = absl::Minutes(10);
  uint32_t virtual_shards = 256;
  // Jobs wait until at least this many servers are live (so a job does not
  // start on the first server of a cluster still coming up).
  uint32_t min_servers = 1;
  absl::Duration server_rpc_timeout = absl::Seconds(10);
  // How long a server may wait for a BSP cut's step boundary.
  absl::Duration checkpoint_wait = absl::Seconds(60);
  // How long a job rolling back to a checkpoint waits for the servers that
  // hold the cut to come back before it fails.
  absl::Duration restore_timeout = absl::Minutes(5);
  absl::Duration tick = absl::Milliseconds(100);
  // Jobs a user may have pending or running at once (0: no limit). Applies
  // to authenticated users; the anonymous user of a coordinator without
  // tokens is not limited.
  uint32_t max_active_jobs_per_user = 16;
  // Long calls (open WatchJob and ExportCheckpoint streams, CheckpointJob
  // calls waiting for their cut) a user may hold at once (0: no limit);
  // anonymous callers of a coordinator without tokens count by their address.
  // Each costs the coordinator ~20 KB (an export also a thread), so a client
  // that never hangs up is bounded.
  uint32_t max_long_calls_per_user = 1024;
  // While saving state fails (a full or failing disk), how often the
  // scheduler tries again (docs/operations.md, "When the coordinator's disk
  // fails").
  absl::Duration store_retry = absl::Seconds(1);
  // The environment RocksDB works through (nullptr: the default). Tests give
  // one whose writes fail on demand.
  rocksdb::Env* env = nullptr;
  // The time of day for liveness, deadlines, TTLs, checkpoint cadence and
  // timestamps (nullptr: the real one). Long polls' timeouts stay on real
  // time. Tests give a fake one and call RunSchedulerPass.
  const Clock* clock = nullptr;
  // Whether a thread runs the scheduler every `tick`; tests that drive it
  // with RunSchedulerPass turn it off.
  bool run_scheduler = true;
};

// The gRPC ServerControl: server/coordinator/rpc/grpc_server_control.h.

class Coordinator {
 public:
  static absl::StatusOr<std::unique_ptr<Coordinator>> Open(CoordinatorOptions options,
                                                           std::unique_ptr<ServerControl> servers);
  ~Coordinator();
  const CoordinatorOptions& options() const { return options_; }

  // ---- job API
  // `owner`: the submitting user (empty without tokens). A user with
  // max_active_jobs_per_user jobs not yet ended gets RESOURCE_EXHAUSTED.
  absl::StatusOr<std::string> SubmitJob(const v1::JobSpec& spec, bool validate_only, const std::string& owner = "");
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) const;
  // A page of the jobs `visible` accepts, oldest first: at most `page_size`
  // (0: kDefaultPageSize; over kMaxPageSize is refused) after `page_token`.
  static constexpr int kDefaultPageSize = 100;
  static constexpr int kMaxPageSize = 1000;
  struct JobPage {
    std::vector<v1::Job> jobs;
    std::string next_page_token;  // empty on the last page
  };
  absl::StatusOr<JobPage> ListJobs(int page_size, const std::string& page_token,
                                   const std::function<bool(const v1::Job&)>& visible) const;
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id);

  // ---- long polls (WatchJob, Heartbeat, CheckpointJob), parked without a thread
  // `done` runs exactly once, never inside the call that parks it: on the
  // wake-up thread, as soon as there is something to answer, at a
  // heartbeat's timeout or at Shutdown. It must not block. The returned ticket withdraws the
  // poll (CancelWait).
  using JobCallback = std::function<void(absl::StatusOr<v1::Job> job, uint64_t version)>;
  // Answers with the job and its version once the version differs from
  // `version` (at once for 0); NOT_FOUND once the job is gone, UNAVAILABLE
  // when the coordinator shuts down.
  uint64_t WaitJobAsync(const std::string& job_id, uint64_t version, JobCallback done);
  using HeartbeatCallback = std::function<void(absl::StatusOr<v1::HeartbeatResponse>)>;
  // Heartbeat below, answered through `done`.
  uint64_t HeartbeatAsync(const v1::HeartbeatRequest& request, HeartbeatCallback done,
                          const std::string& certificate = "");
  // Withdraws a parked poll: true when its `done` will not run, false when
  // it has run or is about to.
  bool CancelWait(uint64_t ticket);

  // ---- checkpoints (docs/checkpoints.md)
  // Takes a cut of a running job now and answers once it is committed (or
  // failed) through `done`, parked like the polls above: NOT_FOUND for an
  // unknown or deleted job, FAILED_PRECONDITION unless it runs or when it
  // ends first, DEADLINE_EXCEEDED after `timeout`, UNAVAILABLE at Shutdown.
  using CheckpointCallback = std::function<void(absl::StatusOr<v1::CheckpointInfo>)>;
  uint64_t CheckpointJobAsync(const std::string& job_id, absl::Duration timeout, CheckpointCallback done);
  // Rolls the job back to committed cut `cut_id` (0: the latest) on the
  // servers live now: a running job's workers restart from it, an ended job
  // runs again from it.
  absl::StatusOr<v1::Job> RestoreJob(const std::string& job_id, uint64_t cut_id);
  // Hands `write` the cut's info and meta, then its records, server by
  // server; stops early when `write` returns false.
  absl::Status ExportCheckpoint(const std::string& job_id, uint64_t cut_id,
                                const std::function<bool(const v1::ExportCheckpointChunk&)>& write);

  // ---- cluster API
  // `certificate` is the caller's: the SPIFFE ID of the certificate it
  // presented (empty in plaintext). A node is bound to the certificate it
  // registered with (NodeInfo.certificate); heartbeats, reports and later
  // registrations as that node must present the same, else
  // PERMISSION_DENIED (docs/security.md, "What each certificate may do").
  absl::StatusOr<v1::RegisterNodeResponse> RegisterNode(const v1::NodeInfo& node, const std::string& certificate = "");
  // Marks the node heard, then answers once the generation differs from the
  // request's (at once for 0) or after min(wait_ms, heartbeat_interval).
  // Blocks; the gRPC service uses HeartbeatAsync.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request,
                                                  const std::string& certificate = "");
  absl::StatusOr<v1::ReportProgressResponse> ReportProgress(const v1::ReportProgressRequest& request,
                                                            const std::string& certificate = "");
  v1::ClusterState GetCluster() const;

  // Stops the scheduler and wakes every long poll. Idempotent.
  void Shutdown();

  // Renders the coordinator's series (docs/metrics.md) into a scrape.
  void CollectMetrics(metrics::Scrape* out) const;

  // Runs one pass of the scheduler now, on the caller's thread, and waits
  // until the calls to servers it started (shard-map installs, releases,
  // cuts) have ended: how an owner that set run_scheduler false drives the
  // coordinator (tests on a fake clock, CoordinatorOptions::clock).
  void RunSchedulerPass();

 private:
  struct RankSlot {
    std::string node_id;  // empty: waiting for a worker
    uint32_t incarnation = 0;
    bool finished = false;
  };
  struct JobRecord {
    v1::Job job;
    uint64_t version = 1;      // bumped on every change
    std::vector<RankSlot> ranks;
    bool release_pending = false;  // tables still to drop on the servers
    bool release_in_flight = false;  // a background ReleaseOnServers runs
    absl::Time started = absl::InfinitePast();
    bool final_cut_pending = false;  // every rank finished: a last cut, then SUCCEEDED
    // Each server's sparse tables of the job, as its last heartbeat said
    // (summed over the live ones into status.sparse_tables).
    std::map<std::string, std::vector<v1::SparseTableStats>> server_tables;
  };
  Coordinator(CoordinatorOptions options, std::unique_ptr<ServerControl> servers,
              std::unique_ptr<CoordinatorStore> store);
  absl::Status Load();
  void SchedulerLoop();
  // One pass of the scheduler, in stages (coordinator_scheduler.cc).
  void Tick();
  // Membership's liveness pass, and what follows from it.
  void CheckLivenessLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A node declared dead (past node_timeout, or leaving): a server's running
  // jobs roll back (or fail), a worker's ranks wait for another worker.
  void NodeDiedLocked(const std::string& id, const Membership::Node& n, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // activeDeadlineSeconds and ttlSecondsAfterFinished.
  void ExpireJobsLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While no job runs the shard map follows the live servers; it is
  // installed on those that lack it.
  void FollowLiveServersLocked(const std::vector<std::string>& live, bool running)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseFinishedJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReassignLostRanksLocked(JobRecord& r, std::map<std::string, int>& free) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a pending job starts now, and if not why (placement.h).
  placement::Verdict ConsiderPendingLocked(const JobRecord& r, const placement::FreeSlots& free,
                                           const std::vector<std::string>& live, bool running, bool blocked) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `pools`: free slots by pool (FreeSlotsLocked), filled as jobs need them.
  using SlotPools = std::map<std::string, std::map<std::string, int>>;
  std::map<std::string, int>& PoolOfLocked(const JobRecord& r, SlotPools& pools) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartPendingJobsLocked(const std::vector<JobRecord*>& order, SlotPools& pools,
                              const std::vector<std::string>& live, bool running) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Persistence (coordinator_store.h). Each record (the meta record,
  // job/<id>, node/<id>) is written whole from memory; `sync` for state
  // changes, not for progress. A key whose write failed is written again by
  // the scheduler's store_->Repair until that works; calls that answer a
  // client check store_->Saved and refuse a change they could not save.
  void SaveJobLocked(JobRecord& r, bool sync) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SaveNodeLocked(const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SaveMetaLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteKeyLocked(const std::string& key, bool sync) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The record `key` should hold now; nullopt: none (a forgotten job, a
  // dead node), so the key is deleted.
  std::optional<std::string> ValueOfLocked(const std::string& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `change` on a job; when its record could not be saved, puts the job
  // back as it was and returns store_->Unavailable(`what`).
  absl::Status ChangeJobLocked(JobRecord& r, const std::string& what, const std::function<void()>& change)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The scheduler's retry of unsaved records.
  void RepairStoreLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void SetStateLocked(JobRecord& r, v1::JobState state, const std::string& type, const std::string& reason,
                      const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a job (FAILED, CANCELLED, SUCCEEDED): frees its workers, queues the
  // release of its tables.
  void FinishLocked(JobRecord& r, v1::JobState state, const std::string& reason, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecomputeLocked(JobRecord& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Free assignment slots per live worker of a pool: the daemons (""), or
  // the user processes registered for job `job_id` (JobSpec.user_workers).
  std::map<std::string, int> FreeSlotsLocked(const std::string& job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A node registering for one job (NodeInfo.job_id): a worker of one slot,
  // for a user_workers job that has not ended.
  absl::Status CheckUserWorkerLocked(const v1::NodeInfo& node) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a user process of job `job_id` has no rank to take ("job X is gone",
  // "job X has ended (CANCELLED)"); "" while the job is pending or running.
  std::string UserJobOverLocked(const std::string& job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<v1::Assignment> AssignmentsOfLocked(const std::string& node_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> LiveServersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AnyRunningLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BumpGenerationLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Long polls: parked in polls_ (parked_polls.h), answered under mu_.
  using PollKind = ParkedPolls::Kind;
  // Wakes the job's watchers and checkpoint waiters; each answers only if
  // there is news for it.
  void WakeJobLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { polls_.WakeJob(job_id); }
  absl::StatusOr<v1::HeartbeatResponse> HeartbeatAnswerLocked(const std::string& node_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Checkpoints. Starts the cuts and restores due now (on threads of their own).
  void ScheduleCheckpointsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeStartRestoreLocked(const std::string& jid, JobRecord& r, const std::set<std::string>& live,
                               bool map_ready, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeStartCutLocked(const std::string& jid, JobRecord& r, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunCut(CutTask task);
  // A cut every server wrote: into the job's list (the oldest past `keep`
  // to `to_delete`), saved; returns the ids kept.
  std::set<uint64_t> CommitCutLocked(const v1::CheckpointInfo& info, JobRecord& r, CutList* to_delete)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunRestore(RestoreTask task);
  // Rolls a running job back to its latest committed cut (or `cut_id`);
  // false when it has none to roll back to.
  // Counts a worker replacement or rollback against run_policy.backoff_limit
  // (failures in a row without progress); FAILS the job with
  // BackoffLimitExceeded and returns true when that passes the limit.
  bool CountFailureLocked(JobRecord& r, const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `or_start`: a job with no committed cut starts again from step 0
  // (JobStatus.restarting) instead of returning false.
  bool BeginRollbackLocked(JobRecord& r, uint64_t cut_id, const std::string& reason, const std::string& message,
                           bool counts_as_restart, bool or_start = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Spawn(std::function<void()> f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Background work of the scheduler, on every server at once, so that a
  // server that hangs holds up only its own call and never the scheduler's
  // tick (liveness, rank moves, job starts) for the control timeout.
  void InstallOnServers(const v1::ShardMap& map, const std::vector<std::string>& servers);
  void ReleaseOnServers(const std::string& job_id, const std::vector<std::string>& servers);
  // Records the outcome of a call the scheduler retries every tick until it
  // works (`what`, e.g. "installing the shard map", on `server`). Failures
  // are counted and logged once a minute, not once a tick; a success after
  // failures is logged with how many there were.
  void NoteRetriedCallLocked(const char* call, const std::string& what, const std::string& server,
                             const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::ReportProgressResponse> ReportProgressLocked(const v1::ReportProgressRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ReportProgressLocked's parts. The rank's progress into its worker entry
  // and the job's (GPU time, batch_size auto's choice, the data read);
  // returns whether the change must be saved at once.
  bool MergeProgressLocked(JobRecord& r, const v1::ReportProgressRequest& req, bool rank_finished)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An epoch's figures into the job's summary of that epoch.
  void MergeEpochLocked(JobRecord& r, const v1::ReportProgressRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank's error: the job rolls back (true: the rank stops) or fails.
  bool RankFailedLocked(JobRecord& r, const v1::ReportProgressRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once every rank finished, the final cut is due.
  void RankFinishedLocked(JobRecord& r, uint32_t rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every rank finished (and the final cut is taken or failed).
  void SucceedLocked(JobRecord& r, const std::string& note) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CollectJobMetricsLocked(const std::string& id, const JobRecord& r, absl::Time now, metrics::Scrape* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Time Now() const { return clock_->Now(); }
  int64_t NowMs() const { return absl::ToUnixMillis(Now()); }

  const CoordinatorOptions options_;
  const Clock* const clock_;
  std::unique_ptr<ServerControl> servers_;
  std::unique_ptr<CoordinatorStore> store_;  // its own lock, taken inside mu_
  // Cuts and restores in flight, their calls to servers (its own lock,
  // taken inside mu_).
  CheckpointManager checkpoints_{servers_.get(), clock_, options_.checkpoint_wait};

  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool kick_ ABSL_GUARDED_BY(mu_) = false;  // a change the scheduler should look at now
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_job_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reassignments_ ABSL_GUARDED_BY(mu_) = 0;  // ranks handed to another worker (this process)
  std::map<std::string, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);
  // Per server node: the jobs its last heartbeat reported sparse tables of.
  std::map<std::string, std::set<std::string>> server_jobs_ ABSL_GUARDED_BY(mu_);
  // A server's heartbeat: its jobs' sparse tables into their status.
  void NoteSparseTablesLocked(const std::string& node_id, const v1::HeartbeatRequest& req)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Nodes and their liveness (its own lock, taken inside mu_).
  Membership members_{{.node_timeout = options_.node_timeout,
                       .dead_node_retention = options_.dead_node_retention,
                       .tick = options_.tick},
                      clock_->Now()};
  // The shard map, who holds it, the installation in flight (its own lock,
  // taken inside mu_).
  ShardMapState shard_maps_{options_.virtual_shards};
  struct RetriedCall {
    uint64_t failures = 0;  // in a row
    absl::Time first_failure, last_failure, last_logged;
    std::string error;
  };
  // Calls failing now, by (what, server); forgotten 10 minutes after their
  // last failure (a dead server dropped from the map, a forgotten job).
  std::map<std::pair<std::string, std::string>, RetriedCall> failing_calls_ ABSL_GUARDED_BY(mu_);
  // fulcrum_coordinator_server_call_failures_total, by call.
  std::map<std::string, uint64_t> call_failures_ ABSL_GUARDED_BY(mu_);
  std::thread scheduler_;
  int background_ ABSL_GUARDED_BY(mu_) = 0;  // cut and restore threads running

  // Last: every poll is answered (its answer reads the members above)
  // before it goes.
  ParkedPolls polls_{&mu_};
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_COORDINATOR_H_
