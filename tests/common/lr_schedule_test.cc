#include "common/lr_schedule.h"

#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace fulcrum {
namespace {

using Spec = v1::LearningRateSchedule;

Spec MakeSpec(Spec::Kind kind, uint64_t warmup, uint64_t decay, float gamma = 0, float min = 0) {
  Spec s;
  s.set_kind(kind);
  s.set_warmup_steps(warmup);
  s.set_decay_steps(decay);
  s.set_gamma(gamma);
  s.set_min_learning_rate(min);
  return s;
}

std::vector<float> Rates(const Spec& spec, float lr, uint64_t steps) {
  REQUIRE(LrScheduleProblems(spec, lr, "s").empty());
  const LrSchedule s = LrScheduleFromProto(spec);
  std::vector<float> out;
  for (uint64_t t = 0; t < steps; ++t) out.push_back(LearningRateAt(s, lr, t));
  return out;
}

std::string Joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

TEST_CASE("an unset schedule keeps the base learning rate at every step", "[lr_schedule]") {
  const LrSchedule s = LrScheduleFromProto(Spec());
  REQUIRE(s.constant());
  for (uint64_t t : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 40}) REQUIRE(LearningRateAt(s, 0.125f, t) == 0.125f);
}

TEST_CASE("warm-up ramps linearly to the base rate, then the decay starts from step 0 of its own", "[lr_schedule]") {
  REQUIRE(Rates(MakeSpec(Spec::CONSTANT, 4, 0), 1.0f, 6) == std::vector<float>{0.25f, 0.5f, 0.75f, 1, 1, 1});
  // Step decay by halves every 2 steps, after 2 warm-up steps.
  REQUIRE(Rates(MakeSpec(Spec::STEP, 2, 2, 0.5f), 1.0f, 9) ==
          std::vector<float>{0.5f, 1, 1, 1, 0.5f, 0.5f, 0.25f, 0.25f, 0.125f});
  REQUIRE_FALSE(LrScheduleFromProto(MakeSpec(Spec::CONSTANT, 4, 0)).constant());
}

TEST_CASE("each decay follows its formula and the floored ones stay at their floor", "[lr_schedule]") {
  // Exponential: gamma per decay_steps, continuously.
  const std::vector<float> e = Rates(MakeSpec(Spec::EXPONENTIAL, 0, 2, 0.25f), 2.0f, 5);
  REQUIRE(e == std::vector<float>{2.0f, 1.0f, 0.5f, 0.25f, 0.125f});
  // Cosine from 1 to 0 over 4 steps: 1, (1 + cos(pi/4)) / 2, 1/2, ..., then 0.
  const std::vector<float> c = Rates(MakeSpec(Spec::COSINE, 0, 4), 1.0f, 7);
  REQUIRE(c[0] == 1.0f);
  REQUIRE(c[1] == Approx(0.8535534f).epsilon(1e-6));
  REQUIRE(c[2] == 0.5f);
  REQUIRE(c[3] == Approx(0.1464466f).epsilon(1e-6));
  REQUIRE(c[4] == 0.0f);
  REQUIRE(c[6] == 0.0f);
  // Cosine towards a floor: halfway is the mean of the two.
  REQUIRE(Rates(MakeSpec(Spec::COSINE, 0, 10, 0, 0.2f), 1.0f, 6)[5] == Approx(0.6f).epsilon(1e-6));
  // Linear from 1 to 0.25 over 3 steps, then flat.
  const std::vector<float> l = Rates(MakeSpec(Spec::LINEAR, 0, 3, 0, 0.25f), 1.0f, 6);
  REQUIRE(l == std::vector<float>{1.0f, 0.75f, 0.5f, 0.25f, 0.25f, 0.25f});
  // Far past the decay nothing overflows or goes negative.
  const LrSchedule s = LrScheduleFromProto(MakeSpec(Spec::STEP, 0, 1, 0.5f));
  REQUIRE(LearningRateAt(s, 1.0f, uint64_t{1} << 40) == 0.0f);
}

TEST_CASE("bad schedules list every problem with its field path and what is allowed", "[lr_schedule]") {
  std::string p = Joined(LrScheduleProblems(MakeSpec(Spec::STEP, 0, 0), 0.1f, "optimizer.schedule"));
  INFO(p);
  REQUIRE(p.find("optimizer.schedule.decay_steps: required for step; allowed: >= 1") != std::string::npos);
  REQUIRE(p.find("optimizer.schedule.gamma: 0 (unset) is invalid for step; allowed: 0 < gamma <= 1") !=
          std::string::npos);

  p = Joined(LrScheduleProblems(MakeSpec(Spec::EXPONENTIAL, 0, 10, 1.5f), 0.1f, "optimizer.schedule"));
  REQUIRE(p.find("optimizer.schedule.gamma: 1.5 is invalid for exponential") != std::string::npos);

  p = Joined(LrScheduleProblems(MakeSpec(Spec::COSINE, 0, 10, 0.5f, 0.2f), 0.1f, "optimizer.schedule"));
  REQUIRE(p.find("optimizer.schedule.gamma: 0.5 is not used by cosine") != std::string::npos);
  REQUIRE(p.find("optimizer.schedule.min_learning_rate: 0.2 is invalid; allowed: 0 <= min_learning_rate < "
                 "learning_rate (0.1)") != std::string::npos);

  p = Joined(LrScheduleProblems(MakeSpec(Spec::CONSTANT, 0, 5, 0, 0.01f), 0.1f, "optimizer.schedule"));
  REQUIRE(p.find("optimizer.schedule.decay_steps: 5 is not used by a constant schedule") != std::string::npos);
  REQUIRE(p.find("optimizer.schedule.min_learning_rate: 0.01 is not used by constant") != std::string::npos);

  p = Joined(LrScheduleProblems(MakeSpec(static_cast<Spec::Kind>(42), 0, 0), 0.1f, "optimizer.schedule"));
  REQUIRE(p.find("optimizer.schedule.kind: 42 is unknown; allowed: constant, step, exponential, cosine, linear") !=
          std::string::npos);

  REQUIRE(LrScheduleProblems(MakeSpec(Spec::LINEAR, 100, 1000, 0, 0), 0.1f, "s").empty());
}

}  // namespace
}  // namespace fulcrum
