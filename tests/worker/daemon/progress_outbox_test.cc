// ProgressOutbox: results delivered in order through a coordinator that is
// away, periodic progress coalesced, a stop answer ending the assignment.
#include "worker/daemon/progress_outbox.h"

#include <deque>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace fulcrum {
namespace {

// Answers each report with the next scripted status (OK once they run out)
// and records what it took.
class ScriptedCoordinator final : public CoordinatorClient {
 public:
  void Script(std::vector<absl::Status> answers) {
    absl::MutexLock lock(&mu_);
    answers_.assign(answers.begin(), answers.end());
  }
  void StopOn(uint32_t epoch) {
    absl::MutexLock lock(&mu_);
    stop_on_epoch_ = epoch;
  }
  // Holds every send until Release (a coordinator that does not answer yet).
  void Hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  absl::StatusOr<v1::ReportProgressResponse> ReportProgress(const v1::ReportProgressRequest& request,
                                                            absl::Duration) override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](bool* held) { return !*held; }, &held_));
    ++calls_;
    absl::Status s = absl::OkStatus();
    if (!answers_.empty()) {
      s = answers_.front();
      answers_.pop_front();
    }
    if (!s.ok()) return s;
    taken_.push_back(request);
    v1::ReportProgressResponse resp;
    if (request.has_epoch_done() && request.epoch_done().epoch() == stop_on_epoch_) resp.set_stop(true);
    return resp;
  }
  std::vector<v1::ReportProgressRequest> taken() const {
    absl::MutexLock lock(&mu_);
    return taken_;
  }
  int calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  mutable absl::Mutex mu_;
  std::deque<absl::Status> answers_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ReportProgressRequest> taken_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t stop_on_epoch_ ABSL_GUARDED_BY(mu_) = 0;
};

v1::ReportProgressRequest EpochDone(uint32_t epoch) {
  v1::ReportProgressRequest r;
  r.set_job_id("j");
  r.mutable_epoch_done()->set_epoch(epoch);
  return r;
}

v1::ReportProgressRequest Periodic(uint64_t step) {
  v1::ReportProgressRequest r;
  r.set_job_id("j");
  r.mutable_progress()->set_step(step);
  return r;
}

ProgressOutboxOptions Fast() {
  return {.send_timeout = absl::Seconds(1), .initial_backoff = absl::Milliseconds(1),
          .max_backoff = absl::Milliseconds(5)};
}

TEST_CASE("results reach a coordinator that is away in order and Drain waits for them", "[outbox]") {
  ScriptedCoordinator coordinator;
  coordinator.Script({absl::UnavailableError("restarting"), absl::DeadlineExceededError("slow"),
                      absl::UnavailableError("restarting")});
  ProgressOutbox outbox(&coordinator, "j", nullptr, Fast());
  for (uint32_t e = 1; e <= 3; ++e) outbox.Post(EpochDone(e));
  outbox.Drain();
  const auto taken = coordinator.taken();
  REQUIRE(taken.size() == 3);
  for (uint32_t e = 1; e <= 3; ++e) CHECK(taken[e - 1].epoch_done().epoch() == e);
  CHECK(coordinator.calls() == 6);  // three refusals, then each once
  CHECK_FALSE(outbox.stopped());
}

TEST_CASE("a result refused for good is dropped and the rest still go", "[outbox]") {
  ScriptedCoordinator coordinator;
  coordinator.Script({absl::FailedPreconditionError("stale incarnation")});
  ProgressOutbox outbox(&coordinator, "j", nullptr, Fast());
  outbox.Post(EpochDone(1));
  outbox.Post(EpochDone(2));
  outbox.Drain();
  const auto taken = coordinator.taken();
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].epoch_done().epoch() == 2);
}

TEST_CASE("only the latest periodic report waits and a result replaces it", "[outbox]") {
  ScriptedCoordinator coordinator;
  coordinator.Hold();
  ProgressOutbox outbox(&coordinator, "j", nullptr, Fast());
  outbox.Post(Periodic(1));  // taken by the sender, held in the send
  while (outbox.idle()) absl::SleepFor(absl::Milliseconds(1));
  outbox.Post(Periodic(2));
  outbox.Post(Periodic(3));  // replaces 2
  outbox.Post(EpochDone(1));  // replaces 3: it carries the progress of its moment
  outbox.Post(Periodic(4));   // waits behind the result
  coordinator.Release();
  outbox.Drain();
  while (!outbox.idle() || coordinator.taken().size() < 3) absl::SleepFor(absl::Milliseconds(1));
  const auto taken = coordinator.taken();
  REQUIRE(taken.size() == 3);
  CHECK(taken[0].progress().step() == 1);
  CHECK(taken[1].epoch_done().epoch() == 1);
  CHECK(taken[2].progress().step() == 4);
}

TEST_CASE("a failed periodic report is not sent again", "[outbox]") {
  ScriptedCoordinator coordinator;
  coordinator.Script({absl::UnavailableError("away")});
  ProgressOutbox outbox(&coordinator, "j", nullptr, Fast());
  outbox.Post(Periodic(1));
  while (coordinator.calls() < 1) absl::SleepFor(absl::Milliseconds(1));
  outbox.Post(EpochDone(1));
  outbox.Drain();
  const auto taken = coordinator.taken();
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].has_epoch_done());
  CHECK(coordinator.calls() == 2);
}

TEST_CASE("a stop in the answer stops the outbox and tells its owner", "[outbox]") {
  ScriptedCoordinator coordinator;
  coordinator.StopOn(1);
  std::atomic<bool> told{false};
  ProgressOutbox outbox(&coordinator, "j", [&] { told.store(true); }, Fast());
  coordinator.Hold();
  outbox.Post(EpochDone(1));
  outbox.Post(EpochDone(2));
  coordinator.Release();
  outbox.Drain();  // returns at the stop, with epoch 2 never sent
  CHECK(outbox.stopped());
  CHECK(told.load());
  while (!outbox.idle()) absl::SleepFor(absl::Milliseconds(1));
  REQUIRE(coordinator.taken().size() == 1);
  CHECK(coordinator.taken()[0].epoch_done().epoch() == 1);
}

TEST_CASE("Stop ends a Drain that waits on a coordinator that never answers", "[outbox]") {
  ScriptedCoordinator coordinator;
  std::vector<absl::Status> away(1000, absl::UnavailableError("away"));
  coordinator.Script(away);
  ProgressOutbox outbox(&coordinator, "j", nullptr, Fast());
  outbox.Post(EpochDone(1));
  std::thread stopper([&] {
    while (coordinator.calls() < 3) absl::SleepFor(absl::Milliseconds(1));
    outbox.Stop();
  });
  outbox.Drain();
  stopper.join();
  CHECK(outbox.stopped());
  CHECK(coordinator.taken().empty());
}

}  // namespace
}  // namespace fulcrum
