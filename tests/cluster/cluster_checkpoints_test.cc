// Cuts, restores and rollbacks on an in-process cluster
// (tests/cluster/cluster_fixture.h).
#include "tests/cluster/cluster_fixture.h"

namespace fulcrum {
namespace {

TEST_CASE("cuts taken every second and on demand are committed on every server, and only the last K stay on disk",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 2);
  v1::JobSpec spec = DigitsSpec();
  // Several seconds of steps: BSP cuts are aimed about a second of steps
  // ahead, and none is taken within a second of the end (the final one is).
  // (400 epochs took 4 s once workers used shared memory: too few cuts.)
  spec.set_epochs(1000);
  spec.mutable_checkpoint()->set_every_seconds(1);
  spec.mutable_checkpoint()->set_keep(3);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  for (int tries = 0; tries < 200 && Get(cluster.jobs(), id).status().step() < 10; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  v1::JobRef ref;
  ref.set_job_id(id);
  v1::CheckpointInfo manual;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  const grpc::Status s = cluster.jobs()->CheckpointJob(&ctx, ref, &manual);
  INFO(s.error_message());
  REQUIRE(s.ok());
  CHECK(manual.trigger() == "manual");
  CHECK(manual.servers_size() == 2);
  CHECK(manual.positions_size() == 2);
  CHECK(manual.step() > 0);
  int events = 0;
  const v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
  INFO(j.status().message() << " " << j.status().last_checkpoint_error());
  REQUIRE(j.status().state() == v1::SUCCEEDED);
  REQUIRE(j.status().checkpoints_size() == 3);
  CHECK(j.status().checkpoints(2).trigger() == "final");
  CHECK(j.status().checkpoints(1).trigger() == "seconds");
  CHECK(j.status().next_cut_id() > 4);  // more cuts were taken than kept
  std::set<uint64_t> kept;
  for (const auto& c : j.status().checkpoints()) kept.insert(c.cut_id());
  // The servers hold exactly the cuts the job lists (older ones deleted).
  for (auto& server : cluster.servers()) {
    std::set<uint64_t> on_disk;
    for (int tries = 0; tries < 50; ++tries) {
      auto cuts = server.ps->ListCuts(id);
      REQUIRE(cuts.ok());
      on_disk.clear();
      for (const auto& m : *cuts) on_disk.insert(m.cut_id());
      if (on_disk == kept) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    CHECK(on_disk == kept);
  }
  // A finished job cannot be checkpointed, and says which cuts it has.
  v1::CheckpointInfo late;
  grpc::Status again = cluster.jobs()->CheckpointJob(Ctx().get(), ref, &late);
  CHECK(again.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(again.error_message().find("only a running job") != std::string::npos);
  // Export and restore name the cuts a job has when asked for another.
  v1::RestoreJobRequest bad;
  bad.set_job_id(id);
  bad.set_cut_id(999);
  v1::Job unused;
  grpc::Status missing = cluster.jobs()->RestoreJob(Ctx().get(), bad, &unused);
  CHECK(missing.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(missing.error_message().find("its checkpoints: ") != std::string::npos);
}

// SSP and ASP cuts are taken when asked, at whatever step the ranks are
// on: the coordinator must still ask once per every_steps boundary, not at
// every tick once the next boundary is near (which took a cut every 0.1 s).
TEST_CASE("a restore that keeps failing fails the job after restore_timeout with the servers' error",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 1, 1, /*restore_timeout=*/absl::Seconds(2));
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.mutable_checkpoint()->set_every_steps(50);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  int events = 0;
  v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
  REQUIRE(j.status().state() == v1::SUCCEEDED);
  REQUIRE(j.status().checkpoints_size() > 0);

  cluster.FailRestores(true);
  v1::RestoreJobRequest req;
  req.set_job_id(id);
  v1::Job accepted;
  grpc::Status s = cluster.jobs()->RestoreJob(Ctx().get(), req, &accepted);
  INFO(s.error_message());
  REQUIRE(s.ok());
  // Restoring, nothing trains: no speed or ETA left over from the run.
  CHECK(accepted.status().samples_per_second() == 0);
  CHECK(accepted.status().eta_seconds() == 0);
  const absl::Time asked = absl::Now();
  j = WatchToEnd(cluster.jobs(), id, &events);
  INFO(j.status().message());
  CHECK(j.status().state() == v1::FAILED);
  CHECK(j.status().reason() == "RestoreFailed");
  CHECK(j.status().message().find("still failed after 2s") != std::string::npos);
  CHECK(j.status().message().find("no room (injected)") != std::string::npos);
  CHECK(absl::Now() - asked >= absl::Seconds(2));
}

TEST_CASE("a rank's ServerLost or TornStep rolls the job back without counting against its backoff limit, other "
          "errors count until the job makes progress",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(400);
  spec.mutable_checkpoint()->set_every_steps(50);
  spec.mutable_run_policy()->set_backoff_limit(1);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  // Reports rank 0's failure once the rank is training (again) after a
  // committed cut; returns the job after the rollback.
  auto fail_rank0 = [&](const std::string& reason, uint32_t rollbacks_before) {
    v1::Job j = WaitForJob(
        cluster.jobs(), id,
        [](const v1::Job& j) {
          if (j.status().workers_size() == 0) return false;
          const auto& w = j.status().workers(0);
          return j.status().checkpoints_size() > 0 && j.status().restoring_cut() == 0 && !w.worker_id().empty() &&
                 w.state() == "training";
        },
        absl::Seconds(30));
    REQUIRE(j.status().state() == v1::RUNNING);
    REQUIRE(j.status().rollbacks() == rollbacks_before);
    const std::string error = absl::StrCat("pull from a server: job '", id, "' is not on this server");
    CHECK(FailRank0(cluster.address(), j, reason, error).stop());
    return Get(cluster.jobs(), id);
  };
  v1::Job j = fail_rank0("ServerLost", 0);
  INFO(j.status().message());
  CHECK(j.status().rollbacks() == 1);
  CHECK(j.status().restarts() == 0);
  CHECK(j.status().reason() == "ServerLost");
  // A step a lost worker left torn between servers: its replacement's
  // report rolls back, and counts no more than the loss itself did.
  j = fail_rank0("TornStep", 1);
  CHECK(j.status().rollbacks() == 2);
  CHECK(j.status().restarts() == 0);
  CHECK(j.status().reason() == "TornStep");
  j = fail_rank0("WorkerError", 2);
  CHECK(j.status().rollbacks() == 3);
  CHECK(j.status().restarts() == 1);
  CHECK(j.status().failures_in_a_row() == 1);
  const uint64_t stuck_at = j.status().step_at_last_failure();
  CHECK(stuck_at > 0);
  // Once the job trains past where it failed, the next failure starts the
  // count again: with backoff_limit 1, a second failure in a row would end
  // the job; after progress it does not (a supervisor's restarts go on).
  WaitForJob(
      cluster.jobs(), id, [&](const v1::Job& x) { return x.status().step() > stuck_at + 5; }, absl::Seconds(60));
  j = fail_rank0("WorkerError", 3);
  INFO(j.status().message());
  CHECK(j.status().state() == v1::RUNNING);
  CHECK(j.status().rollbacks() == 4);
  CHECK(j.status().restarts() == 2);
  CHECK(j.status().failures_in_a_row() == 1);
  CHECK(j.status().step_at_last_failure() > stuck_at);
  Cancel(cluster.jobs(), id);
}

TEST_CASE("a table out of parameter memory ends the job at once: a rollback would bring the same rows back",
          "[cluster][checkpoint][quota]") {
  InProcessCluster cluster(1, 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(400);
  spec.mutable_checkpoint()->set_every_steps(50);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  // A committed cut, so a rollback would be possible.
  const v1::Job j = WaitForJob(
      cluster.jobs(), id,
      [](const v1::Job& j) {
        return j.status().checkpoints_size() > 0 && j.status().workers_size() > 0 &&
               j.status().workers(0).state() == "training";
      },
      absl::Seconds(30));
  REQUIRE(j.status().state() == v1::RUNNING);
  const std::string error = absl::StrCat("push to 127.0.0.1:1: job '", id,
                                         "' would exceed its parameter memory quota of 67108864 bytes on this server: "
                                         "a new row of table 'factors' needs 32 bytes, 67108848 already in use");
  CHECK(IsParameterMemoryExhausted(absl::ResourceExhaustedError(error)));
  FailRank0(cluster.address(), j, "QuotaExceeded", error);
  const v1::Job failed = Get(cluster.jobs(), id);
  INFO(failed.status().message());
  CHECK(failed.status().state() == v1::FAILED);
  CHECK(failed.status().reason() == "QuotaExceeded");
  CHECK(failed.status().rollbacks() == 0);
  CHECK(failed.status().message().find("raise the job's quota_bytes") != std::string::npos);
}

TEST_CASE("after a rollback, ranks back on their own worker are not 'replaced', and ranks without figures are not "
          "averaged in",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(1, 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(5000);  // still running when the test cancels it
  spec.mutable_checkpoint()->set_every_steps(50);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  v1::Job j = WaitForJob(
      cluster.jobs(), id,
      [](const v1::Job& j) {
        if (j.status().workers_size() < 2 || j.status().checkpoints_size() == 0) return false;
        for (const auto& w : j.status().workers()) {
          if (w.state() != "training" || !w.has_metrics()) return false;
        }
        return true;
      },
      absl::Seconds(30));
  REQUIRE(j.status().state() == v1::RUNNING);
  const double accuracy = j.status().train_accuracy();
  CHECK(accuracy > 0.3);
  const std::string before[2] = {j.status().workers(0).worker_id(), j.status().workers(1).worker_id()};
  REQUIRE(FailRank0(cluster.address(), j, "WorkerError", "injected").stop());
  // Both ranks start again, each on either worker.
  j = WaitForJob(
      cluster.jobs(), id,
      [](const v1::Job& j) {
        return j.status().restoring_cut() == 0 && j.status().workers(0).incarnation() >= 2 &&
               j.status().workers(1).incarnation() >= 2;
      },
      absl::Seconds(30));
  int replaced = 0, moved = 0;
  for (const auto& c : j.status().conditions()) replaced += c.reason() == "WorkerReplaced";
  for (int i = 0; i < 2; ++i) moved += j.status().workers(i).worker_id() != before[i];
  // Only a rank that moved to another worker had its worker replaced.
  CHECK(replaced == moved);
  // Until a rank reports figures of its own, the job keeps those it had.
  for (const auto& w : j.status().workers()) {
    if (!w.has_metrics()) CHECK(w.train_accuracy() == 0);
  }
  CHECK(j.status().train_accuracy() >= 0.7 * accuracy);
  INFO(v1::JobState_Name(j.status().state()) << ": " << j.status().message());
  Cancel(cluster.jobs(), id);
}

TEST_CASE("an SSP job with every_steps takes one cut per boundary", "[cluster][checkpoint]") {
  InProcessCluster cluster(1, 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(400);  // 45 steps each
  spec.mutable_consistency()->set_model(v1::ConsistencySpec::SSP);
  spec.mutable_consistency()->set_staleness(2);
  // Several seconds of steps apart: the coordinator's ticks (heartbeats and
  // progress reports, every 0.1-0.2 s) come often enough to overshoot.
  constexpr uint32_t kEvery = 4000;
  spec.mutable_checkpoint()->set_every_steps(kEvery);
  spec.mutable_checkpoint()->set_keep(10);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  // Its epochs (45 steps) are far shorter than the workers' progress
  // interval: the live status still carries a rate and a loss (which the
  // coordinator also uses to aim cuts).
  v1::Job live;
  for (int tries = 0; tries < 400; ++tries) {
    live = Get(cluster.jobs(), id);
    if (live.status().step() > 1000 || live.status().state() == v1::SUCCEEDED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  REQUIRE(live.status().state() == v1::RUNNING);
  CHECK(live.status().samples_per_second() > 0);
  CHECK(live.status().loss() > 0);
  int events = 0;
  const v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
  INFO(j.status().message() << " " << j.status().last_checkpoint_error());
  REQUIRE(j.status().state() == v1::SUCCEEDED);
  const uint64_t total = j.status().total_steps();
  const uint64_t taken = j.status().next_cut_id() - 1;
  INFO("total steps " << total << ", cuts taken " << taken);
  REQUIRE(total >= 3 * kEvery);
  // The first cut, one per boundary crossed, the final one.
  CHECK(taken <= total / kEvery + 2);
  int steps_cuts = 0;
  uint64_t last = 0;
  for (const auto& c : j.status().checkpoints()) {
    CHECK(c.step() >= last);
    last = c.step();
    if (c.trigger() == "steps") ++steps_cuts;
  }
  CHECK(steps_cuts >= 1);
  CHECK(j.status().checkpoints().rbegin()->trigger() == "final");
}

// A rollback moves a rank to a new incarnation; with one worker, the new one
// starts in the same process while the old one is still stopping (mid-step,
// or in a blocked pull). A CI run once lost a worker to a heap corruption in
// that window: the overlap is run here many times, in every build (ASan's
// included), with an MLP big enough for OpenBLAS's threaded GEMMs.
TEST_CASE("repeated rollbacks onto the same worker overlap old and new incarnations without harm",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->add_hidden(256);
  spec.set_batch_size(64);
  spec.set_epochs(100000);
  spec.mutable_checkpoint()->set_every_steps(20);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  constexpr uint32_t kRollbacks = 12;
  // Rank 0 training as incarnation `n`.
  auto training_as = [](uint32_t n) {
    return [n](const v1::Job& j) {
      return j.status().workers_size() == 1 && j.status().workers(0).state() == "training" &&
             j.status().workers(0).incarnation() == n;
    };
  };
  for (uint32_t n = 0; n < kRollbacks; ++n) {
    v1::Job j = WaitForJob(
        cluster.jobs(), id,
        [&](const v1::Job& j) {
          return j.status().checkpoints_size() > 0 && j.status().restoring_cut() == 0 && training_as(n)(j);
        },
        absl::Seconds(12));
    INFO("rollback " << n << ": " << j.status().message());
    REQUIRE(j.status().state() == v1::RUNNING);
    REQUIRE(j.status().workers_size() == 1);
    REQUIRE(j.status().workers(0).incarnation() == n);
    // Some steps into the incarnation, so its trainer is busy when told to stop.
    std::this_thread::sleep_for(std::chrono::milliseconds((n * 37) % 200));
    FailRank0(cluster.address(), j, "ServerLost", "pull from a server: job is not on this server (injected)");
  }
  const v1::Job j = WaitForJob(cluster.jobs(), id, training_as(kRollbacks), absl::Seconds(12));
  INFO(j.status().message());
  CHECK(j.status().state() == v1::RUNNING);
  CHECK(j.status().rollbacks() == kRollbacks);
  REQUIRE(j.status().workers_size() == 1);
  CHECK(j.status().workers(0).state() == "training");
  Cancel(cluster.jobs(), id);
}

// A rank (or server) lost before the job's first cut is committed: nothing
// to roll back to, so the job starts again from step 0 on servers that drop
// what it trained, rather than failing. BSP: it ends with the weights of an
// undisturbed run.
TEST_CASE("a job that loses a rank before any checkpoint is committed starts again from step 0 and ends as an "
          "undisturbed run does",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(300);
  std::string undisturbed_id;
  REQUIRE(Submit(cluster.jobs(), spec, &undisturbed_id).ok());
  int events = 0;
  const v1::Job undisturbed = WatchToEnd(cluster.jobs(), undisturbed_id, &events);
  INFO(undisturbed.status().message());
  REQUIRE(undisturbed.status().state() == v1::SUCCEEDED);
  REQUIRE(!undisturbed.status().weights_fingerprint().empty());

  // No cut commits while the coordinator does not hear back from the servers.
  Faults& faults = cluster.faults();
  faults.hold_cuts = true;
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  v1::Job j = WaitForJob(
      cluster.jobs(), id,
      [](const v1::Job& j) {
        return j.status().workers_size() == 2 && j.status().workers(0).state() == "training" &&
               j.status().step() >= 20;
      },
      absl::Seconds(30));
  REQUIRE(j.status().state() == v1::RUNNING);
  REQUIRE(j.status().checkpoints_size() == 0);
  const uint64_t failed_at = j.status().step();
  CHECK(FailRank0(cluster.address(), j, "WorkerError", "a crash (injected)").stop());
  j = Get(cluster.jobs(), id);
  INFO(j.status().message());
  CHECK(j.status().state() == v1::RUNNING);
  CHECK(j.status().rollbacks() == 1);
  CHECK(j.status().restarts() == 1);  // a rank's own error counts against backoff_limit
  bool restarting = false;  // the condition stays when the restart is already done
  for (const v1::JobCondition& c : j.status().conditions()) {
    restarting = restarting || (c.type() == "Restarting" && c.reason() == "WorkerError" &&
                                c.message().find("starting again from step 0 (no checkpoint committed yet)") !=
                                    std::string::npos);
  }
  CHECK(restarting);
  faults.hold_cuts = false;
  // Back at the start: every rank trains again as incarnation 1 from step 0.
  j = WaitForJob(
      cluster.jobs(), id,
      [](const v1::Job& j) {
        return !j.status().restarting() && j.status().workers_size() == 2 &&
               j.status().workers(0).incarnation() == 1 && j.status().workers(1).incarnation() == 1;
      },
      absl::Seconds(30));
  CHECK(!j.status().restarting());
  CHECK(j.status().restoring_cut() == 0);
  const v1::Job done = WatchToEnd(cluster.jobs(), id, &events);
  INFO(done.status().message() << " " << done.status().last_checkpoint_error());
  REQUIRE(done.status().state() == v1::SUCCEEDED);
  bool restarted = false;
  for (const v1::JobCondition& c : done.status().conditions()) {
    if (c.reason() == "JobRestarted") {
      restarted = true;
      CHECK(c.message().find("started again from step 0 on 2 servers") != std::string::npos);
    }
  }
  CHECK(restarted);
  CHECK(done.status().rollbacks() == 1);
  CHECK(done.status().step() > failed_at);
  // Bit-identical to the undisturbed run: nothing of the first attempt's
  // steps survived on the servers.
  CHECK(done.status().weights_fingerprint() == undisturbed.status().weights_fingerprint());
  CHECK(std::abs(done.status().test_accuracy() - undisturbed.status().test_accuracy()) < 1e-9);
}

// A cut whose servers answered before a rollback began, but which the
// coordinator hears back from only after the job runs again from an older
// cut, holds parameters from the history the rollback discarded (or, had a
// server been asked after the restore, a mix of both histories): it must not
// be committed, or a later rollback would restore it.
TEST_CASE("a cut still in flight when its job rolls back is never committed", "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.set_epochs(100000);
  spec.mutable_checkpoint()->set_every_steps(20);
  spec.mutable_checkpoint()->set_keep(10);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  auto until = [&](const std::function<bool(const v1::Job&)>& done) {
    return WaitForJob(cluster.jobs(), id, done, absl::Seconds(10));
  };
  v1::Job j = until([](const v1::Job& j) {
    return j.status().checkpoints_size() > 0 && j.status().workers_size() == 1 &&
           j.status().workers(0).state() == "training";
  });
  REQUIRE(j.status().checkpoints_size() > 0);
  const uint64_t committed = j.status().checkpoints().rbegin()->cut_id();
  Faults& faults = cluster.faults();
  faults.hold_cuts = true;
  for (int tries = 0; tries < 1000 && faults.cuts_held.load() < 2; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(faults.cuts_held.load() == 2);  // both servers wrote their part of the next cut
  j = Get(cluster.jobs(), id);
  const uint64_t in_flight = j.status().next_cut_id() - 1;
  REQUIRE(in_flight > committed);
  REQUIRE(j.status().checkpoints().rbegin()->cut_id() == committed);
  // Rank 0's server "lost": the job rolls back to `committed` and runs on.
  FailRank0(cluster.address(), j, "ServerLost", "pull from a server: job is not on this server (injected)");
  j = until([](const v1::Job& j) {
    return j.status().rollbacks() == 1 && j.status().restoring_cut() == 0 && j.status().workers_size() == 1 &&
           j.status().workers(0).state() == "training";
  });
  INFO(j.status().message());
  REQUIRE(j.status().rollbacks() == 1);
  REQUIRE(j.status().restoring_cut() == 0);
  REQUIRE(j.status().state() == v1::RUNNING);
  faults.hold_cuts = false;  // the coordinator now hears both servers' OK
  // Until the cut's fate is known: an error, or the next cut under way.
  j = until([&](const v1::Job& j) {
    return !j.status().last_checkpoint_error().empty() || j.status().next_cut_id() - 1 > in_flight;
  });
  INFO(j.status().last_checkpoint_error());
  CHECK(j.status().last_checkpoint_error() ==
        absl::StrCat("checkpoint ", in_flight, ": the job rolled back while the cut was taken"));
  for (const auto& c : j.status().checkpoints()) CHECK(c.cut_id() != in_flight);
  Cancel(cluster.jobs(), id);
}

}  // namespace
}  // namespace fulcrum
