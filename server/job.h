// Job: one training job's tables, quota and consistency state on one server.
//
// Push validates everything first (tables, shapes, dtypes, ownership, finite
// values), then applies per the job's consistency model:
//   ASP  apply on arrival;
//   SSP  apply on arrival, and advance the worker's clock;
//   BSP  buffer until every active worker's push for the step arrived, then
//        combine in rank order (bit-for-bit reproducible) and apply once.
// Pull validates, then waits (asynchronously, no thread blocked) until the
// model allows the caller's clock, or fails DEADLINE_EXCEEDED naming what it
// waited for. Thread-safe.
#ifndef FULCRUM_SERVER_JOB_H_
#define FULCRUM_SERVER_JOB_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
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
#include "server/dedup.h"
#include "server/job_metrics.h"
#include "server/table.h"

namespace fulcrum {

class ParallelRunner;

using PullCallback = std::function<void(absl::StatusOr<PullResult>)>;

// A job's state on one server at one instant: what a checkpoint writes.
struct JobState {
  uint64_t step = 0;                 // BSP: steps < step applied (else the slowest clock)
  std::vector<uint64_t> rank_clock;  // per rank: steps taken from it in order
  struct Dense {
    const DenseTable* table;
    std::vector<DenseTable::ChunkState> chunks;
  };
  struct Sparse {
    const SparseTable* table;
    std::vector<SparseTable::ShardState> shards;  // copied at the cut
    // Or: the virtual shards the cut's writer copies one at a time
    // (SparseTable::CaptureShard), with training held.
    std::vector<uint32_t> stream;
    // With a cut of the cold tier: the table's SparseTable::MoveMarks just
    // before it, for CaptureShard.
    std::vector<uint64_t> marks;
  };
  std::vector<Dense> dense;    // tables in name order
  std::vector<Sparse> sparse;
  // The cut of the server's cold tier the sparse records link to (empty:
  // none); the store's writer owns it: it commits it with the cut or
  // removes it.
  std::string cold_cut_dir;
  // How long training on this server was held while the state was taken
  // (BSP: from reaching the boundary to releasing it; not the wait for it).
  double pause_seconds = 0;
  // The copies' bytes, counted against the job's quota while this lives.
  PoolHold copies;
  // BSP with a streamed table: training is held from `paused` until
  // Job::EndCapture (held_step: the boundary held).
  bool held = false;
  uint64_t held_step = 0;
  absl::Time paused;
};

class Job : public std::enable_shared_from_this<Job> {
 public:
  // Validates the spec; INVALID_ARGUMENT names the field. `cold_tier`:
  // the server's disk tier, which tables with storage.spill spill into (in
  // spaces of their own, dropped when the job goes); null on a server
  // without a data directory, where such a table is FAILED_PRECONDITION.
  // `runner`: the server's threads for a BSP step's dense chunks (null:
  // they are applied on the calling thread).
  static absl::StatusOr<std::shared_ptr<Job>> Create(const v1::PsJobSpec& spec,
                                                     uint32_t num_virtual_shards,
                                                     uint64_t default_quota_bytes,
                                                     DeadlineTimer* timer,
                                                     std::shared_ptr<MemoryQuota> memory_pool = nullptr,
                                                     ColdTier* cold_tier = nullptr,
                                                     std::shared_ptr<ParallelRunner> runner = nullptr);
  ~Job();

  const v1::PsJobSpec& spec() const { return spec_; }
  const std::string& id() const { return spec_.job_id(); }

  // Creates the dense chunks `self` owns under `map` (RESOURCE_EXHAUSTED over quota).
  absl::Status MaterializeOwned(const ShardMap& map, uint32_t self);

  absl::Status Push(const PushMessage& m, const ShardMap& map, uint32_t self, PushResult* out);
  // `done` runs exactly once, possibly on another thread.
  void Pull(std::shared_ptr<const PullMessage> m, std::shared_ptr<const ShardMap> map,
            uint32_t self, absl::Time deadline, PullCallback done);

  // Fails every waiting pull with `reason` (on delete or shutdown).
  void Shutdown(const absl::Status& reason);
  // Marks which ranks take part in BSP/SSP (all by default). For the
  // coordinator, when a worker is declared dead or rejoins.
  absl::Status SetActiveWorkers(const std::vector<uint32_t>& ranks);

  v1::GetJobResponse Stats() const;
  // Counters and histograms the server updates and exports.
  JobMetrics& metrics() const { return metrics_; }
  // Renders the job's series (label job=<id>) into a scrape.
  void CollectMetrics(metrics::Scrape* out) const;
  // Each sparse table's rows, bytes and lifecycle counts on this server.
  std::vector<v1::SparseTableStats> SparseTableStats() const;

  // Captures this server's part of the job for a checkpoint. BSP: exactly
  // at the boundary before step `at_step` (steps < at_step applied, none
  // after): waits until `deadline` for it, holding step at_step back while
  // the state is taken; FAILED_PRECONDITION once at_step was applied.
  // SSP/ASP (at_step ignored): now, each chunk and shard consistent in
  // itself, the clocks read first. Dense chunks are shared copy-on-write.
  // A sparse table's rows are copied, the copy counted against the job's
  // quota while the state lives, so the pause lasts as long as the copy;
  // a capped table, or one whose copy does not fit the quota, is left to
  // be copied a shard at a time as the cut is written (JobState::Sparse::
  // stream): under BSP training then stays held until EndCapture.
  // `cold_cut_dir` (tables that spill; empty: none): where the server's
  // cold tier is cut (hard links) as the state is taken, so the cut's
  // records leave the shards' rows on disk there (JobState::cold_cut_dir;
  // a shard whose rows on disk moved after that has them copied in). A
  // tier that cannot be cut, or a directory already there, means copies.
  absl::StatusOr<JobState> Capture(uint64_t at_step, absl::Time deadline, const std::string& cold_cut_dir = "");
  // Releases training held by Capture (nothing when none is held); sets
  // state->pause_seconds. The caller calls it once the cut is written,
  // also when the write failed.
  absl::Status EndCapture(JobState* state);
  // Restoring a checkpoint into a fresh job: tables, then the clocks.
  absl::Status RestoreDense(const std::string& table, uint32_t chunk, uint64_t updates, uint32_t length, uint32_t slots,
                            const void* block);
  // `step`: the cut's, when the restored rows count as last used unless
  // the record carries the shard's lifecycle (`life`).
  absl::Status RestoreSparse(const std::string& table, uint32_t vshard, uint32_t dim, uint32_t slots, size_t n,
                             const uint64_t* keys, const uint32_t* updates, const float* rows, uint64_t step = 0,
                             const SparseShardLife* life = nullptr);
  absl::Status RestoreClocks(uint64_t step, const std::vector<uint64_t>& rank_clock);
  uint64_t bytes_used() const { return quota_.used(); }
  // Refuses pushes and pulls of incarnations below `n` from now on (a job
  // restored from a checkpoint fences off the run it rolled back).
  void set_min_incarnation(uint32_t n) { min_incarnation_.store(n); }

 private:
  enum class Model { kBsp, kSsp, kAsp };

  // A validated dense gradient: outside BSP a view of the received bytes,
  // widened block by block as it is checked and applied; under BSP decoded
  // to fp32 in `grads`, to be combined with the other workers' later.
  struct DenseItem {
    DenseTable* table;
    uint32_t chunk;
    float* g = nullptr;              // BSP: in `grads`, summed into in place
    const Payload* src = nullptr;    // ASP/SSP: the message's bytes
    DType dtype = DType::kFp32;
  };
  // The keys of one sparse slice, decoded once and ordered by (virtual
  // shard, key, position), so every pass over them (ownership, row creation,
  // apply, read) walks the same runs without hashing or sorting again.
  struct KeyGroups {
    std::vector<uint64_t> keys;                      // request order
    std::vector<uint32_t> idx;                       // positions, grouped
    std::vector<std::pair<uint32_t, size_t>> runs;   // (virtual shard, end in idx)
  };
  struct SparseItem {
    SparseTable* table;
    KeyGroups groups;
    float* g;  // always in `grads`: duplicate keys are summed in place
  };
  // Decoding writes every element of a gradient buffer, so growing one need
  // not zero it first (under BSP each push allocates its own; the zeroing
  // was a memset of the whole model per step).
  template <typename T>
  struct UninitAllocator : std::allocator<T> {
    template <typename U>
    struct rebind {
      using other = UninitAllocator<U>;
    };
    template <typename U, typename... Args>
    void construct(U* p, Args&&... args) {
      if constexpr (sizeof...(Args) == 0) {
        ::new (static_cast<void*>(p)) U;
      } else {
        ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
      }
    }
  };
  using GradBuffer = std::vector<float, UninitAllocator<float>>;
  struct Decoded {
    GradBuffer grads;
    std::vector<DenseItem> dense;
    std::vector<SparseItem> sparse;
    uint64_t seq = 0;
    uint64_t step = 0;  // the push's step (the learning-rate schedule's)
    float lr_scale = 1.0f;  // the push's (PushMessage::lr_scale)
    uint64_t samples = 0;   // the push's (PushMessage::samples)
    // BSP: grads' bytes, held in the server's memory pool while buffered.
    PoolHold hold;
  };
  // A rank's parts of one step. A worker pushing layer by layer sends parts
  // with num_parts 0 ("more follow") and announces the total in its last
  // parts; the step is complete once the total is known and all arrived.
  struct RankStep {
    uint32_t num_parts = 0;  // 0 until announced
    uint32_t received = 0;
    // The rank's incarnation the parts came from. A worker that dies in the
    // middle of a step's parts leaves some here; its replacement sends the
    // whole step again, so a newer incarnation starts the step over.
    uint32_t incarnation = 0;
    std::vector<Decoded> parts;  // BSP only
    bool complete() const { return num_parts != 0 && received == num_parts; }
    bool empty() const { return num_parts == 0 && received == 0; }
  };
  struct Waiter {
    uint64_t step;
    uint32_t rank;
    std::string worker;
    absl::Time start;
    uint64_t timer_id = 0;
    std::function<void(absl::Status)> resume;
  };

  // Each rank's weight in a BSP step's mean: 1, unless every active rank's
  // parts carry samples and they differ (local steps' rounds of different
  // lengths); then the rank's samples times the ranks over their sum.
  static std::vector<float> RankWeights(const std::vector<RankStep>& ranks, const std::vector<bool>& active);

  Job(const v1::PsJobSpec& spec, Model model, uint64_t quota, DeadlineTimer* timer,
      std::shared_ptr<MemoryQuota> memory_pool);

  // The table `name`, which the request uses as dense (or sparse);
  // INVALID_ARGUMENT naming the table otherwise.
  absl::StatusOr<Table*> FindTable(const std::string& name, bool dense) const;
  KeyGroups GroupKeys(const SparseTable& table, std::vector<uint64_t> keys) const;
  // The shard-map mismatch error when `self` does not own `vshard`; `what`
  // names the chunk or key.
  absl::Status CheckOwned(uint32_t vshard, const std::string& what, const ShardMap& map,
                          uint32_t self, uint64_t request_version) const;
  // Push, in the order it runs them. CheckPush: the message's own fields.
  // AdmitPush: true for a push already taken (by its seq, or a step this
  // rank completed), with out->duplicate set: it is acknowledged; under BSP one too
  // far ahead, or from an inactive rank, is refused. PushRateScale: its
  // rate factor (samples' share outside BSP; staleness_aware_lr).
  // ChargeBufferedPush: a BSP push's buffer against the memory pool.
  // RecordPush: the part recorded, and what it completed applied (BSP) or
  // resumed.
  absl::Status CheckPush(const PushMessage& m) const;
  absl::StatusOr<bool> AdmitPush(const PushMessage& m, PushResult* out);
  float PushRateScale(const PushMessage& m);
  absl::Status ChargeBufferedPush(const PushMessage& m, Decoded* decoded);
  absl::Status RecordPush(const PushMessage& m, uint32_t num_parts, Decoded* decoded, PushResult* out);
  absl::Status Decode(const PushMessage& m, const ShardMap& map, uint32_t self, Decoded* out);
  // Decode's steps: every slice's table, shape and owner checked (returns
  // the floats to decode), the slices decoded into out->grads (dense ones
  // left in place unless `copy_dense`), then no NaN or Inf anywhere.
  absl::StatusOr<size_t> CheckSlices(const PushMessage& m, const ShardMap& map, uint32_t self,
                                     bool copy_dense) const;
  absl::Status DecodeSlices(const PushMessage& m, const ShardMap& map, uint32_t self, bool copy_dense,
                            Decoded* out) const;
  absl::Status CheckFinite(const PushMessage& m, const Decoded& d);
  // Creates every chunk and row a push touches, so applying it cannot fail
  // on quota part-way.
  absl::Status Prepare(const Decoded& d);
  absl::Status ApplyDecoded(Decoded& d);
  // Sums duplicate keys and applies each row once, shard by shard.
  absl::Status ApplySparse(SparseTable* table, const KeyGroups& groups, float* grads, uint64_t step,
                           float lr_scale = 1.0f);
  absl::Status ReadSparse(SparseTable* table, const KeyGroups& groups, float* out);
  // Validates a pull; fills `sparse` with the grouped keys of each sparse slice.
  absl::Status ValidatePull(const PullMessage& m, const ShardMap& map, uint32_t self,
                            std::vector<KeyGroups>* sparse) const;
  absl::StatusOr<PullResult> Serve(const PullMessage& m, const std::vector<KeyGroups>& sparse);
  // A prefetch hint (PullMessage::prefetch): the spilling tables read the
  // keys' rows on disk ahead (SparseTable::Prefetch).
  absl::Status Prefetch(const PullMessage& m, const std::vector<KeyGroups>& sparse);

  // Records one received part; returns true when (rank, step) became complete.
  // A part from an incarnation older than the parts held is refused
  // (FAILED_PRECONDITION); one from a newer incarnation discards them.
  bool RecordPartLocked(uint32_t rank, uint64_t step, uint32_t num_parts, uint32_t incarnation, Decoded* bsp_part,
                        absl::Status* error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReadyLocked(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool StepCompleteLocked(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps the applied step's gradient buffers in spare_grads_.
  void KeepSpareGradsLocked(std::vector<RankStep>& ranks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string WaitReasonLocked(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MinClockLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // staleness_aware_lr: 1 + the updates applied since `rank` pulled the
  // weights of `step` (or of the latest step before it it pulled); 1 when it
  // pulled none.
  uint64_t StalenessLocked(uint32_t rank, uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordReadLocked(uint32_t rank, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies complete BSP steps in order; returns waiters that became ready.
  absl::Status DrainBspSteps(std::vector<std::function<void(absl::Status)>>* ready)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Its two halves for one step, outside the lock: the ranks' parts summed
  // (weighted by their samples), then the optimizer over the sum.
  struct CombinedStep;
  void CombineStep(std::vector<RankStep>& ranks, const std::vector<bool>& active, CombinedStep* out);
  absl::Status ApplyCombined(CombinedStep& c, uint64_t step);
  // After an update outside the lock: with `drain`, applies the BSP steps
  // now complete; then resumes the waiters in `ready` (and those the drain
  // made ready).
  absl::Status Resume(bool drain, std::vector<std::function<void(absl::Status)>>* ready)
      ABSL_LOCKS_EXCLUDED(mu_);
  void CollectReadyLocked(std::vector<std::function<void(absl::Status)>>* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Expire(uint64_t waiter_id);

  const v1::PsJobSpec spec_;
  const Model model_;
  const uint32_t num_workers_;
  const uint32_t staleness_;
  const bool staleness_lr_;  // consistency.staleness_aware_lr (SSP/ASP)
  static constexpr size_t kMaxReadsPerRank = 64;
  const bool mean_;
  DeadlineTimer* const timer_;
  MemoryQuota quota_;
  // Gives `table` a space of `tier` (null: none on this server).
  absl::Status AttachColdTier(SparseTable* table, ColdTier* tier);
  // The disk tier's spaces of this job's spilling tables, dropped with it.
  ColdTier* cold_tier_ = nullptr;
  std::vector<uint32_t> cold_spaces_;
  std::shared_ptr<ParallelRunner> runner_;  // null: chunks apply serially
  uint32_t num_virtual_shards_ = 0;
  absl::flat_hash_map<std::string, std::unique_ptr<Table>> tables_;  // immutable after Create
  RecentRequestIds dedup_;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status shutdown_reason_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> active_ ABSL_GUARDED_BY(mu_);
  // BSP: first step not yet applied; steps below it are final.
  uint64_t applied_step_ ABSL_GUARDED_BY(mu_) = 0;
  bool applying_ ABSL_GUARDED_BY(mu_) = false;
  // SSP and ASP pushes that carry samples: their sum and count, whose ratio
  // is the mean a push's samples are weighed against.
  uint64_t samples_sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t samples_pushes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::vector<RankStep>> steps_ ABSL_GUARDED_BY(mu_);
  // BSP: the last applied step's decode buffers, reused by the next step's
  // pushes rather than allocated (and their pages faulted in) afresh: at
  // most one step's bytes, not counted against the memory pool.
  std::deque<GradBuffer> spare_grads_ ABSL_GUARDED_BY(mu_);
  uint64_t spare_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // SSP/ASP: per-rank clock (steps completed in order) and completed steps ahead of it.
  std::vector<uint64_t> clock_ ABSL_GUARDED_BY(mu_);
  std::vector<std::set<uint64_t>> done_ahead_ ABSL_GUARDED_BY(mu_);
  // SSP/ASP: (rank, step)s completed so far, the job's update count here.
  uint64_t updates_ ABSL_GUARDED_BY(mu_) = 0;
  // staleness_aware_lr: per rank, step -> updates_ when its pull was served.
  std::vector<std::map<uint64_t, uint64_t>> reads_ ABSL_GUARDED_BY(mu_);
  // BSP steps a capture holds back until it has taken the state.
  std::multiset<uint64_t> holds_ ABSL_GUARDED_BY(mu_);
  uint64_t next_waiter_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);

  // FAILED_PRECONDITION for a request of a fenced-off incarnation.
  absl::Status CheckIncarnation(uint32_t incarnation, const std::string& worker, uint32_t rank,
                                const char* what) const;

  mutable JobMetrics metrics_;
  std::atomic<uint32_t> min_incarnation_{0};
  std::atomic<uint64_t> pushes_applied_{0};
  std::atomic<uint64_t> unclocked_pushes_{0};  // of pushes_applied_: PushMessage::unclocked
  std::atomic<uint64_t> duplicates_{0};
  // Parts of a step left by a rank's lost incarnation, dropped when its
  // replacement sent the step again.
  std::atomic<uint64_t> superseded_parts_{0};
  std::atomic<uint64_t> rejected_nonfinite_{0};
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_JOB_H_
