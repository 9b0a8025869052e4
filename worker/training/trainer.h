// Trainer: the training loop of one worker rank. Each step pulls the
// parameters its batch needs (whole dense tables, the batch's sparse rows),
// runs the model's forward and backward on the backend, and pushes the
// gradients; the servers apply the optimizer. Data comes from a Prefetcher
// over the rank's shard. Works over any PsClient: the gRPC client in a
// worker daemon, LocalPsClient in a single process.
//
// Communication overlaps compute where the consistency model allows:
//   - Per-layer push (every model): gradients go out in groups as backward
//     finishes them (the last layer's while the earlier layers' backward
//     runs), a group once it holds min_push_group_bytes.
//   - Under SSP (bound >= 1) and ASP (prefetch_parameters): the dense tables
//     for step s+1 are pulled while step s computes, and step s's push
//     completes in the background while step s+1 runs (one step in flight,
//     double-buffered). The parameters a step uses may then lack this
//     worker's own previous step, a staleness of 1 the bound already allows.
//     Sparse rows are pulled with their batch (its keys are known only
//     then).
//   - Under BSP (and SSP(0)) a step's parameters need every worker's
//     previous step. With prefetch_parameters the pull for step s+1 still
//     goes out when step s starts, and the servers hold it until step s is
//     applied: the parameters are exactly those of a pull sent after the
//     push, but the request is already waiting when the step is applied,
//     which saves a round trip per step.
#ifndef FULCRUM_WORKER_TRAINING_TRAINER_H_
#define FULCRUM_WORKER_TRAINING_TRAINER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/bounded_executor.h"
#include "common/future.h"
#include "fulcrum/v1/common.pb.h"
#include "worker/data/dataset.h"
#include "worker/data/device_data.h"
#include "worker/data/pipeline.h"
#include "worker/models/model.h"
#include "worker/ps_client.h"
#include "worker/training/auto_batch.h"
#include "worker/training/progressive.h"

namespace fulcrum::training {

// Where one step's wall time went, in seconds (they add up to `total`).
struct StepTiming {
  double data_wait = 0;  // waiting for the prefetcher's batch
  double prepare = 0;    // the model's host work on the batch (keys, bags) and its uploads
  double pull = 0;       // waiting for parameters
  double compute = 0;    // forward + backward (gradient pushes start during it)
  double push = 0;       // waiting for pushes to be acknowledged
  double total = 0;
};

struct TrainerOptions {
  std::string job_id;
  int batch_size = 64;
  uint64_t seed = 1;
  int rank = 0;
  int world_size = 1;
  int prefetch_depth = 4;
  // Send each next batch's keys ahead to servers whose tables keep rows on
  // disk (storage.spill), so they read them before the pull (HintNext).
  // Off by default: with the tier's files in the page cache they cost more
  // than they save (docs/embeddings.md, "Reading ahead").
  bool prefetch_hints = false;
  // Threads decoding batches on the host (data::DefaultDecodeThreads).
  int decode_threads = 1;
  // Datasets kept on the device in their stored form (data/device_data.h),
  // when they fit in this share of the device's memory; the choice is logged
  // once per dataset.
  data::DeviceDataMode device_data = data::DeviceDataMode::kAuto;
  double device_data_share = 0.25;
  // Datasets that stay on the host: dense batches start their upload on
  // the backend's upload stream once staged (PrefetchOptions::upload).
  data::PrefetchOptions::Upload upload = data::PrefetchOptions::Upload::kAuto;
  bool shuffle = true;
  int64_t max_steps_per_epoch = -1;  // -1: the whole shard
  // Pull step s+1's dense parameters when step s starts, and let pushes
  // complete in the background. Under SSP (bound >= 1) and ASP the servers
  // answer at once (AllowsPrefetch); under BSP they hold the pull until
  // step s is applied. Needs a PsClient whose PullAsync does not block.
  bool prefetch_parameters = false;
  // Backward's gradients are pushed in groups of at least this many bytes
  // as they become ready (the rest when backward ends). 0: every table as
  // soon as it is ready; SIZE_MAX: all at the end.
  size_t min_push_group_bytes = 256 << 10;
  // Clip each step's gradients to this global L2 norm (over every table)
  // before pushing them; 0: off. The norm needs the whole backward, so with
  // clipping a step's gradients go out in one group after it.
  float clip_global_norm = 0;
  // The learning-rate factor each step's push carries (batch_size auto's
  // linear scaling and warm-up); 1 by default.
  LrScaling lr_scaling;
  // Local steps (consistency LOCAL): rounds of sync_every inner steps with
  // `inner` on the device, then one push of the round's pseudo-gradient
  // (start minus end weights) and one pull; 0: every step pushes and pulls.
  int sync_every = 0;
  compute::InnerOptimizer inner;
  // Local steps, overlapped: round r's push and the pull of its result run
  // while round r + 1 computes; the result is merged into the replica at
  // round r + 1's end (replica = servers' weights + this round's progress),
  // a one-round delay. Each epoch's last round is waited for.
  bool overlap_rounds = false;
  // Called after every step with the step's metrics and where its time went.
  std::function<void(uint64_t step, const models::Metrics&, const struct StepTiming&)> on_step;
  // Checked before every step and between consistency waits (see Pull);
  // when set, TrainEpoch returns CANCELLED.
  const std::atomic<bool>* stop = nullptr;
  // Binary tasks: examples in progressive validation's window (0: its
  // default; progressive()).
  uint64_t progressive_window = 0;
};

struct EvalResult {
  int64_t examples = 0;
  double loss = 0;       // mean per example
  double accuracy = 0;   // classification and binary tasks
  double rmse = 0;       // regression
  double auc = 0;        // binary tasks (Metrics::scores), over at most kMaxAucExamples
};

// The examples an epoch's or an evaluation's AUC is computed over, at most
// (the first ones; 12 bytes each are kept).
inline constexpr size_t kMaxAucExamples = size_t{1} << 21;

struct EpochResult {
  int epoch = 0;
  int64_t steps = 0;
  int64_t skipped_steps = 0;   // fp16 overflow
  EvalResult train;            // over this epoch's batches, as trained
  double seconds = 0;
  double data_wait_seconds = 0;  // time steps waited for the prefetcher
  double pull_wait_seconds = 0;  // time steps waited for parameters
  double push_wait_seconds = 0;  // time steps waited for their pushes
  double compute_seconds = 0;    // forward + backward
  double prepare_seconds = 0;    // the model's host work on each batch (Model::Prepare)
  // Local steps: of the pull and push waits, the time the rounds' ends and
  // starts spent on device-side copies and updates of the anchor and the
  // replica (microseconds on a GPU, milliseconds on the CPU backend).
  double round_device_seconds = 0;
  double samples_per_second = 0;
  int64_t sparse_rows_pulled = 0;  // rows of sparse tables pulled, over the steps
};

// Whether a consistency model lets the servers answer a worker's pull of
// step s+1's parameters before its step s push is applied (the parameters
// may then lack that step): SSP with a bound >= 1, and ASP. Under BSP and
// SSP(0) such a pull waits at the servers instead.
bool AllowsPrefetch(const v1::ConsistencySpec& c);

// A job's consistency.inner_optimizer as the worker runs it; INVALID_ARGUMENT
// for kinds that have no device implementation (adagrad, ftrl).
absl::StatusOr<compute::InnerOptimizer> InnerOptimizerFromSpec(const v1::OptimizerSpec& spec);

// The PsJobSpec for a model's tables with one optimizer for all of them.
v1::PsJobSpec JobSpecFor(models::Model& model, const std::string& job_id, const v1::OptimizerSpec& optimizer,
                         const v1::ConsistencySpec& consistency, uint32_t num_workers);

class Trainer {
 public:
  Trainer(models::Model* model, PsClient* client, TrainerOptions options);
  // Waits for pushes and pulls still in flight (they write its buffers).
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains one epoch of this rank's shard, from batch `start_batch` (a
  // worker resuming a lost rank mid-epoch skips what its predecessor did).
  absl::StatusOr<EpochResult> TrainEpoch(const data::Dataset& train, int epoch, int64_t start_batch = 0);
  // Forward only over the whole dataset with the parameters as of this
  // rank's clock (under BSP: every worker's steps so far applied).
  absl::StatusOr<EvalResult> Evaluate(const data::Dataset& test);
  // Waits for everything this trainer has in flight: per-step pushes, and
  // the last overlapped local round of an epoch, which stays in flight
  // while the next epoch's first round computes. Call before reading the
  // servers' weights after TrainEpoch. DenseFingerprint calls it; Evaluate
  // waits for the rounds.
  absl::Status Flush();
  // Steps per epoch of this rank's shard (equal for every rank).
  int64_t StepsPerEpoch(const data::Dataset& train) const;
  // Binary tasks: every trained batch's scores, taken before its gradients
  // were pushed, over the trailing progressive_window examples of this
  // rank (progressive validation, worker/training/progressive.h). Read on
  // the training thread (TrainerOptions::on_step).
  const ProgressiveWindow& progressive() const { return progressive_; }
  // Pulls every dense table at this rank's clock and hashes its fp32 bytes
  // (FNV-1a 64, tables in order): equal hashes mean bit-identical weights.
  absl::StatusOr<std::string> DenseFingerprint();

  uint64_t step() const { return step_; }
  void set_step(uint64_t step) { step_ = step; }
  // The servers' clock for this rank: its steps, or under local steps its
  // rounds (each epoch ends a round, so an epoch has ceil(steps / H)).
  uint64_t clock() const { return local() ? round_ : step_; }
  bool local() const { return options_.sync_every > 0; }
  // The step a rank resumes at when the servers hold `clock` of its pushes.
  uint64_t StepOfClock(uint64_t clock, int64_t steps_per_epoch) const;
  void ResumeAtClock(uint64_t clock, int64_t steps_per_epoch);
  // A BSP replacement's first step (or local round): its pulls at `clock`
  // want the weights of exactly that clock (PullBatch::exact), so a step its
  // predecessor left torn between servers fails with a TornStepError rather
  // than training on newer weights.
  void set_exact_pull_clock(uint64_t clock) { exact_clock_ = clock; }

 private:
  // Staging buffers: two sets (steps alternate) so one step's push and the
  // next step's prefetched pull can be in flight while another computes.
  // On the CPU backend the buffers are swapped with the model's instead of
  // copied.
  struct Staging {
    std::vector<compute::Buffer> value, grad;  // one per table
    std::vector<std::vector<uint64_t>> keys;   // sparse tables' keys of the push in flight
  };

  // Waits for `f`; a consistency wait that ran out (DEADLINE_EXCEEDED) is
  // asked again synchronously with `pull` until `stop` is set.
  absl::Status Pull(const PullBatch& pull, Future<absl::Status>* f = nullptr);
  // The pull of `set`'s buffers for `step`: dense tables, and with `sparse`
  // the batch's rows.
  PullBatch PullFor(uint64_t step, int set, bool dense, bool sparse);
  // Fills the model's tables for the step about to run (from a prefetched
  // pull when there is one for it) and, when allowed, starts the next
  // step's prefetch.
  absl::Status LoadParameters(uint64_t step, bool prefetch_next);
  // Sends the keys of the batch after the one just taken, where it is
  // decoded already, as a prefetch hint (PsClient::Prefetch), for the
  // sparse tables that keep rows on disk (storage.spill).
  void HintNext(const data::Prefetcher& prefetch);
  absl::Status CopyToDevice(int set);
  // Runs forward and backward, pushing gradient groups as they are ready
  // (the caller has waited for the pushes of step - 2).
  absl::StatusOr<models::Metrics> RunAndPush(const data::Batch& batch);
  // A finished step: its times and metrics into the epoch's, on_step, the clock.
  void CloseStep(const StepTiming& t, const models::Metrics& m, EpochResult* result);
  // Local steps: an epoch's loop, a round's start (pull, anchor), one
  // inner step, a round's end (push the pseudo-gradient).
  absl::Status TrainLocal(data::Prefetcher& prefetch, int64_t steps, EpochResult* result);
  absl::Status BeginRound();
  absl::StatusOr<models::Metrics> LocalStep(const data::Batch& batch);
  absl::Status EndRound();
  absl::Status EndRoundOverlapped();
  // Its steps: the pseudo-gradient handed to the sender thread (after the
  // previous round's push), the previous round's result merged into the
  // replica, and the pull of this round's result posted.
  absl::Status SendRoundPush();
  absl::Status MergePulledRound();
  absl::Status PostRoundPull();
  // Table i's buffer among `buffers` (host or device), grown to fit it.
  absl::StatusOr<float*> RoundBuffer(std::vector<compute::Buffer>& buffers, size_t i, bool device);
  // A local step's sparse rows: pulled before it (after this rank's previous
  // rows landed) and their gradients pushed after it, both unclocked, in
  // staging set 1 (rounds stage dense tables in set 0).
  absl::Status PullRows();
  absl::Status PushRows();
  // Waits for the round push and pull in flight (overlapped rounds); the
  // next round starts from a fresh pull.
  absl::Status FinishRounds();
  // As FinishRounds, but the pulled result becomes the replica and the next
  // round's start, so training goes on without another pull (the
  // evaluation between epochs).
  absl::Status LandRounds();
  // Table i's replica becomes the round result pulled last: on the CPU
  // swapped in from the host buffer; on a GPU copied from its upload
  // (`uploaded`) or, when the pull was asked again, from the host buffer.
  absl::Status TakePulled(size_t i, bool uploaded);
  // Scales every table's gradient down to options_.clip_global_norm when
  // their global L2 norm is larger; records the norm in *m.
  absl::Status ClipGradients(models::Metrics* m);
  // Pushes `tables`' gradients of this step from staging set step % 2.
  absl::Status PushGroup(const std::vector<size_t>& tables, bool last);
  // Waits for the pushes of steps < `before`; the first error wins.
  absl::Status WaitPushes(uint64_t before);
  // Waits for everything in flight, ignoring errors (cleanup paths).
  void Drain();
  // Sizes `set`'s value and/or grad buffers for this step's tables.
  absl::Status Stage(int set, bool values, bool grads, bool sparse_only = false);
  static void Accumulate(const models::Metrics& m, EvalResult* r);
  // Binary tasks: a batch's scores and labels toward an AUC.
  struct AucSamples {
    std::vector<double> scores;
    std::vector<float> labels;
    void Add(const models::Metrics& m, const data::Batch& batch);
    double Auc() const;
  };
  AucSamples train_auc_;
  // A trained batch's scores toward the epoch's AUC and the progressive window.
  void NoteScores(const models::Metrics& m, const data::Batch& batch);
  ProgressiveWindow progressive_;
  static void Finish(models::Task task, EvalResult* r);

  models::Model* model_;
  PsClient* client_;
  TrainerOptions options_;
  uint64_t step_ = 0;
  uint64_t exact_clock_ = ~uint64_t{0};  // set_exact_pull_clock
  // Local steps: rounds pushed, inner steps in the current round, inner
  // updates so far (Adam's count), and per table the round's start weights
  // and the inner optimizer's state, on the device.
  uint64_t round_ = 0;
  int in_round_ = 0;
  uint64_t round_samples_ = 0;  // the samples of the round's steps so far
  double round_device_seconds_ = 0;  // EpochResult::round_device_seconds, so far
  uint64_t inner_updates_ = 0;
  std::vector<compute::Buffer> anchor_, inner_m_, inner_v_;
  // Overlapped rounds: whether the replica has started (the first round
  // pulls), and the previous round's push and its result's pull in flight
  // with their host buffers.
  bool rounds_started_ = false;
  std::optional<Future<absl::Status>> round_push_, round_pull_;
  std::vector<compute::Buffer> push_host_, pull_host_;
  // On a GPU the round's copies run beside the next round's compute, on
  // their own streams: the pseudo-gradient is copied to push_dev_ and
  // downloaded from there (push_ready_ marks its arrival, which the sender
  // waits for); a pulled result is uploaded into pull_dev_[round % 2] as
  // soon as it arrives (pull_ready_), and the merge copies it from there.
  // Two pull buffers, so an upload never overwrites the one a merge still
  // reads.
  std::vector<compute::Buffer> push_dev_, pull_dev_[2];
  std::vector<compute::UploadEvent> push_ready_, pull_ready_;
  // Overlapped rounds: sends a round's push (one at a time), so its host
  // work runs while the next round computes. Created on first use.
  std::unique_ptr<BoundedExecutor> round_sender_;
  // Training batches kept from one epoch's pipeline to the next.
  data::BatchPool batch_pool_;
  Staging staging_[2];
  struct InFlightPush {
    uint64_t step;
    Future<absl::Status> done;
  };
  std::vector<InFlightPush> pushes_;
  struct Prefetch {
    uint64_t step;   // into staging set step % 2
    PullBatch pull;  // kept alive while in flight
    Future<absl::Status> done;
  };
  std::optional<Prefetch> prefetch_;
  std::vector<std::pair<size_t, const std::vector<uint64_t>*>> ahead_;  // HintNext's scratch
  // The datasets on the device, by dataset (null: kept on the host).
  struct OnDevice {
    size_t size = 0;
    std::unique_ptr<data::DeviceData> data;
  };
  std::map<const data::Dataset*, OnDevice> on_device_;
  absl::StatusOr<const data::DeviceData*> DeviceDataFor(const data::Dataset& dataset);
  // The pipeline's options for `data` in batches of `batch_size`, as the
  // training epochs and evaluation share them.
  absl::StatusOr<data::PrefetchOptions> PipelineOptions(const data::Dataset& data, int batch_size);
};

}  // namespace fulcrum::training

#endif  // FULCRUM_WORKER_TRAINING_TRAINER_H_
