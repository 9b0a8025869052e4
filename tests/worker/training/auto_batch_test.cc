// batch_size auto's search against a fake device of known memory and speed,
// its learning-rate rule, the real trial on the CPU backend, and the GPU
// time meter with a fake NVML.
#include <cmath>
#include <optional>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "common/config/job_spec.h"
#include "common/config/spec_text.h"
#include "worker/daemon/gpu_time.h"
#include "worker/data/dataset.h"
#include "worker/training/auto_batch.h"

namespace fulcrum::training {
namespace {

// A device of 4 GiB whose step needs 1 MiB per example, and whose samples/s
// saturate as batch / (batch + 512): 32 -> 59k/s, ..., 2048 -> 800k/s, 4096
// -> 889k/s.
struct FakeDevice {
  size_t memory = size_t{4} << 30;
  double bytes_per_example = 1 << 20;
  double peak_rate = 1e6;
  double half_batch = 512;
  int allocation_limit = 1 << 30;  // batches above this fail to allocate
  std::vector<int> tried;

  TrialFn Trial() {
    return [this](int batch) -> absl::StatusOr<BatchTrial> {
      tried.push_back(batch);
      if (batch > allocation_limit) return absl::ResourceExhaustedError("cudaMalloc: out of memory");
      BatchTrial t;
      t.batch = batch;
      t.samples_per_second = peak_rate * batch / (batch + half_batch);
      t.peak_bytes = static_cast<size_t>(bytes_per_example * batch);
      return t;
    };
  }
};

TEST_CASE("batch_size auto keeps the largest batch that fits with headroom and still pays", "[auto_batch]") {
  FakeDevice dev;
  AutoBatchOptions o;  // base 32, min gain 10%, headroom 25%, 200 warm-up steps
  auto c = ChooseBatchSize(o, dev.memory, /*limit=*/1 << 20, dev.Trial());
  REQUIRE(c.ok());
  // 4096 examples need 4 GiB, over 75% of the device: 2048 is the largest
  // that fits; every doubling up to it gained more than 10%.
  CHECK(c->batch == 2048);
  CHECK(dev.tried == std::vector<int>{32, 64, 128, 256, 512, 1024, 2048, 4096});
  CHECK(c->lr.factor == 64.0);
  CHECK(c->lr.warmup_steps == 200);
  CHECK(c->trials.back().fits == false);
  CHECK(absl::StrContains(c->summary, "batch 2048"));
  CHECK(absl::StrContains(c->summary, "4096 does not fit"));

  SECTION("a gain under min_gain stops the search before memory does") {
    FakeDevice big;
    big.memory = size_t{1} << 40;
    o.min_gain = 0.25;  // 1024 -> 2048 gains 20%
    auto g = ChooseBatchSize(o, big.memory, 1 << 20, big.Trial());
    REQUIRE(g.ok());
    CHECK(g->batch == 1024);
    CHECK(big.tried.back() == 2048);
    CHECK(absl::StrContains(g->summary, "2048 gains +20% < 25%"));
  }
  SECTION("an allocation failure is a batch that does not fit") {
    FakeDevice small;
    small.allocation_limit = 300;
    auto g = ChooseBatchSize(o, small.memory, 1 << 20, small.Trial());
    REQUIRE(g.ok());
    CHECK(g->batch == 256);
    CHECK(absl::StrContains(g->summary, "out of memory"));
  }
  SECTION("the shard and max_batch_size cap the batch") {
    FakeDevice d2;
    auto g = ChooseBatchSize(o, d2.memory, /*limit=*/700, d2.Trial());
    REQUIRE(g.ok());
    CHECK(d2.tried.back() == 700);
    CHECK(g->batch == 700);
    o.max_batch_size = 128;
    FakeDevice d3;
    g = ChooseBatchSize(o, d3.memory, 1 << 20, d3.Trial());
    REQUIRE(g.ok());
    CHECK(g->batch == 128);
    CHECK(g->lr.factor == 4.0);
  }
  SECTION("when even the first batch does not fit the search fails and says what to change") {
    FakeDevice tiny;
    tiny.allocation_limit = 16;
    auto g = ChooseBatchSize(o, tiny.memory, 1 << 20, tiny.Trial());
    REQUIRE(!g.ok());
    CHECK(g.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(g.status().message(), "base_batch_size"));
  }
  SECTION("other trial errors end the search with that error") {
    auto g = ChooseBatchSize(o, dev.memory, 1 << 20,
                             [](int) -> absl::StatusOr<BatchTrial> { return absl::InternalError("cublas: boom"); });
    REQUIRE(!g.ok());
    CHECK(g.status().code() == absl::StatusCode::kInternal);
  }
}

TEST_CASE("the learning rate scales linearly with the batch after a linear warm-up", "[auto_batch]") {
  LrScaling s{.factor = 8.0, .warmup_steps = 100};
  CHECK(s.At(0) == 1.0f);
  CHECK(s.At(50) == Approx(4.5));
  CHECK(s.At(100) == 8.0f);
  CHECK(s.At(100000) == 8.0f);
  LrScaling none;
  CHECK(none.At(7) == 1.0f);
  LrScaling now{.factor = 2.0, .warmup_steps = 0};
  CHECK(now.At(0) == 2.0f);
}

TEST_CASE("a trial on the CPU backend measures samples/s and the step's memory", "[auto_batch]") {
  std::vector<float> x(64 * 20), y(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7) % 13) / 13.0f;
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>(i % 3);
  auto data = data::DenseInMemory(x, y, 20, 3, "synthetic");
  auto be = compute::NewCpuBackend(1);
  models::ModelConfig mc;
  mc.type = "mlp";
  mc.num_features = 20;
  mc.num_classes = 3;
  mc.hidden = {16};
  auto small = MeasureBatch(be.get(), mc, *data, 8, 0.01);
  REQUIRE(small.ok());
  auto large = MeasureBatch(be.get(), mc, *data, 128, 0.01);  // more rows than the data: repeated
  REQUIRE(large.ok());
  CHECK(small->samples_per_second > 0);
  CHECK(large->samples_per_second > 0);
  // The input alone is batch x 20 floats; the larger batch holds more.
  CHECK(small->peak_bytes >= 8 * 20 * 4);
  CHECK(large->peak_bytes >= 128 * 20 * 4);
  CHECK(large->peak_bytes > small->peak_bytes);
  CHECK(be->allocated_bytes() == 0);  // the trial's model is gone
}

TEST_CASE("'batch_size: auto' in a spec turns the search on, and its settings are checked", "[auto_batch]") {
  v1::JobSpec spec;
  REQUIRE(config::ParseSpecText("name: a\nbatch_size: auto\nbatch_size_auto: {max_batch_size: 4096}\n", "s.yaml",
                                &spec)
              .ok());
  CHECK(spec.batch_size() == 0);
  CHECK(spec.batch_size_auto().enabled());
  CHECK(spec.batch_size_auto().max_batch_size() == 4096);
  const auto problems = [](const v1::JobSpec& s) {
    std::string all;
    for (const std::string& p : config::JobSpecProblems(s)) all += p + "\n";
    return all;
  };
  CHECK(!absl::StrContains(problems(spec), "batch_size"));
  spec.set_batch_size(64);
  CHECK(absl::StrContains(problems(spec), "give a number or 'auto', not both"));
  spec.set_batch_size(0);
  spec.mutable_batch_size_auto()->set_memory_headroom(0.99);
  spec.mutable_batch_size_auto()->set_max_batch_size(8);
  spec.mutable_batch_size_auto()->set_base_batch_size(16);
  const std::string p = problems(spec);
  CHECK(absl::StrContains(p, "batch_size_auto.memory_headroom: 0.99"));
  CHECK(absl::StrContains(p, "batch_size_auto.max_batch_size: 8"));
  v1::JobSpec fixed;
  CHECK(!config::ParseSpecText("name: a\nbatch_size: lots\n", "s.yaml", &fixed).ok());
}

TEST_CASE("GPU-seconds advance only while a rank trains, split by a fake NVML's utilization", "[gpu_time]") {
  std::optional<double> util = 0.75;
  GpuTimeMeter m([&] { return util; });
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  m.Sample(t0 + absl::Seconds(5));  // not training yet: nothing counts
  CHECK(m.busy_seconds() == 0);
  CHECK(m.idle_seconds() == 0);
  m.Start(t0 + absl::Seconds(10));
  m.Sample(t0 + absl::Seconds(14));  // 4 s at 75%
  CHECK(m.busy_seconds() == Approx(3.0));
  CHECK(m.idle_seconds() == Approx(1.0));
  util = 0.25;
  m.Stop(t0 + absl::Seconds(18));  // 4 s at 25%
  CHECK(m.busy_seconds() == Approx(4.0));
  CHECK(m.idle_seconds() == Approx(4.0));
  m.Sample(t0 + absl::Seconds(60));  // stopped: nothing more
  CHECK(m.busy_seconds() + m.idle_seconds() == Approx(8.0));
  util.reset();  // NVML unreadable: the time still counts, as busy
  m.Start(t0 + absl::Seconds(100));
  m.Stop(t0 + absl::Seconds(102));
  CHECK(m.busy_seconds() == Approx(6.0));
  CHECK(m.idle_seconds() == Approx(4.0));
  CHECK(!m.running());
}

}  // namespace
}  // namespace fulcrum::training
