// ParameterServer: the transport-free core of fulcrum-server. Holds the jobs
// on this server and the shard map, and routes Push/Pull to the job.
// Thread-safe; the gRPC service in server/rpc/ is a thin layer over it.
#ifndef FULCRUM_SERVER_PARAMETER_SERVER_H_
#define FULCRUM_SERVER_PARAMETER_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/messages.h"
#include "common/shard_map.h"
#include "fulcrum/v1/cluster.pb.h"
#include "fulcrum/v1/ps.pb.h"
#include "common/deadline_timer.h"
#include "server/checkpoint.h"
#include "server/cold_tier.h"
#include "server/job.h"
#include "common/metrics/metrics.h"

namespace fulcrum {

struct ParameterServerOptions {
  // This server's index in the shard map's server list.
  uint32_t server_index = 0;
  // When set, the index is wherever this address appears in each installed
  // map (maps come from the coordinator); a server a map does not list owns
  // nothing under it.
  std::string advertise_address;
  // The initial map; without one, requests fail UNAVAILABLE until SetShardMap.
  std::optional<v1::ShardMap> shard_map;
  // Quota per job on this server when the job spec names none.
  uint64_t default_quota_bytes = uint64_t{8} << 30;
  // Bytes of weights and optimizer state all jobs together may hold on
  // this server, whatever their quotas; 0: 80% of the machine's physical
  // memory, or of its cgroup's memory limit when that is lower
  // (memory_limit_bytes() says what was chosen).
  uint64_t memory_limit_bytes = 0;
  // Servers on one host share its memory: the default limit is divided
  // among them (deploy/local/cluster.sh passes its server count).
  uint32_t servers_per_host = 1;
  // Longest a pull may wait for the consistency model.
  absl::Duration max_wait = absl::Minutes(10);
  // Checkpoints live in <data_dir>/checkpoints (a RocksDB database), rows
  // that spill from memory (storage.spill) in <data_dir>/cold; empty: this
  // server takes no checkpoints and holds no table that spills.
  std::string data_dir;
  // The environment the checkpoint store's RocksDB works through (nullptr:
  // the default). Tests give one whose writes fail on demand.
  rocksdb::Env* checkpoint_env = nullptr;
  // The same for the cold tier.
  rocksdb::Env* cold_tier_env = nullptr;
  // Fault injection for crash tests (fulcrum-server
  // --fault_checkpoint_commit_delay): each checkpoint's records wait this
  // long uncommitted, and the server logs when the wait starts. 0 in use.
  absl::Duration checkpoint_commit_delay = absl::ZeroDuration();
  // With a coordinator: CreateJob takes only jobs the coordinator admitted
  // (SetAdmittedJobs), with the quota it granted, and a job it stops
  // listing is dropped after `unadmitted_grace`.
  bool require_admission = false;
  absl::Duration unadmitted_grace = absl::Seconds(60);
};

class ParameterServer {
 public:
  static absl::StatusOr<std::unique_ptr<ParameterServer>> Create(ParameterServerOptions options);
  ~ParameterServer();

  // Idempotent for an identical spec; ALREADY_EXISTS for a different one.
  // INVALID_ARGUMENT for a quota_bytes above this server's memory limit.
  // With require_admission: UNAVAILABLE for a job the coordinator has not
  // (yet) admitted, PERMISSION_DENIED for another quota than it granted.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(const v1::PsJobSpec& spec);

  // The jobs the coordinator admits now (id, quota_bytes, and who owns each
  // rank), from its heartbeat answer at `now`. Jobs held here that it has
  // not listed for unadmitted_grace are deleted (returns their ids).
  std::vector<std::string> SetAdmittedJobs(const std::vector<v1::AdmittedJob>& jobs, absl::Time now);
  // NOT_FOUND for an unknown job. Returns bytes freed; waiting pulls fail ABORTED.
  absl::StatusOr<uint64_t> DeleteJob(const std::string& job_id);
  absl::StatusOr<v1::GetJobResponse> GetJob(const std::string& job_id) const;

  // UNAVAILABLE when no map has been installed yet.
  absl::StatusOr<v1::ShardMap> GetShardMap() const;
  // Installs a newer map (version must increase, shard count must not change).
  absl::Status SetShardMap(const v1::ShardMap& map);

  absl::Status Push(const PushMessage& m, PushResult* out);
  // `done` runs exactly once, possibly on another thread. `rpc_deadline` is
  // the caller's transport deadline (InfiniteFuture when none).
  void Pull(std::shared_ptr<const PullMessage> m, absl::Time rpc_deadline, PullCallback done);

  // Fails waiting and future pulls UNAVAILABLE so the transport can shut
  // down without a request left hanging.
  void Drain();

  // Checkpoints (docs/checkpoint-format.md). Writes this server's part of
  // cut `cut_id` of a job, taken at the BSP step boundary `at_step` (waiting
  // up to `wait` for it; see Job::Capture) or, under SSP/ASP, now. Training
  // pauses only while the state is captured; the write runs after.
  // `on_captured`, when given, runs once the state is captured (training
  // goes on from then), before the write.
  absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string& job_id, uint64_t cut_id, uint64_t at_step,
                                              absl::Duration wait, std::function<void()> on_captured = nullptr);
  // Committed cuts of a job on this server, oldest first.
  absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string& job_id) const;
  // A page of a committed cut's records in this server's store
  // (ReadCheckpoint); with an owner map, only those its owner_index owns.
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const v1::ReadCheckpointRequest& req) const;
  // Where a restore reads a cut from: ReadCheckpoint pages of one server.
  using CutReader =
      std::function<absl::StatusOr<v1::ReadCheckpointResponse>(const v1::ReadCheckpointRequest&)>;
  // Replaces the job (deleting it if present) with cut `cut_id`: the cut's
  // spec, the records of what this server owns under the current map, and
  // the cut's clocks (each rank's lowest over the sources). Without
  // `sources`, from this server's own store, every checksum verified;
  // otherwise from each source in turn (the servers that wrote the cut,
  // this one perhaps among them), so a cut taken on N servers restores onto
  // any number. Afterwards requests of incarnations below `min_incarnation`
  // are refused.
  // Cut 0 is the job's start (RestartJob below).
  absl::StatusOr<v1::ShardCutMeta> Restore(const std::string& job_id, uint64_t cut_id,
                                           const std::vector<CutReader>& sources = {},
                                           uint32_t min_incarnation = 0);
  // The job as it was created (its spec's tables, every clock at 0) in
  // place of what it trained, for a job that lost a rank or a server before
  // any cut was committed; incarnations below `min_incarnation` are refused
  // afterwards. Without the job here only the fence is noted, for the
  // CreateJob that makes it. The answer names cut 0 at step 0.
  absl::StatusOr<v1::ShardCutMeta> RestartJob(const std::string& job_id, uint32_t min_incarnation);
  absl::Status DeleteCut(const std::string& job_id, uint64_t cut_id);
  // Null without a data_dir.
  CheckpointStore* checkpoints() const { return store_.get(); }

  uint32_t server_index() const;
  // Whether `address` names this server: its advertised address, or its
  // entry in the installed map.
  bool IsSelf(const std::string& address) const;
  // Jobs on this server (for the coordinator's bookkeeping and tests).
  std::vector<std::string> JobIds() const;

  // Renders this server's series (docs/metrics.md) into a scrape.
  void CollectMetrics(metrics::Scrape* out) const;
  // Every job's sparse tables, for the coordinator (heartbeats).
  std::vector<v1::JobSparseTables> SparseTables() const;

  // The limit on all jobs' parameter memory (options or the default) and
  // what the jobs hold now.
  uint64_t memory_limit_bytes() const { return memory_->limit(); }
  uint64_t memory_used_bytes() const { return memory_->used(); }

 private:
  explicit ParameterServer(ParameterServerOptions options);
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& job_id) const;
  // Restore's parts for a cut read from other servers: every source's first
  // page (kept in `first_pages`) and their metas merged into the cut's (the
  // slowest clocks; a BSP cut's steps must agree), then every source's
  // records, page by page, handed to `visit`.
  absl::StatusOr<v1::ShardCutMeta> SourcesMeta(const std::string& job_id, uint64_t cut_id,
                                               const std::vector<CutReader>& sources,
                                               const v1::ReadCheckpointRequest& first,
                                               std::vector<v1::ReadCheckpointResponse>* first_pages);
  absl::Status ReadSources(const std::string& job_id, uint64_t cut_id, uint32_t format,
                           const std::vector<CutReader>& sources, const v1::ReadCheckpointRequest& first,
                           std::vector<v1::ReadCheckpointResponse> first_pages, const CheckpointStore::Visitor& visit);
  struct MapRef {
    std::shared_ptr<const ShardMap> map;
    uint32_t self;  // this server's index in it
  };
  absl::StatusOr<MapRef> Map() const;
  // This server's index in `m`, or an error naming why it has none.
  absl::StatusOr<uint32_t> IndexIn(const ShardMap& m) const;

  absl::StatusOr<CheckpointStore*> Store() const;

  // With require_admission, a push or pull that came with a certificate
  // (`caller`) must be of a rank the coordinator gave to a node of that
  // certificate, in the incarnation it gave: PERMISSION_DENIED for another
  // certificate, FAILED_PRECONDITION for an incarnation the rank has left,
  // UNAVAILABLE (retried) for one this server has not heard of yet, and for
  // a job held here that the coordinator does not list (ended). Called for
  // jobs this server holds (an unknown one is NOT_FOUND before).
  absl::Status CheckRankCaller(const std::string& job_id, uint32_t rank, uint32_t incarnation,
                               const std::string& caller, absl::string_view what) const;

  // Requests refused, by operation (0 push, 1 pull) and status code.
  void CountRejected(int op, const absl::Status& s) const;
  mutable std::atomic<uint64_t> rejected_[2][17] = {};

  const ParameterServerOptions options_;
  const std::shared_ptr<MemoryQuota> memory_;  // every job's quota draws from it
  // Threads every job applies a BSP step's dense chunks on.
  const std::shared_ptr<ParallelRunner> runner_;
  std::unique_ptr<CheckpointStore> store_;
  // Null without a data_dir. Outlives every job (they drop their rows).
  std::unique_ptr<ColdTier> cold_tier_;
  DeadlineTimer timer_;
  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<const ShardMap> map_ ABSL_GUARDED_BY(mu_);
  uint32_t self_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // require_admission: what the coordinator admits (id -> quota), and since
  // when each job held here has been missing from that list.
  absl::flat_hash_map<std::string, uint64_t> admitted_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Time> unadmitted_since_ ABSL_GUARDED_BY(mu_);
  // RestartJob's fences (job -> lowest incarnation allowed), taken by the
  // job's next creation.
  absl::flat_hash_map<std::string, uint32_t> fences_ ABSL_GUARDED_BY(mu_);
  // require_admission: each admitted job's ranks as the coordinator gave
  // them (index: rank). A lock of its own: every push and pull reads it.
  mutable absl::Mutex owners_mu_;
  absl::flat_hash_map<std::string, std::vector<v1::RankOwner>> owners_ ABSL_GUARDED_BY(owners_mu_);
  // CreateJob without the admission and quota checks (Restore, which the
  // coordinator drives).
  absl::StatusOr<v1::CreateJobResponse> CreateJobUnchecked(const v1::PsJobSpec& spec);
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_PARAMETER_SERVER_H_
