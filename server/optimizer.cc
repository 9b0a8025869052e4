#include "server/optimizer.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

absl::Status Bad(const std::string& table, absl::string_view field, float value,
                 absl::string_view allowed) {
  return absl::InvalidArgumentError(absl::StrCat("table '", table, "': optimizer.", field, " = ",
                                                 value, " is invalid; allowed: ", allowed));
}

bool Finite(float v) { return std::isfinite(v); }

}  // namespace

namespace {

// The kind's config with its defaults (Adagrad's smaller epsilon).
absl::StatusOr<OptimizerConfig> ConfigOfKind(v1::OptimizerSpec::Kind kind, const std::string& table) {
  OptimizerConfig c;
  switch (kind) {
    case v1::OptimizerSpec::SGD: c.kind = OptimizerKind::kSgd; break;
    case v1::OptimizerSpec::MOMENTUM: c.kind = OptimizerKind::kMomentum; break;
    case v1::OptimizerSpec::ADAGRAD: c.kind = OptimizerKind::kAdagrad; c.epsilon = 1e-10f; break;
    case v1::OptimizerSpec::ADAM: c.kind = OptimizerKind::kAdam; break;
    case v1::OptimizerSpec::ADAMW: c.kind = OptimizerKind::kAdamW; break;
    case v1::OptimizerSpec::FTRL: c.kind = OptimizerKind::kFtrl; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("table '", table, "': optimizer.kind ", static_cast<int>(kind),
                                                     " is not one of SGD, MOMENTUM, ADAGRAD, ADAM, ADAMW, FTRL"));
  }
  return c;
}

}  // namespace

absl::StatusOr<OptimizerConfig> OptimizerConfigFromProto(const v1::OptimizerSpec& spec,
                                                         const std::string& table) {
  ASSIGN_OR_RETURN(OptimizerConfig c, ConfigOfKind(spec.kind(), table));
  if (!Finite(spec.learning_rate()) || spec.learning_rate() <= 0) {
    return Bad(table, "learning_rate", spec.learning_rate(), "a finite value > 0");
  }
  c.learning_rate = spec.learning_rate();
  if (!Finite(spec.momentum()) || spec.momentum() < 0 || spec.momentum() >= 1) {
    return Bad(table, "momentum", spec.momentum(), "0 <= momentum < 1");
  }
  c.momentum = spec.momentum();
  c.nesterov = spec.nesterov();
  if (c.nesterov && c.kind != OptimizerKind::kMomentum) {
    return absl::InvalidArgumentError(
        absl::StrCat("table '", table, "': optimizer.nesterov applies only to MOMENTUM"));
  }
  if (spec.beta1() != 0) {
    if (!Finite(spec.beta1()) || spec.beta1() < 0 || spec.beta1() >= 1) {
      return Bad(table, "beta1", spec.beta1(), "0 < beta1 < 1 (0 means 0.9)");
    }
    c.beta1 = spec.beta1();
  }
  if (spec.beta2() != 0) {
    if (!Finite(spec.beta2()) || spec.beta2() < 0 || spec.beta2() >= 1) {
      return Bad(table, "beta2", spec.beta2(), "0 < beta2 < 1 (0 means 0.999)");
    }
    c.beta2 = spec.beta2();
  }
  if (spec.epsilon() != 0) {
    if (!Finite(spec.epsilon()) || spec.epsilon() < 0) {
      return Bad(table, "epsilon", spec.epsilon(), "a finite value > 0");
    }
    c.epsilon = spec.epsilon();
  }
  if (!Finite(spec.weight_decay()) || spec.weight_decay() < 0) {
    return Bad(table, "weight_decay", spec.weight_decay(), "a finite value >= 0");
  }
  c.weight_decay = spec.weight_decay();
  if (c.kind == OptimizerKind::kFtrl && c.weight_decay != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table '", table, "': FTRL takes l1/l2 regularization, not optimizer.weight_decay"));
  }
  if (spec.initial_accumulator() != 0) {
    if (!Finite(spec.initial_accumulator()) || spec.initial_accumulator() < 0) {
      return Bad(table, "initial_accumulator", spec.initial_accumulator(), "a finite value > 0");
    }
    c.initial_accumulator = spec.initial_accumulator();
  }
  if (!Finite(spec.l1()) || spec.l1() < 0) return Bad(table, "l1", spec.l1(), "a finite value >= 0");
  if (!Finite(spec.l2()) || spec.l2() < 0) return Bad(table, "l2", spec.l2(), "a finite value >= 0");
  c.l1 = spec.l1();
  c.l2 = spec.l2();
  if (spec.lr_power() != 0) {
    if (!Finite(spec.lr_power()) || spec.lr_power() > 0) {
      return Bad(table, "lr_power", spec.lr_power(), "a finite value <= 0 (0 means -0.5)");
    }
    c.lr_power = spec.lr_power();
  }
  // clip_global_norm is the workers' (they clip before pushing); checked
  // here only so a bad value never passes silently.
  if (!Finite(spec.clip_global_norm()) || spec.clip_global_norm() < 0) {
    return Bad(table, "clip_global_norm", spec.clip_global_norm(), "a finite value >= 0 (0: off)");
  }
  const std::vector<std::string> schedule = LrScheduleProblems(spec.schedule(), c.learning_rate, "optimizer.schedule");
  if (!schedule.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("table '", table, "': ", schedule.front()));
  }
  c.schedule = LrScheduleFromProto(spec.schedule());
  return c;
}

int NumSlots(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return 0;
    case OptimizerKind::kMomentum:
    case OptimizerKind::kAdagrad: return 1;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
    case OptimizerKind::kFtrl: return 2;
  }
  return 0;
}

float InitialSlotValue(const OptimizerConfig& config, int slot) {
  if (config.kind == OptimizerKind::kAdagrad) return config.initial_accumulator;
  if (config.kind == OptimizerKind::kFtrl && slot == 1) return config.initial_accumulator;
  return 0.0f;
}

namespace {

// Each loop below is a plain element-wise pass with restrict pointers so GCC
// vectorizes it (sqrt becomes sqrtps thanks to -fno-math-errno).

void Sgd(const OptimizerConfig& c, float* __restrict w, size_t n, const float* __restrict g) {
  const float lr = c.learning_rate, wd = c.weight_decay;
  if (wd == 0) {
    for (size_t i = 0; i < n; ++i) w[i] -= lr * g[i];
  } else {
    for (size_t i = 0; i < n; ++i) w[i] -= lr * (g[i] + wd * w[i]);
  }
}

void Momentum(const OptimizerConfig& c, float* __restrict w, float* __restrict v, size_t n,
              const float* __restrict g) {
  const float lr = c.learning_rate, mu = c.momentum, wd = c.weight_decay;
  if (c.nesterov) {
    for (size_t i = 0; i < n; ++i) {
      const float gi = g[i] + wd * w[i];
      v[i] = mu * v[i] + gi;
      w[i] -= lr * (gi + mu * v[i]);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const float gi = g[i] + wd * w[i];
      v[i] = mu * v[i] + gi;
      w[i] -= lr * v[i];
    }
  }
}

void Adagrad(const OptimizerConfig& c, float* __restrict w, float* __restrict acc, size_t n,
             const float* __restrict g) {
  const float lr = c.learning_rate, eps = c.epsilon, wd = c.weight_decay;
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i] + wd * w[i];
    acc[i] += gi * gi;
    w[i] -= lr * gi / (std::sqrt(acc[i]) + eps);
  }
}

void Adam(const OptimizerConfig& c, float* __restrict w, float* __restrict m,
          float* __restrict v, size_t n, const float* __restrict g, uint64_t step, bool decoupled) {
  const float b1 = c.beta1, b2 = c.beta2, eps = c.epsilon;
  const double t = static_cast<double>(step);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(b2), t)));
  const float step_size = c.learning_rate / bc1;
  const float inv_bc2_sqrt = 1.0f / bc2_sqrt;
  const float l2 = decoupled ? 0.0f : c.weight_decay;
  const float decay = decoupled ? 1.0f - c.learning_rate * c.weight_decay : 1.0f;
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i] + l2 * w[i];
    m[i] = b1 * m[i] + (1.0f - b1) * gi;
    v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
    const float denom = std::sqrt(v[i]) * inv_bc2_sqrt + eps;
    w[i] = w[i] * decay - step_size * m[i] / denom;
  }
}

void Ftrl(const OptimizerConfig& c, float* __restrict w, float* __restrict z,
          float* __restrict nacc, size_t n, const float* __restrict g) {
  const float lr = c.learning_rate, l1 = c.l1, l2 = c.l2;
  if (c.lr_power == -0.5f) {
    for (size_t i = 0; i < n; ++i) {
      const float n_new = nacc[i] + g[i] * g[i];
      const float sqrt_new = std::sqrt(n_new);
      const float sigma = (sqrt_new - std::sqrt(nacc[i])) / lr;
      z[i] += g[i] - sigma * w[i];
      nacc[i] = n_new;
      const float quadratic = sqrt_new / lr + 2.0f * l2;
      const float zi = z[i];
      const float shrunk = (zi > 0 ? l1 : -l1) - zi;
      w[i] = std::fabs(zi) > l1 ? shrunk / quadratic : 0.0f;
    }
  } else {
    const float p = -c.lr_power;
    for (size_t i = 0; i < n; ++i) {
      const float n_new = nacc[i] + g[i] * g[i];
      const float pow_new = std::pow(n_new, p);
      const float sigma = (pow_new - std::pow(nacc[i], p)) / lr;
      z[i] += g[i] - sigma * w[i];
      nacc[i] = n_new;
      const float quadratic = pow_new / lr + 2.0f * l2;
      const float zi = z[i];
      const float shrunk = (zi > 0 ? l1 : -l1) - zi;
      w[i] = std::fabs(zi) > l1 ? shrunk / quadratic : 0.0f;
    }
  }
}

}  // namespace

void ApplyOptimizer(const OptimizerConfig& c, float* block, size_t n, const float* g,
                    uint64_t step) {
  ApplyOptimizerRange(c, block, n, 0, n, g, step);
}

void ApplyOptimizerRange(const OptimizerConfig& c, float* block, size_t stride, size_t begin,
                         size_t n, const float* g, uint64_t step) {
  float* w = block + begin;
  float* s1 = block + stride + begin;
  float* s2 = block + 2 * stride + begin;
  switch (c.kind) {
    case OptimizerKind::kSgd: Sgd(c, w, n, g); return;
    case OptimizerKind::kMomentum: Momentum(c, w, s1, n, g); return;
    case OptimizerKind::kAdagrad: Adagrad(c, w, s1, n, g); return;
    case OptimizerKind::kAdam: Adam(c, w, s1, s2, n, g, step, false); return;
    case OptimizerKind::kAdamW: Adam(c, w, s1, s2, n, g, step, true); return;
    case OptimizerKind::kFtrl: Ftrl(c, w, s1, s2, n, g); return;
  }
}

}  // namespace fulcrum
