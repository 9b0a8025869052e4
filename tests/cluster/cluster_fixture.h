// The in-process cluster the cluster tests share (tests/cluster/*_test.cc):
// a coordinator, 2 parameter servers and 2 worker daemons in the test
// process, talking gRPC over 127.0.0.1, with the coordinator's state in a
// real RocksDB directory; faults to inject into the coordinator's control of
// the servers; the job API driven the way fulcrumctl does; fake nodes and
// helpers for the coordinator's metrics and long polls.
#ifndef FULCRUM_TESTS_CLUSTER_CLUSTER_FIXTURE_H_
#define FULCRUM_TESTS_CLUSTER_CLUSTER_FIXTURE_H_

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <set>
#include <thread>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>
#include <rocksdb/db.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/config/job_spec.h"
#include "common/config/spec_text.h"
#include "common/metrics/metrics.h"
#include "common/rpc/grpc_util.h"
#include "fulcrum/v1/cluster.grpc.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/rpc/grpc_server_control.h"
#include "server/coordinator/rpc/coordinator_service.h"
#include "server/parameter_server.h"
#include "server/rpc/ps_service.h"
#include "server/rpc/server_agent.h"
#include "tests/testing/fault_fs.h"
#include "tests/testing/process_util.h"
#include "worker/daemon/worker_daemon.h"


namespace fulcrum {
namespace {

namespace fs = std::filesystem;

using testing::FreePort;

inline std::string Example(const std::string& name) {
  return std::string(FULCRUM_SOURCE_DIR) + "/deploy/examples/" + name;
}

// Faults a test injects into the coordinator's control of the servers.
struct Faults {
  std::atomic<bool> fail_restores{false};  // every restore fails, as on a server with no room
  // Checkpoint calls, once answered by the server, wait while this is set
  // (a cut the coordinator is slow to hear back from); `cuts_held` counts them.
  std::atomic<bool> hold_cuts{false};
  std::atomic<int> cuts_held{0};
  // DeleteJob calls wait while this is set (a server that hangs), counted
  // in `deletes_held`.
  std::atomic<bool> hold_deletes{false};
  std::atomic<int> deletes_held{0};
};

// The coordinator's real gRPC control of the servers, with Faults.
class FaultyControl : public ServerControl {
 public:
  explicit FaultyControl(Faults* faults) : faults_(faults), real_(NewGrpcServerControl(absl::Seconds(5))) {}
  absl::Status InstallShardMap(const std::string& a, const v1::ShardMap& m) override {
    return real_->InstallShardMap(a, m);
  }
  absl::Status DeleteJob(const std::string& a, const std::string& j) override {
    if (faults_->hold_deletes.load()) {
      ++faults_->deletes_held;
      while (faults_->hold_deletes.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return real_->DeleteJob(a, j);
  }
  absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string& a, const std::string& j, uint64_t cut,
                                              uint64_t at_step, absl::Duration wait) override {
    auto meta = real_->Checkpoint(a, j, cut, at_step, wait);
    if (faults_->hold_cuts.load()) {
      ++faults_->cuts_held;
      while (faults_->hold_cuts.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return meta;
  }
  absl::StatusOr<v1::ShardCutMeta> Restore(const std::string& a, const std::string& j, uint64_t cut,
                                           const std::vector<std::string>& sources, uint32_t inc) override {
    if (faults_->fail_restores.load()) {
      return absl::ResourceExhaustedError(absl::StrCat("server ", a, ": no room (injected)"));
    }
    return real_->Restore(a, j, cut, sources, inc);
  }
  absl::Status DeleteCut(const std::string& a, const std::string& j, uint64_t cut) override {
    return real_->DeleteCut(a, j, cut);
  }
  absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string& a, const std::string& j) override {
    return real_->ListCuts(a, j);
  }
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const std::string& a,
                                                     const v1::ReadCheckpointRequest& r) override {
    return real_->ReadCut(a, r);
  }
  void CancelAll() override { real_->CancelAll(); }

 private:
  Faults* faults_;
  std::unique_ptr<ServerControl> real_;
};

struct Server {
  std::unique_ptr<ParameterServer> ps;
  std::unique_ptr<PsGrpcServer> grpc;
  std::unique_ptr<NodeAgent> agent;
};

class InProcessCluster {
 public:
  InProcessCluster(int servers, int workers, uint32_t slots = 1, absl::Duration restore_timeout = absl::Minutes(5),
                   const std::function<void(CoordinatorOptions&)>& tweak = nullptr) {
    dir_ = fs::temp_directory_path() / absl::StrCat("fulcrum-cluster-", getpid(), "-", counter_++);
    fs::remove_all(dir_);
    CoordinatorOptions o;
    o.data_dir = (dir_ / "coordinator").string();
    o.heartbeat_interval = absl::Milliseconds(200);
    o.node_timeout = absl::Seconds(2);
    o.min_servers = static_cast<uint32_t>(servers);
    o.restore_timeout = restore_timeout;
    if (tweak) tweak(o);
    options_ = o;
    StartCoordinator();
    for (int i = 0; i < servers; ++i) {
      const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
      Server s;
      ParameterServerOptions po;
      po.advertise_address = addr;
      po.data_dir = (dir_ / absl::StrCat("server-", i)).string();
      auto ps = ParameterServer::Create(po);
      REQUIRE(ps.ok());
      s.ps = *std::move(ps);
      auto g = PsGrpcServer::Start(s.ps.get(), addr);
      REQUIRE(g.ok());
      s.grpc = *std::move(g);
      s.agent = StartServerAgent(s.ps.get(), address_, addr);
      servers_.push_back(std::move(s));
    }
    for (int i = 0; i < workers; ++i) AddWorker(slots);
    for (auto& s : servers_) REQUIRE(s.agent->WaitRegistered(absl::Seconds(10)));
    for (auto& w : workers_) REQUIRE(w->WaitRegistered(absl::Seconds(10)));
  }
  ~InProcessCluster() {
    faults_.hold_cuts = false;  // a failed REQUIRE must not leave a cut or a release waiting
    faults_.hold_deletes = false;
    workers_.clear();
    for (auto& s : servers_) {
      s.agent->Stop();
      s.grpc->Shutdown();
    }
    servers_.clear();
    grpc_.reset();
    coordinator_.reset();
    fs::remove_all(dir_);
  }

  void AddWorker(uint32_t slots) {
    WorkerDaemonOptions wo;
    wo.coordinator = address_;
    wo.data_dir = FULCRUM_TEST_DATA_DIR;
    wo.device = "cpu";
    wo.slots = slots;
    workers_.push_back(std::make_unique<WorkerDaemon>(wo));
  }

  // Stops the coordinator and opens a new one on the same state and port.
  void RestartCoordinator() {
    StopCoordinator();
    StartCoordinator();
  }
  // The two halves of a restart, for an outage of any length.
  void StopCoordinator() {
    grpc_.reset();
    coordinator_.reset();
  }
  void StartCoordinator() {
    auto c = Coordinator::Open(options_, std::make_unique<FaultyControl>(&faults_));
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    coordinator_ = *std::move(c);
    if (address_.empty()) address_ = absl::StrCat("127.0.0.1:", FreePort());
    auto g = CoordinatorGrpcServer::Start(coordinator_.get(), address_);
    REQUIRE(g.ok());
    grpc_ = *std::move(g);
    jobs_ = v1::JobService::NewStub(CreateFulcrumChannel(address_, 0, *security::Transport::Plaintext()));
  }

  v1::JobService::Stub* jobs() { return jobs_.get(); }
  void FailRestores(bool on) { faults_.fail_restores = on; }
  Faults& faults() { return faults_; }
  std::vector<Server>& servers() { return servers_; }
  Coordinator& coordinator() { return *coordinator_; }
  const std::string& address() const { return address_; }

 private:

  static inline int counter_ = 0;
  fs::path dir_;
  CoordinatorOptions options_;
  Faults faults_;  // read by the coordinator's FaultyControl
  std::string address_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorGrpcServer> grpc_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::vector<Server> servers_;
  std::vector<std::unique_ptr<WorkerDaemon>> workers_;
};

inline std::unique_ptr<grpc::ClientContext> Ctx() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  return c;
}

inline grpc::Status Submit(v1::JobService::Stub* stub, const v1::JobSpec& spec, std::string* id) {
  v1::SubmitJobRequest req;
  *req.mutable_spec() = spec;
  v1::SubmitJobResponse resp;
  grpc::Status s = stub->SubmitJob(Ctx().get(), req, &resp);
  *id = resp.job_id();
  return s;
}

inline v1::Job Get(v1::JobService::Stub* stub, const std::string& id) {
  v1::JobRef ref;
  ref.set_job_id(id);
  v1::Job j;
  REQUIRE(stub->GetJob(Ctx().get(), ref, &j).ok());
  return j;
}

// Polls the job every 10 ms until `done` holds or `timeout` passes; returns
// the last snapshot (the caller checks what it needs).
inline v1::Job WaitForJob(v1::JobService::Stub* stub, const std::string& id, const std::function<bool(const v1::Job&)>& done,
                   absl::Duration timeout) {
  v1::Job j;
  for (const absl::Time end = absl::Now() + timeout;;) {
    j = Get(stub, id);
    if (done(j) || absl::Now() >= end) return j;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Submits `spec` and waits (at most 20 s) until it runs; returns that snapshot.
inline v1::Job SubmitRunning(v1::JobService::Stub* stub, const v1::JobSpec& spec, std::string* id) {
  REQUIRE(Submit(stub, spec, id).ok());
  const v1::Job running = WaitForJob(
      stub, *id, [](const v1::Job& j) { return j.status().state() == v1::RUNNING; }, absl::Seconds(20));
  REQUIRE(running.status().state() == v1::RUNNING);
  return running;
}

// A progress report for `rank` of `j`, from the worker and incarnation that
// run it; `fill` adds what it reports. Sent as the worker would.
inline grpc::Status ReportAsRank(const std::string& coordinator, const v1::Job& j, uint32_t rank,
                          const std::function<void(v1::ReportProgressRequest&)>& fill,
                          v1::ReportProgressResponse* resp) {
  auto stub = v1::ClusterService::NewStub(CreateFulcrumChannel(coordinator, 0, *security::Transport::Plaintext()));
  v1::ReportProgressRequest req;
  req.set_node_id(j.status().workers(static_cast<int>(rank)).worker_id());
  req.set_job_id(j.id());
  req.set_rank(rank);
  req.set_incarnation(j.status().workers(static_cast<int>(rank)).incarnation());
  fill(req);
  return stub->ReportProgress(Ctx().get(), req, resp);
}

// Reports rank 0 of `j` failed with `reason`, as its worker would.
inline v1::ReportProgressResponse FailRank0(const std::string& coordinator, const v1::Job& j, const std::string& reason,
                                     const std::string& error) {
  v1::ReportProgressResponse resp;
  grpc::Status s = ReportAsRank(
      coordinator, j, 0,
      [&](v1::ReportProgressRequest& req) {
        req.set_error(error);
        req.set_error_reason(reason);
      },
      &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return resp;
}

inline void Cancel(v1::JobService::Stub* stub, const std::string& id) {
  v1::JobRef ref;
  ref.set_job_id(id);
  v1::Job cancelled;
  REQUIRE(stub->CancelJob(Ctx().get(), ref, &cancelled).ok());
}

// Watches the job to its end, as fulcrumctl does; returns the last snapshot
// and the number of events seen.
inline v1::Job WatchToEnd(v1::JobService::Stub* stub, const std::string& id, int* events) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  v1::JobRef ref;
  ref.set_job_id(id);
  auto reader = stub->WatchJob(&ctx, ref);
  v1::JobEvent e;
  v1::Job last;
  *events = 0;
  while (reader->Read(&e)) {
    if (*events == 0) CHECK(e.kind() == "snapshot");
    ++*events;
    last = e.job();
  }
  REQUIRE(reader->Finish().ok());
  return last;
}

// Every server of the cluster drops its tables within 5 s (a release runs
// in the background).
inline void ExpectNoJobOnServers(InProcessCluster& cluster) {
  for (int tries = 0; tries < 100; ++tries) {
    bool any = false;
    for (auto& s : cluster.servers()) any |= !s.ps->JobIds().empty();
    if (!any) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& s : cluster.servers()) CHECK(s.ps->JobIds().empty());
}

inline v1::JobSpec DigitsSpec() {
  v1::JobSpec spec;
  REQUIRE(config::ParseSpecFile(Example("digits-softmax.yaml"), &spec).ok());
  return spec;
}

// A coordinator alone on a fresh state directory, with no servers behind
// it, for tests of its membership rules; `tweak` sets its options.
class BareCoordinator {
 public:
  explicit BareCoordinator(const std::function<void(CoordinatorOptions&)>& tweak = nullptr) {
    dir_ = fs::temp_directory_path() / absl::StrCat("fulcrum-bare-coordinator-", getpid(), "-", counter_++);
    fs::remove_all(dir_);
    CoordinatorOptions o;
    o.data_dir = dir_.string();
    if (tweak) tweak(o);
    auto c = Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(1)));
    REQUIRE(c.ok());
    coordinator_ = *std::move(c);
  }
  ~BareCoordinator() {
    coordinator_.reset();
    fs::remove_all(dir_);
  }
  Coordinator& operator*() { return *coordinator_; }

 private:
  static inline int counter_ = 0;
  fs::path dir_;
  std::unique_ptr<Coordinator> coordinator_;
};

// Reports that rank `rank` of `j` finished epoch `epoch`, as its worker would.
inline grpc::Status ReportEpoch(const std::string& coordinator, const v1::Job& j, uint32_t rank, uint32_t epoch,
                         double train_loss, double samples_per_second) {
  v1::ReportProgressResponse resp;
  return ReportAsRank(
      coordinator, j, rank,
      [&](v1::ReportProgressRequest& req) {
        req.mutable_progress()->set_state("running");
        req.mutable_progress()->set_epoch(epoch);
        v1::EpochSummary* e = req.mutable_epoch_done();
        e->set_epoch(epoch);
        e->set_train_loss(train_loss);
        e->set_samples_per_second(samples_per_second);
        e->set_seconds(1.0);
        if (rank == 0) {
          e->set_tested(true);
          e->set_test_accuracy(0.75);
        }
      },
      &resp);
}

// Nodes that only register and heartbeat: workers the test reports for, or
// a server whose parameter service is elsewhere (or nowhere).
class FakeNodes {
 public:
  FakeNodes(const std::string& coordinator, int n, v1::NodeRole role = v1::WORKER, const std::string& address = "") {
    auto stub = v1::ClusterService::NewStub(CreateFulcrumChannel(coordinator, 0, *security::Transport::Plaintext()));
    for (int i = 0; i < n; ++i) {
      v1::RegisterNodeRequest reg;
      reg.mutable_node()->set_role(role);
      reg.mutable_node()->set_address(address);
      v1::RegisterNodeResponse resp;
      REQUIRE(stub->RegisterNode(Ctx().get(), reg, &resp).ok());
      ids_.push_back(resp.node_id());
    }
    heartbeats_ = std::thread([this, coordinator] {
      auto stub = v1::ClusterService::NewStub(CreateFulcrumChannel(coordinator, 0, *security::Transport::Plaintext()));
      while (!stop_.load()) {
        for (const std::string& id : ids_) {
          v1::HeartbeatRequest hb;
          hb.set_node_id(id);  // generation 0: answered at once
          v1::HeartbeatResponse r;
          if (stub->Heartbeat(Ctx().get(), hb, &r).ok()) {  // fails while the coordinator restarts
            std::lock_guard<std::mutex> l(mu_);
            assignments_[id].assign(r.assignments().begin(), r.assignments().end());
          }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  ~FakeNodes() {
    stop_ = true;
    heartbeats_.join();
  }
  // Every node's assignments as its last heartbeat answered them.
  std::vector<v1::Assignment> Assignments() const {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<v1::Assignment> all;
    for (const auto& [id, a] : assignments_) all.insert(all.end(), a.begin(), a.end());
    return all;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::vector<v1::Assignment>> assignments_;
  std::vector<std::string> ids_;
  std::atomic<bool> stop_{false};
  std::thread heartbeats_;
};

// Rank 0's evaluation of the final weights, as a replacement that resumed
// after the last step sends it.
inline grpc::Status ReportEvaluation(const std::string& coordinator, const v1::Job& j, uint32_t epoch, double accuracy) {
  v1::ReportProgressResponse resp;
  return ReportAsRank(
      coordinator, j, 0,
      [&](v1::ReportProgressRequest& req) {
        req.mutable_progress()->set_state("running");
        v1::EpochSummary* e = req.mutable_epoch_done();
        e->set_epoch(epoch);
        e->set_evaluation_only(true);
        e->set_tested(true);
        e->set_test_accuracy(accuracy);
      },
      &resp);
}

// Redirects this process's stderr (the log) to a file while it lives.
class CaptureStderr {
 public:
  explicit CaptureStderr(const fs::path& file) : file_(file) {
    std::fflush(stderr);
    saved_ = dup(2);
    const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    dup2(fd, 2);
    close(fd);
  }
  ~CaptureStderr() { Stop(); }
  // Restores stderr and returns what was written meanwhile.
  std::string Stop() {
    if (saved_ >= 0) {
      std::fflush(stderr);
      dup2(saved_, 2);
      close(saved_);
      saved_ = -1;
    }
    return testing::ReadFile(file_.string());
  }

 private:
  fs::path file_;
  int saved_ = -1;
};

inline size_t CountOf(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// The value of a series (name and labels as rendered) in the coordinator's
// scrape; -1 when it is not there.
inline double MetricOf(const Coordinator& c, const std::string& series) {
  metrics::FunctionCollector collect([&](metrics::Scrape* out) { c.CollectMetrics(out); });
  const std::string scrape = metrics::RenderText({&collect});
  const size_t at = scrape.find("\n" + series + " ");
  return at == std::string::npos ? -1 : std::stod(scrape.substr(at + series.size() + 2));
}

// Waits (on real time, at most `timeout`) until series `series` reaches
// `at_least`; returns its last value. The faults below are real (a server
// that refuses, a failing disk), so their effects come on real time: the
// test waits for them to show, not for a fixed while.
inline double WaitForMetric(const Coordinator& c, const std::string& series, double at_least,
                     absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + timeout;
  double v = MetricOf(c, series);
  while (v < at_least && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    v = MetricOf(c, series);
  }
  return v;
}

// Whether fulcrum_coordinator_long_polls{call} reads `want` within 10 s.
inline bool LongPollsSettle(const Coordinator& c, const char* call, double want) {
  const std::string series = absl::StrCat("fulcrum_coordinator_long_polls{call=\"", call, "\"}");
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (MetricOf(c, series) != want && absl::Now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return MetricOf(c, series) == want;
}

// A heartbeat through gRPC's callback API: no client thread waits on it.
struct ParkedHeartbeat {
  grpc::ClientContext ctx;
  v1::HeartbeatRequest req;
  v1::HeartbeatResponse resp;
  std::promise<grpc::Status> done;
};

// A CheckpointJob through gRPC's callback API: no client thread waits on it.
struct PendingCheckpoint {
  grpc::ClientContext ctx;
  v1::CheckpointInfo info;
  std::promise<grpc::Status> done;
  std::future<grpc::Status> result = done.get_future();
};

}  // namespace
}  // namespace fulcrum

#endif  // FULCRUM_TESTS_CLUSTER_CLUSTER_FIXTURE_H_
