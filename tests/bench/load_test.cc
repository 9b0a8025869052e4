// Load test: 64 concurrent clients push and pull against 2 fulcrum-server
// processes for a bounded time, over mutual TLS (the default; --insecure for
// plaintext). Every client is a worker of one ASP job with a dense table and
// a sparse table, and alternates a push (gradient 1 everywhere, lr 1) with
// a pull. Afterwards one pull checks that no update was lost: every dense
// weight is minus the number of pushes of all clients, the shared sparse
// row too, each client's own row minus its own pushes. Prints latency
// percentiles per operation and the servers' memory; exits non-zero on any
// error or lost update.
//
//   fulcrum-load-test --server_binary=build/server/fulcrum-server
//       --gen_certs=deploy/tls/gen-certs.sh [--clients=64] [--seconds=20] [--insecure]
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

// The test helpers assert with Catch2, which needs a session: main parses
// our flags, then runs the one test case below.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/rpc/security.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"
#include "worker/rpc/grpc_ps_client.h"

ABSL_FLAG(std::string, server_binary, "", "path of fulcrum-server");
ABSL_FLAG(std::string, gen_certs, "", "path of deploy/tls/gen-certs.sh");
ABSL_FLAG(int32_t, clients, 64, "concurrent clients (workers of one ASP job)");
ABSL_FLAG(int32_t, seconds, 20, "how long the clients push and pull");
ABSL_FLAG(int32_t, dense_elements, 65536, "dense table size (fp32 elements; pushed and pulled whole)");
ABSL_FLAG(int32_t, sparse_keys, 64, "sparse keys per push and pull (one shared by all clients)");
ABSL_FLAG(bool, insecure, false, "plaintext instead of mutual TLS");

namespace fulcrum {
namespace {

constexpr uint32_t kDim = 16;

struct ClientResult {
  std::vector<double> push_ms, pull_ms;
  int64_t pushes = 0;
  std::vector<std::string> errors;
};

std::string Percentiles(std::vector<double> v) {
  if (v.empty()) return "| - | - | - | - | - |";
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))]; };
  return absl::StrFormat("| %.2f | %.2f | %.2f | %.2f | %.2f |", at(0.5), at(0.9), at(0.99), at(0.999), v.back());
}

int Run() {
  const int clients = absl::GetFlag(FLAGS_clients);
  const int seconds = absl::GetFlag(FLAGS_seconds);
  const size_t dense = static_cast<size_t>(std::clamp(absl::GetFlag(FLAGS_dense_elements), 1, 1 << 24));
  const int nkeys = std::clamp(absl::GetFlag(FLAGS_sparse_keys), 1, 4096);
  const bool insecure = absl::GetFlag(FLAGS_insecure);
  const std::string dir = testing::MakeTempDir("fulcrum-load");

  std::vector<std::string> tls_server[2];
  // The client holds a worker certificate with TLS on; plaintext otherwise.
  std::shared_ptr<const security::Transport> transport = security::Transport::Plaintext();
  if (!insecure) {
    const auto gen = testing::Spawn({absl::GetFlag(FLAGS_gen_certs), dir + "/pki", "--servers", "2", "--workers", "1"},
                                    dir + "/gen.log");
    int status = 0;
    waitpid(gen.pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::cerr << "gen-certs.sh failed: " << testing::ReadFile(dir + "/gen.log");
      return 1;
    }
    for (int i = 0; i < 2; ++i) {
      tls_server[i] = {"--tls_ca_file=" + dir + "/pki/ca.crt", absl::StrCat("--tls_cert_file=", dir, "/pki/server-", i, ".crt"),
                       absl::StrCat("--tls_key_file=", dir, "/pki/server-", i, ".key")};
    }
    auto t = security::Transport::Member({dir + "/pki/ca.crt", dir + "/pki/worker-0.crt", dir + "/pki/worker-0.key", ""});
    if (!t.ok()) {
      std::cerr << t.status() << "\n";
      return 1;
    }
    transport = *std::move(t);
  } else {
    for (auto& t : tls_server) t = {"--insecure"};
  }
  const int ports[2] = {testing::FreePort(), testing::FreePort()};
  const std::string a0 = absl::StrCat("127.0.0.1:", ports[0]), a1 = absl::StrCat("127.0.0.1:", ports[1]);
  std::vector<testing::Process> servers;
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> args = {absl::GetFlag(FLAGS_server_binary), "--listen=" + (i == 0 ? a0 : a1),
                                     absl::StrCat("--server_index=", i), "--shard_map=" + a0 + "," + a1,
                                     "--virtual_shards=64", "--metrics_addr="};
    args.insert(args.end(), tls_server[i].begin(), tls_server[i].end());
    servers.push_back(testing::Spawn(args, absl::StrCat(dir, "/server-", i, ".log")));
  }
  auto stop_servers = [&] {
    for (auto& p : servers) kill(p.pid, SIGTERM);
    for (auto& p : servers) waitpid(p.pid, nullptr, 0);
  };

  GrpcPsClientOptions base;
  base.security = transport;
  base.bootstrap_servers = {a0, a1};
  base.channels_per_server = 1;
  base.retry_budget = absl::Seconds(10);
  auto make_client = [&](uint32_t rank) {
    GrpcPsClientOptions o = base;
    o.rank = rank;
    o.worker_id = absl::StrCat("load-", rank);
    return GrpcPsClient::Create(o);
  };
  // The servers may take a moment to listen (seconds under ASan): CreateJob
  // below goes to both, so wait for both.
  for (int i = 0; i < 2; ++i) {
    if (!testing::WaitForListening(ports[i], 60000)) {
      std::cerr << "server " << i << " does not listen on port " << ports[i] << " after 60 s:\n"
                << testing::ReadFile(servers[i].log);
      stop_servers();
      return 1;
    }
  }
  absl::StatusOr<std::unique_ptr<GrpcPsClient>> admin;
  for (int tries = 0; tries < 100; ++tries) {
    admin = make_client(0);
    if (admin.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!admin.ok()) {
    std::cerr << "cannot reach the servers: " << admin.status() << "\n";
    stop_servers();
    return 1;
  }
  const v1::PsJobSpec spec =
      testing::JobSpec("load", {testing::DenseTableSpec("w", static_cast<int64_t>(dense), 1.0f, v1::OptimizerSpec::SGD, 8192),
                                testing::SparseTableSpec("emb", kDim)},
                       static_cast<uint32_t>(clients), v1::ConsistencySpec::ASP);
  if (auto s = (*admin)->CreateJob(spec); !s.ok()) {
    std::cerr << "CreateJob: " << s << "\n";
    stop_servers();
    return 1;
  }
  const int64_t rss_before[2] = {testing::RssKiB(servers[0].pid), testing::RssKiB(servers[1].pid)};

  std::vector<ClientResult> results(static_cast<size_t>(clients));
  // The clock starts once every client is connected (64 TLS handshakes take
  // a while under a sanitizer).
  absl::Notification go;
  std::atomic<int> ready{0};
  std::chrono::steady_clock::time_point deadline;
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      ClientResult& r = results[static_cast<size_t>(c)];
      auto client = make_client(static_cast<uint32_t>(c));
      if (!client.ok() || !(*client)->OpenJob("load").ok()) {
        r.errors.push_back(absl::StrCat("client ", c, ": cannot open the job"));
        ready.fetch_add(1);
        return;
      }
      ready.fetch_add(1);
      std::vector<float> g(dense, 1.0f), w(dense);
      // Key 0 is shared by every client; the rest are this client's own.
      std::vector<uint64_t> keys(static_cast<size_t>(nkeys));
      for (int k = 0; k < nkeys; ++k) keys[static_cast<size_t>(k)] = k == 0 ? 0 : static_cast<uint64_t>(c) * 1000 + k;
      std::vector<float> sg, rows;
      sg.resize(static_cast<size_t>(nkeys) * kDim, 1.0f);
      rows.resize(sg.size());
      go.WaitForNotification();
      for (uint64_t step = 0; std::chrono::steady_clock::now() < deadline; ++step) {
        PushBatch b;
        b.step = step;
        b.dense.push_back({"w", g.data(), g.size()});
        b.sparse.push_back({"emb", keys.data(), keys.size(), sg.data()});
        auto t0 = std::chrono::steady_clock::now();
        absl::Status s = (*client)->Push("load", b);
        auto t1 = std::chrono::steady_clock::now();
        if (!s.ok()) {
          r.errors.push_back(absl::StrCat("client ", c, " push ", step, ": ", s.ToString()));
          break;
        }
        ++r.pushes;
        r.push_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        s = (*client)->Pull("load", {step + 1, {{"w", w.data(), w.size()}}, {{"emb", keys.data(), keys.size(), rows.data()}}});
        auto t2 = std::chrono::steady_clock::now();
        if (!s.ok()) {
          r.errors.push_back(absl::StrCat("client ", c, " pull ", step, ": ", s.ToString()));
          break;
        }
        r.pull_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
    });
  }
  while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto start = std::chrono::steady_clock::now();
  deadline = start + std::chrono::seconds(seconds);
  go.Notify();  // publishes `deadline` to the clients
  for (auto& t : threads) t.join();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t rss_after[2] = {testing::RssKiB(servers[0].pid), testing::RssKiB(servers[1].pid)};

  std::vector<double> push_ms, pull_ms;
  int64_t total = 0;
  std::vector<std::string> errors;
  for (const ClientResult& r : results) {
    push_ms.insert(push_ms.end(), r.push_ms.begin(), r.push_ms.end());
    pull_ms.insert(pull_ms.end(), r.pull_ms.begin(), r.pull_ms.end());
    total += r.pushes;
    errors.insert(errors.end(), r.errors.begin(), r.errors.end());
  }

  // No lost update.
  int lost = 0;
  {
    std::vector<float> w(dense);
    std::vector<uint64_t> keys = {0};
    for (int c = 0; c < clients; ++c) keys.push_back(static_cast<uint64_t>(c) * 1000 + 1);
    std::vector<float> rows(keys.size() * kDim);
    absl::Status s = (*admin)->Pull("load", {0, {{"w", w.data(), w.size()}}, {{"emb", keys.data(), keys.size(), rows.data()}}});
    if (!s.ok()) {
      errors.push_back(absl::StrCat("final pull: ", s.ToString()));
    } else {
      for (float x : w) lost += x != -static_cast<float>(total);
      for (uint32_t j = 0; j < kDim; ++j) lost += rows[j] != -static_cast<float>(total);
      for (int c = 0; c < clients && nkeys > 1; ++c) {
        for (uint32_t j = 0; j < kDim; ++j) {
          lost += rows[(static_cast<size_t>(c) + 1) * kDim + j] != -static_cast<float>(results[static_cast<size_t>(c)].pushes);
        }
      }
    }
  }
  stop_servers();

  const double mib = static_cast<double>(dense) * 4 / (1 << 20);
  std::cout << absl::StrFormat(
      "load: %d clients x %.1f s against 2 fulcrum-server processes (%s), ASP, dense %d fp32 (%.2f MiB) + %d sparse "
      "keys x dim %u per push and per pull, %u cores\n",
      clients, elapsed, insecure ? "plaintext" : "mutual TLS", dense, mib, nkeys, kDim, std::thread::hardware_concurrency());
  std::cout << "| op | count | ops/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms |\n|---|---|---|---|---|---|---|---|\n";
  std::cout << absl::StrFormat("| push | %d | %.0f ", push_ms.size(), static_cast<double>(push_ms.size()) / elapsed)
            << Percentiles(push_ms) << "\n";
  std::cout << absl::StrFormat("| pull | %d | %.0f ", pull_ms.size(), static_cast<double>(pull_ms.size()) / elapsed)
            << Percentiles(pull_ms) << "\n";
  std::cout << absl::StrFormat("server RSS: %d + %d KiB before, %d + %d KiB after\n", rss_before[0], rss_before[1],
                               rss_after[0], rss_after[1]);
  std::cout << absl::StrFormat("errors: %d; lost updates: %d (of %d pushes checked by value)\n", errors.size(), lost, total);
  for (size_t i = 0; i < std::min<size_t>(errors.size(), 10); ++i) std::cout << "  " << errors[i] << "\n";
  const bool ok = errors.empty() && lost == 0 && total > 0 && !push_ms.empty() && !pull_ms.empty();
  std::cout << (ok ? "PASS" : "FAIL") << "\n";
  if (ok) std::filesystem::remove_all(dir);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace fulcrum

TEST_CASE("load") { REQUIRE(fulcrum::Run() == 0); }

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  char* args[] = {argv[0], nullptr};
  return Catch::Session().run(1, args);
}
