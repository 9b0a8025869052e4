#include "common/backoff.h"

#include <set>

#include <catch2/catch.hpp>

namespace fulcrum {
namespace {

TEST_CASE("backoff doubles from its first delay up to its cap and starts over after a reset", "[backoff]") {
  Backoff b({.initial = absl::Milliseconds(100), .max = absl::Milliseconds(500), .jitter = 0}, 1);
  const absl::Duration want[] = {absl::Milliseconds(100), absl::Milliseconds(200), absl::Milliseconds(400),
                                 absl::Milliseconds(500), absl::Milliseconds(500)};
  for (absl::Duration d : want) CHECK(b.Next() == d);
  CHECK(b.failures() == 5);
  b.Reset();
  CHECK(b.failures() == 0);
  CHECK(b.Next() == absl::Milliseconds(100));
}

TEST_CASE("backoff jitter keeps each delay within 20% of its base and never past the cap", "[backoff]") {
  Backoff b({.initial = absl::Milliseconds(250), .max = absl::Seconds(2)}, 7);
  absl::Duration base = absl::Milliseconds(250);
  for (int i = 0; i < 200; ++i) {
    const absl::Duration d = b.Next();
    INFO("try " << i << ": " << absl::FormatDuration(d) << " around " << absl::FormatDuration(base));
    CHECK(d >= base * 0.8);
    CHECK(d <= base * 1.2);
    CHECK(d <= absl::Seconds(2));
    base = std::min(base * 2, absl::Seconds(2));
  }
}

TEST_CASE("backoffs of nodes that failed together spread their retries", "[backoff]") {
  // 50 nodes cut off by the same coordinator restart: their first retries
  // are not one instant (the point of the jitter).
  std::set<int64_t> first;
  for (uint64_t node = 1; node <= 50; ++node) {
    Backoff b({.initial = absl::Milliseconds(100), .max = absl::Milliseconds(500)}, node);
    first.insert(absl::ToInt64Microseconds(b.Next()));
  }
  CHECK(first.size() >= 45);
  CHECK(*first.begin() >= 80000);
  CHECK(*first.rbegin() <= 120000);
  CHECK(*first.rbegin() - *first.begin() >= 20000);  // spread over at least half the +-20% window
}

}  // namespace
}  // namespace fulcrum
