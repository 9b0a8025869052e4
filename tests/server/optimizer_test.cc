#include <algorithm>
#include <cmath>
#include <iomanip>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "server/optimizer.h"

namespace fulcrum {
namespace {

// The learning rate of 0-based step `step`, written out from the schedule's
// definition in common.proto (the kinds these tests use).
float ReferenceRate(const v1::OptimizerSpec& spec, int step) {
  const v1::LearningRateSchedule& s = spec.schedule();
  const double lr = spec.learning_rate();
  const int warmup = static_cast<int>(s.warmup_steps());
  if (step < warmup) return static_cast<float>(lr * (step + 1) / warmup);
  const int t = step - warmup;
  const int d = static_cast<int>(s.decay_steps());
  switch (s.kind()) {
    case v1::LearningRateSchedule::STEP:
      return static_cast<float>(lr * std::pow(static_cast<double>(s.gamma()), t / d));
    case v1::LearningRateSchedule::COSINE: {
      const double progress = std::min(t, d) / static_cast<double>(d);
      const double min = s.min_learning_rate();
      return static_cast<float>(min + (lr - min) * (1 + std::cos(3.14159265358979323846 * progress)) / 2);
    }
    default: return spec.learning_rate();
  }
}

// Plain textbook reference implementations, one element at a time, in fp32
// (the precision of the servers' master weights and optimizer state).
struct Reference {
  v1::OptimizerSpec spec;
  float w, s1 = 0, s2 = 0;
  int t = 0;
  void Step(float g, float lr) {
    ++t;
    switch (spec.kind()) {
      case v1::OptimizerSpec::SGD:
        w -= lr * (g + spec.weight_decay() * w);
        break;
      case v1::OptimizerSpec::MOMENTUM: {
        const float gg = g + spec.weight_decay() * w;
        s1 = spec.momentum() * s1 + gg;
        w -= spec.nesterov() ? lr * (gg + spec.momentum() * s1) : lr * s1;
        break;
      }
      case v1::OptimizerSpec::ADAGRAD:
        s1 += g * g;
        w -= lr * g / (std::sqrt(s1) + 1e-10f);
        break;
      case v1::OptimizerSpec::ADAM:
      case v1::OptimizerSpec::ADAMW: {
        const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
        float gg = g;
        if (spec.kind() == v1::OptimizerSpec::ADAMW) w *= 1 - lr * spec.weight_decay();
        else gg += spec.weight_decay() * w;
        s1 = b1 * s1 + (1 - b1) * gg;
        s2 = b2 * s2 + (1 - b2) * gg * gg;
        const float mhat = s1 / (1 - std::pow(b1, static_cast<float>(t)));
        const float vhat = s2 / (1 - std::pow(b2, static_cast<float>(t)));
        w -= lr * mhat / (std::sqrt(vhat) + eps);
        break;
      }
      case v1::OptimizerSpec::FTRL: {
        // s1 = z, s2 = n (McMahan et al. 2013, with lr_power -1/2).
        const float l1 = spec.l1(), l2 = spec.l2();
        const float n_new = s2 + g * g;
        const float sigma = (std::sqrt(n_new) - std::sqrt(s2)) / lr;
        s1 += g - sigma * w;
        s2 = n_new;
        w = std::fabs(s1) <= l1 ? 0.0f : -(s1 - (s1 > 0 ? l1 : -l1)) / (std::sqrt(s2) / lr + 2 * l2);
        break;
      }
      default: break;
    }
  }
};

void CheckAgainstReference(v1::OptimizerSpec spec) {
  auto config = OptimizerConfigFromProto(spec, "t");
  REQUIRE(config.ok());
  constexpr size_t n = 257;  // not a multiple of the SIMD width
  const int slots = NumSlots(config->kind);
  std::vector<float> block(n * (1 + slots));
  std::vector<Reference> ref(n);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> init(0.5f, 2.0f), grad(-1.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    block[i] = init(rng);
    ref[i].spec = spec;
    ref[i].w = block[i];
    for (int s = 0; s < slots; ++s) block[n * (1 + s) + i] = InitialSlotValue(*config, s);
    if (slots >= 1) ref[i].s1 = InitialSlotValue(*config, 0);
    if (slots >= 2) ref[i].s2 = InitialSlotValue(*config, 1);
  }
  std::vector<float> g(n);
  for (int step = 1; step <= 100; ++step) {
    // Updates count from 1 (Adam's bias correction); schedule steps from 0.
    const float lr = ReferenceRate(spec, step - 1);
    for (size_t i = 0; i < n; ++i) {
      g[i] = grad(rng);
      ref[i].Step(g[i], lr);
    }
    ApplyOptimizer(config->AtStep(static_cast<uint64_t>(step - 1)), block.data(), n, g.data(), step);
  }
  for (size_t i = 0; i < n; ++i) {
    INFO("element " << i << ": " << std::setprecision(10) << block[i] << " vs " << ref[i].w);
    REQUIRE(block[i] == Approx(ref[i].w).epsilon(1e-6).margin(1e-6));
  }
}

v1::OptimizerSpec Spec(v1::OptimizerSpec::Kind kind, float lr) {
  v1::OptimizerSpec s;
  s.set_kind(kind);
  s.set_learning_rate(lr);
  return s;
}

TEST_CASE("SGD matches the reference over 100 steps", "[optimizer]") {
  auto s = Spec(v1::OptimizerSpec::SGD, 0.05f);
  CheckAgainstReference(s);
  s.set_weight_decay(0.01f);
  CheckAgainstReference(s);
}

TEST_CASE("momentum and Nesterov match the reference over 100 steps", "[optimizer]") {
  auto s = Spec(v1::OptimizerSpec::MOMENTUM, 0.01f);
  s.set_momentum(0.9f);
  CheckAgainstReference(s);
  s.set_nesterov(true);
  CheckAgainstReference(s);
}

TEST_CASE("Adagrad matches the reference over 100 steps", "[optimizer]") {
  CheckAgainstReference(Spec(v1::OptimizerSpec::ADAGRAD, 0.1f));
}

TEST_CASE("Adam and AdamW match the reference over 100 steps", "[optimizer]") {
  CheckAgainstReference(Spec(v1::OptimizerSpec::ADAM, 0.01f));
  auto w = Spec(v1::OptimizerSpec::ADAMW, 0.01f);
  w.set_weight_decay(0.1f);
  CheckAgainstReference(w);
}

TEST_CASE("FTRL-proximal matches the reference over 100 steps", "[optimizer]") {
  auto s = Spec(v1::OptimizerSpec::FTRL, 0.1f);
  s.set_l1(0.001f);
  s.set_l2(0.01f);
  CheckAgainstReference(s);
}

TEST_CASE("every optimizer follows its table's learning-rate schedule over 100 steps", "[optimizer][lr_schedule]") {
  for (auto kind : {v1::OptimizerSpec::SGD, v1::OptimizerSpec::MOMENTUM, v1::OptimizerSpec::ADAGRAD,
                    v1::OptimizerSpec::ADAM, v1::OptimizerSpec::ADAMW, v1::OptimizerSpec::FTRL}) {
    INFO("optimizer kind " << kind);
    auto s = Spec(kind, 0.05f);
    if (kind == v1::OptimizerSpec::MOMENTUM) s.set_momentum(0.9f);
    if (kind == v1::OptimizerSpec::ADAMW) s.set_weight_decay(0.1f);
    // Cosine with warm-up: 10 steps up, 80 down to a tenth, 10 flat.
    auto* c = s.mutable_schedule();
    c->set_kind(v1::LearningRateSchedule::COSINE);
    c->set_warmup_steps(10);
    c->set_decay_steps(80);
    c->set_min_learning_rate(0.005f);
    CheckAgainstReference(s);
    // Step decay: halved every 30 steps.
    s.clear_schedule();
    s.mutable_schedule()->set_kind(v1::LearningRateSchedule::STEP);
    s.mutable_schedule()->set_decay_steps(30);
    s.mutable_schedule()->set_gamma(0.5f);
    CheckAgainstReference(s);
  }
  // The schedule really changes the updates: the same run without it ends elsewhere.
  auto with = OptimizerConfigFromProto([] {
    auto s = Spec(v1::OptimizerSpec::SGD, 1.0f);
    s.mutable_schedule()->set_kind(v1::LearningRateSchedule::STEP);
    s.mutable_schedule()->set_decay_steps(1);
    s.mutable_schedule()->set_gamma(0.5f);
    return s;
  }(), "w");
  REQUIRE(with.ok());
  REQUIRE(with->AtStep(0).learning_rate == 1.0f);
  REQUIRE(with->AtStep(3).learning_rate == 0.125f);
  REQUIRE(with->learning_rate == 1.0f);  // the base rate stays
}

TEST_CASE("optimizer specs with bad hyper-parameters name the field", "[optimizer]") {
  auto s = Spec(v1::OptimizerSpec::ADAM, 0.0f);
  auto c = OptimizerConfigFromProto(s, "emb");
  REQUIRE(c.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(std::string(c.status().message()).find("table 'emb': optimizer.learning_rate") !=
          std::string::npos);
  s = Spec(v1::OptimizerSpec::MOMENTUM, 0.1f);
  s.set_momentum(1.5f);
  REQUIRE(std::string(OptimizerConfigFromProto(s, "w").status().message()).find("momentum") !=
          std::string::npos);
  s = Spec(v1::OptimizerSpec::SGD, 0.1f);
  s.set_nesterov(true);
  REQUIRE_FALSE(OptimizerConfigFromProto(s, "w").ok());
  s = Spec(v1::OptimizerSpec::SGD, 0.1f);
  s.mutable_schedule()->set_kind(v1::LearningRateSchedule::COSINE);
  REQUIRE(std::string(OptimizerConfigFromProto(s, "w").status().message()) ==
          "table 'w': optimizer.schedule.decay_steps: required for cosine; allowed: >= 1");
  s = Spec(v1::OptimizerSpec::SGD, 0.1f);
  s.set_clip_global_norm(-2);
  REQUIRE(std::string(OptimizerConfigFromProto(s, "w").status().message()).find("optimizer.clip_global_norm = -2") !=
          std::string::npos);
  s = Spec(static_cast<v1::OptimizerSpec::Kind>(42), 0.1f);
  REQUIRE(std::string(OptimizerConfigFromProto(s, "w").status().message()).find("kind 42") !=
          std::string::npos);
}

}  // namespace
}  // namespace fulcrum
