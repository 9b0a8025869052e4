// Data paths from job specs (which arrive over the network) stay inside the
// worker's data roots: relative paths, absolute paths, "..", and symlinks
// that lead out.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "tests/testing/process_util.h"
#include "worker/setup/job_data.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

TEST_CASE("data paths resolve only inside the worker's data roots", "[data][security]") {
  const fs::path base = testing::MakeTempDir("fulcrum-roots");
  const fs::path root = base / "data", other = base / "more", outside = base / "secret";
  fs::create_directories(root / "mnist");
  fs::create_directories(other);
  fs::create_directories(outside);
  std::ofstream(root / "mnist" / "train.csv") << "0.5,1\n0.25,0\n";
  std::ofstream(other / "x.csv") << "0.5,1\n";
  std::ofstream(outside / "s.csv") << "0.5,1\n";
  fs::create_symlink(outside, root / "escape");
  const std::vector<std::string> one = {root.string()}, two = {root.string(), other.string()};

  auto ok = ConfinedDataPath("mnist/train.csv", root.string(), one);
  REQUIRE(ok.ok());
  REQUIRE(*ok == (fs::canonical(root) / "mnist" / "train.csv").string());
  REQUIRE(ConfinedDataPath((root / "mnist/train.csv").string(), root.string(), one).ok());  // absolute, inside

  for (const std::string& bad : {std::string("../secret/s.csv"), (outside / "s.csv").string(),
                                 std::string("escape/s.csv"), std::string("/etc/passwd"),
                                 std::string("mnist/../../secret/s.csv")}) {
    auto r = ConfinedDataPath(bad, root.string(), one);
    INFO(bad << " -> " << r.status());
    REQUIRE(r.status().code() == absl::StatusCode::kPermissionDenied);
    REQUIRE(r.status().message().find("outside this worker's data roots (" + root.string() + ")") !=
            std::string::npos);
  }
  // A root's name as a prefix of a sibling is not inside it.
  fs::create_directories(base / "data2");
  std::ofstream(base / "data2" / "y.csv") << "0.5,1\n";
  REQUIRE_FALSE(ConfinedDataPath((base / "data2" / "y.csv").string(), root.string(), one).ok());
  // A second root.
  REQUIRE(ConfinedDataPath((other / "x.csv").string(), root.string(), two).ok());

  // LoadDataSource refuses before opening anything; without roots (the
  // local tool) the same path loads.
  v1::DataSource src;
  src.set_format("csv");
  src.set_path((outside / "s.csv").string());
  auto refused = LoadDataSource(src, root.string(), &one);
  REQUIRE(refused.status().code() == absl::StatusCode::kPermissionDenied);
  auto loaded = LoadDataSource(src, root.string(), nullptr);
  INFO(loaded.status());
  REQUIRE(loaded.ok());
  src.set_path("mnist/train.csv");
  auto inside = LoadDataSource(src, root.string(), &one);
  REQUIRE(inside.ok());
  REQUIRE((*inside)->size() == 2);
  fs::remove_all(base);
}

}  // namespace
}  // namespace fulcrum
