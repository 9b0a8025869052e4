// The Trainer's local steps (consistency.model local): rounds of H inner
// steps on the device, the round's pseudo-gradient pushed at its end,
// waited for or overlapped with the next round (docs/consistency.md,
// "Local steps"). The rest of the Trainer is in trainer.cc.
#include <algorithm>
#include <chrono>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/pipeline.h"
#include "worker/training/trainer.h"

namespace fulcrum::training {

using Clock = std::chrono::steady_clock;

namespace {

// Adds the wall time of its scope to `*seconds`.
class ScopeTimer {
 public:
  explicit ScopeTimer(double* seconds) : seconds_(seconds), start_(std::chrono::steady_clock::now()) {}
  ~ScopeTimer() { *seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  double* const seconds_;
  const std::chrono::steady_clock::time_point start_;
};

}  // namespace

uint64_t Trainer::StepOfClock(uint64_t clock, int64_t steps_per_epoch) const {
  if (!local() || steps_per_epoch <= 0) return clock;
  const uint64_t spe = static_cast<uint64_t>(steps_per_epoch), h = static_cast<uint64_t>(options_.sync_every);
  const uint64_t rounds_per_epoch = (spe + h - 1) / h;
  return clock / rounds_per_epoch * spe + clock % rounds_per_epoch * h;
}

void Trainer::ResumeAtClock(uint64_t clock, int64_t steps_per_epoch) {
  step_ = StepOfClock(clock, steps_per_epoch);
  if (local()) {
    round_ = clock;
    in_round_ = 0;
    round_samples_ = 0;
  }
}

absl::Status Trainer::BeginRound() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  // The servers' weights after every round before this one (BSP) or within
  // the bound (SSP), as the replica's start and the pseudo-gradient's anchor.
  RETURN_IF_ERROR(Stage(0, /*values=*/true, /*grads=*/false));
  RETURN_IF_ERROR(Pull(PullFor(round_, 0, /*dense=*/true, /*sparse=*/false)));
  RETURN_IF_ERROR(CopyToDevice(0));
  anchor_.resize(tables.size());
  inner_m_.resize(tables.size());
  inner_v_.resize(tables.size());
  const int slots = options_.inner.slots();
  for (size_t i = 0; i < tables.size(); ++i) {
    if (tables[i].sparse) continue;  // rows go by step (PullRows, PushRows)
    const size_t bytes = std::max<size_t>(4, tables[i].elements * 4);
    if (anchor_[i].bytes() < bytes) {
      ASSIGN_OR_RETURN(anchor_[i], be->Allocate(bytes));
    }
    {
      ScopeTimer device(&round_device_seconds_);
      RETURN_IF_ERROR(be->Copy(anchor_[i].data(), tables[i].value.data(), tables[i].elements * 4));
    }
    // The inner optimizer's state lives on the device across rounds.
    for (int k = 0; k < slots; ++k) {
      compute::Buffer& b = k == 0 ? inner_m_[i] : inner_v_[i];
      if (b.bytes() >= bytes) continue;
      ASSIGN_OR_RETURN(b, be->Allocate(bytes));
      RETURN_IF_ERROR(be->Zero(b.data(), bytes));
    }
  }
  in_round_ = 0;
  round_samples_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<models::Metrics> Trainer::LocalStep(const data::Batch& batch) {
  compute::Backend* be = model_->backend();
  RETURN_IF_ERROR(PullRows());
  ASSIGN_OR_RETURN(models::Metrics m, model_->Run(batch, /*train=*/true));
  if (options_.clip_global_norm > 0) RETURN_IF_ERROR(ClipGradients(&m));
  ++inner_updates_;
  for (size_t i = 0; i < model_->tables().size(); ++i) {
    models::Table& t = model_->tables()[i];
    if (t.sparse) continue;
    RETURN_IF_ERROR(be->OptimizerUpdate(options_.inner, t.elements, t.value.as<float>(), t.grad.as<float>(),
                                        inner_m_[i].as<float>(), inner_v_[i].as<float>(), inner_updates_));
  }
  RETURN_IF_ERROR(PushRows());
  ++in_round_;
  round_samples_ += batch.size;
  return m;
}

absl::Status Trainer::PullRows() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  PullBatch pull;
  pull.step = step_;
  pull.unclocked = true;
  Staging& st = staging_[1];
  for (size_t i = 0; i < tables.size(); ++i) {
    const models::Table& t = tables[i];
    if (t.sparse && !t.keys.empty()) pull.sparse.push_back({t.spec.name(), t.keys.data(), t.keys.size(), nullptr});
  }
  if (pull.sparse.empty()) return absl::OkStatus();
  // This rank reads its own writes: the previous step's rows first (a push
  // of a few rows, sent while the next batch was prepared).
  RETURN_IF_ERROR(WaitPushes(UINT64_MAX));
  RETURN_IF_ERROR(Stage(1, /*values=*/true, /*grads=*/true, /*sparse_only=*/true));
  for (size_t i = 0, k = 0; i < tables.size(); ++i) {
    if (tables[i].sparse && !tables[i].keys.empty()) pull.sparse[k++].out = st.value[i].as<float>();
  }
  RETURN_IF_ERROR(Pull(pull));
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (!t.sparse || t.keys.empty()) continue;
    if (!be->is_gpu()) {
      std::swap(t.value, st.value[i]);  // host memory: the pulled rows as they are
      continue;
    }
    RETURN_IF_ERROR(be->CopyToDevice(t.value.data(), st.value[i].data(), t.elements * 4));
  }
  return absl::OkStatus();
}

absl::Status Trainer::PushRows() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  Staging& st = staging_[1];
  PushBatch push;
  push.step = step_;  // picks the inner optimizer's schedule, not a clock
  push.unclocked = true;
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (!t.sparse || t.keys.empty()) continue;
    if (!be->is_gpu()) {
      std::swap(t.grad, st.grad[i]);  // the model's next backward gets the free buffer
    } else {
      RETURN_IF_ERROR(be->CopyToHost(st.grad[i].data(), t.grad.data(), t.elements * 4));
    }
    st.keys[i] = t.keys;  // the push outlives the batch's keys
    push.sparse.push_back({t.spec.name(), st.keys[i].data(), st.keys[i].size(), st.grad[i].as<float>()});
  }
  if (push.sparse.empty()) return absl::OkStatus();
  if (be->is_gpu()) RETURN_IF_ERROR(be->Synchronize());
  pushes_.push_back({step_, client_->PushAsync(options_.job_id, push)});
  return absl::OkStatus();
}

absl::Status Trainer::EndRound() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  // The pseudo-gradient, start minus end weights, replaces the anchor.
  RETURN_IF_ERROR(Stage(0, /*values=*/false, /*grads=*/true));
  PushBatch push;
  push.step = round_;
  push.samples = round_samples_;
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (t.sparse) continue;
    {
      ScopeTimer device(&round_device_seconds_);
      RETURN_IF_ERROR(be->Axpy(t.elements, -1.0f, t.value.as<float>(), anchor_[i].as<float>()));
    }
    if (!be->is_gpu()) {
      // The CPU's device memory is host memory: push the anchor itself.
      push.dense.push_back({t.spec.name(), anchor_[i].as<float>(), t.elements});
      continue;
    }
    RETURN_IF_ERROR(be->CopyToHost(staging_[0].grad[i].data(), anchor_[i].data(), t.elements * 4));
    push.dense.push_back({t.spec.name(), staging_[0].grad[i].as<float>(), t.elements});
  }
  RETURN_IF_ERROR(be->Synchronize());
  Future<absl::Status> done = client_->PushAsync(options_.job_id, push);
  RETURN_IF_ERROR(done.Wait());
  ++round_;
  in_round_ = 0;
  round_samples_ = 0;
  return absl::OkStatus();
}

absl::Status Trainer::FinishRounds() {
  absl::Status s;
  if (round_push_) s.Update(round_push_->Wait());
  if (round_pull_) s.Update(round_pull_->Wait());
  round_push_.reset();
  round_pull_.reset();
  rounds_started_ = false;  // the next round starts from the servers' weights
  return s;
}

absl::Status Trainer::TakePulled(size_t i, bool uploaded) {
  compute::Backend* be = model_->backend();
  models::Table& t = model_->tables()[i];
  if (!be->is_gpu()) {
    std::swap(t.value, pull_host_[i]);  // the pulled weights, without a copy
    return absl::OkStatus();
  }
  if (!uploaded) return be->CopyToDevice(t.value.data(), pull_host_[i].data(), t.elements * 4);
  // The result of the pull posted at the previous round's end.
  RETURN_IF_ERROR(be->WaitForUpload(pull_ready_[i]));
  return be->Copy(t.value.data(), pull_dev_[(round_ - 1) % 2][i].data(), t.elements * 4);
}

absl::Status Trainer::LandRounds() {
  if (!round_pull_) return FinishRounds();
  absl::Status s;
  if (round_push_) s.Update(round_push_->Wait());
  s.Update(round_pull_->Wait());
  if (!s.ok()) return FinishRounds();
  round_push_.reset();
  round_pull_.reset();
  // No step ran since the round ended: the replica is the result as pulled
  // (the servers' weights at this rank's clock), and so is the next anchor.
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (t.sparse) continue;
    RETURN_IF_ERROR(TakePulled(i, /*uploaded=*/true));
    ScopeTimer device(&round_device_seconds_);
    RETURN_IF_ERROR(be->Copy(anchor_[i].data(), t.value.data(), t.elements * 4));
  }
  return absl::OkStatus();
}

absl::StatusOr<float*> Trainer::RoundBuffer(std::vector<compute::Buffer>& buffers, size_t i, bool device) {
  compute::Backend* be = model_->backend();
  const size_t bytes = std::max<size_t>(4, model_->tables()[i].elements * 4);
  if (buffers[i].bytes() < bytes) {
    ASSIGN_OR_RETURN(buffers[i], device ? be->Allocate(bytes) : be->AllocateHost(bytes));
  }
  return buffers[i].as<float>();
}

absl::Status Trainer::EndRoundOverlapped() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  // This round's pseudo-gradient into the anchor: start minus end weights.
  {
    ScopeTimer device(&round_device_seconds_);
    for (size_t i = 0; i < tables.size(); ++i) {
      models::Table& t = tables[i];
      if (!t.sparse) RETURN_IF_ERROR(be->Axpy(t.elements, -1.0f, t.value.as<float>(), anchor_[i].as<float>()));
    }
  }
  push_host_.resize(tables.size());
  pull_host_.resize(tables.size());
  if (be->is_gpu()) {
    push_dev_.resize(tables.size());
    for (auto& p : pull_dev_) p.resize(tables.size());
    push_ready_.resize(tables.size());
    pull_ready_.resize(tables.size());
  }
  RETURN_IF_ERROR(SendRoundPush());
  RETURN_IF_ERROR(MergePulledRound());
  ++round_;
  in_round_ = 0;
  return PostRoundPull();
}

absl::Status Trainer::SendRoundPush() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  // The previous round's push used the host buffers: it must be done.
  if (round_push_) {
    absl::Status s = round_push_->Wait();
    round_push_.reset();
    RETURN_IF_ERROR(s);
  }
  PushBatch push;
  push.step = round_;
  push.samples = round_samples_;
  round_samples_ = 0;
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (t.sparse) continue;
    ASSIGN_OR_RETURN(float* out, RoundBuffer(push_host_, i, /*device=*/false));
    if (!be->is_gpu()) {
      // The CPU's device memory is host memory: the pseudo-gradient's buffer
      // becomes the push's, and the push's last buffer the next anchor.
      std::swap(anchor_[i], push_host_[i]);
      push.dense.push_back({t.spec.name(), push_host_[i].as<float>(), t.elements});
      continue;
    }
    // A device-side copy (the anchor is rewritten below), then the download
    // on its own stream while the next round computes.
    ASSIGN_OR_RETURN(float* pseudo, RoundBuffer(push_dev_, i, /*device=*/true));
    RETURN_IF_ERROR(be->Copy(pseudo, anchor_[i].data(), t.elements * 4));
    RETURN_IF_ERROR(be->DownloadAsync(out, pseudo, t.elements * 4, &push_ready_[i]));
    push.dense.push_back({t.spec.name(), out, t.elements});
  }
  // Waiting for the download, then slicing and encoding the push (copies of
  // the whole model into shared memory or gRPC buffers) run on the sender
  // thread, while the next round computes.
  if (round_sender_ == nullptr) round_sender_ = std::make_unique<BoundedExecutor>("round pushes", 1, 1);
  Promise<absl::Status> sent;
  round_push_ = sent.future();
  absl::Status accepted =
      round_sender_->Submit([this, be, push = std::move(push), sent, downloads = push_ready_] {
        absl::Status landed;
        for (const compute::UploadEvent& e : downloads) landed.Update(be->WaitForDownload(e));
        sent.Set(landed.ok() ? client_->PushAsync(options_.job_id, push).Wait() : landed);
      });
  if (!accepted.ok()) round_push_.reset();
  return accepted;
}

absl::Status Trainer::MergePulledRound() {
  if (!round_pull_) return absl::OkStatus();
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  const bool host_memory = !be->is_gpu();
  // Merge the previous round's result: replica = its weights minus this
  // round's pseudo-gradient (this round's progress on top of them).
  absl::Status s = round_pull_->Wait();
  round_pull_.reset();
  // On a GPU the result is on the device already unless its pull failed.
  const bool uploaded = !host_memory && s.ok();
  // A consistency wait that ran out is asked again, as Pull does.
  if (s.code() == absl::StatusCode::kDeadlineExceeded) {
    PullBatch again;
    again.step = round_;
    for (size_t i = 0; i < tables.size(); ++i) {
      if (tables[i].sparse) continue;
      again.dense.push_back({tables[i].spec.name(), pull_host_[i].as<float>(), tables[i].elements});
    }
    s = Pull(again);
  }
  RETURN_IF_ERROR(s);
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (t.sparse) continue;
    // This round's pseudo-gradient: in the push's buffer on the CPU.
    const float* delta = host_memory ? push_host_[i].as<float>() : anchor_[i].as<float>();
    RETURN_IF_ERROR(TakePulled(i, uploaded));
    ScopeTimer device(&round_device_seconds_);
    RETURN_IF_ERROR(be->Axpy(t.elements, -1.0f, delta, t.value.as<float>()));
  }
  return absl::OkStatus();
}

absl::Status Trainer::PostRoundPull() {
  compute::Backend* be = model_->backend();
  auto& tables = model_->tables();
  // The next round starts here; the servers' weights after this round come
  // while it computes (under BSP once every rank pushed it).
  PullBatch pull;
  pull.step = round_;
  std::vector<std::tuple<void*, const void*, size_t>> uploads;  // device, host, bytes
  for (size_t i = 0; i < tables.size(); ++i) {
    models::Table& t = tables[i];
    if (t.sparse) continue;
    ASSIGN_OR_RETURN(float* in, RoundBuffer(pull_host_, i, /*device=*/false));
    pull.dense.push_back({t.spec.name(), in, t.elements});
    if (be->is_gpu()) {
      ASSIGN_OR_RETURN(float* dev, RoundBuffer(pull_dev_[(round_ - 1) % 2], i, /*device=*/true));
      uploads.emplace_back(dev, in, t.elements * 4);
    }
    ScopeTimer device(&round_device_seconds_);
    RETURN_IF_ERROR(be->Copy(anchor_[i].data(), t.value.data(), t.elements * 4));
  }
  Future<absl::Status> pulled = client_->PullAsync(options_.job_id, pull);
  if (!be->is_gpu()) {
    round_pull_ = pulled;
    return absl::OkStatus();
  }
  // On a GPU the result goes up to the device the moment it arrives, on the
  // upload stream, while this round still computes.
  Promise<absl::Status> up;
  round_pull_ = up.future();
  pulled.Then([be, up, uploads = std::move(uploads), events = &pull_ready_](const absl::Status& s) {
    absl::Status u = s;
    for (size_t i = 0; u.ok() && i < uploads.size(); ++i) {
      const auto& [dev, from, bytes] = uploads[i];
      u = be->UploadAsync(dev, from, bytes, &(*events)[i]);
    }
    // A failed upload is a failed pull: the merge then pulls and copies on
    // its own (DeadlineExceeded), or reports it.
    up.Set(s.ok() ? u : s);
  });
  return absl::OkStatus();
}

absl::Status Trainer::TrainLocal(data::Prefetcher& prefetch, int64_t steps, EpochResult* result) {
  round_device_seconds_ = 0;
  while (result->steps < steps) {
    if (options_.stop != nullptr && options_.stop->load()) return absl::CancelledError("training stopped");
    const auto t_data = Clock::now();
    ASSIGN_OR_RETURN(std::unique_ptr<data::Batch> batch, prefetch.Next());
    if (!batch) break;
    const auto t_batch = Clock::now();
    RETURN_IF_ERROR(model_->Prepare(*batch));
    const auto a = Clock::now();
    if (in_round_ == 0 && (!options_.overlap_rounds || !rounds_started_)) {
      RETURN_IF_ERROR(BeginRound());
      rounds_started_ = true;
    }
    const auto b = Clock::now();
    ASSIGN_OR_RETURN(models::Metrics m, LocalStep(*batch));
    // Overlapped rounds leave the step's inner update queued: the next
    // batch's host work runs while the device finishes it (the step's
    // metrics were read after its backward pass).
    if (!options_.overlap_rounds) RETURN_IF_ERROR(model_->backend()->Synchronize());
    const auto c = Clock::now();
    // A round ends after sync_every steps, and at the epoch's end (every
    // rank has the same steps per epoch, so the same rounds).
    const bool last = result->steps + 1 == steps;
    if (in_round_ >= options_.sync_every || last) {
      RETURN_IF_ERROR(options_.overlap_rounds ? EndRoundOverlapped() : EndRound());
    }
    const auto d = Clock::now();
    StepTiming t;
    t.data_wait = std::chrono::duration<double>(t_batch - t_data).count();
    t.prepare = std::chrono::duration<double>(a - t_batch).count();
    t.pull = std::chrono::duration<double>(b - a).count();
    t.compute = std::chrono::duration<double>(c - b).count();
    t.push = std::chrono::duration<double>(d - c).count();
    t.total = std::chrono::duration<double>(d - t_data).count();
    CloseStep(t, m, result);
    NoteScores(m, *batch);
    prefetch.Recycle(std::move(batch));
  }
  // The epoch's sparse rows are on the servers before it ends.
  RETURN_IF_ERROR(WaitPushes(UINT64_MAX));
  const bool short_shard = in_round_ > 0;  // a shard shorter than expected
  if (short_shard) RETURN_IF_ERROR(EndRound());
  result->round_device_seconds += round_device_seconds_;
  round_device_seconds_ = 0;
  // Overlapped rounds stay in flight across the epoch's end: the next
  // epoch's first round computes while this one's last round is sent and
  // applied (Flush and Evaluate wait for it). A round still ends with the
  // epoch, so every rank has the same rounds per epoch.
  if (options_.overlap_rounds && !short_shard) return absl::OkStatus();
  return FinishRounds();
}

}  // namespace fulcrum::training
