// When a job's next checkpoint cut is due and at which step, on its own:
// the triggers' precedence, BSP's step ahead, SSP/ASP boundaries asked for
// once, the backoff after a failure, and local steps' rounds.
#include "server/coordinator/cut_schedule.h"

#include <catch2/catch.hpp>

namespace fulcrum::cut_schedule {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1800000000);

// A running BSP job of one rank at `step`, with no speed reported (a lead of
// 2 steps), 10 epochs of 100 steps.
struct Job {
  v1::JobSpec spec;
  v1::JobStatus status;
  JobView view;
  explicit Job(uint64_t step, v1::ConsistencySpec::Model model = v1::ConsistencySpec::BSP) {
    spec.set_num_workers(1);
    spec.set_batch_size(32);
    spec.set_epochs(10);
    spec.mutable_consistency()->set_model(model);
    status.set_total_steps(1000);
    status.add_workers()->set_step(step);
    view.spec = &spec;
    view.status = &status;
    view.now = kStart;
    view.started = kStart;
    view.last_cut = kStart;
  }
  void CutAt(uint64_t step) { status.add_checkpoints()->set_step(step); }
  Due Next() { return NextCut(view); }
};

TEST_CASE("cut triggers come in order: final then asked then first then steps then seconds", "[cut_schedule]") {
  Job j(50);
  j.spec.mutable_checkpoint()->set_every_steps(10);
  j.spec.mutable_checkpoint()->set_every_seconds(1);
  j.view.now = kStart + absl::Seconds(5);
  CHECK(j.Next().trigger == "first");  // no cut yet
  j.CutAt(10);
  CHECK(j.Next().trigger == "steps");
  j.spec.mutable_checkpoint()->set_every_steps(0);
  CHECK(j.Next().trigger == "seconds");
  j.view.manual_pending = true;
  CHECK(j.Next().trigger == "manual");
  CHECK(j.Next().at_step == 52);  // the current step and the lead
  j.view.final_pending = true;
  const Due d = j.Next();
  CHECK(d.kind == Due::Kind::kCut);
  CHECK(d.trigger == "final");
  CHECK(d.at_step == 1000);
  CHECK(d.steps_per_epoch == 100);
}

TEST_CASE("a job that ends with no step succeeds without a cut", "[cut_schedule]") {
  Job j(0);
  j.status.set_total_steps(0);
  j.view.final_pending = true;
  CHECK(j.Next().kind == Due::Kind::kSucceed);
}

TEST_CASE("a BSP every_steps cut names the next boundary once it is near and none past the end", "[cut_schedule]") {
  Job j(190);
  j.spec.mutable_checkpoint()->set_every_steps(100);
  j.CutAt(100);
  CHECK(j.Next().kind == Due::Kind::kNothing);  // 190 + 2 x 2 < 200
  j.status.mutable_workers(0)->set_step(196);
  CHECK(j.Next().at_step == 200);
  j.status.mutable_workers(0)->set_step(199);  // too close: the next boundary but one
  CHECK(j.Next().at_step == 300);
  // A faster job asks further ahead: 8 batches a second is a lead of 10.
  j.status.set_samples_per_second(8 * 32);
  j.status.mutable_workers(0)->set_step(185);
  CHECK(j.Next().at_step == 200);
  j.view.extra_lead = 10;  // after misses
  CHECK(j.Next().at_step == 300);
  // Near the end the final cut covers it.
  j.status.mutable_workers(0)->set_step(996);
  j.CutAt(900);
  CHECK(j.Next().kind == Due::Kind::kNothing);
}

TEST_CASE("an SSP every_steps cut is asked for once per boundary and taken at once", "[cut_schedule]") {
  Job j(95, v1::ConsistencySpec::SSP);
  j.spec.mutable_checkpoint()->set_every_steps(100);
  j.CutAt(20);
  CHECK(j.Next().kind == Due::Kind::kNothing);
  j.status.mutable_workers(0)->set_step(130);
  Due d = j.Next();
  CHECK(d.trigger == "steps");
  CHECK(d.at_step == 0);
  CHECK(d.steps_boundary_asked == 100);
  // The cut recorded the slowest rank's clock (below the boundary): not
  // asked again for the same boundary.
  j.CutAt(90);
  j.view.steps_boundary_asked = d.steps_boundary_asked;
  CHECK(j.Next().kind == Due::Kind::kNothing);
  j.status.mutable_workers(0)->set_step(205);
  CHECK(j.Next().steps_boundary_asked == 200);
}

TEST_CASE("every_seconds counts from the last cut or the start and a failure's backoff delays it", "[cut_schedule]") {
  Job j(40);
  j.spec.mutable_checkpoint()->set_every_seconds(30);
  j.CutAt(10);
  j.view.last_cut = kStart + absl::Seconds(10);
  j.view.now = kStart + absl::Seconds(39);
  CHECK(j.Next().kind == Due::Kind::kNothing);
  j.view.now = kStart + absl::Seconds(40);
  CHECK(j.Next().trigger == "seconds");
  j.view.backoff_until = kStart + absl::Seconds(45);
  CHECK(j.Next().kind == Due::Kind::kNothing);
  j.view.manual_pending = true;  // an asked cut does not wait out the backoff
  CHECK(j.Next().trigger == "manual");
  j.view.manual_pending = false;
  j.view.final_pending = true;
  CHECK(j.Next().trigger == "final");
}

TEST_CASE("a first cut that failed is not tried again and the policy takes over", "[cut_schedule]") {
  Job j(5);
  CHECK(j.Next().trigger == "first");
  j.view.first_cut_failed = true;
  CHECK(j.Next().kind == Due::Kind::kNothing);
  Job idle(0);
  CHECK(idle.Next().kind == Due::Kind::kNothing);  // no step yet: nothing to cut
}

TEST_CASE("local steps' cuts name the round that ends at or after the step", "[cut_schedule]") {
  Job j(5, v1::ConsistencySpec::LOCAL);
  j.spec.mutable_consistency()->set_sync_every_steps(4);
  j.spec.set_epochs(2);
  j.status.set_total_steps(20);  // 10 steps an epoch: rounds end at 4, 8, 10
  j.view.manual_pending = true;
  const Due d = j.Next();
  CHECK(d.at_step == 2);  // step 7 is inside round 2 (steps 5 to 8)
  CHECK(StepsOfRounds(j.spec, 10, 3) == 10);
  CHECK(StepsOfRounds(j.spec, 10, 5) == 18);
  CHECK(RoundsOfSteps(j.spec, 10, 10) == 3);
  CHECK(RoundsOfSteps(j.spec, 10, 19) == 5);
  for (uint64_t s = 0; s <= 20; ++s) CHECK(StepsOfRounds(j.spec, 10, RoundsOfSteps(j.spec, 10, s)) <= s);
  // With staleness the servers take cuts when asked.
  j.spec.mutable_consistency()->set_staleness(2);
  CHECK_FALSE(IsBsp(j.spec));
  CHECK(j.Next().at_step == 0);
}

}  // namespace
}  // namespace fulcrum::cut_schedule
