#include "common/parallel.h"

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace fulcrum {
namespace {

TEST_CASE("ParallelRunner runs every index once and shares the work among threads", "[parallel]") {
  ParallelRunner runner(3);
  REQUIRE(runner.helpers() == 3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{1000}}) {
    std::vector<std::atomic<int>> calls(n);
    runner.ForEach(n, [&](size_t i) { calls[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) REQUIRE(calls[i].load() == 1);
  }
  // Iterations long enough that a parked helper wakes while the caller works.
  absl::Mutex mu;
  std::set<std::thread::id> ids;
  runner.ForEach(40, [&](size_t) {
    absl::SleepFor(absl::Milliseconds(5));
    absl::MutexLock lock(&mu);
    ids.insert(std::this_thread::get_id());
  });
  REQUIRE(ids.size() > 1);
}

TEST_CASE("ParallelRunner without helpers runs on the calling thread", "[parallel]") {
  ParallelRunner runner(0);
  std::set<std::thread::id> ids;
  runner.ForEach(50, [&](size_t) { ids.insert(std::this_thread::get_id()); });
  REQUIRE(ids == std::set<std::thread::id>{std::this_thread::get_id()});
}

TEST_CASE("ParallelRunner serves concurrent callers without losing an index", "[parallel]") {
  ParallelRunner runner(2);
  constexpr int kCallers = 4, kRounds = 200, kN = 64;
  std::vector<std::atomic<int>> calls(kCallers * kN);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int r = 0; r < kRounds; ++r) {
        runner.ForEach(kN, [&](size_t i) { calls[c * kN + i].fetch_add(1); });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (const auto& c : calls) REQUIRE(c.load() == kRounds);
}

}  // namespace
}  // namespace fulcrum
