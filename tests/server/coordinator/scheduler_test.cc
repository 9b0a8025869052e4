// The coordinator's scheduler on a fake clock: liveness, the grace after a
// stall and dead-node retention, driven tick by tick (TickForTesting) with
// no scheduler thread and no sleeping. A real RocksDB directory holds its
// state; no server is called.
#include <filesystem>
#include <memory>
#include <string>

#include <catch2/catch.hpp>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "server/coordinator/coordinator.h"
#include "tests/testing/fake_clock.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

// Servers are never called by these tests: every call fails.
class NoServers final : public ServerControl {
 public:
  absl::Status InstallShardMap(const std::string& a, const v1::ShardMap&) override { return Unreachable(a); }
  absl::Status DeleteJob(const std::string& a, const std::string&) override { return Unreachable(a); }
  absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string& a, const std::string&, uint64_t, uint64_t,
                                              absl::Duration) override {
    return Unreachable(a);
  }
  absl::StatusOr<v1::ShardCutMeta> Restore(const std::string& a, const std::string&, uint64_t,
                                           const std::vector<std::string>&, uint32_t) override {
    return Unreachable(a);
  }
  absl::Status DeleteCut(const std::string& a, const std::string&, uint64_t) override { return Unreachable(a); }
  absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string& a, const std::string&) override {
    return Unreachable(a);
  }
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const std::string& a,
                                                     const v1::ReadCheckpointRequest&) override {
    return Unreachable(a);
  }

 private:
  static absl::Status Unreachable(const std::string& a) { return absl::UnavailableError(a + ": no servers here"); }
};

// A coordinator on `clock` with a scheduler only the test runs.
class ClockedCoordinator {
 public:
  ClockedCoordinator(testing::FakeClock* clock, absl::Duration node_timeout,
                     absl::Duration retention = absl::Minutes(10)) {
    dir_ = fs::temp_directory_path() / absl::StrCat("fulcrum-scheduler-test-", getpid(), "-", counter_++);
    fs::remove_all(dir_);
    CoordinatorOptions o;
    o.data_dir = dir_.string();
    o.clock = clock;
    o.run_scheduler = false;
    o.tick = absl::Milliseconds(100);
    o.node_timeout = node_timeout;
    o.dead_node_retention = retention;
    auto c = Coordinator::Open(o, std::make_unique<NoServers>());
    REQUIRE(c.ok());
    coordinator_ = *std::move(c);
  }
  ~ClockedCoordinator() {
    coordinator_.reset();
    fs::remove_all(dir_);
  }
  Coordinator& operator*() { return *coordinator_; }
  Coordinator* operator->() { return coordinator_.get(); }

 private:
  static inline int counter_ = 0;
  fs::path dir_;
  std::unique_ptr<Coordinator> coordinator_;
};

// "alive", "dead" or "forgotten": node `id` in the coordinator's cluster state.
std::string NodeState(const Coordinator& coordinator, const std::string& id) {
  const v1::ClusterState cs = coordinator.GetCluster();
  for (const auto& n : cs.nodes()) {
    if (n.info().node_id() == id) return n.alive() ? "alive" : "dead";
  }
  return "forgotten";
}

// Registers a worker that never heartbeats; returns its node id.
std::string RegisterSilentWorker(Coordinator& coordinator) {
  v1::NodeInfo info;
  info.set_role(v1::WORKER);
  auto node = coordinator.RegisterNode(info);
  REQUIRE(node.ok());
  return node->node_id();
}

// Moves the clock by `d` in steps of one tick, running the scheduler after each.
void Run(testing::FakeClock& clock, Coordinator& c, absl::Duration d, absl::Duration tick = absl::Milliseconds(100)) {
  for (absl::Duration done; done < d; done += tick) {
    clock.Advance(tick);
    c.TickForTesting();
  }
}

TEST_CASE("a silent node is declared dead once node_timeout passes on the coordinator's clock", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCoordinator c(&clock, absl::Seconds(5));
  const std::string node = RegisterSilentWorker(*c);
  Run(clock, *c, absl::Milliseconds(4900));
  CHECK(NodeState(*c, node) == "alive");
  Run(clock, *c, absl::Milliseconds(200));
  CHECK(NodeState(*c, node) == "dead");
  // A node that heartbeats stays alive however long the clock runs.
  const std::string talking = RegisterSilentWorker(*c);
  v1::HeartbeatRequest hb;
  hb.set_node_id(talking);
  hb.set_wait_ms(0);
  for (int i = 0; i < 10; ++i) {
    Run(clock, *c, absl::Seconds(2));
    REQUIRE(c->Heartbeat(hb).ok());
  }
  CHECK(NodeState(*c, talking) == "alive");
}

TEST_CASE("a coordinator that could not run for a while gives nodes a fresh node_timeout before declaring them dead",
          "[coordinator]") {
  testing::FakeClock clock;
  ClockedCoordinator c(&clock, absl::Seconds(1));
  const std::string node = RegisterSilentWorker(*c);
  auto alive = [&]() { return NodeState(*c, node) == "alive"; };
  c->TickForTesting();
  // 2.5 s between two ticks, as when a write stuck on a slow disk held the
  // lock: the node's heartbeats, had it sent any, would have waited behind it.
  clock.Advance(absl::Milliseconds(2500));
  c->TickForTesting();
  Run(clock, *c, absl::Milliseconds(300));  // three scheduler ticks
  CHECK(alive());  // spared: not declared dead for silence the stall may have caused
  // The grace is one node_timeout, not immunity.
  Run(clock, *c, absl::Milliseconds(800));
  CHECK_FALSE(alive());
}

TEST_CASE("a dead node stays listed for dead_node_retention and is then forgotten", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCoordinator c(&clock, absl::Milliseconds(300), absl::Seconds(1));
  const std::string gone = RegisterSilentWorker(*c);
  Run(clock, *c, absl::Milliseconds(400));
  REQUIRE(NodeState(*c, gone) == "dead");
  Run(clock, *c, absl::Milliseconds(900));
  CHECK(NodeState(*c, gone) == "dead");  // listed for its retention first
  Run(clock, *c, absl::Milliseconds(300));
  REQUIRE(NodeState(*c, gone) == "forgotten");
  // It heartbeats again after a long pause: told to register anew.
  v1::HeartbeatRequest hb;
  hb.set_node_id(gone);
  CHECK(c->Heartbeat(hb).status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace fulcrum
