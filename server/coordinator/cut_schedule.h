// When a running job's next checkpoint cut is due, and at which step, as a
// pure function of the job's spec, status and cut history (no lock, no
// clock, no I/O; docs/checkpoints.md). The coordinator's checkpoint
// orchestration (coordinator_checkpoints.cc) asks it every tick, then takes
// the cut on the servers.
#ifndef FULCRUM_SERVER_COORDINATOR_CUT_SCHEDULE_H_
#define FULCRUM_SERVER_COORDINATOR_CUT_SCHEDULE_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum::cut_schedule {

// Whether the servers collect the job's steps in order (BSP, and local
// steps without staleness): its cuts name a step the servers wait for.
bool IsBsp(const v1::JobSpec& spec);

// Local steps: the servers' clock counts rounds of sync_every_steps, and
// each epoch ends one (worker/training/trainer.h). The rounds a rank has
// completed after `step` inner steps, and the inner steps a clock of
// `rounds` stands for; both the identity for other models.
uint64_t RoundsOfSteps(const v1::JobSpec& spec, uint64_t steps_per_epoch, uint64_t step);
uint64_t StepsOfRounds(const v1::JobSpec& spec, uint64_t steps_per_epoch, uint64_t rounds);

// What the coordinator knows of a running job when it considers a cut.
struct JobView {
  const v1::JobSpec* spec = nullptr;
  const v1::JobStatus* status = nullptr;
  bool final_pending = false;     // every rank finished: the last cut is due
  bool manual_pending = false;    // a CheckpointJob call waits
  bool first_cut_failed = false;  // the early "first" cut failed: not retried
  uint64_t extra_lead = 0;        // steps added to a BSP cut's lead after misses
  // SSP/ASP: the highest every_steps boundary a cut was asked for.
  uint64_t steps_boundary_asked = 0;
  absl::Time now, started, last_cut;
  absl::Time backoff_until = absl::InfinitePast();  // after a failed cut
};

struct Due {
  enum class Kind { kNothing, kSucceed, kCut };
  Kind kind = Kind::kNothing;  // kSucceed: the job ended with no step to cut
  std::string trigger;         // final, manual, first, steps, seconds
  // The step (BSP) or round (local steps) the servers cut at; 0: at once
  // when asked (SSP/ASP).
  uint64_t at_step = 0;
  uint64_t steps_per_epoch = 0;
  uint64_t steps_boundary_asked = 0;  // the view's, moved on by an SSP/ASP "steps" cut
};

// The cut due now, in order of precedence: the final one, one asked for,
// the first one soon after training starts, the policy's every_steps, then
// every_seconds. A failed cut's backoff delays all but the final and asked
// ones. A BSP cut asks for a step about a second of progress ahead (reports
// lag), and none is taken past the last step (the final cut covers it).
Due NextCut(const JobView& job);

}  // namespace fulcrum::cut_schedule

#endif  // FULCRUM_SERVER_COORDINATOR_CUT_SCHEDULE_H_
