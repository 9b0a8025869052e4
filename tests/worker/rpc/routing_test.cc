// GrpcPsClient's routing and slicing (worker/rpc/routing.h), without a
// transport: every chunk and key goes to its owner under the shard map,
// once; parts keep to the byte budget; a step's last push reaches every
// server; a rejected part re-slices under a new map; errors name the table.
#include <map>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/testing/test_util.h"
#include "worker/rpc/routing.h"

namespace fulcrum::routing {
namespace {

ShardMap Map(uint64_t version, int servers) {
  std::vector<std::string> addresses;
  for (int i = 0; i < servers; ++i) addresses.push_back("s" + std::to_string(i));
  auto m = ShardMap::RoundRobin(version, 64, addresses);
  REQUIRE_OK(m.status());
  return *m;
}

std::shared_ptr<const JobInfo> Job() {
  v1::PsJobSpec spec;
  spec.set_job_id("j");
  v1::TableSpec* d = spec.add_tables();
  d->set_name("w");
  d->set_kind(v1::TableSpec::DENSE);
  d->add_shape(10);
  d->add_shape(10);
  d->set_chunk_elements(16);  // 7 chunks, the last of 4
  v1::TableSpec* e = spec.add_tables();
  e->set_name("emb");
  e->set_kind(v1::TableSpec::SPARSE);
  e->set_dim(4);
  auto job = MakeJobInfo(spec);
  REQUIRE_OK(job.status());
  return *job;
}

TEST_CASE("a push's chunks and rows each reach their owner once, within the byte budget") {
  const ShardMap m = Map(1, 3);
  auto job = Job();
  const TableInfo& w = job->tables.at("w");
  CHECK(w.num_chunks == 7);
  CHECK(w.ChunkLength(6) == 4);
  std::vector<float> g(100);
  std::vector<uint64_t> keys;
  std::vector<float> values;
  for (uint64_t k = 0; k < 40; ++k) {
    keys.push_back(k * 7919);
    for (int j = 0; j < 4; ++j) values.push_back(static_cast<float>(k) + 0.25f * j);
  }
  PushBatch batch;
  batch.dense.push_back({"w", g.data(), g.size()});
  batch.sparse.push_back({"emb", keys.data(), keys.size(), values.data()});
  const size_t budget = 100;  // bytes: a 64-byte fp32 chunk, or 2 rows of 8 + 16
  auto parts = PlanPush(m, *job, batch, DType::kFp32, budget);
  REQUIRE_OK(parts.status());
  std::set<uint32_t> chunks;
  std::map<uint64_t, std::vector<float>> rows;
  for (const auto& [server, part] : *parts) {
    size_t bytes = 0;
    for (const PushPart::Dense& d : part->dense) {
      CHECK(m.owner(VShardOfChunk(w.name_hash, d.chunk, m.num_virtual_shards())) == server);
      CHECK(d.data == g.data() + d.chunk * 16);
      CHECK(chunks.insert(d.chunk).second);
      bytes += size_t{w.ChunkLength(d.chunk)} * 4;
    }
    for (const PushPart::Sparse& s : part->sparse) {
      REQUIRE(s.values.size() == s.keys.size() * 4);
      for (size_t i = 0; i < s.keys.size(); ++i) {
        CHECK(m.owner(VShardOfKey(s.table->name_hash, s.keys[i], m.num_virtual_shards())) == server);
        CHECK(rows.emplace(s.keys[i], std::vector<float>(s.values.begin() + 4 * i, s.values.begin() + 4 * i + 4)).second);
      }
      bytes += s.keys.size() * (8 + 16);
    }
    CHECK(bytes <= budget);
    CHECK(part->bytes == bytes);
  }
  CHECK(chunks.size() == 7);
  REQUIRE(rows.size() == 40);
  for (uint64_t k = 0; k < 40; ++k) CHECK(rows.at(k * 7919)[3] == static_cast<float>(k) + 0.75f);
  // bf16 halves a chunk's bytes: two chunks fit a part.
  auto half = PlanPush(m, *job, batch, DType::kBf16, budget);
  REQUIRE_OK(half.status());
  CHECK(half->size() < parts->size());
}

TEST_CASE("a step's last push reaches every server, an earlier group only the owners") {
  const ShardMap m = Map(1, 5);
  auto job = Job();
  std::vector<uint64_t> keys = {42};
  std::vector<float> values(4, 1.0f);
  PushBatch batch;
  batch.sparse.push_back({"emb", keys.data(), 1, values.data()});
  batch.last = false;
  auto group = PlanPush(m, *job, batch, DType::kFp32, 1 << 20);
  REQUIRE_OK(group.status());
  CHECK(group->size() == 1);
  batch.last = true;
  auto last = PlanPush(m, *job, batch, DType::kFp32, 1 << 20);
  REQUIRE_OK(last.status());
  std::set<uint32_t> servers;
  for (const auto& [server, part] : *last) servers.insert(server);
  CHECK(servers.size() == 5);
}

TEST_CASE("a push naming a table the job lacks or of the wrong size is refused, naming it") {
  const ShardMap m = Map(1, 2);
  auto job = Job();
  std::vector<float> g(99);
  PushBatch batch;
  batch.dense.push_back({"w", g.data(), g.size()});
  auto s = PlanPush(m, *job, batch, DType::kFp32, 1 << 20).status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()) == "table 'w' has 100 elements; gradient has 99");
  batch.dense[0] = {"emb", g.data(), g.size()};
  s = PlanPush(m, *job, batch, DType::kFp32, 1 << 20).status();
  CHECK(std::string(s.message()) == "job 'j' has no dense table 'emb'");
  batch.dense.clear();
  batch.sparse.push_back({"w", nullptr, 0, nullptr});
  s = PlanPush(m, *job, batch, DType::kFp32, 1 << 20).status();
  CHECK(std::string(s.message()) == "job 'j' has no sparse table 'w'");
}

TEST_CASE("a rejected part re-slices under a newer map, each item to its new owner") {
  auto job = Job();
  const TableInfo& w = job->tables.at("w");
  std::vector<float> g(100);
  std::vector<uint64_t> keys = {1, 2, 3, 4, 5, 6};
  std::vector<float> values(24, 2.0f);
  PushBatch batch;
  batch.dense.push_back({"w", g.data(), g.size()});
  batch.sparse.push_back({"emb", keys.data(), keys.size(), values.data()});
  auto one = PlanPush(Map(1, 1), *job, batch, DType::kFp32, 1 << 20);
  REQUIRE_OK(one.status());
  REQUIRE(one->size() == 1);
  const ShardMap now = Map(2, 4);
  auto parts = ReslicePush(now, *one->front().second, DType::kFp32, 1 << 20);
  size_t chunk_count = 0, key_count = 0;
  std::set<uint32_t> servers;
  for (const auto& [server, part] : parts) {
    servers.insert(server);
    for (const PushPart::Dense& d : part->dense) {
      CHECK(now.owner(VShardOfChunk(w.name_hash, d.chunk, now.num_virtual_shards())) == server);
      ++chunk_count;
    }
    for (const PushPart::Sparse& s : part->sparse) {
      for (uint64_t k : s.keys) CHECK(now.owner(VShardOfKey(s.table->name_hash, k, now.num_virtual_shards())) == server);
      key_count += s.keys.size();
    }
  }
  CHECK(chunk_count == 7);
  CHECK(key_count == 6);
  CHECK(servers.size() > 1);
}

TEST_CASE("a pull's chunks and keys go to their owners with their destinations") {
  const ShardMap m = Map(1, 3);
  auto job = Job();
  const TableInfo* w = &job->tables.at("w");
  const TableInfo* emb = &job->tables.at("emb");
  std::vector<float> out(100), rows(4 * 3);
  std::vector<PullPart::Dense> dense;
  for (uint32_t c = 0; c < w->num_chunks; ++c) dense.push_back({w, c, out.data() + c * 16});
  std::vector<PullPart::Sparse> sparse(1);
  sparse[0].table = emb;
  sparse[0].keys = {10, 20, 30};
  sparse[0].out = {rows.data(), rows.data() + 4, rows.data() + 8};
  auto parts = PlanPull(m, dense, sparse, DType::kFp32, 1 << 20);
  std::map<uint64_t, float*> dest;
  size_t chunks = 0;
  for (const auto& [server, part] : parts) {
    for (const PullPart::Dense& d : part->dense) {
      CHECK(m.owner(VShardOfChunk(w->name_hash, d.chunk, m.num_virtual_shards())) == server);
      CHECK(d.out == out.data() + d.chunk * 16);
      ++chunks;
    }
    for (const PullPart::Sparse& s : part->sparse) {
      REQUIRE(s.out.size() == s.keys.size());
      for (size_t i = 0; i < s.keys.size(); ++i) dest[s.keys[i]] = s.out[i];
    }
  }
  CHECK(chunks == 7);
  CHECK(dest.at(10) == rows.data());
  CHECK(dest.at(20) == rows.data() + 4);
  CHECK(dest.at(30) == rows.data() + 8);
}

}  // namespace
}  // namespace fulcrum::routing
