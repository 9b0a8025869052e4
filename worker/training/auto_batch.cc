#include "worker/training/auto_batch.h"

#include <algorithm>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace fulcrum::training {

float LrScaling::At(uint64_t step) const {
  if (factor == 1.0) return 1.0f;
  const double ramp = warmup_steps == 0 ? 1.0 : std::min(1.0, static_cast<double>(step) / warmup_steps);
  return static_cast<float>(1.0 + (factor - 1.0) * ramp);
}

AutoBatchOptions AutoBatchOptionsFromSpec(const v1::AutoBatchSpec& spec) {
  AutoBatchOptions o;
  if (spec.base_batch_size() > 0) o.base_batch_size = static_cast<int>(spec.base_batch_size());
  if (spec.max_batch_size() > 0) o.max_batch_size = static_cast<int>(spec.max_batch_size());
  if (spec.min_gain() > 0) o.min_gain = spec.min_gain();
  if (spec.memory_headroom() > 0) o.memory_headroom = spec.memory_headroom();
  if (spec.warmup_steps() > 0) o.warmup_steps = spec.warmup_steps();
  return o;
}

namespace {

std::string Rate(double per_second) {
  if (per_second >= 1e6) return absl::StrFormat("%.2fM/s", per_second / 1e6);
  if (per_second >= 1e3) return absl::StrFormat("%.1fk/s", per_second / 1e3);
  return absl::StrFormat("%.0f/s", per_second);
}

}  // namespace

absl::StatusOr<AutoBatchChoice> ChooseBatchSize(const AutoBatchOptions& options, size_t memory_bytes,
                                                int64_t limit, const TrialFn& trial) {
  AutoBatchChoice choice;
  const double budget = static_cast<double>(memory_bytes) * (1.0 - options.memory_headroom);
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(options.max_batch_size, limit));
  int batch = static_cast<int>(std::min<int64_t>(options.base_batch_size, cap));
  // The best trial so far, by index: trials grows (pointers would dangle).
  int best = -1;
  std::string stop;
  while (true) {
    absl::StatusOr<BatchTrial> t = trial(batch);
    if (!t.ok() && !absl::IsResourceExhausted(t.status())) return t.status();
    BatchTrial r;
    if (t.ok()) {
      r = *t;
    } else {
      r.fits = false;
      r.note = std::string(t.status().message());
    }
    r.batch = batch;
    if (r.fits && static_cast<double>(r.peak_bytes) > budget) {
      r.fits = false;
      r.note = absl::StrFormat("needs %.0f MiB, over %.0f%% of the device's %.0f MiB", r.peak_bytes / 1048576.0,
                               100 * (1 - options.memory_headroom), memory_bytes / 1048576.0);
    }
    choice.trials.push_back(r);
    const BatchTrial& cur = choice.trials.back();
    if (!cur.fits) {
      stop = absl::StrCat(batch, " does not fit: ", cur.note);
      break;
    }
    if (best >= 0 && cur.samples_per_second < choice.trials[best].samples_per_second * (1.0 + options.min_gain)) {
      stop = absl::StrFormat("%d gains %+.0f%% < %.0f%%", batch,
                             100 * (cur.samples_per_second / choice.trials[best].samples_per_second - 1),
                             100 * options.min_gain);
      break;
    }
    best = static_cast<int>(choice.trials.size()) - 1;
    if (batch >= cap) {
      stop = batch >= options.max_batch_size ? absl::StrCat("max_batch_size ", options.max_batch_size)
                                             : absl::StrCat("the shard's ", limit, " examples");
      break;
    }
    batch = static_cast<int>(std::min<int64_t>(int64_t{batch} * 2, cap));
  }
  if (best < 0) {
    return absl::FailedPreconditionError(absl::StrCat("batch_size auto: the first batch tried, ", stop,
                                                      "; set a smaller batch_size_auto.base_batch_size or a fixed batch_size"));
  }
  choice.batch = choice.trials[best].batch;
  choice.lr.factor = static_cast<double>(choice.batch) / options.base_batch_size;
  choice.lr.warmup_steps = choice.lr.factor == 1.0 ? 0 : options.warmup_steps;
  std::vector<std::string> tried;
  for (const BatchTrial& t : choice.trials) {
    tried.push_back(t.fits ? absl::StrCat(t.batch, ": ", Rate(t.samples_per_second)) : absl::StrCat(t.batch, ": no fit"));
  }
  choice.summary = absl::StrFormat("batch %d, lr x%.4g over %d warm-up steps (tried %s; stopped: %s)", choice.batch,
                                   choice.lr.factor, choice.lr.warmup_steps, absl::StrJoin(tried, ", "), stop);
  return choice;
}

absl::StatusOr<BatchTrial> MeasureBatch(compute::Backend* backend, const models::ModelConfig& config,
                                        const data::Dataset& data, int batch, double min_seconds) {
  if (data.size() == 0) return absl::FailedPreconditionError("batch_size auto: the training data is empty");
  BatchTrial trial;
  trial.batch = batch;
  backend->ResetPeakAllocated();
  {
    ASSIGN_OR_RETURN(std::unique_ptr<models::Model> model, models::CreateModel(config, backend));
    std::vector<int64_t> rows(batch);
    for (int i = 0; i < batch; ++i) rows[i] = i % static_cast<int64_t>(data.size());
    data::Batch b;
    data.Fill(rows.data(), batch, &b);
    if (b.sparse()) data::DistinctKeys(b.keys.data(), b.keys.size(), &b.distinct_keys, &b.key_index);
    RETURN_IF_ERROR(model->Prepare(b));
    for (models::Table& t : model->tables()) RETURN_IF_ERROR(backend->Zero(t.value.data(), t.elements * 4));
    RETURN_IF_ERROR(model->Run(b, /*train=*/true).status());  // warm-up: buffers sized, kernels loaded
    RETURN_IF_ERROR(backend->Synchronize());
    int steps = 0;
    const absl::Time start = absl::Now();
    double seconds = 0;
    while (steps < 3 || seconds < min_seconds) {
      RETURN_IF_ERROR(model->Run(b, /*train=*/true).status());
      ++steps;
      RETURN_IF_ERROR(backend->Synchronize());
      seconds = absl::ToDoubleSeconds(absl::Now() - start);
      if (steps >= 50) break;
    }
    trial.samples_per_second = seconds > 0 ? static_cast<double>(steps) * batch / seconds : 0;
    trial.peak_bytes = backend->peak_allocated_bytes();
  }
  return trial;
}

}  // namespace fulcrum::training
