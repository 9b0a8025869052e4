#include "worker/training/trainer.h"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/float_env.h"
#include "common/logging.h"
#include "common/binary_metrics.h"
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
  if (consistency.model() == v1::ConsistencySpec::LOCAL) {
    // The servers see rounds: each push is a round's pseudo-gradient,
    // collected under BSP, or under SSP with `staleness` rounds of slack.
    v1::ConsistencySpec rounds;
    rounds.set_model(consistency.staleness() > 0 ? v1::ConsistencySpec::SSP : v1::ConsistencySpec::BSP);
    rounds.set_staleness(consistency.staleness());
    *spec.mutable_consistency() = rounds;
  }
  for (const models::Table& t : model.tables()) {
    v1::TableSpec* ts = spec.add_tables();
    *ts = t.spec;
    // Under local steps the job's optimizer is the outer one, for rounds'
    // pseudo-gradients; sparse rows are pushed by every step and trained by
    // the servers with the inner optimizer.
    const bool per_step_rows = t.sparse && consistency.model() == v1::ConsistencySpec::LOCAL;
    *ts->mutable_optimizer() = per_step_rows ? consistency.inner_optimizer() : optimizer;
  }
  return spec;
}

absl::StatusOr<compute::InnerOptimizer> InnerOptimizerFromSpec(const v1::OptimizerSpec& spec) {
  compute::InnerOptimizer o;
  switch (spec.kind()) {
    case v1::OptimizerSpec::KIND_UNSPECIFIED:
    case v1::OptimizerSpec::SGD: o.kind = compute::InnerOptimizer::Kind::kSgd; break;
    case v1::OptimizerSpec::MOMENTUM: o.kind = compute::InnerOptimizer::Kind::kMomentum; break;
    case v1::OptimizerSpec::ADAM: o.kind = compute::InnerOptimizer::Kind::kAdam; break;
    case v1::OptimizerSpec::ADAMW: o.kind = compute::InnerOptimizer::Kind::kAdamW; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("consistency.inner_optimizer.kind: ",
                                                     v1::OptimizerSpec::Kind_Name(spec.kind()),
                                                     " cannot run on a worker; allowed: sgd, momentum, adam, adamw"));
  }
  if (spec.learning_rate() > 0) o.learning_rate = spec.learning_rate();
  o.momentum = spec.momentum();
  o.nesterov = spec.nesterov();
  if (spec.beta1() > 0) o.beta1 = spec.beta1();
  if (spec.beta2() > 0) o.beta2 = spec.beta2();
  if (spec.epsilon() > 0) o.epsilon = spec.epsilon();
  o.weight_decay = spec.weight_decay();
  return o;
}

bool AllowsPrefetch(const v1::ConsistencySpec& c) {
  return c.model() == v1::ConsistencySpec::ASP || (c.model() == v1::ConsistencySpec::SSP && c.staleness() >= 1);
}

Trainer::Trainer(models::Model* model, PsClient* client, TrainerOptions options)
    : progressive_(options.progressive_window), model_(model), client_(client), options_(std::move(options)) {
  for (Staging& st : staging_) {
    st.value.resize(model_->tables().size());
    st.grad.resize(model_->tables().size());
    st.keys.resize(model_->tables().size());
  }
}

Trainer::~Trainer() {
  Drain();
  model_->set_on_gradient(nullptr);
}

void Trainer::Drain() {
  (void)FinishRounds();
  if (prefetch_) {
    prefetch_->done.Wait();
    prefetch_.reset();
  }
  for (InFlightPush& p : pushes_) p.done.Wait();
  pushes_.clear();
}

absl::Status Trainer::Stage(int set, bool values, bool grads, bool sparse_only) {
  // Only `set`'s buffers may grow (sparse tables' rows vary by batch): the
  // other set's may be in flight.
  compute::Backend* be = model_->backend();
  Staging& st = staging_[set];
  for (size_t i = 0; i < model_->tables().size(); ++i) {
    if (sparse_only && !model_->tables()[i].sparse) continue;
    const size_t bytes = std::max<size_t>(64, model_->tables()[i].elements * 4);
    for (compute::Buffer* b : {values ? &st.value[i] : nullptr, grads ? &st.grad[i] : nullptr}) {
      if (b == nullptr || (b->data() != nullptr && b->bytes() >= bytes)) continue;
      b->Reset();
      // Grow by half again so batches of slightly more keys do not reallocate.
      ASSIGN_OR_RETURN(*b, be->AllocateHost(bytes + bytes / 2));
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Pull(const PullBatch& pull, Future<absl::Status>* f) {
  absl::Status s = f != nullptr ? f->Wait() : client_->Pull(options_.job_id, pull);
  for (;;) {
    // A consistency wait that ran out (the client's pull_wait_timeout) is
    // asked again until the trainer is stopped: a slow or replaced rank is
    // waited for, and a stop reaches a blocked wait within one timeout.
    if (s.code() != absl::StatusCode::kDeadlineExceeded || options_.stop == nullptr) return s;
    if (options_.stop->load()) return absl::CancelledError("training stopped");
    s = client_->Pull(options_.job_id, pull);
  }
}

PullBatch Trainer::PullFor(uint64_t step, int set, bool dense, bool sparse) {
  PullBatch pull;
  pull.step = step;
  pull.exact = step == exact_clock_;
  auto& tables = model_->tables();
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    float* out = staging_[set].value[i].as<float>();
    if (t.sparse) {
      if (sparse && !t.keys.empty()) pull.sparse.push_back({t.spec.name(), t.keys.data(), t.keys.size(), out});
    } else if (dense) {
      pull.dense.push_back({t.spec.name(), out, t.elements});
    }
  }
  return pull;
}

absl::Status Trainer::CopyToDevice(int set) {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  for (size_t i = 0; i < tables.size(); ++i) {
    if (!be->is_gpu()) {
      // The CPU's device memory is host memory: hand the pulled buffer to
      // the model instead of copying it (Stage regrows the one handed back).
      std::swap(tables[i].value, staging_[set].value[i]);
      continue;
    }
    RETURN_IF_ERROR(be->CopyToDevice(tables[i].value.data(), staging_[set].value[i].data(), tables[i].elements * 4));
  }
  return absl::OkStatus();
}

absl::Status Trainer::LoadParameters(uint64_t step, bool prefetch_next) {
  const int set = static_cast<int>(step % 2);
  if (prefetch_ && prefetch_->step != step) Drain();  // not for this step
  RETURN_IF_ERROR(Stage(set, /*values=*/true, /*grads=*/false));
  bool have_dense = false;
  if (prefetch_) {
    Prefetch p = std::move(*prefetch_);
    prefetch_.reset();
    RETURN_IF_ERROR(Pull(p.pull, &p.done));
    have_dense = true;
  }
  PullBatch now = PullFor(step, set, /*dense=*/!have_dense, /*sparse=*/true);
  if (!now.dense.empty() || !now.sparse.empty()) RETURN_IF_ERROR(Pull(now));
  RETURN_IF_ERROR(CopyToDevice(set));
  if (prefetch_next) {
    // The other set's values were copied to the device a step ago; its
    // grads belong to pushes, which pulls do not touch.
    RETURN_IF_ERROR(Stage(1 - set, /*values=*/true, /*grads=*/false));  // dense: sized once
    Prefetch p{step + 1, PullFor(step + 1, 1 - set, /*dense=*/true, /*sparse=*/false), {}};
    if (!p.pull.dense.empty()) {
      prefetch_ = std::move(p);
      prefetch_->done = client_->PullAsync(options_.job_id, prefetch_->pull);
    }
  }
  return absl::OkStatus();
}

void Trainer::HintNext(const data::Prefetcher& prefetch) {
  if (!options_.prefetch_hints) return;
  auto& tables = model_->tables();
  bool spills = false;
  for (const models::Table& t : tables) spills = spills || (t.sparse && t.spec.has_storage());
  if (!spills) return;
  const data::Batch* next = prefetch.Peek();
  if (next == nullptr) return;
  ahead_.clear();
  model_->AheadKeys(*next, &ahead_);
  std::vector<SparseTarget> hint;
  for (const auto& [i, keys] : ahead_) {
    if (i < tables.size() && tables[i].spec.has_storage() && !keys->empty()) {
      hint.push_back({tables[i].spec.name(), keys->data(), keys->size(), nullptr});
    }
  }
  if (!hint.empty()) client_->Prefetch(options_.job_id, hint);
}

absl::Status Trainer::PushGroup(const std::vector<size_t>& group, bool last) {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  Staging& st = staging_[step_ % 2];
  for (size_t i : group) {
    if (!be->is_gpu()) {
      // Host memory already: take the gradient buffer and give the model
      // this set's free one for its next backward.
      std::swap(tables[i].grad, st.grad[i]);
      continue;
    }
    RETURN_IF_ERROR(be->CopyToHost(st.grad[i].data(), tables[i].grad.data(), tables[i].elements * 4));
  }
  RETURN_IF_ERROR(be->Synchronize());
  PushBatch push;
  push.step = step_;
  push.last = last;
  push.lr_scale = options_.lr_scaling.At(step_);
  for (size_t i : group) {
    models::Table& t = tables[i];
    if (t.sparse) {
      // The keys must outlive the push, which may still fly when the next
      // batch's keys replace the model's.
      st.keys[i] = t.keys;
      if (!t.keys.empty()) push.sparse.push_back({t.spec.name(), st.keys[i].data(), st.keys[i].size(), st.grad[i].as<float>()});
    } else {
      push.dense.push_back({t.spec.name(), st.grad[i].as<float>(), t.elements});
    }
  }
  pushes_.push_back({step_, client_->PushAsync(options_.job_id, push)});
  return absl::OkStatus();
}

absl::Status Trainer::ClipGradients(models::Metrics* m) {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  double sum = 0;
  for (models::Table& t : tables) {
    if (t.elements == 0) continue;
    ASSIGN_OR_RETURN(double s, be->SumSquares(t.elements, t.grad.as<float>()));
    sum += s;
  }
  const double norm = std::sqrt(sum);
  m->grad_norm = norm;
  // A NaN or Inf norm is left alone: the servers refuse such a push by name.
  if (!(norm > options_.clip_global_norm) || !std::isfinite(norm)) return absl::OkStatus();
  const float factor = static_cast<float>(options_.clip_global_norm / norm);
  for (models::Table& t : tables) {
    if (t.elements != 0) RETURN_IF_ERROR(be->Scale(t.elements, factor, t.grad.as<float>()));
  }
  m->clipped = true;
  return absl::OkStatus();
}

absl::Status Trainer::WaitPushes(uint64_t before) {
  absl::Status first;
  size_t kept = 0;
  for (size_t k = 0; k < pushes_.size(); ++k) {
    if (pushes_[k].step < before) {
      first.Update(pushes_[k].done.Wait());
    } else {
      pushes_[kept++] = std::move(pushes_[k]);
    }
  }
  pushes_.resize(kept);
  return first;
}

absl::StatusOr<models::Metrics> Trainer::RunAndPush(const data::Batch& batch) {
  auto& tables = model_->tables();
  // The step's gradients stage in set step % 2, free once the caller waited
  // for the pushes of step - 2.
  RETURN_IF_ERROR(Stage(static_cast<int>(step_ % 2), /*values=*/false, /*grads=*/true));
  // Dense tables go in groups as backward finishes them; sparse rows (their
  // keys change every batch) and whatever is left form the last group,
  // sent after Run.
  std::vector<bool> pushed(tables.size(), false);
  size_t unpushed = tables.size();
  std::vector<size_t> ready;
  size_t ready_bytes = 0;
  // With clipping the scale is known once backward ends: one group after it.
  const bool clip = options_.clip_global_norm > 0;
  bool announced = false;
  model_->set_on_gradient([&](size_t i) -> absl::Status {
    // Backward has begun: the step's push follows within it (PsClient::
    // ExpectPush lets servers that sleep between requests wake meanwhile).
    if (!announced) {
      announced = true;
      client_->ExpectPush();
    }
    if (!clip) {
      if (i >= tables.size() || pushed[i] || tables[i].sparse) return absl::OkStatus();
      ready.push_back(i);
      ready_bytes += tables[i].elements * 4;
      if (ready_bytes < options_.min_push_group_bytes || ready.size() == unpushed) return absl::OkStatus();
      for (size_t k : ready) pushed[k] = true;
      unpushed -= ready.size();
      absl::Status s = PushGroup(ready, /*last=*/false);
      ready.clear();
      ready_bytes = 0;
      return s;
    }
    return absl::OkStatus();
  });
  absl::StatusOr<models::Metrics> m = model_->Run(batch, /*train=*/true);
  model_->set_on_gradient(nullptr);
  if (!m.ok()) return m.status();
  if (clip) RETURN_IF_ERROR(ClipGradients(&*m));
  std::vector<size_t> rest;
  for (size_t i = 0; i < tables.size(); ++i) {
    if (!pushed[i]) rest.push_back(i);
  }
  RETURN_IF_ERROR(PushGroup(rest, /*last=*/true));
  return m;
}

void Trainer::CloseStep(const StepTiming& t, const models::Metrics& m, EpochResult* result) {
  // Waits for batches as the training thread saw them: the prefetcher's
  // own count misses a consumer preempted inside Next.
  result->data_wait_seconds += t.data_wait;
  result->pull_wait_seconds += t.pull;
  result->compute_seconds += t.compute;
  result->prepare_seconds += t.prepare;
  result->push_wait_seconds += t.push;
  if (options_.on_step) options_.on_step(step_, m, t);
  ++step_;
  ++result->steps;
  result->skipped_steps += m.skipped;
  for (const models::Table& table : model_->tables()) {
    if (table.sparse) result->sparse_rows_pulled += static_cast<int64_t>(table.keys.size());
  }
  Accumulate(m, &result->train);
}

void Trainer::AucSamples::Add(const models::Metrics& m, const data::Batch& batch) {
  const size_t n = std::min(m.scores.size(), static_cast<size_t>(batch.size));
  if (n == 0 || scores.size() >= kMaxAucExamples) return;
  const float* y = batch.label_data();
  for (size_t i = 0; i < n && scores.size() < kMaxAucExamples; ++i) {
    scores.push_back(m.scores[i]);
    labels.push_back(y[i]);
  }
}

void Trainer::NoteScores(const models::Metrics& m, const data::Batch& batch) {
  train_auc_.Add(m, batch);
  const size_t n = std::min(m.scores.size(), static_cast<size_t>(batch.size));
  if (n > 0) progressive_.Add(m.scores.data(), batch.label_data(), n);
}

double Trainer::AucSamples::Auc() const { return scores.empty() ? 0 : fulcrum::Auc(scores, labels); }

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

absl::Status Trainer::Flush() {
  absl::Status s = FinishRounds();
  s.Update(WaitPushes(UINT64_MAX));
  return s;
}

absl::StatusOr<std::string> Trainer::DenseFingerprint() {
  RETURN_IF_ERROR(Flush());
  Drain();
  RETURN_IF_ERROR(Stage(0, /*values=*/true, /*grads=*/false));
  PullBatch pull = PullFor(clock(), 0, /*dense=*/true, /*sparse=*/false);
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

absl::StatusOr<data::PrefetchOptions> Trainer::PipelineOptions(const data::Dataset& data, int batch_size) {
  data::PrefetchOptions po;
  po.batch_size = batch_size;
  po.depth = options_.prefetch_depth;
  po.threads = options_.decode_threads;
  po.upload = options_.upload;
  po.distinct_keys = model_->wants_distinct_keys();
  po.host_work = model_->HostWork();
  ASSIGN_OR_RETURN(po.device, DeviceDataFor(data));
  return po;
}

absl::StatusOr<EpochResult> Trainer::TrainEpoch(const data::Dataset& train, int epoch, int64_t start_batch) {
  const auto t0 = Clock::now();
  // The CPU backend's kernels run on this thread (and OpenBLAS's, with one
  // compute thread): keep denormal activations and gradients from costing
  // a microcode assist each (common/float_env.h).
  ScopedFlushDenormals flush;
  ASSIGN_OR_RETURN(data::PrefetchOptions po, PipelineOptions(train, options_.batch_size));
  po.pool = &batch_pool_;
  std::vector<int64_t> order =
      data::ShardOrder(train.size(), options_.rank, options_.world_size, options_.seed, epoch, options_.shuffle);
  const size_t skip = std::min(order.size(), static_cast<size_t>(std::max<int64_t>(0, start_batch)) * options_.batch_size);
  order.erase(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(skip));
  data::Prefetcher prefetch(&train, std::move(order), epoch, po, model_->backend());
  EpochResult result;
  result.epoch = epoch;
  train_auc_ = AucSamples();
  int64_t steps = prefetch.num_batches();
  if (options_.max_steps_per_epoch >= 0) {
    steps = std::min(steps, std::max<int64_t>(0, options_.max_steps_per_epoch - start_batch));
  }
  absl::Status s = [&]() -> absl::Status {
    if (local()) return TrainLocal(prefetch, steps, &result);
    while (result.steps < steps) {
      if (options_.stop != nullptr && options_.stop->load()) return absl::CancelledError("training stopped");
      const auto t_data = Clock::now();
      ASSIGN_OR_RETURN(std::unique_ptr<data::Batch> batch, prefetch.Next());
      if (!batch) break;
      HintNext(prefetch);
      const auto t_batch = Clock::now();
      RETURN_IF_ERROR(model_->Prepare(*batch));
      const auto a = Clock::now();
      RETURN_IF_ERROR(LoadParameters(step_, options_.prefetch_parameters && result.steps + 1 < steps));
      const auto b = Clock::now();
      // This step's gradients reuse the staging set of step - 2: its pushes
      // must be done (with prefetching they complete in the background).
      RETURN_IF_ERROR(WaitPushes(step_ >= 1 ? step_ - 1 : 0));
      const auto c = Clock::now();
      ASSIGN_OR_RETURN(models::Metrics m, RunAndPush(*batch));
      const auto d = Clock::now();
      // Without prefetching the next pull needs this push applied (BSP), so
      // wait for it now; otherwise it completes while the next step runs.
      if (!options_.prefetch_parameters) RETURN_IF_ERROR(WaitPushes(step_ + 1));
      const auto e = Clock::now();
      StepTiming t;
      t.data_wait = std::chrono::duration<double>(t_batch - t_data).count();
      t.prepare = std::chrono::duration<double>(a - t_batch).count();
      t.pull = std::chrono::duration<double>(b - a).count();
      t.compute = std::chrono::duration<double>(d - c).count();
      t.push = std::chrono::duration<double>((c - b) + (e - d)).count();
      t.total = std::chrono::duration<double>(e - t_data).count();
      CloseStep(t, m, &result);
      NoteScores(m, *batch);
      prefetch.Recycle(std::move(batch));
    }
    // The epoch's results (evaluation, fingerprints) include every push.
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(WaitPushes(UINT64_MAX));
    result.push_wait_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    return absl::OkStatus();
  }();
  if (!s.ok()) {
    Drain();
    return s;
  }
  Finish(model_->task(), &result.train);
  result.train.auc = train_auc_.Auc();
  train_auc_ = AucSamples();
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  result.samples_per_second = result.seconds > 0 ? result.train.examples / result.seconds : 0;
  return result;
}

absl::StatusOr<const data::DeviceData*> Trainer::DeviceDataFor(const data::Dataset& dataset) {
  auto it = on_device_.find(&dataset);
  if (it != on_device_.end() && it->second.size == dataset.size()) return it->second.data.get();
  std::string why;
  ASSIGN_OR_RETURN(std::unique_ptr<data::DeviceData> on,
                   data::DeviceData::Upload(dataset, model_->backend(), options_.device_data,
                                            options_.device_data_share, &why));
  FLOG(INFO) << options_.job_id << ": " << dataset.source() << ": "
             << (on != nullptr ? "batches built on the device from " : "batches decoded on the host by ")
             << (on != nullptr ? why : absl::StrCat(options_.decode_threads, " thread(s): ", why));
  OnDevice& slot = on_device_[&dataset];
  slot.size = dataset.size();
  slot.data = std::move(on);
  return slot.data.get();
}

absl::StatusOr<EvalResult> Trainer::Evaluate(const data::Dataset& test) {
  // An overlapped round in flight: its result first. It becomes the
  // replica, so the next epoch's first round starts without another pull.
  RETURN_IF_ERROR(LandRounds());
  ScopedFlushDenormals flush;
  ASSIGN_OR_RETURN(const data::PrefetchOptions po, PipelineOptions(test, std::max(options_.batch_size, 256)));
  data::Prefetcher prefetch(&test, data::ShardOrder(test.size(), 0, 1, 0, 0, /*shuffle=*/false), 0, po,
                            model_->backend());
  EvalResult r;
  AucSamples auc;
  bool sparse = false;
  for (const models::Table& t : model_->tables()) sparse = sparse || t.sparse;
  bool loaded = false;
  for (;;) {
    ASSIGN_OR_RETURN(std::unique_ptr<data::Batch> batch, prefetch.Next());
    if (!batch) break;
    if (sparse) HintNext(prefetch);
    RETURN_IF_ERROR(model_->Prepare(*batch));
    // Evaluation reads the parameters as of this rank's clock (the first
    // pull waits for the consistency model; later ones are then ready);
    // dense-only models load their tables once.
    if (sparse || !loaded) RETURN_IF_ERROR(LoadParameters(clock(), /*prefetch_next=*/false));
    loaded = true;
    ASSIGN_OR_RETURN(models::Metrics m, model_->Run(*batch, /*train=*/false));
    Accumulate(m, &r);
    auc.Add(m, *batch);
    prefetch.Recycle(std::move(batch));
  }
  Finish(model_->task(), &r);
  r.auc = auc.Auc();
  return r;
}

}  // namespace fulcrum::training
