// Tables and memory quotas (server/table.h): a job's quota and the
// server's pool refuse what does not fit, naming which limit; holds give
// bytes back; dense tables are chunked as specified, materialize on
// demand within the quota, apply updates with their optimizer and read
// back in other dtypes.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "server/table.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

TEST_CASE("a job's quota refuses what does not fit and names the job, the pool names the server limit") {
  auto pool = std::make_shared<MemoryQuota>("", 1000);
  MemoryQuota job("j", 600, pool);
  REQUIRE_OK(job.Reserve(500, "table 'a'"));
  CHECK(job.used() == 500);
  CHECK(pool->used() == 500);
  absl::Status s = job.Reserve(200, "table 'b'");
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(s.message()).find("job 'j' would exceed its parameter memory quota of 600 bytes") !=
        std::string::npos);
  CHECK(std::string(s.message()).find("table 'b' needs 200 bytes, 500 already in use") != std::string::npos);
  CHECK(job.used() == 500);  // nothing reserved by a refusal
  MemoryQuota other("k", 1000, pool);
  s = other.Reserve(600, "table 'c'");
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(s.message()).find("parameter memory limit of 1000 bytes (--memory_limit_bytes)") !=
        std::string::npos);
  CHECK(std::string(s.message()).find("job 'k': table 'c'") != std::string::npos);
  CHECK(other.used() == 0);
  CHECK(pool->used() == 500);
  job.Release(500);
  CHECK(pool->used() == 0);
  REQUIRE_OK(other.Reserve(600, "table 'c'"));
}

TEST_CASE("charged bytes count past the limit, and a pool hold gives its bytes back once") {
  auto pool = std::make_shared<MemoryQuota>("", 100);
  pool->Charge(150);
  CHECK(pool->used() == 150);
  uint64_t in_use = 0;
  CHECK(!pool->TryAdd(1, &in_use));
  CHECK(in_use == 150);
  pool->Release(150);
  {
    PoolHold a(pool, 40);
    pool->Charge(40);
    PoolHold b = std::move(a);  // moved: released once, by b
    CHECK(pool->used() == 40);
  }
  CHECK(pool->used() == 0);
}

v1::TableSpec Dense(int64_t rows, int64_t cols, uint32_t chunk) {
  v1::TableSpec t;
  t.set_name("w");
  t.set_kind(v1::TableSpec::DENSE);
  t.add_shape(rows);
  t.add_shape(cols);
  t.set_chunk_elements(chunk);
  t.mutable_initializer()->set_kind(v1::InitializerSpec::CONSTANT);
  t.mutable_initializer()->set_a(0.5f);
  t.mutable_optimizer()->set_kind(v1::OptimizerSpec::SGD);
  t.mutable_optimizer()->set_learning_rate(0.1f);
  return t;
}

TEST_CASE("a dense table is chunked as specified and materializes chunks within its quota") {
  MemoryQuota quota("j", 1 << 20);
  auto table = DenseTable::Create(Dense(3, 5, 4), &quota);
  REQUIRE_OK(table.status());
  DenseTable& t = **table;
  CHECK(t.num_elements() == 15);
  CHECK(t.num_chunks() == 4);
  CHECK(t.ChunkLength(0) == 4);
  CHECK(t.ChunkLength(3) == 3);
  CHECK(t.materialized_chunks() == 0);
  CHECK(quota.used() == 0);  // created without allocating
  REQUIRE_OK(t.EnsureChunk(3));
  REQUIRE_OK(t.EnsureChunk(3));
  CHECK(t.materialized_chunks() == 1);
  CHECK(quota.used() == t.ChunkBytes(3));
  MemoryQuota tiny("small", 8);
  auto small = DenseTable::Create(Dense(3, 5, 4), &tiny);
  REQUIRE_OK(small.status());
  absl::Status s = (*small)->EnsureChunk(0);
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(s.message()).find("job 'small'") != std::string::npos);
}

TEST_CASE("a dense chunk starts at its initializer, applies SGD and reads back as fp32 and bf16") {
  MemoryQuota quota("j", 1 << 20);
  auto table = DenseTable::Create(Dense(2, 2, 4), &quota);
  REQUIRE_OK(table.status());
  DenseTable& t = **table;
  std::vector<float> w(4);
  REQUIRE_OK(t.Read(0, DType::kFp32, w.data()));
  CHECK(w == std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f});
  const std::vector<float> g = {1, -1, 2, 0};
  REQUIRE_OK(t.Apply(0, g.data(), /*step=*/0));
  REQUIRE_OK(t.Read(0, DType::kFp32, w.data()));
  CHECK(w[0] == Approx(0.4f));
  CHECK(w[1] == Approx(0.6f));
  CHECK(w[2] == Approx(0.3f));
  CHECK(w[3] == Approx(0.5f));
  std::vector<uint16_t> half(4);
  REQUIRE_OK(t.Read(0, DType::kBf16, half.data()));
  // bf16 is fp32's top 16 bits (rounded): 0.5 is exact.
  uint32_t bits = uint32_t{half[3]} << 16;
  float back;
  std::memcpy(&back, &bits, 4);
  CHECK(back == 0.5f);
  // A snapshot keeps the weights it saw while later updates copy first.
  auto snap = t.Snapshot(0);
  REQUIRE_OK(snap.status());
  REQUIRE_OK(t.Apply(0, g.data(), /*step=*/1));
  CHECK((*snap)[0] == Approx(0.4f));
  REQUIRE_OK(t.Read(0, DType::kFp32, w.data()));
  CHECK(w[0] == Approx(0.3f));
}

}  // namespace
}  // namespace fulcrum
