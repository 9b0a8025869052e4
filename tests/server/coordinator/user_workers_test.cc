// Jobs whose workers are user processes (JobSpec.user_workers, Python's
// fulcrum.Worker): who may register for one, that ranks go only to the
// processes registered for the job, that such a job neither waits for nor
// holds back the daemons' jobs, and that a lost process's rank waits for
// another of the job's processes. On a fake clock, with the scheduler run
// tick by tick; servers accept every call.
#include <filesystem>
#include <memory>
#include <string>

#include <catch2/catch.hpp>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/config/job_spec.h"
#include "server/coordinator/coordinator.h"
#include "tests/testing/clocked_cluster.h"
#include "tests/testing/fake_clock.h"

namespace fulcrum {
namespace {

using testing::ClockedCluster;

TEST_CASE("a user_workers spec needs no model or data and refuses them", "[coordinator]") {
  v1::JobSpec spec;
  spec.set_name("u");
  spec.set_num_workers(2);
  spec.set_user_workers(true);
  spec.mutable_optimizer()->set_kind(v1::OptimizerSpec::ADAM);
  spec.mutable_optimizer()->set_learning_rate(0.001f);
  CHECK(config::ValidateJobSpec(spec).ok());
  spec.mutable_model()->set_type("mlp");
  spec.mutable_data()->mutable_train()->set_format("idx");
  spec.set_precision(v1::DTYPE_BF16);
  const std::string msg(config::ValidateJobSpec(spec).message());
  CHECK_THAT(msg, Catch::Contains("model: user_workers jobs train the user processes' own model") &&
                      Catch::Contains("data: user_workers jobs read") && Catch::Contains("precision:"));
}

TEST_CASE("only a one-slot worker may register for a user_workers job that has not ended", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  const std::string daemons_job = c.Submit(false, 1, "d");
  const std::string user_job = c.Submit(true, 1, "u");
  CHECK(c.Register("nope-99").status().code() == absl::StatusCode::kNotFound);
  auto daemon = c.Register(daemons_job);
  CHECK(daemon.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(daemon.status().message()), Catch::Contains("fulcrum-worker daemons"));
  CHECK(c.Register(user_job, 2).status().code() == absl::StatusCode::kInvalidArgument);
  v1::NodeInfo server;
  server.set_role(v1::SERVER);
  server.set_address("127.0.0.1:2");
  server.set_job_id(user_job);
  CHECK(c->RegisterNode(server).status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(c->CancelJob(user_job).ok());
  auto late = c.Register(user_job);
  CHECK(late.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(late.status().message()), Catch::Contains("has ended (CANCELLED)"));
}

TEST_CASE("a user_workers job takes only its own processes and holds back no daemon job", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  auto daemon = c.Register("", 4);
  REQUIRE(daemon.ok());
  const std::string user_job = c.Submit(true, 2, "u");
  const std::string daemons_job = c.Submit(false, 1, "d");  // submitted after it
  REQUIRE(c.RunUntil(daemons_job, v1::RUNNING));
  c.Run(absl::Seconds(1));
  auto job = c->GetJob(user_job);
  CHECK(job->status().state() == v1::PENDING);
  CHECK_THAT(job->status().message(), Catch::Contains("needs 2 user processes registered for this job") &&
                                          Catch::Contains("0 so far"));
  CHECK(c.Assignments(*daemon) == std::vector<std::string>{daemons_job + "/0/0"});

  auto first = c.Register(user_job);
  REQUIRE(first.ok());
  c.Run(absl::Seconds(1));
  CHECK_THAT(c->GetJob(user_job)->status().message(), Catch::Contains("1 so far"));
  auto second = c.Register(user_job);
  REQUIRE(second.ok());
  REQUIRE(c.RunUntil(user_job, v1::RUNNING));
  const auto a = c.Assignments(*first), b = c.Assignments(*second);
  REQUIRE(a.size() == 1);
  REQUIRE(b.size() == 1);
  CHECK(std::set<std::string>{a[0], b[0]} == std::set<std::string>{user_job + "/0/0", user_job + "/1/0"});
  CHECK(c.Assignments(*daemon) == std::vector<std::string>{daemons_job + "/0/0"});  // and nothing of the user job
}

TEST_CASE("a lost user process's rank waits for another process of its job, not for a daemon", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  auto daemon = c.Register("", 4);
  REQUIRE(daemon.ok());
  const std::string user_job = c.Submit(true, 2, "u");
  auto p0 = c.Register(user_job);
  auto p1 = c.Register(user_job);
  REQUIRE((p0.ok() && p1.ok()));
  REQUIRE(c.RunUntil(user_job, v1::RUNNING));
  const std::string lost = c.Assignments(*p0)[0] == user_job + "/0/0" ? *p0 : *p1;

  c.Run(absl::Seconds(6), /*silent=*/lost);  // past node_timeout without a heartbeat
  auto job = c->GetJob(user_job);
  REQUIRE(job->status().state() == v1::RUNNING);
  CHECK_THAT(job->status().message(), Catch::Contains("rank 0 waits for a user process to register for this job"));
  CHECK(c.Assignments(*daemon).empty());

  auto replacement = c.Register(user_job);
  REQUIRE(replacement.ok());
  c.Run(absl::Milliseconds(200), lost);
  CHECK(c.Assignments(*replacement) == std::vector<std::string>{user_job + "/0/1"});
  job = c->GetJob(user_job);
  CHECK(job->status().workers(0).worker_id() == *replacement);
  CHECK(job->status().reason() == "WorkerReplaced");
}

TEST_CASE("a process that leaves is forgotten at once, and its unfinished rank moves on", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  const std::string user_job = c.Submit(true, 2, "u");
  auto p0 = c.Register(user_job);
  auto p1 = c.Register(user_job);
  REQUIRE((p0.ok() && p1.ok()));
  REQUIRE(c.RunUntil(user_job, v1::RUNNING));
  auto listed = [&](const std::string& id) {
    const v1::ClusterState cs = c->GetCluster();
    for (const auto& n : cs.nodes()) {
      if (n.info().node_id() == id) return true;
    }
    return false;
  };
  // Rank of p0 finishes, then p0 leaves: gone within two ticks, the job
  // untouched.
  const uint32_t rank0 = c->GetJob(user_job)->status().workers(0).worker_id() == *p0 ? 0 : 1;
  v1::ReportProgressRequest done;
  done.set_node_id(*p0);
  done.set_job_id(user_job);
  done.set_rank(rank0);
  done.set_finished(true);
  done.mutable_progress()->set_state("finished");
  REQUIRE(c->ReportProgress(done).ok());
  v1::HeartbeatRequest leave;
  leave.set_node_id(*p0);
  leave.set_leaving(true);
  REQUIRE(c->Heartbeat(leave).ok());
  c.Run(absl::Milliseconds(200), *p0);
  CHECK_FALSE(listed(*p0));
  auto job = c->GetJob(user_job);
  CHECK(job->status().workers(static_cast<int>(rank0)).state() == "finished");
  CHECK(job->status().reason() != "WorkerLost");

  // p1 leaves before its rank finished: the rank is lost at once, not after
  // node_timeout.
  leave.set_node_id(*p1);
  REQUIRE(c->Heartbeat(leave).ok());
  c.Run(absl::Milliseconds(200), *p1);
  job = c->GetJob(user_job);
  CHECK_FALSE(listed(*p1));
  CHECK(job->status().workers(static_cast<int>(1 - rank0)).state() == "lost");
  CHECK(job->status().reason() == "WorkerLost");
  CHECK_THAT(job->status().conditions(job->status().conditions_size() - 1).message(),
             Catch::Contains("left before the rank finished"));
}

TEST_CASE("a process of a job that ended is told so at its heartbeat and forgotten", "[coordinator]") {
  testing::FakeClock clock;
  ClockedCluster c(&clock);
  const std::string user_job = c.Submit(true, 2, "u");
  auto waiting = c.Register(user_job);  // the job still needs another process
  REQUIRE(waiting.ok());
  REQUIRE(c->CancelJob(user_job).ok());
  v1::HeartbeatRequest hb;
  hb.set_node_id(*waiting);
  auto r = c->Heartbeat(hb);
  REQUIRE(r.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(r.status().message()), Catch::Contains("has ended (CANCELLED)"));
  c.Run(absl::Milliseconds(200), *waiting);
  const v1::ClusterState cs = c->GetCluster();
  for (const auto& n : cs.nodes()) CHECK(n.info().node_id() != *waiting);
}

}  // namespace
}  // namespace fulcrum
