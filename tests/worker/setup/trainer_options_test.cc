// The trainer's options for a spec: what the spec sets, what the rank's
// environment sets, and the difference between per-step training and
// local steps, as both fulcrum-worker and fulcrum-train-local get them.
#include "worker/setup/trainer_options.h"

#include <catch2/catch.hpp>

#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

v1::JobSpec BspSpec() {
  v1::JobSpec spec;
  spec.set_seed(7);
  spec.mutable_consistency()->set_model(v1::ConsistencySpec::BSP);
  return spec;
}

TEST_CASE("a per-step spec's options: its seed, shuffling, clipping and steps, and the rank's batch and threads",
          "[setup]") {
  v1::JobSpec spec = BspSpec();
  spec.mutable_optimizer()->set_clip_global_norm(2.5f);
  spec.set_max_steps_per_epoch(40);
  RankEnvironment env;
  env.job_id = "j";
  env.rank = 1;
  env.world_size = 3;
  env.batch_size = 64;
  env.decode_threads = 5;
  env.prefetch_hints = true;
  env.device_data = "off";
  env.device_data_share = 0.5;
  REQUIRE_OK_AND_ASSIGN(training::TrainerOptions to, TrainerOptionsFor(spec, env));
  CHECK(to.job_id == "j");
  CHECK(to.rank == 1);
  CHECK(to.world_size == 3);
  CHECK(to.batch_size == 64);
  CHECK(to.seed == 7);
  CHECK(to.shuffle);
  CHECK(to.prefetch_parameters);
  CHECK(to.sync_every == 0);
  CHECK(to.clip_global_norm == 2.5f);
  CHECK(to.max_steps_per_epoch == 40);
  CHECK(to.decode_threads == 5);
  CHECK(to.prefetch_hints);
  CHECK(to.device_data == data::DeviceDataMode::kOff);
  CHECK(to.device_data_share == 0.5);

  spec.mutable_data()->set_no_shuffle(true);
  env.decode_threads = 0;
  env.cores = 8;
  REQUIRE_OK_AND_ASSIGN(to, TrainerOptionsFor(spec, env));
  CHECK_FALSE(to.shuffle);
  CHECK(to.decode_threads == data::DefaultDecodeThreads(8, false));
}

TEST_CASE("local steps: rounds of the spec's length, its inner optimizer, no per-step prefetch", "[setup]") {
  v1::JobSpec spec = BspSpec();
  v1::ConsistencySpec* c = spec.mutable_consistency();
  c->set_model(v1::ConsistencySpec::LOCAL);
  c->set_sync_every_steps(16);
  c->set_overlap_rounds(true);
  c->mutable_inner_optimizer()->set_kind(v1::OptimizerSpec::ADAM);
  c->mutable_inner_optimizer()->set_learning_rate(0.001f);
  RankEnvironment env;
  env.batch_size = 32;
  REQUIRE_OK_AND_ASSIGN(training::TrainerOptions to, TrainerOptionsFor(spec, env));
  CHECK(to.sync_every == 16);
  CHECK(to.overlap_rounds);
  CHECK_FALSE(to.prefetch_parameters);
  CHECK(to.inner.kind == compute::InnerOptimizer::Kind::kAdam);
  CHECK(to.inner.learning_rate == 0.001f);
}

TEST_CASE("bad device_data and inner optimizers are refused, naming them", "[setup]") {
  RankEnvironment env;
  env.device_data = "sometimes";
  absl::Status s = TrainerOptionsFor(BspSpec(), env).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()), Catch::Contains("sometimes"));

  v1::JobSpec spec = BspSpec();
  spec.mutable_consistency()->set_model(v1::ConsistencySpec::LOCAL);
  spec.mutable_consistency()->set_sync_every_steps(4);
  spec.mutable_consistency()->mutable_inner_optimizer()->set_kind(v1::OptimizerSpec::ADAGRAD);
  s = TrainerOptionsFor(spec, RankEnvironment()).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()), Catch::Contains("inner_optimizer"));
}

}  // namespace
}  // namespace fulcrum
