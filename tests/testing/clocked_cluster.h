// A coordinator on a fake clock with its scheduler run tick by tick by the
// test (RunSchedulerPass, which also waits out the background calls a tick
// starts): no scheduler thread, no sleeping. One server registers at once;
// servers accept every call but checkpoints (a job's start, cut 0, they
// restore). A real RocksDB directory holds
// the coordinator's state.
#ifndef FULCRUM_TESTS_TESTING_CLOCKED_CLUSTER_H_
#define FULCRUM_TESTS_TESTING_CLOCKED_CLUSTER_H_

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "server/coordinator/coordinator.h"
#include "tests/testing/fake_clock.h"

namespace fulcrum::testing {

// Servers that take the shard map and drop jobs; they have no checkpoints.
class AcceptingServers final : public ServerControl {
 public:
  absl::Status InstallShardMap(const std::string&, const v1::ShardMap&) override { return absl::OkStatus(); }
  absl::Status DeleteJob(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string&, const std::string&, uint64_t, uint64_t,
                                              absl::Duration) override {
    return absl::UnimplementedError("no cuts here");
  }
  // Cut 0, a job's start, needs no cut.
  absl::StatusOr<v1::ShardCutMeta> Restore(const std::string&, const std::string& job_id, uint64_t cut_id,
                                           const std::vector<std::string>&, uint32_t) override {
    if (cut_id != 0) return absl::UnimplementedError("no cuts here");
    v1::ShardCutMeta start;
    start.mutable_spec()->set_job_id(job_id);
    return start;
  }
  absl::Status DeleteCut(const std::string&, const std::string&, uint64_t) override { return absl::OkStatus(); }
  absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string&, const std::string&) override {
    return std::vector<v1::ShardCutMeta>();
  }
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const std::string&, const v1::ReadCheckpointRequest&) override {
    return absl::UnimplementedError("no cuts here");
  }
};

class ClockedCluster {
 public:
  static constexpr absl::Duration kTick = absl::Milliseconds(100);

  using Adjust = std::function<void(CoordinatorOptions&)>;
  // `servers`: how many register now; `adjust` changes the options first.
  explicit ClockedCluster(FakeClock* clock, int servers = 1, const Adjust& adjust = nullptr)
      : clock_(clock) {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("fulcrum-clocked-cluster-", getpid(), "-", counter_++);
    std::filesystem::remove_all(dir_);
    CoordinatorOptions o;
    o.data_dir = dir_.string();
    o.clock = clock;
    o.run_scheduler = false;
    o.tick = kTick;
    o.node_timeout = absl::Seconds(5);
    if (adjust) adjust(o);
    auto c = Coordinator::Open(o, std::make_unique<AcceptingServers>());
    REQUIRE(c.ok());
    c_ = *std::move(c);
    for (int i = 0; i < servers; ++i) AddServer();
  }
  ~ClockedCluster() {
    c_.reset();
    std::filesystem::remove_all(dir_);
  }
  Coordinator& operator*() { return *c_; }
  Coordinator* operator->() { return c_.get(); }

  std::string AddServer() {
    v1::NodeInfo server;
    server.set_role(v1::SERVER);
    server.set_address(absl::StrCat("127.0.0.1:", ++ports_));
    auto s = c_->RegisterNode(server);
    REQUIRE(s.ok());
    nodes_.push_back(s->node_id());
    return s->node_id();
  }
  // A worker: a daemon (job_id "") or a user process of job `job_id`.
  absl::StatusOr<std::string> Register(const std::string& job_id, uint32_t slots = 1) {
    v1::NodeInfo info;
    info.set_role(v1::WORKER);
    info.set_job_id(job_id);
    info.set_slots(slots);
    auto r = c_->RegisterNode(info);
    if (!r.ok()) return r.status();
    nodes_.push_back(r->node_id());
    return r->node_id();
  }
  // A job of `workers` ranks: user processes' (`user`) or the daemons'.
  std::string Submit(bool user, uint32_t workers, const std::string& name,
                     const std::function<void(v1::JobSpec&)>& adjust = nullptr) {
    v1::JobSpec spec;
    spec.set_name(name);
    spec.set_num_workers(workers);
    spec.mutable_optimizer()->set_kind(v1::OptimizerSpec::SGD);
    spec.mutable_optimizer()->set_learning_rate(0.1f);
    spec.mutable_consistency()->set_model(v1::ConsistencySpec::ASP);
    if (user) {
      spec.set_user_workers(true);
    } else {
      spec.mutable_model()->set_type("softmax");
      spec.mutable_data()->mutable_train()->set_format("idx");
      spec.mutable_data()->mutable_train()->set_path("x");
      spec.mutable_data()->mutable_train()->set_labels("y");
      spec.set_batch_size(8);
      spec.set_epochs(1);
    }
    if (adjust) adjust(spec);
    auto id = c_->SubmitJob(spec, false);
    INFO(id.status().message());
    REQUIRE(id.ok());
    return *id;
  }
  // Heartbeats from every node but those in `silent`, then `d` of scheduler
  // ticks on the clock.
  void Run(absl::Duration d, const std::vector<std::string>& silent = {}) {
    for (absl::Duration done; done < d; done += kTick) {
      for (const std::string& n : nodes_) {
        if (std::find(silent.begin(), silent.end(), n) != silent.end()) continue;
        v1::HeartbeatRequest hb;
        hb.set_node_id(n);
        (void)c_->Heartbeat(hb);
      }
      clock_->Advance(kTick);
      c_->RunSchedulerPass();
    }
  }
  void Run(absl::Duration d, const std::string& silent) { Run(d, std::vector<std::string>{silent}); }
  // Ticks until job `id` is in `state`; false after 10 s on the clock.
  bool RunUntil(const std::string& id, v1::JobState state) {
    for (int i = 0; i < 100; ++i) {
      Run(kTick);
      if (c_->GetJob(id)->status().state() == state) return true;
    }
    return false;
  }
  // The assignments node `id` gets, as "job/rank/incarnation".
  std::vector<std::string> Assignments(const std::string& id) {
    v1::HeartbeatRequest hb;
    hb.set_node_id(id);
    auto r = c_->Heartbeat(hb);
    REQUIRE(r.ok());
    std::vector<std::string> out;
    for (const auto& a : r->assignments()) {
      out.push_back(absl::StrCat(a.job_id(), "/", a.rank(), "/", a.incarnation()));
      CHECK(a.world_size() == c_->GetJob(a.job_id())->spec().num_workers());
    }
    return out;
  }
  // Rank `rank` of job `id` reports that it finished.
  void Finish(const std::string& id, uint32_t rank) {
    const v1::Job job = *c_->GetJob(id);
    v1::ReportProgressRequest req;
    req.set_node_id(job.status().workers(static_cast<int>(rank)).worker_id());
    req.set_job_id(id);
    req.set_rank(rank);
    req.set_incarnation(job.status().workers(static_cast<int>(rank)).incarnation());
    req.set_finished(true);
    REQUIRE(c_->ReportProgress(req).ok());
  }

 private:
  static inline int counter_ = 0;
  FakeClock* clock_;
  std::filesystem::path dir_;
  std::unique_ptr<Coordinator> c_;
  std::vector<std::string> nodes_;
  int ports_ = 0;
};

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_CLOCKED_CLUSTER_H_
