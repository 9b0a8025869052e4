// Job-level tests, without gRPC: consistency bookkeeping driven directly.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/float_env.h"
#include "common/parallel.h"
#include "server/job.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

using testing::DenseTableSpec;
using testing::JobSpec;

// Rank `rank`'s push for `step` of job "j", without gradients.
PushMessage Header(uint32_t rank, uint64_t step) {
  PushMessage m;
  m.job_id = "j";
  m.worker_id = "w" + std::to_string(rank);
  m.seq = step + 1;
  m.rank = rank;
  m.step = step;
  return m;
}

PushMessage Push(uint32_t rank, uint64_t step, const std::vector<float>& g) {
  PushMessage m = Header(rank, step);
  m.dense.push_back({"w", 0, DType::kFp32, Payload(g.data(), g.size() * 4)});
  return m;
}

// The fp32 weights of table "w"'s `chunks` (each `chunk_elements` long) as
// rank `rank`'s pull at `step` sees them.
std::vector<float> PullWeights(Job& job, const std::shared_ptr<const ShardMap>& map, uint64_t step,
                               uint32_t chunks, size_t chunk_elements, uint32_t rank = 0) {
  auto pull = std::make_shared<PullMessage>();
  pull->job_id = "j";
  pull->worker_id = "w" + std::to_string(rank);
  pull->rank = rank;
  pull->step = step;
  for (uint32_t c = 0; c < chunks; ++c) pull->dense.push_back({"w", c});
  absl::Notification done;
  absl::StatusOr<PullResult> result;
  job.Pull(pull, map, 0, absl::Now() + absl::Seconds(30), [&](absl::StatusOr<PullResult> res) {
    result = std::move(res);
    done.Notify();
  });
  REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  REQUIRE_OK(result.status());
  std::vector<float> w(chunks * chunk_elements);
  for (const PullResult::Dense& d : result->dense) {
    std::memcpy(w.data() + size_t{d.chunk} * chunk_elements, d.owner ? d.shared : d.data.data.get(),
                chunk_elements * 4);
  }
  return w;
}

TEST_CASE("BSP stops waiting for a worker removed from the active set", "[bsp][job]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  REQUIRE_OK_AND_ASSIGN(auto job, Job::Create(JobSpec("j", {DenseTableSpec("w", 4)}, 3), 4,
                                              1 << 20, &timer));
  REQUIRE_OK(job->MaterializeOwned(*map, 0));
  std::vector<float> g0(4, 1.0f), g1(4, 3.0f);
  PushResult r;
  REQUIRE_OK(job->Push(Push(0, 0, g0), *map, 0, &r));
  REQUIRE_OK(job->Push(Push(1, 0, g1), *map, 0, &r));
  REQUIRE(r.applied_step == 0);  // rank 2 has not pushed

  auto pull = std::make_shared<PullMessage>();
  pull->job_id = "j";
  pull->worker_id = "w0";
  pull->step = 1;
  pull->dense.push_back({"w", 0});
  absl::Notification done;
  absl::StatusOr<PullResult> result;
  job->Pull(pull, map, 0, absl::Now() + absl::Seconds(30), [&](absl::StatusOr<PullResult> res) {
    result = std::move(res);
    done.Notify();
  });
  REQUIRE_FALSE(done.HasBeenNotified());  // parked: step 0 waits for worker 2

  // Worker 2 is declared gone: step 0 completes with the two that pushed.
  REQUIRE_OK(job->SetActiveWorkers({0, 1}));
  REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  REQUIRE_OK(result.status());
  REQUIRE(result->applied_step == 1);
  std::vector<float> w(4);
  const PullResult::Dense& d = result->dense[0];
  std::memcpy(w.data(), d.owner ? d.shared : d.data.data.get(), 16);  // fp32: served shared
  for (float x : w) REQUIRE(x == -2.0f);  // mean of 1 and 3 over the 2 active workers, lr 1

  // A push from the inactive worker is refused and names it.
  REQUIRE_STATUS(job->Push(Push(2, 1, g0), *map, 0, &r), absl::StatusCode::kFailedPrecondition,
                 "is not an active worker");
  REQUIRE_STATUS(job->SetActiveWorkers({7}), absl::StatusCode::kInvalidArgument, "rank 7");
}

// Job "j" of 2 workers under BSP with a dense table "w" (4 elements) and a
// sparse table "emb" (dim 2), every shard on this server of `map`.
std::shared_ptr<Job> DenseAndSparseJob(DeadlineTimer* timer, const ShardMap& map) {
  using testing::SparseTableSpec;
  auto job = Job::Create(JobSpec("j", {DenseTableSpec("w", 4), SparseTableSpec("emb", 2, 0.5f)}, 2), 4, 1 << 20, timer);
  REQUIRE_OK(job.status());
  REQUIRE_OK((*job)->MaterializeOwned(map, 0));
  return *std::move(job);
}

TEST_CASE("a prefetch hint is answered at once with no rows, whatever the clock, and names no dense table",
          "[bsp][job][cold]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  const std::shared_ptr<Job> job = DenseAndSparseJob(&timer, *map);
  std::vector<uint64_t> keys = {7, 9};
  auto hint = [&](bool dense) {
    auto pull = std::make_shared<PullMessage>();
    pull->job_id = "j";
    pull->worker_id = "w0";
    pull->step = 5;  // BSP would make a pull for step 5 wait
    pull->prefetch = true;
    pull->sparse.push_back({"emb", Payload(keys.data(), keys.size() * 8)});
    if (dense) pull->dense.push_back({"w", 0});
    absl::Notification done;
    absl::StatusOr<PullResult> result;
    job->Pull(pull, map, 0, absl::Now() + absl::Seconds(30), [&](absl::StatusOr<PullResult> res) {
      result = std::move(res);
      done.Notify();
    });
    REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
    return result;
  };
  absl::StatusOr<PullResult> got = hint(false);
  REQUIRE_OK(got.status());
  CHECK(got->sparse.empty());
  CHECK(got->dense.empty());
  REQUIRE_STATUS(hint(true).status(), absl::StatusCode::kInvalidArgument, "hints name sparse keys only");
}

TEST_CASE("unclocked rows (local steps' sparse tables) apply on arrival under BSP and count toward no step",
          "[bsp][job][local]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  const std::shared_ptr<Job> job = DenseAndSparseJob(&timer, *map);
  std::vector<uint64_t> keys = {7, 7, 9};
  std::vector<float> rows = {1, 1, 1, 1, 2, 2};  // key 7 twice: summed
  auto unclocked = [&](uint32_t rank, uint64_t seq) {
    PushMessage m = Header(rank, 5);
    m.seq = seq;
    m.unclocked = true;
    m.sparse.push_back({"emb", DType::kFp32, Payload(keys.data(), keys.size() * 8), Payload(rows.data(), rows.size() * 4)});
    return m;
  };
  // Rank 0's rows apply at once, though rank 1 has pushed no round.
  PushResult r;
  REQUIRE_OK(job->Push(unclocked(0, 100), *map, 0, &r));
  CHECK(r.applied_step == 0);
  // Read back unclocked, for a step BSP would make wait: served now.
  auto read = [&](bool unclocked_pull, uint64_t step) {
    auto pull = std::make_shared<PullMessage>();
    pull->job_id = "j";
    pull->worker_id = "w0";
    pull->step = step;
    pull->unclocked = unclocked_pull;
    pull->sparse.push_back({"emb", Payload(keys.data() + 1, 16)});
    absl::Notification done;
    absl::StatusOr<PullResult> result;
    job->Pull(pull, map, 0, absl::Now() + absl::Milliseconds(300), [&](absl::StatusOr<PullResult> res) {
      result = std::move(res);
      done.Notify();
    });
    REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    return result;
  };
  absl::StatusOr<PullResult> got = read(true, 1);
  REQUIRE_OK(got.status());
  std::vector<float> v(4);
  std::memcpy(v.data(), got->sparse[0].values.data.get(), 16);
  CHECK(v == std::vector<float>{-1, -1, -1, -1});  // key 7: -(1 + 1) x 0.5, key 9: -2 x 0.5
  // The same pull with the clock waits for step 0's rounds and times out.
  CHECK(read(false, 1).status().code() == absl::StatusCode::kDeadlineExceeded);
  // A retry is acknowledged, not applied again.
  REQUIRE_OK(job->Push(unclocked(0, 100), *map, 0, &r));
  CHECK(r.duplicate);
  // Rounds still need every rank: one dense round each, then step 0 applies.
  std::vector<float> g(4, 1.0f);
  REQUIRE_OK(job->Push(Push(0, 0, g), *map, 0, &r));
  CHECK(r.applied_step == 0);
  REQUIRE_OK(job->Push(Push(1, 0, g), *map, 0, &r));
  CHECK(r.applied_step == 1);
  const v1::GetJobResponse stats = job->Stats();
  CHECK(stats.unclocked_pushes() == 1);
  CHECK(stats.pushes_applied() == 3);
  // Dense tables go by rounds only.
  PushMessage dense = Push(0, 1, g);
  dense.unclocked = true;
  REQUIRE_STATUS(job->Push(dense, *map, 0, &r), absl::StatusCode::kInvalidArgument,
                 "unclocked push from worker 'w0' (rank 0) carries dense table 'w'");
  auto pull = std::make_shared<PullMessage>();
  pull->job_id = "j";
  pull->worker_id = "w0";
  pull->unclocked = true;
  pull->dense.push_back({"w", 0});
  absl::Status refused;
  job->Pull(pull, map, 0, absl::Now() + absl::Seconds(1), [&](absl::StatusOr<PullResult> res) { refused = res.status(); });
  REQUIRE_STATUS(refused, absl::StatusCode::kInvalidArgument, "unclocked pulls read sparse rows only");
}

TEST_CASE("a push's lr_scale multiplies the learning rate: alone under ASP, the ranks' mean under BSP",
          "[job][lr_scale]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  auto weights = [&](Job& job, uint64_t step) { return PullWeights(job, map, step, 1, 4); };
  std::vector<float> g(4, 1.0f);
  PushResult r;
  // ASP, SGD at lr 0.5: one push at lr_scale 4 moves each weight by -2.
  REQUIRE_OK_AND_ASSIGN(auto asp, Job::Create(JobSpec("j", {DenseTableSpec("w", 4, 0.5f)}, 1, v1::ConsistencySpec::ASP),
                                              4, 1 << 20, &timer));
  REQUIRE_OK(asp->MaterializeOwned(*map, 0));
  PushMessage m = Push(0, 0, g);
  m.lr_scale = 4.0f;
  REQUIRE_OK(asp->Push(m, *map, 0, &r));
  for (float x : weights(*asp, 1)) CHECK(x == -2.0f);
  // BSP, 2 ranks at lr_scale 1 and 3: the mean gradient 1 at lr 0.5 x 2.
  REQUIRE_OK_AND_ASSIGN(auto bsp, Job::Create(JobSpec("j", {DenseTableSpec("w", 4, 0.5f)}, 2), 4, 1 << 20, &timer));
  REQUIRE_OK(bsp->MaterializeOwned(*map, 0));
  PushMessage a = Push(0, 0, g), b = Push(1, 0, g);
  a.lr_scale = 1.0f;
  b.lr_scale = 3.0f;
  REQUIRE_OK(bsp->Push(a, *map, 0, &r));
  REQUIRE_OK(bsp->Push(b, *map, 0, &r));
  REQUIRE(r.applied_step == 1);
  for (float x : weights(*bsp, 1)) CHECK(x == -1.0f);
}

TEST_CASE("samples weigh pushes: a BSP step's ranks by their share, an ASP push against the mean per push",
          "[job][samples]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  auto weights = [&](Job& job, uint64_t step) { return PullWeights(job, map, step, 1, 4); };
  std::vector<float> one(4, 1.0f), three(4, 3.0f);
  PushResult r;
  // BSP, SGD at lr 0.5, 2 ranks: gradients 1 over 300 samples and 3 over
  // 100 average to 1.5, not 2.
  REQUIRE_OK_AND_ASSIGN(auto bsp, Job::Create(JobSpec("j", {DenseTableSpec("w", 4, 0.5f)}, 2), 4, 1 << 20, &timer));
  REQUIRE_OK(bsp->MaterializeOwned(*map, 0));
  PushMessage a = Push(0, 0, one), b = Push(1, 0, three);
  a.samples = 300;
  b.samples = 100;
  REQUIRE_OK(bsp->Push(a, *map, 0, &r));
  REQUIRE_OK(bsp->Push(b, *map, 0, &r));
  REQUIRE(r.applied_step == 1);
  for (float x : weights(*bsp, 1)) CHECK(x == -0.75f);
  // Equal samples, or a rank without them: the plain mean, 2.
  for (uint64_t other : {uint64_t{100}, uint64_t{0}}) {
    const uint64_t step = other == 0 ? 2 : 1;
    PushMessage c = Push(0, step, one), d = Push(1, step, three);
    c.seq = d.seq = 10 + step;
    c.samples = 100;
    d.samples = other;
    REQUIRE_OK(bsp->Push(c, *map, 0, &r));
    REQUIRE_OK(bsp->Push(d, *map, 0, &r));
    REQUIRE(r.applied_step == step + 1);
  }
  for (float x : weights(*bsp, 3)) CHECK(x == -2.75f);

  // ASP: the first push (100 samples) is the mean and moves by lr x g; the
  // second (300) is 1.5x the mean of 200; one without samples is plain.
  REQUIRE_OK_AND_ASSIGN(auto asp, Job::Create(JobSpec("j", {DenseTableSpec("w", 4, 0.5f)}, 1, v1::ConsistencySpec::ASP),
                                              4, 1 << 20, &timer));
  REQUIRE_OK(asp->MaterializeOwned(*map, 0));
  PushMessage p1 = Push(0, 0, one), p2 = Push(0, 1, one), p3 = Push(0, 2, one);
  p2.seq = 2;
  p3.seq = 3;
  p1.samples = 100;
  p2.samples = 300;
  REQUIRE_OK(asp->Push(p1, *map, 0, &r));
  for (float x : weights(*asp, 1)) CHECK(x == -0.5f);
  REQUIRE_OK(asp->Push(p2, *map, 0, &r));
  for (float x : weights(*asp, 2)) CHECK(x == -1.25f);
  REQUIRE_OK(asp->Push(p3, *map, 0, &r));
  for (float x : weights(*asp, 3)) CHECK(x == -1.75f);
}

TEST_CASE("staleness_aware_lr divides a push's rate by the updates applied since its pull, plus one",
          "[job][staleness]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  auto pull = [&](Job& job, uint32_t rank, uint64_t step) { return PullWeights(job, map, step, 1, 4, rank); };
  std::vector<float> g(4, 1.0f);
  PushResult r;
  for (auto model : {v1::ConsistencySpec::ASP, v1::ConsistencySpec::SSP}) {
    INFO("model " << v1::ConsistencySpec::Model_Name(model));
    v1::PsJobSpec spec = JobSpec("j", {DenseTableSpec("w", 4, 0.5f)}, 3, model, model == v1::ConsistencySpec::SSP ? 2 : 0);
    spec.mutable_consistency()->set_staleness_aware_lr(true);
    REQUIRE_OK_AND_ASSIGN(auto job, Job::Create(spec, 4, 1 << 20, &timer));
    REQUIRE_OK(job->MaterializeOwned(*map, 0));
    // All three ranks read step 0's weights (0); then they push in turn.
    for (uint32_t rank = 0; rank < 3; ++rank) pull(*job, rank, 0);
    REQUIRE_OK(job->Push(Push(0, 0, g), *map, 0, &r));  // fresh: -0.5
    REQUIRE_OK(job->Push(Push(1, 0, g), *map, 0, &r));  // 1 update since: -0.25
    REQUIRE_OK(job->Push(Push(2, 0, g), *map, 0, &r));  // 2 since: -0.5 / 3
    const float after0 = -0.5f - 0.25f - 0.5f / 3;
    // Rank 0 reads step 1 (all three applied), rank 1 pushes step 1 on its
    // step-0 read (it pulled none for step 1: 3 updates since, a quarter).
    for (float x : pull(*job, 0, 1)) CHECK(x == Approx(after0));
    PushMessage late = Push(1, 1, g);
    REQUIRE_OK(job->Push(late, *map, 0, &r));
    REQUIRE_OK(job->Push(Push(0, 1, g), *map, 0, &r));  // 1 since its read: -0.25
    for (float x : pull(*job, 2, 2)) CHECK(x == Approx(after0 - 0.125f - 0.25f));
    // A retried push is not applied again, whatever its staleness.
    REQUIRE_OK(job->Push(late, *map, 0, &r));
    CHECK(r.duplicate);
    for (float x : pull(*job, 2, 2)) CHECK(x == Approx(after0 - 0.125f - 0.25f));

    metrics::Scrape scrape;
    job->CollectMetrics(&scrape);
    bool seen = false;
    for (const auto& family : scrape.Take()) {
      if (family.name != "fulcrum_server_push_staleness_updates") continue;
      seen = true;
      REQUIRE(family.metric.size() == 1);
      CHECK(family.metric[0].histogram.sample_count == 5);
      CHECK(family.metric[0].histogram.sample_sum == Approx(1 + 2 + 3 + 4 + 2));
    }
    CHECK(seen);
  }
  // BSP gradients are never stale: the option is refused, naming it.
  v1::PsJobSpec bsp = JobSpec("j", {DenseTableSpec("w", 4)}, 2);
  bsp.mutable_consistency()->set_staleness_aware_lr(true);
  REQUIRE_STATUS(Job::Create(bsp, 4, 1 << 20, &timer).status(), absl::StatusCode::kInvalidArgument,
                 "staleness_aware_lr applies only to SSP and ASP");
}

TEST_CASE("BSP gradients buffered ahead count against the server's memory limit and the collected step always fits",
          "[bsp][job][quota]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  // 1024 weights under SGD (4 KiB), and room for three 4 KiB gradients.
  constexpr uint64_t kWeights = 4096;
  auto pool = std::make_shared<MemoryQuota>("", kWeights + 3 * 4096);
  REQUIRE_OK_AND_ASSIGN(auto job, Job::Create(JobSpec("j", {DenseTableSpec("w", 1024)}, 2), 4, 1 << 20, &timer, pool));
  REQUIRE_OK(job->MaterializeOwned(*map, 0));
  REQUIRE(pool->used() == kWeights);
  std::vector<float> g(1024, 1.0f);
  PushResult r;
  // Rank 0 runs three steps ahead of rank 1; the fourth does not fit.
  for (uint64_t step = 0; step < 3; ++step) REQUIRE_OK(job->Push(Push(0, step, g), *map, 0, &r));
  REQUIRE(pool->used() == kWeights + 3 * 4096);
  REQUIRE_STATUS(job->Push(Push(0, 3, g), *map, 0, &r), absl::StatusCode::kResourceExhausted,
                 "limit of 16384 bytes (--memory_limit_bytes) is reached: job 'j': step 3's gradients from worker 'w0' "
                 "(rank 0), buffered while step 0 is collected, needs 4096 bytes, 16384 already in use");
  // Rank 1's part of step 0 is counted past the limit rather than refused:
  // it completes the step, which frees both parts.
  REQUIRE_OK(job->Push(Push(1, 0, g), *map, 0, &r));
  REQUIRE(r.applied_step == 1);
  REQUIRE(pool->used() == kWeights + 2 * 4096);
  // The refused push, retried, now fits; rank 1 catches up and every
  // buffer is given back.
  REQUIRE_OK(job->Push(Push(0, 3, g), *map, 0, &r));
  for (uint64_t step = 1; step < 4; ++step) REQUIRE_OK(job->Push(Push(1, step, g), *map, 0, &r));
  REQUIRE(r.applied_step == 4);
  REQUIRE(pool->used() == kWeights);
  job.reset();
  REQUIRE(pool->used() == 0);
}

TEST_CASE("BSP sums a many-chunk step in rank order and applies its chunks in parallel", "[bsp][job]") {
  // 200,000 elements in 13 chunks: above the size from which a step's
  // chunks are applied on several threads. The first rank's buffer is the
  // accumulator, so a second step must not see the first step's sums.
  constexpr uint32_t kElements = 200000, kChunk = 16384, kRanks = 3;
  constexpr uint32_t kChunks = (kElements + kChunk - 1) / kChunk;
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  REQUIRE_OK_AND_ASSIGN(
      auto job, Job::Create(JobSpec("j", {DenseTableSpec("big", kElements, 1.0f, v1::OptimizerSpec::SGD, kChunk)},
                                    kRanks),
                            4, 64 << 20, &timer, nullptr, nullptr, std::make_shared<ParallelRunner>(3)));
  REQUIRE_OK(job->MaterializeOwned(*map, 0));
  auto grad = [](uint32_t rank, uint64_t step, uint32_t i) {
    return static_cast<float>((i * 7 + rank * 13 + step * 5) % 101) * 0.37f - 11.0f;
  };
  std::vector<float> expect(kElements, 0.0f);
  for (uint64_t step = 0; step < 2; ++step) {
    std::vector<std::vector<float>> g(kRanks, std::vector<float>(kElements));
    for (uint32_t r = 0; r < kRanks; ++r) {
      for (uint32_t i = 0; i < kElements; ++i) g[r][i] = grad(r, step, i);
    }
    for (uint32_t i = 0; i < kElements; ++i) {
      float sum = g[0][i];
      for (uint32_t r = 1; r < kRanks; ++r) sum += g[r][i];
      expect[i] -= sum * (1.0f / kRanks);
    }
    PushResult res;
    for (uint32_t r = 0; r < kRanks; ++r) {
      PushMessage m = Header(r, step);
      for (uint32_t c = 0; c < kChunks; ++c) {
        const uint32_t n = std::min(kChunk, kElements - c * kChunk);
        m.dense.push_back({"big", c, DType::kFp32, Payload(g[r].data() + size_t{c} * kChunk, n * 4)});
      }
      REQUIRE_OK(job->Push(m, *map, 0, &res));
    }
    REQUIRE(res.applied_step == step + 1);
  }
  auto pull = std::make_shared<PullMessage>();
  pull->job_id = "j";
  pull->worker_id = "w0";
  pull->step = 2;
  for (uint32_t c = 0; c < kChunks; ++c) pull->dense.push_back({"big", c});
  absl::Notification done;
  absl::StatusOr<PullResult> result;
  job->Pull(pull, map, 0, absl::Now() + absl::Seconds(30), [&](absl::StatusOr<PullResult> res) {
    result = std::move(res);
    done.Notify();
  });
  REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  REQUIRE_OK(result.status());
  REQUIRE(result->dense.size() == kChunks);
  std::vector<float> w(kElements);
  for (const PullResult::Dense& d : result->dense) {
    const size_t n = std::min(kChunk, kElements - d.chunk * kChunk);
    std::memcpy(w.data() + size_t{d.chunk} * kChunk, d.owner ? d.shared : d.data.data.get(), n * 4);
  }
  size_t mismatches = 0;
  for (uint32_t i = 0; i < kElements; ++i) mismatches += w[i] != expect[i];
  REQUIRE(mismatches == 0);
}

TEST_CASE("BSP: parts of a step from a lost incarnation are dropped when its replacement sends the step again",
          "[bsp][job]") {
  // Two chunks, pushed as two parts. Rank 0's first incarnation delivers
  // one part and dies; its replacement sends both. The step must apply
  // exactly what an undisturbed run applies.
  constexpr uint32_t kChunk = 256, kElements = 2 * kChunk;
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  auto make = [&] {
    auto job = Job::Create(JobSpec("j", {DenseTableSpec("w", kElements, 1.0f, v1::OptimizerSpec::SGD, kChunk)}, 2), 4,
                           1 << 20, &timer);
    REQUIRE_OK(job.status());
    REQUIRE_OK((*job)->MaterializeOwned(*map, 0));
    return std::move(*job);
  };
  std::vector<float> a(kChunk, 1.0f), b(kChunk, 2.0f), c(kElements, 4.0f);
  // Part `chunk` of rank 0's step 0, from `incarnation`.
  auto part = [&](uint32_t chunk, uint32_t incarnation) {
    PushMessage m = Header(0, 0);
    m.worker_id = "w0/i" + std::to_string(incarnation);
    m.seq = 10 * incarnation + chunk;
    m.incarnation = incarnation;
    m.num_parts = 2;
    m.dense.push_back({"w", chunk, DType::kFp32, Payload((chunk == 0 ? a : b).data(), kChunk * 4)});
    return m;
  };
  auto rank1 = [&] {
    PushMessage m = Header(1, 0);
    m.dense.push_back({"w", 0, DType::kFp32, Payload(c.data(), kChunk * 4)});
    m.dense.push_back({"w", 1, DType::kFp32, Payload(c.data() + kChunk, kChunk * 4)});
    return m;
  };
  auto weights = [&](Job& job) { return PullWeights(job, map, 1, 2, kChunk); };
  PushResult r;
  auto clean = make();
  REQUIRE_OK(clean->Push(part(0, 1), *map, 0, &r));
  REQUIRE_OK(clean->Push(part(1, 1), *map, 0, &r));
  REQUIRE_OK(clean->Push(rank1(), *map, 0, &r));
  REQUIRE(r.applied_step == 1);
  const std::vector<float> want = weights(*clean);

  auto disturbed = make();
  REQUIRE_OK(disturbed->Push(part(0, 1), *map, 0, &r));  // then incarnation 1 dies
  REQUIRE_OK(disturbed->Push(part(0, 2), *map, 0, &r));
  // A straggler of the dead incarnation, arriving late, is refused.
  REQUIRE_STATUS(disturbed->Push(part(1, 1), *map, 0, &r), absl::StatusCode::kFailedPrecondition,
                 "rank 0's incarnation 1, which incarnation 2 replaced");
  REQUIRE_OK(disturbed->Push(part(1, 2), *map, 0, &r));
  REQUIRE_OK(disturbed->Push(rank1(), *map, 0, &r));
  REQUIRE(r.applied_step == 1);
  CHECK(weights(*disturbed) == want);
}

TEST_CASE("pulls no worker could make are refused, and waiting pulls are bounded", "[job][limits]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  REQUIRE_OK_AND_ASSIGN(auto job, Job::Create(JobSpec("j", {DenseTableSpec("w", 4)}, 1), 4, 1 << 20, &timer));
  REQUIRE_OK(job->MaterializeOwned(*map, 0));
  auto pull_at = [&](uint64_t step, std::atomic<int>* answered, absl::Status* status) {
    auto pull = std::make_shared<PullMessage>();
    pull->job_id = "j";
    pull->worker_id = "w0";
    pull->step = step;
    job->Pull(pull, map, 0, absl::Now() + absl::Seconds(30), [answered, status](absl::StatusOr<PullResult> res) {
      if (status != nullptr) *status = res.status();
      answered->fetch_add(1);
    });
  };
  // BSP at step 0: a worker can be at most 16 pending steps (+1) ahead.
  std::atomic<int> answered{0};
  absl::Status far;
  pull_at(1000, &answered, &far);
  REQUIRE(answered == 1);
  REQUIRE(far.code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(far.message().find("pull for step 1000 by") != std::string::npos);
  REQUIRE(far.message().find("is beyond step 17") != std::string::npos);
  // Pulls for step 1 wait (step 0 is not complete); 16 per worker + 256 may.
  answered = 0;
  for (int i = 0; i < 16 + 256; ++i) pull_at(1, &answered, nullptr);
  REQUIRE(answered == 0);
  absl::Status over;
  std::atomic<int> one{0};
  pull_at(1, &one, &over);
  REQUIRE(one == 1);
  REQUIRE(over.code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(over.message().find("already has 272 pulls waiting; the limit is 272") != std::string::npos);
  // Completing step 0 answers every waiting pull.
  std::vector<float> g(4, 1.0f);
  PushResult r;
  REQUIRE_OK(job->Push(Push(0, 0, g), *map, 0, &r));
  for (int i = 0; i < 100 && answered < 272; ++i) absl::SleepFor(absl::Milliseconds(20));
  REQUIRE(answered == 272);
}

TEST_CASE("deleting a job fails its parked pulls", "[job]") {
  DeadlineTimer timer;
  auto map = std::make_shared<const ShardMap>(*ShardMap::FromServerList("self:1", 4));
  REQUIRE_OK_AND_ASSIGN(auto job, Job::Create(JobSpec("j", {DenseTableSpec("w", 4)}, 2), 4,
                                              1 << 20, &timer));
  auto pull = std::make_shared<PullMessage>();
  pull->job_id = "j";
  pull->worker_id = "w0";
  pull->step = 1;
  absl::Notification done;
  absl::Status status;
  job->Pull(pull, map, 0, absl::Now() + absl::Seconds(30), [&](absl::StatusOr<PullResult> res) {
    status = res.status();
    done.Notify();
  });
  job->Shutdown(absl::AbortedError("job 'j' was deleted"));
  REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  REQUIRE(status.code() == absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace fulcrum

namespace fulcrum {
namespace {

TEST_CASE("a weight snapshot being served is never changed by later updates", "[table]") {
  MemoryQuota quota("j", 1 << 20);
  auto table = DenseTable::Create(testing::DenseTableSpec("w", 8, 1.0f), &quota);
  REQUIRE_OK(table.status());
  DenseTable& t = **table;
  const std::vector<float> g(8, 1.0f);

  // No snapshot alive: updates happen in place (no copy of the block).
  const float* before;
  {
    REQUIRE_OK_AND_ASSIGN(auto s, t.Snapshot(0));
    before = s.get();
  }
  REQUIRE_OK(t.Apply(0, g.data(), 0));
  REQUIRE_OK_AND_ASSIGN(auto held, t.Snapshot(0));
  REQUIRE(held.get() == before);
  REQUIRE(held[0] == -1.0f);

  // A snapshot alive (a response gRPC has not sent yet): the update goes to a
  // copy and the snapshot keeps the values it was taken with.
  REQUIRE_OK(t.Apply(0, g.data(), 0));
  for (int i = 0; i < 8; ++i) REQUIRE(held[i] == -1.0f);
  REQUIRE_OK_AND_ASSIGN(auto now, t.Snapshot(0));
  REQUIRE(now.get() != held.get());
  for (int i = 0; i < 8; ++i) REQUIRE(now[i] == -2.0f);
}

TEST_CASE("updates flush denormal optimizer state to zero and restore the caller's float mode", "[table]") {
  // Adam's first moment decays by 0.9 per step: after one gradient of 1 and
  // 900 of 0 it would be 0.1 * 0.9^900 = 7e-43, a denormal that makes every
  // later update of the element take a microcode assist (common/float_env.h).
  MemoryQuota quota("j", 1 << 20);
  auto table = DenseTable::Create(testing::DenseTableSpec("w", 8, 0.001f, v1::OptimizerSpec::ADAM), &quota);
  REQUIRE_OK(table.status());
  DenseTable& t = **table;
  const bool caller_flushes = FlushingDenormals();
  const std::vector<float> one(8, 1.0f), zero(8, 0.0f);
  REQUIRE_OK(t.Apply(0, one.data(), 0));
  for (int i = 0; i < 900; ++i) REQUIRE_OK(t.Apply(0, zero.data(), 0));
  REQUIRE(FlushingDenormals() == caller_flushes);
  REQUIRE_OK_AND_ASSIGN(auto block, t.Snapshot(0));
  for (int i = 0; i < 8; ++i) {
    INFO("element " << i << ": w " << block[i] << " m " << block[8 + i] << " v " << block[16 + i]);
    REQUIRE(std::fpclassify(block[i]) == FP_NORMAL);
    REQUIRE(block[8 + i] == 0.0f);                        // m: flushed, not denormal
    REQUIRE(std::fpclassify(block[16 + i]) == FP_NORMAL);  // v = 1e-3 * 0.999^900: kept
  }
}

TEST_CASE("ScopedFlushDenormals sets flush-to-zero for its scope only", "[table]") {
#ifdef FULCRUM_HAS_MXCSR
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved & ~kFlushDenormalBits);
  REQUIRE_FALSE(FlushingDenormals());
  volatile float tiny = 1e-39f;  // a denormal: read as 0 under DAZ
  {
    ScopedFlushDenormals flush;
    REQUIRE(FlushingDenormals());
    REQUIRE(tiny * 1.0f == 0.0f);
  }
  REQUIRE_FALSE(FlushingDenormals());
  REQUIRE(tiny * 1.0f != 0.0f);
  _mm_setcsr(saved);
#else
  WARN("no MXCSR on this architecture: denormals are not flushed");
  REQUIRE_FALSE(FlushingDenormals());
#endif
}

}  // namespace
}  // namespace fulcrum
