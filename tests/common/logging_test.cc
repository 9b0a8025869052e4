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

}  // namespace
}  // namespace fulcrum
