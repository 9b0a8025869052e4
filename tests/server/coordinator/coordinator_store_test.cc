// CoordinatorStore over a real RocksDB directory: records survive a reopen,
// a failing disk leaves keys unsaved and refuses with a message naming the
// directory, and Repair writes them again (on a fake clock, no sleeping)
// once the disk works.
#include "server/coordinator/coordinator_store.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <catch2/catch.hpp>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/fault_fs.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / absl::StrCat("fulcrum-store-test-", getpid(), "-", counter_++)) {
    fs::remove_all(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::map<std::string, std::string> Records(const CoordinatorStore& store) {
  std::map<std::string, std::string> out;
  REQUIRE(store
              .Scan([&out](const std::string& k, const std::string& v) {
                out[k] = v;
                return absl::OkStatus();
              })
              .ok());
  return out;
}

TEST_CASE("Records written and deleted are what a reopened store holds") {
  TempDir dir;
  {
    auto store = CoordinatorStore::Open({.dir = dir.str()});
    REQUIRE(store.ok());
    (*store)->Write("job/a-1", "one", true);
    (*store)->Write("job/a-2", "two", false);
    (*store)->Write("node/worker-1", "w", true);
    (*store)->Write("job/a-2", std::nullopt, true);  // deleted
    CHECK((*store)->AllSaved());
    CHECK((*store)->write_failures() == 0);
  }
  auto store = CoordinatorStore::Open({.dir = dir.str()});
  REQUIRE(store.ok());
  CHECK(Records(**store) == std::map<std::string, std::string>{{"job/a-1", "one"}, {"node/worker-1", "w"}});
  auto got = (*store)->Get("job/a-1");
  REQUIRE(got.ok());
  CHECK(got->value_or("") == "one");
  auto missing = (*store)->Get("job/a-2");
  REQUIRE(missing.ok());
  CHECK_FALSE(missing->has_value());
}

TEST_CASE("A scan stops at the visitor's first error and returns it") {
  TempDir dir;
  auto store = CoordinatorStore::Open({.dir = dir.str()});
  REQUIRE(store.ok());
  for (const char* k : {"a", "b", "c"}) (*store)->Write(k, "x", true);
  int seen = 0;
  const absl::Status s = (*store)->Scan([&seen](const std::string& k, const std::string&) {
    ++seen;
    return k == "b" ? absl::DataLossError("record 'b' is corrupt") : absl::OkStatus();
  });
  CHECK(s.code() == absl::StatusCode::kDataLoss);
  CHECK(seen == 2);
}

TEST_CASE("A store that cannot be opened says where") {
  TempDir dir;
  fs::create_directories(dir.str());
  const std::string file = dir.str() + "/a-file";
  { std::ofstream(file) << "not a directory"; }
  auto store = CoordinatorStore::Open({.dir = file + "/state"});
  REQUIRE_FALSE(store.ok());
  CHECK_THAT(std::string(store.status().message()), Catch::Contains(file));
  auto none = CoordinatorStore::Open({.dir = ""});
  CHECK(none.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Failed writes stay unsaved until Repair writes what memory holds then") {
  TempDir dir;
  testing::FakeClock clock;
  testing::FaultFs faults;
  auto opened = CoordinatorStore::Open(
      {.dir = dir.str(), .env = faults.env(), .retry = absl::Seconds(1), .clock = &clock});
  REQUIRE(opened.ok());
  CoordinatorStore& store = **opened;
  store.Write("meta", "m0", true);
  REQUIRE(store.AllSaved());

  faults.Set(testing::FaultFs::Fault::kIoError);
  store.Write("job/a-1", "v1", true);
  store.Write("node/worker-1", "w", true);
  CHECK_FALSE(store.Saved("job/a-1"));
  CHECK_FALSE(store.Saved("node/worker-1"));
  CHECK(store.Saved("meta"));
  CHECK(store.unsaved() == 2);
  CHECK(store.write_failures() == 2);
  const absl::Status refused = store.Unavailable("the job was not submitted");
  CHECK(refused.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(refused.message()), Catch::Contains(dir.str()) && Catch::Contains("the job was not submitted") &&
                                                 Catch::Contains("retries every 1s"));

  // Memory moved on while the disk was down: the repair writes what is
  // there now (the node is gone: its key is deleted).
  std::map<std::string, std::optional<std::string>> memory = {{"job/a-1", "v2"}, {"node/worker-1", std::nullopt}};
  auto value_of = [&memory](const std::string& key) { return memory.at(key); };

  store.Repair(value_of);  // too soon after the failure: nothing tried
  CHECK(store.unsaved() == 2);
  clock.Advance(absl::Seconds(1));
  store.Repair(value_of);  // the disk still fails
  CHECK(store.unsaved() == 2);

  faults.Set(testing::FaultFs::Fault::kNone);
  store.Repair(value_of);  // within `retry` of the last try: waits
  CHECK(store.unsaved() == 2);
  clock.Advance(absl::Seconds(1));
  store.Repair(value_of);
  CHECK(store.AllSaved());
  CHECK(store.write_failures() >= 2);
  opened->reset();

  auto reopened = CoordinatorStore::Open({.dir = dir.str()});
  REQUIRE(reopened.ok());
  CHECK(Records(**reopened) == std::map<std::string, std::string>{{"job/a-1", "v2"}, {"meta", "m0"}});
}

}  // namespace
}  // namespace fulcrum
