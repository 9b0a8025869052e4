// End-to-end with the real binaries as separate processes, started the way
// deploy/local/cluster.sh starts them: fulcrum-coordinator, fulcrum-server x2
// and fulcrum-worker processes on 127.0.0.1, jobs submitted with fulcrumctl
// from the example specs, results read back with `fulcrumctl --output=json`
// and the job API.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/config/spec_text.h"
#include "common/rpc/grpc_util.h"
#include "fulcrum/v1/cluster.grpc.pb.h"
#include "tests/testing/process_util.h"
#include "tests/testing/subprocess.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

using testing::FreePort;

pid_t Spawn(std::vector<std::string> args, const std::string& log) {
  return testing::Spawn(std::move(args), log).pid;
}

std::string Bin(const char* rel) { return std::string(FULCRUM_BUILD_DIR) + "/" + rel; }
std::string Example(const std::string& name) { return std::string(FULCRUM_SOURCE_DIR) + "/deploy/examples/" + name; }

class ProcessCluster {
 public:
  // `server_flags` go to every server this cluster starts, `worker_flags`
  // to every worker.
  ProcessCluster(int servers, int workers, int slots, std::vector<std::string> server_flags = {},
                 std::vector<std::string> worker_flags = {})
      : slots_(slots), server_flags_(std::move(server_flags)), worker_flags_(std::move(worker_flags)) {
    dir_ = fs::temp_directory_path() / absl::StrCat("fulcrum-e2e-cluster-", getpid(), "-", counter_++);
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "logs");
    coordinator_ = absl::StrCat("127.0.0.1:", FreePort());
    Start("coordinator", {Bin("server/fulcrum-coordinator"), "--listen=" + coordinator_,
                          "--data_dir=" + (dir_ / "coordinator").string(), absl::StrCat("--min_servers=", servers),
                          // 5 s: a server starved of CPU for 2 s on a loaded 2-core CI
                          // machine was once declared dead mid-start-up.
                          "--heartbeat_interval_ms=300", "--node_timeout_ms=5000",
                          // Plaintext: these tests are about training and recovery;
                          // security_e2e_test runs a cluster with mutual TLS and tokens.
                          "--insecure"});
    for (int i = 0; i < servers; ++i) {
      AddServer();
    }
    for (int i = 0; i < workers; ++i) AddWorker();
    stub_ = v1::JobService::NewStub(CreateFulcrumChannel(coordinator_, 0, *security::Transport::Plaintext()));
    cluster_ = v1::ClusterService::NewStub(CreateFulcrumChannel(coordinator_, 0, *security::Transport::Plaintext()));
    // Everyone registered.
    for (int tries = 0; tries < 200 && Alive() < servers + workers; ++tries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    REQUIRE(Alive() == servers + workers);
  }
  ~ProcessCluster() {
    for (auto it = pids_.rbegin(); it != pids_.rend(); ++it) kill(it->second, SIGTERM);
    for (auto& [name, pid] : pids_) {
      int status;
      waitpid(pid, &status, 0);
    }
    // A failed REQUIRE or FAIL unwinds through here: the end of every
    // process's log goes to stderr, since the directory is then removed
    // (FULCRUM_TEST_KEEP_DIR=1 keeps it).
    const bool keep = getenv("FULCRUM_TEST_KEEP_DIR") != nullptr;
    if (std::uncaught_exceptions() > 0) DumpLogs(keep);
    if (!keep) fs::remove_all(dir_);
  }

  // A server with its checkpoints in <dir>/server-N.
  void AddServer() {
    const std::string name = absl::StrCat("server-", servers_++);
    std::vector<std::string> args = {Bin("server/fulcrum-server"), absl::StrCat("--listen=127.0.0.1:", FreePort()),
                                     "--coordinator=" + coordinator_, "--data_dir=" + (dir_ / name).string(),
                                     "--insecure"};
    args.insert(args.end(), server_flags_.begin(), server_flags_.end());
    Start(name, args);
  }

  // kill -9 the process `name` ("coordinator", "server-1", ...); with
  // `restart`, start it again with the same flags (port, data directory).
  void Kill(const std::string& name, bool restart) {
    for (auto& [n, pid] : pids_) {
      if (n != name) continue;
      REQUIRE(kill(pid, SIGKILL) == 0);
      int status;
      waitpid(pid, &status, 0);
      if (!restart) return;
      const std::string log = (dir_ / "logs" / absl::StrCat(name, "-", ++restarts_, ".log")).string();
      pid = Spawn(args_[name], log);
      // Back at the same port, or the test says why (another process may
      // have taken the port meanwhile) instead of waiting for it.
      int port = 0;
      for (const std::string& a : args_[name]) {
        if (a.rfind("--listen=", 0) == 0) port = std::stoi(a.substr(a.rfind(':') + 1));
      }
      if (port != 0 && !testing::WaitForListening(port, 30000, pid)) {
        FAIL(name << " restarted as pid " << pid << " is not listening on port " << port << " after 30 s: "
                  << testing::ReadFile(log));
      }
      return;
    }
    FAIL("no process " << name);
  }

  void AddWorker() {
    std::vector<std::string> args = {Bin("worker/fulcrum-worker"), "--coordinator=" + coordinator_, "--device=cpu",
                                     std::string("--data_dir=") + FULCRUM_TEST_DATA_DIR,
                                     absl::StrCat("--slots=", slots_), "--insecure"};
    args.insert(args.end(), worker_flags_.begin(), worker_flags_.end());
    Start(absl::StrCat("worker-", workers_++), args);
  }

  // What the process `name` logged so far (since its last restart).
  std::string Log(const std::string& name) const {
    return testing::ReadFile((dir_ / "logs" / (name + ".log")).string());
  }

  int Alive() {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::ClusterState cs;
    if (!cluster_->GetCluster(&ctx, v1::GetClusterRequest(), &cs).ok()) return 0;
    int n = 0;
    for (const auto& node : cs.nodes()) n += node.alive() ? 1 : 0;
    return n;
  }

  // The worker process (by its node id) running `job`'s `rank`.
  pid_t WorkerPid(const std::string& job, uint32_t rank) {
    v1::Job j = Get(job);
    const std::string node = j.status().workers(static_cast<int>(rank)).worker_id();
    grpc::ClientContext ctx;
    v1::ClusterState cs;
    REQUIRE(cluster_->GetCluster(&ctx, v1::GetClusterRequest(), &cs).ok());
    for (const auto& n : cs.nodes()) {
      if (n.info().node_id() == node) return static_cast<pid_t>(n.info().pid());
    }
    return -1;
  }

  // The pid of the process started as `name` ("server-0", "worker-1", ...).
  pid_t Pid(const std::string& name) const {
    for (const auto& [n, pid] : pids_) {
      if (n == name) return pid;
    }
    return -1;
  }

  // Starts fulcrumctl; Wait(pid) collects it. Its output goes to `log`.
  pid_t CtlAsync(const std::vector<std::string>& args, const std::string& log) {
    std::vector<std::string> argv = {Bin("server/fulcrumctl"), "--coordinator=" + coordinator_, "--insecure"};
    argv.insert(argv.end(), args.begin(), args.end());
    return Spawn(argv, log);
  }

  // Runs fulcrumctl; returns its exit code and output.
  int Ctl(const std::vector<std::string>& args, std::string* out) {
    const std::string log = (dir_ / absl::StrCat("ctl-", ctl_++, ".out")).string();
    std::vector<std::string> argv = {Bin("server/fulcrumctl"), "--coordinator=" + coordinator_, "--insecure"};
    argv.insert(argv.end(), args.begin(), args.end());
    const pid_t pid = Spawn(argv, log);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    *out = testing::ReadFile(log);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  std::string Submit(const v1::JobSpec& spec) {
    grpc::ClientContext ctx;
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    grpc::Status s = stub_->SubmitJob(&ctx, req, &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
    return resp.job_id();
  }

  // Asks again for up to 20 s while the coordinator is unreachable (a
  // test may be restarting it).
  v1::Job Get(const std::string& id) {
    v1::JobRef ref;
    ref.set_job_id(id);
    v1::Job j;
    grpc::Status s;
    for (int tries = 0; tries < 100; ++tries) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      s = stub_->GetJob(&ctx, ref, &j);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    INFO(s.error_message());
    REQUIRE(s.ok());
    return j;
  }

  v1::ClusterState Cluster() {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::ClusterState cs;
    REQUIRE(cluster_->GetCluster(&ctx, v1::GetClusterRequest(), &cs).ok());
    return cs;
  }

  // Fails with the logs before ctest's 300 s per-case timeout would kill
  // the test silently.
  v1::Job WaitEnd(const std::string& id, absl::Duration limit = absl::Minutes(4)) {
    limit = std::min(limit, budget_end_ - absl::Now());
    const absl::Time end = absl::Now() + limit;
    for (;;) {
      v1::Job j = Get(id);
      const auto s = j.status().state();
      if (s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED) return j;
      if (absl::Now() > end) {
        FAIL("job " << id << " still " << v1::JobState_Name(s) << " after " << absl::FormatDuration(limit)
                    << ": " << j.status().message());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  const fs::path& dir() const { return dir_; }

 private:
  void DumpLogs(bool kept) const {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir_ / "logs", ec)) {
      const std::string text = testing::ReadFile(entry.path().string());
      const size_t from = text.size() > 6000 ? text.size() - 6000 : 0;
      std::cerr << "---- last " << text.size() - from << " bytes of " << entry.path().string() << "\n"
                << text.substr(from) << "\n";
    }
    std::cerr << "---- " << dir_.string() << (kept ? " kept" : " removed") << std::endl;
  }

  void Start(const std::string& name, std::vector<std::string> args) {
    args.push_back("--metrics_addr=127.0.0.1:0");  // tests run side by side
    args_[name] = args;
    pids_.emplace_back(name, Spawn(std::move(args), (dir_ / "logs" / (name + ".log")).string()));
  }

  static inline int counter_ = 0;
  const absl::Time budget_end_ = absl::Now() + absl::Seconds(280);
  fs::path dir_;
  std::string coordinator_;
  int slots_;
  std::vector<std::string> server_flags_;
  std::vector<std::string> worker_flags_;
  int workers_ = 0;
  int servers_ = 0;
  int restarts_ = 0;
  int ctl_ = 0;
  std::map<std::string, std::vector<std::string>> args_;
  std::vector<std::pair<std::string, pid_t>> pids_;
  std::unique_ptr<v1::JobService::Stub> stub_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
};

v1::JobSpec Spec(const std::string& file) {
  v1::JobSpec s;
  absl::Status st = config::ParseSpecFile(Example(file), &s);
  INFO(st.ToString());
  REQUIRE(st.ok());
  return s;
}

void Report(const v1::Job& j) {
  WARN(j.id() << " " << v1::JobState_Name(j.status().state()) << ": test accuracy " << j.status().test_accuracy()
               << ", " << (j.status().end_time_unix_ms() - j.status().start_time_unix_ms()) / 1000.0
               << " s, fingerprint " << j.status().weights_fingerprint() << ", restarts " << j.status().restarts()
               << " - " << j.status().message());
}

// Waits until job `id` is 1/`part` done, then kills (SIGKILL) the worker
// running `rank`.
void KillRankWorker(ProcessCluster& cluster, const std::string& id, uint32_t rank, int part) {
  for (int tries = 0; tries < 600; ++tries) {
    v1::Job j = cluster.Get(id);
    if (j.status().total_steps() > 0 && j.status().step() * part > j.status().total_steps()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const pid_t victim = cluster.WorkerPid(id, rank);
  REQUIRE(victim > 0);
  REQUIRE(kill(victim, SIGKILL) == 0);
}

TEST_CASE("fulcrumctl submit trains the MNIST MLP to >= 0.97 under BSP, twice at once, with bit-identical weights",
          "[e2e]") {
  ProcessCluster cluster(2, 2, /*slots=*/2);
  // The first through fulcrumctl exactly as a user would (it watches to the end).
  std::string second;
  std::thread other([&] { second = cluster.Submit(Spec("mnist-mlp.yaml")); });
  std::string out;
  const int rc = cluster.Ctl({"submit", "-f", Example("mnist-mlp.yaml")}, &out);
  other.join();
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find("SUCCEEDED: test accuracy 0.9") != std::string::npos);
  // The live lines show the test accuracy only once rank 0 has evaluated an
  // epoch: rank 1 reports each epoch first, and its report carries no test
  // figures (a "test_acc 0.0000" line in the middle of training).
  int test_figures = 0;
  for (size_t at = out.find(" test_acc "); at != std::string::npos; at = out.find(" test_acc ", at + 1)) {
    ++test_figures;
    CHECK(std::stod(out.substr(at + 10, 6)) >= 0.5);
  }
  CHECK(test_figures > 0);
  const v1::Job b = cluster.WaitEnd(second);
  std::string json;
  REQUIRE(cluster.Ctl({"--output=json", "list"}, &json) == 0);
  REQUIRE(json.find("\"jobs\"") != std::string::npos);
  const std::string first = second == "mnist-mlp-1" ? "mnist-mlp-2" : "mnist-mlp-1";
  const v1::Job a = cluster.Get(first);
  Report(a);
  Report(b);
  REQUIRE(a.status().state() == v1::SUCCEEDED);
  REQUIRE(b.status().state() == v1::SUCCEEDED);
  CHECK(a.status().test_accuracy() >= 0.97);
  CHECK(b.status().test_accuracy() >= 0.97);
  // Same spec and seed, run side by side on the same servers: the same bits.
  CHECK(a.status().weights_fingerprint().size() == 16);
  CHECK(a.status().weights_fingerprint() == b.status().weights_fingerprint());
  // Cancelling a finished job is refused with an exit code a script can use.
  CHECK(cluster.Ctl({"cancel", first}, &out) == 5);
  CHECK(out.find("already ended: SUCCEEDED") != std::string::npos);
  CHECK(cluster.Ctl({"status", "nope-1"}, &out) == 3);
}

TEST_CASE("ASP and SSP(2) train the MNIST MLP to >= 0.96", "[e2e]") {
  ProcessCluster cluster(2, 2, /*slots=*/2);
  v1::JobSpec asp = Spec("mnist-mlp.yaml");
  asp.set_name("mnist-asp");
  asp.mutable_consistency()->set_model(v1::ConsistencySpec::ASP);
  v1::JobSpec ssp = Spec("mnist-mlp.yaml");
  ssp.set_name("mnist-ssp");
  ssp.mutable_consistency()->set_model(v1::ConsistencySpec::SSP);
  ssp.mutable_consistency()->set_staleness(2);
  const std::string a = cluster.Submit(asp), s = cluster.Submit(ssp);
  for (const std::string& id : {a, s}) {
    const v1::Job j = cluster.WaitEnd(id);
    Report(j);
    CHECK(j.status().state() == v1::SUCCEEDED);
    CHECK(j.status().test_accuracy() >= 0.96);
  }
}

TEST_CASE("batch_size auto: rank 0 finds the batch, every rank trains with it, and MNIST still reaches >= 0.96",
          "[e2e]") {
  ProcessCluster cluster(2, 2, /*slots=*/2);
  std::string out;
  const int rc = cluster.Ctl({"submit", "-f", Example("mnist-mlp-auto-batch.yaml")}, &out);
  INFO(out);
  CHECK(rc == 0);
  const v1::Job j = cluster.Get("mnist-mlp-auto-1");
  Report(j);
  REQUIRE(j.status().state() == v1::SUCCEEDED);
  CHECK(j.status().test_accuracy() >= 0.96);
  const uint32_t batch = j.status().batch_size();
  WARN("batch_size auto chose " << j.status().batch_size_choice());
  CHECK(batch >= 32);
  CHECK(batch <= 256);
  CHECK(absl::StrContains(j.status().batch_size_choice(), absl::StrCat("batch ", batch)));
  for (const v1::WorkerProgress& w : j.status().workers()) {
    CHECK(w.batch_size() == batch);
    CHECK(w.lr_scale() == Approx(batch / 32.0));  // warm-up over by the end
  }
  // The steps per rank follow the chosen batch: 30000 examples per rank.
  CHECK(j.status().total_steps() == 3 * ((30000 + batch - 1) / batch));
  std::string status;
  REQUIRE(cluster.Ctl({"status", "mnist-mlp-auto-1"}, &status) == 0);
  CHECK(absl::StrContains(status, absl::StrCat("batch auto: ", batch)));
  CHECK(absl::StrContains(status, "batch size: batch "));
}

TEST_CASE("killing a worker mid-job (kill -9) moves its rank and the job still succeeds", "[e2e]") {
  ProcessCluster cluster(2, 3, /*slots=*/1);  // one spare worker
  const std::string id = cluster.Submit(Spec("mnist-mlp.yaml"));
  KillRankWorker(cluster, id, 1, 5);
  const v1::Job j = cluster.WaitEnd(id);
  Report(j);
  CHECK(j.status().state() == v1::SUCCEEDED);
  CHECK(j.status().test_accuracy() >= 0.96);
  CHECK(j.status().restarts() == 1);
  CHECK(j.status().workers(1).incarnation() == 1);
  bool replaced = false;
  for (const auto& c : j.status().conditions()) replaced |= c.reason() == "WorkerLost";
  CHECK(replaced);
}

TEST_CASE("local steps (H = 16): MNIST reaches >= 0.955 in 3 epochs, a worker killed mid-round is replaced, and "
          "cuts land on round boundaries", "[e2e]") {
  ProcessCluster cluster(2, 3, /*slots=*/1);  // one spare worker
  const std::string id = cluster.Submit(Spec("mnist-mlp-local.yaml"));
  KillRankWorker(cluster, id, 1, 3);
  const v1::Job j = cluster.WaitEnd(id);
  Report(j);
  CHECK(j.status().state() == v1::SUCCEEDED);
  // The kill loses up to one round of rank 1's inner steps: 0.9663-0.9725 in
  // runs on the reference machine.
  CHECK(j.status().test_accuracy() >= 0.955);
  CHECK(j.status().restarts() == 1);
  CHECK(j.status().workers(1).incarnation() == 1);
  // The final cut covers every round; its step is in the ranks' steps.
  REQUIRE(j.status().checkpoints_size() > 0);
  const v1::CheckpointInfo& last = *j.status().checkpoints().rbegin();
  CHECK(last.trigger() == "final");
  CHECK(last.step() == j.status().total_steps());
  // Every rank ran every step: the replacement resumed at a round's start.
  for (const v1::WorkerProgress& w : j.status().workers()) CHECK(w.step() == j.status().total_steps());
  std::string status;
  REQUIRE(cluster.Ctl({"status", id}, &status) == 0);
  // 30000 examples per rank, batch 32: 938 steps an epoch, 59 rounds of 16.
  CHECK(absl::StrContains(status, "rounds:    177 of 177 done (16 inner steps each"));
}

TEST_CASE("sparse logistic regression (ASP) and a factorization machine with local steps on hashed SpamAssassin "
          "reach >= 0.97",
          "[e2e]") {
  // The hashed corpus, made from the fetched mails (deterministic; cached).
  const std::string d = std::string(FULCRUM_TEST_DATA_DIR) + "/spam-assassin";
  if (!fs::exists(d + "/hashed.test")) {
    const std::string cmd = Bin("worker/fulcrum-text2libsvm") + " --input=" + d +
                            " --positive=spam --extension=.txt --train=" + d + "/hashed.train --test=" + d +
                            "/hashed.test";
    REQUIRE(std::system(cmd.c_str()) == 0);
  }
  ProcessCluster cluster(2, 2, /*slots=*/1);
  std::string out;
  const int rc = cluster.Ctl({"submit", "-f", Example("spam-sparse-lr.json")}, &out);
  INFO(out);
  CHECK(rc == 0);
  const v1::Job j = cluster.Get("spam-lr-1");
  Report(j);
  CHECK(j.status().state() == v1::SUCCEEDED);
  CHECK(j.status().test_accuracy() >= 0.97);
  CHECK(j.status().test_auc() >= 0.97);  // a binary task: its AUC is reported too
  // Sparse rows by step, the dense bias by rounds, over gRPC and shared memory.
  const int rc_fm = cluster.Ctl({"submit", "-f", Example("spam-fm-local.yaml")}, &out);
  INFO(out);
  CHECK(rc_fm == 0);
  const v1::Job fm = cluster.Get("spam-fm-local-2");
  Report(fm);
  CHECK(fm.status().state() == v1::SUCCEEDED);
  CHECK(fm.status().test_accuracy() >= 0.97);
  std::string status;
  REQUIRE(cluster.Ctl({"status", "spam-fm-local-2"}, &status) == 0);
  INFO(status);
  CHECK(absl::StrContains(status, "rounds:"));
  CHECK(absl::StrContains(status, " auc 0.9"));
}

// 300k rows from the planted model (deterministic; cached in
// <test data>/ctr-e2e), small vocabularies so two epochs see each id often
// enough to learn it; returns the planted model's test AUC.
double CtrE2eData() {
  const std::string d = std::string(FULCRUM_TEST_DATA_DIR) + "/ctr-e2e";
  const std::string planted = d + "/planted.txt";
  if (!fs::exists(planted)) {
    fs::create_directories(d);
    const std::string cmd = Bin("worker/fulcrum-datagen") + " ctr --train=" + d + "/train.tsv.gz --test=" + d +
                            "/test.tsv.gz --train_rows=300000 --test_rows=30000 --vocab=100 > " + d + "/gen.out";
    REQUIRE(std::system(cmd.c_str()) == 0);
    fs::rename(d + "/gen.out", planted);
  }
  std::ifstream gen(planted);
  std::string text((std::istreambuf_iterator<char>(gen)), std::istreambuf_iterator<char>());
  const size_t at = text.find("best AUC ");
  REQUIRE(at != std::string::npos);
  return std::stod(text.substr(at + 9));
}

TEST_CASE("DLRM and Wide and Deep and DeepFM graph specs train on generated click-through data through real processes",
          "[e2e]") {
  const double best_auc = CtrE2eData();
  ProcessCluster cluster(2, 2, /*slots=*/1);
  int n = 0;
  for (const char* example : {"ctr-dlrm.yaml", "ctr-deepfm.yaml", "ctr-wide-deep.yaml"}) {
    // The example as shipped, on this test's data, with its learning rate
    // for one short epoch.
    std::ifstream in(Example(example));
    std::string spec((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const char* split : {"train", "test"}) {
      const std::string from = absl::StrCat("path: ctr/", split), to = absl::StrCat("path: ctr-e2e/", split);
      REQUIRE(absl::StrContains(spec, from));
      spec.replace(spec.find(from), from.size(), to);
    }
    // DeepFM's embeddings get a lifecycle: ids admitted on their second
    // push, at most 512 rows (of about 770 ids; 2 a virtual shard) kept by
    // LFU.
    const bool capped = std::string(example) == "ctr-deepfm.yaml";
    if (capped) {
      const std::string from = "{name: embeddings, op: embedding, inputs: [categorical], dim: 8}";
      REQUIRE(absl::StrContains(spec, from));
      spec.replace(spec.find(from), from.size(),
                   "{name: embeddings, op: embedding, inputs: [categorical], dim: 8, admission: {min_count: 2}, "
                   "eviction: {policy: LFU, max_rows: 512}}");
    }
    const fs::path file = cluster.dir() / example;
    std::ofstream(file) << spec;
    std::string out;
    const int rc = cluster.Ctl({"submit", "-f", file.string()}, &out);
    INFO(out);
    CHECK(rc == 0);
    CHECK(absl::StrContains(out, "dense parameters:"));  // the graph's table, printed before submitting
    const std::string name = std::string(example).substr(0, std::string(example).size() - 5);
    const v1::Job j = cluster.Get(absl::StrCat(name, "-", ++n));
    Report(j);
    WARN(example << ": test AUC " << j.status().test_auc() << ", planted " << best_auc);
    CHECK(j.status().state() == v1::SUCCEEDED);
    // Within 0.06 of the planted model in two epochs of 300k rows (about
    // 0.005 on 2M rows: ctr_bench.sh). Every table is in the final cut.
    CHECK(j.status().test_auc() > best_auc - 0.06);
    CHECK_FALSE(absl::StrContains(j.status().message(), "no final checkpoint"));
    CHECK(j.status().test_auc() < best_auc + 0.01);
    // fulcrumctl status shows each sparse table as its servers last said.
    std::string status;
    REQUIRE(cluster.Ctl({"status", j.id()}, &status) == 0);
    INFO(status);
    CHECK(absl::StrContains(status, "  table embeddings: "));
    if (capped) {
      REQUIRE(j.status().sparse_tables_size() > 0);
      const v1::SparseTableStats* emb = nullptr;
      for (const auto& t : j.status().sparse_tables()) {
        if (t.table() == "embeddings") emb = &t;
      }
      REQUIRE(emb != nullptr);
      CHECK(emb->rows() <= 512);
      CHECK(emb->admitted() > 0);
      CHECK(emb->rejected() > 0);
      CHECK(emb->evicted_cap() > 0);
      CHECK(emb->sketch_bytes() > 0);
      CHECK(absl::StrContains(status, "; admitted "));
    }
  }
}

TEST_CASE("fulcrumctl list reads every page of a registry of 1001 jobs", "[e2e]") {
  ProcessCluster cluster(1, 0, 1);  // no workers: the jobs wait
  v1::JobSpec spec = Spec("digits-softmax.yaml");
  spec.set_name("paged");
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < 1001; ++i) cluster.Submit(spec);
  INFO("1001 submits took " << absl::FormatDuration(absl::Now() - t0));
  std::string out;
  REQUIRE(cluster.Ctl({"list"}, &out) == 0);
  size_t lines = 0;
  for (size_t at = out.find("\npaged-"); at != std::string::npos; at = out.find("\npaged-", at + 1)) ++lines;
  lines += absl::StartsWith(out, "paged-") ? 1 : 0;
  CHECK(lines == 1001);
  CHECK(out.find("paged-1 ") != std::string::npos);
  CHECK(out.find("paged-1001 ") != std::string::npos);
  // JSON: one list, every job once, oldest first, no page token.
  REQUIRE(cluster.Ctl({"--output=json", "list"}, &out) == 0);
  size_t ids = 0, last = 0;
  bool ordered = true;
  for (size_t at = out.find("\"id\":\"paged-"); at != std::string::npos; at = out.find("\"id\":\"paged-", at + 1)) {
    const size_t n = std::stoul(out.substr(at + 12));
    ordered = ordered && n > last;
    last = n;
    ++ids;
  }
  CHECK(ids == 1001);
  CHECK(ordered);
  CHECK(out.find("next_page_token") == std::string::npos);
}

TEST_CASE("fulcrumctl watch gives up with exit code 4 on a coordinator that does not come back", "[e2e]") {
  ProcessCluster cluster(1, 0, 1);  // no workers: the job waits
  const std::string id = cluster.Submit(Spec("digits-softmax.yaml"));
  const std::string log = (cluster.dir() / "watch.out").string();
  const pid_t watch = cluster.CtlAsync({"watch", id, "--reconnect_seconds=2"}, log);
  for (int tries = 0; tries < 100 && testing::ReadFile(log).find(id + " ") == std::string::npos; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE(testing::ReadFile(log).find(id + " ") != std::string::npos);
  const absl::Time killed = absl::Now();
  cluster.Kill("coordinator", /*restart=*/false);
  int status = 0;
  REQUIRE(waitpid(watch, &status, 0) == watch);
  const absl::Duration took = absl::Now() - killed;
  const std::string out = testing::ReadFile(log);
  INFO(out);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 4);  // the coordinator is unreachable
  CHECK(out.find("lost the coordinator") != std::string::npos);
  CHECK(out.find("(no coordinator for 2s)") != std::string::npos);
  CHECK(out.find("reconnected") == std::string::npos);
  CHECK(took >= absl::Seconds(2));
  CHECK(took < absl::Seconds(10));
}

TEST_CASE("fulcrumctl reports bad specs and flags with exit code 2 and says why a job waits or fails", "[e2e]") {
  ProcessCluster cluster(1, 1, 1);
  const fs::path bad = cluster.dir() / "bad.yaml";
  std::ofstream(bad) << "name: Bad\nmodel: {type: cnn}\nnum_workers: 0\n";
  std::string out;
  CHECK(cluster.Ctl({"submit", "-f", bad.string()}, &out) == 2);
  CHECK(out.find("name: 'Bad' must be at most 48 lowercase letters") != std::string::npos);
  CHECK(out.find("model.type: 'cnn' is not one of: softmax, mlp, sparse_lr, fm, mf") != std::string::npos);
  CHECK(out.find("num_workers: 0 must be 1 to 1024") != std::string::npos);
  CHECK(cluster.Ctl({"submit", "-f", (cluster.dir() / "missing.yaml").string()}, &out) == 2);
  CHECK(out.find("cannot open spec file") != std::string::npos);
  CHECK(cluster.Ctl({"--coordinator=", "list"}, &out) == 2);
  CHECK(out.find("--coordinator is empty") != std::string::npos);

  // A valid job that needs more workers than the cluster has waits, and says
  // for what, rank by rank; it can be cancelled while it waits.
  REQUIRE(cluster.Ctl({"submit", "--no-wait", "-f", Example("mnist-softmax.yaml")}, &out) == 0);
  const size_t at = out.find("submitted job ");
  REQUIRE(at != std::string::npos);
  const std::string id = out.substr(at + 14, out.find('\n', at) - at - 14);
  CHECK(id == "mnist-softmax-1");
  // The scheduler says why on its next tick (after the shard map is installed).
  for (int tries = 0; tries < 50; ++tries) {
    REQUIRE(cluster.Ctl({"status", id}, &out) == 0);
    if (out.find("WorkersNotReady") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(out.find("PENDING") != std::string::npos);
  CHECK(out.find("needs 2 workers with a free slot; 1 free of 1 live") != std::string::npos);
  CHECK(out.find("rank 1   -          pending    waiting for a worker") != std::string::npos);
  CHECK(out.find("loss 0.0000") == std::string::npos);
  CHECK(cluster.Ctl({"cancel", id}, &out) == 0);
  REQUIRE(cluster.Ctl({"status", id}, &out) == 0);
  CHECK(out.find("CANCELLED") != std::string::npos);

  // A job whose quota cannot hold one chunk fails, and says so, with the
  // numbers; its rank never reported a step, and the status says that
  // rather than printing zeros.
  const fs::path small = cluster.dir() / "small-quota.yaml";
  {
    std::ifstream in(Example("mnist-softmax.yaml"));
    std::ofstream o(small);
    for (std::string line; std::getline(in, line);) {
      o << (line.rfind("num_workers:", 0) == 0 ? "num_workers: 1" : line) << "\n";
    }
    o << "quota_bytes: 1000\n";
  }
  CHECK(cluster.Ctl({"submit", "-f", small.string()}, &out) == 1);
  CHECK(out.find("FAILED") != std::string::npos);
  CHECK(out.find("would exceed its parameter memory quota of 1000 bytes") != std::string::npos);
  REQUIRE(cluster.Ctl({"status", "mnist-softmax-2"}, &out) == 0);
  CHECK(out.find("rank 0   worker-") != std::string::npos);
  CHECK(out.find("no step yet") != std::string::npos);
  CHECK(out.find("step 0/0") == std::string::npos);

  // `cluster` lists each node with its pid, so an operator can tell which
  // process (and log) is which node.
  REQUIRE(cluster.Ctl({"cluster"}, &out) == 0);
  INFO(out);
  CHECK(out.find("PID") != std::string::npos);
  for (const char* name : {"server-0", "worker-0"}) {
    const size_t at = out.find(absl::StrCat(" ", cluster.Pid(name), " "));
    REQUIRE(at != std::string::npos);
    const size_t line = out.rfind('\n', at) + 1;
    CHECK(out.substr(line, out.find('\n', at) - line).find(" alive ") != std::string::npos);
  }
  CHECK(out.find("shard map version 1: 256 virtual shards over 127.0.0.1:") != std::string::npos);
}

// ---------------------------------------------------------------- checkpoints and recovery

// The MNIST MLP for 2 epochs (1876 steps per rank) under BSP, a checkpoint
// every `every` steps.
v1::JobSpec Checkpointed(uint32_t every, uint32_t keep) {
  v1::JobSpec s = Spec("mnist-mlp.yaml");
  // Long enough for periodic cuts, kills and restarts mid-job: 2 epochs
  // last about a second once workers use shared memory.
  s.set_epochs(6);
  s.mutable_checkpoint()->set_every_steps(every);
  s.mutable_checkpoint()->set_keep(keep);
  return s;
}

// Waits until the job has committed at least `checkpoints` cuts and is
// `fraction` done: up to 3 minutes (an undisturbed job takes 30-90 s on 2
// busy cores).
v1::Job WaitFor(ProcessCluster& cluster, const std::string& id, int checkpoints, double fraction) {
  for (const absl::Time limit = absl::Now() + absl::Minutes(3); absl::Now() < limit;) {
    v1::Job j = cluster.Get(id);
    const auto& s = j.status();
    if (s.state() != v1::RUNNING && s.state() != v1::PENDING) FAIL("job ended early: " << s.message());
    if (s.checkpoints_size() >= checkpoints && s.total_steps() > 0 &&
        static_cast<double>(s.step()) >= fraction * static_cast<double>(s.total_steps())) {
      return j;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  FAIL("job " << id << " did not get there");
  return {};
}

std::string Conditions(const v1::Job& j) {
  std::string out;
  for (const auto& c : j.status().conditions()) absl::StrAppend(&out, c.type(), "/", c.reason(), ": ", c.message(), "\n");
  return out;
}

bool HasReason(const v1::Job& j, const std::string& reason) {
  for (const auto& c : j.status().conditions()) {
    if (c.reason() == reason) return true;
  }
  return false;
}

// Runs tests/integration/safetensors_check.py on `file`.
int CheckSafetensors(ProcessCluster& cluster, const std::string& file, const std::string& fingerprint,
                     std::string* out) {
  const std::string log = (cluster.dir() / "safetensors_check.out").string();
  const pid_t pid = Spawn({"/usr/bin/python3", std::string(FULCRUM_SOURCE_DIR) + "/tests/integration/safetensors_check.py",
                           file, "--fingerprint", fingerprint, "--min-tensors", "4"},
                          log);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  *out = testing::ReadFile(log);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_CASE("a server killed with kill -9 and restarted, or frozen and resumed, rolls the job back to its last "
          "checkpoint and ends with the weights of an undisturbed run whose final cut exports as safetensors",
          "[e2e][checkpoint]") {
  ProcessCluster cluster(2, 2, /*slots=*/1);
  const std::string clean = cluster.Submit(Checkpointed(200, 2));
  const v1::Job a = cluster.WaitEnd(clean);
  Report(a);
  INFO(Conditions(a));
  REQUIRE(a.status().state() == v1::SUCCEEDED);
  REQUIRE(a.status().checkpoints_size() == 2);  // keep: 2
  CHECK(a.status().checkpoints(1).trigger() == "final");
  CHECK(a.status().checkpoints(1).step() == a.status().total_steps());
  CHECK(a.status().checkpoints(0).trigger() == "steps");
  CHECK(a.status().checkpoints(0).step() % 200 == 0);
  CHECK(a.status().checkpoints(0).positions_size() == 2);
  WARN("checkpoint pause " << a.status().checkpoints(0).pause_seconds() * 1e3 << " ms, "
                           << a.status().checkpoints(0).bytes() << " bytes");

  // The final cut as safetensors, read back by an independent reader: its
  // dense tensors hash to the fingerprint rank 0 reported for its weights.
  const std::string file = (cluster.dir() / "model.safetensors").string();
  std::string out;
  REQUIRE(cluster.Ctl({"export", clean, "-o", file}, &out) == 0);
  INFO(out);
  // What it exports and how far it got, then the result (stderr is not a
  // terminal here: a line per tenth received).
  CHECK(out.find(absl::StrCat("exporting checkpoint ", a.status().checkpoints(1).cut_id(), " of job ", clean,
                              " (step ", a.status().checkpoints(1).step())) != std::string::npos);
  CHECK(out.find("(100%)\n") != std::string::npos);
  CHECK(out.find("exported checkpoint ") != std::string::npos);
  std::string check;
  const int rc = CheckSafetensors(cluster, file, a.status().weights_fingerprint(), &check);
  INFO(check);
  REQUIRE(rc == 0);

  const std::string id = cluster.Submit(Checkpointed(200, 2));
  WaitFor(cluster, id, 1, 0.4);
  cluster.Kill("server-1", /*restart=*/true);
  const v1::Job b = cluster.WaitEnd(id);
  Report(b);
  INFO(Conditions(b));
  REQUIRE(b.status().state() == v1::SUCCEEDED);
  CHECK(b.status().rollbacks() >= 1);
  CHECK(HasReason(b, "CheckpointRestored"));
  CHECK(b.status().weights_fingerprint() == a.status().weights_fingerprint());
  CHECK(std::abs(b.status().test_accuracy() - a.status().test_accuracy()) <= 0.005);

  // A server frozen (SIGSTOP: a hung host, a long GC-like pause) is declared
  // dead; the job waits for it, since it holds part of the cut, and says so
  // instead of showing its last speed. Resumed, the old process finds
  // itself dead, registers again and the job rolls back as above.
  const std::string frozen = cluster.Submit(Checkpointed(200, 2));
  WaitFor(cluster, frozen, 1, 0.4);
  const pid_t server1 = cluster.Pid("server-1");
  REQUIRE(kill(server1, SIGSTOP) == 0);
  v1::Job waiting;
  for (int tries = 0; tries < 600; ++tries) {
    waiting = cluster.Get(frozen);
    if (waiting.status().message().find("to come back") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string shown;
  const int shown_rc = cluster.Ctl({"status", frozen}, &shown);
  REQUIRE(kill(server1, SIGCONT) == 0);
  INFO(Conditions(waiting));
  CHECK(waiting.status().reason() == "ServerLost");
  CHECK(waiting.status().samples_per_second() == 0);
  CHECK(waiting.status().eta_seconds() == 0);
  REQUIRE(shown_rc == 0);
  INFO(shown);
  const size_t line = shown.find("\n  progress:  " + frozen);
  REQUIRE(line != std::string::npos);
  const std::string progress = shown.substr(line + 1, shown.find('\n', line + 1) - line - 1);
  CHECK(progress.find(" - waiting for 127.0.0.1:") != std::string::npos);
  CHECK(progress.find("ETA") == std::string::npos);
  const v1::Job c = cluster.WaitEnd(frozen);
  Report(c);
  INFO(Conditions(c));
  REQUIRE(c.status().state() == v1::SUCCEEDED);
  CHECK(c.status().rollbacks() >= 1);
  CHECK(c.status().weights_fingerprint() == a.status().weights_fingerprint());
}

// DLRM on the e2e click data (300k rows; cached by the graph test) whose
// embeddings keep 512 rows in memory (2 a virtual shard, of about 770 ids)
// and the rest on the servers' disks: rows move between the tiers every
// step. One epoch, a cut every 100 steps.
v1::JobSpec SpilledDlrm() {
  CtrE2eData();
  std::ifstream in(Example("ctr-dlrm.yaml"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* split : {"train", "test"}) {
    const std::string from = absl::StrCat("path: ctr/", split), to = absl::StrCat("path: ctr-e2e/", split);
    REQUIRE(absl::StrContains(text, from));
    text.replace(text.find(from), from.size(), to);
  }
  const std::string from = "{name: embeddings, op: embedding, inputs: [categorical], dim: 16}";
  REQUIRE(absl::StrContains(text, from));
  text.replace(text.find(from), from.size(),
               "{name: embeddings, op: embedding, inputs: [categorical], dim: 16, "
               "storage: {memory_bytes: 65536, spill: rocksdb}}");  // 512 rows of 16 weights and 16 accumulators
  const fs::path file = fs::temp_directory_path() / absl::StrCat("spilled-dlrm-", getpid(), ".yaml");
  std::ofstream(file) << text;
  v1::JobSpec s;
  const absl::Status st = config::ParseSpecFile(file.string(), &s);
  fs::remove(file);
  INFO(st.ToString());
  REQUIRE(st.ok());
  s.set_epochs(1);
  s.mutable_checkpoint()->set_every_steps(100);
  s.mutable_checkpoint()->set_keep(2);
  return s;
}

TEST_CASE("a server killed with kill -9 while rows move between its memory and disk: the job rolls back to its last "
          "cut and ends with the weights of an undisturbed run, every row on disk counted",
          "[e2e][checkpoint][cold]") {
  // With prefetch hints (off by default): they must change no weight.
  ProcessCluster cluster(2, 2, /*slots=*/1, {}, {"--prefetch_hints=true"});
  const std::string clean = cluster.Submit(SpilledDlrm());
  const v1::Job a = cluster.WaitEnd(clean);
  Report(a);
  INFO(Conditions(a));
  REQUIRE(a.status().state() == v1::SUCCEEDED);
  const v1::SparseTableStats* emb = nullptr;
  for (const auto& t : a.status().sparse_tables()) {
    if (t.table() == "embeddings") emb = &t;
  }
  REQUIRE(emb != nullptr);
  WARN("embeddings: " << emb->rows() << " rows in memory, " << emb->cold_rows() << " on disk, moved there "
                      << emb->demoted() << ", back " << emb->promoted() << ", read there " << emb->cold_reads()
                      << ", read ahead " << emb->prefetched());
  CHECK(emb->rows() <= 512);
  CHECK(emb->cold_rows() > 0);
  CHECK(emb->promoted() > 0);
  CHECK(emb->cold_reads() > 0);
  CHECK(emb->demoted() - emb->promoted() == emb->cold_rows());
  std::string status;
  REQUIRE(cluster.Ctl({"status", clean}, &status) == 0);
  INFO(status);
  CHECK(absl::StrContains(status, "; on disk "));

  const std::string id = cluster.Submit(SpilledDlrm());
  WaitFor(cluster, id, 1, 0.4);
  cluster.Kill("server-1", /*restart=*/true);
  const v1::Job b = cluster.WaitEnd(id);
  Report(b);
  INFO(Conditions(b));
  REQUIRE(b.status().state() == v1::SUCCEEDED);
  CHECK(b.status().rollbacks() >= 1);
  CHECK(HasReason(b, "CheckpointRestored"));
  // The dense weights depend on every embedding row every step: nothing
  // lost or applied twice.
  CHECK(b.status().weights_fingerprint() == a.status().weights_fingerprint());
  CHECK(b.status().test_auc() == a.status().test_auc());
}

TEST_CASE("a server killed while it writes a checkpoint: the job rolls back to the previous committed one",
          "[e2e][checkpoint]") {
  // Each cut's records wait 1.5 s uncommitted on the servers, and the servers
  // log when a wait starts.
  ProcessCluster cluster(2, 2, /*slots=*/1, {"--fault_checkpoint_commit_delay=1.5s"});
  const std::string id = cluster.Submit(Checkpointed(300, 3));
  const v1::Job before = WaitFor(cluster, id, 1, 0.0);
  const uint64_t first_committed = before.status().checkpoints().rbegin()->cut_id();
  // The next cut server-0 holds uncommitted: kill it inside that window.
  uint64_t held = 0;
  for (int tries = 0; tries < 3000 && held == 0; ++tries) {
    const std::string log = cluster.Log("server-0");
    for (size_t at = log.find("holding cut "); at != std::string::npos; at = log.find("holding cut ", at + 1)) {
      const uint64_t cut = std::strtoull(log.c_str() + at + 12, nullptr, 10);
      if (cut > first_committed) held = cut;
    }
    if (held == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(held > 0);
  const v1::Job at_kill = cluster.Get(id);
  cluster.Kill("server-0", /*restart=*/true);
  const uint64_t committed = at_kill.status().checkpoints().rbegin()->cut_id();
  INFO("held cut " << held << ", last committed " << committed);
  REQUIRE(committed < held);  // 1.5 s is far longer than reading the status
  const v1::Job j = cluster.WaitEnd(id);
  Report(j);
  INFO(Conditions(j));
  REQUIRE(j.status().state() == v1::SUCCEEDED);
  CHECK(j.status().test_accuracy() >= 0.96);
  CHECK(Conditions(j).find(absl::StrCat("rolling back to checkpoint ", committed, " ")) != std::string::npos);
  for (const auto& c : j.status().checkpoints()) CHECK(c.cut_id() != held);  // never committed
}

TEST_CASE("the coordinator killed with kill -9 and restarted mid-job: the job completes", "[e2e][checkpoint]") {
  ProcessCluster cluster(2, 2, /*slots=*/1);
  const std::string id = cluster.Submit(Checkpointed(300, 3));
  WaitFor(cluster, id, 1, 0.2);
  // One on demand, as a user would take it.
  std::string out;
  REQUIRE(cluster.Ctl({"checkpoint", id}, &out) == 0);
  INFO(out);
  CHECK(out.find("checkpoint of job " + id + ": asked; every server writes its part") != std::string::npos);
  CHECK(out.find("(manual)") != std::string::npos);
  // A user watching the job: the watch outlives the coordinator's restart.
  const std::string watch_log = (cluster.dir() / "watch.out").string();
  const pid_t watch = cluster.CtlAsync({"watch", id}, watch_log);
  for (int tries = 0; tries < 100 && testing::ReadFile(watch_log).find(id + " ") == std::string::npos; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  cluster.Kill("coordinator", /*restart=*/true);
  const v1::Job j = cluster.WaitEnd(id);
  Report(j);
  INFO(Conditions(j));
  REQUIRE(j.status().state() == v1::SUCCEEDED);
  CHECK(j.status().test_accuracy() >= 0.96);
  CHECK(j.status().checkpoints_size() == 3);
  REQUIRE(cluster.Ctl({"status", id}, &out) == 0);
  CHECK(out.find("(final)") != std::string::npos);

  int status = 0;
  REQUIRE(waitpid(watch, &status, 0) == watch);
  const std::string watched = testing::ReadFile(watch_log);
  INFO(watched);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(watched.find("fulcrumctl: watch " + id + ": lost the coordinator (") != std::string::npos);
  CHECK(watched.find("reconnecting for up to 5m") != std::string::npos);
  CHECK(watched.find("fulcrumctl: watch " + id + ": reconnected to the coordinator") != std::string::npos);
  CHECK(watched.find("job " + id + " SUCCEEDED: test accuracy") != std::string::npos);
}

TEST_CASE("a cut taken on 2 servers restores onto 3: the job runs again from it to the same final weights",
          "[e2e][checkpoint]") {
  ProcessCluster cluster(2, 2, /*slots=*/1);
  const std::string id = cluster.Submit(Checkpointed(400, 10));
  const v1::Job a = cluster.WaitEnd(id);
  Report(a);
  REQUIRE(a.status().state() == v1::SUCCEEDED);
  REQUIRE(a.status().checkpoints_size() >= 3);
  const v1::CheckpointInfo& mid = a.status().checkpoints(1);
  REQUIRE(mid.servers_size() == 2);

  cluster.AddServer();
  for (int tries = 0; tries < 200 && cluster.Cluster().shard_map().servers_size() < 3; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE(cluster.Cluster().shard_map().servers_size() == 3);
  std::string out;
  REQUIRE(cluster.Ctl({"restore", id, absl::StrCat("--cut=", mid.cut_id())}, &out) == 0);
  INFO(out);
  const v1::Job b = cluster.WaitEnd(id);
  Report(b);
  INFO(Conditions(b));
  REQUIRE(b.status().state() == v1::SUCCEEDED);
  CHECK(Conditions(b).find(absl::StrCat("restored checkpoint ", mid.cut_id(), " (step ", mid.step(), ") onto 3 servers")) !=
        std::string::npos);
  CHECK(b.status().checkpoints().rbegin()->servers_size() == 3);
  CHECK(b.status().weights_fingerprint() == a.status().weights_fingerprint());
}

}  // namespace
}  // namespace fulcrum
