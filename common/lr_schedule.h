// Learning-rate schedules (LearningRateSchedule in common.proto): the rate a
// table's optimizer uses for the update of a given step. A pure function of
// (schedule, base rate, step), computed the same way on every server, so BSP
// runs stay bit-for-bit reproducible and a restored job resumes on the same
// curve without any extra state in its checkpoints.
#ifndef FULCRUM_COMMON_LR_SCHEDULE_H_
#define FULCRUM_COMMON_LR_SCHEDULE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fulcrum/v1/common.pb.h"

namespace fulcrum {

struct LrSchedule {
  enum class Kind { kConstant, kStep, kExponential, kCosine, kLinear };
  Kind kind = Kind::kConstant;
  uint64_t warmup_steps = 0;
  uint64_t decay_steps = 0;
  double gamma = 1.0;
  double min_learning_rate = 0.0;

  // True when every step uses the base rate.
  bool constant() const { return kind == Kind::kConstant && warmup_steps == 0; }
};

// Every problem with `spec` for a base rate `learning_rate`, one line each:
// "<prefix>.<field>: <value> <what is wrong>; allowed: ...". Empty when valid.
std::vector<std::string> LrScheduleProblems(const v1::LearningRateSchedule& spec, float learning_rate,
                                            const std::string& prefix);

// The schedule of a valid spec (see LrScheduleProblems).
LrSchedule LrScheduleFromProto(const v1::LearningRateSchedule& spec);

// The learning rate for the update of `step` (0-based).
float LearningRateAt(const LrSchedule& schedule, float learning_rate, uint64_t step);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_LR_SCHEDULE_H_
