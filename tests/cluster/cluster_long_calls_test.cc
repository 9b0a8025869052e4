// Long calls on an in-process cluster (tests/cluster/cluster_fixture.h):
// WatchJob streams, parked heartbeats and CheckpointJob calls hold no
// coordinator thread and end cleanly.
#include "tests/cluster/cluster_fixture.h"

namespace fulcrum {
namespace {

TEST_CASE("open WatchJob streams and heartbeats hold no coordinator thread and are released on cancel and shutdown",
          "[cluster]") {
  BareCoordinator bare([](CoordinatorOptions& o) {
    o.heartbeat_interval = absl::Seconds(60);  // heartbeats stay parked
    o.node_timeout = absl::Seconds(120);
  });
  Coordinator& coordinator = *bare;
  auto server = CoordinatorGrpcServer::Start(&coordinator, "127.0.0.1:0");
  REQUIRE(server.ok());
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto jobs = v1::JobService::NewStub(channel);
  auto cluster = v1::ClusterService::NewStub(channel);
  std::string id;
  REQUIRE(Submit(jobs.get(), DigitsSpec(), &id).ok());  // stays PENDING: no server
  auto settles_at = [&](const char* call, double want) { return LongPollsSettle(coordinator, call, want); };

  // 40 watchers, each past its first event (the snapshot), then parked.
  const int64_t threads_before = testing::ThreadCount(getpid());
  std::vector<std::unique_ptr<grpc::ClientContext>> watch_ctx;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::JobEvent>>> watches;
  v1::JobRef ref;
  ref.set_job_id(id);
  for (int i = 0; i < 40; ++i) {
    watch_ctx.push_back(std::make_unique<grpc::ClientContext>());
    watches.push_back(jobs->WatchJob(watch_ctx.back().get(), ref));
    v1::JobEvent e;
    REQUIRE(watches.back()->Read(&e));
    CHECK(e.kind() == "snapshot");
  }
  // 20 nodes, each with a heartbeat parked (the generation they send is
  // the current one, so there is nothing to answer for 60 s).
  std::vector<std::unique_ptr<ParkedHeartbeat>> beats;
  for (int i = 0; i < 20; ++i) {
    v1::RegisterNodeRequest reg;
    reg.mutable_node()->set_role(v1::WORKER);
    reg.mutable_node()->set_hostname(absl::StrCat("parked-", i));
    v1::RegisterNodeResponse r;
    REQUIRE(cluster->RegisterNode(Ctx().get(), reg, &r).ok());
    auto hb = std::make_unique<ParkedHeartbeat>();
    hb->req.set_node_id(r.node_id());
    hb->req.set_generation(coordinator.GetCluster().generation());
    hb->req.set_wait_ms(60000);
    cluster->async()->Heartbeat(&hb->ctx, &hb->req, &hb->resp,
                                [p = hb.get()](grpc::Status s) { p->done.set_value(s); });
    beats.push_back(std::move(hb));
  }
  CHECK(settles_at("watch_job", 40));
  CHECK(settles_at("heartbeat", 20));
  // With a thread per open call there would be 60 more; gRPC's own pollers
  // and executors come to a few.
  CHECK(testing::ThreadCount(getpid()) - threads_before < 20);

  // Watchers and nodes that hang up withdraw their polls.
  for (int i = 0; i < 20; ++i) watch_ctx[static_cast<size_t>(i)]->TryCancel();
  for (int i = 0; i < 10; ++i) beats[static_cast<size_t>(i)]->ctx.TryCancel();
  CHECK(settles_at("watch_job", 20));
  CHECK(settles_at("heartbeat", 10));
  for (int i = 0; i < 20; ++i) {
    v1::JobEvent e;
    CHECK_FALSE(watches[static_cast<size_t>(i)]->Read(&e));
    CHECK(watches[static_cast<size_t>(i)]->Finish().error_code() == grpc::StatusCode::CANCELLED);
  }
  for (int i = 0; i < 10; ++i) {
    CHECK(beats[static_cast<size_t>(i)]->done.get_future().get().error_code() == grpc::StatusCode::CANCELLED);
  }

  // The job ends: each remaining watcher gets the CANCELLED state as its
  // last event, and the stream ends OK.
  {
    v1::Job j;
    REQUIRE(jobs->CancelJob(Ctx().get(), ref, &j).ok());
  }
  for (int i = 20; i < 40; ++i) {
    v1::JobEvent e, last;
    while (watches[static_cast<size_t>(i)]->Read(&e)) last = e;
    CHECK(last.kind() == "state");
    CHECK(last.job().status().state() == v1::CANCELLED);
    CHECK(watches[static_cast<size_t>(i)]->Finish().ok());
  }
  CHECK(settles_at("watch_job", 0));

  // Shutdown with 10 heartbeats parked answers them and returns at once,
  // not after their 60 s.
  const absl::Time stop = absl::Now();
  (*server)->Shutdown();
  CHECK(absl::Now() - stop < absl::Seconds(5));
  for (int i = 10; i < 20; ++i) {
    auto f = beats[static_cast<size_t>(i)]->done.get_future();
    REQUIRE(f.wait_for(std::chrono::seconds(5)) == std::future_status::ready);
    const grpc::Status s = f.get();
    // Answered with the new generation before the transport closed, or cut.
    CHECK((s.ok() || s.error_code() == grpc::StatusCode::UNAVAILABLE ||
           s.error_code() == grpc::StatusCode::CANCELLED));
  }
  CHECK(MetricOf(coordinator, "fulcrum_coordinator_long_polls{call=\"heartbeat\"}") == 0);
}

TEST_CASE("watchers that hang up at random moments of a running job each end cleanly and leave no poll behind",
          "[cluster]") {
  InProcessCluster cluster(2, 2);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), DigitsSpec(), &id).ok());
  v1::JobRef ref;
  ref.set_job_id(id);
  // Progress reports change the job many times a second, so a hang-up
  // lands while a watch is parked, while its event is being written, or
  // while its answer is on the way.
  constexpr int kWatchers = 24;
  std::vector<std::thread> threads;
  std::atomic<int> cancelled{0}, to_the_end{0}, wrong{0};
  for (int i = 0; i < kWatchers; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      auto reader = cluster.jobs()->WatchJob(&ctx, ref);
      const bool hang_up = i % 3 != 0;
      const absl::Time leave = absl::Now() + absl::Milliseconds(50 * i);
      v1::JobEvent e, last;
      int events = 0;
      while (reader->Read(&e)) {
        last = e;
        ++events;
        if (hang_up && absl::Now() >= leave) ctx.TryCancel();
      }
      const grpc::Status s = reader->Finish();
      if (s.ok() && config::JobEnded(last.job().status().state()) && events > 0) {
        ++to_the_end;
      } else if (hang_up && s.error_code() == grpc::StatusCode::CANCELLED) {
        ++cancelled;
      } else {
        ++wrong;
        WARN("watcher " << i << ": " << s.error_code() << " " << s.error_message() << " after " << events
                        << " events");
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(wrong == 0);
  CHECK(to_the_end >= kWatchers / 3);  // those that never hang up
  CHECK(cancelled >= 1);
  CHECK(cancelled + to_the_end == kWatchers);
  CHECK(LongPollsSettle(cluster.coordinator(), "watch_job", 0));
}

TEST_CASE("without tokens each client address may hold max_long_calls_per_user watches", "[cluster]") {
  BareCoordinator bare([](CoordinatorOptions& o) { o.max_long_calls_per_user = 2; });
  auto server = CoordinatorGrpcServer::Start(&*bare, "127.0.0.1:0");
  REQUIRE(server.ok());
  auto jobs = v1::JobService::NewStub(grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
  std::string id;
  REQUIRE(Submit(jobs.get(), DigitsSpec(), &id).ok());  // stays PENDING: no server
  v1::JobRef ref;
  ref.set_job_id(id);
  grpc::ClientContext first_ctx, second_ctx;
  auto first = jobs->WatchJob(&first_ctx, ref);
  auto second = jobs->WatchJob(&second_ctx, ref);
  v1::JobEvent e;
  REQUIRE(first->Read(&e));
  REQUIRE(second->Read(&e));
  grpc::ClientContext third_ctx;
  auto third = jobs->WatchJob(&third_ctx, ref);
  CHECK_FALSE(third->Read(&e));
  const grpc::Status refused = third->Finish();
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_THAT(refused.error_message(),
             Catch::Contains("caller ipv4:127.0.0.1 has 2 WatchJob, CheckpointJob and ExportCheckpoint calls open"));
  v1::CheckpointInfo info;
  CHECK(jobs->CheckpointJob(Ctx().get(), ref, &info).error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Once a watcher hangs up, the address may watch again.
  first_ctx.TryCancel();
  CHECK(first->Finish().error_code() == grpc::StatusCode::CANCELLED);
  bool watching = false;
  for (int tries = 0; tries < 500 && !watching; ++tries) {
    grpc::ClientContext ctx;
    auto again = jobs->WatchJob(&ctx, ref);
    watching = again->Read(&e);
    ctx.TryCancel();
    (void)again->Finish();
    if (!watching) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(watching);
  second_ctx.TryCancel();
  (void)second->Finish();
  (*server)->Shutdown();
}

TEST_CASE("CheckpointJob calls wait for their cut without a coordinator thread and end on commit hang-up "
          "timeout and shutdown",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(4000);  // runs until the coordinator stops
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  REQUIRE(WaitForJob(cluster.jobs(), id, [](const v1::Job& j) { return j.status().step() >= 10; }, absl::Seconds(10))
              .status()
              .step() >= 10);
  v1::JobRef ref;
  ref.set_job_id(id);
  auto start = [&](absl::Duration deadline) {
    auto p = std::make_unique<PendingCheckpoint>();
    p->ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    cluster.jobs()->async()->CheckpointJob(&p->ctx, &ref, &p->info,
                                           [q = p.get()](grpc::Status st) { q->done.set_value(st); });
    return p;
  };
  auto settles_at = [&](double want) { return LongPollsSettle(cluster.coordinator(), "checkpoint_job", want); };
  auto answered = [](PendingCheckpoint& p) {
    REQUIRE(p.result.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
    return p.result.get();
  };

  // The servers hold every cut, so 40 calls wait: 30 with a minute to go,
  // 10 with 3 s.
  Faults& faults = cluster.faults();
  faults.hold_cuts = true;
  const int64_t threads_before = testing::ThreadCount(getpid());
  std::vector<std::unique_ptr<PendingCheckpoint>> calls;
  for (int i = 0; i < 30; ++i) calls.push_back(start(absl::Seconds(60)));
  for (int i = 0; i < 10; ++i) calls.push_back(start(absl::Seconds(3)));
  CHECK(settles_at(40));
  // A thread per waiting call would be 40 more.
  CHECK(testing::ThreadCount(getpid()) - threads_before < 20);

  // Callers that hang up withdraw their calls.
  for (int i = 0; i < 10; ++i) calls[static_cast<size_t>(i)]->ctx.TryCancel();
  for (int i = 0; i < 10; ++i) CHECK(answered(*calls[static_cast<size_t>(i)]).error_code() == grpc::StatusCode::CANCELLED);
  // The short ones are answered before their deadline, saying what they waited for.
  for (int i = 30; i < 40; ++i) {
    const grpc::Status st = answered(*calls[static_cast<size_t>(i)]);
    CHECK(st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    CHECK(st.error_message().find("not committed within") != std::string::npos);
  }
  CHECK(settles_at(20));
  CHECK(faults.cuts_held.load() >= 1);

  // The servers answer: every remaining call gets a committed manual cut.
  faults.hold_cuts = false;
  for (int i = 10; i < 30; ++i) {
    PendingCheckpoint& p = *calls[static_cast<size_t>(i)];
    const grpc::Status st = answered(p);
    INFO(st.error_message());
    CHECK(st.ok());
    CHECK(p.info.trigger() == "manual");
    CHECK(p.info.step() >= 10);
    CHECK(p.info.servers_size() == 2);
  }
  CHECK(settles_at(0));

  // Shutdown answers the calls still waiting, at once.
  faults.hold_cuts = true;
  std::vector<std::unique_ptr<PendingCheckpoint>> last;
  for (int i = 0; i < 5; ++i) last.push_back(start(absl::Seconds(60)));
  CHECK(settles_at(5));
  const absl::Time stop_at = absl::Now();
  std::thread stop([&] { cluster.StopCoordinator(); });  // waits for the held cut
  for (auto& p : last) {
    const grpc::Status st = answered(*p);
    CHECK((st.error_code() == grpc::StatusCode::UNAVAILABLE || st.error_code() == grpc::StatusCode::CANCELLED));
  }
  CHECK(absl::Now() - stop_at < absl::Seconds(5));
  faults.hold_cuts = false;
  stop.join();
}

}  // namespace
}  // namespace fulcrum
