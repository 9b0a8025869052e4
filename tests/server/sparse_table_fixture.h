// The sparse table tests' shared fixture: tables of a few virtual shards,
// pushes, pulls and hints as a server groups them, and the spill tests'
// stream of keys (tests/server/sparse_table_test.cc and
// sparse_table_cuts_test.cc).
#ifndef FULCRUM_TESTS_SERVER_SPARSE_TABLE_FIXTURE_H_
#define FULCRUM_TESTS_SERVER_SPARSE_TABLE_FIXTURE_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "common/shard_map.h"
#include "server/cold_tier.h"
#include "server/table.h"
#include "tests/testing/test_util.h"

namespace fulcrum::sparse_table_testing {

inline v1::TableSpec Spec(uint32_t dim = 2) {
  v1::TableSpec spec = testing::SparseTableSpec("emb", dim);
  spec.mutable_initializer()->set_kind(v1::InitializerSpec::CONSTANT);
  spec.mutable_initializer()->set_a(0.5f);
  return spec;
}

// The spill tests' table: dim 4, Adagrad (a row that came back without its
// optimizer state would take other steps), keys admitted on their second
// push, and at most `max_rows` rows in memory (0: no cap).
inline v1::TableSpec SpillSpec(uint32_t max_rows) {
  v1::TableSpec spec = testing::SparseTableSpec("emb", 4, 0.1f, v1::OptimizerSpec::ADAGRAD);
  spec.mutable_admission()->set_min_count(2);
  if (max_rows != 0) spec.mutable_eviction()->set_max_rows(max_rows);
  return spec;
}

inline std::set<uint64_t> Keys(const std::vector<SparseTable::ShardState>& shards) {
  std::set<uint64_t> keys;
  for (const auto& s : shards) keys.insert(s.keys.begin(), s.keys.end());
  return keys;
}

// Two tables' shards hold the same keys, rows (bit for bit) and slots.
inline void CheckSameShards(const std::vector<SparseTable::ShardState>& a, const std::vector<SparseTable::ShardState>& b) {
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
  std::set<uint64_t> Keys() const { return sparse_table_testing::Keys(table->Capture()); }
  uint32_t shards() const { return shards_; }
  MemoryQuota quota;
  uint32_t shards_;
  std::unique_ptr<SparseTable> table;
};

inline void RestoreInto(Fixture& to, const std::vector<SparseTable::ShardState>& from, uint64_t step) {
  for (const auto& s : from) {
    const SparseShardLife life = s.Life();
    REQUIRE_OK(to.table->Restore(s.vshard, to.table->dim(), static_cast<uint32_t>(to.table->num_slots()),
                                 s.keys.size(), s.keys.data(), s.updates.data(), s.rows.data(), step,
                                 s.has_life ? &life : nullptr));
  }
}

// Pushes gradient 1 for each of `keys` (distinct) at `step`, the keys of
// each virtual shard in one Apply, as a server applies a push.
inline void PushBatch(Fixture& f, const std::vector<uint64_t>& keys, uint64_t step) {
  std::vector<std::vector<uint32_t>> by_shard(f.shards());
  for (uint32_t i = 0; i < keys.size(); ++i) by_shard[VShardOfKey(f.table->name_hash(), keys[i], f.shards())].push_back(i);
  std::vector<float> g(keys.size() * f.table->dim(), 1.0f);
  for (uint32_t v = 0; v < f.shards(); ++v) {
    if (by_shard[v].empty()) continue;
    REQUIRE_OK(f.table->EnsureRows(v, keys.data(), by_shard[v].data(), by_shard[v].size()));
    REQUIRE_OK(f.table->Apply(v, keys.data(), by_shard[v].data(), by_shard[v].size(), g.data(), step));
  }
}

// `keys` grouped as a server groups a pull's: indices by virtual shard,
// and (shard, end of its indices) runs, shards ascending.
inline void GroupByShard(const Fixture& f, const std::vector<uint64_t>& keys, std::vector<uint32_t>* idx,
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
inline std::vector<float> PullBatch(Fixture& f, const std::vector<uint64_t>& keys) {
  std::vector<uint32_t> idx;
  std::vector<std::pair<uint32_t, size_t>> runs;
  GroupByShard(f, keys, &idx, &runs);
  std::vector<float> out(keys.size() * f.table->dim());
  REQUIRE_OK(f.table->ReadShards(keys.data(), idx.data(), runs, out.data()));
  return out;
}

// A prefetch hint of `keys`, as a server takes one: the rows read ahead.
inline uint64_t PrefetchBatch(Fixture& f, const std::vector<uint64_t>& keys) {
  std::vector<uint32_t> idx;
  std::vector<std::pair<uint32_t, size_t>> runs;
  GroupByShard(f, keys, &idx, &runs);
  absl::StatusOr<uint64_t> n = f.table->Prefetch(keys.data(), idx.data(), runs);
  REQUIRE_OK(n.status());
  return *n;
}

// The keys of push `step` of the spill tests' stream: 24 distinct of 400,
// the small ones most often.
inline std::vector<uint64_t> SpillBatch(uint64_t step) {
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
inline std::map<uint64_t, std::vector<float>> DiskRows(ColdTier& tier, uint32_t space, uint32_t shards, uint32_t row_floats) {
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
inline std::map<uint64_t, std::vector<float>> OnlyOnDisk(ColdTier& tier, uint32_t space, const Fixture& f,
                                                  uint32_t row_floats) {
  std::map<uint64_t, std::vector<float>> out = DiskRows(tier, space, f.shards(), row_floats);
  for (const auto& sh : f.table->Capture()) {
    for (size_t k = 0; k < sh.keys.size(); ++k) {
      if (sh.slot[k] != kColdSlot) out.erase(sh.keys[k]);
    }
  }
  return out;
}

}  // namespace fulcrum::sparse_table_testing

#endif  // FULCRUM_TESTS_SERVER_SPARSE_TABLE_FIXTURE_H_
