// GrpcPsClient against real servers over 127.0.0.1: its two transports,
// retries through cut and frozen connections, shard-map changes, wire dtypes
// and the splitting of large tensors. Routing and slicing alone are
// routing_test's; the servers' own rules are parameter_server_test's.
#include "worker/rpc/grpc_ps_client.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/errors.h"
#include "common/shard_map.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

using testing::DensePush;
using testing::DenseTableSpec;
using testing::JobSpec;
using testing::RawPush;
using testing::RawStub;
using testing::SparseTableSpec;
using testing::TestCluster;

// A TCP proxy on 127.0.0.1 in front of one server that can freeze (keep the
// connections open but stop passing bytes either way, as a hung server -
// SIGSTOP, a wedged host - would) or cut every connection it carries (as a
// crashed server or a broken link would); new connections still go through.
class FaultyProxy {
 public:
  explicit FaultyProxy(const std::string& upstream) {
    upstream_port_ = std::stoi(upstream.substr(upstream.rfind(':') + 1));
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(listen_fd_ >= 0);
    sockaddr_in a = testing::LoopbackAddress(0);
    socklen_t len = sizeof(a);
    REQUIRE(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) == 0);
    REQUIRE(::listen(listen_fd_, 8) == 0);
    REQUIRE(::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    address_ = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
    accept_ = std::thread([this] { Accept(); });
  }
  ~FaultyProxy() {
    stop_ = true;
    frozen_ = false;
    ::shutdown(listen_fd_, SHUT_RDWR);
    accept_.join();  // no connection is added after this
    absl::MutexLock lock(&mu_);  // pumps never take it
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    for (auto& t : threads_) t.join();
    ::close(listen_fd_);
    for (int fd : fds_) ::close(fd);
  }
  const std::string& address() const { return address_; }
  void Freeze() { frozen_ = true; }
  void Cut() {
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  }

 private:
  void Accept() {
    for (;;) {
      const int in = ::accept(listen_fd_, nullptr, nullptr);
      if (in < 0 || stop_) return;
      const int out = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a = testing::LoopbackAddress(upstream_port_);
      if (::connect(out, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        ::close(in);
        ::close(out);
        continue;
      }
      absl::MutexLock lock(&mu_);
      fds_.push_back(in);
      fds_.push_back(out);
      threads_.emplace_back([this, in, out] { Pump(in, out); });
      threads_.emplace_back([this, in, out] { Pump(out, in); });
    }
  }
  void Pump(int from, int to) {
    std::vector<char> buf(1 << 16);
    for (;;) {
      const ssize_t n = ::read(from, buf.data(), buf.size());
      if (n <= 0) break;
      while (frozen_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      // MSG_NOSIGNAL: a cut connection fails the send instead of raising SIGPIPE.
      if (stop_ || ::send(to, buf.data(), static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  int listen_fd_ = -1;
  int upstream_port_ = 0;
  std::string address_;
  std::atomic<bool> frozen_{false}, stop_{false};
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::thread accept_;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);  // pumps
};

TEST_CASE("a stream request to a server that hangs fails DEADLINE_EXCEEDED by its deadline", "[stream][errors]") {
  testing::TestCluster::Options one;
  one.num_servers = 1;
  auto cluster = TestCluster::Start(one);
  FaultyProxy proxy(cluster->address(0));
  GrpcPsClientOptions opts;
  opts.transport = GrpcPsClientOptions::Transport::kStream;
  opts.rpc_timeout = absl::Seconds(1);
  opts.pull_wait_timeout = absl::Milliseconds(500);
  v1::ShardMap via_proxy = cluster->shard_map();
  via_proxy.set_servers(0, proxy.address());
  opts.shard_map = via_proxy;
  opts.worker_id = "worker-0";
  auto client = GrpcPsClient::Create(opts);
  REQUIRE_OK(client.status());
  GrpcPsClient& c = **client;
  REQUIRE_OK(c.CreateJob(JobSpec("hang", {DenseTableSpec("w", 8)}, 1, v1::ConsistencySpec::ASP)));
  std::vector<float> g(8, 1.0f), w(8);
  REQUIRE_OK(c.Push("hang", {0, {{"w", g.data(), 8}}, {}}));
  REQUIRE_OK(c.Pull("hang", {1, {{"w", w.data(), 8}}, {}}));
  proxy.Freeze();
  const absl::Time t0 = absl::Now();
  REQUIRE_STATUS(c.Pull("hang", {1, {{"w", w.data(), 8}}, {}}), absl::StatusCode::kDeadlineExceeded,
                 "no response on the stream");
  REQUIRE_STATUS(c.Push("hang", {1, {{"w", g.data(), 8}}, {}}), absl::StatusCode::kDeadlineExceeded,
                 "no response on the stream");
  const absl::Duration took = absl::Now() - t0;
  INFO("took " << absl::FormatDuration(took));
  CHECK(took >= absl::Milliseconds(2500));  // the pull's 1.5 s and the push's 1 s
  CHECK(took < absl::Seconds(10));
}

// Connections cut under busy clients' streams again and again, as a crashing
// server or a broken link does: every push is applied exactly once (retried
// on a new stream, deduplicated by worker and seq) and the clients carry on.
// Under ASan this also checks that nothing is started on a stream that gRPC
// has already torn down (a stream ends when its read fails, before OnDone).
TEST_CASE("streams cut again and again under busy clients lose no push and apply none twice", "[stream][errors]") {
  testing::TestCluster::Options one;
  one.num_servers = 1;
  auto cluster = TestCluster::Start(one);
  FaultyProxy proxy(cluster->address(0));
  constexpr int kThreads = 4;
  constexpr size_t kElements = 1024;
  auto admin = cluster->Client(0);
  REQUIRE_OK(admin->CreateJob(JobSpec("cut", {DenseTableSpec("w", kElements, 1.0f, v1::OptimizerSpec::SGD, 256)},
                                      kThreads, v1::ConsistencySpec::ASP)));
  v1::ShardMap via_proxy = cluster->shard_map();
  via_proxy.set_servers(0, proxy.address());
  std::atomic<bool> stop{false};
  std::vector<int> pushes(kThreads, 0);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      GrpcPsClientOptions o;
      o.transport = GrpcPsClientOptions::Transport::kStream;
      o.channels_per_server = 2;
      o.shard_map = via_proxy;
      o.worker_id = absl::StrCat("cut-worker-", t);
      o.rank = static_cast<uint32_t>(t);
      o.retry_budget = absl::Seconds(60);
      auto c = GrpcPsClient::Create(o);
      absl::Status s = c.status();
      if (s.ok()) s = (*c)->OpenJob("cut");
      std::vector<float> g(kElements, 1.0f), w(kElements);
      for (uint64_t i = 0; s.ok() && !stop.load(); ++i) {
        // Pushes and pulls in flight together, as a prefetching worker has them.
        auto pull = (*c)->PullAsync("cut", {i, {{"w", w.data(), kElements}}, {}});
        s = (*c)->Push("cut", {i, {{"w", g.data(), kElements}}, {}});
        s.Update(pull.Wait());
        if (s.ok()) ++pushes[t];
      }
      if (!s.ok()) errors[t] = s.ToString();
    });
  }
  // Three seconds of cuts, 20-80 ms apart.
  int cuts = 0;
  std::mt19937 rng(7);
  for (const absl::Time end = absl::Now() + absl::Seconds(3); absl::Now() < end; ++cuts) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 60));
    proxy.Cut();
  }
  stop = true;
  for (auto& th : threads) th.join();
  int total = 0;
  for (int t = 0; t < kThreads; ++t) {
    INFO("client " << t << ": " << pushes[t] << " pushes; " << errors[t]);
    CHECK(errors[t].empty());
    CHECK(pushes[t] > 0);
    total += pushes[t];
  }
  INFO(cuts << " cuts, " << total << " pushes");
  CHECK(cuts >= 20);
  std::vector<float> w(kElements);
  REQUIRE_OK(admin->Pull("cut", {0, {{"w", w.data(), kElements}}, {}}));
  for (float x : w) REQUIRE(x == -static_cast<float>(total));
}

// ------------------------------------------------------------------ shard maps, wire dtypes, big tensors

TEST_CASE("a shard-map mismatch is retried transparently", "[shard_map]") {
  auto transport = GENERATE(GrpcPsClientOptions::Transport::kUnary,
                            GrpcPsClientOptions::Transport::kStream);
  INFO("transport " << (transport == GrpcPsClientOptions::Transport::kStream ? "stream" : "unary"));
  auto cluster = TestCluster::Start();
  GrpcPsClientOptions opts;
  opts.transport = transport;
  auto c = cluster->Client(0, opts);  // knows version 1
  REQUIRE_OK(c->CreateJob(JobSpec("moved", {DenseTableSpec("w", 512, 1.0f, v1::OptimizerSpec::SGD, 32),
                                            SparseTableSpec("emb", 4)},
                                  1, v1::ConsistencySpec::ASP)));
  // Version 2 swaps every virtual shard to the other server.
  v1::ShardMap v2 = cluster->shard_map();
  v2.set_version(2);
  for (int v = 0; v < v2.owner_size(); ++v) v2.set_owner(v, 1 - v2.owner(v));
  cluster->SetShardMap(v2);

  std::vector<float> g(512, 1.0f), w(512);
  std::vector<uint64_t> keys = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> sg(keys.size() * 4, 0.5f), rows(keys.size() * 4);
  REQUIRE_OK(c->Push("moved", {0, {{"w", g.data(), 512}}, {{"emb", keys.data(), keys.size(), sg.data()}}}));
  REQUIRE(c->shard_map_version() == 2);
  REQUIRE_OK(c->Pull("moved", {1, {{"w", w.data(), 512}}, {{"emb", keys.data(), keys.size(), rows.data()}}}));
  for (float x : w) REQUIRE(x == -1.0f);
  for (float x : rows) REQUIRE(x == -0.5f);

  // Errors keep their codes and messages over either transport.
  g[3] = std::nanf("");
  REQUIRE_STATUS(c->Push("moved", {1, {{"w", g.data(), 512}}, {}}), absl::StatusCode::kInvalidArgument,
                 "contains NaN or Inf");
  REQUIRE_STATUS(c->Pull("nope", {0, {}, {}}), absl::StatusCode::kFailedPrecondition, "unknown to this client");

  // A stale map reported straight to the server gets the distinct error.
  auto stub = RawStub(cluster->address(0));
  uint32_t chunk = 0;
  auto m2 = ShardMap::FromProto(v2);
  while (m2->ServerOfChunk("w", chunk) == 0) ++chunk;
  v1::PushRequest req = DensePush("moved", "w", chunk, std::vector<float>(32, 1.0f), 5);
  req.set_shard_map_version(1);
  auto s = RawPush(stub.get(), req);
  REQUIRE(s.code() == absl::StatusCode::kAborted);
  REQUIRE(WrongShardVersion(s) == 2u);
}

TEST_CASE("a replacement's exact pull of a step its predecessor left torn between servers fails TornStep, other "
          "pulls of that step are served",
          "[bsp][recovery]") {
  auto cluster = TestCluster::Start();
  constexpr size_t n = 256;
  const std::string job = "torn";
  auto c0 = cluster->Client(0);
  REQUIRE_OK(c0->CreateJob(JobSpec(job, {DenseTableSpec("w", n, 1.0f, v1::OptimizerSpec::SGD, 8)}, 2)));
  std::vector<uint32_t> on_a;  // server 0's chunks of the 32
  for (uint32_t c = 0; c < n / 8; ++c) {
    if (testing::OwnerOfChunk(*cluster, "w", c) == 0) on_a.push_back(c);
  }
  REQUIRE(!on_a.empty());
  REQUIRE(on_a.size() < n / 8);  // server 1 owns some too

  GrpcPsClientOptions replacement;
  replacement.incarnation = 1;
  replacement.worker_id = "worker-1-again";
  auto c1 = cluster->Client(1, replacement);
  REQUIRE_OK(c1->OpenJob(job));
  std::vector<float> w(n, 7.0f);
  PullBatch exact{0, {{"w", w.data(), n}}, {}};
  exact.exact = true;
  // Nothing applied yet: step 0's weights are there to be had.
  REQUIRE_OK(c1->Pull(job, exact));
  for (float x : w) REQUIRE(x == 0.0f);

  // Rank 0 pushes step 0 everywhere; rank 1's first incarnation reaches
  // server 0 only, then dies. Server 0 applies step 0; server 1 waits.
  std::vector<float> g(n, 1.0f);
  REQUIRE_OK(c0->Push(job, {0, {{"w", g.data(), n}}, {}}));
  auto stub = testing::RawStub(cluster->address(0));
  v1::PushRequest part;
  part.set_job_id(job);
  part.set_worker_id("worker-1");
  part.set_rank(1);
  part.set_seq(1);
  part.set_step(0);
  part.set_num_parts(1);
  for (uint32_t c : on_a) {
    auto* d = part.add_dense();
    d->set_table("w");
    d->set_chunk(c);
    d->set_dtype(v1::DTYPE_FP32);
    d->set_data(std::string(reinterpret_cast<const char*>(g.data()), 8 * 4));
  }
  REQUIRE_OK(testing::RawPush(stub.get(), part));
  auto stats = c0->GetJobStats(job, 0);
  REQUIRE_OK(stats.status());
  REQUIRE(stats->applied_step() == 1);
  stats = c0->GetJobStats(job, 1);
  REQUIRE_OK(stats.status());
  REQUIRE(stats->applied_step() == 0);

  // The replacement resumes at step 0 (server 1's clock for rank 1). A
  // plain pull of step 0 gets server 0's weights after step 0: a gradient
  // from them, pushed to server 1, would differ from an undisturbed run's.
  PullBatch plain{0, {{"w", w.data(), n}}, {}};
  REQUIRE_OK(c1->Pull(job, plain));
  size_t newer = 0;
  for (uint32_t c : on_a) newer += w[c * 8] != 0.0f;
  REQUIRE(newer == on_a.size());
  // Its exact pull fails, naming the torn step, so the worker reports
  // TornStep and the job rolls back to its last cut.
  const absl::Status torn = c1->Pull(job, exact);
  INFO(torn.ToString());
  REQUIRE(IsTornStep(torn));
  REQUIRE(absl::StrContains(torn.message(), cluster->address(0)));
  REQUIRE(absl::StrContains(torn.message(), "step 0"));
}

TEST_CASE("bf16 and fp16 on the wire round trip within their precision", "[dtype]") {
  auto cluster = TestCluster::Start();
  constexpr size_t n = 5000;
  for (DType dt : {DType::kBf16, DType::kFp16}) {
    GrpcPsClientOptions o;
    o.wire_dtype = dt;
    auto c = cluster->Client(0, o);
    const std::string job = std::string("wire-") + DTypeName(dt);
    REQUIRE_OK(c->CreateJob(JobSpec(job, {DenseTableSpec("w", n)}, 1, v1::ConsistencySpec::ASP)));
    std::vector<float> g(n), w(n);
    for (size_t i = 0; i < n; ++i) g[i] = -0.37f * static_cast<float>(i % 101) - 0.01f;
    REQUIRE_OK(c->Push(job, {0, {{"w", g.data(), n}}, {}}));
    REQUIRE_OK(c->Pull(job, {0, {{"w", w.data(), n}}, {}}));
    const float tol = dt == DType::kBf16 ? 1.0f / 128 : 1.0f / 1024;  // two roundings
    for (size_t i = 0; i < n; ++i) REQUIRE(std::fabs(w[i] + g[i]) <= std::fabs(g[i]) * tol);
  }
}

TEST_CASE("tensors larger than one gRPC message are split and reassembled", "[chunking]") {
  auto cluster = TestCluster::Start();
  constexpr size_t n = 3'000'000;  // 12 MB of fp32, over gRPC's 4 MiB default
  auto c = cluster->Client(0);
  REQUIRE_OK(c->CreateJob(JobSpec("big", {DenseTableSpec("w", n)}, 1)));
  std::vector<float> g(n), w(n);
  for (size_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 1024);
  REQUIRE_OK(c->Push("big", {0, {{"w", g.data(), n}}, {}}));
  REQUIRE_OK(c->Pull("big", {1, {{"w", w.data(), n}}, {}}));
  for (size_t i = 0; i < n; ++i) {
    if (w[i] != -g[i]) FAIL("element " << i << ": " << w[i] << " != " << -g[i]);
  }
}

TEST_CASE("a large push to several servers goes out on a sender thread per server and lands whole", "[chunking]") {
  auto cluster = TestCluster::Start();  // 2 servers
  constexpr size_t n = 3'000'000;       // 12 MB of fp32: past the size at which a push is spread
  for (bool shm : {true, false}) {
    INFO("shared memory " << shm);
    GrpcPsClientOptions o;
    o.wire_dtype = DType::kBf16;
    o.shared_memory = shm;
    auto c = cluster->Client(0, o);
    const std::string job = shm ? "spread-shm" : "spread-grpc";
    REQUIRE_OK(c->CreateJob(JobSpec(job, {DenseTableSpec("w", n), DenseTableSpec("b", 1000)}, 1)));
    // Small integers: exact in bf16, so three steps of SGD at rate 1 give
    // exactly -3 g whatever the parts' order.
    std::vector<float> g(n), gb(1000), w(n), wb(1000);
    for (size_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 61);
    for (size_t i = 0; i < gb.size(); ++i) gb[i] = static_cast<float>(i % 7);
    for (uint64_t step = 0; step < 3; ++step) {
      REQUIRE_OK(c->Push(job, {step, {{"w", g.data(), n}, {"b", gb.data(), gb.size()}}, {}}));
    }
    REQUIRE_OK(c->Pull(job, {3, {{"w", w.data(), n}, {"b", wb.data(), wb.size()}}, {}}));
    for (size_t i = 0; i < n; ++i) {
      if (w[i] != -3 * g[i]) FAIL("w element " << i << ": " << w[i] << " != " << -3 * g[i]);
    }
    for (size_t i = 0; i < wb.size(); ++i) {
      if (wb[i] != -3 * gb[i]) FAIL("b element " << i << ": " << wb[i] << " != " << -3 * gb[i]);
    }
    // Both servers hold part of the table and applied all three steps.
    for (size_t s = 0; s < cluster->size(); ++s) {
      auto stats = c->GetJobStats(job, s);
      REQUIRE_OK(stats.status());
      CHECK(stats->applied_step() == 3);
    }
  }
}

}  // namespace
}  // namespace fulcrum
