// SparseTable's checkpoints (server/sparse_table_cuts.cc): a shard's rows
// captured (with a cold tier: merged with its rows on disk, or linked to a
// cut of the tier) and restored, lifecycle and all.
#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/shard_map.h"
#include "server/cold_cut.h"
#include "server/cold_tier.h"
#include "server/table.h"
#include "tests/server/sparse_table_fixture.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

using sparse_table_testing::CheckSameShards;
using sparse_table_testing::DiskRows;
using sparse_table_testing::Fixture;
using sparse_table_testing::Keys;
using sparse_table_testing::OnlyOnDisk;
using sparse_table_testing::PushBatch;
using sparse_table_testing::RestoreInto;
using sparse_table_testing::Spec;
using sparse_table_testing::SpillBatch;
using sparse_table_testing::SpillSpec;

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
