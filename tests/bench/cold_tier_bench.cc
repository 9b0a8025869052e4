// fulcrum-cold-tier-bench: what the cold tier (server/cold_tier.h) costs
// over RocksDB's own batched reads, on the same data directory in the same
// run.
//
// Fills a tier with --rows rows (dim floats and two optimizer slots'
// worth, as Adam's rows with their state: 48 floats at dim 16) over 256 virtual
// shards, cuts it (the rows in table files, as a long-running tier holds
// them), then reads batches of --batch keys of one virtual shard, picked
// Zipf(--zipf) over the rows, two ways in alternating rounds:
//   - the tier: ColdTier::Get on the cut, which decodes each row into the
//     arrays a table copies from;
//   - the bound: rocksdb::DB::MultiGet on the same cut directory, opened
//     read-only, with the same keys and options (values pinned, not copied).
// Goal (issue "Tables larger than memory"): the tier at >= 0.5x the bound.
// Prints a Markdown table; exits 1 when the goal is missed (--quick: a short
// run that checks the bench works, goal not enforced).
//
//   fulcrum-cold-tier-bench [--rows=4000000] [--batch=4096] [--dim=16] [--rounds=5] [--quick]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "server/cold_tier.h"

ABSL_FLAG(int64_t, rows, 4000000, "rows in the tier");
ABSL_FLAG(int32_t, batch, 4096, "keys a read (one virtual shard's)");
ABSL_FLAG(int32_t, dim, 16, "floats per row's weights (the row holds 3 x dim: weights and two slots)");
ABSL_FLAG(int32_t, rounds, 5, "alternating rounds of each reader");
ABSL_FLAG(int32_t, reads, 200, "batched reads a round");
ABSL_FLAG(double, zipf, 1.05, "the keys' Zipf exponent over the rows");
ABSL_FLAG(std::string, dir, "", "where the tier lives (default: a fresh directory under /tmp, removed after)");
ABSL_FLAG(bool, quick, false, "a short run that checks the bench works (goal not enforced)");

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kShards = 256;

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) {
    std::fprintf(stderr, "fulcrum-cold-tier-bench: %s: %s\n", what.c_str(), s.ToString().c_str());
    std::exit(2);
  }
}

// The tier's key of a row, built here as the bound's reader must (the
// layout of server/cold_tier.cc: big-endian space, shard, key).
std::string TierKey(uint32_t space, uint32_t shard, uint64_t key) {
  std::string k(16, '\0');
  for (int i = 0; i < 4; ++i) k[i] = static_cast<char>(space >> (24 - 8 * i));
  for (int i = 0; i < 4; ++i) k[4 + i] = static_cast<char>(shard >> (24 - 8 * i));
  for (int i = 0; i < 8; ++i) k[8 + i] = static_cast<char>(key >> (56 - 8 * i));
  return k;
}

// Zipf(s) ranks over [0, n) by inverse CDF of a table of cumulative weights.
class Zipf {
 public:
  Zipf(uint64_t n, double s) : cdf_(n) {
    double sum = 0;
    for (uint64_t i = 0; i < n; ++i) cdf_[i] = sum += std::pow(static_cast<double>(i + 1), -s);
    for (double& c : cdf_) c /= sum;
  }
  uint64_t operator()(std::mt19937_64& rng) const {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    return static_cast<uint64_t>(std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
  }

 private:
  std::vector<double> cdf_;
};

int Main() {
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int64_t rows = quick ? 200000 : absl::GetFlag(FLAGS_rows);
  const int batch = absl::GetFlag(FLAGS_batch);
  const uint32_t row_floats = 3 * static_cast<uint32_t>(absl::GetFlag(FLAGS_dim));
  const int rounds = quick ? 2 : absl::GetFlag(FLAGS_rounds);
  const int reads = quick ? 20 : absl::GetFlag(FLAGS_reads);
  std::string dir = absl::GetFlag(FLAGS_dir);
  const bool own_dir = dir.empty();
  if (own_dir) {
    char tmpl[] = "/tmp/fulcrum-cold-tier-bench-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return 2;
    dir = tmpl;
  }

  // Keys: row i is key i * a large odd number, in shard (i % 256), so a
  // shard's keys are spread over the key space as hashed ids are.
  auto key_of = [](uint64_t i) { return i * 0x9e3779b97f4a7c15ull; };
  const uint64_t per_shard = (static_cast<uint64_t>(rows) + kShards - 1) / kShards;
  uint32_t space = 0;
  double fill_seconds = 0;
  {
    auto tier = ColdTier::Open(dir + "/tier");
    Check(tier.status(), "opening the tier");
    auto sp = (*tier)->Space("bench", "emb");
    Check(sp.status(), "naming the table");
    space = *sp;
    std::vector<float> v(row_floats);
    const auto t0 = Clock::now();
    for (uint32_t shard = 0; shard < kShards; ++shard) {
      ColdRows chunk;
      chunk.row_floats = row_floats;
      for (uint64_t j = 0; j < per_shard; ++j) {
        const uint64_t i = j * kShards + shard;
        if (i >= static_cast<uint64_t>(rows)) break;
        for (uint32_t f = 0; f < row_floats; ++f) v[f] = static_cast<float>(i % 1000) * 0.001f + static_cast<float>(f);
        chunk.Add(key_of(i), static_cast<uint32_t>(i), i, 1.0f, v.data());
        if (chunk.size() == 4096) {
          Check((*tier)->Put(space, shard, chunk), "writing rows");
          chunk.Clear();
        }
      }
      Check((*tier)->Put(space, shard, chunk), "writing rows");
    }
    Check((*tier)->Checkpoint(dir + "/cut"), "cutting the tier");
    fill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  auto cut = ColdTier::OpenCut(dir + "/cut");
  Check(cut.status(), "opening the cut");

  rocksdb::Options options;
  options.compression = rocksdb::kNoCompression;
  rocksdb::BlockBasedTableOptions table;
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::DB* raw = nullptr;
  const rocksdb::Status os = rocksdb::DB::OpenForReadOnly(options, dir + "/cut", &raw);
  if (!os.ok()) {
    std::fprintf(stderr, "fulcrum-cold-tier-bench: opening the cut raw: %s\n", os.ToString().c_str());
    return 2;
  }
  std::unique_ptr<rocksdb::DB> db(raw);

  // The batches: one shard each, keys Zipf over the shard's rows.
  const Zipf zipf(per_shard, absl::GetFlag(FLAGS_zipf));
  std::mt19937_64 rng(1);
  struct Batch {
    uint32_t shard;
    std::vector<uint64_t> keys;
  };
  std::vector<Batch> batches(static_cast<size_t>(reads));
  for (Batch& b : batches) {
    b.shard = static_cast<uint32_t>(rng() % kShards);
    while (b.keys.size() < static_cast<size_t>(batch)) {
      const uint64_t i = zipf(rng) * kShards + b.shard;
      if (i < static_cast<uint64_t>(rows)) b.keys.push_back(key_of(i));
    }
  }

  double tier_s = 0, raw_s = 0;
  uint64_t tier_rows = 0, raw_rows = 0;
  for (int round = 0; round < rounds; ++round) {
    auto t0 = Clock::now();
    for (const Batch& b : batches) {
      ColdRows out;
      out.row_floats = row_floats;
      std::vector<bool> found;
      Check((*cut)->Get(space, b.shard, b.keys.data(), b.keys.size(), &out, &found), "reading rows");
      tier_rows += out.size();
    }
    tier_s += std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    for (const Batch& b : batches) {
      std::vector<std::string> keys;
      keys.reserve(b.keys.size());
      for (uint64_t k : b.keys) keys.push_back(TierKey(space, b.shard, k));
      std::vector<rocksdb::Slice> slices(keys.begin(), keys.end());
      std::vector<rocksdb::PinnableSlice> values(keys.size());
      std::vector<rocksdb::Status> st(keys.size());
      db->MultiGet(rocksdb::ReadOptions(), db->DefaultColumnFamily(), keys.size(), slices.data(), values.data(),
                   st.data());
      for (const auto& s : st) raw_rows += s.ok();
    }
    raw_s += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  const uint64_t asked = static_cast<uint64_t>(rounds) * reads * batch;
  const double tier_rate = static_cast<double>(tier_rows) / tier_s, raw_rate = static_cast<double>(raw_rows) / raw_s;
  const double ratio = tier_rate / raw_rate;
  std::printf("\n## fulcrum-cold-tier-bench: %lld rows of %u floats, batches of %d keys of one shard (Zipf %.2f)\n\n",
              static_cast<long long>(rows), row_floats, batch, absl::GetFlag(FLAGS_zipf));
  std::printf("filled and cut in %.1f s (%.0f rows/s); %llu of %llu keys found by each reader\n\n", fill_seconds,
              static_cast<double>(rows) / fill_seconds, static_cast<unsigned long long>(tier_rows / rounds),
              static_cast<unsigned long long>(asked / rounds));
  std::printf("| what | rows/s | bound | rows/s | ratio | goal |\n|---|---|---|---|---|---|\n");
  std::printf("| ColdTier::Get | %.0f | rocksdb MultiGet, same cut and keys | %.0f | %.2f | >= 0.5 %s |\n", tier_rate,
              raw_rate, ratio, ratio >= 0.5 ? "met" : "MISSED");
  db.reset();
  cut->reset();
  if (own_dir) std::filesystem::remove_all(dir);
  if (tier_rows != raw_rows || tier_rows != asked) {
    std::fprintf(stderr, "fulcrum-cold-tier-bench: the readers found %llu and %llu of %llu rows\n",
                 static_cast<unsigned long long>(tier_rows), static_cast<unsigned long long>(raw_rows),
                 static_cast<unsigned long long>(asked));
    return 1;
  }
  return quick || ratio >= 0.5 ? 0 : 1;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return fulcrum::Main();
}
