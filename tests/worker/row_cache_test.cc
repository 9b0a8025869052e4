// The worker's row cache (worker/row_cache.h) over a real ParameterServer
// core behind LocalPsClient: bit-identical BSP at staleness 0, the bound
// checked on every row of every pull, and which rows it keeps.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/testing/test_util.h"
#include "worker/local_ps_client.h"
#include "worker/row_cache.h"

namespace fulcrum {
namespace {

constexpr uint32_t kDim = 4;
constexpr char kJob[] = "cache-job";

v1::PsJobSpec Spec(v1::ConsistencySpec::Model model) {
  v1::PsJobSpec spec;
  spec.set_job_id(kJob);
  spec.set_num_workers(1);
  spec.mutable_consistency()->set_model(model);
  v1::TableSpec* emb = spec.add_tables();
  emb->set_name("emb");
  emb->set_kind(v1::TableSpec::SPARSE);
  emb->set_dim(kDim);
  emb->mutable_initializer()->set_kind(v1::InitializerSpec::NORMAL);
  emb->mutable_initializer()->set_b(0.1f);
  emb->mutable_optimizer()->set_kind(v1::OptimizerSpec::ADAGRAD);
  emb->mutable_optimizer()->set_learning_rate(0.1f);
  v1::TableSpec* w = spec.add_tables();
  w->set_name("w");
  w->set_kind(v1::TableSpec::DENSE);
  w->add_shape(8);
  w->mutable_optimizer()->set_kind(v1::OptimizerSpec::SGD);
  w->mutable_optimizer()->set_learning_rate(0.1f);
  return spec;
}

// A step's distinct keys: Zipf(1.05) over `vocab` ids, most of them rare.
std::vector<uint64_t> Batch(std::mt19937_64& rng, size_t draws, uint64_t vocab) {
  static std::vector<double> cdf;
  if (cdf.size() != vocab) {
    cdf.assign(vocab, 0);
    double sum = 0;
    for (uint64_t i = 0; i < vocab; ++i) cdf[i] = sum += std::pow(static_cast<double>(i + 1), -1.05);
    for (double& c : cdf) c /= sum;
  }
  std::uniform_real_distribution<double> u(0, 1);
  std::set<uint64_t> keys;
  for (size_t i = 0; i < draws; ++i) {
    keys.insert(static_cast<uint64_t>(std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin()) * 7919 + 3);
  }
  return {keys.begin(), keys.end()};
}

// A deterministic gradient of the pulled rows.
std::vector<float> Gradient(const std::vector<uint64_t>& keys, const std::vector<float>& rows, uint64_t step) {
  std::vector<float> g(rows.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    for (uint32_t d = 0; d < kDim; ++d) {
      g[i * kDim + d] = 0.5f * rows[i * kDim + d] - 0.01f * static_cast<float>((keys[i] + d + step) % 7);
    }
  }
  return g;
}

absl::Status PullRows(PsClient& c, uint64_t step, const std::vector<uint64_t>& keys, std::vector<float>* rows,
                      std::vector<float>* dense = nullptr) {
  rows->assign(keys.size() * kDim, 0);
  PullBatch pull;
  pull.step = step;
  pull.sparse.push_back({"emb", keys.data(), keys.size(), rows->data()});
  if (dense != nullptr) {
    dense->assign(8, 0);
    pull.dense.push_back({"w", dense->data(), dense->size()});
  }
  return c.Pull(kJob, pull);
}

absl::Status PushRows(PsClient& c, uint64_t step, const std::vector<uint64_t>& keys, const std::vector<float>& grad,
                      const std::vector<float>* dense_grad = nullptr) {
  PushBatch push;
  push.step = step;
  push.sparse.push_back({"emb", keys.data(), keys.size(), grad.data()});
  if (dense_grad != nullptr) push.dense.push_back({"w", dense_grad->data(), dense_grad->size()});
  return c.Push(kJob, push);
}

std::shared_ptr<ParameterServer> NewServer() {
  auto s = LocalPsClient::NewServer();
  REQUIRE_OK(s.status());
  return *s;
}

TEST_CASE("row cache: BSP with max_staleness_steps 0 trains bit for bit as without the cache", "[row_cache]") {
  LocalPsClient plain(NewServer(), "worker-0", 0);
  LocalPsClient behind(NewServer(), "worker-0", 0);
  RowCacheStats stats;
  CachingPsClient cached(&behind, {/*rows=*/64, /*max_staleness_steps=*/0, 4, &stats});
  REQUIRE_OK(plain.CreateJob(Spec(v1::ConsistencySpec::BSP)));
  REQUIRE_OK(cached.CreateJob(Spec(v1::ConsistencySpec::BSP)));

  std::mt19937_64 rng(7);
  for (uint64_t step = 0; step < 60; ++step) {
    const std::vector<uint64_t> keys = Batch(rng, 256, 5000);
    std::vector<float> a, b, da, db;
    REQUIRE_OK(PullRows(plain, step, keys, &a, &da));
    REQUIRE_OK(PullRows(cached, step, keys, &b, &db));
    INFO("step " << step);
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    REQUIRE(da == db);
    // A second pull within the step is served from the cache, unchanged.
    const uint64_t hits = stats.hits.load();
    REQUIRE_OK(PullRows(cached, step, keys, &b));
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    CHECK(stats.hits.load() > hits);
    const std::vector<float> g = Gradient(keys, a, step);
    const std::vector<float> dg(8, 0.01f * static_cast<float>(step % 5));
    REQUIRE_OK(PushRows(plain, step, keys, g, &dg));
    REQUIRE_OK(PushRows(cached, step, keys, g, &dg));
  }
  // Every row the job touched ends the same on both servers.
  std::vector<uint64_t> all;
  for (uint64_t i = 0; i < 5000; ++i) all.push_back(i * 7919 + 3);
  std::vector<float> a, b;
  REQUIRE_OK(PullRows(plain, 60, all, &a));
  REQUIRE_OK(PullRows(behind, 60, all, &b));
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  CHECK(stats.max_staleness.load() == 0);
  CHECK(cached.CachedRows(kJob, "emb") == 64);
  CHECK(cached.CachedRows(kJob, "w") == 0);  // dense tables pass through
}

TEST_CASE("row cache: every row a pull serves is the servers' row of a step within the bound", "[row_cache]") {
  constexpr uint32_t kBound = 3;
  std::shared_ptr<ParameterServer> server = NewServer();
  LocalPsClient behind(server, "worker-0", 0);
  LocalPsClient truth(server, "worker-0", 0);  // reads what the servers hold
  RowCacheStats stats;
  CachingPsClient cached(&behind, {/*rows=*/128, kBound, 4, &stats});
  REQUIRE_OK(cached.CreateJob(Spec(v1::ConsistencySpec::BSP)));

  // history[step][key]: the servers' row at that step.
  std::vector<std::map<uint64_t, std::vector<float>>> history;
  std::mt19937_64 rng(11);
  uint64_t served = 0, stale = 0;
  for (uint64_t step = 0; step < 80; ++step) {
    const std::vector<uint64_t> keys = Batch(rng, 256, 5000);
    std::vector<float> now, got;
    REQUIRE_OK(PullRows(truth, step, keys, &now));
    auto& h = history.emplace_back();
    for (size_t i = 0; i < keys.size(); ++i) h[keys[i]].assign(&now[i * kDim], &now[(i + 1) * kDim]);
    REQUIRE_OK(PullRows(cached, step, keys, &got));
    for (size_t i = 0; i < keys.size(); ++i) {
      const std::vector<float> row(&got[i * kDim], &got[(i + 1) * kDim]);
      // The row equals the servers' row at some step in [step - bound, step].
      bool within = false;
      for (uint64_t f = step >= kBound ? step - kBound : 0; f <= step && !within; ++f) {
        auto it = history[f].find(keys[i]);
        within = it != history[f].end() && it->second == row;
      }
      INFO("step " << step << " key " << keys[i]);
      REQUIRE(within);
      ++served;
      if (row != h[keys[i]]) ++stale;
    }
    REQUIRE_OK(PushRows(cached, step, keys, Gradient(keys, got, step)));
  }
  // The cache did serve old rows (the check above could fail), never older
  // than the bound, and its counters add up.
  CHECK(stale > 0);
  CHECK(stats.max_staleness.load() == kBound);
  CHECK(stats.hits.load() + stats.misses.load() == served);
  CHECK(stats.staleness.count() == stats.hits.load());
  CHECK(stats.bytes_saved.load() == stats.hits.load() * (8 + kDim * 4));
  CHECK(stats.rows.load() == 128);
  CHECK(stats.bytes.load() == 128 * (kDim * 4 + 32));
}

TEST_CASE("row cache: it keeps the most-pulled rows, near the best any cache of its size could hit", "[row_cache]") {
  std::shared_ptr<ParameterServer> server = NewServer();
  LocalPsClient behind(server, "worker-0", 0);
  RowCacheStats stats;
  constexpr uint64_t kRows = 200;  // 1% of the vocabulary
  constexpr uint64_t kVocab = 20000;
  CachingPsClient cached(&behind, {kRows, /*max_staleness_steps=*/1000, 4, &stats});
  REQUIRE_OK(cached.CreateJob(Spec(v1::ConsistencySpec::ASP)));
  std::mt19937_64 rng(3);
  uint64_t best = 0, total = 0, measured_hits = 0;
  for (uint64_t step = 0; step < 200; ++step) {
    const std::vector<uint64_t> keys = Batch(rng, 2048, kVocab);
    const uint64_t hits = stats.hits.load(), misses = stats.misses.load();
    std::vector<float> rows;
    REQUIRE_OK(PullRows(cached, step, keys, &rows));
    if (step < 50) continue;  // warm-up
    // The best: a cache holding exactly the kRows most frequent ids.
    for (uint64_t k : keys) best += (k - 3) / 7919 < kRows;
    total += stats.hits.load() - hits + stats.misses.load() - misses;
    measured_hits += stats.hits.load() - hits;
  }
  INFO("best " << best << " of " << total << ", cache " << measured_hits);
  // 1% of the ids are 15-20% of a batch's distinct ids: most are rare.
  CHECK(static_cast<double>(best) / static_cast<double>(total) > 0.15);
  // The hits of the 150 measured steps: at least 85% of the best.
  CHECK(static_cast<double>(measured_hits) >= 0.85 * static_cast<double>(best));
}

TEST_CASE("row cache: a pull of an exact clock and a failed pull leave the cache alone", "[row_cache]") {
  std::shared_ptr<ParameterServer> server = NewServer();
  LocalPsClient behind(server, "worker-0", 0);
  RowCacheStats stats;
  CachingPsClient cached(&behind, {16, 5, 4, &stats});
  REQUIRE_OK(cached.CreateJob(Spec(v1::ConsistencySpec::BSP)));
  const std::vector<uint64_t> keys = {3, 10, 17};
  std::vector<float> rows(keys.size() * kDim);
  PullBatch exact;
  exact.step = 0;
  exact.exact = true;
  exact.sparse.push_back({"emb", keys.data(), keys.size(), rows.data()});
  REQUIRE_OK(cached.Pull(kJob, exact));
  CHECK(cached.CachedRows(kJob, "emb") == 0);
  CHECK(stats.hits.load() + stats.misses.load() == 0);
  // An unknown table fails the pull with the servers' error, caching nothing.
  PullBatch bad;
  bad.step = 0;
  bad.sparse.push_back({"emb", keys.data(), keys.size(), rows.data()});
  bad.sparse.push_back({"nope", keys.data(), keys.size(), rows.data()});
  CHECK_FALSE(cached.Pull(kJob, bad).ok());
  CHECK(cached.CachedRows(kJob, "emb") == 0);
  // Deleting the job frees its rows.
  REQUIRE_OK(PullRows(cached, 0, keys, &rows));
  CHECK(stats.rows.load() == 3);
  REQUIRE_OK(cached.DeleteJob(kJob));
  CHECK(stats.rows.load() == 0);
  CHECK(stats.bytes.load() == 0);
}

}  // namespace
}  // namespace fulcrum
