// Cuts that link the cold tier instead of copying it (server/cold_cut.h,
// the store's format 5): what they hold, that they stay as they were while
// the tier moves on, that they read back whole (locally and as pages for
// peers), and that they go with their cut.
#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <sys/stat.h>

#include <catch2/catch.hpp>

#include "common/checkpoint_record.h"
#include "server/checkpoint.h"
#include "server/cold_cut.h"
#include "server/parameter_server.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"
#include "worker/local_ps_client.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;
using testing::JobSpec;

constexpr uint32_t kDim = 4;
constexpr uint32_t kRowFloats = kDim * 2;  // Adagrad: weights and accumulator

std::shared_ptr<ParameterServer> Server(const std::string& data_dir) {
  ParameterServerOptions o;
  o.data_dir = data_dir;
  auto ps = LocalPsClient::NewServer(std::move(o), 16);
  REQUIRE_OK(ps.status());
  return *std::move(ps);
}

// 32 rows' worth of memory; the rest of the job's 2 000 ids go to disk.
v1::TableSpec Spilling() {
  v1::TableSpec t = testing::SparseTableSpec("emb", kDim, 0.1f, v1::OptimizerSpec::ADAGRAD);
  t.mutable_storage()->set_memory_bytes(32 * kRowFloats * sizeof(float));
  t.mutable_storage()->set_spill(v1::StorageSpec::ROCKSDB);
  return t;
}

// Step t's keys: 48 distinct ids of 2 000, most of them rare.
std::vector<uint64_t> Keys(uint64_t t) {
  std::set<uint64_t> keys;
  uint64_t x = t * 0x9e3779b97f4a7c15ull + 11;
  while (keys.size() < 48) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const uint64_t u = (x >> 33) % 2000;
    keys.insert(u * u / 2000 + 1);
  }
  return {keys.begin(), keys.end()};
}

void Steps(PsClient& c, uint64_t from, uint64_t to) {
  for (uint64_t t = from; t < to; ++t) {
    const std::vector<uint64_t> keys = Keys(t);
    std::vector<float> rows(keys.size() * kDim);
    REQUIRE_OK(c.Pull("job", {t, {}, {{"emb", keys.data(), keys.size(), rows.data()}}}));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.5f * rows[i] - 0.01f * static_cast<float>(i % 5);
    REQUIRE_OK(c.Push("job", {t, {}, {{"emb", keys.data(), keys.size(), rows.data()}}}));
  }
}

std::vector<float> ReadAll(PsClient& c, uint64_t t) {
  std::vector<uint64_t> keys(2000);
  std::iota(keys.begin(), keys.end(), 1);
  std::vector<float> out(keys.size() * kDim);
  REQUIRE_OK(c.Pull("job", {t, {}, {{"emb", keys.data(), keys.size(), out.data()}}}));
  return out;
}

// A cut's sparse rows as its pages give them: key -> (slot, floats).
struct PagedCut {
  std::map<uint64_t, std::pair<uint32_t, std::vector<float>>> rows;
  uint64_t cold = 0;
};
PagedCut ReadPages(const ParameterServer& ps, uint64_t cut) {
  PagedCut out;
  v1::ReadCheckpointRequest req;
  req.set_job_id("job");
  req.set_cut_id(cut);
  req.set_max_bytes(4096);  // several pages
  CheckpointVisitor visit;
  visit.sparse = [&](const std::string&, uint32_t, uint32_t, uint32_t, size_t n, const uint64_t* keys,
                     const uint32_t*, const float* rows, const SparseShardLife* life) {
    REQUIRE(life != nullptr);
    CHECK_FALSE(life->cold_linked);  // pages carry whole records
    for (size_t k = 0; k < n; ++k) {
      out.rows[keys[k]] = {life->slot[k], std::vector<float>(rows + k * kRowFloats, rows + (k + 1) * kRowFloats)};
      out.cold += life->slot[k] == kColdSlot;
    }
    return absl::OkStatus();
  };
  for (;;) {
    REQUIRE_OK_AND_ASSIGN(v1::ReadCheckpointResponse page, ps.ReadCut(req));
    RecordDecoder decoder(page.meta().format());
    for (const v1::CheckpointRecord& r : page.records()) {
      uint32_t crc = 0;
      REQUIRE_OK(decoder.Decode(CutPrefix("job", cut), r.key(), r.value(), visit, &crc, " in a page"));
    }
    if (page.next_start_after().empty()) break;
    req.set_start_after(page.next_start_after());
  }
  return out;
}

// Files of `dir` that share their inode with another name.
size_t LinkedFiles(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".sst" && fs::hard_link_count(e.path()) >= 2) ++n;
  }
  return n;
}

TEST_CASE("a cut of a job whose table spills links the cold tier: its records hold the rows in memory, the tier's "
          "files are hard links, and it reads back whole after the tier moved on",
          "[checkpoint][cold]") {
  const std::string dir = testing::MakeTempDir("cold-cut");
  std::vector<float> at_end;
  {
    // The same steps on a server whose job is never cut.
    auto ref_ps = Server(dir + "/ref");
    LocalPsClient ref(ref_ps, "ref");
    REQUIRE_OK(ref.CreateJob(JobSpec("job", {Spilling()}, 1)));
    Steps(ref, 0, 40);
    at_end = ReadAll(ref, 40);
  }
  auto ps = Server(dir + "/ps");
  auto c = std::make_unique<LocalPsClient>(ps, "w0");
  REQUIRE_OK(c->CreateJob(JobSpec("job", {Spilling()}, 1)));
  Steps(*c, 0, 20);
  REQUIRE_OK_AND_ASSIGN(v1::GetJobResponse stats, ps->GetJob("job"));
  REQUIRE_OK_AND_ASSIGN(v1::ShardCutMeta meta, ps->Checkpoint("job", 1, 20, absl::Seconds(5)));
  INFO("in memory " << stats.sparse_rows() << ", on disk " << stats.sparse_rows_cold() << "; cut: " << meta.bytes()
                    << " bytes, " << meta.cold_rows() << " rows linked in " << meta.cold_cut());
  REQUIRE(stats.sparse_rows_cold() > 300);
  CHECK(meta.format() == kFormatColdLinked);
  CHECK(meta.cold_cut() == "job-0000000000000001");
  CHECK(meta.cold_rows() == stats.sparse_rows_cold());
  CHECK(meta.sparse_rows() == stats.sparse_rows() + stats.sparse_rows_cold());
  // The records hold no row on disk: fewer bytes than those rows alone.
  CHECK(meta.bytes() < meta.cold_rows() * kRowFloats * sizeof(float));
  const std::string linked = dir + "/ps/checkpoints-cold/" + meta.cold_cut();
  REQUIRE(fs::is_directory(linked));
  CHECK(LinkedFiles(linked) > 0);  // shared with the live tier, not copied

  const PagedCut first = ReadPages(*ps, 1);
  CHECK(first.rows.size() == meta.sparse_rows());
  CHECK(first.cold == meta.cold_rows());

  // Training goes on: rows move between the tiers, the tier compacts; the
  // cut still reads as it was.
  Steps(*c, 20, 40);
  REQUIRE_OK_AND_ASSIGN(v1::GetJobResponse later, ps->GetJob("job"));
  CHECK(later.sparse_rows_promoted() > stats.sparse_rows_promoted());
  const PagedCut again = ReadPages(*ps, 1);
  CHECK(again.rows == first.rows);
  CHECK(again.cold == first.cold);

  // Rolled back to it (read through the server's own store) and trained
  // on, the job ends as the one never cut.
  c.reset();
  REQUIRE_OK(ps->Restore("job", 1).status());
  c = std::make_unique<LocalPsClient>(ps, "w1");
  Steps(*c, 20, 40);
  CHECK(ReadAll(*c, 40) == at_end);

  // A second cut; then the first deleted takes its links with it.
  REQUIRE_OK_AND_ASSIGN(v1::ShardCutMeta second, ps->Checkpoint("job", 2, 40, absl::Seconds(5)));
  CHECK(!second.cold_cut().empty());
  REQUIRE_OK(ps->DeleteCut("job", 1));
  CHECK_FALSE(fs::exists(linked));
  const PagedCut kept = ReadPages(*ps, 2);
  CHECK(kept.rows.size() == second.sparse_rows());

  // A restarted server removes links of cuts never committed, and keeps
  // the committed ones'.
  const std::string stray = dir + "/ps/checkpoints-cold/job-0000000000000009";
  fs::create_directories(stray);
  c.reset();
  ps.reset();
  ps = Server(dir + "/ps");
  CHECK_FALSE(fs::exists(stray));
  const PagedCut reopened = ReadPages(*ps, 2);
  CHECK(reopened.rows == kept.rows);

  // A cut whose links are gone is DATA_LOSS naming where they were.
  ps.reset();
  fs::remove_all(dir + "/ps/checkpoints-cold/" + second.cold_cut());
  ps = Server(dir + "/ps");
  v1::ReadCheckpointRequest req;
  req.set_job_id("job");
  req.set_cut_id(2);
  const absl::Status lost = ps->ReadCut(req).status();
  CHECK(lost.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(lost.message()), Catch::Contains(second.cold_cut()));
  ps.reset();
  fs::remove_all(dir);
}

TEST_CASE("a linked record's rows come back merged in key order, the rows in memory over their older copies on disk",
          "[checkpoint][cold]") {
  const std::string dir = testing::MakeTempDir("cold-expand");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  // On disk: keys 2, 4, 6 (4's an older copy of the row in memory).
  ColdRows disk;
  disk.row_floats = 2;
  for (uint64_t k : {2, 4, 6}) {
    const float v[2] = {static_cast<float>(k), -1.0f};
    disk.Add(k, static_cast<uint32_t>(k), 10 + k, 0.5f, v);
  }
  REQUIRE_OK(tier->Put(space, 3, disk));
  REQUIRE_OK(tier->Checkpoint(dir + "/cut"));
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> opened, ColdTier::OpenCut(dir + "/cut"));
  LinkedCut linked{std::shared_ptr<ColdTier>(std::move(opened)), "job", {{"emb", space}}};
  // In memory: keys 1, 4, 7 in slots 0..2; two rows linked.
  const uint64_t keys[] = {1, 4, 7};
  const uint32_t updates[] = {1, 40, 7};
  const float rows[] = {1, 1, 4, 4, 7, 7};
  const uint32_t slot[] = {0, 1, 2};
  const uint64_t last[] = {1, 4, 7};
  const float freq[] = {1, 1, 1};
  SparseShardLife life;
  life.slot = slot;
  life.last_step = last;
  life.freq = freq;
  life.slots = 3;
  life.cold_linked = true;
  life.linked_cold_rows = 2;
  std::string stored;
  EncodeSparseRecord(1, 1, 3, keys, updates, rows, &life, &stored);
  const uint32_t crc = CheckpointCrc(kFormatColdLinked, stored.data(), stored.size());
  stored.append(reinterpret_cast<const char*>(&crc), 4);

  std::string whole;
  REQUIRE_OK(ExpandLinkedRecord(linked, kFormatColdLinked, "cut/job/0000000000000001/", "sparse/emb/00000003",
                                stored, &whole));
  REQUIRE_FALSE(whole.empty());
  std::vector<uint64_t> got_keys;
  std::vector<uint32_t> got_slots, got_updates;
  std::vector<float> got_rows;
  CheckpointVisitor visit;
  visit.sparse = [&](const std::string&, uint32_t vshard, uint32_t dim, uint32_t slots, size_t n,
                     const uint64_t* k, const uint32_t* u, const float* r, const SparseShardLife* l) {
    CHECK(vshard == 3);
    CHECK(dim == 1);
    CHECK(slots == 1);
    CHECK_FALSE(l->cold_linked);
    CHECK(l->slots == 3);
    got_keys.assign(k, k + n);
    got_updates.assign(u, u + n);
    got_rows.assign(r, r + 2 * n);
    got_slots.assign(l->slot, l->slot + n);
    return absl::OkStatus();
  };
  RecordDecoder decoder(kFormatColdLinked);
  uint32_t got_crc = 0;
  REQUIRE_OK(decoder.Decode("cut/job/0000000000000001/", "sparse/emb/00000003", whole, visit, &got_crc, ""));
  CHECK(got_keys == std::vector<uint64_t>{1, 2, 4, 6, 7});
  CHECK(got_updates == std::vector<uint32_t>{1, 2, 40, 6, 7});
  CHECK(got_slots == std::vector<uint32_t>{0, kColdSlot, 1, kColdSlot, 2});
  CHECK(got_rows == std::vector<float>{1, 1, 2, -1, 4, 4, 6, -1, 7, 7});

  // Records that link nothing are sent as stored.
  std::string plain;
  life.cold_linked = false;
  EncodeSparseRecord(1, 1, 3, keys, updates, rows, &life, &plain);
  const uint32_t plain_crc = CheckpointCrc(kFormatColdLinked, plain.data(), plain.size());
  plain.append(reinterpret_cast<const char*>(&plain_crc), 4);
  REQUIRE_OK(ExpandLinkedRecord(linked, kFormatColdLinked, "cut/job/0000000000000001/", "sparse/emb/00000003",
                                plain, &whole));
  CHECK(whole.empty());
  // A damaged linked record is DATA_LOSS, not read past.
  stored[20] ^= 1;
  const absl::Status damaged = ExpandLinkedRecord(linked, kFormatColdLinked, "cut/job/0000000000000001/",
                                                  "sparse/emb/00000003", stored, &whole);
  CHECK(damaged.code() == absl::StatusCode::kDataLoss);
  // Before format 5 the flag means nothing known: refused.
  RecordDecoder old(kFormatColdRows);
  stored[20] ^= 1;
  std::string as_four = stored.substr(0, stored.size() - 4);
  const uint32_t four_crc = CheckpointCrc(kFormatColdRows, as_four.data(), as_four.size());
  as_four.append(reinterpret_cast<const char*>(&four_crc), 4);
  const absl::Status unknown = old.Decode("cut/job/0000000000000001/", "sparse/emb/00000003", as_four, visit,
                                          &got_crc, "");
  CHECK(unknown.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(unknown.message()), Catch::Contains("unknown flags"));
  linked.tier.reset();
  tier.reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fulcrum
