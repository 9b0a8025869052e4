// Job: the BSP/SSP bookkeeping (buffered BSP steps applied in rank order,
// clocks, which waiting pulls are ready).
#include "server/job.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/status_macros.h"
#include "server/job_internal.h"

namespace fulcrum {

using job_internal::kParallelApplyElements;

absl::Status Job::Resume(bool drain, std::vector<std::function<void(absl::Status)>>* ready) {
  absl::Status s = drain ? DrainBspSteps(ready) : absl::OkStatus();
  for (auto& r : *ready) r(absl::OkStatus());
  return s;
}

// A BSP step's gradients, summed over its ranks.
struct Job::CombinedStep {
  // A dense chunk's first contribution is its accumulator: the later ones
  // are added into that rank's decoded buffer, which the drain owns.
  struct Chunk {
    DenseTable* table;
    uint32_t chunk;
    float* acc;
  };
  std::vector<Chunk> dense_order;  // first-seen order
  absl::flat_hash_map<std::pair<DenseTable*, uint32_t>, size_t> dense;  // -> index in dense_order
  size_t dense_elements = 0;
  // Per table: key -> offset in its values, in first-seen order.
  absl::flat_hash_map<SparseTable*, std::pair<absl::flat_hash_map<uint64_t, size_t>, std::vector<float>>> sparse;
  std::vector<SparseTable*> sparse_order;
  uint32_t contributors = 0;
  double lr_scale_sum = 0;  // the step's rate: its ranks' mean lr_scale
};

absl::Status Job::DrainBspSteps(std::vector<std::function<void(absl::Status)>>* ready) {
  absl::Status result;
  mu_.Lock();
  if (applying_) {
    mu_.Unlock();
    return result;
  }
  applying_ = true;
  while (!shut_down_ && holds_.count(applied_step_) == 0 && StepCompleteLocked(applied_step_)) {
    const uint64_t step = applied_step_;
    std::vector<RankStep> ranks = std::move(steps_[step]);
    steps_.erase(step);
    std::vector<bool> active = active_;
    mu_.Unlock();

    CombinedStep c;
    CombineStep(ranks, active, &c);
    const absl::Time apply_start = absl::Now();
    result.Update(ApplyCombined(c, step));
    metrics_.apply_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - apply_start));

    mu_.Lock();
    KeepSpareGradsLocked(ranks);
    applied_step_ = step + 1;
    CollectReadyLocked(ready);
  }
  applying_ = false;
  mu_.Unlock();
  return result;
}

void Job::CombineStep(std::vector<RankStep>& ranks, const std::vector<bool>& active, CombinedStep* c) {
  // Combine in rank order, and within a rank in sequence order, so the sum
  // (and so the run) is bit-for-bit reproducible.
  const std::vector<float> weight = RankWeights(ranks, active);
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    if (!active[r]) continue;
    ++c->contributors;
    const float w = weight[r];
    auto& parts = ranks[r].parts;
    std::sort(parts.begin(), parts.end(), [](const Decoded& a, const Decoded& b) { return a.seq < b.seq; });
    c->lr_scale_sum += parts.empty() ? 1.0 : parts.front().lr_scale;
    for (Decoded& part : parts) {
      for (const DenseItem& d : part.dense) {
        const size_t n = d.table->ChunkLength(d.chunk);
        if (w != 1.0f) {
          for (size_t i = 0; i < n; ++i) d.g[i] *= w;
        }
        const float* g = d.g;
        auto [it, inserted] = c->dense.try_emplace({d.table, d.chunk}, c->dense_order.size());
        if (inserted) {
          c->dense_order.push_back({d.table, d.chunk, d.g});
          c->dense_elements += n;
        } else {
          float* acc = c->dense_order[it->second].acc;
          for (size_t i = 0; i < n; ++i) acc[i] += g[i];
        }
      }
      for (const SparseItem& s : part.sparse) {
        const uint32_t dim = s.table->dim();
        if (w != 1.0f) {
          for (size_t i = 0; i < s.groups.keys.size() * dim; ++i) s.g[i] *= w;
        }
        auto [it, inserted] = c->sparse.try_emplace(s.table);
        if (inserted) c->sparse_order.push_back(s.table);
        auto& [index, values] = it->second;
        for (size_t k = 0; k < s.groups.keys.size(); ++k) {
          const float* g = s.g + k * dim;
          auto [kit, kinserted] = index.try_emplace(s.groups.keys[k], values.size());
          if (kinserted) {
            values.insert(values.end(), g, g + dim);
          } else {
            float* acc = values.data() + kit->second;
            for (uint32_t j = 0; j < dim; ++j) acc[j] += g[j];
          }
        }
      }
    }
  }
}

absl::Status Job::ApplyCombined(CombinedStep& c, uint64_t step) {
  const float scale = mean_ && c.contributors > 0 ? 1.0f / static_cast<float>(c.contributors) : 1.0f;
  const float lr_scale = c.contributors > 0 ? static_cast<float>(c.lr_scale_sum / c.contributors) : 1.0f;
  absl::Status s;
  // The workers wait for this step: apply its chunks on every core.
  std::vector<absl::Status> applied(c.dense_order.size());
  auto apply_chunk = [&](size_t k) {
    const auto& [table, chunk, g] = c.dense_order[k];
    if (scale != 1.0f) {
      const size_t n = table->ChunkLength(chunk);
      for (size_t i = 0; i < n; ++i) g[i] *= scale;
    }
    applied[k] = table->Apply(chunk, g, step, lr_scale);
  };
  if (runner_ != nullptr && c.dense_elements >= kParallelApplyElements) {
    runner_->ForEach(c.dense_order.size(), apply_chunk);
  } else {
    for (size_t k = 0; k < c.dense_order.size(); ++k) apply_chunk(k);
  }
  for (const absl::Status& a : applied) s.Update(a);
  for (SparseTable* t : c.sparse_order) {
    auto& [index, values] = c.sparse[t];
    if (scale != 1.0f) for (float& x : values) x *= scale;
    std::vector<uint64_t> keys(index.size());
    for (const auto& [key, off] : index) keys[off / t->dim()] = key;
    s.Update(ApplySparse(t, GroupKeys(*t, std::move(keys)), values.data(), step, lr_scale));
  }
  return s;
}

// ------------------------------------------------------------------ pull

uint64_t Job::MinClockLocked() const {
  uint64_t min = UINT64_MAX;
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (active_[r]) min = std::min(min, clock_[r]);
  }
  return min;
}

bool Job::ReadyLocked(uint64_t step) const {
  switch (model_) {
    case Model::kBsp: return applied_step_ >= step;
    case Model::kSsp: return step <= staleness_ || MinClockLocked() >= step - staleness_;
    case Model::kAsp: return true;
  }
  return true;
}

std::string Job::WaitReasonLocked(uint64_t step) const {
  std::vector<std::string> missing;
  if (model_ == Model::kBsp) {
    auto it = steps_.find(applied_step_);
    for (uint32_t r = 0; r < num_workers_; ++r) {
      if (!active_[r]) continue;
      if (it == steps_.end() || !it->second[r].complete()) {
        missing.push_back(absl::StrCat(r));
      }
    }
    return absl::StrCat("step ", applied_step_, " waits for workers ", absl::StrJoin(missing, ", "));
  }
  const uint64_t need = step - staleness_;
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (active_[r] && clock_[r] < need) missing.push_back(absl::StrCat(r, " (at clock ", clock_[r], ")"));
  }
  return absl::StrCat("clock ", step, " waits for workers ", absl::StrJoin(missing, ", "),
                      " to reach clock ", need, " (staleness bound ", staleness_, ")");
}

void Job::CollectReadyLocked(std::vector<std::function<void(absl::Status)>>* ready) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (ReadyLocked(it->second.step)) {
      // A timer that already fired finds the waiter gone and does nothing.
      timer_->Cancel(it->second.timer_id);
      ready->push_back(std::move(it->second.resume));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace fulcrum
