// The cold tier in a real RocksDB directory: rows go to disk and come back
// bit for bit, tables and virtual shards stay apart, a cut is hard links
// that later writes leave alone, and a full or failing disk is an error
// naming the directory, after which the tier works again with nothing lost.
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>

#include "absl/strings/match.h"
#include "server/cold_tier.h"
#include "tests/testing/fault_fs.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

constexpr uint32_t kFloats = 48;  // dim 16: weights and two optimizer slots

// n rows of keys base, base + stride, ... with values no arithmetic would
// keep: NaNs with payloads, infinities, -0, denormals, and random bits.
ColdRows MakeRows(uint64_t base, uint64_t stride, size_t n, uint32_t seed) {
  ColdRows r;
  r.row_floats = kFloats;
  std::mt19937 rng(seed);
  std::vector<float> v(kFloats);
  for (size_t i = 0; i < n; ++i) {
    for (uint32_t j = 0; j < kFloats; ++j) {
      const uint32_t bits = rng();
      std::memcpy(&v[j], &bits, 4);
    }
    v[0] = -0.0f;
    v[1] = std::numeric_limits<float>::denorm_min();
    v[2] = std::numeric_limits<float>::infinity();
    const uint32_t nan = 0x7fc01234u + static_cast<uint32_t>(i);
    std::memcpy(&v[3], &nan, 4);
    r.Add(base + i * stride, static_cast<uint32_t>(rng()), (uint64_t{rng()} << 32) | rng(), static_cast<float>(i) * 0.37f,
          v.data());
  }
  return r;
}

// Whether row i of a equals row j of b bit for bit (key, counts and floats).
bool SameRow(const ColdRows& a, size_t i, const ColdRows& b, size_t j) {
  return a.keys[i] == b.keys[j] && a.updates[i] == b.updates[j] && a.last_step[i] == b.last_step[j] &&
         std::memcmp(&a.freq[i], &b.freq[j], 4) == 0 && std::memcmp(a.row(i), b.row(j), kFloats * 4) == 0;
}

TEST_CASE("a row that goes to the cold tier comes back bit for bit, and absent keys are not found", "[cold_tier]") {
  const std::string dir = testing::MakeTempDir("cold-tier");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  const ColdRows rows = MakeRows(1000, 3, 5000, 1);
  REQUIRE_OK(tier->Put(space, 7, rows));

  // Every third key was written: ask for all keys of the range, in reverse.
  std::vector<uint64_t> keys;
  for (uint64_t k = 1000 + 3 * 5000; k-- > 1000;) keys.push_back(k);
  ColdRows got;
  got.row_floats = kFloats;
  std::vector<bool> found;
  REQUIRE_OK(tier->Get(space, 7, keys.data(), keys.size(), &got, &found));
  REQUIRE(got.size() == rows.size());
  size_t next = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const bool written = (keys[i] - 1000) % 3 == 0;
    CHECK(found[i] == written);
    if (!found[i]) continue;
    const size_t j = (keys[i] - 1000) / 3;
    REQUIRE(SameRow(got, next, rows, j));
    ++next;
  }
  CHECK(tier->counts().rows_read == rows.size());

  // Taken rows (promoted back to memory) leave the tier; the rest stay.
  ColdRows taken;
  taken.row_floats = kFloats;
  REQUIRE_OK(tier->Take(space, 7, rows.keys.data(), 100, &taken, &found));
  CHECK(taken.size() == 100);
  ColdRows again;
  again.row_floats = kFloats;
  REQUIRE_OK(tier->Get(space, 7, rows.keys.data(), 200, &again, &found));
  CHECK(again.size() == 100);
  CHECK(std::count(found.begin(), found.begin() + 100, true) == 0);
  CHECK(std::count(found.begin() + 100, found.end(), true) == 100);

  // A row asked for with another width is an error naming it, not a
  // misread.
  ColdRows wrong;
  wrong.row_floats = kFloats - 1;
  const absl::Status s = tier->Get(space, 7, rows.keys.data() + 150, 1, &wrong, &found);
  CHECK(s.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(s.message()), Catch::Contains("row " + std::to_string(rows.keys[150])));
  std::filesystem::remove_all(dir);
}

TEST_CASE("the cold tier keeps tables and virtual shards apart, and a scan reads one shard in key order",
          "[cold_tier]") {
  const std::string dir = testing::MakeTempDir("cold-tier");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t a, tier->Space("job-a", "emb"));
  REQUIRE_OK_AND_ASSIGN(uint32_t b, tier->Space("job-b", "emb"));
  REQUIRE_OK_AND_ASSIGN(uint32_t a2, tier->Space("job-a", "emb"));
  CHECK(a == a2);
  CHECK(a != b);
  // The same keys in two spaces and in neighbouring shards, the largest
  // shard number included.
  const ColdRows r1 = MakeRows(0, 1, 3000, 1), r2 = MakeRows(0, 1, 3000, 2), r3 = MakeRows(0, 1, 10, 3);
  REQUIRE_OK(tier->Put(a, 4, r1));
  REQUIRE_OK(tier->Put(b, 4, r2));
  REQUIRE_OK(tier->Put(a, 5, r3));
  REQUIRE_OK(tier->Put(a, 0xffffffffu, r3));
  REQUIRE_OK(tier->Put(a, 3, r3));

  ColdRows seen;
  seen.row_floats = kFloats;
  int batches = 0;
  REQUIRE_OK(tier->Scan(a, 4, kFloats, 1024, [&](const ColdRows& batch) {
    ++batches;
    CHECK(batch.size() <= 1024);
    for (size_t i = 0; i < batch.size(); ++i) seen.Add(batch.keys[i], batch.updates[i], batch.last_step[i], batch.freq[i], batch.row(i));
    return absl::OkStatus();
  }));
  CHECK(batches == 3);
  REQUIRE(seen.size() == r1.size());
  for (size_t i = 0; i < seen.size(); ++i) REQUIRE(SameRow(seen, i, r1, i));
  size_t last = 0;
  REQUIRE_OK(tier->Scan(a, 0xffffffffu, kFloats, 1024, [&](const ColdRows& batch) {
    last += batch.size();
    return absl::OkStatus();
  }));
  CHECK(last == r3.size());

  // Dropping one job's table leaves the other's.
  REQUIRE_OK(tier->Drop(a));
  ColdRows got;
  got.row_floats = kFloats;
  std::vector<bool> found;
  REQUIRE_OK(tier->Get(a, 4, r1.keys.data(), r1.size(), &got, &found));
  CHECK(got.size() == 0);
  REQUIRE_OK(tier->Get(b, 4, r2.keys.data(), r2.size(), &got, &found));
  REQUIRE(got.size() == r2.size());
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(SameRow(got, i, r2, i));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a cut of the cold tier is hard links: later writes leave it as it was, and it reads back",
          "[cold_tier]") {
  const std::string dir = testing::MakeTempDir("cold-tier");
  std::vector<ColdRows> before;
  {
    REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
    REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
    for (uint32_t shard = 0; shard < 4; ++shard) {
      before.push_back(MakeRows(shard * 100000, 7, 2000, shard));
      REQUIRE_OK(tier->Put(space, shard, before.back()));
    }
    REQUIRE_OK(tier->Checkpoint(dir + "/cut-1"));
    // The cut's table files are the tier's own, linked, not copied.
    int linked = 0, files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir + "/cut-1")) {
      if (e.path().extension() != ".sst") continue;
      ++files;
      struct stat st;
      REQUIRE(stat(e.path().c_str(), &st) == 0);
      if (st.st_nlink > 1) ++linked;
    }
    CHECK(files > 0);
    CHECK(linked == files);
    // After the cut: shard 0 overwritten, shard 1 taken, shard 2 dropped
    // with the whole table.
    REQUIRE_OK(tier->Put(space, 0, MakeRows(0, 7, 2000, 99)));
    ColdRows taken;
    taken.row_floats = kFloats;
    std::vector<bool> found;
    REQUIRE_OK(tier->Take(space, 1, before[1].keys.data(), before[1].size(), &taken, &found));
    CHECK(taken.size() == before[1].size());
    REQUIRE_OK(tier->Drop(space));
    CHECK_FALSE(tier->Checkpoint(dir + "/cut-1").ok());  // a cut is never overwritten
  }
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> cut, ColdTier::OpenCut(dir + "/cut-1"));
  CHECK(cut->read_only());
  CHECK(cut->Space("job", "other").status().code() == absl::StatusCode::kNotFound);
  REQUIRE_OK_AND_ASSIGN(uint32_t space, cut->Space("job", "emb"));
  for (uint32_t shard = 0; shard < 4; ++shard) {
    size_t n = 0;
    REQUIRE_OK(cut->Scan(space, shard, kFloats, 512, [&](const ColdRows& batch) {
      for (size_t i = 0; i < batch.size(); ++i, ++n) {
        if (!SameRow(batch, i, before[shard], n)) return absl::InternalError("row differs");
      }
      return absl::OkStatus();
    }));
    CHECK(n == before[shard].size());
  }
  CHECK(cut->Put(space, 0, before[0]).code() == absl::StatusCode::kFailedPrecondition);
  // A tier opened again on its directory starts empty: its rows meant
  // something only beside the memory of the process that wrote them.
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> reopened, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t s2, reopened->Space("job", "emb"));
  ColdRows got;
  got.row_floats = kFloats;
  std::vector<bool> found;
  REQUIRE_OK(reopened->Get(s2, 3, before[3].keys.data(), before[3].size(), &got, &found));
  CHECK(got.size() == 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a full or failing disk under the cold tier is an error naming its directory, and nothing written is lost",
          "[cold_tier]") {
  using Fault = testing::FaultFs::Fault;
  const Fault fault = GENERATE(Fault::kNoSpace, Fault::kIoError);
  INFO("fault " << static_cast<int>(fault));
  const std::string dir = testing::MakeTempDir("cold-tier");
  testing::FaultFs disk;
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold", disk.env()));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  const ColdRows kept = MakeRows(0, 1, 3000, 1);
  REQUIRE_OK(tier->Put(space, 1, kept));
  disk.Set(fault);
  const absl::Status s = tier->Put(space, 2, MakeRows(0, 1, 3000, 2));
  INFO(s.ToString());
  CHECK_FALSE(s.ok());
  CHECK_THAT(std::string(s.message()), Catch::Contains(dir + "/cold"));
  CHECK_THAT(std::string(s.message()), Catch::Contains("injected by the test"));
  if (fault == Fault::kNoSpace) CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(tier->Checkpoint(dir + "/cut").ok() == false);
  disk.Set(Fault::kNone);
  // The next write reopens the database; what was written before is there.
  const ColdRows later = MakeRows(0, 1, 3000, 3);
  REQUIRE_OK(tier->Put(space, 3, later));
  CHECK(tier->counts().reopens >= 1);
  for (const auto& [shard, rows] : {std::pair<uint32_t, const ColdRows*>{1, &kept}, {3, &later}}) {
    ColdRows got;
    got.row_floats = kFloats;
    std::vector<bool> found;
    REQUIRE_OK(tier->Get(space, shard, rows->keys.data(), rows->size(), &got, &found));
    REQUIRE(got.size() == rows->size());
    for (size_t i = 0; i < got.size(); ++i) REQUIRE(SameRow(got, i, *rows, i));
  }
  REQUIRE_OK(tier->Checkpoint(dir + "/cut-2"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fulcrum
