// Trainer: the training loop of one worker rank. Each step pulls the
// parameters its batch needs (whole dense tables, the batch's sparse rows),
// runs the model's forward and backward on the backend, and pushes the
// gradients; the servers apply the optimizer. Data comes from a Prefetcher
// over the rank's shard. Works over any PsClient: the gRPC client in a
// worker daemon, LocalPsClient in a single process.
#ifndef FULCRUM_WORKER_TRAINING_TRAINER_H_
#define FULCRUM_WORKER_TRAINING_TRAINER_H_

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fulcrum/v1/common.pb.h"
#include "worker/data/dataset.h"
#include "worker/models/model.h"
#include "worker/ps_client.h"

namespace fulcrum::training {

struct TrainerOptions {
  std::string job_id;
  int batch_size = 64;
  uint64_t seed = 1;
  int rank = 0;
  int world_size = 1;
  int prefetch_depth = 4;
  bool shuffle = true;
  int64_t max_steps_per_epoch = -1;  // -1: the whole shard
  // Called after every step with the step's metrics.
  std::function<void(uint64_t step, const models::Metrics&)> on_step;
  // Checked before every step and between consistency waits (see Pull);
  // when set, TrainEpoch returns CANCELLED.
  const std::atomic<bool>* stop = nullptr;
};

struct EvalResult {
  int64_t examples = 0;
  double loss = 0;       // mean per example
  double accuracy = 0;   // classification and binary tasks
  double rmse = 0;       // regression
};

struct EpochResult {
  int epoch = 0;
  int64_t steps = 0;
  int64_t skipped_steps = 0;   // fp16 overflow
  EvalResult train;            // over this epoch's batches, as trained
  double seconds = 0;
  double data_wait_seconds = 0;  // time steps waited for the prefetcher
  double samples_per_second = 0;
};

// The PsJobSpec for a model's tables with one optimizer for all of them.
v1::PsJobSpec JobSpecFor(models::Model& model, const std::string& job_id, const v1::OptimizerSpec& optimizer,
                         const v1::ConsistencySpec& consistency, uint32_t num_workers);

class Trainer {
 public:
  Trainer(models::Model* model, PsClient* client, TrainerOptions options);

  // Trains one epoch of this rank's shard, from batch `start_batch` (a
  // worker resuming a lost rank mid-epoch skips what its predecessor did).
  absl::StatusOr<EpochResult> TrainEpoch(const data::Dataset& train, int epoch, int64_t start_batch = 0);
  // Forward only over the whole dataset with the parameters as of this
  // rank's clock (under BSP: every worker's steps so far applied).
  absl::StatusOr<EvalResult> Evaluate(const data::Dataset& test);
  // Steps per epoch of this rank's shard (equal for every rank).
  int64_t StepsPerEpoch(const data::Dataset& train) const;
  // Pulls every dense table at this rank's clock and hashes its fp32 bytes
  // (FNV-1a 64, tables in order): equal hashes mean bit-identical weights.
  absl::StatusOr<std::string> DenseFingerprint();

  uint64_t step() const { return step_; }
  void set_step(uint64_t step) { step_ = step; }

 private:
  // PsClient::Pull, retried on DEADLINE_EXCEEDED while `stop` is given and unset.
  absl::Status Pull(const PullBatch& pull);
  absl::Status LoadParameters(uint64_t pull_step);
  absl::Status PushGradients();
  absl::Status Stage();
  static void Accumulate(const models::Metrics& m, EvalResult* r);
  static void Finish(models::Task task, EvalResult* r);

  models::Model* model_;
  PsClient* client_;
  TrainerOptions options_;
  uint64_t step_ = 0;
  std::vector<compute::Buffer> host_value_, host_grad_;  // staging, one per table
};

}  // namespace fulcrum::training

#endif  // FULCRUM_WORKER_TRAINING_TRAINER_H_
