// Several ranks training MNIST in one process: the CPU backend, a real
// ParameterServer core behind LocalPsClient, one thread per rank. Shared by
// the tests of the consistency models' convergence (local steps, stale
// gradients).
#ifndef FULCRUM_TESTS_TESTING_MNIST_TRAINING_H_
#define FULCRUM_TESTS_TESTING_MNIST_TRAINING_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fulcrum/v1/common.pb.h"
#include "worker/data/dataset.h"
#include "worker/ps_client.h"

namespace fulcrum::testing {

struct Mnist {
  std::unique_ptr<data::Dataset> train_all, test;
  std::unique_ptr<data::Dataset> train;  // every `every`-th training example
};
Mnist LoadMnist(int every);

v1::OptimizerSpec Opt(v1::OptimizerSpec::Kind kind, float lr, float momentum = 0, bool nesterov = false);

// Rounds as the ranks push them: each push's samples, and how far a rank's
// pushes led the slowest rank's when it started pushing another.
struct RoundLog {
  absl::Mutex mu;
  std::vector<int64_t> pushed ABSL_GUARDED_BY(mu);
  std::vector<std::vector<uint64_t>> samples ABSL_GUARDED_BY(mu);
  std::vector<int64_t> max_lead ABSL_GUARDED_BY(mu);
  int64_t pulls ABSL_GUARDED_BY(mu) = 0;  // every rank's together
};

// A rank's client as its trainer sees it. A slowed rank sleeps `delay`
// before each push, as a slower device reaches it later. With `lag` > 0 a
// push is held (copied) and sent once the rank pushes a step `lag` later,
// as a device whose pushes are still in flight while it computes ahead:
// its gradients reach the servers `lag` steps stale. Pushes are logged
// into `log` when one is given, and pulls counted there.
class ShapedClient final : public PsClient {
 public:
  ShapedClient(PsClient* inner, int rank, absl::Duration delay, uint64_t lag, RoundLog* log)
      : inner_(inner), rank_(rank), delay_(delay), lag_(lag), log_(log) {}
  absl::Status CreateJob(const v1::PsJobSpec& spec) override { return inner_->CreateJob(spec); }
  absl::Status OpenJob(const std::string& job_id) override { return inner_->OpenJob(job_id); }
  absl::Status DeleteJob(const std::string& job_id) override { return inner_->DeleteJob(job_id); }
  Future<absl::Status> PullAsync(const std::string& job_id, const PullBatch& batch) override {
    if (log_ != nullptr) {
      absl::MutexLock lock(&log_->mu);
      ++log_->pulls;
    }
    return inner_->PullAsync(job_id, batch);
  }
  Future<absl::Status> PushAsync(const std::string& job_id, const PushBatch& batch) override;
  // Sends the pushes still held.
  absl::Status Flush(const std::string& job_id);

 private:
  struct Held {
    PushBatch batch;
    std::vector<std::vector<float>> dense;  // the batch's gradients, copied
  };
  absl::Status Send(const std::string& job_id, const PushBatch& batch);

  PsClient* const inner_;
  const int rank_;
  const absl::Duration delay_;
  const uint64_t lag_;
  RoundLog* const log_;
  absl::Mutex mu_;
  std::deque<Held> held_ ABSL_GUARDED_BY(mu_);
};

// How the ranks train beyond optimizer, H and epochs. Per-step training
// (sync_every 0) runs under `per_step`; local rounds (sync_every > 0)
// under SSP with `staleness` rounds, or BSP at 0.
struct Mixed {
  v1::ConsistencySpec::Model per_step = v1::ConsistencySpec::BSP;
  int staleness = 0;
  bool staleness_aware_lr = false;
  int slow_rank = -1;      // rank `slow_rank`'s pushes come `slow_delay` late
  absl::Duration slow_delay;
  uint64_t lag_steps = 0;  // every rank's pushes reach the servers this stale
  RoundLog* log = nullptr;
};

struct Outcome {
  std::vector<float> weights;  // dense0.weight after training
  double test_accuracy = 0;
  double seconds = 0;
  uint64_t clock = 0;
};

// Trains `workers` ranks of a 784-`hidden`-10 MLP for `epochs` on one
// in-process server. `outer` is the servers' optimizer; sync_every 0 means
// per-step training.
Outcome Train(const Mnist& d, int workers, int epochs, int batch, const v1::OptimizerSpec& outer, int sync_every,
              const v1::OptimizerSpec& inner, int64_t max_steps = -1, bool overlap = false, const Mixed& mixed = {},
              int hidden = 64);

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_MNIST_TRAINING_H_
