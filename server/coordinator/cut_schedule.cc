#include "server/coordinator/cut_schedule.h"

#include <algorithm>
#include <cmath>

namespace fulcrum::cut_schedule {

bool IsBsp(const v1::JobSpec& spec) {
  const auto& c = spec.consistency();
  return c.model() == v1::ConsistencySpec::BSP || c.model() == v1::ConsistencySpec::MODEL_UNSPECIFIED ||
         (c.model() == v1::ConsistencySpec::LOCAL && c.staleness() == 0);
}

uint64_t RoundsOfSteps(const v1::JobSpec& spec, uint64_t steps_per_epoch, uint64_t step) {
  const auto& c = spec.consistency();
  if (c.model() != v1::ConsistencySpec::LOCAL || c.sync_every_steps() == 0 || steps_per_epoch == 0) return step;
  const uint64_t h = c.sync_every_steps(), per_epoch = (steps_per_epoch + h - 1) / h;
  const uint64_t in_epoch = step % steps_per_epoch;
  return step / steps_per_epoch * per_epoch + in_epoch / h;
}

uint64_t StepsOfRounds(const v1::JobSpec& spec, uint64_t steps_per_epoch, uint64_t rounds) {
  const auto& c = spec.consistency();
  if (c.model() != v1::ConsistencySpec::LOCAL || c.sync_every_steps() == 0 || steps_per_epoch == 0) return rounds;
  const uint64_t h = c.sync_every_steps(), per_epoch = (steps_per_epoch + h - 1) / h;
  return rounds / per_epoch * steps_per_epoch + std::min(steps_per_epoch, rounds % per_epoch * h);
}

namespace {

// The trigger and step of the cut due now, before the consistency model's
// adjustments; kNothing when none is.
Due Trigger(const JobView& job, uint64_t cur, uint64_t lead) {
  const v1::JobSpec& spec = *job.spec;
  const v1::JobStatus& st = *job.status;
  const v1::CheckpointPolicy& policy = spec.checkpoint();
  const uint64_t last_step = st.checkpoints_size() > 0 ? st.checkpoints().rbegin()->step() : 0;
  Due d;
  d.steps_boundary_asked = job.steps_boundary_asked;
  d.kind = Due::Kind::kCut;
  if (job.final_pending) {
    if (st.total_steps() == 0) d.kind = Due::Kind::kSucceed;
    d.trigger = "final";
    d.at_step = st.total_steps();
  } else if (job.manual_pending) {
    d.trigger = "manual";
    d.at_step = cur + lead;
  } else if (st.checkpoints_size() == 0 && !job.first_cut_failed && cur > 0) {
    // A cut soon after training starts, whatever the policy: a server lost
    // before the first periodic cut then costs a rollback, not the job.
    d.trigger = "first";
    d.at_step = cur + lead;
  } else if (policy.every_steps() > 0 && cur > 0) {
    const uint64_t n = policy.every_steps();
    d.trigger = "steps";
    if (IsBsp(spec)) {
      // BSP cuts name a step ahead, which the servers wait for.
      const uint64_t next = (last_step / n + 1) * n;
      if (cur + 2 * lead < next) return Due{};
      d.at_step = next >= cur + lead ? next : (cur + lead + n - 1) / n * n;
    } else {
      // SSP/ASP cuts are taken when asked: ask once the fastest rank has
      // crossed the next boundary, once per boundary.
      const uint64_t next = (std::max(last_step, job.steps_boundary_asked) / n + 1) * n;
      if (cur < next) return Due{};
      d.steps_boundary_asked = cur / n * n;
    }
  } else if (policy.every_seconds() > 0 &&
             job.now - std::max(job.last_cut, job.started) >= absl::Seconds(policy.every_seconds())) {
    d.trigger = "seconds";
    d.at_step = cur + lead;
  } else {
    return Due{};
  }
  return d;
}

}  // namespace

Due NextCut(const JobView& job) {
  const v1::JobSpec& spec = *job.spec;
  const v1::JobStatus& st = *job.status;
  if (!job.final_pending && !job.manual_pending && job.now < job.backoff_until) return Due{};
  uint64_t cur = 0;
  for (const v1::WorkerProgress& w : st.workers()) cur = std::max<uint64_t>(cur, w.step());
  const double rate = st.samples_per_second() / std::max(1u, spec.num_workers()) /
                      std::max(1u, std::max(spec.batch_size(), st.batch_size()));
  // Progress reports lag up to 0.5 s: ask for a step about a second ahead.
  const uint64_t lead = static_cast<uint64_t>(std::ceil(rate)) + 2 + job.extra_lead;
  Due d = Trigger(job, cur, lead);
  if (d.kind != Due::Kind::kCut) return d;
  if (!IsBsp(spec)) {
    d.at_step = 0;  // SSP/ASP cuts are taken when asked
  } else if (!job.final_pending && st.total_steps() > 0 && d.at_step >= st.total_steps()) {
    return Due{};  // the final cut covers the end
  }
  d.steps_per_epoch = spec.epochs() > 0 ? st.total_steps() / spec.epochs() : 0;
  if (d.at_step > 0 && spec.consistency().model() == v1::ConsistencySpec::LOCAL) {
    // The servers count rounds: name the first round that ends at or after
    // the step (the final cut: every round).
    const uint64_t rounds = RoundsOfSteps(spec, d.steps_per_epoch, d.at_step);
    d.at_step = StepsOfRounds(spec, d.steps_per_epoch, rounds) < d.at_step ? rounds + 1 : rounds;
  }
  return d;
}

}  // namespace fulcrum::cut_schedule
