// Coordinator load test: one fulcrum-coordinator process with many nodes
// heartbeating (each a long poll that the coordinator holds until something
// changes or heartbeat_interval passes) and many users watching jobs
// (WatchJob streams), as a large cluster has. The clients use gRPC's
// callback API, so this process needs no thread per call either.
//
// It measures, in the coordinator process: threads and resident memory idle
// and under the load, CPU used while the load idles, the latency of GetJob
// idle (the bound) and under the load, the time one change takes to reach
// every heartbeating node (a server registers) and every watcher (the job is
// cancelled), and how long SIGTERM takes with every long poll still open.
// It exits non-zero when a call failed, a node was declared dead, a watcher
// missed the end of its job, or the coordinator's threads grew with the
// number of open calls (more than --max_thread_growth).
//
//   fulcrum-coordinator-load --coordinator_binary=build/server/fulcrum-coordinator
//       [--nodes=1000] [--watchers=1000] [--jobs=4] [--seconds=20]
//
// Plaintext: what is measured is how the coordinator holds its calls; the
// cost of TLS is the load test's (load_test.cc).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/config/spec_text.h"
#include "fulcrum/v1/cluster.grpc.pb.h"
#include "tests/testing/process_util.h"
#include "tests/testing/subprocess.h"

ABSL_FLAG(std::string, coordinator_binary, "", "path of fulcrum-coordinator");
ABSL_FLAG(std::string, spec, "", "job spec the watched jobs are submitted with");
ABSL_FLAG(int32_t, nodes, 1000, "worker nodes that register and heartbeat");
ABSL_FLAG(int32_t, watchers, 1000, "WatchJob streams, spread over --jobs jobs");
ABSL_FLAG(int32_t, jobs, 4, "jobs submitted (they stay PENDING: no server registers)");
ABSL_FLAG(int32_t, seconds, 20, "how long the load idles while CPU and GetJob latency are measured");
ABSL_FLAG(int32_t, channels, 8, "client connections the nodes and watchers are spread over");
ABSL_FLAG(int32_t, max_thread_growth, 48,
          "fail when the coordinator has more threads than this above its idle count under the load");

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// User plus system CPU seconds of `pid`, from /proc/PID/stat.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  std::istringstream fields(stat.substr(paren + 2));
  std::string f;
  double ticks = 0;
  for (int i = 3; fields >> f; ++i) {  // field 3 is the state
    if (i == 14 || i == 15) ticks += std::stod(f);
    if (i == 15) break;
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string Percentiles(std::vector<double> v) {
  if (v.empty()) return "| - | - | - |";
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))]; };
  return absl::StrFormat("| %.2f | %.2f | %.2f |", at(0.5), at(0.99), v.back());
}

// Errors of the clients, kept for the report.
class Errors {
 public:
  void Add(std::string e) {
    absl::MutexLock lock(&mu_);
    if (list_.size() < 10) list_.push_back(std::move(e));
    ++count_;
  }
  int64_t count() const {
    absl::MutexLock lock(&mu_);
    return count_;
  }
  std::vector<std::string> list() const {
    absl::MutexLock lock(&mu_);
    return list_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> list_ ABSL_GUARDED_BY(mu_);
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// A node agent reduced to its heartbeat: each call carries the generation
// it last saw, and the next starts as soon as one returns.
class Node {
 public:
  Node(v1::ClusterService::Stub* stub, std::string id, Errors* errors) : stub_(stub), errors_(errors) {
    req_.set_node_id(std::move(id));
    req_.set_wait_ms(60000);  // the coordinator holds it for heartbeat_interval at most
  }
  void Start() { Send(); }
  // No new call after the one in flight; Wait() returns once it is back.
  void Stop() { stopping_ = true; }
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&idle_));
  }
  // When an answer with a generation above `above` first came (after Watch).
  void Watch(uint64_t above) {
    absl::MutexLock lock(&mu_);
    above_ = above;
    seen_at_.reset();
  }
  std::optional<Clock::time_point> seen_at() const {
    absl::MutexLock lock(&mu_);
    return seen_at_;
  }
  int64_t answers() const { return answers_.load(); }

 private:
  void Send() {
    {
      absl::MutexLock lock(&mu_);
      idle_ = false;
    }
    ctx_ = std::make_unique<grpc::ClientContext>();
    ctx_->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    stub_->async()->Heartbeat(ctx_.get(), &req_, &resp_, [this](grpc::Status s) { Done(s); });
  }
  void Done(const grpc::Status& s) {
    if (!s.ok()) {
      errors_->Add(absl::StrCat("heartbeat of ", req_.node_id(), ": ", s.error_message()));
    } else {
      ++answers_;
      req_.set_generation(resp_.generation());
      absl::MutexLock lock(&mu_);
      if (!seen_at_ && resp_.generation() > above_) seen_at_ = Clock::now();
    }
    if (s.ok() && !stopping_.load()) {
      Send();
      return;
    }
    absl::MutexLock lock(&mu_);
    idle_ = true;
  }

  v1::ClusterService::Stub* const stub_;
  Errors* const errors_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  v1::HeartbeatRequest req_;
  v1::HeartbeatResponse resp_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> answers_{0};
  mutable absl::Mutex mu_;
  bool idle_ ABSL_GUARDED_BY(mu_) = true;
  uint64_t above_ ABSL_GUARDED_BY(mu_) = UINT64_MAX;
  std::optional<Clock::time_point> seen_at_ ABSL_GUARDED_BY(mu_);
};

// `fulcrumctl watch` reduced to its stream.
class Watcher : public grpc::ClientReadReactor<v1::JobEvent> {
 public:
  Watcher(v1::JobService::Stub* stub, const std::string& job_id) {
    req_.set_job_id(job_id);
    stub->async()->WatchJob(&ctx_, &req_, this);
    StartRead(&event_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    {
      absl::MutexLock lock(&mu_);
      ++events_;
      if (event_.job().status().state() == v1::CANCELLED && !ended_at_) ended_at_ = Clock::now();
    }
    StartRead(&event_);
  }
  void OnDone(const grpc::Status& s) override {
    absl::MutexLock lock(&mu_);
    status_ = s;
    done_ = true;
  }
  void Cancel() { ctx_.TryCancel(); }
  bool WaitDone(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&done_), timeout);
  }
  int64_t events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  std::optional<Clock::time_point> ended_at() const {
    absl::MutexLock lock(&mu_);
    return ended_at_;
  }
  grpc::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  const std::string& job_id() const { return req_.job_id(); }

 private:
  grpc::ClientContext ctx_;
  v1::JobRef req_;
  v1::JobEvent event_;
  mutable absl::Mutex mu_;
  int64_t events_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Clock::time_point> ended_at_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// Waits up to `timeout` for `pred`, polling.
template <typename Pred>
bool Within(absl::Duration timeout, Pred pred) {
  const absl::Time end = absl::Now() + timeout;
  while (!pred()) {
    if (absl::Now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

int Run() {
  const int nnodes = std::clamp(absl::GetFlag(FLAGS_nodes), 1, 20000);
  const int nwatchers = std::clamp(absl::GetFlag(FLAGS_watchers), 1, 20000);
  const int njobs = std::clamp(absl::GetFlag(FLAGS_jobs), 1, 64);
  const int seconds = std::clamp(absl::GetFlag(FLAGS_seconds), 1, 3600);
  const int nchannels = std::clamp(absl::GetFlag(FLAGS_channels), 1, 256);
  const std::string dir = testing::MakeTempDir("fulcrum-coordinator-load");
  const int port = testing::FreePort();
  const std::string address = absl::StrCat("127.0.0.1:", port);
  const int heartbeat_ms = 1000;
  testing::Process coordinator =
      testing::Spawn({absl::GetFlag(FLAGS_coordinator_binary), "--listen=" + address, "--data_dir=" + dir + "/state",
                      "--metrics_addr=", "--insecure", "--min_servers=2",
                      // Every watcher comes from 127.0.0.1: no per-client limit on them.
                      "--max_long_calls_per_user=0", absl::StrCat("--heartbeat_interval_ms=", heartbeat_ms),
                      "--node_timeout_ms=5000"},
                     dir + "/coordinator.log");
  if (!testing::WaitForListening(port, 60000, coordinator.pid)) {
    std::cerr << "the coordinator does not listen on " << address << ":\n" << testing::ReadFile(coordinator.log);
    return 1;
  }
  const pid_t pid = coordinator.pid;

  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::ClusterService::Stub>> cluster;
  std::vector<std::unique_ptr<v1::JobService::Stub>> job_api;
  for (int i = 0; i < nchannels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection per channel
    args.SetInt("fulcrum.load_channel", i);
    channels.push_back(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    cluster.push_back(v1::ClusterService::NewStub(channels.back()));
    job_api.push_back(v1::JobService::NewStub(channels.back()));
  }
  Errors errors;
  auto call_ctx = [] {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return ctx;
  };

  // The jobs: PENDING for good, as no parameter server registers.
  v1::JobSpec spec;
  if (auto s = config::ParseSpecFile(absl::GetFlag(FLAGS_spec), &spec); !s.ok()) {
    std::cerr << "--spec: " << s << "\n";
    return 1;
  }
  std::vector<std::string> job_ids;
  for (int j = 0; j < njobs; ++j) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    if (auto s = job_api[0]->SubmitJob(call_ctx().get(), req, &resp); !s.ok()) {
      std::cerr << "SubmitJob: " << s.error_message() << "\n";
      return 1;
    }
    job_ids.push_back(resp.job_id());
  }
  // GetJob, one call at a time, as fulcrumctl status does.
  auto get_job_ms = [&](Clock::time_point until, std::vector<double>* out) {
    v1::JobRef ref;
    ref.set_job_id(job_ids[0]);
    while (Clock::now() < until) {
      v1::Job job;
      const auto t0 = Clock::now();
      if (auto s = job_api[0]->GetJob(call_ctx().get(), ref, &job); !s.ok()) {
        errors.Add(absl::StrCat("GetJob: ", s.error_message()));
      }
      out->push_back(Ms(Clock::now() - t0));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  std::vector<double> idle_ms, loaded_ms;
  get_job_ms(Clock::now() + std::chrono::seconds(2), &idle_ms);
  const int64_t threads_idle = testing::ThreadCount(pid);
  const int64_t rss_idle = testing::RssKiB(pid);

  // Register every node, then start their heartbeats.
  const auto reg_start = Clock::now();
  std::vector<std::unique_ptr<Node>> nodes;
  for (int i = 0; i < nnodes; ++i) {
    v1::RegisterNodeRequest req;
    req.mutable_node()->set_role(v1::WORKER);
    req.mutable_node()->set_hostname(absl::StrCat("load-", i));
    req.mutable_node()->set_slots(1);
    v1::RegisterNodeResponse resp;
    if (auto s = cluster[static_cast<size_t>(i % nchannels)]->RegisterNode(call_ctx().get(), req, &resp); !s.ok()) {
      std::cerr << "RegisterNode: " << s.error_message() << "\n";
      return 1;
    }
    nodes.push_back(std::make_unique<Node>(cluster[static_cast<size_t>(i % nchannels)].get(), resp.node_id(), &errors));
    nodes.back()->Start();
  }
  const double register_s = std::chrono::duration<double>(Clock::now() - reg_start).count();
  std::vector<std::unique_ptr<Watcher>> watchers;
  for (int i = 0; i < nwatchers; ++i) {
    watchers.push_back(std::make_unique<Watcher>(job_api[static_cast<size_t>(i % nchannels)].get(),
                                                 job_ids[static_cast<size_t>(i % njobs)]));
  }
  const bool all_up = Within(absl::Seconds(60), [&] {
    for (const auto& w : watchers) {
      if (w->events() == 0) return false;
    }
    return true;
  });
  // Settle: registrations bumped the generation many times; every node is
  // back to waiting a whole interval per call once it has caught up.
  std::this_thread::sleep_for(std::chrono::milliseconds(2 * heartbeat_ms));

  // The load idles: each node's call returns once a heartbeat_interval.
  const int64_t threads_loaded = testing::ThreadCount(pid);
  int64_t answers_before = 0;
  for (const auto& n : nodes) answers_before += n->answers();
  const double cpu_before = CpuSeconds(pid);
  const auto idle_start = Clock::now();
  get_job_ms(idle_start + std::chrono::seconds(seconds), &loaded_ms);
  const double idle_s = std::chrono::duration<double>(Clock::now() - idle_start).count();
  const double cpu_used = CpuSeconds(pid) - cpu_before;
  int64_t answers_after = 0;
  for (const auto& n : nodes) answers_after += n->answers();
  const int64_t rss_loaded = testing::RssKiB(pid);

  // One change to every node: a parameter server registers (the shard map
  // changes). Nothing listens at its address, and with --min_servers=2 no
  // job starts.
  v1::ClusterState before;
  if (auto s = cluster[0]->GetCluster(call_ctx().get(), v1::GetClusterRequest(), &before); !s.ok()) {
    errors.Add(absl::StrCat("GetCluster: ", s.error_message()));
  }
  for (auto& n : nodes) n->Watch(before.generation());
  const auto change_at = Clock::now();
  {
    v1::RegisterNodeRequest req;
    req.mutable_node()->set_role(v1::SERVER);
    req.mutable_node()->set_hostname("load-server");
    req.mutable_node()->set_address("127.0.0.1:1");
    v1::RegisterNodeResponse resp;
    if (auto s = cluster[0]->RegisterNode(call_ctx().get(), req, &resp); !s.ok()) {
      errors.Add(absl::StrCat("RegisterNode: ", s.error_message()));
    }
  }
  const bool nodes_heard = Within(absl::Seconds(30), [&] {
    for (const auto& n : nodes) {
      if (!n->seen_at()) return false;
    }
    return true;
  });
  double node_fanout_ms = 0;
  for (const auto& n : nodes) {
    if (auto t = n->seen_at()) node_fanout_ms = std::max(node_fanout_ms, Ms(*t - change_at));
  }

  // One change to every watcher: each job is cancelled.
  std::vector<double> watch_fanout_ms;
  int watchers_missed = 0;
  for (const std::string& id : job_ids) {
    v1::JobRef ref;
    ref.set_job_id(id);
    v1::Job job;
    const auto t0 = Clock::now();
    if (auto s = job_api[0]->CancelJob(call_ctx().get(), ref, &job); !s.ok()) {
      errors.Add(absl::StrCat("CancelJob: ", s.error_message()));
    }
    double slowest = 0;
    for (auto& w : watchers) {
      if (w->job_id() != id) continue;
      if (!w->WaitDone(absl::Seconds(30)) || !w->status().ok() || !w->ended_at()) {
        ++watchers_missed;
        continue;
      }
      slowest = std::max(slowest, Ms(*w->ended_at() - t0));
    }
    watch_fanout_ms.push_back(slowest);
  }

  // Nobody was declared dead: every node heartbeat in time throughout.
  v1::ClusterState after;
  if (auto s = cluster[0]->GetCluster(call_ctx().get(), v1::GetClusterRequest(), &after); !s.ok()) {
    errors.Add(absl::StrCat("GetCluster: ", s.error_message()));
  }
  int alive = 0;
  for (const auto& n : after.nodes()) alive += n.alive() && n.info().role() == v1::WORKER ? 1 : 0;

  // SIGTERM with every heartbeat still open: the calls it cuts fail, as
  // they should; the errors before it count.
  const int64_t errors_before_term = errors.count();
  const std::vector<std::string> listed = errors.list();
  const auto term_at = Clock::now();
  kill(pid, SIGTERM);
  int wstatus = 0;
  bool exited = false;
  for (int i = 0; i < 3000 && !exited; ++i) {
    exited = waitpid(pid, &wstatus, WNOHANG) == pid;
    if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double term_ms = Ms(Clock::now() - term_at);
  if (!exited) {
    kill(pid, SIGKILL);
    waitpid(pid, &wstatus, 0);
  }
  for (auto& n : nodes) n->Stop();
  for (auto& n : nodes) n->Wait();  // the calls end with the coordinator's exit
  for (auto& w : watchers) {
    w->Cancel();
    w->WaitDone(absl::Seconds(30));
  }

  std::cout << absl::StrFormat(
      "coordinator load: %d heartbeating nodes (heartbeat_interval %d ms), %d WatchJob streams over %d jobs, %d "
      "connections, %u cores\n",
      nnodes, heartbeat_ms, nwatchers, njobs, nchannels, std::thread::hardware_concurrency());
  std::cout << absl::StrFormat("registering %d nodes: %.2f s (%.0f/s)\n", nnodes, register_s,
                               static_cast<double>(nnodes) / register_s);
  std::cout << "| coordinator | idle | under load |\n|---|---|---|\n";
  std::cout << absl::StrFormat("| threads | %d | %d |\n", threads_idle, threads_loaded);
  std::cout << absl::StrFormat("| RSS MiB | %.1f | %.1f |\n", static_cast<double>(rss_idle) / 1024,
                               static_cast<double>(rss_loaded) / 1024);
  std::cout << absl::StrFormat("load idling %.1f s: %.0f heartbeats answered/s, coordinator CPU %.1f%% of one core\n",
                               idle_s, static_cast<double>(answers_after - answers_before) / idle_s,
                               100 * cpu_used / idle_s);
  std::cout << "| GetJob | calls | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|\n";
  std::cout << absl::StrFormat("| idle (bound) | %d ", idle_ms.size()) << Percentiles(idle_ms) << "\n";
  std::cout << absl::StrFormat("| under load | %d ", loaded_ms.size()) << Percentiles(loaded_ms) << "\n";
  std::sort(idle_ms.begin(), idle_ms.end());
  std::sort(loaded_ms.begin(), loaded_ms.end());
  if (!idle_ms.empty() && !loaded_ms.empty()) {
    std::cout << absl::StrFormat("GetJob p50 under load / idle: %.2fx\n",
                                 loaded_ms[loaded_ms.size() / 2] / idle_ms[idle_ms.size() / 2]);
  }
  std::cout << absl::StrFormat("a change reaches all %d nodes in %.1f ms%s\n", nnodes, node_fanout_ms,
                               nodes_heard ? "" : " (NOT ALL within 30 s)");
  for (size_t j = 0; j < watch_fanout_ms.size(); ++j) {
    std::cout << absl::StrFormat("cancelling job %s reaches its watchers in %.1f ms\n", job_ids[j], watch_fanout_ms[j]);
  }
  const bool clean_exit = exited && WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0;
  std::cout << absl::StrFormat("SIGTERM with %d heartbeats open: %s in %.0f ms\n", nnodes,
                               !exited             ? "KILLED, still running"
                               : clean_exit        ? "exited 0"
                               : WIFEXITED(wstatus) ? absl::StrCat("exited ", WEXITSTATUS(wstatus))
                                                    : absl::StrCat("died of signal ", WTERMSIG(wstatus)),
                               term_ms);
  std::cout << absl::StrFormat("workers alive at the end: %d of %d\n", alive, nnodes);
  const int64_t growth = threads_loaded - threads_idle;
  const bool ok = errors_before_term == 0 && all_up && nodes_heard && watchers_missed == 0 && alive == nnodes &&
                  clean_exit && growth <= absl::GetFlag(FLAGS_max_thread_growth);
  std::cout << absl::StrFormat(
      "errors before SIGTERM: %d; watchers that missed their job's end: %d; thread growth under load: %d (at most "
      "%d)\n",
      errors_before_term, watchers_missed, growth, absl::GetFlag(FLAGS_max_thread_growth));
  for (const std::string& e : listed) std::cout << "  " << e << "\n";
  std::cout << (ok ? "PASS" : "FAIL") << "\n";
  if (ok) {
    std::filesystem::remove_all(dir);
  } else {
    std::cout << "coordinator log: " << coordinator.log << "\n";
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace fulcrum

TEST_CASE("coordinator load") { REQUIRE(fulcrum::Run() == 0); }

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  char* args[] = {argv[0], nullptr};
  return Catch::Session().run(1, args);
}
