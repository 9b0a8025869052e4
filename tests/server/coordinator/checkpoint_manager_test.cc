// The coordinator's checkpoint work on its own, against fake servers and a
// fake clock: a cut's record from the servers' parts, retention, what a
// failed or late cut teaches the schedule, CheckpointJob answers, restores,
// stray parts deleted, exports page by page.
#include "server/coordinator/checkpoint_manager.h"

#include <catch2/catch.hpp>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "tests/testing/fake_clock.h"

namespace fulcrum {
namespace {

using testing::FakeClock;

// Servers that answer from tables set by the test and record what they
// were asked (from the manager's threads, so under a lock).
class FakeServers final : public ServerControl {
 public:
  absl::Status InstallShardMap(const std::string&, const v1::ShardMap&) override { return absl::OkStatus(); }
  absl::Status DeleteJob(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string& address, const std::string& job_id, uint64_t cut_id,
                                              uint64_t at_step, absl::Duration) override {
    absl::MutexLock lock(&mu_);
    asked.push_back(absl::StrCat("cut ", job_id, " ", cut_id, " at ", at_step, " on ", address));
    auto failure = fail.find(address);
    if (failure != fail.end()) return failure->second;
    return parts.at(address);
  }
  absl::StatusOr<v1::ShardCutMeta> Restore(const std::string& address, const std::string& job_id, uint64_t cut_id,
                                           const std::vector<std::string>& sources, uint32_t min_incarnation) override {
    absl::MutexLock lock(&mu_);
    asked.push_back(absl::StrCat("restore ", job_id, " ", cut_id, " on ", address, " from ", sources.size(),
                                 " incarnation ", min_incarnation));
    auto failure = fail.find(address);
    if (failure != fail.end()) return failure->second;
    return v1::ShardCutMeta();
  }
  absl::Status DeleteCut(const std::string& address, const std::string& job_id, uint64_t cut_id) override {
    absl::MutexLock lock(&mu_);
    deleted.insert(absl::StrCat(address, "/", job_id, "/", cut_id));
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string& address, const std::string&) override {
    absl::MutexLock lock(&mu_);
    std::vector<v1::ShardCutMeta> out;
    for (uint64_t id : held[address]) {
      out.emplace_back();
      out.back().set_cut_id(id);
    }
    return out;
  }
  // Pages of two records per server: "<server>:<n>" for n < 3.
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const std::string& address,
                                                     const v1::ReadCheckpointRequest& req) override {
    absl::MutexLock lock(&mu_);
    auto failure = fail.find(address);
    if (failure != fail.end()) return failure->second;
    v1::ReadCheckpointResponse page;
    page.mutable_meta()->set_cut_id(req.cut_id());
    page.mutable_meta()->set_server_index(address == "s0" ? 0 : 1);
    int n = req.start_after().empty() ? 0 : std::stoi(req.start_after().substr(req.start_after().find(':') + 1)) + 1;
    for (int end = n + 2; n < end && n < 3; ++n) page.add_records()->set_key(absl::StrCat(address, ":", n));
    if (n < 3) page.set_next_start_after(absl::StrCat(address, ":", n - 1));
    return page;
  }

  absl::Mutex mu_;
  std::map<std::string, v1::ShardCutMeta> parts;
  std::map<std::string, absl::Status> fail;
  std::map<std::string, std::vector<uint64_t>> held;
  std::vector<std::string> asked;
  std::set<std::string> deleted;
};

v1::ShardCutMeta Part(uint64_t step, std::vector<uint64_t> clocks, uint64_t bytes, double pause) {
  v1::ShardCutMeta m;
  m.set_step(step);
  for (uint64_t c : clocks) m.add_rank_clock(c);
  m.set_bytes(bytes);
  m.set_capture_seconds(pause);
  return m;
}

CutTask Task(uint64_t cut_id, const std::string& trigger = "steps") {
  CutTask t;
  t.job_id = "j-1";
  t.cut_id = cut_id;
  t.at_step = 40;
  t.trigger = trigger;
  t.servers = {"s0", "s1"};
  t.map_version = 7;
  t.steps_per_epoch = 25;
  return t;
}

TEST_CASE("a cut's record takes the lowest step and clock per rank over the servers") {
  FakeClock clock;
  FakeServers servers;
  CheckpointManager m(&servers, &clock, absl::Seconds(1));
  servers.parts["s0"] = Part(40, {41, 40}, 1000, 0.5);
  servers.parts["s1"] = Part(40, {40, 43}, 500, 0.25);
  const CutTask t = Task(3);
  auto metas = m.TakeCut(t);
  REQUIRE(metas.ok());
  REQUIRE(servers.asked.size() == 2);
  const v1::CheckpointInfo info = m.Committed(t, *metas);
  CHECK(info.cut_id() == 3);
  CHECK(info.step() == 40);
  CHECK(info.bytes() == 1500);
  CHECK(info.pause_seconds() == 0.5);
  CHECK(info.shard_map_version() == 7);
  CHECK(info.created_unix_ms() == absl::ToUnixMillis(clock.Now()));
  REQUIRE(info.positions_size() == 2);
  CHECK(info.positions(0).step() == 40);  // min(41, 40)
  CHECK(info.positions(1).step() == 40);  // min(40, 43)
  CHECK(info.positions(1).epoch() == 1);
  CHECK(info.positions(1).batch() == 15);

  SECTION("under local steps the servers' clocks count rounds") {
    CutTask local = t;
    local.spec.mutable_consistency()->set_model(v1::ConsistencySpec::LOCAL);
    local.spec.mutable_consistency()->set_sync_every_steps(10);
    // 25 steps an epoch are 3 rounds (10, 10, 5): 4 rounds are 1 epoch + 10 steps.
    const v1::CheckpointInfo rounds = m.Committed(local, {Part(4, {4}, 1, 0)});
    CHECK(rounds.step() == 35);
    CHECK(rounds.positions(0).epoch() == 1);
    CHECK(rounds.positions(0).batch() == 10);
  }
}

TEST_CASE("a cut fails with the first failing server named") {
  FakeClock clock;
  FakeServers servers;
  CheckpointManager m(&servers, &clock, absl::Seconds(1));
  servers.parts["s0"] = Part(40, {40}, 1, 0);
  servers.fail["s1"] = absl::UnavailableError("disk full");
  auto metas = m.TakeCut(Task(1));
  REQUIRE(!metas.ok());
  CHECK(metas.status().code() == absl::StatusCode::kUnavailable);
  CHECK(metas.status().message() == "server s1: disk full");
}

TEST_CASE("retention keeps the newest cuts and hands back the others' servers") {
  v1::JobStatus st;
  CutList to_delete;
  for (uint64_t id = 1; id <= 4; ++id) {
    v1::CheckpointInfo info;
    info.set_cut_id(id);
    info.add_servers("s0");
    info.add_servers(absl::StrCat("s", id));
    const std::set<uint64_t> kept = CheckpointManager::Record(info, 2, &st, &to_delete);
    CHECK(kept.count(id) == 1);
  }
  REQUIRE(st.checkpoints_size() == 2);
  CHECK(st.checkpoints(0).cut_id() == 3);
  CHECK(st.checkpoints(1).cut_id() == 4);
  REQUIRE(to_delete.size() == 2);
  CHECK(to_delete[0].first == 1);
  CHECK(to_delete[1].second == std::vector<std::string>{"s0", "s2"});
  CHECK(FindCut(st, 0)->cut_id() == 4);
  CHECK(FindCut(st, 3)->cut_id() == 3);
  CHECK(FindCut(st, 1) == nullptr);
  CHECK(NoCutError("j-1", st, 1).message() == "job 'j-1' has no committed checkpoint 1 (its checkpoints: 3, 4)");
  SECTION("keep 0 is the default of 3") {
    v1::JobStatus fresh;
    CutList gone;
    for (uint64_t id = 1; id <= 5; ++id) {
      v1::CheckpointInfo info;
      info.set_cut_id(id);
      CheckpointManager::Record(info, 0, &fresh, &gone);
    }
    CHECK(fresh.checkpoints_size() == 3);
    CHECK(gone.size() == 2);
  }
}

TEST_CASE("what a cut's outcome teaches the schedule") {
  FakeClock clock;
  FakeServers servers;
  CheckpointManager m(&servers, &clock, absl::Seconds(1));
  const CutTask first = Task(1, "first");
  m.CutStarted("j-1");
  CHECK(m.Busy("j-1"));
  CHECK(m.CutInFlight("j-1"));
  CHECK(!m.Busy("j-2"));

  // A failed first cut: a backoff of 5 s, and no second "first".
  m.CutEnded(first, CheckpointManager::Outcome::kFailed, absl::UnavailableError("down"), 0);
  CHECK(!m.Busy("j-1"));
  cut_schedule::JobView view;
  m.FillView("j-1", &view);
  CHECK(view.first_cut_failed);
  CHECK(view.backoff_until == clock.Now() + absl::Seconds(5));

  // Too late: the lead grows from 16 and doubles.
  CHECK(m.CutEnded(Task(2), CheckpointManager::Outcome::kTooLate, absl::FailedPreconditionError("too late"), 0) == 16);
  CHECK(m.CutEnded(Task(3), CheckpointManager::Outcome::kTooLate, absl::FailedPreconditionError("too late"), 0) == 32);

  // A commit is the last cut's time.
  clock.Advance(absl::Seconds(30));
  m.CutEnded(Task(4), CheckpointManager::Outcome::kCommitted, v1::CheckpointInfo(), 0);
  m.FillView("j-1", &view);
  CHECK(view.last_cut == clock.Now());
  CHECK(view.extra_lead == 32);
  CHECK(!view.manual_pending);

  m.SetBoundaryAsked("j-1", 200);
  m.FillView("j-1", &view);
  CHECK(view.steps_boundary_asked == 200);
}

TEST_CASE("CheckpointJob calls are answered by the cut that covers their ticket") {
  FakeClock clock;
  FakeServers servers;
  CheckpointManager m(&servers, &clock, absl::Seconds(1));
  const uint64_t a = m.RequestManual("j-1");
  const uint64_t b = m.RequestManual("j-1");
  CHECK(b == a + 1);
  cut_schedule::JobView view;
  m.FillView("j-1", &view);
  CHECK(view.manual_pending);
  CHECK(!m.ManualAnswer("j-1", a).has_value());

  CutTask manual = Task(5, "manual");
  manual.manual_ticket = a;
  // A cut that came too late answers nobody.
  m.CutEnded(manual, CheckpointManager::Outcome::kTooLate, absl::FailedPreconditionError("too late"), a);
  CHECK(!m.ManualAnswer("j-1", a).has_value());
  v1::CheckpointInfo info;
  info.set_cut_id(5);
  m.CutEnded(manual, CheckpointManager::Outcome::kCommitted, info, a);
  auto answer = m.ManualAnswer("j-1", a);
  REQUIRE(answer.has_value());
  REQUIRE(answer->ok());
  CHECK((*answer)->cut_id() == 5);
  CHECK(!m.ManualAnswer("j-1", b).has_value());  // asked after that cut began

  // The final cut answers every call still waiting, here with its failure.
  m.CutEnded(Task(6, "final"), CheckpointManager::Outcome::kFailed, absl::AbortedError("the job rolled back"), b);
  answer = m.ManualAnswer("j-1", b);
  REQUIRE(answer.has_value());
  CHECK(answer->status().code() == absl::StatusCode::kAborted);
  m.FillView("j-1", &view);
  CHECK(!view.manual_pending);

  m.Forget("j-1");
  CHECK(!m.ManualAnswer("j-1", a).has_value());
}

TEST_CASE("a restore asks every target, naming a failing one") {
  FakeClock clock;
  FakeServers servers;
  CheckpointManager m(&servers, &clock, absl::Seconds(1));
  RestoreTask t;
  t.job_id = "j-1";
  t.cut.set_cut_id(4);
  t.cut.add_servers("s0");
  t.targets = {"s0", "s1", "s2"};
  t.min_incarnation = 3;
  REQUIRE(m.Restore(t).ok());
  CHECK(servers.asked.size() == 3);
  CHECK(std::count(servers.asked.begin(), servers.asked.end(), "restore j-1 4 on s2 from 1 incarnation 3") == 1);
  servers.fail["s2"] = absl::NotFoundError("no cut 4");
  const absl::Status s = m.Restore(t);
  CHECK(s.code() == absl::StatusCode::kNotFound);
  CHECK(s.message() == "server s2: no cut 4");

  m.SetRestoreInFlight("j-1", true);
  CHECK(m.Busy("j-1"));
  CHECK(!m.CutInFlight("j-1"));
  m.Loaded("j-2", absl::FromUnixSeconds(5), clock.Now());
  CHECK(m.Of("j-2").last_cut == absl::FromUnixSeconds(5));
  CHECK(m.Of("j-2").restore_since == clock.Now());
}

TEST_CASE("stray parts below a committed cut go, kept and later ones stay") {
  FakeClock clock;
  FakeServers servers;
  CheckpointManager m(&servers, &clock, absl::Seconds(1));
  servers.held["s0"] = {2, 3, 5, 6, 7};
  servers.held["s1"] = {4};
  m.DeleteStrayCuts(Task(6), {5, 6});
  CHECK(servers.deleted == std::set<std::string>{"s0/j-1/2", "s0/j-1/3", "s1/j-1/4"});
  m.DeleteCuts("j-1", {{9, {"s0", "s1"}}});
  CHECK(servers.deleted.count("s1/j-1/9") == 1);
}

TEST_CASE("an export pages through every server, the info and meta first") {
  FakeClock clock;
  FakeServers servers;
  CheckpointManager m(&servers, &clock, absl::Seconds(1));
  v1::CheckpointInfo info;
  info.set_cut_id(8);
  info.add_servers("s0");
  info.add_servers("s1");
  std::vector<v1::ExportCheckpointChunk> chunks;
  REQUIRE(m.Export("j-1", info, [&](const v1::ExportCheckpointChunk& c) {
              chunks.push_back(c);
              return true;
            }).ok());
  REQUIRE(chunks.size() == 4);  // 2 pages per server
  CHECK(chunks[0].checkpoint().cut_id() == 8);
  CHECK(chunks[0].meta().cut_id() == 8);
  CHECK(!chunks[1].has_checkpoint());
  std::vector<std::string> keys;
  for (const auto& c : chunks) {
    for (const auto& r : c.records()) keys.push_back(r.key());
  }
  CHECK(keys == std::vector<std::string>{"s0:0", "s0:1", "s0:2", "s1:0", "s1:1", "s1:2"});

  SECTION("a reader that goes away stops it") {
    int calls = 0;
    const absl::Status s = m.Export("j-1", info, [&](const v1::ExportCheckpointChunk&) { return ++calls < 2; });
    CHECK(s.code() == absl::StatusCode::kCancelled);
    CHECK(calls == 2);
  }
  SECTION("a server that fails is named") {
    servers.fail["s1"] = absl::UnavailableError("gone");
    const absl::Status s = m.Export("j-1", info, [](const v1::ExportCheckpointChunk&) { return true; });
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message() == "reading checkpoint 8 from s1: gone");
  }
}

}  // namespace
}  // namespace fulcrum
