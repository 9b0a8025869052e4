// End-to-end tests of fulcrum-server over gRPC on 127.0.0.1: several
// in-process servers per test, driven by the real GrpcPsClient and, for
// hostile input, by the protoc-generated stub.
#include <atomic>
#include <map>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>

#include "absl/synchronization/notification.h"
#include "common/errors.h"
#include "common/rpc/grpc_util.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

using testing::DensePush;
using testing::DenseTableSpec;
using testing::JobSpec;
using testing::OwnerOfChunk;
using testing::RawPush;
using testing::RawStub;
using testing::SparseTableSpec;
using testing::TestCluster;

// ------------------------------------------------------------------ BSP

// Runs `workers` workers for `steps` BSP steps; worker r's gradient for
// element i at step t is grad(r, t, i). Returns the final dense weights.
struct BspRun {
  std::vector<float> dense;
  std::vector<float> sparse;  // rows of keys {0, 1, 2, 100}
};

// What a coordinator's heartbeat admits: (job id, quota_bytes) pairs.
std::vector<v1::AdmittedJob> Admitted(const std::vector<std::pair<std::string, uint64_t>>& jobs) {
  std::vector<v1::AdmittedJob> out;
  for (const auto& [id, quota] : jobs) {
    out.emplace_back().set_job_id(id);
    out.back().set_quota_bytes(quota);
  }
  return out;
}

float Grad(uint32_t r, int t, size_t i) {
  // Non-dyadic values, so summation order shows in the bits.
  return 0.1f * static_cast<float>(r + 1) + 0.01f * static_cast<float>(t) +
         0.001f * static_cast<float>(i % 13);
}

BspRun RunBsp(TestCluster& cluster, const std::string& job, uint32_t workers, int steps,
              GrpcPsClientOptions base = {}, std::vector<uint32_t> push_order = {}) {
  constexpr size_t kDense = 1000;
  constexpr uint32_t kDim = 4;
  auto spec = JobSpec(job, {DenseTableSpec("w", kDense, 1.0f, v1::OptimizerSpec::SGD, 64),
                            SparseTableSpec("emb", kDim)},
                      workers);
  std::vector<std::unique_ptr<GrpcPsClient>> clients;
  for (uint32_t r = 0; r < workers; ++r) clients.push_back(cluster.Client(r, base));
  REQUIRE_OK(clients[0]->CreateJob(spec));
  for (uint32_t r = 1; r < workers; ++r) REQUIRE_OK(clients[r]->OpenJob(job));
  if (push_order.empty()) {
    push_order.resize(workers);
    std::iota(push_order.begin(), push_order.end(), 0);
  }
  for (int t = 0; t < steps; ++t) {
    // Every worker pulls step t (waits for step t-1 to apply), then the
    // pushes go out in the chosen order, each waiting for its answer.
    for (uint32_t r = 0; r < workers; ++r) {
      std::vector<float> w(kDense);
      REQUIRE_OK(clients[r]->Pull(job, {static_cast<uint64_t>(t), {{"w", w.data(), kDense}}, {}}));
    }
    for (uint32_t r : push_order) {
      std::vector<float> g(kDense);
      for (size_t i = 0; i < kDense; ++i) g[i] = Grad(r, t, i);
      std::vector<uint64_t> keys = {r, 100, 2};
      std::vector<float> sg(keys.size() * kDim);
      for (size_t i = 0; i < sg.size(); ++i) sg[i] = Grad(r, t, i);
      PushBatch b;
      b.step = static_cast<uint64_t>(t);
      b.dense.push_back({"w", g.data(), kDense});
      b.sparse.push_back({"emb", keys.data(), keys.size(), sg.data()});
      REQUIRE_OK(clients[r]->Push(job, b));
    }
  }
  BspRun out;
  out.dense.resize(kDense);
  std::vector<uint64_t> keys = {0, 1, 2, 100};
  out.sparse.resize(keys.size() * kDim);
  PullBatch final_pull{static_cast<uint64_t>(steps), {{"w", out.dense.data(), kDense}},
                       {{"emb", keys.data(), keys.size(), out.sparse.data()}}};
  REQUIRE_OK(clients[0]->Pull(job, final_pull));
  return out;
}

// The expected BSP result, computed the way the servers must: per step, sum
// the workers' gradients in rank order, scale by 1/n (MEAN), apply SGD at
// the step's rate (rates[t], or 1 without rates).
std::vector<float> ExpectedDense(uint32_t workers, int steps, size_t n, const std::vector<float>& rates = {}) {
  std::vector<float> w(n, 0.0f);
  const float scale = 1.0f / static_cast<float>(workers);
  for (int t = 0; t < steps; ++t) {
    const float lr = rates.empty() ? 1.0f : rates[t];
    for (size_t i = 0; i < n; ++i) {
      float acc = Grad(0, t, i);
      for (uint32_t r = 1; r < workers; ++r) acc += Grad(r, t, i);
      acc *= scale;
      w[i] -= lr * acc;
    }
  }
  return w;
}

testing::TestCluster::Options OneServerFourShards() {
  testing::TestCluster::Options o;
  o.num_servers = 1;
  o.num_virtual_shards = 4;
  return o;
}

TEST_CASE("BSP with SGD lr 1 yields exactly the expected weights", "[bsp]") {
  auto cluster = TestCluster::Start();
  BspRun run = RunBsp(*cluster, "exact", 3, 4);
  const std::vector<float> want = ExpectedDense(3, 4, run.dense.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("element " << i);
    REQUIRE(run.dense[i] == want[i]);  // bit-for-bit
  }
  // Sparse: key 100 gets every worker's row each step; key 0 only rank 0's;
  // key 1 only rank 1's; all contributions averaged over the 3 workers.
  const float scale = 1.0f / 3.0f;
  for (uint32_t j = 0; j < 4; ++j) {
    float k0 = 0, k1 = 0, k100 = 0;
    for (int t = 0; t < 4; ++t) {
      float a0 = Grad(0, t, j);
      a0 *= scale;
      k0 -= a0;
      float a1 = Grad(1, t, j);
      a1 *= scale;
      k1 -= a1;
      float a = Grad(0, t, 4 + j);
      a += Grad(1, t, 4 + j);
      a += Grad(2, t, 4 + j);
      a *= scale;
      k100 -= a;
    }
    REQUIRE(run.sparse[0 * 4 + j] == k0);
    REQUIRE(run.sparse[1 * 4 + j] == k1);
    REQUIRE(run.sparse[3 * 4 + j] == k100);
  }
}

TEST_CASE("a learning-rate schedule sets each step's rate on every server and table", "[bsp][asp][lr_schedule]") {
  auto cluster = TestCluster::Start();
  // Two warm-up steps, then halved every 2 steps: 0.5, 1, 1, 1, 0.5, 0.5.
  const std::vector<float> rates = {0.5f, 1.0f, 1.0f, 1.0f, 0.5f, 0.5f};
  auto scheduled = [](v1::TableSpec t) {
    auto* s = t.mutable_optimizer()->mutable_schedule();
    s->set_kind(v1::LearningRateSchedule::STEP);
    s->set_warmup_steps(2);
    s->set_decay_steps(2);
    s->set_gamma(0.5f);
    return t;
  };
  constexpr size_t kDense = 1000;  // 16 chunks of 64 over both servers
  constexpr uint32_t kDim = 4;
  SECTION("BSP: the job's global step, dense chunks and sparse rows") {
    const std::string job = "sched-bsp";
    auto a = cluster->Client(0);
    auto b = cluster->Client(1);
    REQUIRE_OK(a->CreateJob(JobSpec(job, {scheduled(DenseTableSpec("w", kDense, 1.0f, v1::OptimizerSpec::SGD, 64)),
                                          scheduled(SparseTableSpec("emb", kDim))}, 2)));
    REQUIRE_OK(b->OpenJob(job));
    for (int t = 0; t < static_cast<int>(rates.size()); ++t) {
      for (uint32_t r = 0; r < 2; ++r) {
        std::vector<float> g(kDense);
        for (size_t i = 0; i < kDense; ++i) g[i] = Grad(r, t, i);
        std::vector<uint64_t> keys = {7};
        std::vector<float> sg(kDim);
        for (uint32_t j = 0; j < kDim; ++j) sg[j] = Grad(r, t, j);
        PushBatch batch;
        batch.step = static_cast<uint64_t>(t);
        batch.dense.push_back({"w", g.data(), kDense});
        batch.sparse.push_back({"emb", keys.data(), keys.size(), sg.data()});
        REQUIRE_OK((r == 0 ? a : b)->Push(job, batch));
      }
    }
    const std::vector<float> want = ExpectedDense(2, static_cast<int>(rates.size()), kDense, rates);
    // The row's gradients are the dense ones' first kDim elements.
    const std::vector<float> want_row(want.begin(), want.begin() + kDim);
    std::vector<float> w(kDense), row(kDim);
    std::vector<uint64_t> keys = {7};
    REQUIRE_OK(a->Pull(job, {rates.size(), {{"w", w.data(), kDense}}, {{"emb", keys.data(), 1, row.data()}}}));
    for (size_t i = 0; i < kDense; ++i) {
      INFO("element " << i);
      REQUIRE(w[i] == want[i]);  // bit-for-bit
    }
    REQUIRE(row == want_row);
    // Without the schedule (every step at 1.0) the weights differ.
    REQUIRE(w[0] != Approx(ExpectedDense(2, static_cast<int>(rates.size()), kDense)[0]).epsilon(1e-3));
  }
  SECTION("ASP: each push at the rate of the step it carries") {
    const std::string job = "sched-asp";
    auto c = cluster->Client(0);
    REQUIRE_OK(c->CreateJob(JobSpec(job, {scheduled(DenseTableSpec("w", 8))}, 1, v1::ConsistencySpec::ASP)));
    std::vector<float> g(8, 1.0f), w(8);
    float want = 0;
    for (uint64_t t = 0; t < rates.size(); ++t) {
      REQUIRE_OK(c->Push(job, {t, {{"w", g.data(), 8}}, {}}));
      want -= rates[t];
      REQUIRE_OK(c->Pull(job, {t + 1, {{"w", w.data(), 8}}, {}}));
      INFO("after step " << t);
      for (float x : w) REQUIRE(x == want);
    }
    REQUIRE(want == -4.5f);
  }
}

TEST_CASE("BSP combines gradients in rank order whatever order they arrive in", "[bsp]") {
  auto cluster = TestCluster::Start();
  BspRun a = RunBsp(*cluster, "order-a", 3, 3, {}, {0, 1, 2});
  BspRun b = RunBsp(*cluster, "order-b", 3, 3, {}, {2, 0, 1});
  REQUIRE(a.dense == b.dense);
  REQUIRE(a.sparse == b.sparse);
  REQUIRE(a.dense == ExpectedDense(3, 3, a.dense.size()));
}

TEST_CASE("BSP over the bidirectional stream gives the same weights as unary calls", "[bsp][stream]") {
  auto cluster = TestCluster::Start();
  GrpcPsClientOptions stream;
  stream.transport = GrpcPsClientOptions::Transport::kStream;
  BspRun s = RunBsp(*cluster, "stream", 2, 3, stream);
  BspRun u = RunBsp(*cluster, "unary", 2, 3);
  REQUIRE(s.dense == u.dense);
  REQUIRE(s.sparse == u.sparse);
  REQUIRE(s.dense == ExpectedDense(2, 3, s.dense.size()));
}

TEST_CASE("a BSP pull waiting past its deadline names the missing workers", "[bsp][errors]") {
  auto cluster = TestCluster::Start();
  GrpcPsClientOptions opts;
  opts.pull_wait_timeout = absl::Milliseconds(300);
  auto c0 = cluster->Client(0, opts);
  REQUIRE_OK(c0->CreateJob(JobSpec("late", {DenseTableSpec("w", 8)}, 3)));
  std::vector<float> g(8, 1.0f), w(8);
  REQUIRE_OK(c0->Push("late", {0, {{"w", g.data(), 8}}, {}}));
  auto s = c0->Pull("late", {1, {{"w", w.data(), 8}}, {}});
  REQUIRE_STATUS(s, absl::StatusCode::kDeadlineExceeded, "step 0 waits for workers 1, 2");
}

// ------------------------------------------------------------------ SSP

TEST_CASE("a step pushed in groups completes when the announced total of parts arrived", "[bsp][groups]") {
  // One server, so every part goes to it; chunks of 4 elements.
  testing::TestCluster::Options one;
  one.num_servers = 1;
  auto cluster = TestCluster::Start(one);
  GrpcPsClientOptions opts;
  opts.pull_wait_timeout = absl::Milliseconds(200);
  auto c = cluster->Client(0, opts);
  REQUIRE_OK(c->CreateJob(JobSpec("groups", {DenseTableSpec("w", 8, 1.0f, v1::OptimizerSpec::SGD, 4)}, 1)));
  auto stub = RawStub(cluster->address(0));
  // Part 1 of step 0: "more follow".
  v1::PushRequest a = DensePush("groups", "w", 0, {1, 1, 1, 1}, 1);
  a.set_num_parts(0);
  a.set_more_parts(true);
  REQUIRE_OK(RawPush(stub.get(), a));
  std::vector<float> w(8);
  REQUIRE_STATUS(c->Pull("groups", {1, {{"w", w.data(), 8}}, {}}), absl::StatusCode::kDeadlineExceeded,
                 "step 0 waits for workers 0");
  // The last part carries the total: now step 0 applies, both chunks at once.
  v1::PushRequest b = DensePush("groups", "w", 1, {2, 2, 2, 2}, 2);
  b.set_num_parts(2);
  REQUIRE_OK(RawPush(stub.get(), b));
  REQUIRE_OK(c->Pull("groups", {1, {{"w", w.data(), 8}}, {}}));
  REQUIRE(w == std::vector<float>{-1, -1, -1, -1, -2, -2, -2, -2});
  // Step 1: the total arrives first, the "more follow" part after it.
  v1::PushRequest d = DensePush("groups", "w", 1, {1, 1, 1, 1}, 3, 1);
  d.set_num_parts(2);
  REQUIRE_OK(RawPush(stub.get(), d));
  v1::PushRequest e = DensePush("groups", "w", 0, {1, 1, 1, 1}, 4, 1);
  e.set_num_parts(0);
  e.set_more_parts(true);
  REQUIRE_OK(RawPush(stub.get(), e));
  REQUIRE_OK(c->Pull("groups", {2, {{"w", w.data(), 8}}, {}}));
  REQUIRE(w == std::vector<float>{-2, -2, -2, -2, -3, -3, -3, -3});
  // Step 2: a total that changes, and a part beyond the total, are refused.
  v1::PushRequest f = DensePush("groups", "w", 0, {1, 1, 1, 1}, 5, 2);
  f.set_num_parts(2);
  REQUIRE_OK(RawPush(stub.get(), f));
  v1::PushRequest g = DensePush("groups", "w", 1, {1, 1, 1, 1}, 6, 2);
  g.set_num_parts(3);
  REQUIRE_STATUS(RawPush(stub.get(), g), absl::StatusCode::kInvalidArgument, "announced 2 parts for step 2, then 3");
  g.set_num_parts(2);
  g.set_seq(7);
  REQUIRE_OK(RawPush(stub.get(), g));
  REQUIRE_OK(c->Pull("groups", {3, {{"w", w.data(), 8}}, {}}));
  REQUIRE(w == std::vector<float>{-3, -3, -3, -3, -4, -4, -4, -4});
  // A part after the step completed is acknowledged and not applied again.
  v1::PushRequest h = DensePush("groups", "w", 1, {1, 1, 1, 1}, 8, 2);
  h.set_num_parts(0);
  h.set_more_parts(true);
  v1::PushResponse hr;
  REQUIRE_OK(RawPush(stub.get(), h, &hr));
  REQUIRE(hr.duplicate());
  REQUIRE_OK(c->Pull("groups", {3, {{"w", w.data(), 8}}, {}}));
  REQUIRE(w == std::vector<float>{-3, -3, -3, -3, -4, -4, -4, -4});
  // "More follow" must not carry a count.
  h.set_step(3);
  h.set_seq(9);
  h.set_num_parts(1);
  REQUIRE_STATUS(RawPush(stub.get(), h), absl::StatusCode::kInvalidArgument, "must be 0 with more_parts");
}

TEST_CASE("the client's grouped pushes of a step equal one push of it", "[bsp][groups]") {
  auto cluster = TestCluster::Start();
  std::vector<std::unique_ptr<GrpcPsClient>> w;
  w.push_back(cluster->Client(0));
  w.push_back(cluster->Client(1));
  // Two tables of 3 chunks each over 2 servers; 2 workers' steps in groups
  // (table by table) and whole must give the same weights, exactly.
  for (const char* job : {"whole", "grouped"}) {
    auto spec = JobSpec(job, {DenseTableSpec("a", 12, 1.0f, v1::OptimizerSpec::SGD, 4),
                              DenseTableSpec("b", 12, 1.0f, v1::OptimizerSpec::SGD, 4)}, 2);
    REQUIRE_OK(w[0]->CreateJob(spec));
    REQUIRE_OK(w[1]->OpenJob(job));
  }
  std::vector<float> out(12);
  for (int t = 0; t < 3; ++t) {
    for (uint32_t r = 0; r < 2; ++r) {
      std::vector<float> ga(12), gb(12);
      for (size_t i = 0; i < 12; ++i) {
        ga[i] = Grad(r, t, i);
        gb[i] = Grad(r, t, i + 5);
      }
      REQUIRE_OK(w[r]->Push("whole", {static_cast<uint64_t>(t), {{"b", gb.data(), 12}, {"a", ga.data(), 12}}, {}}));
      PushBatch first{static_cast<uint64_t>(t), {{"b", gb.data(), 12}}, {}};
      first.last = false;
      REQUIRE_OK(w[r]->Push("grouped", first));
      if (r == 0) {
        // Worker 0's step is not complete until its last group: no server applies step t.
        REQUIRE(w[r]->GetJobStats("grouped", 0)->applied_step() == static_cast<uint64_t>(t));
      }
      REQUIRE_OK(w[r]->Push("grouped", {static_cast<uint64_t>(t), {{"a", ga.data(), 12}}, {}}));
    }
  }
  for (const char* table : {"a", "b"}) {
    std::vector<float> whole(12), grouped(12);
    REQUIRE_OK(w[0]->Pull("whole", {3, {{table, whole.data(), 12}}, {}}));
    REQUIRE_OK(w[0]->Pull("grouped", {3, {{table, grouped.data(), 12}}, {}}));
    REQUIRE(whole == grouped);
    REQUIRE(whole[0] != 0.0f);
  }
}

TEST_CASE("SSP: a fast worker blocks at the staleness bound and resumes", "[ssp]") {
  auto cluster = TestCluster::Start();
  auto fast = cluster->Client(0);
  auto slow = cluster->Client(1);
  REQUIRE_OK(fast->CreateJob(JobSpec("ssp", {DenseTableSpec("w", 16)}, 2, v1::ConsistencySpec::SSP, 1)));
  REQUIRE_OK(slow->OpenJob("ssp"));
  std::vector<float> g(16, 1.0f), w(16);
  // The fast worker runs steps 0 and 1; with bound 1 it may start step 1
  // while the slow one is at clock 0, but not step 2.
  REQUIRE_OK(fast->Pull("ssp", {0, {{"w", w.data(), 16}}, {}}));
  REQUIRE_OK(fast->Push("ssp", {0, {{"w", g.data(), 16}}, {}}));
  REQUIRE_OK(fast->Pull("ssp", {1, {{"w", w.data(), 16}}, {}}));
  REQUIRE_OK(fast->Push("ssp", {1, {{"w", g.data(), 16}}, {}}));
  auto blocked = fast->PullAsync("ssp", {2, {{"w", w.data(), 16}}, {}});
  REQUIRE_FALSE(blocked.WaitFor(absl::Milliseconds(300)));
  // The slow worker finishes step 0: clock 1 >= 2 - 1, so the fast one resumes.
  REQUIRE_OK(slow->Push("ssp", {0, {{"w", g.data(), 16}}, {}}));
  REQUIRE(blocked.WaitFor(absl::Seconds(10)));
  REQUIRE_OK(blocked.Wait());
  // SSP applies pushes on arrival: 3 pushes of 1 with lr 1.
  for (float x : w) REQUIRE(x == -3.0f);
}

TEST_CASE("SSP: a step a lost worker completed on a server is not applied again", "[ssp]") {
  {
    const std::string job = "ssp-dup";
    auto cluster = TestCluster::Start();
    // Chunks of 4 over 2 servers: every step reaches both.
    GrpcPsClientOptions lost_opts;
    lost_opts.worker_id = "lost";
    auto lost = cluster->Client(0, lost_opts);
    REQUIRE_OK(lost->CreateJob(
        JobSpec(job, {DenseTableSpec("w", 16, 1.0f, v1::OptimizerSpec::SGD, 4)}, 1, v1::ConsistencySpec::SSP, 1)));
    std::vector<float> g(16, 1.0f), w(16);
    REQUIRE_OK(lost->Push(job, {0, {{"w", g.data(), 16}}, {}}));
    REQUIRE_OK(lost->Push(job, {1, {{"w", g.data(), 16}}, {}}));
    for (size_t s = 0; s < 2; ++s) REQUIRE(lost->GetJobStats(job, s)->rank_clock(0) == 2);
    // The replacement (another worker id, so no request-id dedup) pushes step 1 again.
    GrpcPsClientOptions next_opts;
    next_opts.worker_id = "replacement";
    auto next = cluster->Client(0, next_opts);
    REQUIRE_OK(next->OpenJob(job));
    REQUIRE_OK(next->Push(job, {1, {{"w", g.data(), 16}}, {}}));
    REQUIRE_OK(next->Push(job, {2, {{"w", g.data(), 16}}, {}}));
    REQUIRE_OK(next->Pull(job, {3, {{"w", w.data(), 16}}, {}}));
    for (float x : w) REQUIRE(x == -3.0f);  // steps 0, 1, 2 once each
    uint64_t dups = 0;
    for (size_t s = 0; s < 2; ++s) dups += next->GetJobStats(job, s)->duplicate_pushes();
    REQUIRE(dups >= 2);  // step 1's part on each server
  }
}

TEST_CASE("ASP: a server with no part of a step still advances the rank's clock", "[asp]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0);
  // One small dense table lives on one server; the other hears nothing but
  // the step's empty part.
  REQUIRE_OK(c->CreateJob(JobSpec("asp-clock", {DenseTableSpec("w", 4)}, 1, v1::ConsistencySpec::ASP)));
  std::vector<float> g(4, 1.0f);
  for (uint64_t t = 0; t < 5; ++t) REQUIRE_OK(c->Push("asp-clock", {t, {{"w", g.data(), 4}}, {}}));
  for (size_t s = 0; s < 2; ++s) {
    INFO("server " << s);
    REQUIRE(c->GetJobStats("asp-clock", s)->rank_clock(0) == 5);
  }
}

// ------------------------------------------------------------------ ASP, concurrency

TEST_CASE("16 client threads x 1000 pushes to shared keys lose no update", "[asp][concurrency]") {
  auto cluster = TestCluster::Start();
  constexpr int kThreads = 16, kPushes = 1000;
  auto admin = cluster->Client(0);
  REQUIRE_OK(admin->CreateJob(JobSpec("conc", {DenseTableSpec("w", 64, 1.0f, v1::OptimizerSpec::SGD, 16),
                                               SparseTableSpec("emb", 8)},
                                      kThreads, v1::ConsistencySpec::ASP)));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      GrpcPsClientOptions o;
      o.channels_per_server = 1;
      auto c = cluster->Client(static_cast<uint32_t>(t), o);
      if (!c->OpenJob("conc").ok()) { ++failures; return; }
      std::vector<float> g(64, 1.0f), sg(16, 1.0f);
      std::vector<uint64_t> keys = {42, static_cast<uint64_t>(1000 + t)};
      for (int i = 0; i < kPushes; ++i) {
        PushBatch b;
        b.step = static_cast<uint64_t>(i);
        b.dense.push_back({"w", g.data(), 64});
        b.sparse.push_back({"emb", keys.data(), 2, sg.data()});
        if (!c->Push("conc", b).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  REQUIRE(failures == 0);
  std::vector<float> w(64), rows(2 * 8);
  std::vector<uint64_t> keys = {42, 1003};
  REQUIRE_OK(admin->Pull("conc", {0, {{"w", w.data(), 64}}, {{"emb", keys.data(), 2, rows.data()}}}));
  for (float x : w) REQUIRE(x == -static_cast<float>(kThreads * kPushes));
  for (int j = 0; j < 8; ++j) {
    REQUIRE(rows[j] == -static_cast<float>(kThreads * kPushes));
    REQUIRE(rows[8 + j] == -static_cast<float>(kPushes));
  }
}

// ------------------------------------------------------------------ dedup

TEST_CASE("a replayed push is applied once", "[dedup]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(JobSpec("dup", {DenseTableSpec("w", 8)}, 1, v1::ConsistencySpec::ASP)));
  const uint32_t owner = OwnerOfChunk(*cluster, "w", 0);
  auto stub = RawStub(cluster->address(owner));
  v1::PushRequest req = DensePush("dup", "w", 0, std::vector<float>(8, 2.0f), 77);
  req.set_shard_map_version(cluster->shard_map().version());
  v1::PushResponse first, second;
  REQUIRE_OK(RawPush(stub.get(), req, &first));
  REQUIRE_OK(RawPush(stub.get(), req, &second));  // e.g. a retry after a lost response
  REQUIRE_FALSE(first.duplicate());
  REQUIRE(second.duplicate());
  std::vector<float> w(8);
  REQUIRE_OK(c->Pull("dup", {0, {{"w", w.data(), 8}}, {}}));
  for (float x : w) REQUIRE(x == -2.0f);
  REQUIRE_OK_AND_ASSIGN(auto stats, c->GetJobStats("dup", owner));
  REQUIRE(stats.duplicate_pushes() == 1);
  // A new sequence number is a new push.
  req.set_seq(78);
  REQUIRE_OK(RawPush(stub.get(), req));
  REQUIRE_OK(c->Pull("dup", {0, {{"w", w.data(), 8}}, {}}));
  for (float x : w) REQUIRE(x == -4.0f);
}

// ------------------------------------------------------------------ initializers

TEST_CASE("sparse pull creates rows with the table initializer", "[sparse]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0);
  auto uniform = SparseTableSpec("emb", 16);
  uniform.mutable_initializer()->set_kind(v1::InitializerSpec::UNIFORM);
  uniform.mutable_initializer()->set_a(-0.5f);
  uniform.mutable_initializer()->set_b(0.5f);
  uniform.mutable_initializer()->set_seed(1234);
  auto zeros = SparseTableSpec("zero", 16);
  REQUIRE_OK(c->CreateJob(JobSpec("init", {uniform, zeros}, 1, v1::ConsistencySpec::ASP)));
  uniform.mutable_initializer()->set_seed(99);
  REQUIRE_OK(c->CreateJob(JobSpec("init2", {uniform}, 1, v1::ConsistencySpec::ASP)));
  std::vector<uint64_t> keys(200);
  std::iota(keys.begin(), keys.end(), 5);
  std::vector<float> a(200 * 16), again(200 * 16), z(200 * 16, 1.0f), other(200 * 16);
  REQUIRE_OK(c->Pull("init", {0, {}, {{"emb", keys.data(), 200, a.data()}, {"zero", keys.data(), 200, z.data()}}}));
  REQUIRE_OK(c->Pull("init", {0, {}, {{"emb", keys.data(), 200, again.data()}}}));
  REQUIRE_OK(c->Pull("init2", {0, {}, {{"emb", keys.data(), 200, other.data()}}}));
  double mean = 0;
  for (float x : a) {
    REQUIRE(x >= -0.5f);
    REQUIRE(x < 0.5f);
    mean += x;
  }
  REQUIRE(std::fabs(mean / a.size()) < 0.05);
  REQUIRE(a == again);   // created once, then read back
  REQUIRE(a != other);   // a different seed gives different rows
  for (float x : z) REQUIRE(x == 0.0f);
  REQUIRE_OK_AND_ASSIGN(auto s0, c->GetJobStats("init", 0));
  REQUIRE_OK_AND_ASSIGN(auto s1, c->GetJobStats("init", 1));
  REQUIRE(s0.sparse_rows() + s1.sparse_rows() == 400);
}

TEST_CASE("dense initial values do not depend on placement", "[dense]") {
  auto two = TestCluster::Start();
  TestCluster::Options one_opts;
  one_opts.num_servers = 1;
  auto one = TestCluster::Start(one_opts);
  auto spec = DenseTableSpec("w", 3000, 1.0f, v1::OptimizerSpec::SGD, 100);
  spec.mutable_initializer()->set_kind(v1::InitializerSpec::NORMAL);
  spec.mutable_initializer()->set_b(0.1f);
  spec.mutable_initializer()->set_seed(5);
  std::vector<float> a(3000), b(3000);
  auto ca = two->Client(0);
  auto cb = one->Client(0);
  REQUIRE_OK(ca->CreateJob(JobSpec("n", {spec}, 1)));
  REQUIRE_OK(cb->CreateJob(JobSpec("n", {spec}, 1)));
  REQUIRE_OK(ca->Pull("n", {0, {{"w", a.data(), 3000}}, {}}));
  REQUIRE_OK(cb->Pull("n", {0, {{"w", b.data(), 3000}}, {}}));
  REQUIRE(a == b);
  double var = 0;
  for (float x : a) var += double{x} * x;
  REQUIRE(std::sqrt(var / a.size()) == Approx(0.1).epsilon(0.1));
}

// ------------------------------------------------------------------ errors

TEST_CASE("an unknown job is NOT_FOUND", "[errors]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0);
  const absl::Status open = c->OpenJob("nope");
  REQUIRE_STATUS(open, absl::StatusCode::kNotFound, "job 'nope'");
  auto stub = RawStub(cluster->address(0));
  const absl::Status push = RawPush(stub.get(), DensePush("nope", "w", 0, {1.0f}, 1));
  REQUIRE_STATUS(push, absl::StatusCode::kNotFound, "job 'nope' is not on this server");
  // Workers tell this answer apart (a restarted server: "ServerLost"),
  // also with the client's context in front, from any other NOT_FOUND.
  CHECK(IsJobNotOnServer(push));
  CHECK(IsJobNotOnServer(Annotate(push, "pull from 127.0.0.1:1")));
  CHECK_FALSE(IsJobNotOnServer(absl::NotFoundError("no table 'w' in job 'nope'")));
  CHECK_FALSE(IsJobNotOnServer(absl::AbortedError("job 'nope' is not on this server")));
}

TEST_CASE("wrong dtype, shape, dim and key count are INVALID_ARGUMENT naming the table", "[errors]") {
  auto cluster = TestCluster::Start(OneServerFourShards());
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(JobSpec("bad", {DenseTableSpec("w", 10), SparseTableSpec("emb", 4)}, 1,
                                  v1::ConsistencySpec::ASP)));
  auto stub = RawStub(cluster->address(0));

  v1::PushRequest dtype = DensePush("bad", "w", 0, std::vector<float>(10, 1.0f), 1);
  dtype.mutable_dense(0)->set_dtype(static_cast<v1::DType>(7));
  REQUIRE_STATUS(RawPush(stub.get(), dtype), absl::StatusCode::kInvalidArgument, "dtype 7");

  REQUIRE_STATUS(RawPush(stub.get(), DensePush("bad", "w", 0, std::vector<float>(9, 1.0f), 2)),
                 absl::StatusCode::kInvalidArgument,
                 "table 'w' chunk 0 expects 10 fp32 elements (40 bytes), got 36 bytes");
  REQUIRE_STATUS(RawPush(stub.get(), DensePush("bad", "w", 3, std::vector<float>(10, 1.0f), 3)),
                 absl::StatusCode::kInvalidArgument, "table 'w' has 1 chunks; push names chunk 3");
  REQUIRE_STATUS(RawPush(stub.get(), DensePush("bad", "nope", 0, {1.0f}, 4)),
                 absl::StatusCode::kInvalidArgument, "has no table 'nope'");

  v1::PushRequest dim;
  dim.set_job_id("bad");
  dim.set_worker_id("raw");
  dim.set_seq(5);
  auto* s = dim.add_sparse();
  s->set_table("emb");
  s->set_dtype(v1::DTYPE_FP32);
  const uint64_t keys[2] = {1, 2};
  s->set_keys(std::string(reinterpret_cast<const char*>(keys), 16));
  s->set_values(std::string(2 * 3 * 4, '\0'));  // dim 3 instead of 4
  REQUIRE_STATUS(RawPush(stub.get(), dim), absl::StatusCode::kInvalidArgument,
                 "table 'emb' expects dim 4: 2 keys need 32 bytes of fp32 values, got 24");
  s->set_keys(std::string(reinterpret_cast<const char*>(keys), 12));
  REQUIRE_STATUS(RawPush(stub.get(), dim), absl::StatusCode::kInvalidArgument,
                 "keys field has 12 bytes, not a multiple of 8");

  std::vector<float> small(9), w(10);
  REQUIRE_STATUS(c->Push("bad", {0, {{"w", small.data(), 9}}, {}}),
                 absl::StatusCode::kInvalidArgument, "table 'w' has 10 elements; gradient has 9");
  REQUIRE_STATUS(c->Pull("bad", {0, {{"emb", w.data(), 10}}, {}}),
                 absl::StatusCode::kInvalidArgument, "no dense table 'emb'");
  // Nothing above changed the weights.
  REQUIRE_OK(c->Pull("bad", {0, {{"w", w.data(), 10}}, {}}));
  for (float x : w) REQUIRE(x == 0.0f);
}

TEST_CASE("a NaN or Inf gradient is rejected, counted and never applied", "[errors]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(JobSpec("nan", {DenseTableSpec("w", 100, 1.0f, v1::OptimizerSpec::SGD, 10)}, 1,
                                  v1::ConsistencySpec::ASP)));
  std::vector<float> g(100, 1.0f), w(100);
  g[57] = std::nanf("");
  REQUIRE_STATUS(c->Push("nan", {0, {{"w", g.data(), 100}}, {}}), absl::StatusCode::kInvalidArgument,
                 "table 'w' chunk 5 from worker 'worker-0' (rank 0) at step 0 contains NaN or Inf");
  g[57] = INFINITY;
  REQUIRE_FALSE(c->Push("nan", {0, {{"w", g.data(), 100}}, {}}).ok());
  REQUIRE_OK(c->Pull("nan", {0, {{"w", w.data(), 100}}, {}}));
  // The chunk holding the NaN was refused whole; other chunks went to their
  // servers in separate messages and each message is judged alone.
  for (size_t i = 50; i < 60; ++i) REQUIRE(w[i] == 0.0f);
  uint64_t rejected = 0;
  for (size_t s = 0; s < cluster->size(); ++s) {
    REQUIRE_OK_AND_ASSIGN(auto stats, c->GetJobStats("nan", s));
    rejected += stats.rejected_nonfinite();
  }
  REQUIRE(rejected == 2);
}

TEST_CASE("exceeding the job's memory quota is RESOURCE_EXHAUSTED, not a crash", "[errors][quota]") {
  auto cluster = TestCluster::Start(OneServerFourShards());
  auto c = cluster->Client(0);
  auto big = JobSpec("huge", {DenseTableSpec("w", 1'000'000, 0.1f, v1::OptimizerSpec::ADAM)}, 1);
  big.set_quota_bytes(1 << 20);
  REQUIRE_STATUS(c->CreateJob(big), absl::StatusCode::kResourceExhausted,
                 "job 'huge' would exceed its parameter memory quota of 1048576 bytes");
  // Sparse rows count what they hold: blocks of rows and each virtual
  // shard's index. A job whose quota is what 10 rows of dim 8 took takes
  // further rows until one needs a new block or a larger index.
  auto probe = JobSpec("probe", {SparseTableSpec("emb", 8)}, 1, v1::ConsistencySpec::ASP);
  REQUIRE_OK(c->CreateJob(probe));
  std::vector<uint64_t> keys(10);
  std::iota(keys.begin(), keys.end(), 0);
  std::vector<float> rows(11 * 8);
  REQUIRE_OK(c->Pull("probe", {0, {}, {{"emb", keys.data(), 10, rows.data()}}}));
  auto probe_stats = c->GetJobStats("probe", 0);
  REQUIRE_OK(probe_stats.status());
  const uint64_t ten_rows = probe_stats->bytes_used();
  CHECK(ten_rows > 10 * 32);  // more than the rows' floats
  REQUIRE_OK(c->DeleteJob("probe"));
  auto sparse = JobSpec("rows", {SparseTableSpec("emb", 8)}, 1, v1::ConsistencySpec::ASP);
  sparse.set_quota_bytes(ten_rows);
  REQUIRE_OK(c->CreateJob(sparse));
  REQUIRE_OK(c->Pull("rows", {0, {}, {{"emb", keys.data(), 10, rows.data()}}}));
  absl::Status full;
  uint64_t refused = 0;
  for (uint64_t k = 1000; k < 1100 && full.ok(); ++k) {
    full = c->Pull("rows", {0, {}, {{"emb", &k, 1, rows.data()}}});
    refused = k;
  }
  REQUIRE_STATUS(full, absl::StatusCode::kResourceExhausted, "a new row of table 'emb'");
  // What a worker reports as QuotaExceeded (no rollback cures it).
  CHECK(IsParameterMemoryExhausted(full));
  CHECK_FALSE(IsParameterMemoryExhausted(absl::ResourceExhaustedError("the pull pool is full")));
  // The existing rows still serve.
  REQUIRE_OK(c->Pull("rows", {0, {}, {{"emb", keys.data(), 10, rows.data()}}}));

  // A push touching existing rows and a row that does not fit fails whole:
  // nothing is applied, not even to the rows that exist.
  std::vector<uint64_t> mixed = {0, 1, 2, refused};
  std::vector<float> grads(mixed.size() * 8, 1.0f);
  REQUIRE_STATUS(c->Push("rows", {0, {}, {{"emb", mixed.data(), mixed.size(), grads.data()}}}),
                 absl::StatusCode::kResourceExhausted, "quota");
  REQUIRE_OK(c->Pull("rows", {0, {}, {{"emb", keys.data(), 10, rows.data()}}}));
  for (size_t i = 0; i < 10 * 8; ++i) REQUIRE(rows[i] == 0.0f);
}

TEST_CASE("jobs whose quotas add up to more than the server's memory limit are RESOURCE_EXHAUSTED", "[errors][quota]") {
  // Each job's own quota (8 GiB by default, or whatever its spec names) is
  // a cap; the server's limit is what all jobs share.
  testing::TestCluster::Options o = OneServerFourShards();
  o.memory_limit_bytes = 3 << 20;
  auto cluster = TestCluster::Start(o);
  ParameterServer* ps = cluster->server(0);
  REQUIRE(ps->memory_limit_bytes() == 3u << 20);
  auto c = cluster->Client(0);
  // 1.92 MB of weights and Adam state fit; a second such job does not.
  constexpr uint64_t kJobBytes = 160000 * 3 * 4;
  auto Spec = [](const std::string& id, uint64_t quota = 3 << 20) {
    auto s = JobSpec(id, {DenseTableSpec("w", 160000, 0.1f, v1::OptimizerSpec::ADAM)}, 1);
    s.set_quota_bytes(quota);
    return s;
  };
  // A quota beyond what the server has is refused outright.
  REQUIRE_STATUS(c->CreateJob(Spec("a", uint64_t{1} << 40)), absl::StatusCode::kInvalidArgument,
                 "job 'a': quota_bytes 1099511627776 exceeds this server's memory limit of 3145728 bytes");
  REQUIRE(ps->GetJob("a").status().code() == absl::StatusCode::kNotFound);
  REQUIRE_OK(c->CreateJob(Spec("a")));
  REQUIRE(ps->memory_used_bytes() == kJobBytes);
  REQUIRE_STATUS(c->CreateJob(Spec("b")), absl::StatusCode::kResourceExhausted,
                 "this server's parameter memory limit of 3145728 bytes (--memory_limit_bytes) is reached: "
                 "job 'b': ");
  CHECK(IsParameterMemoryExhausted(c->CreateJob(Spec("b"))));
  REQUIRE(ps->GetJob("b").status().code() == absl::StatusCode::kNotFound);
  REQUIRE(ps->memory_used_bytes() == kJobBytes);  // the failed job gave back what it took
  // Sparse rows draw from the same limit: 400 rows of 4 KiB do not fit in
  // the 1.2 MB left.
  REQUIRE_OK(c->CreateJob(JobSpec("rows", {SparseTableSpec("emb", 1024)}, 1, v1::ConsistencySpec::ASP)));
  std::vector<uint64_t> keys(400);
  std::iota(keys.begin(), keys.end(), 0);
  std::vector<float> out(keys.size() * 1024);
  REQUIRE_STATUS(c->Pull("rows", {0, {}, {{"emb", keys.data(), keys.size(), out.data()}}}),
                 absl::StatusCode::kResourceExhausted, "job 'rows': a new row of table 'emb'");
  // Deleting jobs gives their memory back to every other job.
  REQUIRE_OK(c->DeleteJob("rows"));
  REQUIRE_OK(c->DeleteJob("a"));
  REQUIRE(ps->memory_used_bytes() == 0);
  REQUIRE_OK(c->CreateJob(Spec("b")));
  // The server reports both figures to Prometheus.
  metrics::Scrape scrape;
  ps->CollectMetrics(&scrape);
  std::map<std::string, double> gauges;
  for (const prometheus::MetricFamily& f : scrape.Take()) {
    if (f.metric.size() == 1) gauges[f.name] = f.metric[0].gauge.value;
  }
  CHECK(gauges["fulcrum_server_memory_limit_bytes"] == 3145728.0);
  CHECK(gauges["fulcrum_server_memory_used_bytes"] == static_cast<double>(kJobBytes));
}

TEST_CASE("with a coordinator, a server creates only the jobs it admits and drops the others after a grace period",
          "[errors][quota]") {
  auto map = ShardMap::RoundRobin(1, 4, {"in-process"});
  REQUIRE_OK(map.status());
  ParameterServerOptions o;
  o.shard_map = map->ToProto();
  o.require_admission = true;
  o.unadmitted_grace = absl::Seconds(60);
  REQUIRE_OK_AND_ASSIGN(std::unique_ptr<ParameterServer> ps, ParameterServer::Create(std::move(o)));
  auto spec = JobSpec("train-1", {DenseTableSpec("w", 1000, 0.1f, v1::OptimizerSpec::SGD)}, 1);
  // Not admitted (yet): a worker retries UNAVAILABLE until its server hears.
  REQUIRE_STATUS(ps->CreateJob(spec).status(), absl::StatusCode::kUnavailable,
                 "job 'train-1' is not admitted by the coordinator (yet)");
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  CHECK(ps->SetAdmittedJobs(Admitted({{"train-1", 0}}), t0).empty());
  REQUIRE_OK(ps->CreateJob(spec).status());
  // Another quota than the coordinator granted.
  auto greedy = spec;
  greedy.set_job_id("train-2");
  greedy.set_quota_bytes(1 << 20);
  CHECK(ps->SetAdmittedJobs(Admitted({{"train-1", 0}, {"train-2", 0}}), t0).empty());
  REQUIRE_STATUS(ps->CreateJob(greedy).status(), absl::StatusCode::kPermissionDenied,
                 "job 'train-2' asks for quota_bytes 1048576; the coordinator granted 0");
  // The coordinator stops listing train-1 (it ended, or never ran): the job
  // stays through the grace period, then goes.
  CHECK(ps->SetAdmittedJobs({}, t0 + absl::Seconds(1)).empty());
  CHECK(ps->SetAdmittedJobs({}, t0 + absl::Seconds(59)).empty());
  REQUIRE_OK(ps->GetJob("train-1").status());
  // Listed again within the grace period: the clock starts over.
  CHECK(ps->SetAdmittedJobs(Admitted({{"train-1", 0}}), t0 + absl::Seconds(60)).empty());
  CHECK(ps->SetAdmittedJobs({}, t0 + absl::Seconds(61)).empty());
  CHECK(ps->SetAdmittedJobs({}, t0 + absl::Seconds(120)).empty());
  REQUIRE_OK(ps->GetJob("train-1").status());
  const std::vector<std::string> dropped = ps->SetAdmittedJobs({}, t0 + absl::Seconds(121));
  CHECK(dropped == std::vector<std::string>{"train-1"});
  REQUIRE(ps->GetJob("train-1").status().code() == absl::StatusCode::kNotFound);
  CHECK(ps->memory_used_bytes() == 0);
}

TEST_CASE("servers sharing a host divide its default memory limit", "[errors][quota]") {
  auto make = [](uint32_t per_host) {
    auto map = ShardMap::RoundRobin(1, 4, {"in-process"});
    REQUIRE_OK(map.status());
    ParameterServerOptions o;
    o.shard_map = map->ToProto();
    o.servers_per_host = per_host;
    auto ps = ParameterServer::Create(std::move(o));
    REQUIRE_OK(ps.status());
    return (*ps)->memory_limit_bytes();
  };
  const uint64_t one = make(1), two = make(2);
  CHECK(two == one / 2);
}

TEST_CASE("deleting a job frees its tables", "[errors][quota]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(JobSpec("gone", {DenseTableSpec("w", 100000, 0.1f, v1::OptimizerSpec::ADAM)}, 1)));
  REQUIRE_OK_AND_ASSIGN(auto s0, c->GetJobStats("gone", 0));
  REQUIRE_OK_AND_ASSIGN(auto s1, c->GetJobStats("gone", 1));
  REQUIRE(s0.bytes_used() + s1.bytes_used() == 100000 * 3 * 4);  // weights + Adam's m and v
  REQUIRE_OK(c->DeleteJob("gone"));
  REQUIRE(c->GetJobStats("gone", 0).status().code() == absl::StatusCode::kNotFound);
  std::vector<float> w(100000);
  REQUIRE(c->Pull("gone", {0, {{"w", w.data(), 100000}}, {}}).code() == absl::StatusCode::kFailedPrecondition);
  // The same id can be created again, from scratch.
  REQUIRE_OK(c->CreateJob(JobSpec("gone", {DenseTableSpec("w", 10)}, 1)));
}

TEST_CASE("bad job specs are rejected naming the field", "[errors]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0);
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 10)}, 0)),
                 absl::StatusCode::kInvalidArgument, "num_workers 0");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", -3)}, 1)),
                 absl::StatusCode::kInvalidArgument, "shape[0] = -3");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 3), DenseTableSpec("w", 4)}, 1)),
                 absl::StatusCode::kInvalidArgument, "declares table 'w' twice");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {SparseTableSpec("e", 0)}, 1)),
                 absl::StatusCode::kInvalidArgument, "dim 0");
  REQUIRE_STATUS(c->CreateJob(JobSpec("bad id!", {DenseTableSpec("w", 3)}, 1)),
                 absl::StatusCode::kInvalidArgument, "job_id 'bad id!'");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 3)}, 1, v1::ConsistencySpec::BSP, 4)),
                 absl::StatusCode::kInvalidArgument, "staleness applies only to SSP");
  REQUIRE_OK(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 3)}, 1)));
  REQUIRE_OK(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 3)}, 1)));  // idempotent
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 4)}, 1)),
                 absl::StatusCode::kAlreadyExists, "different spec");
}

TEST_CASE("requests and job specs past a limit are RESOURCE_EXHAUSTED naming the limit", "[errors][limits]") {
  auto cluster = TestCluster::Start(OneServerFourShards());
  auto c = cluster->Client(0);
  std::vector<v1::TableSpec> many;
  for (int i = 0; i < 1025; ++i) many.push_back(DenseTableSpec(absl::StrCat("t", i), 2));
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", many, 1)), absl::StatusCode::kResourceExhausted,
                 "declares 1025 tables; the limit is 1024 tables per job");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {SparseTableSpec("e", 70000)}, 1)), absl::StatusCode::kResourceExhausted,
                 "dim 70000 exceeds the limit of 65536 per row");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", int64_t{1} << 37)}, 1)),
                 absl::StatusCode::kResourceExhausted, "past the limit of 2^36 (68719476736) elements per table");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 3)}, 70000)), absl::StatusCode::kResourceExhausted,
                 "num_workers 70000 exceeds the limit of 65536 workers per job");
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", 1 << 22, 1.0f, v1::OptimizerSpec::SGD, 1 << 21)}, 1)),
                 absl::StatusCode::kResourceExhausted, "chunk_elements 2097152 exceeds the limit of 1048576");
  // Tiny chunks of a big table: the chunk index is bounded before it is
  // allocated, per table and over the job's tables.
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", {DenseTableSpec("w", int64_t{1} << 34, 1.0f, v1::OptimizerSpec::SGD, 16)}, 1)),
                 absl::StatusCode::kResourceExhausted,
                 "17179869184 elements in chunks of 16 make 1073741824 chunks, past the limit of 4194304 chunks per "
                 "job; raise chunk_elements");
  std::vector<v1::TableSpec> chunky;
  for (int i = 0; i < 3; ++i) chunky.push_back(DenseTableSpec(absl::StrCat("t", i), 1 << 21, 1.0f, v1::OptimizerSpec::SGD, 1));
  REQUIRE_STATUS(c->CreateJob(JobSpec("x", chunky, 1)), absl::StatusCode::kResourceExhausted,
                 "its dense tables up to 't2' make 6291456 chunks, past the limit of 4194304");

  REQUIRE_OK(c->CreateJob(JobSpec("lim", {SparseTableSpec("emb", 1)}, 1, v1::ConsistencySpec::ASP)));
  auto stub = RawStub(cluster->address(0));
  // 600 000 keys: 4.8 MB, within the message limit but past the key limit.
  std::vector<uint64_t> keys(600000);
  std::iota(keys.begin(), keys.end(), 0);
  v1::PullRequest pull;
  pull.set_job_id("lim");
  pull.set_worker_id("raw");
  pull.set_shard_map_version(cluster->shard_map().version());
  auto* sk = pull.add_sparse();
  sk->set_table("emb");
  sk->set_keys(std::string(reinterpret_cast<const char*>(keys.data()), keys.size() * 8));
  grpc::ClientContext ctx;
  v1::PullResponse resp;
  REQUIRE_STATUS(FromGrpcStatus(stub->Pull(&ctx, pull, &resp)), absl::StatusCode::kResourceExhausted,
                 "pull carries 600000 sparse keys; the limit is 524288 keys per request");
  // Past the server's message limit (from a client that sends anything):
  // gRPC's own RESOURCE_EXHAUSTED, naming both sizes.
  keys.resize(1200000);
  sk->set_keys(std::string(reinterpret_cast<const char*>(keys.data()), keys.size() * 8));
  grpc::ChannelArguments unlimited;
  unlimited.SetMaxSendMessageSize(-1);
  auto big_stub = v1::ParameterService::NewStub(
      grpc::CreateCustomChannel(cluster->address(0), grpc::InsecureChannelCredentials(), unlimited));
  grpc::ClientContext ctx2;
  const absl::Status big = FromGrpcStatus(big_stub->Pull(&ctx2, pull, &resp));
  REQUIRE(big.code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(big.message().find("larger than max") != std::string::npos);
  REQUIRE(big.message().find("8388608") != std::string::npos);
  // Nothing was created, and the server still serves.
  REQUIRE_OK(c->OpenJob("lim"));
}

TEST_CASE("garbage and hostile bytes get an error and the server keeps serving", "[errors]") {
  auto cluster = TestCluster::Start(OneServerFourShards());
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(JobSpec("ok", {DenseTableSpec("w", 4)}, 1, v1::ConsistencySpec::ASP)));
  grpc::GenericStub stub(CreateFulcrumChannel(cluster->address(0), 7, *security::Transport::Plaintext()));
  std::mt19937 rng(1);
  int rejected = 0;
  for (int i = 0; i < 300; ++i) {
    std::string junk(1 + rng() % 200, '\0');
    for (char& ch : junk) ch = static_cast<char>(rng());
    // Some messages look like protobuf: a valid tag with a huge length.
    if (i % 3 == 0) junk = std::string("\x0a\xff\xff\xff\xff\x0f", 6) + junk;
    grpc::Slice slice(junk.data(), junk.size());
    grpc::ByteBuffer req(&slice, 1), resp;
    grpc::ClientContext ctx;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&ctx, i % 2 ? "/fulcrum.v1.ParameterService/Push" : "/fulcrum.v1.ParameterService/Pull",
                   grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
                     status = s;
                     done.Notify();
                   });
    done.WaitForNotification();
    if (!status.ok()) ++rejected;
  }
  REQUIRE(rejected > 250);  // a random message can parse as an empty request, nothing more
  std::vector<float> g(4, 1.0f), w(4);
  REQUIRE_OK(c->Push("ok", {0, {{"w", g.data(), 4}}, {}}));
  REQUIRE_OK(c->Pull("ok", {0, {{"w", w.data(), 4}}, {}}));
  for (float x : w) REQUIRE(x == -1.0f);
}

}  // namespace
}  // namespace fulcrum
