#include "common/logging.h"

#include <catch2/catch.hpp>

namespace fulcrum {
namespace {

TEST_CASE("HumanBytes picks the largest binary unit below the size", "[logging]") {
  CHECK(HumanBytes(0) == "0 B");
  CHECK(HumanBytes(1023) == "1023 B");
  CHECK(HumanBytes(1024) == "1.0 KiB");
  CHECK(HumanBytes(31440) == "30.7 KiB");
  CHECK(HumanBytes(10000000) == "9.5 MiB");
  CHECK(HumanBytes(uint64_t{8} << 30) == "8.0 GiB");
}

TEST_CASE("LogLimiter lets a burst through per window and counts what it held back", "[logging]") {
  LogLimiter limiter(3, absl::Minutes(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t dropped = 99;
  for (int i = 0; i < 3; ++i) {
    REQUIRE(limiter.Allow(t0 + absl::Seconds(i), &dropped));
    CHECK(dropped == 0);
  }
  for (int i = 0; i < 1000; ++i) CHECK_FALSE(limiter.Allow(t0 + absl::Seconds(10), &dropped));
  // The next window: one gets through, saying how many were dropped.
  REQUIRE(limiter.Allow(t0 + absl::Seconds(61), &dropped));
  CHECK(dropped == 1000);
  REQUIRE(limiter.Allow(t0 + absl::Seconds(62), &dropped));
  CHECK(dropped == 0);
}

}  // namespace
}  // namespace fulcrum
