// How the Trainer overlaps communication with compute, seen through the
// calls it makes on a FakePsClient: per-layer push groups during backward,
// the next step's pull issued before this step's push under SSP/ASP, and
// pushes that complete in the background but are all waited for by the end
// of an epoch. Real gRPC servers are exercised by parameter_server_test
// ("[groups]") and the cluster tests.
#include <atomic>
#include <cmath>
#include <random>
#include <set>
#include <thread>

#include "tests/fakes/fake_ps_client.h"
#include "tests/testing/test_util.h"
#include "worker/data/dataset.h"
#include "worker/training/trainer.h"

namespace fulcrum::training {
namespace {

using testing::FakePsClient;

// 256 examples of 20 features in 3 separable classes.
std::unique_ptr<data::Dataset> Synthetic() {
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0, 0.3f);
  std::vector<float> x, y;
  for (int i = 0; i < 256; ++i) {
    const int c = i % 3;
    for (int f = 0; f < 20; ++f) x.push_back((f % 3 == c ? 1.0f : 0.0f) + noise(rng));
    y.push_back(static_cast<float>(c));
  }
  return data::DenseInMemory(std::move(x), std::move(y), 20, 3, "synthetic");
}

struct Setup {
  std::unique_ptr<compute::Backend> backend = compute::NewCpuBackend(1);
  std::unique_ptr<models::Model> model;
  FakePsClient client;
  std::unique_ptr<Trainer> trainer;

  // prefetch: TrainerOptions::prefetch_parameters, by default what the
  // model answers at once (AllowsPrefetch).
  Setup(TrainerOptions o, v1::ConsistencySpec::Model cm = v1::ConsistencySpec::BSP, int prefetch = -1) {
    models::ModelConfig c;
    c.type = "mlp";
    c.num_features = 20;
    c.num_classes = 3;
    c.hidden = {16, 8};
    auto m = models::CreateModel(c, backend.get());
    REQUIRE_OK(m.status());
    model = std::move(*m);
    v1::OptimizerSpec sgd;
    sgd.set_kind(v1::OptimizerSpec::SGD);
    sgd.set_learning_rate(0.1f);
    v1::ConsistencySpec cs;
    cs.set_model(cm);
    cs.set_staleness(cm == v1::ConsistencySpec::SSP ? 1 : 0);
    o.job_id = "j";
    o.prefetch_parameters = prefetch < 0 ? AllowsPrefetch(cs) : prefetch == 1;
    REQUIRE_OK(client.CreateJob(JobSpecFor(*model, "j", sgd, cs, 1)));
    client.set_auto_complete(true);
    trainer = std::make_unique<Trainer>(model.get(), &client, std::move(o));
  }
};

TEST_CASE("only SSP with a bound >= 1 and ASP answer a prefetched pull at once") {
  v1::ConsistencySpec c;
  c.set_model(v1::ConsistencySpec::BSP);
  REQUIRE_FALSE(AllowsPrefetch(c));
  c.set_model(v1::ConsistencySpec::SSP);
  REQUIRE_FALSE(AllowsPrefetch(c));  // SSP(0) is BSP
  c.set_staleness(1);
  REQUIRE(AllowsPrefetch(c));
  c.set_model(v1::ConsistencySpec::ASP);
  REQUIRE(AllowsPrefetch(c));
}

TEST_CASE("per-layer push: the last layer's gradients go out before backward ends, each table once") {
  TrainerOptions o;
  o.batch_size = 64;
  o.min_push_group_bytes = 0;  // every table as soon as it is ready
  o.max_steps_per_epoch = 2;
  Setup s(o);
  auto data = Synthetic();
  REQUIRE_OK(s.trainer->TrainEpoch(*data, 0).status());
  // Per step: a pull, then push groups; the MLP reports each layer's bias
  // and weight from the last layer back.
  std::vector<FakePsClient::Call> calls = s.client.calls();
  for (uint64_t step = 0; step < 2; ++step) {
    std::vector<FakePsClient::Call> pushes;
    for (const auto& c : calls) {
      if (c.is_push && c.step == step) pushes.push_back(c);
    }
    REQUIRE(pushes.size() >= 3);
    REQUIRE(pushes.front().tables.front().rfind("dense2.", 0) == 0);  // the output layer first
    std::multiset<std::string> seen;
    for (size_t k = 0; k < pushes.size(); ++k) {
      INFO("step " << step << " group " << k);
      REQUIRE(pushes[k].last == (k + 1 == pushes.size()));
      seen.insert(pushes[k].tables.begin(), pushes[k].tables.end());
    }
    REQUIRE(seen.size() == 6);
    REQUIRE(std::set<std::string>(seen.begin(), seen.end()).size() == 6);  // no table twice
  }
}

TEST_CASE("small models push a step in one group by default") {
  TrainerOptions o;
  o.batch_size = 64;
  o.max_steps_per_epoch = 2;
  Setup s(o);
  auto data = Synthetic();
  REQUIRE_OK(s.trainer->TrainEpoch(*data, 0).status());
  size_t pushes = 0;
  for (const auto& c : s.client.calls()) {
    if (!c.is_push) continue;
    ++pushes;
    REQUIRE(c.last);
    REQUIRE(c.tables.size() == 6);
  }
  REQUIRE(pushes == 2);
}

TEST_CASE("grouped pushes train the same weights as whole-step pushes") {
  auto data = Synthetic();
  std::vector<std::vector<float>> weights;
  for (size_t group : {size_t{0}, SIZE_MAX}) {
    TrainerOptions o;
    o.batch_size = 32;
    o.min_push_group_bytes = group;
    Setup s(o);
    REQUIRE_OK(s.trainer->TrainEpoch(*data, 0).status());
    weights.push_back(s.client.Dense("j", "dense0.weight"));
  }
  REQUIRE(weights[0].size() == 20 * 16);
  REQUIRE(weights[0] == weights[1]);
}

// One step of the MLP on the fake (SGD, lr 0.1): every table's weights
// before and after, the step's metrics and its push calls.
struct OneStep {
  std::vector<std::vector<float>> before, after;
  models::Metrics metrics;
  int pushes = 0;
  // The step's gradient (before - after) / lr, all tables end to end.
  std::vector<double> Gradient() const {
    std::vector<double> g;
    for (size_t t = 0; t < before.size(); ++t) {
      for (size_t i = 0; i < before[t].size(); ++i) g.push_back((before[t][i] - after[t][i]) / 0.1);
    }
    return g;
  }
};

OneStep RunOneStep(float clip) {
  auto data = Synthetic();
  TrainerOptions o;
  o.batch_size = 32;
  o.max_steps_per_epoch = 1;
  o.min_push_group_bytes = 0;  // every layer on its own as soon as it is ready
  o.clip_global_norm = clip;
  OneStep out;
  o.on_step = [&out](uint64_t, const models::Metrics& m, const StepTiming&) { out.metrics = m; };
  Setup s(o);
  for (const auto& t : s.model->tables()) out.before.push_back(s.client.Dense("j", t.spec.name()));
  REQUIRE_OK(s.trainer->TrainEpoch(*data, 0).status());
  for (const auto& t : s.model->tables()) out.after.push_back(s.client.Dense("j", t.spec.name()));
  for (const auto& call : s.client.calls()) out.pushes += call.is_push;
  return out;
}

double Norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

TEST_CASE("clipping by global norm scales a step's gradients down to the bound and keeps their direction") {
  const OneStep free = RunOneStep(0);
  const std::vector<double> g = free.Gradient();
  const double norm = Norm(g);
  REQUIRE(norm > 0);
  CHECK(free.metrics.grad_norm == -1);  // not computed without clipping
  CHECK(free.pushes == 6);               // three layers, weight and bias each, pushed as ready

  const OneStep clipped = RunOneStep(static_cast<float>(norm / 2));
  CHECK(clipped.metrics.clipped);
  CHECK(clipped.metrics.grad_norm == Approx(norm).epsilon(1e-4));
  CHECK(clipped.pushes == 1);  // the scale needs the whole backward: one group
  const std::vector<double> h = clipped.Gradient();
  REQUIRE(h.size() == g.size());
  CHECK(Norm(h) == Approx(norm / 2).epsilon(1e-3));
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i);
    REQUIRE(h[i] == Approx(g[i] / 2).epsilon(1e-3).margin(1e-6));
  }

  // Under the bound nothing changes, bit for bit.
  const OneStep loose = RunOneStep(static_cast<float>(norm * 2));
  CHECK_FALSE(loose.metrics.clipped);
  CHECK(loose.metrics.grad_norm == Approx(norm).epsilon(1e-4));
  CHECK(loose.after == free.after);
}

// One epoch trained on a thread, the test completing the fake's calls by
// hand; however the test ends, what the trainer waits for is completed and
// the thread joined.
struct BackgroundEpoch {
  Setup& s;
  std::atomic<bool> done{false};
  absl::StatusOr<EpochResult> result;
  std::thread thread;

  BackgroundEpoch(Setup& setup, const data::Dataset& data) : s(setup) {
    s.client.set_auto_complete(false);
    thread = std::thread([this, &data] {
      result = s.trainer->TrainEpoch(data, 0);
      done = true;
    });
  }
  ~BackgroundEpoch() { Join(); }
  void Join() {
    if (!thread.joinable()) return;
    s.client.set_auto_complete(true);
    while (s.client.CompleteNext()) {
    }
    thread.join();
  }
};

// The order of calls by kind and step: "pull 0", "push 0", ...
std::vector<std::string> Order(const FakePsClient& c) {
  std::vector<std::string> out;
  for (const auto& call : c.calls()) out.push_back((call.is_push ? "push " : "pull ") + std::to_string(call.step));
  return out;
}

TEST_CASE("under BSP a step's pull waits for the previous step's push") {
  TrainerOptions o;
  o.batch_size = 64;
  o.max_steps_per_epoch = 3;
  Setup s(o, v1::ConsistencySpec::BSP);
  auto data = Synthetic();
  REQUIRE_OK(s.trainer->TrainEpoch(*data, 0).status());
  REQUIRE(Order(s.client) == std::vector<std::string>{"pull 0", "push 0", "pull 1", "push 1", "pull 2", "push 2"});
}

TEST_CASE("under BSP with prefetching the next step's pull goes out before this step's push") {
  // The servers hold it until the step is applied (training_test checks the
  // weights are those of pulling after each push).
  TrainerOptions o;
  o.batch_size = 64;
  o.max_steps_per_epoch = 3;
  Setup s(o, v1::ConsistencySpec::BSP, /*prefetch=*/1);
  auto data = Synthetic();
  REQUIRE_OK(s.trainer->TrainEpoch(*data, 0).status());
  REQUIRE(Order(s.client) == std::vector<std::string>{"pull 0", "pull 1", "push 0", "pull 2", "push 1", "push 2"});
}

TEST_CASE("under SSP(1) and ASP the next step's parameters are pulled before this step's push") {
  for (auto model : {v1::ConsistencySpec::SSP, v1::ConsistencySpec::ASP}) {
    TrainerOptions o;
    o.batch_size = 64;
    o.max_steps_per_epoch = 3;
    Setup s(o, model);
    auto data = Synthetic();
    REQUIRE_OK_AND_ASSIGN(EpochResult e, s.trainer->TrainEpoch(*data, 0));
    REQUIRE(e.steps == 3);
    // No prefetch past the epoch's last step.
    REQUIRE(Order(s.client) ==
            std::vector<std::string>{"pull 0", "pull 1", "push 0", "pull 2", "push 1", "push 2"});
    // The prefetched pulls carry the dense tables only; this model has no sparse ones.
    for (const auto& c : s.client.calls()) REQUIRE(c.tables.size() == 6);
  }
}

TEST_CASE("under SSP a push still in flight does not hold up the next step, and the epoch waits for it") {
  TrainerOptions o;
  o.batch_size = 64;
  o.max_steps_per_epoch = 2;
  Setup s(o, v1::ConsistencySpec::SSP);
  auto data = Synthetic();
  BackgroundEpoch run(s, *data);
  auto wait_calls = [&](size_t n) {
    for (int i = 0; i < 2000 && s.client.calls().size() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    REQUIRE(s.client.calls().size() >= n);
  };
  // pull 0, then (once it is answered) the prefetch of step 1.
  wait_calls(1);
  REQUIRE(s.client.CompleteNext());  // pull 0
  wait_calls(2);
  REQUIRE(s.client.CompleteNext());  // pull 1 (prefetch)
  // Step 0 pushes; step 1 runs without that push completing and pushes too.
  wait_calls(4);
  REQUIRE(Order(s.client) == std::vector<std::string>{"pull 0", "pull 1", "push 0", "push 1"});
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE_FALSE(run.done.load());  // the epoch waits for both pushes
  REQUIRE(s.client.CompleteNext());
  REQUIRE(s.client.CompleteNext());
  for (int i = 0; i < 2000 && !run.done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(run.done.load());
  run.Join();
  REQUIRE_OK(run.result.status());
  REQUIRE(run.result->steps == 2);
  REQUIRE(s.client.pending() == 0);
}

TEST_CASE("a failed background push fails the epoch with its error") {
  TrainerOptions o;
  o.batch_size = 64;
  o.max_steps_per_epoch = 4;
  Setup s(o, v1::ConsistencySpec::ASP);
  auto data = Synthetic();
  BackgroundEpoch run(s, *data);
  // Complete calls as they come (the trainer waits on them); fail the first push.
  bool failed = false;
  for (int i = 0; i < 10000 && !run.done.load(); ++i) {
    const auto calls = s.client.calls();
    const size_t pending = s.client.pending();
    if (pending == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    const bool push = calls[calls.size() - pending].is_push;
    s.client.CompleteNext(push && !failed ? absl::InvalidArgumentError("gradient of 'dense0.weight' is NaN")
                                          : absl::OkStatus());
    failed = failed || push;
  }
  run.Join();
  REQUIRE(failed);
  REQUIRE_STATUS(run.result.status(), absl::StatusCode::kInvalidArgument, "NaN");
}

}  // namespace
}  // namespace fulcrum::training
