// The coordinator's scheduler on a fake clock, driven tick by tick
// (RunSchedulerPass) with no scheduler thread and no sleeping: liveness, the
// grace after a stall and dead-node retention (no server registered), then job
// starts, queueing, a lost worker's rank moving, deadlines and TTLs (servers
// accept every call). A real RocksDB directory holds its state.
#include <string>

#include <catch2/catch.hpp>

#include "server/coordinator/coordinator.h"
#include "tests/testing/clocked_cluster.h"
#include "tests/testing/fake_clock.h"

namespace fulcrum {
namespace {

using testing::ClockedCluster;

// The liveness cases' options: a ClockedCluster with no server registered
// (none is called) whose nodes time out after `node_timeout`.
ClockedCluster::Adjust Timeouts(absl::Duration node_timeout, absl::Duration retention = absl::Minutes(10)) {
  return [=](CoordinatorOptions& o) {
    o.node_timeout = node_timeout;
    o.dead_node_retention = retention;
  };
}

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
    c.RunSchedulerPass();
  }
}

TEST_CASE("a silent node is declared dead once node_timeout passes on the coordinator's clock", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock, 0, Timeouts(absl::Seconds(5)));
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
  ClockedCluster c(&clock, 0, Timeouts(absl::Seconds(1)));
  const std::string node = RegisterSilentWorker(*c);
  auto alive = [&]() { return NodeState(*c, node) == "alive"; };
  c->RunSchedulerPass();
  // 2.5 s between two ticks, as when a write stuck on a slow disk held the
  // lock: the node's heartbeats, had it sent any, would have waited behind it.
  clock.Advance(absl::Milliseconds(2500));
  c->RunSchedulerPass();
  Run(clock, *c, absl::Milliseconds(300));  // three scheduler ticks
  CHECK(alive());  // spared: not declared dead for silence the stall may have caused
  // The grace is one node_timeout, not immunity.
  Run(clock, *c, absl::Milliseconds(800));
  CHECK_FALSE(alive());
}

TEST_CASE("a dead node stays listed for dead_node_retention and is then forgotten", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock, 0, Timeouts(absl::Milliseconds(300), absl::Seconds(1)));
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


// ---------------------------------------------------------------- job scheduling

TEST_CASE("a job waits for min_servers and then for workers and starts once both are there", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock, 1, [](CoordinatorOptions& o) { o.min_servers = 2; });
  const std::string id = c.Submit(false, 2, "wait");
  c.Run(absl::Milliseconds(200));
  v1::Job j = *c->GetJob(id);
  CHECK(j.status().state() == v1::PENDING);
  CHECK(j.status().reason() == "ServersNotReady");
  CHECK(j.status().message() == "waiting for parameter servers: 1 of 2 live");
  c.AddServer();
  auto w1 = c.Register("", 1);
  REQUIRE(w1.ok());
  c.Run(absl::Milliseconds(300));
  j = *c->GetJob(id);
  CHECK(j.status().reason() == "WorkersNotReady");
  CHECK(j.status().message() == "needs 2 workers with a free slot; 1 free of 1 live");
  auto w2 = c.Register("", 1);
  REQUIRE(w2.ok());
  c.Run(absl::Milliseconds(100));
  j = *c->GetJob(id);
  REQUIRE(j.status().state() == v1::RUNNING);
  CHECK_THAT(j.status().conditions().rbegin()->message(),
             Catch::StartsWith("2 workers assigned; shard map version ") && Catch::EndsWith(" over 2 servers"));
  CHECK(c.Assignments(*w1) == std::vector<std::string>{id + "/0/0"});
  CHECK(c.Assignments(*w2) == std::vector<std::string>{id + "/1/0"});
}

TEST_CASE("jobs start in submission order: a job waiting for workers holds back later ones", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  auto w = c.Register("", 2);
  REQUIRE(w.ok());
  const std::string big = c.Submit(false, 2, "big");  // two ranks: two workers
  const std::string small = c.Submit(false, 1, "small");
  c.Run(absl::Milliseconds(500));
  CHECK(c->GetJob(big)->status().reason() == "WorkersNotReady");
  CHECK(c->GetJob(small)->status().state() == v1::PENDING);
  CHECK(c->GetJob(small)->status().reason() == "Queued");
  auto w2 = c.Register("", 1);
  REQUIRE(w2.ok());
  REQUIRE(c.RunUntil(big, v1::RUNNING));
  // big took a slot on each worker; small takes w's second one.
  REQUIRE(c.RunUntil(small, v1::RUNNING));
  CHECK(c->GetJob(small)->status().workers(0).worker_id() == *w);
}

TEST_CASE("a worker silent past node_timeout loses its rank to a free worker on the coordinator's clock",
          "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  auto a = c.Register("", 1);
  REQUIRE(a.ok());
  const std::string id = c.Submit(false, 1, "moves");
  REQUIRE(c.RunUntil(id, v1::RUNNING));
  auto b = c.Register("", 1);  // free, for when a goes
  REQUIRE(b.ok());
  c.Run(absl::Milliseconds(4800), *a);  // 4.9 s since a was last heard
  CHECK(c->GetJob(id)->status().workers(0).worker_id() == *a);
  c.Run(absl::Milliseconds(200), *a);
  const v1::Job j = *c->GetJob(id);
  CHECK(j.status().state() == v1::RUNNING);
  CHECK(j.status().workers(0).worker_id() == *b);
  CHECK(j.status().workers(0).incarnation() == 1);
  CHECK(j.status().reason() == "WorkerReplaced");
  bool lost = false;
  for (const auto& cond : j.status().conditions()) lost = lost || cond.reason() == "WorkerLost";
  CHECK(lost);
  CHECK(c.Assignments(*b) == std::vector<std::string>{id + "/0/1"});
}

TEST_CASE("a server lost before the job's first cut starts the job again from step 0 on the live servers",
          "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock, 2);
  auto w = c.Register("", 1);
  REQUIRE(w.ok());
  const std::string id = c.Submit(false, 1, "early");
  REQUIRE(c.RunUntil(id, v1::RUNNING));
  REQUIRE(c.Assignments(*w) == std::vector<std::string>{id + "/0/0"});
  std::string lost;
  const v1::ClusterState before = c->GetCluster();
  for (const v1::NodeStatus& n : before.nodes()) {
    if (n.info().role() == v1::SERVER) lost = n.info().node_id();
  }
  REQUIRE(!lost.empty());
  REQUIRE(c->GetJob(id)->status().checkpoints_size() == 0);
  c.Run(absl::Seconds(6), lost);  // past node_timeout: declared dead
  const v1::Job j = *c->GetJob(id);
  INFO(j.status().message());
  CHECK(j.status().state() == v1::RUNNING);
  CHECK(!j.status().restarting());
  CHECK(j.status().rollbacks() == 1);
  CHECK(j.status().restarts() == 0);  // a lost server is not the job's failure
  CHECK(j.status().reason() == "JobRestarted");
  CHECK(j.status().workers(0).step() == 0);
  // The shard map followed the live server, and the rank starts again as a
  // new incarnation.
  const v1::ClusterState cluster = c->GetCluster();
  CHECK(cluster.shard_map().servers_size() == 1);
  CHECK(c.Assignments(*w) == std::vector<std::string>{id + "/0/1"});
}

TEST_CASE("a server that joins while a job runs on a map without it holds up none of the job's cuts",
          "[coordinator]") {
  // The job starts on one server; a second registers while it runs (a
  // server back from a partition at a new node id, or one added): the map
  // stays the job's until no job runs, and the job's cuts, its final one
  // included, go on over the map's servers.
  testing::FakeClock clock;
  ClockedCluster c(&clock, 1);
  auto w = c.Register("", 1);
  REQUIRE(w.ok());
  const std::string id = c.Submit(false, 1, "joined");
  REQUIRE(c.RunUntil(id, v1::RUNNING));
  c.AddServer();
  c.Run(absl::Seconds(1));
  CHECK(c->GetCluster().shard_map().servers_size() == 1);
  c.Finish(id, 0);
  // The job's end is decided (its final cut, here none: it trained no
  // step) instead of waiting for the map to list the new server.
  REQUIRE(c.RunUntil(id, v1::SUCCEEDED));
  CHECK_THAT(c->GetJob(id)->status().message(), Catch::Contains("all 1 ranks finished"));
  // Once no job runs, the map follows both servers.
  c.Run(absl::Seconds(1));
  CHECK(c->GetCluster().shard_map().servers_size() == 2);
}

TEST_CASE("activeDeadlineSeconds fails a running job and ttlSecondsAfterFinished forgets it, on the clock",
          "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  auto w = c.Register("", 1);
  REQUIRE(w.ok());
  const std::string id = c.Submit(false, 1, "bounded", [](v1::JobSpec& s) {
    s.mutable_run_policy()->set_active_deadline_seconds(30);
    s.mutable_run_policy()->set_ttl_seconds_after_finished(60);
  });
  REQUIRE(c.RunUntil(id, v1::RUNNING));
  c.Run(absl::Seconds(29));
  CHECK(c->GetJob(id)->status().state() == v1::RUNNING);
  c.Run(absl::Seconds(2));
  v1::Job j = *c->GetJob(id);
  CHECK(j.status().state() == v1::FAILED);
  CHECK(j.status().reason() == "DeadlineExceeded");
  CHECK(j.status().message() == "the job ran longer than activeDeadlineSeconds (30 s)");
  CHECK(c.Assignments(*w).empty());
  c.Run(absl::Seconds(59));
  CHECK(c->GetJob(id).ok());
  c.Run(absl::Seconds(2));
  CHECK(c->GetJob(id).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("a job whose ranks all finish succeeds and frees its worker for the next", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  auto w = c.Register("", 1);
  REQUIRE(w.ok());
  const std::string first = c.Submit(false, 1, "first");
  const std::string second = c.Submit(false, 1, "second");
  REQUIRE(c.RunUntil(first, v1::RUNNING));
  c.Run(absl::Milliseconds(300));
  CHECK(c->GetJob(second)->status().reason() == "WorkersNotReady");
  c.Finish(first, 0);
  REQUIRE(c.RunUntil(first, v1::SUCCEEDED));
  REQUIRE(c.RunUntil(second, v1::RUNNING));
  CHECK(c.Assignments(*w) == std::vector<std::string>{second + "/0/0"});
}

}  // namespace
}  // namespace fulcrum
