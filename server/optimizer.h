// Server-side optimizers. A parameter block (a dense chunk or a sparse row)
// is laid out as [weights | slot 1 | slot 2], each n floats, so the state of
// an element lives next to its weight. Apply() updates one block in place.
// Compiled with -O3 -fno-math-errno so the sqrt loops vectorize.
#ifndef FULCRUM_SERVER_OPTIMIZER_H_
#define FULCRUM_SERVER_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/lr_schedule.h"
#include "fulcrum/v1/common.pb.h"

namespace fulcrum {

enum class OptimizerKind { kSgd, kMomentum, kAdagrad, kAdam, kAdamW, kFtrl };

// Hyper-parameters with defaults filled in; validated.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float learning_rate = 0.01f;
  float momentum = 0.0f;
  bool nesterov = false;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float weight_decay = 0.0f;
  float initial_accumulator = 0.1f;
  float l1 = 0.0f;
  float l2 = 0.0f;
  float lr_power = -0.5f;
  // learning_rate above is the base rate the schedule scales.
  LrSchedule schedule;

  // This config for the update of push step `step`: learning_rate replaced
  // by the schedule's rate for that step, times `lr_scale` (the push's:
  // batch_size auto's linear scaling).
  OptimizerConfig AtStep(uint64_t step, float lr_scale = 1.0f) const {
    OptimizerConfig c = *this;
    if (!schedule.constant()) c.learning_rate = LearningRateAt(schedule, learning_rate, step);
    c.learning_rate *= lr_scale;
    return c;
  }
};

// INVALID_ARGUMENT naming the table and the field when a value is out of range.
absl::StatusOr<OptimizerConfig> OptimizerConfigFromProto(const v1::OptimizerSpec& spec,
                                                         const std::string& table);

// Number of state slots (0 for SGD, 1 for momentum/Adagrad, 2 for Adam/FTRL).
int NumSlots(OptimizerKind kind);
// Initial value of slot `slot` (Adagrad's and FTRL's accumulators start at
// initial_accumulator; everything else at 0).
float InitialSlotValue(const OptimizerConfig& config, int slot);

// Applies gradient g (n floats) to block (n * (1 + NumSlots) floats).
// `step` is the 1-based number of this update of the block (Adam's bias
// correction). Not thread-safe for the same block: callers lock it.
void ApplyOptimizer(const OptimizerConfig& config, float* block, size_t n, const float* g,
                    uint64_t step);
// The same for elements [begin, begin + len) of a block of n elements.
void ApplyOptimizerRange(const OptimizerConfig& config, float* block, size_t n, size_t begin,
                         size_t len, const float* g, uint64_t step);

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_OPTIMIZER_H_
