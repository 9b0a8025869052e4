#include "common/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace fulcrum {
namespace {

using Spec = v1::LearningRateSchedule;

const char* KindName(Spec::Kind kind) {
  switch (kind) {
    case Spec::STEP: return "step";
    case Spec::EXPONENTIAL: return "exponential";
    case Spec::COSINE: return "cosine";
    case Spec::LINEAR: return "linear";
    default: return "constant";
  }
}

}  // namespace

std::vector<std::string> LrScheduleProblems(const Spec& spec, float learning_rate,
                                            const std::string& prefix) {
  std::vector<std::string> p;
  const auto field = [&](const char* name) { return absl::StrCat(prefix, ".", name, ": "); };
  const Spec::Kind kind = spec.kind();
  const bool uses_gamma = kind == Spec::STEP || kind == Spec::EXPONENTIAL;
  const bool uses_min = kind == Spec::COSINE || kind == Spec::LINEAR;
  const bool decays = uses_gamma || uses_min;
  if (kind != Spec::KIND_UNSPECIFIED && kind != Spec::CONSTANT && !decays) {
    p.push_back(absl::StrCat(field("kind"), static_cast<int>(kind),
                             " is unknown; allowed: constant, step, exponential, cosine, linear"));
    return p;
  }
  if (decays && spec.decay_steps() == 0) {
    p.push_back(absl::StrCat(field("decay_steps"), "required for ", KindName(kind), "; allowed: >= 1"));
  }
  if (!decays && spec.decay_steps() != 0) {
    p.push_back(absl::StrCat(field("decay_steps"), spec.decay_steps(),
                             " is not used by a constant schedule; allowed: 0, or kind step, exponential, "
                             "cosine or linear"));
  }
  const float gamma = spec.gamma();
  if (uses_gamma && !(gamma > 0 && gamma <= 1)) {
    p.push_back(absl::StrCat(field("gamma"), gamma, gamma == 0 ? " (unset)" : "", " is invalid for ",
                             KindName(kind), "; allowed: 0 < gamma <= 1 (the factor per decay_steps)"));
  }
  if (!uses_gamma && gamma != 0) {
    p.push_back(absl::StrCat(field("gamma"), gamma, " is not used by ", KindName(kind),
                             "; allowed: only step and exponential take gamma"));
  }
  const float min = spec.min_learning_rate();
  if (uses_min && !(min >= 0 && min < learning_rate && std::isfinite(min))) {
    p.push_back(absl::StrCat(field("min_learning_rate"), min, " is invalid; allowed: 0 <= min_learning_rate < ",
                             "learning_rate (", learning_rate, ")"));
  }
  if (!uses_min && min != 0) {
    p.push_back(absl::StrCat(field("min_learning_rate"), min, " is not used by ", KindName(kind),
                             "; allowed: only cosine and linear take min_learning_rate"));
  }
  return p;
}

LrSchedule LrScheduleFromProto(const Spec& spec) {
  LrSchedule s;
  switch (spec.kind()) {
    case Spec::STEP: s.kind = LrSchedule::Kind::kStep; break;
    case Spec::EXPONENTIAL: s.kind = LrSchedule::Kind::kExponential; break;
    case Spec::COSINE: s.kind = LrSchedule::Kind::kCosine; break;
    case Spec::LINEAR: s.kind = LrSchedule::Kind::kLinear; break;
    default: s.kind = LrSchedule::Kind::kConstant; break;
  }
  s.warmup_steps = spec.warmup_steps();
  s.decay_steps = spec.decay_steps();
  s.gamma = spec.gamma();
  s.min_learning_rate = spec.min_learning_rate();
  return s;
}

float LearningRateAt(const LrSchedule& s, float learning_rate, uint64_t step) {
  const double lr = learning_rate;
  if (step < s.warmup_steps) {
    return static_cast<float>(lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps));
  }
  const uint64_t t = step - s.warmup_steps;
  const uint64_t period = std::max<uint64_t>(s.decay_steps, 1);  // 0 only for constant
  const double d = static_cast<double>(period);
  // The fraction of the decay done, for the kinds that end at a floor.
  const double done = static_cast<double>(std::min(t, period)) / d;
  double rate = lr;
  switch (s.kind) {
    case LrSchedule::Kind::kConstant: break;
    case LrSchedule::Kind::kStep:
      rate = lr * std::pow(s.gamma, static_cast<double>(t / period));
      break;
    case LrSchedule::Kind::kExponential:
      rate = lr * std::pow(s.gamma, static_cast<double>(t) / d);
      break;
    case LrSchedule::Kind::kCosine:
      rate = s.min_learning_rate + (lr - s.min_learning_rate) * 0.5 * (1.0 + std::cos(std::numbers::pi * done));
      break;
    case LrSchedule::Kind::kLinear:
      rate = lr + (s.min_learning_rate - lr) * done;
      break;
  }
  return static_cast<float>(rate);
}

}  // namespace fulcrum
