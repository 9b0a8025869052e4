// batch_size: auto. A worker finds the batch its own device trains fastest
// with: it times training steps (forward and backward, no pushes) of growing
// batches, base_batch_size, 2x, 4x, ..., and keeps the largest batch that
//   - fits: its step's device memory stays under (1 - memory_headroom) of
//     the device's, and allocating it did not fail, and
//   - paid: it raised samples/s by at least min_gain over the batch before.
// The search stops at the first batch that fails either test, at
// max_batch_size, or at the rank's shard size.
//
// The learning rate then follows the linear scaling rule (Goyal et al.
// 2017, "Accurate, large minibatch SGD"): the spec's rate is meant for
// base_batch_size, so a batch k times larger trains at k times the rate,
// reached by a linear warm-up over warmup_steps that starts at the spec's
// rate. The factor travels with every push (PushRequest.lr_scale); the
// servers multiply the job's rate (and schedule) by it.
#ifndef FULCRUM_WORKER_TRAINING_AUTO_BATCH_H_
#define FULCRUM_WORKER_TRAINING_AUTO_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fulcrum/v1/cluster.pb.h"
#include "worker/compute/backend.h"
#include "worker/data/dataset.h"
#include "worker/models/model.h"

namespace fulcrum::training {

// A learning-rate factor with a linear warm-up from 1: At(step) = 1 +
// (factor - 1) * min(1, step / warmup_steps).
struct LrScaling {
  double factor = 1.0;
  uint64_t warmup_steps = 0;
  float At(uint64_t step) const;
};

struct AutoBatchOptions {
  int base_batch_size = 32;
  int max_batch_size = 65536;
  double min_gain = 0.10;
  double memory_headroom = 0.25;
  uint64_t warmup_steps = 200;
};
// The spec's values with the documented defaults for those left 0.
AutoBatchOptions AutoBatchOptionsFromSpec(const v1::AutoBatchSpec& spec);

// One batch size tried.
struct BatchTrial {
  int batch = 0;
  bool fits = true;               // false: allocation failed, or over the memory limit
  double samples_per_second = 0;  // measured when it fit
  size_t peak_bytes = 0;          // device memory held during its steps
  std::string note;               // why it does not fit
};

struct AutoBatchChoice {
  int batch = 0;
  LrScaling lr;
  std::vector<BatchTrial> trials;
  // One line for the log and the job's status: "batch 2048 (lr x64 over 200
  // warm-up steps): 512: 1.10M/s, 1024: 1.42M/s, 2048: 1.63M/s, 4096: 1.66M/s
  // (+2% < 10%)".
  std::string summary;
};

// Runs the search with `trial` measuring one batch size; `memory_bytes` is
// the device's. `limit` caps the batch (the rank's shard size). A trial's
// RESOURCE_EXHAUSTED status means the batch does not fit; other errors end
// the search with that error. FAILED_PRECONDITION when even the first batch
// does not fit.
using TrialFn = std::function<absl::StatusOr<BatchTrial>(int batch)>;
absl::StatusOr<AutoBatchChoice> ChooseBatchSize(const AutoBatchOptions& options, size_t memory_bytes,
                                                int64_t limit, const TrialFn& trial);

// The trial the worker runs: a model of `config` on `backend` trains `batch`
// examples of `data` (its first rows, repeated as needed) for at least
// `min_seconds` and 3 steps after one untimed step. Table values are zeros
// (the timing does not depend on them). Allocation failures are
// RESOURCE_EXHAUSTED.
absl::StatusOr<BatchTrial> MeasureBatch(compute::Backend* backend, const models::ModelConfig& config,
                                        const data::Dataset& data, int batch, double min_seconds = 0.2);

}  // namespace fulcrum::training

#endif  // FULCRUM_WORKER_TRAINING_AUTO_BATCH_H_
