// Several ranks train as well as one: 4 ranks reach one rank's MNIST test
// accuracy in the same epochs under each consistency setting
// docs/consistency.md recommends ("Several workers, one model's accuracy").
// Real MNIST, the CPU backend, a real ParameterServer core behind
// LocalPsClient, one thread per rank; wall times are printed (the
// benchmarks in docs/benchmarks.md report them), not asserted.
#include <cstdio>

#include <catch2/catch.hpp>

#include "tests/testing/mnist_training.h"
#include "tests/testing/test_util.h"

namespace fulcrum::training {
namespace {

using testing::LoadMnist;
using testing::Mixed;
using testing::Mnist;
using testing::Opt;
using testing::Outcome;
using testing::Train;

constexpr int kHidden = 512;
constexpr int kBatch = 64;
constexpr float kRate = 0.1f;  // one rank's SGD rate

TEST_CASE("4 ranks reach one rank's accuracy within 0.5 point in an epoch: per-step BSP and ASP with "
          "staleness_aware_lr at 4x the rate, and local rounds",
          "[convergence]") {
  const Mnist d = LoadMnist(1);
  const Outcome one = Train(d, 1, 1, kBatch, Opt(v1::OptimizerSpec::SGD, kRate), 0, {}, -1, false, {}, kHidden);
  std::printf("MNIST 784-%d-10, batch %d, 1 epoch; 1 rank, SGD %.2f: test accuracy %.4f in %.2f s\n", kHidden, kBatch,
              kRate, one.test_accuracy, one.seconds);
  CHECK(one.test_accuracy >= 0.92);

  // BSP averages the 4 ranks' gradients: a quarter of the steps, each over
  // 4x the samples, so the rate scales with the ranks (linear scaling).
  const Outcome bsp = Train(d, 4, 1, kBatch, Opt(v1::OptimizerSpec::SGD, 4 * kRate), 0, {}, -1, false, {}, kHidden);
  std::printf("4 ranks, per-step BSP, SGD %.2f: %.4f in %.2f s\n", 4 * kRate, bsp.test_accuracy, bsp.seconds);
  CHECK(bsp.test_accuracy >= one.test_accuracy - 0.005);

  // ASP applies every push; dividing each by its staleness (about the
  // ranks taking turns) leaves the 4x rate acting as BSP's on the mean.
  Mixed asp;
  asp.per_step = v1::ConsistencySpec::ASP;
  asp.staleness_aware_lr = true;
  const Outcome aware = Train(d, 4, 1, kBatch, Opt(v1::OptimizerSpec::SGD, 4 * kRate), 0, {}, -1, false, asp, kHidden);
  std::printf("4 ranks, ASP with staleness_aware_lr, SGD %.2f: %.4f in %.2f s\n", 4 * kRate, aware.test_accuracy,
              aware.seconds);
  CHECK(aware.test_accuracy >= one.test_accuracy - 0.005);

  // Local rounds of 16 steps with the one rank's SGD inside, Nesterov 0.9
  // at rate 1 outside.
  const Outcome local = Train(d, 4, 1, kBatch, Opt(v1::OptimizerSpec::MOMENTUM, 1.0f, 0.9f, true), 16,
                              Opt(v1::OptimizerSpec::SGD, kRate), -1, false, {}, kHidden);
  std::printf("4 ranks, local rounds H=16 (inner SGD %.2f, outer Nesterov 0.9 at 1.0): %.4f in %.2f s\n", kRate,
              local.test_accuracy, local.seconds);
  CHECK(local.test_accuracy >= one.test_accuracy - 0.005);
}

TEST_CASE("with every push 3 steps late, ASP at 4x the rate diverges plainly and trains with staleness_aware_lr",
          "[convergence]") {
  // As a GPU whose pushes are still in flight while it computes ahead.
  const Mnist d = LoadMnist(1);
  Mixed asp;
  asp.per_step = v1::ConsistencySpec::ASP;
  asp.lag_steps = 3;
  const Outcome plain = Train(d, 4, 1, kBatch, Opt(v1::OptimizerSpec::SGD, 4 * kRate), 0, {}, -1, false, asp, kHidden);
  asp.staleness_aware_lr = true;
  const Outcome aware = Train(d, 4, 1, kBatch, Opt(v1::OptimizerSpec::SGD, 4 * kRate), 0, {}, -1, false, asp, kHidden);
  std::printf("4 ranks, ASP, pushes 3 steps late, SGD %.2f: plain %.4f, staleness_aware_lr %.4f\n", 4 * kRate,
              plain.test_accuracy, aware.test_accuracy);
  CHECK(aware.test_accuracy >= 0.85);
  CHECK(aware.test_accuracy > plain.test_accuracy);
}

}  // namespace
}  // namespace fulcrum::training
