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
#include "tests/server/sparse_table_fixture.h"

namespace fulcrum {
namespace {

using sparse_table_testing::CheckSameShards;
using sparse_table_testing::DiskRows;
using sparse_table_testing::Fixture;
using sparse_table_testing::GroupByShard;
using sparse_table_testing::Keys;
using sparse_table_testing::PrefetchBatch;
using sparse_table_testing::PullBatch;
using sparse_table_testing::PushBatch;
using sparse_table_testing::RestoreInto;
using sparse_table_testing::Spec;
using sparse_table_testing::SpillBatch;
using sparse_table_testing::SpillSpec;

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

}  // namespace
}  // namespace fulcrum
