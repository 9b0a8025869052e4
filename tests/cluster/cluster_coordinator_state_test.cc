// The coordinator's own state on an in-process cluster
// (tests/cluster/cluster_fixture.h): damaged RocksDB records, restarts, node
// registration, servers that cannot take the shard map, and a store or disk
// that fails.
#include "tests/cluster/cluster_fixture.h"

namespace fulcrum {
namespace {

TEST_CASE("a coordinator whose RocksDB state is damaged refuses to start and names the damage", "[cluster]") {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("fulcrum-damaged-coordinator-", getpid());
  fs::remove_all(dir);
  CoordinatorOptions o;
  o.data_dir = dir.string();
  {
    auto c = Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(1)));
    REQUIRE(c.ok());
    for (int i = 0; i < 300; ++i) REQUIRE((*c)->SubmitJob(DigitsSpec(), false).ok());
  }
  {
    // Into one table file, as a long-running coordinator's state would be.
    rocksdb::DB* db = nullptr;
    REQUIRE(rocksdb::DB::Open(rocksdb::Options(), o.data_dir, &db).ok());
    REQUIRE(db->CompactRange(rocksdb::CompactRangeOptions(), nullptr, nullptr).ok());
    delete db;
  }
  fs::path sst;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".sst" && (sst.empty() || fs::file_size(e.path()) > fs::file_size(sst))) sst = e.path();
  }
  REQUIRE(!sst.empty());
  const uintmax_t size = fs::file_size(sst);
  REQUIRE(size > 8 * 1024);  // several 4 KiB data blocks, then the index and footer
  {
    // A run of bytes in the middle of its data blocks turns to garbage.
    std::fstream f(sst, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size / 3));
    const std::string junk(64, '\x5a');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
  auto c = Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(1)));
  REQUIRE(!c.ok());
  INFO(c.status().ToString());
  CHECK(c.status().code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(c.status().message()),
             Catch::StartsWith("reading coordinator state in " + dir.string() + ": Corruption: "));
  fs::remove_all(dir);
}

TEST_CASE("a coordinator refuses to start on a record that parses but is damaged and names it", "[cluster]") {
  // Each case: the record a good coordinator wrote, with protobuf bytes
  // appended (they merge into the message), and what the error must say.
  struct Case {
    std::string key, appended, says;
  };
  const std::vector<Case> cases = {
      // spec { num_workers: 4294967295 }: every rank would get a slot.
      {"job/digits-1", std::string("\x12\x06\x30\xff\xff\xff\xff\x0f", 8),
       "coordinator record 'job/digits-1' is corrupt: num_workers 4294967295 is not 1 to 1024"},
      // status { workers { rank: 5 } }: a third entry for a job of 2 ranks.
      {"job/digits-1", std::string("\x1a\x05\x8a\x01\x02\x08\x05", 7),
       "coordinator record 'job/digits-1' is corrupt: worker entry 2 is for rank 5"},
      // status { workers { rank: 2 } }: in order, but one too many.
      {"job/digits-1", std::string("\x1a\x05\x8a\x01\x02\x08\x02", 7),
       "coordinator record 'job/digits-1' is corrupt: 3 worker entries for num_workers 2"},
      // id: "digits-9"
      {"job/digits-1", std::string("\x0a\x08") + "digits-9",
       "coordinator record 'job/digits-1' is corrupt: it holds job 'digits-9'"},
      // shard_map { servers: "a" }: a map with no virtual shards.
      {"meta", std::string("\x1a\x03\x1a\x01") + "a",
       "coordinator meta record is corrupt: its shard map: shard map has num_virtual_shards = 0"},
      // node_id: "worker-7"
      {"node/worker-0", std::string("\x0a\x08") + "worker-7",
       "coordinator record 'node/worker-0' is corrupt: it holds node 'worker-7'"},
  };
  for (const Case& k : cases) {
    CoordinatorOptions o;
    o.data_dir = testing::MakeTempDir("fulcrum-odd-record-coordinator");
    {
      auto c = Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(1)));
      REQUIRE(c.ok());
      REQUIRE((*c)->SubmitJob(DigitsSpec(), false).ok());
      v1::NodeInfo worker;
      worker.set_role(v1::WORKER);
      worker.set_hostname("test");
      auto r = (*c)->RegisterNode(worker);
      REQUIRE(r.ok());
      REQUIRE(r->node_id() == "worker-0");
    }
    {
      rocksdb::DB* raw = nullptr;
      REQUIRE(rocksdb::DB::Open(rocksdb::Options(), o.data_dir, &raw).ok());
      std::unique_ptr<rocksdb::DB> db(raw);
      std::string value;
      REQUIRE(db->Get(rocksdb::ReadOptions(), k.key, &value).ok());
      REQUIRE(db->Put(rocksdb::WriteOptions(), k.key, value + k.appended).ok());
    }
    auto c = Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(1)));
    REQUIRE(!c.ok());
    INFO(c.status().ToString());
    CHECK(c.status().code() == absl::StatusCode::kDataLoss);
    CHECK(c.status().message() == k.says);
  }
}

TEST_CASE("a server restarted at its address retires the old entry at once even while its heartbeat is parked",
          "[cluster]") {
  BareCoordinator bare([](CoordinatorOptions& o) {
    o.heartbeat_interval = absl::Seconds(5);  // the long poll stays parked for up to this
    o.node_timeout = absl::Seconds(20);
  });
  Coordinator& coordinator = *bare;
  v1::NodeInfo info;
  info.set_role(v1::SERVER);
  info.set_address("127.0.0.1:1");  // nothing listens: map installs fail and are retried
  auto old_node = coordinator.RegisterNode(info);
  REQUIRE(old_node.ok());
  // The old process heartbeats as node agents do: each call waits for a
  // change, and the next starts as soon as one returns. When it dies, its
  // last call is still waiting.
  std::atomic<bool> killed{false};
  std::thread agent([&] {
    v1::HeartbeatRequest hb;
    hb.set_node_id(old_node->node_id());
    hb.set_wait_ms(5000);
    while (!killed.load()) {
      auto r = coordinator.Heartbeat(hb);
      if (!r.ok()) return;
      hb.set_generation(r->generation());
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the shard map is made; the agent waits
  killed = true;
  const absl::Time restarted = absl::Now();
  auto new_node = coordinator.RegisterNode(info);  // same address, no node id: a new process
  REQUIRE(new_node.ok());
  CHECK(new_node->node_id() != old_node->node_id());
  auto alive = [&](const std::string& id) {
    const v1::ClusterState cs = coordinator.GetCluster();
    for (const auto& n : cs.nodes()) {
      if (n.info().node_id() == id) return n.alive();
    }
    return false;
  };
  while (alive(old_node->node_id()) && absl::Now() - restarted < absl::Seconds(15)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Declared dead by the next scheduler tick (100 ms), not a node_timeout
  // (20 s) after the parked heartbeat woke.
  CHECK_FALSE(alive(old_node->node_id()));
  CHECK(absl::Now() - restarted < absl::Seconds(5));
  CHECK(alive(new_node->node_id()));
  agent.join();
}

TEST_CASE("RegisterNode refuses a node it could not keep or dial, naming the field", "[cluster]") {
  BareCoordinator bare;
  Coordinator& coordinator = *bare;
  auto refused = [&](const v1::NodeInfo& info, const std::string& says) {
    auto r = coordinator.RegisterNode(info);
    INFO(says);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(r.status().message()), Catch::Contains(says));
  };
  v1::NodeInfo server;
  server.set_role(v1::SERVER);
  for (const char* bad : {"nohost", ":7071", "host:", "host:0", "host:65536", "host:http", "host:-1"}) {
    server.set_address(bad);
    refused(server, absl::StrCat("must be HOST:PORT with a port of 1 to 65535; got '", bad, "'"));
  }
  server.set_address(std::string(300, 'h') + ":7071");
  refused(server, "address is 305 bytes; at most 256 allowed");
  v1::NodeInfo worker;
  worker.set_role(v1::WORKER);
  worker.set_slots(4000000000u);
  refused(worker, "slots is 4000000000; allowed: 1 to 1024");
  worker.set_slots(1);
  worker.set_hostname(std::string(1000, 'x'));
  refused(worker, "hostname is 1000 bytes");
  worker.clear_hostname();
  for (int i = 0; i < 1025; ++i) worker.add_devices()->set_kind("cpu");
  refused(worker, "1025 devices; at most 1024 allowed");
  worker.mutable_devices()->DeleteSubrange(1, 1024);
  worker.mutable_devices(0)->set_name(std::string(257, 'n'));
  refused(worker, "devices.name is 257 bytes");
  worker.mutable_devices(0)->set_name("cpu");
  // Nothing refused was kept; what is valid registers.
  CHECK(coordinator.GetCluster().nodes_size() == 0);
  REQUIRE(coordinator.RegisterNode(worker).ok());
  server.set_address("[::1]:7071");
  REQUIRE(coordinator.RegisterNode(server).ok());
  CHECK(coordinator.GetCluster().nodes_size() == 2);
}

TEST_CASE("a restarted coordinator knows its jobs and nodes", "[cluster]") {
  InProcessCluster cluster(1, 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(2);  // cannot start on one worker: stays pending
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  cluster.RestartCoordinator();
  v1::Job j = Get(cluster.jobs(), id);
  CHECK(j.status().state() == v1::PENDING);
  CHECK(j.spec().SerializeAsString() == [&] {
    v1::JobSpec s = spec;
    // Defaults are made explicit on submit.
    s.mutable_consistency()->set_model(v1::ConsistencySpec::BSP);
    s.set_seed(1);
    return s.SerializeAsString();
  }());
  // The next id continues the sequence, and a second worker lets the job run.
  std::string id2;
  REQUIRE(Submit(cluster.jobs(), spec, &id2).ok());
  CHECK(id2 == "digits-2");
  auto cluster_stub = v1::ClusterService::NewStub(CreateFulcrumChannel(cluster.address(), 0, *security::Transport::Plaintext()));
  v1::ClusterState cs;
  REQUIRE(cluster_stub->GetCluster(Ctx().get(), v1::GetClusterRequest(), &cs).ok());
  CHECK(cs.nodes_size() == 2);  // the server and the worker, from RocksDB and their heartbeats
  CHECK(cs.shard_map().servers_size() == 1);
  cluster.AddWorker(1);
  int events = 0;
  j = WatchToEnd(cluster.jobs(), id, &events);
  CHECK(j.status().state() == v1::SUCCEEDED);
  CHECK(j.status().test_accuracy() >= 0.90);
}

TEST_CASE("a restarted coordinator gives new work only to workers it has heard from since", "[cluster]") {
  InProcessCluster cluster(1, 1);
  // A worker that registered and then died with the old coordinator: the
  // new one loads it from RocksDB and cannot tell yet. Four free slots make
  // it the scheduler's first choice if it were eligible.
  auto cluster_stub = v1::ClusterService::NewStub(CreateFulcrumChannel(cluster.address(), 0, *security::Transport::Plaintext()));
  v1::RegisterNodeRequest reg;
  reg.mutable_node()->set_role(v1::WORKER);
  reg.mutable_node()->set_slots(4);
  reg.mutable_node()->set_hostname("gone");
  v1::RegisterNodeResponse gone;
  REQUIRE(cluster_stub->RegisterNode(Ctx().get(), reg, &gone).ok());
  cluster.RestartCoordinator();  // well within node_timeout (2 s) of its registration
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  int events = 0;
  const v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
  CHECK(j.status().state() == v1::SUCCEEDED);
  REQUIRE(j.status().workers_size() == 1);
  CHECK(j.status().workers(0).worker_id() != gone.node_id());
  // Not handed to the dead worker and taken back when it missed heartbeats.
  CHECK(j.status().restarts() == 0);
  for (const auto& c : j.status().conditions()) CHECK(c.reason() != "WorkerLost");
}

TEST_CASE("a server that cannot take the shard map is named in the waiting job and logged once a minute",
          "[cluster]") {
  InProcessCluster cluster(1, 1);
  // A server that heartbeats but whose parameter service is not there: its
  // advertised address is wrong (nothing listens on it).
  const std::string nowhere = absl::StrCat("127.0.0.1:", FreePort());
  const fs::path log = fs::temp_directory_path() / absl::StrCat("fulcrum-capture-", getpid(), ".log");
  CaptureStderr capture(log);
  auto fake = std::make_unique<FakeNodes>(cluster.address(), 1, v1::SERVER, nowhere);
  std::string id;
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.set_epochs(2);
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  v1::Job j = WaitForJob(
      cluster.jobs(), id, [&](const v1::Job& j) { return absl::StrContains(j.status().message(), nowhere); },
      absl::Seconds(20));
  CHECK(j.status().state() == v1::PENDING);
  CHECK(j.status().reason() == "ShardMapNotReady");
  CHECK_THAT(j.status().message(), Catch::StartsWith("installing the shard map on the servers; " + nowhere +
                                                     " fails: UNAVAILABLE"));
  // Retried every tick (100 ms), logged once.
  const double failures = WaitForMetric(
      cluster.coordinator(), "fulcrum_coordinator_server_call_failures_total{call=\"install_shard_map\"}", 10);
  REQUIRE(failures != -1);
  CHECK(failures >= 10);
  // The server goes (its heartbeats stop): the map drops it, the job runs.
  fake.reset();
  int events = 0;
  j = WatchToEnd(cluster.jobs(), id, &events);
  const std::string text = capture.Stop();
  INFO(text.substr(0, 4000));
  CHECK(j.status().state() == v1::SUCCEEDED);
  CHECK(CountOf(text, "installing the shard map on " + nowhere + " failed") == 1);
  CHECK(CountOf(text, "(1 failure; retried every tick, logged once a minute)") == 1);
  fs::remove(log);
}

TEST_CASE("a coordinator that cannot save its state refuses what it would lose and saves it all once it can",
          "[cluster]") {
  using Fault = testing::FaultFs::Fault;
  // RocksDB stops writing after either; the coordinator reopens it.
  const Fault fault = GENERATE(Fault::kNoSpace, Fault::kIoError);
  const bool eio = fault == Fault::kIoError;
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("fulcrum-store-fault-", getpid(), eio ? "-eio" : "-enospc");
  fs::remove_all(dir);
  testing::FaultFs disk;
  CoordinatorOptions o;
  o.data_dir = dir.string();
  o.env = disk.env();
  o.store_retry = absl::Milliseconds(200);
  auto opened = Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(1)));
  REQUIRE(opened.ok());
  std::unique_ptr<Coordinator> c = *std::move(opened);
  const v1::JobSpec spec = DigitsSpec();
  const absl::StatusOr<std::string> kept = c->SubmitJob(spec, false);
  REQUIRE(kept.ok());
  v1::NodeInfo w1;
  w1.set_role(v1::WORKER);
  w1.set_hostname("w1");
  w1.set_pid(1);
  REQUIRE(c->RegisterNode(w1).ok());
  v1::NodeInfo w2 = w1;
  w2.set_hostname("w2");
  auto all = [](const v1::Job&) { return true; };

  const fs::path log = fs::temp_directory_path() / absl::StrCat("fulcrum-capture-store-", getpid(), ".log");
  CaptureStderr capture(log);
  disk.Set(fault);
  const absl::StatusOr<std::string> lost = c->SubmitJob(spec, false);
  INFO(lost.status().ToString());
  CHECK(lost.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(lost.status().message()),
             Catch::StartsWith("the coordinator cannot save its state in " + dir.string()) &&
                 Catch::Contains("injected by the test") && Catch::Contains("the job was not submitted"));
  const absl::StatusOr<v1::Job> cancel = c->CancelJob(*kept);
  INFO(cancel.status().ToString());
  CHECK(cancel.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(cancel.status().message()), Catch::Contains("job '" + *kept + "' was not cancelled"));
  CHECK(c->GetJob(*kept)->status().state() == v1::PENDING);
  const auto refused = c->RegisterNode(w2);
  CHECK(refused.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("worker at w2 pid 1 not registered"));
  CHECK(c->GetCluster().nodes_size() == 1);
  CHECK(c->ListJobs(0, "", all)->jobs.size() == 1);
  // The scheduler retries every 200 ms meanwhile, and logs the outage once.
  CHECK(WaitForMetric(*c, "fulcrum_coordinator_store_write_failures_total", 4) >= 4);
  CHECK(c->SubmitJob(spec, false).status().code() == absl::StatusCode::kUnavailable);
  CHECK(MetricOf(*c, "fulcrum_coordinator_store_unsaved_records") >= 3);  // meta, 2 jobs, a node

  disk.Set(Fault::kNone);
  const absl::Time healed = absl::Now();
  absl::StatusOr<std::string> later = c->SubmitJob(spec, false);
  while (!later.ok() && absl::Now() - healed < absl::Seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    later = c->SubmitJob(spec, false);
  }
  INFO(later.status().ToString());
  REQUIRE(later.ok());
  REQUIRE(c->CancelJob(*kept).ok());
  REQUIRE(c->RegisterNode(w2).ok());
  while (MetricOf(*c, "fulcrum_coordinator_store_unsaved_records") != 0 && absl::Now() - healed < absl::Seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(MetricOf(*c, "fulcrum_coordinator_store_unsaved_records") == 0);
  const std::string text = capture.Stop();
  INFO(text.substr(0, 4000));
  CHECK(CountOf(text, "cannot save coordinator state in " + dir.string()) == 1);
  CHECK(CountOf(text, "saved again after") == 1);
  if (eio) CHECK(CountOf(text, "(RocksDB reopened)") == 1);
  fs::remove(log);

  // What was acknowledged is there after a restart, and nothing else.
  c.reset();
  o.env = nullptr;
  opened = Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(1)));
  REQUIRE(opened.ok());
  c = *std::move(opened);
  const std::vector<v1::Job> jobs = c->ListJobs(0, "", all)->jobs;
  REQUIRE(jobs.size() == 2);
  CHECK(jobs[0].id() == *kept);
  CHECK(jobs[0].status().state() == v1::CANCELLED);
  CHECK(jobs[1].id() == *later);
  CHECK(jobs[1].status().state() == v1::PENDING);
  std::set<std::string> hosts;
  const v1::ClusterState cluster = c->GetCluster();
  for (const auto& n : cluster.nodes()) hosts.insert(n.info().hostname());
  CHECK(hosts == std::set<std::string>{"w1", "w2"});
  // Ids the refused submissions took are not given again.
  const absl::StatusOr<std::string> next = c->SubmitJob(spec, false);
  REQUIRE(next.ok());
  CHECK(std::stoull(next->substr(next->rfind('-') + 1)) > std::stoull(later->substr(later->rfind('-') + 1)));
  c.reset();
  fs::remove_all(dir);
}

TEST_CASE("a disk that fails in the middle of a job loses none of its reports", "[cluster]") {
  testing::FaultFs disk;
  InProcessCluster cluster(1, 2, 1, absl::Minutes(5), [&](CoordinatorOptions& o) {
    o.env = disk.env();
    o.store_retry = absl::Milliseconds(200);
  });
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(30);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  const v1::Job running = WaitForJob(
      cluster.jobs(), id, [](const v1::Job& j) { return j.status().epochs_size() >= 2; }, absl::Seconds(60));
  REQUIRE(running.status().state() == v1::RUNNING);
  disk.Set(testing::FaultFs::Fault::kIoError);
  // Down until writes have failed 15 times (about 3 s of the scheduler's
  // 200 ms retries, with the workers' reports): the epoch reports meanwhile
  // are refused (the workers send them again).
  CHECK(WaitForMetric(cluster.coordinator(), "fulcrum_coordinator_store_write_failures_total", 15) >= 15);
  disk.Set(testing::FaultFs::Fault::kNone);
  int events = 0;
  const v1::Job done = WatchToEnd(cluster.jobs(), id, &events);
  INFO(done.status().message());
  CHECK(disk.failed() > 0);
  CHECK(done.status().state() == v1::SUCCEEDED);
  CHECK(done.status().epochs_size() == 30);
  // Every acknowledged report was saved: a restarted coordinator has them.
  cluster.RestartCoordinator();
  const v1::Job after = Get(cluster.jobs(), id);
  CHECK(after.status().state() == v1::SUCCEEDED);
  CHECK(after.status().epochs_size() == 30);
  for (const v1::EpochSummary& e : after.status().epochs()) CHECK(e.reported_ranks_size() == 2);
}

TEST_CASE("a coordinator away for 12 s while the job ends: every node is back within its grace and the job succeeds "
          "with no restart",
          "[cluster]") {
  InProcessCluster cluster(2, 2);  // node timeout 2 s: a restarted coordinator's grace
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(40);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  const v1::Job running = WaitForJob(
      cluster.jobs(), id, [](const v1::Job& j) { return j.status().step() > 0; }, absl::Seconds(30));
  REQUIRE(running.status().state() == v1::RUNNING);
  // Training goes on between workers and servers; the ranks' last reports
  // (epochs, the end) wait for the coordinator. Its nodes' channels back
  // off meanwhile: at gRPC's default (up to 120 s) their next try came
  // about 16 s into the outage, past the 2 s grace, and every node was
  // declared dead. The outage is real time: gRPC's reconnect backoff runs
  // on it, and a shorter one stays inside the default backoff's early tries.
  cluster.StopCoordinator();
  std::this_thread::sleep_for(std::chrono::seconds(12));
  cluster.StartCoordinator();
  const v1::Job j = WaitForJob(
      cluster.jobs(), id, [](const v1::Job& j) { return config::JobEnded(j.status().state()); }, absl::Seconds(60));
  std::string conditions;
  for (const auto& c : j.status().conditions()) absl::StrAppend(&conditions, c.reason(), ": ", c.message(), "\n");
  INFO(conditions);
  CHECK(j.status().state() == v1::SUCCEEDED);
  CHECK(j.status().restarts() == 0);
  CHECK(j.status().rollbacks() == 0);
  CHECK(j.status().epochs_size() == 40);
  CHECK(j.status().test_accuracy() >= 0.85);
  for (const auto& c : j.status().conditions()) {
    CHECK(c.reason() != "WorkerLost");
    CHECK(c.reason() != "ServerLost");
  }
}

}  // namespace
}  // namespace fulcrum
