// fulcrum-embedding-bench: trains an embedding table of --rows rows x --dim
// on --servers fulcrum-server processes and reports the servers' memory per
// row against the bound: the row's floats plus its optimizer state
// (Adagrad: one accumulator per float), 2 x dim x 4 bytes.
//
// Every row is created and trained as a training step would: a pull of a
// batch of keys (the servers create missing rows from the initializer),
// then a push of gradients for them (Adagrad applies); a second pass pushes
// to random rows and checks the values moved. Memory is each server's
// resident set (VmRSS) before the job and after the passes; the processes
// must still be alive at the end (no out-of-memory kill).
//
//   fulcrum-embedding-bench --server_binary=build/server/fulcrum-server [--rows=10000000] [--dim=64]
//   [--servers=2] [--batch=65536]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/shard_map.h"
#include "tests/testing/subprocess.h"
#include "worker/rpc/grpc_ps_client.h"

ABSL_FLAG(std::string, server_binary, "", "path of fulcrum-server");
ABSL_FLAG(int64_t, rows, 10000000, "rows of the embedding table");
ABSL_FLAG(int32_t, dim, 64, "floats per row");
ABSL_FLAG(int32_t, servers, 2, "fulcrum-server processes");
ABSL_FLAG(int32_t, batch, 65536, "keys per pull and push");

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

// A process's resident set in bytes (VmRSS), -1 when it is gone.
int64_t Rss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "fulcrum-embedding-bench: %s\n", what.c_str());
  return 1;
}

int Run() {
  const std::string binary = absl::GetFlag(FLAGS_server_binary);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int dim = absl::GetFlag(FLAGS_dim), n = absl::GetFlag(FLAGS_servers), batch = absl::GetFlag(FLAGS_batch);
  if (binary.empty() || rows <= 0 || dim <= 0 || n <= 0 || batch <= 0) {
    return Fail("usage: fulcrum-embedding-bench --server_binary=PATH [--rows=N] [--dim=N] [--servers=N] [--batch=N]");
  }
  char tmpl[] = "/tmp/fulcrum-embedding-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return Fail("mkdtemp failed");
  const std::string dir = tmpl;
  std::vector<int> ports;
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    ports.push_back(testing::FreeLoopbackPort());
    addresses.push_back(absl::StrCat("127.0.0.1:", ports.back()));
  }
  std::vector<pid_t> pids;
  auto stop = [&] {
    for (pid_t p : pids) kill(p, SIGTERM);
    for (pid_t p : pids) waitpid(p, nullptr, 0);
    std::system(absl::StrCat("rm -rf '", dir, "'").c_str());
  };
  for (int i = 0; i < n; ++i) {
    pids.push_back(testing::StartProcess(
        {binary, "--listen=" + addresses[i], absl::StrCat("--server_index=", i),
         "--shard_map=" + absl::StrJoin(addresses, ","), "--metrics_addr=", "--insecure",
         absl::StrCat("--servers_per_host=", n), absl::StrCat("--data_dir=", dir, "/server-", i)},
        absl::StrCat(dir, "/server-", i, ".log")));
    if (pids.back() < 0 || !testing::WaitForListening(ports[i], 30000, pids.back())) {
      stop();
      return Fail(absl::StrCat("server ", i, " did not start"));
    }
  }
  std::vector<int64_t> before;
  for (pid_t p : pids) before.push_back(Rss(p));

  GrpcPsClientOptions o;
  o.shard_map = ShardMap::RoundRobin(1, 256, addresses)->ToProto();
  o.worker_id = "bench";
  auto client = GrpcPsClient::Create(o);
  if (!client.ok()) {
    stop();
    return Fail(client.status().ToString());
  }
  v1::PsJobSpec spec;
  spec.set_job_id("emb");
  spec.set_num_workers(1);
  spec.mutable_consistency()->set_model(v1::ConsistencySpec::ASP);
  auto* t = spec.add_tables();
  t->set_name("emb");
  t->set_kind(v1::TableSpec::SPARSE);
  t->set_dim(dim);
  t->mutable_initializer()->set_kind(v1::InitializerSpec::NORMAL);
  t->mutable_initializer()->set_b(0.01f);
  t->mutable_optimizer()->set_kind(v1::OptimizerSpec::ADAGRAD);
  t->mutable_optimizer()->set_learning_rate(0.05f);
  if (auto s = (*client)->CreateJob(spec); !s.ok()) {
    stop();
    return Fail(s.ToString());
  }
  std::vector<uint64_t> keys(batch);
  std::vector<float> vals(size_t{1} * batch * dim), grads(size_t{1} * batch * dim);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0, 1);
  for (float& g : grads) g = normal(rng);
  // Keys spread over the 64-bit space, as hashed ids are.
  auto key_of = [](uint64_t i) { return (i + 1) * 0x9e3779b97f4a7c15ull; };
  const auto start = Clock::now();
  uint64_t step = 0;
  for (int64_t first = 0; first < rows; first += batch) {
    const size_t m = static_cast<size_t>(std::min<int64_t>(batch, rows - first));
    for (size_t i = 0; i < m; ++i) keys[i] = key_of(first + i);
    absl::Status s = (*client)->Pull("emb", {step, {}, {{"emb", keys.data(), m, vals.data()}}});
    if (s.ok()) s = (*client)->Push("emb", {step, {}, {{"emb", keys.data(), m, grads.data()}}});
    ++step;
    if (!s.ok()) {
      stop();
      return Fail(absl::StrCat("after ", first, " rows: ", s.ToString()));
    }
    if ((first / batch) % 16 == 15) {
      std::fprintf(stderr, "%.1f M rows trained, %.0f s\n", (first + m) / 1e6,
                   std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Random rows again: trained values differ from their first pull's.
  std::uniform_int_distribution<int64_t> pick(0, rows - 1);
  const size_t m = static_cast<size_t>(std::min<int64_t>(batch, rows));
  for (size_t i = 0; i < m; ++i) keys[i] = key_of(pick(rng));
  std::vector<float> again(vals.size());
  absl::Status s = (*client)->Pull("emb", {step, {}, {{"emb", keys.data(), m, again.data()}}});
  double moved = 0;
  for (size_t i = 0; i < m * dim; ++i) moved += std::abs(again[i]);
  std::vector<int64_t> after;
  int64_t grown = 0;
  for (size_t i = 0; i < pids.size(); ++i) {
    after.push_back(Rss(pids[i]));
    grown += after.back() - before[i];
  }
  const double bound = 2.0 * dim * 4;
  std::printf("| embedding table | servers | seconds | rows/s (pull + push) | server memory grown | bytes per row | "
              "bound (value + Adagrad state) | ratio |\n|---|---|---|---|---|---|---|---|\n");
  std::printf("| %lld x %d | %d | %.1f | %.0f | %.2f GiB | %.0f | %.0f | %.2f |\n", static_cast<long long>(rows), dim, n,
              seconds, rows / seconds, grown / double(1 << 30), double(grown) / rows, bound, grown / rows / bound);
  for (size_t i = 0; i < pids.size(); ++i) {
    std::printf("server %zu: resident %.2f GiB -> %.2f GiB\n", i, before[i] / double(1 << 30), after[i] / double(1 << 30));
  }
  const bool alive = std::all_of(after.begin(), after.end(), [](int64_t r) { return r > 0; });
  std::printf("all servers alive: %s; a second pull of %zu random rows: %s, mean |value| %.4f\n", alive ? "yes" : "NO", m,
              s.ok() ? "ok" : s.ToString().c_str(), moved / (m * dim));
  stop();
  // Rows start as N(0, 0.01) (mean |value| 0.008); Adagrad's first step
  // alone moves each value by about the learning rate.
  return alive && s.ok() && moved / (m * dim) > 0.02 ? 0 : 1;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  fulcrum::SetMinLogSeverity(fulcrum::LogSeverity::kWarning);
  return fulcrum::Run();
}
