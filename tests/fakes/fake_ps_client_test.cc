#include <vector>

#include "tests/fakes/fake_ps_client.h"
#include "tests/testing/test_util.h"

namespace fulcrum::testing {
namespace {

TEST_CASE("the fake client queues calls until the test completes them", "[fake]") {
  FakePsClient c;
  REQUIRE_OK(c.CreateJob(JobSpec("j", {DenseTableSpec("w", 3, 0.5f)}, 1)));
  std::vector<float> g = {2, 4, 6}, w(3, 9.0f);
  auto push = c.PushAsync("j", {0, {{"w", g.data(), 3}}, {}});
  auto pull = c.PullAsync("j", {1, {{"w", w.data(), 3}}, {}});
  REQUIRE(c.pending() == 2);
  REQUIRE_FALSE(push.Ready());
  REQUIRE(c.CompleteNext());
  REQUIRE_OK(push.Wait());
  REQUIRE(c.CompleteNext());
  REQUIRE_OK(pull.Wait());
  REQUIRE(w == std::vector<float>{-1, -2, -3});
  REQUIRE_FALSE(c.CompleteNext());
  auto calls = c.calls();
  REQUIRE(calls.size() == 2);
  REQUIRE(calls[0].is_push);
  REQUIRE(calls[1].step == 1);
}

TEST_CASE("a call the fake fails has no effect", "[fake]") {
  FakePsClient c;
  REQUIRE_OK(c.CreateJob(JobSpec("j", {DenseTableSpec("w", 2, 1.0f)}, 1)));
  std::vector<float> g = {1, 1};
  auto push = c.PushAsync("j", {0, {{"w", g.data(), 2}}, {}});
  REQUIRE(c.CompleteNext(absl::UnavailableError("injected")));
  REQUIRE(push.Wait().code() == absl::StatusCode::kUnavailable);
  REQUIRE(c.Dense("j", "w") == std::vector<float>{0, 0});
  c.set_auto_complete(true);
  REQUIRE_OK(c.Push("j", {1, {{"w", g.data(), 2}}, {}}));
  REQUIRE(c.Dense("j", "w") == std::vector<float>{-1, -1});
  REQUIRE(c.Push("missing", {0, {}, {}}).code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace fulcrum::testing
