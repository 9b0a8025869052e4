// A sparse table's lifecycle (server/sparse_table.cc): admission by count
// and by probability, the count-min sketch's error against exact counts,
// eviction past a cap by LRU and by decayed LFU, by TTL, bad knobs refused
// naming the field, and the same pushes giving the same rows. The clock is
// the push's step, so these run on no wall clock at all.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "common/shard_map.h"
#include "server/cold_cut.h"
#include "server/cold_tier.h"
#include "server/table.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

v1::TableSpec Spec(uint32_t dim = 2) {
  v1::TableSpec spec = testing::SparseTableSpec("emb", dim);
  spec.mutable_initializer()->set_kind(v1::InitializerSpec::CONSTANT);
  spec.mutable_initializer()->set_a(0.5f);
  return spec;
}

// The spill tests' table: dim 4, Adagrad (a row that came back without its
// optimizer state would take other steps), keys admitted on their second
// push, and at most `max_rows` rows in memory (0: no cap).
v1::TableSpec SpillSpec(uint32_t max_rows) {
  v1::TableSpec spec = testing::SparseTableSpec("emb", 4, 0.1f, v1::OptimizerSpec::ADAGRAD);
  spec.mutable_admission()->set_min_count(2);
  if (max_rows != 0) spec.mutable_eviction()->set_max_rows(max_rows);
  return spec;
}

std::set<uint64_t> Keys(const std::vector<SparseTable::ShardState>& shards) {
  std::set<uint64_t> keys;
  for (const auto& s : shards) keys.insert(s.keys.begin(), s.keys.end());
  return keys;
}

// Two tables' shards hold the same keys, rows (bit for bit) and slots.
void CheckSameShards(const std::vector<SparseTable::ShardState>& a, const std::vector<SparseTable::ShardState>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].keys == b[i].keys);
    CHECK(a[i].rows == b[i].rows);
    CHECK(a[i].slot == b[i].slot);
  }
}

// A table of one virtual shard (or `shards`) and its quota.
struct Fixture {
  explicit Fixture(const v1::TableSpec& spec, uint32_t shards = 1) : quota("j", uint64_t{1} << 32), shards_(shards) {
    auto t = SparseTable::Create(spec, shards, &quota);
    REQUIRE_OK(t.status());
    table = *std::move(t);
  }
  // One push of gradient 1 for `key` at `step` (through EnsureRows, as a
  // server's push goes).
  void Push(uint64_t key, uint64_t step) {
    const uint32_t v = VShardOfKey(table->name_hash(), key, shards());
    const uint32_t idx = 0;
    std::vector<float> g(table->dim(), 1.0f);
    REQUIRE_OK(table->EnsureRows(v, &key, &idx, 1));
    REQUIRE_OK(table->Apply(v, &key, &idx, 1, g.data(), step));
  }
  std::vector<float> Read(uint64_t key) {
    std::vector<float> out(table->dim());
    const uint32_t idx = 0;
    REQUIRE_OK(table->Read(VShardOfKey(table->name_hash(), key, shards()), &key, &idx, 1, out.data()));
    return out;
  }
  std::set<uint64_t> Keys() const { return fulcrum::Keys(table->Capture()); }
  uint32_t shards() const { return shards_; }
  MemoryQuota quota;
  uint32_t shards_;
  std::unique_ptr<SparseTable> table;
};

TEST_CASE("bad lifecycle knobs are refused before the table exists, naming the field") {
  MemoryQuota quota("j", 1 << 20);
  auto refused = [&](const v1::TableSpec& spec, const std::string& text) {
    auto t = SparseTable::Create(spec, 16, &quota);
    INFO(t.status().ToString());
    CHECK(t.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(t.status().message()).find(text) != std::string::npos);
  };
  v1::TableSpec s = Spec();
  s.mutable_admission();  // present, with nothing set
  refused(s, "admission needs min_count (at least 1) or probability");
  s.mutable_admission()->set_probability(1.5f);
  refused(s, "admission.probability 1.5 must be in (0, 1]");
  s = Spec();
  s.mutable_admission()->set_min_count(70000);
  refused(s, "admission.min_count 70000 is over 65535");
  s = Spec();
  s.mutable_admission()->set_min_count(2);
  s.mutable_admission()->set_sketch_width(10);
  refused(s, "admission.sketch_width 10 must be 64 to 1048576");
  s = Spec();
  s.mutable_eviction()->set_policy(v1::EvictionSpec::LRU);
  refused(s, "eviction needs max_rows, max_bytes or ttl_steps");
  s.mutable_eviction()->set_policy(static_cast<v1::EvictionSpec::Policy>(7));
  s.mutable_eviction()->set_max_rows(100);
  refused(s, "eviction.policy 7 is not LRU or LFU");
  s = Spec();
  s.mutable_eviction()->set_max_bytes(4);  // a row of dim 2 with SGD is 8 bytes
  refused(s, "eviction.max_bytes 4 is below one row (8 bytes");
  s.mutable_eviction()->set_max_rows(10);
  refused(s, "eviction takes max_rows or max_bytes, not both");
  s = Spec();
  s.mutable_eviction()->set_max_rows(10);
  s.mutable_eviction()->set_lfu_decay(-0.5f);
  refused(s, "eviction.lfu_decay -0.5 must be in (0, 1]");
}

TEST_CASE("admission by count: a key's first pushes drop their gradient and read its initial value, the Nth "
          "makes the row") {
  v1::TableSpec spec = Spec();
  spec.mutable_admission()->set_min_count(3);
  Fixture f(spec);
  f.Push(7, 1);
  f.Push(7, 2);
  CHECK(f.table->num_rows() == 0);
  CHECK(f.Read(7) == std::vector<float>{0.5f, 0.5f});  // its initial value, not created by the read
  CHECK(f.table->num_rows() == 0);
  CHECK(f.table->counts().rejected == 2);
  f.Push(7, 3);  // the third: admitted, its gradient applied
  CHECK(f.table->num_rows() == 1);
  CHECK(f.Read(7) == std::vector<float>{-0.5f, -0.5f});
  CHECK(f.table->counts().admitted == 1);
  CHECK(f.table->counts().sketch_bytes == 4 * 4096 * 2);
  CHECK(f.quota.used() == f.table->bytes());
}

TEST_CASE("admission by probability admits the same keys for the same pushes, at about the asked rate") {
  v1::TableSpec spec = Spec();
  spec.mutable_admission()->set_probability(0.25f);
  Fixture a(spec), b(spec);
  for (uint64_t k = 0; k < 4000; ++k) {
    a.Push(k, k % 7);
    b.Push(k, k % 7);
  }
  CHECK(a.Keys() == b.Keys());
  const double rate = static_cast<double>(a.table->num_rows()) / 4000.0;
  CHECK(rate > 0.22);
  CHECK(rate < 0.28);
}

TEST_CASE("the admission sketch over-counts within its documented bound") {
  // n distinct keys pushed once each into W counters a row, 4 rows: a key
  // seen once is admitted at min_count 2 only when all 4 of its counters
  // were raised by others, about (1 - e^(-n/W))^4 of them (conservative
  // update keeps it at or below that; the sketch's halving, below, only
  // lowers it).
  for (const uint32_t n : {512u, 1024u, 2048u}) {
    v1::TableSpec spec = Spec();
    spec.mutable_admission()->set_min_count(2);
    spec.mutable_admission()->set_sketch_width(4096);
    Fixture f(spec);
    for (uint64_t k = 0; k < n; ++k) f.Push(k * 0x9E3779B97F4A7C15ull + 1, 1);
    const double false_admissions = static_cast<double>(f.table->num_rows()) / n;
    const double bound = std::pow(1.0 - std::exp(-static_cast<double>(n) / 4096.0), 4);
    INFO(n << " keys: " << false_admissions << " admitted at their first push; bound " << bound);
    CHECK(false_admissions <= bound * 1.2 + 0.002);
  }
}

TEST_CASE("the admission sketch forgets: on an endless stream of new keys its false admissions stay bounded, and "
          "keys that recur are still admitted") {
  // W = 1024: the sketch halves when its counters sum to 2 W, so it never
  // holds much more than the last W / 2 keys seen once; without halving,
  // 64 W keys would fill every counter and admit every key at its first
  // push.
  v1::TableSpec spec = Spec();
  spec.mutable_admission()->set_min_count(2);
  spec.mutable_admission()->set_sketch_width(1024);
  Fixture f(spec);
  uint64_t step = 0;
  auto once = [&](uint64_t k) { return k * 0x9E3779B97F4A7C15ull + 1; };
  constexpr uint64_t kKeys = 64 * 1024;
  uint64_t admitted_late = 0, recurring = 0, recurring_admitted = 0;
  for (uint64_t k = 0; k < kKeys; ++k) {
    const uint64_t before = f.table->num_rows();
    f.Push(once(k), ++step);
    if (k >= kKeys - 8 * 1024) admitted_late += f.table->num_rows() - before;
    if (k % 256 == 0) {  // now and then a key pushed twice in a row
      const uint64_t key = once(k) ^ 0x5555;
      f.Push(key, ++step);
      const uint64_t rows = f.table->num_rows();
      f.Push(key, ++step);
      ++recurring;
      recurring_admitted += f.table->num_rows() - rows;
    }
  }
  const double rate = static_cast<double>(admitted_late) / (8 * 1024);
  const double bound = std::pow(1.0 - std::exp(-0.5), 4);  // n = W / 2
  INFO("false admissions over the last 8 W keys: " << rate << " (bound " << bound << "); agings "
                                                    << f.table->counts().sketch_agings << "; recurring keys admitted "
                                                    << recurring_admitted << " of " << recurring);
  CHECK(f.table->counts().sketch_agings >= 64);
  CHECK(rate <= bound * 1.2 + 0.002);
  CHECK(recurring_admitted >= recurring * 95 / 100);
}

TEST_CASE("past its cap a table drops the least recently pushed row (LRU) or the least used, decayed (LFU)") {
  for (const auto policy : {v1::EvictionSpec::LRU, v1::EvictionSpec::LFU}) {
    INFO(v1::EvictionSpec::Policy_Name(policy));
    v1::TableSpec spec = Spec();
    spec.mutable_eviction()->set_policy(policy);
    spec.mutable_eviction()->set_max_rows(4);
    spec.mutable_eviction()->set_lfu_decay(0.9f);
    Fixture f(spec);
    f.Push(1, 1);  // key 1: pushed three times, long ago
    f.Push(1, 2);
    f.Push(1, 3);
    f.Push(2, 4);
    f.Push(3, 5);
    f.Push(4, 6);
    f.Push(5, 7);  // one row too many
    CHECK(f.table->num_rows() == 4);
    CHECK(f.table->counts().evicted_cap == 1);
    // LRU drops key 1 (last pushed at step 3); LFU keeps it (three pushes)
    // and drops key 2, whose one push has decayed most.
    const std::set<uint64_t> want = policy == v1::EvictionSpec::LRU ? std::set<uint64_t>{2, 3, 4, 5}
                                                                     : std::set<uint64_t>{1, 3, 4, 5};
    CHECK(f.Keys() == want);
    // A dropped row starts again from its initial value.
    const uint64_t gone = policy == v1::EvictionSpec::LRU ? 1 : 2;
    CHECK(f.Read(gone) == std::vector<float>{0.5f, 0.5f});
    CHECK(f.quota.used() == f.table->bytes());
  }
}

TEST_CASE("rows unused for ttl_steps are dropped by the sweep of later pushes") {
  v1::TableSpec spec = Spec();
  spec.mutable_eviction()->set_ttl_steps(10);
  Fixture f(spec);
  f.Push(1, 1);
  f.Push(2, 8);
  f.Push(3, 12);  // key 1 is 11 steps old
  CHECK(f.Keys() == std::set<uint64_t>{2, 3});
  CHECK(f.table->counts().evicted_ttl == 1);
  f.Push(4, 30);
  CHECK(f.Keys() == std::set<uint64_t>{4});
  CHECK(f.table->counts().evicted_ttl == 3);
}

TEST_CASE("the same pushes give the same rows: capped tables fed alike end bit-identical") {
  v1::TableSpec spec = Spec(4);
  spec.mutable_eviction()->set_max_rows(300);
  spec.mutable_admission()->set_min_count(2);
  Fixture a(spec, 4), b(spec, 4);
  uint64_t x = 1;
  for (uint64_t step = 0; step < 3000; ++step) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const uint64_t key = (x >> 33) % 2000;
    a.Push(key, step);
    b.Push(key, step);
  }
  CheckSameShards(a.table->Capture(), b.table->Capture());
  CHECK(a.table->num_rows() <= 300);
  CHECK(a.table->counts().evicted_cap > 0);
  CHECK(a.table->counts().rejected > 0);
}

void RestoreInto(Fixture& to, const std::vector<SparseTable::ShardState>& from, uint64_t step) {
  for (const auto& s : from) {
    const SparseShardLife life = s.Life();
    REQUIRE_OK(to.table->Restore(s.vshard, to.table->dim(), static_cast<uint32_t>(to.table->num_slots()),
                                 s.keys.size(), s.keys.data(), s.updates.data(), s.rows.data(), step,
                                 s.has_life ? &life : nullptr));
  }
}

// Pushes gradient 1 for each of `keys` (distinct) at `step`, the keys of
// each virtual shard in one Apply, as a server applies a push.
void PushBatch(Fixture& f, const std::vector<uint64_t>& keys, uint64_t step) {
  std::vector<std::vector<uint32_t>> by_shard(f.shards());
  for (uint32_t i = 0; i < keys.size(); ++i) by_shard[VShardOfKey(f.table->name_hash(), keys[i], f.shards())].push_back(i);
  std::vector<float> g(keys.size() * f.table->dim(), 1.0f);
  for (uint32_t v = 0; v < f.shards(); ++v) {
    if (by_shard[v].empty()) continue;
    REQUIRE_OK(f.table->EnsureRows(v, keys.data(), by_shard[v].data(), by_shard[v].size()));
    REQUIRE_OK(f.table->Apply(v, keys.data(), by_shard[v].data(), by_shard[v].size(), g.data(), step));
  }
}

TEST_CASE("with a cold tier, rows past the cap go to disk and come back bit for bit: no row is lost") {
  const v1::TableSpec spec = SpillSpec(0), capped = SpillSpec(64);
  Fixture all(spec, 4), spill(capped, 4);
  const std::string dir = testing::MakeTempDir("spill");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  REQUIRE_OK(spill.table->AttachColdTier(tier.get(), space));
  // Batches of 24 distinct keys of 400, the small ones most often: rows
  // leave and come back, some within one push.
  uint64_t x = 7;
  for (uint64_t step = 0; step < 400; ++step) {
    std::set<uint64_t> batch;
    while (batch.size() < 24) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const uint64_t u = (x >> 33) % 400;
      batch.insert(u * u / 400 * 2654435761u + 1);
    }
    const std::vector<uint64_t> keys(batch.begin(), batch.end());
    PushBatch(all, keys, step);
    PushBatch(spill, keys, step);
  }
  const SparseTable::Counts c = spill.table->counts();
  INFO("demoted " << c.demoted << ", promoted " << c.promoted);
  CHECK(spill.table->num_rows() <= 64);
  CHECK(c.evicted_cap == 0);
  CHECK(c.demoted > 100);
  CHECK(c.promoted > 100);
  // The same keys were admitted: a promoted row is not counted again.
  CHECK(c.rejected == all.table->counts().rejected);
  CHECK(c.admitted == all.table->counts().admitted);
  // Memory holds each row once; disk holds every other row, and older
  // copies of rows that came back (a promotion writes nothing to disk).
  std::set<uint64_t> on_disk;
  for (uint32_t v = 0; v < 4; ++v) {
    REQUIRE_OK(tier->Scan(space, v, 4 * 2, 1024, [&](const ColdRows& rows) {
      on_disk.insert(rows.keys.begin(), rows.keys.end());
      return absl::OkStatus();
    }));
  }
  // A cut lists both tiers' rows, those on disk with slot kColdSlot.
  std::set<uint64_t> in_memory, both;
  for (const auto& sh : spill.table->Capture()) {
    for (size_t k = 0; k < sh.keys.size(); ++k) {
      if (sh.slot[k] != kColdSlot) in_memory.insert(sh.keys[k]);
    }
  }
  CHECK(spill.Keys() == all.Keys());
  std::set_intersection(in_memory.begin(), in_memory.end(), on_disk.begin(), on_disk.end(),
                        std::inserter(both, both.end()));
  CHECK(!both.empty());
  std::set<uint64_t> held = in_memory;
  held.insert(on_disk.begin(), on_disk.end());
  CHECK(held == all.Keys());
  CHECK(on_disk.size() - both.size() == c.demoted - c.promoted);
  CHECK(spill.table->counts().cold_rows == c.demoted - c.promoted);
  // Every row reads as the uncapped table's, bit for bit, from either tier.
  const uint64_t cold_before = spill.table->counts().cold_reads;
  for (uint64_t key : all.Keys()) {
    const std::vector<float> a = all.Read(key), b = spill.Read(key);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
  // Only rows not in memory are read from disk: never an older copy.
  CHECK(spill.table->counts().cold_reads - cold_before == on_disk.size() - both.size());
  // A key never admitted reads its initial value from neither tier.
  CHECK(spill.Read(999999999) == all.Read(999999999));
  tier.reset();
  std::filesystem::remove_all(dir);
}

// `keys` grouped as a server groups a pull's: indices by virtual shard,
// and (shard, end of its indices) runs, shards ascending.
void GroupByShard(const Fixture& f, const std::vector<uint64_t>& keys, std::vector<uint32_t>* idx,
                  std::vector<std::pair<uint32_t, size_t>>* runs) {
  std::vector<std::vector<uint32_t>> by_shard(f.shards());
  for (uint32_t i = 0; i < keys.size(); ++i) by_shard[VShardOfKey(f.table->name_hash(), keys[i], f.shards())].push_back(i);
  for (uint32_t v = 0; v < f.shards(); ++v) {
    if (by_shard[v].empty()) continue;
    idx->insert(idx->end(), by_shard[v].begin(), by_shard[v].end());
    runs->emplace_back(v, idx->size());
  }
}

// Reads `keys` as a server answers a pull: every virtual shard's in one
// ReadShards, shards ascending.
std::vector<float> PullBatch(Fixture& f, const std::vector<uint64_t>& keys) {
  std::vector<uint32_t> idx;
  std::vector<std::pair<uint32_t, size_t>> runs;
  GroupByShard(f, keys, &idx, &runs);
  std::vector<float> out(keys.size() * f.table->dim());
  REQUIRE_OK(f.table->ReadShards(keys.data(), idx.data(), runs, out.data()));
  return out;
}

// A prefetch hint of `keys`, as a server takes one: the rows read ahead.
uint64_t PrefetchBatch(Fixture& f, const std::vector<uint64_t>& keys) {
  std::vector<uint32_t> idx;
  std::vector<std::pair<uint32_t, size_t>> runs;
  GroupByShard(f, keys, &idx, &runs);
  absl::StatusOr<uint64_t> n = f.table->Prefetch(keys.data(), idx.data(), runs);
  REQUIRE_OK(n.status());
  return *n;
}

TEST_CASE("with a cold tier, a push after pulls of its keys takes their rows from the pulls, not from disk again") {
  const v1::TableSpec spec = SpillSpec(0), capped = SpillSpec(64);
  Fixture all(spec, 4), spill(capped, 4);
  const std::string dir = testing::MakeTempDir("spill-read");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  REQUIRE_OK(spill.table->AttachColdTier(tier.get(), space));
  uint64_t x = 11;
  auto batch_of = [&x](std::set<uint64_t>* taken) {
    std::set<uint64_t> batch;
    while (batch.size() < 24) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const uint64_t u = (x >> 33) % 400;
      const uint64_t key = u * u / 400 * 2654435761u + 1;
      if (taken->insert(key).second) batch.insert(key);
    }
    return std::vector<uint64_t>(batch.begin(), batch.end());
  };
  uint64_t push_reads = 0;
  for (uint64_t step = 0; step < 300; ++step) {
    // Two workers pull their keys, then push them in the other order, as
    // the steps of two workers interleave on a server.
    std::set<uint64_t> taken;
    const std::vector<uint64_t> k1 = batch_of(&taken), k2 = batch_of(&taken);
    INFO("step " << step);
    for (const std::vector<uint64_t>* keys : {&k1, &k2}) {
      const std::vector<float> a = PullBatch(all, *keys), b = PullBatch(spill, *keys);
      REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    }
    const ColdTier::Counts before = tier->counts();
    for (const std::vector<uint64_t>* keys : {&k2, &k1}) {
      PushBatch(all, *keys, step);
      PushBatch(spill, *keys, step);
    }
    push_reads += tier->counts().rows_read - before.rows_read;
  }
  // Pushes read from disk only the few rows a shard's kept rows had let go
  // (each starts over once full): every other row they promoted, a pull had
  // read or a push had just moved there.
  const SparseTable::Counts c = spill.table->counts();
  INFO("promoted " << c.promoted << ", read from disk by pushes " << push_reads);
  CHECK(c.promoted > 1000);  // rows did come back from disk
  CHECK(push_reads * 20 <= c.promoted);
  CHECK(spill.Keys() == all.Keys());
  for (uint64_t key : all.Keys()) {
    const std::vector<float> a = all.Read(key), b = spill.Read(key);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
  tier.reset();
  std::filesystem::remove_all(dir);
}

// The keys of push `step` of the spill tests' stream: 24 distinct of 400,
// the small ones most often.
std::vector<uint64_t> SpillBatch(uint64_t step) {
  uint64_t x = step * 0x9e3779b97f4a7c15ull + 7;
  std::set<uint64_t> batch;
  while (batch.size() < 24) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const uint64_t u = (x >> 33) % 400;
    batch.insert(u * u / 400 * 2654435761u + 1);
  }
  return {batch.begin(), batch.end()};
}

// Every row a table's cold tier holds, by key: (update count, last push,
// floats).
std::map<uint64_t, std::vector<float>> DiskRows(ColdTier& tier, uint32_t space, uint32_t shards, uint32_t row_floats) {
  std::map<uint64_t, std::vector<float>> out;
  for (uint32_t v = 0; v < shards; ++v) {
    REQUIRE_OK(tier.Scan(space, v, row_floats, 1024, [&](const ColdRows& rows) {
      for (size_t i = 0; i < rows.size(); ++i) {
        std::vector<float>& r = out[rows.keys[i]];
        r.assign(rows.row(i), rows.row(i) + row_floats);
        r.push_back(static_cast<float>(rows.updates[i]));
        r.push_back(static_cast<float>(rows.last_step[i]));
      }
      return absl::OkStatus();
    }));
  }
  return out;
}

// The rows a table holds on disk only: its tier's rows less the older
// copies of rows in memory.
std::map<uint64_t, std::vector<float>> OnlyOnDisk(ColdTier& tier, uint32_t space, const Fixture& f,
                                                  uint32_t row_floats) {
  std::map<uint64_t, std::vector<float>> out = DiskRows(tier, space, f.shards(), row_floats);
  for (const auto& sh : f.table->Capture()) {
    for (size_t k = 0; k < sh.keys.size(); ++k) {
      if (sh.slot[k] != kColdSlot) out.erase(sh.keys[k]);
    }
  }
  return out;
}

TEST_CASE("a row that came back from disk and expires is gone from both tiers: its older copy does not return") {
  v1::TableSpec spec = Spec();
  spec.mutable_eviction()->set_max_rows(2);
  spec.mutable_eviction()->set_ttl_steps(10);
  Fixture f(spec), fresh(Spec());
  const std::string dir = testing::MakeTempDir("spill-ttl");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  REQUIRE_OK(f.table->AttachColdTier(tier.get(), space));
  f.Push(1, 1);
  f.Push(2, 2);
  f.Push(3, 3);  // 1 goes to disk
  CHECK(DiskRows(*tier, space, 1, 2).count(1) == 1);
  f.Push(1, 4);  // 1 comes back, its copy stays; 2 goes to disk
  f.Push(1, 5);  // the row in memory moves past its copy
  CHECK(DiskRows(*tier, space, 1, 2).count(1) == 1);
  CHECK(f.Read(1) != fresh.Read(1));
  f.Push(9, 20);  // 1 and 3 expire
  CHECK(f.table->counts().evicted_ttl == 2);
  const auto disk = DiskRows(*tier, space, 1, 2);
  CHECK(disk.count(1) == 0);
  CHECK(disk.count(2) == 1);
  CHECK(f.Keys() == std::set<uint64_t>{2, 9});
  CHECK(f.table->counts().cold_rows == 1);
  // Read and pushed again, key 1 starts over as a key never seen.
  CHECK(f.Read(1) == fresh.Read(1));
  f.Push(1, 21);
  fresh.Push(1, 21);
  CHECK(f.Read(1) == fresh.Read(1));
  tier.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("a cut of a table with a cold tier holds its rows on disk, and a restored table goes on as the first") {
  const v1::TableSpec spec = SpillSpec(64);
  const std::string dir = testing::MakeTempDir("spill");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t s1, tier->Space("job", "emb"));
  REQUIRE_OK_AND_ASSIGN(uint32_t s2, tier->Space("restored", "emb"));
  Fixture a(spec, 4), b(spec, 4);
  REQUIRE_OK(a.table->AttachColdTier(tier.get(), s1));
  REQUIRE_OK(b.table->AttachColdTier(tier.get(), s2));
  for (uint64_t step = 0; step < 200; ++step) PushBatch(a, SpillBatch(step), step);
  const std::vector<SparseTable::ShardState> cut = a.table->Capture();
  size_t cold = 0;
  for (const auto& sh : cut) {
    REQUIRE_OK(sh.error);
    cold += std::count(sh.slot.begin(), sh.slot.end(), kColdSlot);
    CHECK(std::is_sorted(sh.keys.begin(), sh.keys.end()));
  }
  const auto disk_a = OnlyOnDisk(*tier, s1, a, 8);
  CHECK(cold == disk_a.size());
  CHECK(cold > 50);

  RestoreInto(b, cut, 200);
  CHECK(DiskRows(*tier, s2, 4, 8) == disk_a);  // a restore writes no older copies
  CheckSameShards(b.table->Capture(), cut);
  // Both go on alike: the same rows promoted, demoted and admitted.
  for (uint64_t step = 200; step < 300; ++step) {
    PushBatch(a, SpillBatch(step), step);
    PushBatch(b, SpillBatch(step), step);
  }
  CheckSameShards(a.table->Capture(), b.table->Capture());
  CHECK(OnlyOnDisk(*tier, s1, a, 8) == OnlyOnDisk(*tier, s2, b, 8));

  // A table without a cold tier refuses the cut, naming why.
  Fixture c(spec, 4);
  bool refused = false;
  for (const auto& sh : cut) {
    if (std::count(sh.slot.begin(), sh.slot.end(), kColdSlot) == 0) continue;
    const SparseShardLife life = sh.Life();
    const absl::Status st = c.table->Restore(sh.vshard, 4, 1, sh.keys.size(), sh.keys.data(), sh.updates.data(),
                                             sh.rows.data(), 200, &life);
    CHECK(st.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(std::string(st.message()), Catch::Contains("lay in a cold tier, and the table has none"));
    refused = true;
    break;
  }
  CHECK(refused);
  tier.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("a capture linked to a cut of the cold tier leaves each shard's rows on disk there, unless a push moved "
          "them after the marks, and read back through the cut they are the copied capture") {
  const v1::TableSpec spec = SpillSpec(64);
  const std::string dir = testing::MakeTempDir("spill-link");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  Fixture a(spec, 4);
  REQUIRE_OK(a.table->AttachColdTier(tier.get(), space));
  for (uint64_t step = 0; step < 200; ++step) PushBatch(a, SpillBatch(step), step);
  const std::vector<uint64_t> marks = a.table->MoveMarks();
  REQUIRE(marks.size() == 4);
  REQUIRE_OK(tier->Checkpoint(dir + "/cut"));
  // A push of one row on disk after the tier's cut: it comes back (a move
  // of its shard), and nothing of the other shards moves.
  const auto on_disk = OnlyOnDisk(*tier, space, a, 8);
  REQUIRE(!on_disk.empty());
  const uint64_t moved_key = on_disk.begin()->first;
  const uint32_t moved = VShardOfKey(a.table->name_hash(), moved_key, 4);
  PushBatch(a, {moved_key}, 200);
  const std::vector<SparseTable::ShardState> want = a.table->Capture();

  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> cut_tier, ColdTier::OpenCut(dir + "/cut"));
  std::shared_ptr<ColdTier> cut(std::move(cut_tier));
  std::vector<SparseTable::ShardState> merged;
  CheckpointVisitor collect;
  collect.sparse = [&](const std::string&, uint32_t vshard, uint32_t, uint32_t, size_t n, const uint64_t* keys,
                       const uint32_t* updates, const float* rows, const SparseShardLife* life) {
    SparseTable::ShardState& m = merged.emplace_back();
    m.vshard = vshard;
    m.keys.assign(keys, keys + n);
    m.updates.assign(updates, updates + n);
    m.rows.assign(rows, rows + n * 8);
    m.slot.assign(life->slot, life->slot + n);
    CHECK_FALSE(life->cold_linked);
    return absl::OkStatus();
  };
  const CheckpointVisitor whole = LinkedCutVisitor({cut, "job", {{"emb", space}}}, collect);
  size_t linked = 0, copied = 0;
  Fixture other(spec, 4);
  for (const SparseTable::ShardState& w : want) {
    INFO("virtual shard " << w.vshard);
    SparseTable::ShardState s = a.table->CaptureShard(w.vshard, &marks);
    REQUIRE_OK(s.error);
    const size_t cold_rows = std::count(w.slot.begin(), w.slot.end(), kColdSlot);
    if (w.vshard == moved) {
      // Copied in, as without marks.
      CHECK_FALSE(s.cold_linked);
      CHECK(s.keys == w.keys);
      CHECK(s.rows == w.rows);
      CHECK(s.slot == w.slot);
      ++copied;
      continue;
    }
    CHECK(s.cold_linked);
    CHECK(s.linked_cold_rows == cold_rows);
    CHECK(std::count(s.slot.begin(), s.slot.end(), kColdSlot) == 0);
    CHECK(s.keys.size() + cold_rows == w.keys.size());
    SparseShardLife life = s.Life();
    life.cold_linked = true;
    life.linked_cold_rows = s.linked_cold_rows;
    REQUIRE_OK(whole.sparse("emb", s.vshard, 4, 1, s.keys.size(), s.keys.data(), s.updates.data(), s.rows.data(),
                            &life));
    CHECK(merged.back().keys == w.keys);
    CHECK(merged.back().rows == w.rows);
    CHECK(merged.back().slot == w.slot);
    // A count that is not the cut's is refused, naming the directory.
    life.linked_cold_rows += 1;
    const absl::Status miscounted = whole.sparse("emb", s.vshard, 4, 1, s.keys.size(), s.keys.data(),
                                                 s.updates.data(), s.rows.data(), &life);
    CHECK(miscounted.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(std::string(miscounted.message()), Catch::Contains(dir + "/cut"));
    // A table never restores a record whose rows are elsewhere.
    life.linked_cold_rows -= 1;
    const absl::Status refused = other.table->Restore(s.vshard, 4, 1, s.keys.size(), s.keys.data(),
                                                      s.updates.data(), s.rows.data(), 200, &life);
    CHECK(refused.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(std::string(refused.message()), Catch::Contains("linked cut"));
    linked += cold_rows > 0;
  }
  CHECK(copied == 1);
  CHECK(linked >= 2);
  cut.reset();
  tier.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("a prefetch hint reads exactly its keys' rows on disk, once, and their pull and push read disk no more") {
  const v1::TableSpec spec = SpillSpec(64);
  const std::string dir = testing::MakeTempDir("spill-ahead");
  // b's tier is its own: its counts are b's reads only.
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier_a, ColdTier::Open(dir + "/cold-a"));
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold-b"));
  REQUIRE_OK_AND_ASSIGN(uint32_t s1, tier_a->Space("job", "emb"));
  REQUIRE_OK_AND_ASSIGN(uint32_t s2, tier->Space("restored", "emb"));
  Fixture a(spec, 4), b(spec, 4);
  REQUIRE_OK(a.table->AttachColdTier(tier_a.get(), s1));
  REQUIRE_OK(b.table->AttachColdTier(tier.get(), s2));
  for (uint64_t step = 0; step < 200; ++step) PushBatch(a, SpillBatch(step), step);
  // b: a's rows, restored, so its shards keep nothing read from disk yet.
  RestoreInto(b, a.table->Capture(), 200);
  const auto disk = DiskRows(*tier, s2, 4, 8);
  const std::set<uint64_t> memory = b.Keys();
  // A hint of 20 keys on disk, 10 in memory and 5 on neither tier.
  std::vector<uint64_t> hint;
  std::set<uint64_t> on_disk;
  for (const auto& [key, row] : disk) {
    if (on_disk.size() == 20) break;
    on_disk.insert(key);
    hint.push_back(key);
  }
  REQUIRE(on_disk.size() == 20);
  size_t in_memory = 0;
  for (uint64_t key : memory) {
    if (disk.count(key) != 0) continue;
    hint.push_back(key);
    if (++in_memory == 10) break;
  }
  for (uint64_t k = 0; k < 5; ++k) hint.push_back(0xfeed0000 + k);
  std::sort(hint.begin(), hint.end());
  ColdTier::Counts before = tier->counts();
  CHECK(PrefetchBatch(b, hint) == 20);
  CHECK(tier->counts().rows_read - before.rows_read == 20);
  CHECK(tier->counts().reads - before.reads == 1);  // one batched read
  CHECK(b.table->counts().prefetched == 20);
  // Nothing moved: a hint only reads.
  CHECK(DiskRows(*tier, s2, 4, 8) == disk);
  CHECK(b.Keys() == memory);
  // Asked again, it reads nothing: the rows are kept.
  before = tier->counts();
  CHECK(PrefetchBatch(b, hint) == 0);
  CHECK(tier->counts().reads == before.reads);
  // The pull reads nothing from disk, and reads what a's pull reads.
  const std::vector<float> pa = PullBatch(a, hint), pb = PullBatch(b, hint);
  CHECK(tier->counts().rows_read == before.rows_read);
  REQUIRE(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)) == 0);
  // Nor does their push; both tables go on alike.
  PushBatch(a, hint, 200);
  PushBatch(b, hint, 200);
  CHECK(tier->counts().rows_read == before.rows_read);
  for (uint64_t step = 201; step < 260; ++step) {
    PushBatch(a, SpillBatch(step), step);
    PushBatch(b, SpillBatch(step), step);
  }
  CheckSameShards(a.table->Capture(), b.table->Capture());
  tier.reset();
  tier_a.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("a push that moves a hinted row while the hint reads it voids what the hint read") {
  // Rows of 512 bytes (dim 64, Adagrad's accumulator): a shard keeps at
  // most 128 of them, so the pushes below move rows to disk that nothing
  // keeps.
  v1::TableSpec spec = testing::SparseTableSpec("emb", 64, 0.1f, v1::OptimizerSpec::ADAGRAD);
  v1::TableSpec capped = spec;
  capped.mutable_eviction()->set_max_rows(4);
  Fixture all(spec, 1), spill(capped, 1);
  const std::string dir = testing::MakeTempDir("spill-void");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  REQUIRE_OK(spill.table->AttachColdTier(tier.get(), space));
  // One key a push: keys 1 to 296 go to disk in turn (LRU), and only the
  // first 128 are kept.
  for (uint64_t k = 1; k <= 300; ++k) {
    all.Push(k, k);
    spill.Push(k, k);
  }
  const uint64_t key = 250;
  uint64_t step = 301;
  const uint64_t read_before = tier->counts().rows_read;
  std::vector<uint32_t> idx;
  std::vector<std::pair<uint32_t, size_t>> runs;
  GroupByShard(spill, {key}, &idx, &runs);
  REQUIRE_OK_AND_ASSIGN(const SparseTable::ReadAhead read, spill.table->ReadAheadOf(&key, idx.data(), runs));
  REQUIRE(read.keys.size() == 1);
  // With the hint's read in hand: a push brings the row back and changes
  // it, and four more push it out to disk again, unkept; then another
  // worker's pull of a row on disk makes the full kept rows start over, so
  // there is room to keep what the hint read.
  for (uint64_t k : {key, uint64_t{1001}, uint64_t{1002}, uint64_t{1003}, uint64_t{1004}}) {
    all.Push(k, step);
    spill.Push(k, step);
    ++step;
  }
  PullBatch(spill, {260});
  CHECK(spill.table->KeepReadAhead(read) == 0);  // voided
  CHECK(tier->counts().rows_read - read_before >= 2);  // the hint's read and the push's
  CHECK(spill.table->counts().demoted - spill.table->counts().promoted == 300);  // keys 1 to 300
  // The pull reads the row as it is now, from disk.
  std::vector<float> a = PullBatch(all, {key}), b = PullBatch(spill, {key});
  REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  // Hinted again with no push between, the row is read ahead and kept.
  const uint64_t key2 = 251;
  CHECK(PrefetchBatch(spill, {key2}) == 1);
  const uint64_t read_after = tier->counts().rows_read;
  a = PullBatch(all, {key2});
  b = PullBatch(spill, {key2});
  CHECK(tier->counts().rows_read == read_after);
  REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  tier.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("prefetch hints racing pushes and pulls never serve a stale row") {
  // The case above, left to the scheduler: one thread hints the coming
  // batches while this one pulls and pushes; every pull must read what the
  // all-in-memory table reads, bit for bit (and, under the sanitizers, no
  // access may race). Wide rows (512 bytes
  // with Adagrad's) fill a shard's kept rows at 128, so pushes move rows
  // to disk that nothing keeps, and a hint's read can go stale.
  v1::TableSpec spec = testing::SparseTableSpec("emb", 64, 0.1f, v1::OptimizerSpec::ADAGRAD);
  v1::TableSpec capped = spec;
  capped.mutable_eviction()->set_max_rows(64);
  Fixture all(spec, 2), spill(capped, 2);
  auto batch_at = [](uint64_t step) {
    uint64_t x = step * 0x9e3779b97f4a7c15ull + 3;
    std::set<uint64_t> batch;
    while (batch.size() < 8) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const uint64_t u = (x >> 33) % 1000;
      batch.insert(u * u / 1000 + 1);
    }
    return std::vector<uint64_t>(batch.begin(), batch.end());
  };
  const std::string dir = testing::MakeTempDir("spill-race");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  REQUIRE_OK_AND_ASSIGN(uint32_t space, tier->Space("job", "emb"));
  REQUIRE_OK(spill.table->AttachColdTier(tier.get(), space));
  std::atomic<uint64_t> at{0};
  std::atomic<bool> stop{false};
  absl::Mutex mu;
  absl::Status hint_error;  // Catch's assertions are for this thread only
  std::thread hinter([&] {
    while (!stop.load()) {
      const uint64_t step = at.load();
      std::vector<uint64_t> keys;
      for (uint64_t ahead = 1; ahead <= 8; ++ahead) {
        const std::vector<uint64_t> next = batch_at(step + ahead);
        keys.insert(keys.end(), next.begin(), next.end());
      }
      {
        std::vector<uint32_t> idx;
        std::vector<std::pair<uint32_t, size_t>> runs;
        GroupByShard(spill, keys, &idx, &runs);
        const absl::Status s = spill.table->Prefetch(keys.data(), idx.data(), runs).status();
        absl::MutexLock lock(&mu);
        hint_error.Update(s);
      }
    }
  });
  for (uint64_t step = 0; step < 4000; ++step) {
    at.store(step);
    const std::vector<uint64_t> keys = batch_at(step);
    const std::vector<float> a = PullBatch(all, keys), b = PullBatch(spill, keys);
    INFO("step " << step);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    PushBatch(all, keys, step);
    PushBatch(spill, keys, step);
  }
  stop.store(true);
  hinter.join();
  REQUIRE_OK(hint_error);
  CHECK(spill.table->counts().prefetched > 0);
  CHECK(spill.Keys() == all.Keys());
  for (uint64_t key : all.Keys()) {
    const std::vector<float> a = all.Read(key), b = spill.Read(key);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
  tier.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("a cold tier needs a cap") {
  const std::string dir = testing::MakeTempDir("spill");
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ColdTier> tier, ColdTier::Open(dir + "/cold"));
  Fixture f(Spec());
  const absl::Status s = f.table->AttachColdTier(tier.get(), 1);
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(s.message()), Catch::Contains("'emb' has no cap"));
  tier.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("a captured lifecycle restores into a new table that admits and evicts as the first one goes on to") {
  for (const auto policy : {v1::EvictionSpec::LRU, v1::EvictionSpec::LFU}) {
    INFO(v1::EvictionSpec::Policy_Name(policy));
    v1::TableSpec spec = Spec(4);
    spec.mutable_eviction()->set_policy(policy);
    spec.mutable_eviction()->set_max_rows(200);
    spec.mutable_eviction()->set_ttl_steps(900);
    spec.mutable_admission()->set_min_count(3);
    spec.mutable_admission()->set_sketch_width(512);
    Fixture a(spec, 4);
    uint64_t x = 7;
    auto key_at = [&x](uint64_t step) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      return (x >> 33) % (400 + step / 4);  // new keys keep arriving
    };
    uint64_t step = 0;
    for (; step < 2000; ++step) a.Push(key_at(step), step);
    const auto cut = a.table->Capture();
    for (const auto& s : cut) REQUIRE(s.has_life);
    Fixture b(spec, 4);
    RestoreInto(b, cut, step);
    CHECK(b.Keys() == a.Keys());
    const SparseTable::Counts before = a.table->counts();
    for (; step < 4000; ++step) {
      const uint64_t key = key_at(step);
      a.Push(key, step);
      b.Push(key, step);
    }
    // The same rows, bit for bit, and the same evictions and rejections
    // since the cut: the slots, cursors, last uses and sketch came along.
    CheckSameShards(a.table->Capture(), b.table->Capture());
    const SparseTable::Counts ca = a.table->counts(), cb = b.table->counts();
    // The sketches halved since the cut: the restored ones knew when.
    CHECK(ca.sketch_agings > before.sketch_agings);
    CHECK(ca.sketch_agings - before.sketch_agings == cb.sketch_agings);
    CHECK(ca.evicted_cap - before.evicted_cap == cb.evicted_cap);
    CHECK(ca.evicted_ttl - before.evicted_ttl == cb.evicted_ttl);
    CHECK(ca.rejected - before.rejected == cb.rejected);
    CHECK(cb.evicted_cap > 0);
    CHECK(cb.rejected > 0);
    CHECK(b.quota.used() == b.table->bytes());

    // A cut of format 2 holds the rows alone: they restore, as last used
    // at the cut's step.
    Fixture c(spec, 4);
    for (const auto& s : cut) {
      REQUIRE_OK(c.table->Restore(s.vshard, 4, static_cast<uint32_t>(c.table->num_slots()), s.keys.size(),
                                  s.keys.data(), s.updates.data(), s.rows.data(), 2000));
    }
    CHECK(c.Keys() == Keys(cut));
  }
}

TEST_CASE("a restored lifecycle whose slots do not fit together is refused as DATA_LOSS") {
  v1::TableSpec spec = Spec(2);
  spec.mutable_eviction()->set_max_rows(8);
  spec.mutable_admission()->set_min_count(2);
  Fixture a(spec);
  for (uint64_t step = 0; step < 40; ++step) a.Push(step % 12, step);
  auto cut = a.table->Capture();
  REQUIRE(cut.size() == 1);
  REQUIRE(cut[0].keys.size() >= 2);
  struct Case {
    const char* what;
    std::function<void(SparseTable::ShardState&)> damage;
    const char* error;
  };
  const std::vector<Case> cases = {
      {"a slot past the shard's", [](auto& s) { s.slot[0] = s.slots + 3; }, "names slot"},
      {"two rows in one slot", [](auto& s) { s.slot[1] = s.slot[0]; }, "names slot"},
      {"a slot count that leaves slots unaccounted", [](auto& s) { s.slots += 2; }, "do not make its"},
      {"a sketch of another width", [](auto& s) { s.sketch.resize(12); }, "admission sketch has 12 counters"},
  };
  for (const Case& k : cases) {
    INFO(k.what);
    SparseTable::ShardState s = cut[0];
    k.damage(s);
    Fixture b(spec);
    const SparseShardLife life = s.Life();
    REQUIRE_STATUS(b.table->Restore(s.vshard, 2, static_cast<uint32_t>(b.table->num_slots()), s.keys.size(),
                                    s.keys.data(), s.updates.data(), s.rows.data(), 40, &life),
                   absl::StatusCode::kDataLoss, k.error);
  }
}

}  // namespace
}  // namespace fulcrum
