// Checkpoints of a server's shards in a real RocksDB directory: a cut taken
// at a BSP step boundary holds weights, optimizer slots and update counts
// together, so training resumed from it continues bit for bit; a server
// reopened on the same directory finds it; an uncommitted cut is ignored;
// damaged records are reported, never loaded.
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <thread>

#include <rocksdb/db.h>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "common/checkpoint_export.h"
#include "common/checkpoint_record.h"
#include "common/metrics/metrics.h"
#include "common/rpc/grpc_util.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "tests/testing/fault_fs.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"
#include "worker/local_ps_client.h"

namespace fulcrum {
namespace {

using testing::DenseTableSpec;
using testing::JobSpec;
using testing::SparseTableSpec;

std::shared_ptr<ParameterServer> NewServer(const std::string& data_dir, rocksdb::Env* env = nullptr) {
  ParameterServerOptions o;
  o.data_dir = data_dir;
  o.checkpoint_env = env;
  auto ps = LocalPsClient::NewServer(std::move(o));
  REQUIRE_OK(ps.status());
  return *std::move(ps);
}

constexpr size_t kDense = 1000;  // 4 chunks of 256 (the last shorter)
constexpr uint32_t kDim = 3;
const std::vector<uint64_t> kKeys = {7, 1ull << 40, 12345, 99};

v1::PsJobSpec Spec(const std::string& job, v1::ConsistencySpec::Model model = v1::ConsistencySpec::BSP) {
  return JobSpec(job, {DenseTableSpec("w", kDense, 0.05f, v1::OptimizerSpec::ADAM, 256),
                       SparseTableSpec("emb", kDim, 0.1f, v1::OptimizerSpec::ADAGRAD)},
                 1, model);
}

// One training step of worker 0: pull at `step`, push a gradient that
// depends on the weights (so a wrong restore shows in every later step).
void Step(PsClient& c, const std::string& job, uint64_t step) {
  std::vector<float> w(kDense), rows(kKeys.size() * kDim);
  REQUIRE_OK(c.Pull(job, {step, {{"w", w.data(), kDense}}, {{"emb", kKeys.data(), kKeys.size(), rows.data()}}}));
  std::vector<float> g(kDense), sg(rows.size());
  for (size_t i = 0; i < kDense; ++i) g[i] = 0.3f * w[i] + 0.01f * static_cast<float>(i % 7) - 0.02f;
  for (size_t i = 0; i < sg.size(); ++i) sg[i] = rows[i] + 0.05f * static_cast<float>(i % 5);
  REQUIRE_OK(c.Push(job, {step, {{"w", g.data(), kDense}}, {{"emb", kKeys.data(), kKeys.size(), sg.data()}}}));
}

struct Weights {
  std::vector<float> dense, rows;
  bool operator==(const Weights& o) const { return dense == o.dense && rows == o.rows; }
};

// The server's checkpoint store, opened directly to damage it.
std::unique_ptr<rocksdb::DB> OpenStore(const std::string& dir) {
  rocksdb::DB* raw = nullptr;
  REQUIRE(rocksdb::DB::Open(rocksdb::Options(), dir + "/checkpoints", &raw).ok());
  return std::unique_ptr<rocksdb::DB>(raw);
}

// Creates "job" on `ps`, trains step 0 and writes cut 1 at step 1.
void CutAfterOneStep(const std::shared_ptr<ParameterServer>& ps) {
  LocalPsClient c(ps, "w0");
  REQUIRE_OK(c.CreateJob(Spec("job")));
  Step(c, "job", 0);
  REQUIRE_OK(ps->Checkpoint("job", 1, 1, absl::Seconds(5)).status());
}

Weights Read(PsClient& c, const std::string& job, uint64_t step) {
  Weights out{std::vector<float>(kDense), std::vector<float>(kKeys.size() * kDim)};
  REQUIRE_OK(c.Pull(job, {step, {{"w", out.dense.data(), kDense}}, {{"emb", kKeys.data(), kKeys.size(), out.rows.data()}}}));
  return out;
}

TEST_CASE("a BSP cut restores weights, optimizer state and clocks: training resumes bit for bit", "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt");
  Weights at3, at6;
  {
    std::shared_ptr<ParameterServer> ps = NewServer(dir);
    LocalPsClient c(ps, "w0");
    REQUIRE_OK(c.CreateJob(Spec("job")));
    for (uint64_t t = 0; t < 3; ++t) Step(c, "job", t);
    REQUIRE_OK_AND_ASSIGN(v1::ShardCutMeta meta, ps->Checkpoint("job", 1, 3, absl::Seconds(5)));
    CHECK(meta.step() == 3);
    CHECK(meta.rank_clock_size() == 1);
    CHECK(meta.dense_chunks() == 4);
    CHECK(meta.sparse_rows() == kKeys.size());
    CHECK(meta.records() >= 5);            // 4 chunks + the virtual shards the keys fall in
    CHECK(meta.bytes() > kDense * 3 * 4);  // weights and Adam's two slots
    at3 = Read(c, "job", 3);
    for (uint64_t t = 3; t < 6; ++t) Step(c, "job", t);
    at6 = Read(c, "job", 6);
    REQUIRE_FALSE(at6 == at3);

    // Roll back to the cut and train the same steps again: the same bits,
    // which needs Adam's moments and step counts restored with the weights.
    REQUIRE_OK(ps->Restore("job", 1).status());
    REQUIRE(ps->GetJob("job")->applied_step() == 3);
    LocalPsClient again(ps, "w0-again");
    REQUIRE(Read(again, "job", 3) == at3);
    for (uint64_t t = 3; t < 6; ++t) Step(again, "job", t);
    REQUIRE(Read(again, "job", 6) == at6);
  }
  // A server restarted on the same directory finds the cut.
  std::shared_ptr<ParameterServer> restarted = NewServer(dir);
  REQUIRE_OK_AND_ASSIGN(auto cuts, restarted->ListCuts("job"));
  REQUIRE(cuts.size() == 1);
  REQUIRE(cuts[0].step() == 3);
  REQUIRE_OK(restarted->Restore("job", 1).status());
  LocalPsClient fresh(restarted, "w0-fresh");
  REQUIRE(Read(fresh, "job", 3) == at3);
  for (uint64_t t = 3; t < 6; ++t) Step(fresh, "job", t);
  REQUIRE(Read(fresh, "job", 6) == at6);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a BSP cut waits for its step boundary, and a step already applied is refused", "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt");
  std::shared_ptr<ParameterServer> ps = NewServer(dir);
  LocalPsClient c0(ps, "w0", 0), c1(ps, "w1", 1);
  v1::PsJobSpec spec = Spec("job");
  spec.set_num_workers(2);
  REQUIRE_OK(c0.CreateJob(spec));
  std::vector<float> g(kDense, 0.5f);
  auto push = [&](LocalPsClient& c, uint64_t step) { REQUIRE_OK(c.Push("job", {step, {{"w", g.data(), kDense}}, {}})); };
  push(c0, 0);
  push(c1, 0);
  push(c0, 1);  // step 1 waits for worker 1
  absl::StatusOr<v1::ShardCutMeta> meta;
  std::thread cut([&] { meta = ps->Checkpoint("job", 7, 2, absl::Seconds(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  push(c1, 1);  // completes step 1: the boundary the cut waits for
  const Weights at2 = Read(c0, "job", 2);
  cut.join();
  REQUIRE_OK(meta.status());
  REQUIRE(meta->step() == 2);
  REQUIRE(meta->rank_clock_size() == 2);
  push(c0, 2);
  push(c1, 2);
  REQUIRE_FALSE(Read(c0, "job", 3) == at2);
  REQUIRE_OK(ps->Restore("job", 7).status());
  LocalPsClient again(ps, "w0-again");
  REQUIRE(Read(again, "job", 2) == at2);

  REQUIRE_STATUS(ps->Checkpoint("job", 8, 1, absl::Seconds(1)).status(), absl::StatusCode::kFailedPrecondition,
                 "too late");
  REQUIRE_STATUS(ps->Checkpoint("job", 8, 5, absl::Milliseconds(200)).status(), absl::StatusCode::kDeadlineExceeded,
                 "a cut at step 5 timed out");
  REQUIRE_STATUS(ps->Checkpoint("job", 7, 2, absl::Seconds(1)).status(), absl::StatusCode::kAlreadyExists, "cut 7");
  std::filesystem::remove_all(dir);
}

// The raw records of every cut in a server's directory but their metas
// (which hold the time they were made).
std::map<std::string, std::string> CutRecordsIn(const std::string& dir) {
  std::map<std::string, std::string> out;
  std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("cut/"); it->Valid() && it->key().starts_with("cut/"); it->Next()) {
    const std::string key = it->key().ToString();
    if (!absl::EndsWith(key, "/meta")) out[key] = it->value().ToString();
  }
  REQUIRE(it->status().ok());
  return out;
}

TEST_CASE("a cut whose copy does not fit the quota is written shard by shard, training held: a copied cut's records",
          "[checkpoint]") {
  struct Run {
    std::string dir;
    uint64_t used = 0, during = 0, applied_during = 0;
    Weights at4;
  };
  auto run = [](uint64_t quota) {
    Run r;
    r.dir = testing::MakeTempDir("ckpt-stream");
    {
      std::shared_ptr<ParameterServer> ps = NewServer(r.dir);
      LocalPsClient c(ps, "w0");
      v1::PsJobSpec spec = Spec("job");
      spec.set_quota_bytes(quota);
      REQUIRE_OK(c.CreateJob(spec));
      for (uint64_t t = 0; t < 3; ++t) Step(c, "job", t);
      auto used = [&] { return ps->GetJob("job")->bytes_used(); };
      r.used = used();
      std::thread next;
      REQUIRE_OK(ps->Checkpoint("job", 1, 3, absl::Seconds(5), [&] {
                       r.during = used();
                       // Step 3 arrives while the cut is taken: it must not
                       // reach the records.
                       next = std::thread([&] { Step(c, "job", 3); });
                       std::this_thread::sleep_for(std::chrono::milliseconds(100));
                       r.applied_during = ps->GetJob("job")->applied_step();
                     }).status());
      next.join();
      REQUIRE(used() == r.used);  // the copy given back
      r.at4 = Read(c, "job", 4);
    }
    return r;
  };
  const Run copied = run(uint64_t{1} << 30);
  // Room for the tables, not for a copy of the sparse rows.
  const Run streamed = run(copied.used + 16);
  REQUIRE(streamed.used == copied.used);
  CHECK(copied.during > copied.used);     // the copy counted while it lives
  CHECK(streamed.during == streamed.used);
  CHECK(streamed.applied_during == 3);    // held while the rows were written
  CHECK(streamed.at4 == copied.at4);
  const auto a = CutRecordsIn(copied.dir), b = CutRecordsIn(streamed.dir);
  REQUIRE(a.size() >= 5);
  CHECK(a == b);
  std::filesystem::remove_all(copied.dir);
  std::filesystem::remove_all(streamed.dir);
}

TEST_CASE("SSP and ASP cuts are taken at once with the ranks' clocks", "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt");
  std::shared_ptr<ParameterServer> ps = NewServer(dir);
  LocalPsClient c(ps, "w0");
  REQUIRE_OK(c.CreateJob(Spec("asp", v1::ConsistencySpec::ASP)));
  for (uint64_t t = 0; t < 4; ++t) Step(c, "asp", t);
  const Weights now = Read(c, "asp", 4);
  REQUIRE_OK_AND_ASSIGN(v1::ShardCutMeta meta, ps->Checkpoint("asp", 1, 0, absl::Seconds(1)));
  REQUIRE(meta.step() == 4);
  REQUIRE(meta.rank_clock(0) == 4);
  Step(c, "asp", 4);
  REQUIRE_OK(ps->Restore("asp", 1).status());
  REQUIRE(ps->GetJob("asp")->rank_clock(0) == 4);
  LocalPsClient again(ps, "w0-again");
  REQUIRE(Read(again, "asp", 4) == now);
  std::filesystem::remove_all(dir);
}

TEST_CASE("an uncommitted cut is ignored and cleared, and a damaged record is reported and never loaded", "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt");
  {
    std::shared_ptr<ParameterServer> ps = NewServer(dir);
    LocalPsClient c(ps, "w0");
    REQUIRE_OK(c.CreateJob(Spec("job")));
    Step(c, "job", 0);
    REQUIRE_OK(ps->Checkpoint("job", 1, 1, absl::Seconds(5)).status());
    Step(c, "job", 1);
    REQUIRE_OK(ps->Checkpoint("job", 2, 2, absl::Seconds(5)).status());
  }
  // As if the server died writing cut 2: its records, no meta.
  {
    std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
    REQUIRE(db->Delete(rocksdb::WriteOptions(), CutPrefix("job", 2) + "meta").ok());
    // And damage one record of cut 1: a flipped byte in a dense chunk.
    const std::string key = CutPrefix("job", 1) + "dense/w/00000001";
    std::string v;
    REQUIRE(db->Get(rocksdb::ReadOptions(), key, &v).ok());
    v[40] ^= 0x10;
    REQUIRE(db->Put(rocksdb::WriteOptions(), key, v).ok());
  }
  std::shared_ptr<ParameterServer> ps = NewServer(dir);
  REQUIRE_OK_AND_ASSIGN(auto cuts, ps->ListCuts("job"));
  REQUIRE(cuts.size() == 1);
  REQUIRE(cuts[0].cut_id() == 1);
  REQUIRE_STATUS(ps->checkpoints()->Read("job", 2, {}).status(), absl::StatusCode::kNotFound, "no committed cut 2");
  {
    // Its records are gone, not just hidden: nothing under its prefix.
    ps.reset();
    std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    const std::string prefix = CutPrefix("job", 2);
    it->Seek(prefix);
    REQUIRE((!it->Valid() || !it->key().starts_with(prefix)));
  }
  ps = NewServer(dir);
  REQUIRE_STATUS(ps->Restore("job", 1).status(), absl::StatusCode::kDataLoss,
                 "dense/w/00000001 in " + dir + "/checkpoints: checksum mismatch");
  REQUIRE(ps->GetJob("job").status().code() == absl::StatusCode::kNotFound);  // nothing half-restored
  REQUIRE_STATUS(ps->Restore("job", 9).status(), absl::StatusCode::kNotFound, "no committed cut 9");
  std::filesystem::remove_all(dir);
}

TEST_CASE("deleted cuts give their disk back: files and bytes stay flat under keep 3, and go when the job's go",
          "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt");
  std::shared_ptr<ParameterServer> ps = NewServer(dir);
  auto c = std::make_unique<LocalPsClient>(ps, "w0");
  REQUIRE_OK(c->CreateJob(Spec("job")));
  CheckpointStore* store = ps->checkpoints();
  REQUIRE_OK_AND_ASSIGN(const CheckpointStore::DiskUse empty, store->Disk());
  // 40 cuts, keeping the last 3 as the coordinator does.
  uint64_t cut_bytes = 0;
  CheckpointStore::DiskUse most;
  for (uint64_t cut = 1; cut <= 40; ++cut) {
    Step(*c, "job", cut - 1);
    REQUIRE_OK_AND_ASSIGN(v1::ShardCutMeta meta, ps->Checkpoint("job", cut, cut, absl::Seconds(5)));
    cut_bytes = meta.bytes();
    if (cut > 3) REQUIRE_OK(ps->DeleteCut("job", cut - 3));
    REQUIRE_OK_AND_ASSIGN(const CheckpointStore::DiskUse now, store->Disk());
    most.files = std::max(most.files, now.files);
    most.bytes = std::max(most.bytes, now.bytes);
    most.table_files = std::max(most.table_files, now.table_files);
  }
  INFO("empty: " << empty.files << " files, " << empty.bytes << " bytes; most: " << most.files << " files, "
                 << most.bytes << " bytes, " << most.table_files << " table files; a cut is " << cut_bytes
                 << " bytes");
  // Without the files going, 40 cuts leave 40 table files behind.
  CHECK(most.table_files <= 4);
  CHECK(most.files <= empty.files + 4);
  CHECK(most.bytes <= empty.bytes + 4 * cut_bytes + (64 << 10));
  REQUIRE_OK_AND_ASSIGN(auto cuts, ps->ListCuts("job"));
  REQUIRE(cuts.size() == 3);

  // Deleting the job's last cuts frees their space.
  REQUIRE_OK_AND_ASSIGN(const CheckpointStore::DiskUse before, store->Disk());
  for (const v1::ShardCutMeta& m : cuts) REQUIRE_OK(ps->DeleteCut("job", m.cut_id()));
  REQUIRE_OK_AND_ASSIGN(const CheckpointStore::DiskUse after, store->Disk());
  INFO("before: " << before.bytes << " bytes in " << before.table_files << " tables; after: " << after.bytes
                  << " bytes in " << after.table_files << " tables");
  CHECK(after.table_files == 0);
  CHECK(before.bytes - after.bytes >= 3 * cut_bytes);
  REQUIRE_OK_AND_ASSIGN(cuts, ps->ListCuts("job"));
  CHECK(cuts.empty());

  // A cut merged with others by a compaction is compacted away instead.
  for (uint64_t cut = 41; cut <= 43; ++cut) REQUIRE_OK(ps->Checkpoint("job", cut, 40, absl::Seconds(5)).status());
  {
    // Compact the whole store into one file holding all three cuts.
    c.reset();
    ps.reset();
    std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
    rocksdb::CompactRangeOptions all;
    all.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
    REQUIRE(db->CompactRange(all, nullptr, nullptr).ok());
  }
  ps = NewServer(dir);
  store = ps->checkpoints();
  REQUIRE_OK_AND_ASSIGN(const CheckpointStore::DiskUse merged, store->Disk());
  REQUIRE_OK(ps->DeleteCut("job", 41));
  REQUIRE_OK(ps->DeleteCut("job", 42));
  REQUIRE_OK_AND_ASSIGN(const CheckpointStore::DiskUse one_left, store->Disk());
  INFO("merged: " << merged.bytes << " bytes; one cut left: " << one_left.bytes);
  CHECK(merged.bytes - one_left.bytes >= 2 * cut_bytes - (4 << 10));
  // The cut kept is whole.
  size_t records = 0;
  CheckpointVisitor count;
  count.dense = [&](const std::string&, uint32_t, uint64_t, uint32_t, uint32_t, const void*) {
    ++records;
    return absl::OkStatus();
  };
  count.sparse = [&](const std::string&, uint32_t, uint32_t, uint32_t, size_t, const uint64_t*, const uint32_t*,
                     const float*, const SparseShardLife*) {
    ++records;
    return absl::OkStatus();
  };
  REQUIRE_OK_AND_ASSIGN(v1::ShardCutMeta kept, store->Read("job", 43, count));
  CHECK(records == kept.records());
  std::filesystem::remove_all(dir);
}

TEST_CASE("a disk that fails during a cut fails that cut only: the next one is written once the disk works",
          "[checkpoint]") {
  using Fault = testing::FaultFs::Fault;
  // ENOSPC: RocksDB recovers by itself; EIO: the store reopens it.
  const Fault fault = GENERATE(Fault::kNoSpace, Fault::kIoError);
  // Every file: writing the cut's ingest file fails first. Only the
  // write-ahead log: the cut is ingested and its commit fails, which stops
  // RocksDB's writes until it resumes or is reopened.
  const std::string only = GENERATE(std::string(), std::string(".log"));
  INFO("fault " << static_cast<int>(fault) << " on '" << only << "'");
  const std::string dir = testing::MakeTempDir("ckpt-fault");
  testing::FaultFs disk;
  Weights at3;
  {
    std::shared_ptr<ParameterServer> ps = NewServer(dir, disk.env());
    LocalPsClient c(ps, "w0");
    REQUIRE_OK(c.CreateJob(Spec("job")));
    Step(c, "job", 0);
    REQUIRE_OK(ps->Checkpoint("job", 1, 1, absl::Seconds(5)).status());
    Step(c, "job", 1);
    disk.Set(fault, only);
    const absl::Status failed = ps->Checkpoint("job", 2, 2, absl::Seconds(5)).status();
    INFO(failed.ToString());
    CHECK_FALSE(failed.ok());
    CHECK_THAT(std::string(failed.message()), Catch::Contains("injected by the test"));
    CHECK(disk.failed() > 0);
    disk.Set(Fault::kNone);
    Step(c, "job", 2);
    at3 = Read(c, "job", 3);
    // Before, RocksDB refused every write after an EIO until the server
    // restarted. ENOSPC recovery runs on RocksDB's thread: a cut asked for
    // meanwhile is refused (UNAVAILABLE) and the next one works.
    absl::StatusOr<v1::ShardCutMeta> cut = ps->Checkpoint("job", 3, 3, absl::Seconds(5));
    for (int i = 1; !cut.ok() && cut.status().code() == absl::StatusCode::kUnavailable && i < 100; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      cut = ps->Checkpoint("job", 3 + i, 3, absl::Seconds(5));
    }
    REQUIRE_OK(cut.status());
    REQUIRE_OK_AND_ASSIGN(auto cuts, ps->ListCuts("job"));
    REQUIRE(cuts.size() == 2);
    CHECK(cuts[0].cut_id() == 1);
    CHECK(cuts[1].cut_id() == cut->cut_id());
    // Only a failed write of the database itself needs the reopen, and the
    // servers' scrape counts it.
    const int reopens = only == ".log" ? 1 : 0;
    CHECK(ps->checkpoints()->reopens() == static_cast<uint64_t>(reopens));
    metrics::FunctionCollector collect([&](metrics::Scrape* out) { ps->CollectMetrics(out); });
    CHECK_THAT(metrics::RenderText({&collect}),
               Catch::Contains(absl::StrCat("\nfulcrum_server_checkpoint_store_reopens_total ", reopens, "\n")));
  }
  // Nothing of the failed cut is left: no records, no ingest file.
  {
    std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    const std::string prefix = CutPrefix("job", 2);
    it->Seek(prefix);
    CHECK((!it->Valid() || !it->key().starts_with(prefix)));
  }
  CHECK(std::filesystem::is_empty(dir + "/checkpoints/ingest"));
  std::shared_ptr<ParameterServer> restarted = NewServer(dir);
  REQUIRE_OK_AND_ASSIGN(auto cuts, restarted->ListCuts("job"));
  REQUIRE(cuts.size() == 2);
  REQUIRE_OK(restarted->Restore("job", cuts[1].cut_id()).status());
  LocalPsClient fresh(restarted, "w0-fresh");
  CHECK(Read(fresh, "job", 3) == at3);
  std::filesystem::remove_all(dir);
}

TEST_CASE("record checksums are CRC-32C, in hardware and portably alike, and an unknown format is refused",
          "[checkpoint]") {
  // The standard check value of CRC-32C.
  REQUIRE(Crc32c("123456789", 9) == 0xE3069283u);
  REQUIRE(Crc32cPortable("123456789", 9) == 0xE3069283u);
  std::string data(100003, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + (i >> 7));
  for (size_t n : {0, 1, 7, 8, 9, 1000, 100003}) {
    INFO("length " << n);
    REQUIRE(Crc32c(data.data(), n) == Crc32cPortable(data.data(), n));
    // Continuing a checksum equals one pass over the whole.
    REQUIRE(Crc32c(data.data() + n / 3, n - n / 3, Crc32c(data.data(), n / 3)) == Crc32c(data.data(), n));
  }

  const std::string dir = testing::MakeTempDir("ckpt");
  {
    std::shared_ptr<ParameterServer> ps = NewServer(dir);
    LocalPsClient c(ps, "w0");
    REQUIRE_OK(c.CreateJob(Spec("job")));
    Step(c, "job", 0);
    REQUIRE_OK_AND_ASSIGN(v1::ShardCutMeta meta, ps->Checkpoint("job", 1, 1, absl::Seconds(5)));
    REQUIRE(meta.format() == kCurrentFormat);
  }
  {
    // A cut from a future build: format 99.
    std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
    const std::string key = CutPrefix("job", 1) + "meta";
    std::string v;
    REQUIRE(db->Get(rocksdb::ReadOptions(), key, &v).ok());
    v1::ShardCutMeta meta;
    REQUIRE(meta.ParseFromString(v));
    meta.set_format(99);
    REQUIRE(db->Put(rocksdb::WriteOptions(), key, meta.SerializeAsString()).ok());
  }
  std::shared_ptr<ParameterServer> ps = NewServer(dir);
  REQUIRE_STATUS(ps->Restore("job", 1).status(), absl::StatusCode::kDataLoss, "has format 99");
  std::filesystem::remove_all(dir);
}

// A record with a valid checksum whose header disagrees with its table (a
// peer of another build, a bug in a writer): the restore must refuse it
// before copying the table's size from a shorter block.
std::string Record(const std::string& header, size_t floats) {
  std::string v = header;
  for (size_t i = 0; i < floats; ++i) {
    const float f = 0.5f;
    v.append(reinterpret_cast<const char*>(&f), 4);
  }
  const uint32_t crc = Crc32c(v.data(), v.size());
  v.append(reinterpret_cast<const char*>(&crc), 4);
  return v;
}

template <typename... T>
std::string Header(T... fields) {
  std::string h;
  ((h.append(reinterpret_cast<const char*>(&fields), sizeof(fields))), ...);
  return h;
}

TEST_CASE("a checksummed record whose header disagrees with its table is refused and never read past its end",
          "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt");
  CutAfterOneStep(NewServer(dir));
  const std::string prefix = CutPrefix("job", 1);
  // One sparse record of "emb" (Adagrad: 1 slot) and its virtual shard.
  std::string sparse_key, sparse_value;
  {
    std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    it->Seek(prefix + "sparse/emb/");
    REQUIRE(it->Valid());
    REQUIRE(it->key().starts_with(prefix + "sparse/emb/"));
    sparse_key = it->key().ToString();
    sparse_value = it->value().ToString();
  }
  const uint32_t vshard = static_cast<uint32_t>(std::stoul(sparse_key.substr(sparse_key.size() - 8), nullptr, 16));
  uint64_t key0;
  std::memcpy(&key0, sparse_value.data() + 16, 8);  // after n, dim, slots, pad
  char other[9];
  std::snprintf(other, sizeof(other), "%08x", (vshard + 1) % 64);

  struct Case {
    const char* what;
    std::string key, value, error;
  };
  const uint64_t upd = 1;
  const std::vector<Case> cases = {
      {"a dense chunk shorter than the table's", prefix + "dense/w/00000001",
       Record(Header(upd, uint32_t{10}, uint32_t{2}), 30),
       "chunk 1 holds 10 elements with 2 optimizer slots; the table's chunk has 256 elements with 2"},
      {"a dense chunk without the optimizer's slots", prefix + "dense/w/00000000",
       Record(Header(upd, uint32_t{256}, uint32_t{0}), 256), "holds 256 elements with 0 optimizer slots"},
      {"a chunk the table does not have", prefix + "dense/w/00000009",
       Record(Header(upd, uint32_t{256}, uint32_t{2}), 768), "names chunk 9; the table has 4 chunks"},
      {"a record of a table the job does not declare", prefix + "dense/nope/00000000",
       Record(Header(upd, uint32_t{4}, uint32_t{2}), 12), "has no table 'nope'"},
      {"so many slots that sizes would wrap", prefix + "dense/w/00000000",
       Record(Header(upd, uint32_t{256}, uint32_t{0xFFFFFFFFu}), 0), "names 4294967295 optimizer slots"},
      {"sparse rows of another dim", sparse_key,
       Record(Header(uint32_t{1}, uint32_t{2}, uint32_t{1}, uint32_t{0}) + std::string(12, '\0'), 4),
       "holds rows of dim 2 with 1 optimizer slots; the table's rows have dim 3 with 1"},
      {"a key filed under another virtual shard", prefix + "sparse/emb/" + other,
       Record(Header(uint32_t{1}, uint32_t{3}, uint32_t{1}, uint32_t{0}, key0, uint32_t{1}), 6),
       absl::StrCat("holds key ", key0, ", which belongs to virtual shard ", vshard)},
      {"a sparse record with flags this build does not know", sparse_key,
       Record(Header(uint32_t{0}, uint32_t{3}, uint32_t{1}, uint32_t{6}), 0), "has unknown flags 6"},
      {"a lifecycle whose freed slots run past the record's end", sparse_key,
       Record(Header(uint32_t{0}, uint32_t{3}, uint32_t{1}, kSparseRecordLifecycle, uint32_t{5}, uint32_t{0},
                     uint32_t{0}, uint32_t{1000}),
              2),
       "freed slots run past its end"},
      {"a lifecycle cut short before its fixed fields", sparse_key,
       Record(Header(uint32_t{1}, uint32_t{3}, uint32_t{1}, kSparseRecordLifecycle, key0, uint32_t{1}), 6),
       "size does not match its header"},
  };
  for (const Case& k : cases) {
    INFO(k.what);
    std::unique_ptr<rocksdb::DB> db = OpenStore(dir);
    std::string before;
    const bool existed = db->Get(rocksdb::ReadOptions(), k.key, &before).ok();
    REQUIRE(db->Put(rocksdb::WriteOptions(), k.key, k.value).ok());
    db.reset();
    {
      std::shared_ptr<ParameterServer> ps = NewServer(dir);
      REQUIRE_STATUS(ps->Restore("job", 1).status(), absl::StatusCode::kDataLoss, k.error);
      REQUIRE(ps->GetJob("job").status().code() == absl::StatusCode::kNotFound);  // nothing half-restored
    }
    db = OpenStore(dir);
    REQUIRE((existed ? db->Put(rocksdb::WriteOptions(), k.key, before) : db->Delete(rocksdb::WriteOptions(), k.key)).ok());
  }
  // Put back as it was, the cut restores.
  {
    std::shared_ptr<ParameterServer> ps = NewServer(dir);
    REQUIRE_OK(ps->Restore("job", 1).status());
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a peer's cut that names another job creates nothing", "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt");
  std::shared_ptr<ParameterServer> source = NewServer(dir);
  CutAfterOneStep(source);
  std::shared_ptr<ParameterServer> ps = NewServer("");
  ParameterServer::CutReader peer = [&](const v1::ReadCheckpointRequest& req) -> absl::StatusOr<v1::ReadCheckpointResponse> {
    absl::StatusOr<v1::ReadCheckpointResponse> page = source->ReadCut(req);
    if (page.ok()) page->mutable_meta()->mutable_spec()->set_job_id("other");
    return page;
  };
  REQUIRE_STATUS(ps->Restore("job", 1, {peer}).status(), absl::StatusCode::kDataLoss,
                 "cut 1 of job 'job' holds the spec of job 'other'");
  REQUIRE(ps->GetJob("other").status().code() == absl::StatusCode::kNotFound);
  REQUIRE(ps->GetJob("job").status().code() == absl::StatusCode::kNotFound);
  // The same peer, unaltered, restores.
  ParameterServer::CutReader honest = [&](const v1::ReadCheckpointRequest& req) { return source->ReadCut(req); };
  REQUIRE_OK(ps->Restore("job", 1, {honest}).status());
  source.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoint calls past the server's pool and queue are refused RESOURCE_EXHAUSTED, the others complete",
          "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt-pool");
  testing::TestCluster::Options co;
  co.num_servers = 1;
  co.data_dir = dir;
  co.blocking_threads = 1;
  co.blocking_queue = 1;
  auto cluster = testing::TestCluster::Start(co);
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(Spec("job")));
  auto stub = v1::ParameterService::NewStub(CreateFulcrumChannel(cluster->address(0), 7, *security::Transport::Plaintext()));
  // Cuts at step 3 wait for it: the first holds the one thread, the second
  // waits in the queue, the third is refused at once.
  struct Call {
    grpc::ClientContext ctx;
    v1::ShardCutMeta meta;
    grpc::Status status;
    absl::Notification done;
  };
  std::vector<std::unique_ptr<Call>> calls;
  for (uint64_t id = 1; id <= 3; ++id) {
    auto call = std::make_unique<Call>();
    v1::CheckpointRequest req;
    req.set_job_id("job");
    req.set_cut_id(id);
    req.set_at_step(3);
    req.set_wait_timeout_ms(20000);
    Call* raw = call.get();
    stub->async()->Checkpoint(&raw->ctx, &req, &raw->meta, [raw](grpc::Status s) {
      raw->status = s;
      raw->done.Notify();
    });
    calls.push_back(std::move(call));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  REQUIRE(calls[2]->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  CHECK(calls[2]->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(absl::StrContains(calls[2]->status.error_message(),
                          "checkpoint and restore calls: 1 running on all 1 threads and 1 waiting"));
  CHECK_FALSE(calls[0]->done.HasBeenNotified());
  std::vector<float> g(kDense, 0.5f);
  for (uint64_t step = 0; step < 3; ++step) REQUIRE_OK(c->Push("job", {step, {{"w", g.data(), kDense}}, {}}));
  for (int i = 0; i < 2; ++i) {
    REQUIRE(calls[i]->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
    INFO("cut " << i + 1 << ": " << calls[i]->status.error_message());
    CHECK(calls[i]->status.ok());
    CHECK(calls[i]->meta.step() == 3);
  }
  c.reset();
  cluster.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("a server without a data directory says how to get checkpoints", "[checkpoint]") {
  std::shared_ptr<ParameterServer> ps = NewServer("");
  LocalPsClient c(ps, "w0");
  REQUIRE_OK(c.CreateJob(Spec("job")));
  REQUIRE_STATUS(ps->Checkpoint("job", 1, 0, absl::Seconds(1)).status(), absl::StatusCode::kFailedPrecondition,
                 "--data_dir");
}

// Three servers, the first two holding the job (map version 1), cuts
// under `dir`.
testing::TestCluster::Options ThreeServersTwoMapped(const std::string& dir) {
  testing::TestCluster::Options o;
  o.num_servers = 3;
  o.mapped_servers = 2;
  o.data_dir = dir;
  return o;
}

// Spreads the cluster's virtual shards over all three servers (map version
// 2) and restores cut `cut` of `job` on each from servers 0 and 1, which
// wrote it, fencing off incarnation 0.
std::vector<v1::ShardCutMeta> RestoreOntoThree(testing::TestCluster& cluster, uint32_t num_virtual_shards,
                                               const std::string& job, uint64_t cut) {
  auto map = ShardMap::RoundRobin(2, num_virtual_shards, {cluster.address(0), cluster.address(1), cluster.address(2)});
  REQUIRE_OK(map.status());
  cluster.SetShardMap(map->ToProto());
  std::vector<v1::ShardCutMeta> metas(3);
  for (size_t i = 0; i < 3; ++i) {
    auto stub =
        v1::ParameterService::NewStub(CreateFulcrumChannel(cluster.address(i), 0, *security::Transport::Plaintext()));
    grpc::ClientContext ctx;
    v1::RestoreRequest req;
    req.set_job_id(job);
    req.set_cut_id(cut);
    req.add_sources(cluster.address(0));
    req.add_sources(cluster.address(1));
    req.set_min_incarnation(1);
    REQUIRE_OK(FromGrpcStatus(stub->Restore(&ctx, req, &metas[i])));
  }
  return metas;
}

TEST_CASE("a cut taken on 2 servers restores onto 3, fetched from the servers that wrote it", "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt3");
  const testing::TestCluster::Options o = ThreeServersTwoMapped(dir);
  auto cluster = testing::TestCluster::Start(o);
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(Spec("job")));
  for (uint64_t t = 0; t < 3; ++t) Step(*c, "job", t);
  for (size_t i = 0; i < 2; ++i) REQUIRE_OK(cluster->server(i)->Checkpoint("job", 1, 3, absl::Seconds(5)).status());
  const Weights at3 = Read(*c, "job", 3);
  Step(*c, "job", 3);  // moves on past the cut
  const Weights at4 = Read(*c, "job", 4);
  c.reset();

  const std::vector<v1::ShardCutMeta> metas = RestoreOntoThree(*cluster, o.num_virtual_shards, "job", 1);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(metas[i].step() == 3);
    REQUIRE_OK_AND_ASSIGN(v1::GetJobResponse stats, cluster->server(i)->GetJob("job"));
    CHECK(stats.applied_step() == 3);
    CHECK(stats.bytes_used() > 0);  // the new server got its share
  }
  GrpcPsClientOptions fenced;
  fenced.incarnation = 1;
  auto resumed = cluster->Client(0, fenced);
  REQUIRE_OK(resumed->OpenJob("job"));
  REQUIRE(Read(*resumed, "job", 3) == at3);
  Step(*resumed, "job", 3);
  REQUIRE(Read(*resumed, "job", 4) == at4);  // Adam's slots and counts came along

  // The rolled-back run (incarnation 0) can no longer touch the job.
  GrpcPsClientOptions old;
  old.worker_id = "stale";
  auto stale = cluster->Client(0, old);
  REQUIRE_OK(stale->OpenJob("job"));
  std::vector<float> w(kDense);
  REQUIRE_STATUS(stale->Pull("job", {4, {{"w", w.data(), kDense}}, {}}), absl::StatusCode::kFailedPrecondition,
                 "incarnation 0");
  std::filesystem::remove_all(dir);
}

// Cut 0 is a job's start: what a job lost before its first cut restarts
// from. Over gRPC, as the coordinator asks it.
v1::ShardCutMeta RestartOverGrpc(testing::TestCluster& cluster, size_t server, const std::string& job,
                                 uint32_t min_incarnation) {
  auto stub = v1::ParameterService::NewStub(
      CreateFulcrumChannel(cluster.address(server), 0, *security::Transport::Plaintext()));
  grpc::ClientContext ctx;
  v1::RestoreRequest req;
  req.set_job_id(job);
  req.set_cut_id(0);
  req.set_min_incarnation(min_incarnation);
  v1::ShardCutMeta meta;
  REQUIRE_OK(FromGrpcStatus(stub->Restore(&ctx, req, &meta)));
  return meta;
}

TEST_CASE("restoring cut 0 puts a job back as it was created, fenced, on a server without a data directory too",
          "[checkpoint]") {
  testing::TestCluster::Options o;
  o.num_servers = 2;
  auto cluster = testing::TestCluster::Start(o);
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(Spec("job")));
  const Weights at0 = Read(*c, "job", 0);
  for (uint64_t t = 0; t < 3; ++t) Step(*c, "job", t);
  REQUIRE_FALSE(Read(*c, "job", 3) == at0);
  c.reset();

  for (size_t i = 0; i < 2; ++i) {
    const v1::ShardCutMeta meta = RestartOverGrpc(*cluster, i, "job", 1);
    CHECK(meta.cut_id() == 0);
    CHECK(meta.step() == 0);
    CHECK(meta.spec().job_id() == "job");
    REQUIRE_OK_AND_ASSIGN(v1::GetJobResponse stats, cluster->server(i)->GetJob("job"));
    CHECK(stats.applied_step() == 0);
  }
  // The new incarnation finds the initial weights (rows made again by the
  // table's initializer) and trains the same steps to the same bits.
  GrpcPsClientOptions fenced;
  fenced.incarnation = 1;
  auto again = cluster->Client(0, fenced);
  REQUIRE_OK(again->CreateJob(Spec("job")));  // what its worker does: the same spec is success
  REQUIRE(Read(*again, "job", 0) == at0);
  // The first attempt (incarnation 0) can no longer touch the job.
  GrpcPsClientOptions old;
  old.worker_id = "stale";
  auto stale = cluster->Client(0, old);
  REQUIRE_OK(stale->OpenJob("job"));
  std::vector<float> w(kDense);
  REQUIRE_STATUS(stale->Pull("job", {0, {{"w", w.data(), kDense}}, {}}), absl::StatusCode::kFailedPrecondition,
                 "incarnation 0");

  // A server that does not hold the job keeps the fence for the creation.
  (void)cluster->server(0)->DeleteJob("job");
  (void)cluster->server(1)->DeleteJob("job");
  for (size_t i = 0; i < 2; ++i) CHECK(RestartOverGrpc(*cluster, i, "job", 2).cut_id() == 0);
  REQUIRE_FALSE(cluster->server(0)->GetJob("job").ok());
  auto late = cluster->Client(0, fenced);  // incarnation 1 creates it...
  REQUIRE_OK(late->CreateJob(Spec("job")));
  REQUIRE_STATUS(late->Pull("job", {0, {{"w", w.data(), kDense}}, {}}), absl::StatusCode::kFailedPrecondition,
                 "incarnation 2 onwards");  // ...but may not train it
  GrpcPsClientOptions third;
  third.incarnation = 2;
  third.worker_id = "third";
  auto current = cluster->Client(0, third);
  REQUIRE_OK(current->OpenJob("job"));
  CHECK(Read(*current, "job", 0) == at0);
}

// A table with a lifecycle under a stream of ids that keeps arriving: each
// step's keys slide 8 on over a window of 160, so old ids fade, rows are
// admitted on their second push, capped (96 rows over 16 virtual shards)
// and expired after 5 unused steps.
v1::TableSpec LifeTable() {
  v1::TableSpec t = SparseTableSpec("emb", kDim, 0.1f, v1::OptimizerSpec::ADAGRAD);
  t.mutable_admission()->set_min_count(2);
  t.mutable_admission()->set_sketch_width(64);
  t.mutable_eviction()->set_policy(v1::EvictionSpec::LRU);
  t.mutable_eviction()->set_max_rows(96);
  t.mutable_eviction()->set_ttl_steps(5);
  return t;
}

std::vector<uint64_t> StreamKeys(uint32_t rank, uint64_t step) {
  std::vector<uint64_t> keys;
  uint64_t x = (rank + 1) * 0x9e3779b97f4a7c15ull + step * 7919;
  for (int i = 0; i < 48; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    keys.push_back(step * 8 + (x >> 33) % 160);
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  return keys;
}

// Steps [from, to) of a 2-worker BSP job: both pull their keys, then push
// a gradient that depends on what they read, in `order`.
void StreamSteps(std::vector<std::unique_ptr<GrpcPsClient>>& c, const std::string& job, uint64_t from, uint64_t to,
                 std::vector<uint32_t> order) {
  for (uint64_t t = from; t < to; ++t) {
    std::vector<std::vector<uint64_t>> keys(2);
    std::vector<std::vector<float>> rows(2);
    for (uint32_t r = 0; r < 2; ++r) {
      keys[r] = StreamKeys(r, t);
      rows[r].resize(keys[r].size() * kDim);
      REQUIRE_OK(c[r]->Pull(job, {t, {}, {{"emb", keys[r].data(), keys[r].size(), rows[r].data()}}}));
    }
    for (uint32_t r : order) {
      std::vector<float> g(rows[r].size());
      for (size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * rows[r][i] - 0.03f * static_cast<float>((i + r) % 7);
      REQUIRE_OK(c[r]->Push(job, {t, {}, {{"emb", keys[r].data(), keys[r].size(), g.data()}}}));
    }
  }
}

// Every key the stream ever used, as read at `step` (an evicted or never
// admitted key reads its initial value).
std::vector<float> ReadStream(GrpcPsClient& c, const std::string& job, uint64_t step) {
  std::vector<uint64_t> keys(step * 8 + 160);
  std::iota(keys.begin(), keys.end(), 0);
  std::vector<float> out(keys.size() * kDim);
  REQUIRE_OK(c.Pull(job, {step, {}, {{"emb", keys.data(), keys.size(), out.data()}}}));
  return out;
}

struct LifeCounts {
  uint64_t rows = 0, admitted = 0, rejected = 0, evicted_cap = 0, evicted_ttl = 0;
};
LifeCounts CountsOf(testing::TestCluster& cluster, size_t servers, const std::string& job) {
  LifeCounts n;
  for (size_t i = 0; i < servers; ++i) {
    REQUIRE_OK_AND_ASSIGN(v1::GetJobResponse s, cluster.server(i)->GetJob(job));
    n.rows += s.sparse_rows();
    n.admitted += s.sparse_rows_admitted();
    n.rejected += s.sparse_rows_rejected();
    n.evicted_cap += s.sparse_rows_evicted_cap();
    n.evicted_ttl += s.sparse_rows_evicted_ttl();
  }
  return n;
}

std::vector<std::unique_ptr<GrpcPsClient>> StreamClients(testing::TestCluster& cluster, const std::string& job,
                                                         bool create, GrpcPsClientOptions base = {}) {
  std::vector<std::unique_ptr<GrpcPsClient>> c;
  for (uint32_t r = 0; r < 2; ++r) c.push_back(cluster.Client(r, base));
  if (create) REQUIRE_OK(c[0]->CreateJob(JobSpec(job, {LifeTable()}, 2)));
  for (uint32_t r = create ? 1 : 0; r < 2; ++r) REQUIRE_OK(c[r]->OpenJob(job));
  return c;
}

// Cut `cut` of `job`, read from servers [0, servers) as the coordinator's
// export does, written to `path` and read back.
safetensors::File ExportCut(testing::TestCluster& cluster, size_t servers, const std::string& job, uint64_t cut,
                            const std::string& path) {
  CutExport out;
  bool begun = false;
  for (size_t i = 0; i < servers; ++i) {
    v1::ReadCheckpointRequest req;
    req.set_job_id(job);
    req.set_cut_id(cut);
    for (;;) {
      auto page = cluster.server(i)->ReadCut(req);
      REQUIRE_OK(page.status());
      if (!begun) REQUIRE_OK(out.Begin(page->meta()));
      begun = true;
      for (const v1::CheckpointRecord& r : page->records()) REQUIRE_OK(out.Add(r));
      if (page->next_start_after().empty()) break;
      req.set_start_after(page->next_start_after());
    }
  }
  REQUIRE_OK(out.Write(path, {}));
  auto f = safetensors::Read(path);
  REQUIRE_OK(f.status());
  return std::move(*f);
}

// Checks that every row of an export of table "emb" holds the weights the
// workers read (`read`: kDim floats a key, by key); returns its rows.
size_t ExportedRowsMatch(const safetensors::File& f, const std::vector<float>& read) {
  REQUIRE(f.tensors.size() == 2);
  REQUIRE(f.tensors[0].name == "emb.keys");
  const size_t n = f.tensors[0].data.size() / 8;
  std::vector<uint64_t> keys(n);
  std::memcpy(keys.data(), f.tensors[0].data.data(), n * 8);
  REQUIRE(f.tensors[1].data.size() == n * kDim * 4);
  for (size_t k = 0; k < n; ++k) {
    INFO("key " << keys[k]);
    REQUIRE(keys[k] < read.size() / kDim);
    std::vector<float> w(kDim);
    std::memcpy(w.data(), f.tensors[1].data.data() + k * kDim * 4, kDim * 4);
    CHECK(std::vector<float>(read.begin() + keys[k] * kDim, read.begin() + (keys[k] + 1) * kDim) == w);
  }
  return n;
}

TEST_CASE("a BSP job whose table admits and evicts is bit-identical across reruns, and restored from a cut onto 3 "
          "servers from 2 it evicts as the undisturbed run, and an export holds exactly the live rows",
          "[checkpoint][lifecycle]") {
  const std::string dir = testing::MakeTempDir("ckpt-life");
  const testing::TestCluster::Options o = ThreeServersTwoMapped(dir);
  auto cluster = testing::TestCluster::Start(o);
  constexpr uint64_t kCut = 12, kEnd = 24;

  // Two runs, the workers' pushes arriving in opposite orders.
  auto a = StreamClients(*cluster, "a", true);
  StreamSteps(a, "a", 0, kCut, {0, 1});
  for (size_t i = 0; i < 2; ++i) REQUIRE_OK(cluster->server(i)->Checkpoint("a", 1, kCut, absl::Seconds(5)).status());
  const LifeCounts at_cut = CountsOf(*cluster, 2, "a");
  StreamSteps(a, "a", kCut, kEnd, {0, 1});
  const std::vector<float> undisturbed = ReadStream(*a[0], "a", kEnd);
  const LifeCounts end = CountsOf(*cluster, 2, "a");
  auto b = StreamClients(*cluster, "b", true);
  StreamSteps(b, "b", 0, kEnd, {1, 0});
  CHECK(ReadStream(*b[0], "b", kEnd) == undisturbed);
  const LifeCounts rerun = CountsOf(*cluster, 2, "b");
  CHECK(rerun.rows == end.rows);
  CHECK(rerun.evicted_cap == end.evicted_cap);
  CHECK(rerun.evicted_ttl == end.evicted_ttl);
  CHECK(rerun.rejected == end.rejected);
  // The stream used every part of the lifecycle.
  INFO("rows " << end.rows << ", admitted " << end.admitted << ", rejected " << end.rejected << ", evicted for the cap "
               << end.evicted_cap << ", by TTL " << end.evicted_ttl);
  CHECK(end.rows <= 96);
  CHECK(end.rejected > 0);
  CHECK(end.evicted_cap - at_cut.evicted_cap > 0);
  CHECK(end.evicted_ttl - at_cut.evicted_ttl > 0);

  // Export of the final state: a cut read back as the coordinator's export
  // does holds exactly the live rows, with the weights the workers read.
  for (size_t i = 0; i < 2; ++i) REQUIRE_OK(cluster->server(i)->Checkpoint("a", 2, kEnd, absl::Seconds(5)).status());
  {
    const safetensors::File f = ExportCut(*cluster, 2, "a", 2, dir + "/a.safetensors");
    CHECK(ExportedRowsMatch(f, undisturbed) == end.rows);
  }

  // Restore cut 1 onto 3 servers and train the same steps again: the same
  // rows evicted, the same weights.
  a.clear();
  RestoreOntoThree(*cluster, o.num_virtual_shards, "a", 1);
  CHECK(CountsOf(*cluster, 3, "a").rows == at_cut.rows);
  GrpcPsClientOptions fenced;
  fenced.incarnation = 1;
  auto resumed = StreamClients(*cluster, "a", false, fenced);
  StreamSteps(resumed, "a", kCut, kEnd, {1, 0});
  CHECK(ReadStream(*resumed[0], "a", kEnd) == undisturbed);
  const LifeCounts after = CountsOf(*cluster, 3, "a");
  CHECK(after.rows == end.rows);
  CHECK(after.evicted_cap == end.evicted_cap - at_cut.evicted_cap);
  CHECK(after.evicted_ttl == end.evicted_ttl - at_cut.evicted_ttl);
  CHECK(after.rejected == end.rejected - at_cut.rejected);
  std::filesystem::remove_all(dir);
}

// The stream's table, with 32 rows' worth of memory (2 per virtual shard)
// and the rest on disk; or, with `spill` false, every row in memory.
v1::TableSpec SpillTable(bool spill) {
  v1::TableSpec t = SparseTableSpec("emb", kDim, 0.1f, v1::OptimizerSpec::ADAGRAD);
  if (spill) {
    t.mutable_storage()->set_memory_bytes(32 * kDim * 2 * sizeof(float));
    t.mutable_storage()->set_spill(v1::StorageSpec::ROCKSDB);
  }
  return t;
}

std::vector<std::unique_ptr<GrpcPsClient>> Clients(testing::TestCluster& cluster, const std::string& job,
                                                   const v1::TableSpec* create, GrpcPsClientOptions base = {}) {
  std::vector<std::unique_ptr<GrpcPsClient>> c;
  for (uint32_t r = 0; r < 2; ++r) c.push_back(cluster.Client(r, base));
  if (create != nullptr) REQUIRE_OK(c[0]->CreateJob(JobSpec(job, {*create}, 2)));
  for (uint32_t r = create != nullptr ? 1 : 0; r < 2; ++r) REQUIRE_OK(c[r]->OpenJob(job));
  return c;
}

struct ColdCounts {
  uint64_t rows = 0, cold = 0, demoted = 0, promoted = 0;
};
ColdCounts ColdCountsOf(testing::TestCluster& cluster, size_t servers, const std::string& job) {
  ColdCounts n;
  for (size_t i = 0; i < servers; ++i) {
    REQUIRE_OK_AND_ASSIGN(v1::GetJobResponse s, cluster.server(i)->GetJob(job));
    n.rows += s.sparse_rows();
    n.cold += s.sparse_rows_cold();
    n.demoted += s.sparse_rows_demoted();
    n.promoted += s.sparse_rows_promoted();
  }
  return n;
}

TEST_CASE("a BSP job whose table spills to disk trains bit for bit as one that keeps every row in memory, restores "
          "from a cut onto 3 servers from 2 with both tiers, and exports every row",
          "[checkpoint][cold]") {
  const std::string dir = testing::MakeTempDir("ckpt-cold");
  const testing::TestCluster::Options o = ThreeServersTwoMapped(dir);
  auto cluster = testing::TestCluster::Start(o);
  constexpr uint64_t kCut = 12, kEnd = 24;
  const v1::TableSpec spill = SpillTable(true), memory = SpillTable(false);

  auto m = Clients(*cluster, "m", &memory);
  StreamSteps(m, "m", 0, kEnd, {0, 1});
  const std::vector<float> undisturbed = ReadStream(*m[0], "m", kEnd);
  auto a = Clients(*cluster, "a", &spill);
  StreamSteps(a, "a", 0, kCut, {1, 0});
  for (size_t i = 0; i < 2; ++i) REQUIRE_OK(cluster->server(i)->Checkpoint("a", 1, kCut, absl::Seconds(5)).status());
  const ColdCounts at_cut = ColdCountsOf(*cluster, 2, "a");
  StreamSteps(a, "a", kCut, kEnd, {1, 0});
  CHECK(ReadStream(*a[0], "a", kEnd) == undisturbed);
  const ColdCounts end = ColdCountsOf(*cluster, 2, "a");
  INFO("in memory " << end.rows << ", on disk " << end.cold << ", moved there " << end.demoted << ", back "
                    << end.promoted);
  CHECK(end.rows <= 32);
  CHECK(end.cold > 0);
  CHECK(end.promoted - at_cut.promoted > 0);
  CHECK(end.demoted - end.promoted == end.cold);

  // An export of the end holds the rows of both tiers, as the workers read them.
  for (size_t i = 0; i < 2; ++i) REQUIRE_OK(cluster->server(i)->Checkpoint("a", 2, kEnd, absl::Seconds(5)).status());
  {
    const safetensors::File f = ExportCut(*cluster, 2, "a", 2, dir + "/a.safetensors");
    CHECK(ExportedRowsMatch(f, undisturbed) == end.rows + end.cold);
  }

  // Cut 1 onto 3 servers: each reads its share of both tiers, and the same
  // steps again give the same weights.
  a.clear();
  RestoreOntoThree(*cluster, o.num_virtual_shards, "a", 1);
  const ColdCounts restored = ColdCountsOf(*cluster, 3, "a");
  CHECK(restored.rows + restored.cold == at_cut.rows + at_cut.cold);
  for (size_t i = 0; i < 3; ++i) {
    REQUIRE_OK_AND_ASSIGN(v1::GetJobResponse s, cluster->server(i)->GetJob("a"));
    CHECK(s.sparse_rows_cold() > 0);  // server 2 too, which wrote none of the cut
  }
  GrpcPsClientOptions fenced;
  fenced.incarnation = 1;
  auto resumed = Clients(*cluster, "a", nullptr, fenced);
  StreamSteps(resumed, "a", kCut, kEnd, {0, 1});
  CHECK(ReadStream(*resumed[0], "a", kEnd) == undisturbed);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a full disk under a table's cold tier is an error naming its path, the server serves on, and the job "
          "restored from its last cut trains on bit for bit",
          "[checkpoint][cold]") {
  using Fault = testing::FaultFs::Fault;
  const Fault fault = GENERATE(Fault::kNoSpace, Fault::kIoError);
  INFO("fault " << static_cast<int>(fault));
  const std::string dir = testing::MakeTempDir("cold-full");
  testing::FaultFs disk;
  ParameterServerOptions po;
  po.data_dir = dir;
  po.cold_tier_env = disk.env();
  REQUIRE_OK_AND_ASSIGN(std::shared_ptr<ParameterServer> ps, LocalPsClient::NewServer(std::move(po), 16));
  const v1::TableSpec spill = SpillTable(true);
  auto one_step = [&](PsClient& c, const std::string& job, uint64_t t) -> absl::Status {
    const std::vector<uint64_t> keys = StreamKeys(0, t);
    std::vector<float> rows(keys.size() * kDim);
    RETURN_IF_ERROR(c.Pull(job, {t, {}, {{"emb", keys.data(), keys.size(), rows.data()}}}));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.5f * rows[i] - 0.03f * static_cast<float>(i % 7);
    return c.Push(job, {t, {}, {{"emb", keys.data(), keys.size(), rows.data()}}});
  };
  auto read = [&](PsClient& c, const std::string& job, uint64_t t) {
    std::vector<uint64_t> keys(t * 8 + 160);
    std::iota(keys.begin(), keys.end(), 0);
    std::vector<float> out(keys.size() * kDim);
    REQUIRE_OK(c.Pull(job, {t, {}, {{"emb", keys.data(), keys.size(), out.data()}}}));
    return out;
  };
  // The same steps on a job whose disk never fails.
  LocalPsClient ref(ps, "ref");
  REQUIRE_OK(ref.CreateJob(JobSpec("ref", {SpillTable(false)}, 1)));
  for (uint64_t t = 0; t < 12; ++t) REQUIRE_OK(one_step(ref, "ref", t));
  const std::vector<float> want = read(ref, "ref", 12);

  LocalPsClient c(ps, "w0");
  REQUIRE_OK(c.CreateJob(JobSpec("job", {spill}, 1)));
  for (uint64_t t = 0; t < 6; ++t) REQUIRE_OK(one_step(c, "job", t));
  REQUIRE_OK(ps->Checkpoint("job", 1, 6, absl::Seconds(5)).status());
  disk.Set(fault);
  absl::Status failed;
  uint64_t t = 6;
  for (; t < 12 && failed.ok(); ++t) failed = one_step(c, "job", t);
  INFO(failed.ToString());
  REQUIRE_FALSE(failed.ok());
  CHECK(disk.failed() > 0);
  CHECK_THAT(std::string(failed.message()), Catch::Contains(dir + "/cold"));
  if (fault == Fault::kNoSpace) CHECK(failed.code() == absl::StatusCode::kResourceExhausted);
  // The server serves on: other jobs train, the stats answer.
  REQUIRE_OK(ps->GetJob("job").status());
  // The rollback: the disk has room again, the job comes back from its cut.
  // ENOSPC recovery runs on RocksDB's thread: a write meanwhile may be
  // refused, and the rollback is then tried again.
  disk.Set(Fault::kNone);
  std::vector<float> got;
  absl::Status s;
  for (int attempt = 0; attempt < 100; ++attempt) {
    s = ps->Restore("job", 1).status();
    if (s.ok()) {
      LocalPsClient resumed(ps, absl::StrCat("w0-", attempt));
      s = resumed.OpenJob("job");
      for (uint64_t u = 6; u < 12 && s.ok(); ++u) s = one_step(resumed, "job", u);
      if (s.ok()) {
        got = read(resumed, "job", 12);
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE_OK(s);
  CHECK(got == want);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a table that spills needs a server with a data directory, and its spec is checked", "[checkpoint][cold]") {
  REQUIRE_OK_AND_ASSIGN(std::shared_ptr<ParameterServer> ps, LocalPsClient::NewServer({}, 16));
  LocalPsClient c(ps, "w0");
  REQUIRE_STATUS(c.CreateJob(JobSpec("job", {SpillTable(true)}, 1)), absl::StatusCode::kFailedPrecondition,
                 "no data directory");
  const std::string dir = testing::MakeTempDir("cold-spec");
  std::shared_ptr<ParameterServer> with_disk = NewServer(dir);
  LocalPsClient d(with_disk, "w0");
  v1::TableSpec t = SpillTable(true);
  t.mutable_storage()->set_spill(v1::StorageSpec::SPILL_UNSPECIFIED);
  REQUIRE_STATUS(d.CreateJob(JobSpec("job", {t}, 1)), absl::StatusCode::kInvalidArgument, "storage.spill");
  t = SpillTable(true);
  t.mutable_storage()->set_memory_bytes(8);  // a row is 24 bytes
  REQUIRE_STATUS(d.CreateJob(JobSpec("job", {t}, 1)), absl::StatusCode::kInvalidArgument, "storage.memory_bytes 8");
  t = SpillTable(true);
  t.mutable_eviction()->set_max_rows(10);
  REQUIRE_STATUS(d.CreateJob(JobSpec("job", {t}, 1)), absl::StatusCode::kInvalidArgument, "eviction with storage");
  t = SpillTable(true);
  t.mutable_eviction()->set_policy(v1::EvictionSpec::LFU);  // which rows move: allowed
  REQUIRE_OK(d.CreateJob(JobSpec("job", {t}, 1)));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fulcrum

namespace fulcrum {
namespace {

size_t OpenFileDescriptors() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST_CASE("a finished job leaves no open files behind: its cuts deleted, its tables dropped", "[checkpoint]") {
  const std::string dir = testing::MakeTempDir("ckpt-fds");
  std::shared_ptr<ParameterServer> ps = NewServer(dir);
  std::vector<size_t> after_job;
  for (int j = 0; j < 6; ++j) {
    const std::string job = "job-" + std::to_string(j);
    {
      LocalPsClient c(ps, "w0");
      REQUIRE_OK(c.CreateJob(Spec(job)));
      for (uint64_t cut = 1; cut <= 4; ++cut) {
        Step(c, job, cut - 1);
        REQUIRE_OK(ps->Checkpoint(job, cut, cut, absl::Seconds(5)).status());
        REQUIRE_OK_AND_ASSIGN(auto cuts, ps->ListCuts(job));
        // Read each cut as a restore onto another server would.
        v1::ReadCheckpointRequest read;
        read.set_job_id(job);
        read.set_cut_id(cut);
        REQUIRE_OK(ps->ReadCut(read).status());
      }
    }
    // The job ends as the coordinator ends it: its cuts and its tables go.
    REQUIRE_OK_AND_ASSIGN(auto cuts, ps->ListCuts(job));
    for (const v1::ShardCutMeta& m : cuts) REQUIRE_OK(ps->DeleteCut(job, m.cut_id()));
    REQUIRE_OK(ps->DeleteJob(job).status());
    after_job.push_back(OpenFileDescriptors());
  }
  std::string seen;
  for (size_t n : after_job) seen += std::to_string(n) + " ";
  INFO("open descriptors after each finished job: " << seen);
  // After the first job (RocksDB opens its files once), flat.
  CHECK(after_job.back() <= after_job[1]);
}

}  // namespace
}  // namespace fulcrum
