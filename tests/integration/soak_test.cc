// A randomized soak test of recovery: a local cluster started by
// deploy/local/cluster.sh (so every process runs under its supervisor, which
// restarts it) trains one job after another while the test kills a random
// server, worker or the coordinator with kill -9 every few seconds. Every
// job must succeed, every BSP job must end with the weights (fingerprint)
// of the same job run undisturbed first, and afterwards every checkpoint
// the coordinator committed must verify on disk: RocksDB opens, every
// shard's records are present across the servers, every checksum matches.
//
// Besides the random kills, the coordinator is killed where recovery has
// the most to keep apart: near the end of an epoch (its evaluation and
// report in flight) and 0.5-2.5 s after a worker's kill, while the
// replacement resumes.
//
// FULCRUM_SOAK_SECONDS (default 60) bounds the killing; FULCRUM_SOAK_EPOCHS
// (default 2) sets each job's length; FULCRUM_SOAK_SEED replays a run (the
// seed is printed).
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/config/spec_text.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/cluster.grpc.pb.h"
#include "server/checkpoint.h"
#include "tests/testing/process_util.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

int Run(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = testing::Spawn(args, log).pid;
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class Soak {
 public:
  // cluster.sh runs the cluster with mutual TLS and tokens: this client
  // verifies the coordinator against the run's CA and acts as its admin.
  Soak(const std::string& coordinator, const fs::path& tls_dir) {
    auto transport = security::Transport::Client((tls_dir / "ca.crt").string());
    REQUIRE(transport.ok());
    token_ = std::string(absl::StripAsciiWhitespace(testing::ReadFile((tls_dir / "token-admin").string())));
    REQUIRE(token_.size() == 64);
    stub_ = v1::JobService::NewStub(CreateFulcrumChannel(coordinator, 0, **transport));
  }

  // The job, asking again while the coordinator restarts; nullopt if it
  // stays unreachable for 90 s (the supervisor waits up to 30 s before it
  // restarts a process that keeps dying, and the kills may land on the
  // coordinator several times in a minute).
  std::optional<v1::Job> Get(const std::string& id) {
    v1::JobRef ref;
    ref.set_job_id(id);
    for (int tries = 0; tries < 450; ++tries) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("authorization", "Bearer " + token_);
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      v1::Job j;
      const grpc::Status s = stub_->GetJob(&ctx, ref, &j);
      if (s.ok()) return j;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return std::nullopt;
  }

  std::string Submit(const v1::JobSpec& spec) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    for (int tries = 0; tries < 150; ++tries) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("authorization", "Bearer " + token_);
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      v1::SubmitJobResponse resp;
      if (stub_->SubmitJob(&ctx, req, &resp).ok()) return resp.job_id();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    FAIL("cannot submit a job");
    return "";
  }

 private:
  std::string token_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

bool Ended(v1::JobState s) { return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED; }

std::string Describe(const v1::Job& j) {
  std::string out = absl::StrCat(j.id(), " ", v1::JobState_Name(j.status().state()), " (rollbacks ",
                                 j.status().rollbacks(), ", restarts ", j.status().restarts(), ")\n");
  for (const auto& c : j.status().conditions()) absl::StrAppend(&out, "  ", c.type(), "/", c.reason(), ": ", c.message(), "\n");
  return out;
}

TEST_CASE("soak: kill -9 of random servers, workers and the coordinator while jobs train - every job succeeds, BSP "
          "jobs bit-identical to an undisturbed run, every committed checkpoint verifies",
          "[e2e][soak]") {
  uint64_t seed = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  if (const char* s = std::getenv("FULCRUM_SOAK_SEED"); s != nullptr) REQUIRE(absl::SimpleAtoi(s, &seed));
  int seconds = 60;
  if (const char* s = std::getenv("FULCRUM_SOAK_SECONDS"); s != nullptr) REQUIRE(absl::SimpleAtoi(s, &seconds));
  int epochs = 2;
  if (const char* s = std::getenv("FULCRUM_SOAK_EPOCHS"); s != nullptr) REQUIRE(absl::SimpleAtoi(s, &epochs));
  REQUIRE((epochs >= 1 && epochs <= 50));
  WARN("soak seed " << seed << " (FULCRUM_SOAK_SEED replays it), " << seconds << " s of kills, " << epochs
                    << " epochs a job");
  std::mt19937 rng(static_cast<uint32_t>(seed));

  const fs::path dir = testing::MakeTempDir("fulcrum-soak");
  const int base = testing::FreePortBlock(4);  // cluster.sh: the coordinator, 2 servers, one spare
  const std::string script = std::string(FULCRUM_SOURCE_DIR) + "/deploy/local/cluster.sh";
  const std::string bin = FULCRUM_BUILD_DIR;
  REQUIRE(Run({script, "start", "--servers", "2", "--workers", "3", "--dir", (dir / "cluster").string(), "--port",
               absl::StrCat(base), "--metrics-port", "0", "--bin", bin, "--data", FULCRUM_TEST_DATA_DIR},
              (dir / "start.log").string()) == 0);
  // Stops the cluster however the test ends.
  struct Stop {
    std::vector<std::string> args;
    std::string log;
    bool done = false;
    ~Stop() {
      if (!done) Run(args, log);
    }
  } stop{{script, "stop", "--dir", (dir / "cluster").string()}, (dir / "stop.log").string()};

  Soak soak(absl::StrCat("127.0.0.1:", base), dir / "cluster" / "tls");
  v1::JobSpec spec;
  REQUIRE(config::ParseSpecFile(std::string(FULCRUM_SOURCE_DIR) + "/deploy/examples/mnist-mlp.yaml", &spec).ok());
  spec.set_epochs(static_cast<uint32_t>(epochs));
  spec.mutable_checkpoint()->set_every_steps(150);
  spec.mutable_checkpoint()->set_keep(3);
  spec.mutable_run_policy()->set_backoff_limit(1000);  // this test is the failures

  // The reference: the same BSP job, undisturbed. Under BSP a lost worker
  // changes no bits, and a rollback replays the same steps: every BSP job
  // trained under the kills must end with these weights.
  std::string reference_fingerprint;
  {
    const std::string id = soak.Submit(spec);
    std::optional<v1::Job> j;
    for (const absl::Time limit = absl::Now() + absl::Minutes(2 * epochs); absl::Now() < limit;) {
      j = soak.Get(id);
      REQUIRE(j.has_value());
      if (Ended(j->status().state())) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    INFO(Describe(*j));
    REQUIRE(j->status().state() == v1::SUCCEEDED);
    reference_fingerprint = j->status().weights_fingerprint();
    REQUIRE(reference_fingerprint.size() == 16);
  }

  const std::vector<std::string> victims = {"coordinator", "server-0", "server-1", "worker-0", "worker-1", "worker-2"};
  std::vector<std::string> jobs;
  std::string kills;
  int kill_count = 0;
  // A job with no checkpoint yet fails when it loses a server (there is
  // nothing to roll back to): a new job starts only once a killed server's
  // restart has been noticed (node timeout 5 s), so the kill belongs to the
  // job that had checkpoints.
  absl::Time last_server_kill = absl::InfinitePast();
  auto submit = [&] {
    const absl::Time settled = last_server_kill + absl::Seconds(8);
    if (absl::Now() < settled) absl::SleepFor(settled - absl::Now());
    v1::JobSpec s = spec;
    // Alternate BSP and ASP jobs.
    if (jobs.size() % 2 == 1) s.mutable_consistency()->set_model(v1::ConsistencySpec::ASP);
    jobs.push_back(soak.Submit(s));
  };
  submit();
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  absl::Time next_kill = absl::Now() + absl::Seconds(3);
  // The targeted coordinator kills: one pending after a worker's kill (the
  // replacement resuming), and one per job and epoch near its end.
  absl::Time coordinator_after_worker = absl::InfiniteFuture();
  std::set<std::pair<std::string, uint64_t>> epoch_ends_hit;
  int targeted = 0;
  auto kill_victim = [&](const std::string& victim, const v1::Job& j, const char* why) {
    const std::string pid_text = testing::ReadFile((dir / "cluster" / "run" / (victim + ".pid")).string());
    int pid = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(pid_text), &pid) || pid <= 0 || kill(pid, SIGKILL) != 0) {
      return false;
    }
    if (victim.rfind("server", 0) == 0) last_server_kill = absl::Now();
    ++kill_count;
    absl::StrAppend(&kills, absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::UTCTimeZone()), " ", victim, " (pid ",
                    pid, ") during ", jobs.back(), " at step ", j.status().step(), why, "\n");
    return true;
  };
  while (absl::Now() < end) {
    std::optional<v1::Job> j = soak.Get(jobs.back());
    INFO("kills:\n" << kills);
    REQUIRE(j.has_value());
    if (Ended(j->status().state())) {
      INFO(Describe(*j) << "kills:\n" << kills);
      REQUIRE(j->status().state() == v1::SUCCEEDED);
      submit();
      continue;
    }
    // Near an epoch's end (its last 3% of steps, at most 40): the
    // coordinator, once per job and epoch.
    const uint64_t total = j->status().total_steps();
    if (total > 0 && j->status().state() == v1::RUNNING) {
      const uint64_t spe = total / static_cast<uint64_t>(epochs);
      const uint64_t step = j->status().step();
      const uint64_t window = std::min<uint64_t>(40, spe / 33 + 1);
      const uint64_t epoch = step / spe;
      if (spe > window && step % spe >= spe - window && epoch_ends_hit.emplace(jobs.back(), epoch).second &&
          kill_victim("coordinator", *j, " (near the end of an epoch)")) {
        ++targeted;
      }
    }
    if (absl::Now() >= coordinator_after_worker) {
      coordinator_after_worker = absl::InfiniteFuture();
      if (kill_victim("coordinator", *j, " (while a replacement resumes)")) ++targeted;
    }
    if (absl::Now() >= next_kill) {
      // A server may die only once the job has a checkpoint to roll back to.
      const bool servers_ok = j->status().checkpoints_size() > 0;
      std::string victim;
      do {
        victim = victims[std::uniform_int_distribution<size_t>(0, victims.size() - 1)(rng)];
      } while (!servers_ok && victim.rfind("server", 0) == 0);
      if (kill_victim(victim, *j, "") && victim.rfind("worker", 0) == 0 &&
          std::uniform_int_distribution<int>(0, 1)(rng) == 1) {
        coordinator_after_worker =
            absl::Now() + absl::Milliseconds(std::uniform_int_distribution<int>(500, 2500)(rng));
      }
      next_kill = absl::Now() + absl::Milliseconds(std::uniform_int_distribution<int>(3000, 6000)(rng));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  WARN("kills:\n" << kills);

  // Every job ends, and succeeds; BSP jobs with the reference's weights.
  std::vector<v1::Job> finished;
  int bsp_compared = 0;
  for (const std::string& id : jobs) {
    const absl::Time limit = absl::Now() + absl::Minutes(2 * epochs + 2);
    std::optional<v1::Job> j;
    for (;;) {
      j = soak.Get(id);
      REQUIRE(j.has_value());
      if (Ended(j->status().state()) || absl::Now() > limit) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    INFO(Describe(*j) << "kills:\n" << kills);
    REQUIRE(j->status().state() == v1::SUCCEEDED);
    CHECK(j->status().test_accuracy() >= 0.95);
    if (j->spec().consistency().model() == v1::ConsistencySpec::BSP) {
      CHECK(j->status().weights_fingerprint() == reference_fingerprint);
      ++bsp_compared;
    }
    finished.push_back(*j);
  }
  CHECK(bsp_compared >= 1);
  uint32_t rollbacks = 0;
  for (const auto& j : finished) rollbacks += j.status().rollbacks();
  // One line for tests/bench/kill_loop.sh (Catch wraps its own messages).
  std::printf("soak summary: jobs=%zu bsp_identical=%d kills=%d targeted=%d rollbacks=%u\n", finished.size(),
              bsp_compared, kill_count, targeted, rollbacks);
  WARN(jobs.size() << " jobs succeeded, " << bsp_compared << " BSP jobs bit-identical to the undisturbed run ("
                   << reference_fingerprint << "); rollbacks: " << [&] {
    std::string r;
    for (const auto& j : finished) absl::StrAppend(&r, j.id(), "=", j.status().rollbacks(), " ");
    return r;
  }());

  // Stop the cluster, then read every committed cut from the servers' disks.
  stop.done = true;
  REQUIRE(Run(stop.args, stop.log) == 0);
  std::map<int, std::unique_ptr<CheckpointStore>> stores;
  int verified = 0;
  for (const v1::Job& j : finished) {
    REQUIRE(j.status().checkpoints_size() > 0);  // at least the final cut
    for (const v1::CheckpointInfo& cut : j.status().checkpoints()) {
      std::map<std::string, uint64_t> chunks;  // per dense table, over all servers
      std::set<uint64_t> steps;
      for (const std::string& address : cut.servers()) {
        const std::vector<std::string> hp = absl::StrSplit(address, ':');
        int port = 0;
        REQUIRE((hp.size() == 2 && absl::SimpleAtoi(hp[1], &port)));
        const int index = port - base - 1;
        auto& store = stores[index];
        if (store == nullptr) {
          auto opened = CheckpointStore::Open((dir / "cluster" / absl::StrCat("server-", index) / "checkpoints").string());
          INFO(opened.status().ToString());
          REQUIRE(opened.ok());
          store = *std::move(opened);
        }
        CheckpointStore::Visitor visit;
        visit.dense = [&](const std::string& table, uint32_t, uint64_t, uint32_t, uint32_t, const void*) {
          ++chunks[table];
          return absl::OkStatus();
        };
        auto meta = store->Read(j.id(), cut.cut_id(), visit);
        INFO(j.id() << " checkpoint " << cut.cut_id() << " on " << address << ": " << meta.status().ToString());
        REQUIRE(meta.ok());
        steps.insert(meta->step());
        for (const auto& t : meta->spec().tables()) {
          if (t.kind() != v1::TableSpec::DENSE) continue;
          int64_t n = 1;
          for (int64_t d : t.shape()) n *= d;
          const int64_t per = t.chunk_elements() == 0 ? 65536 : t.chunk_elements();
          // Filled in after the last server: compare then.
          chunks.try_emplace("#expect " + t.name(), static_cast<uint64_t>((n + per - 1) / per));
        }
      }
      for (const auto& [key, want] : chunks) {
        if (key.rfind("#expect ", 0) != 0) continue;
        INFO(j.id() << " checkpoint " << cut.cut_id() << " table " << key.substr(8));
        CHECK(chunks[key.substr(8)] == want);
      }
      if (j.spec().consistency().model() != v1::ConsistencySpec::ASP) CHECK(steps.size() == 1);
      ++verified;
    }
  }
  WARN(verified << " committed checkpoints verified on disk");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fulcrum
