#include "worker/training/trainer.h"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/pipeline.h"

namespace fulcrum::training {

using Clock = std::chrono::steady_clock;

v1::PsJobSpec JobSpecFor(models::Model& model, const std::string& job_id, const v1::OptimizerSpec& optimizer,
                         const v1::ConsistencySpec& consistency, uint32_t num_workers) {
  v1::PsJobSpec spec;
  spec.set_job_id(job_id);
  spec.set_num_workers(num_workers);
  *spec.mutable_consistency() = consistency;
  for (const models::Table& t : model.tables()) {
    v1::TableSpec* ts = spec.add_tables();
    *ts = t.spec;
    *ts->mutable_optimizer() = optimizer;
  }
  return spec;
}

Trainer::Trainer(models::Model* model, PsClient* client, TrainerOptions options)
    : model_(model), client_(client), options_(std::move(options)) {
  host_value_.resize(model_->tables().size());
  host_grad_.resize(model_->tables().size());
}

absl::Status Trainer::Stage() {
  compute::Backend* be = model_->backend();
  for (size_t i = 0; i < model_->tables().size(); ++i) {
    const size_t bytes = std::max<size_t>(64, model_->tables()[i].elements * 4);
    for (compute::Buffer* b : {&host_value_[i], &host_grad_[i]}) {
      if (b->data() != nullptr && b->bytes() >= bytes) continue;
      b->Reset();
      // Grow by half again so batches of slightly more keys do not reallocate.
      ASSIGN_OR_RETURN(*b, be->AllocateHost(bytes + bytes / 2));
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Pull(const PullBatch& pull) {
  for (;;) {
    absl::Status s = client_->Pull(options_.job_id, pull);
    // A consistency wait that ran out (the client's pull_wait_timeout) is
    // asked again until the trainer is stopped: a slow or replaced rank is
    // waited for, and a stop reaches a blocked wait within one timeout.
    if (s.code() != absl::StatusCode::kDeadlineExceeded || options_.stop == nullptr) return s;
    if (options_.stop->load()) return absl::CancelledError("training stopped");
  }
}

absl::Status Trainer::LoadParameters(uint64_t pull_step) {
  RETURN_IF_ERROR(Stage());
  PullBatch pull;
  pull.step = pull_step;
  auto& tables = model_->tables();
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (t.sparse) {
      if (!t.keys.empty()) pull.sparse.push_back({t.spec.name(), t.keys.data(), t.keys.size(), host_value_[i].as<float>()});
    } else {
      pull.dense.push_back({t.spec.name(), host_value_[i].as<float>(), t.elements});
    }
  }
  RETURN_IF_ERROR(Pull(pull));
  compute::Backend* be = model_->backend();
  for (size_t i = 0; i < tables.size(); ++i) {
    RETURN_IF_ERROR(be->CopyToDevice(tables[i].value.data(), host_value_[i].data(), tables[i].elements * 4));
  }
  return absl::OkStatus();
}

absl::Status Trainer::PushGradients() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  for (size_t i = 0; i < tables.size(); ++i) {
    RETURN_IF_ERROR(be->CopyToHost(host_grad_[i].data(), tables[i].grad.data(), tables[i].elements * 4));
  }
  RETURN_IF_ERROR(be->Synchronize());
  PushBatch push;
  push.step = step_;
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (t.sparse) {
      if (!t.keys.empty()) push.sparse.push_back({t.spec.name(), t.keys.data(), t.keys.size(), host_grad_[i].as<float>()});
    } else {
      push.dense.push_back({t.spec.name(), host_grad_[i].as<float>(), t.elements});
    }
  }
  return client_->Push(options_.job_id, push);
}

// Sums while running; Finish turns the sums into means.
void Trainer::Accumulate(const models::Metrics& m, EvalResult* r) {
  r->examples += m.examples;
  r->loss += m.loss_sum;
  r->accuracy += static_cast<double>(m.correct);
}

void Trainer::Finish(models::Task task, EvalResult* r) {
  if (r->examples == 0) return;
  r->loss /= r->examples;
  if (task == models::Task::kRegression) {
    r->accuracy = 0;
    r->rmse = std::sqrt(2 * r->loss);  // the regression loss is (pred - y)^2 / 2
  } else {
    r->accuracy /= r->examples;
  }
}

int64_t Trainer::StepsPerEpoch(const data::Dataset& train) const {
  const int64_t n = static_cast<int64_t>(
      data::ShardOrder(train.size(), options_.rank, options_.world_size, options_.seed, 0, options_.shuffle).size());
  int64_t steps = (n + options_.batch_size - 1) / options_.batch_size;
  if (options_.max_steps_per_epoch >= 0) steps = std::min(steps, options_.max_steps_per_epoch);
  return steps;
}

absl::StatusOr<std::string> Trainer::DenseFingerprint() {
  RETURN_IF_ERROR(Stage());
  PullBatch pull;
  pull.step = step_;
  auto& tables = model_->tables();
  for (size_t i = 0; i < tables.size(); ++i) {
    if (!tables[i].sparse) pull.dense.push_back({tables[i].spec.name(), host_value_[i].as<float>(), tables[i].elements});
  }
  RETURN_IF_ERROR(Pull(pull));
  uint64_t h = 1469598103934665603ull;
  for (const DenseTarget& t : pull.dense) {
    const auto* b = reinterpret_cast<const unsigned char*>(t.out);
    for (size_t k = 0; k < t.size * sizeof(float); ++k) h = (h ^ b[k]) * 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return std::string(buf);
}

absl::StatusOr<EpochResult> Trainer::TrainEpoch(const data::Dataset& train, int epoch, int64_t start_batch) {
  const auto t0 = Clock::now();
  data::PrefetchOptions po;
  po.batch_size = options_.batch_size;
  po.depth = options_.prefetch_depth;
  std::vector<int64_t> order =
      data::ShardOrder(train.size(), options_.rank, options_.world_size, options_.seed, epoch, options_.shuffle);
  const size_t skip = std::min(order.size(), static_cast<size_t>(std::max<int64_t>(0, start_batch)) * options_.batch_size);
  order.erase(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(skip));
  data::Prefetcher prefetch(&train, std::move(order), epoch, po, model_->backend());
  EpochResult result;
  result.epoch = epoch;
  const int64_t limit = options_.max_steps_per_epoch < 0 ? -1 : std::max<int64_t>(0, options_.max_steps_per_epoch - start_batch);
  for (;;) {
    if (limit >= 0 && result.steps >= limit) break;
    if (options_.stop != nullptr && options_.stop->load()) return absl::CancelledError("training stopped");
    ASSIGN_OR_RETURN(std::unique_ptr<data::Batch> batch, prefetch.Next());
    if (!batch) break;
    RETURN_IF_ERROR(model_->Prepare(*batch));
    RETURN_IF_ERROR(LoadParameters(step_));
    ASSIGN_OR_RETURN(models::Metrics m, model_->Run(*batch, /*train=*/true));
    RETURN_IF_ERROR(PushGradients());
    if (options_.on_step) options_.on_step(step_, m);
    ++step_;
    ++result.steps;
    result.skipped_steps += m.skipped;
    Accumulate(m, &result.train);
    prefetch.Recycle(std::move(batch));
  }
  Finish(model_->task(), &result.train);
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  result.data_wait_seconds = prefetch.wait_seconds();
  result.samples_per_second = result.seconds > 0 ? result.train.examples / result.seconds : 0;
  return result;
}

absl::StatusOr<EvalResult> Trainer::Evaluate(const data::Dataset& test) {
  data::PrefetchOptions po;
  po.batch_size = std::max(options_.batch_size, 256);
  po.depth = options_.prefetch_depth;
  data::Prefetcher prefetch(&test, data::ShardOrder(test.size(), 0, 1, 0, 0, /*shuffle=*/false), 0, po,
                            model_->backend());
  EvalResult r;
  bool sparse = false;
  for (const models::Table& t : model_->tables()) sparse = sparse || t.sparse;
  bool loaded = false;
  for (;;) {
    ASSIGN_OR_RETURN(std::unique_ptr<data::Batch> batch, prefetch.Next());
    if (!batch) break;
    RETURN_IF_ERROR(model_->Prepare(*batch));
    // Evaluation reads the parameters as of this rank's clock (the first
    // pull waits for the consistency model; later ones are then ready);
    // dense-only models load their tables once.
    if (sparse || !loaded) RETURN_IF_ERROR(LoadParameters(step_));
    loaded = true;
    ASSIGN_OR_RETURN(models::Metrics m, model_->Run(*batch, /*train=*/false));
    Accumulate(m, &r);
    prefetch.Recycle(std::move(batch));
  }
  Finish(model_->task(), &r);
  return r;
}

}  // namespace fulcrum::training
