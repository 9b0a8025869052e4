// fulcrum-lifecycle-bench: what a sparse table's lifecycle (admission and
// eviction, docs/embeddings.md) costs on the push and pull path of one
// in-process server (no network: the table and the job's push path alone),
// each figure against a peer or bound measured in the same run:
//
//  1. eviction on against off: the same stream of pulls and pushes (half the
//     keys of each batch from a hot set, half ids never seen before) into a
//     table capped at --cap rows and one without a cap. Goal: >= 0.9.
//  2. new keys against present keys: a capped table, full, fed batches of
//     ids it has never seen (each push creates rows and evicts as many)
//     against batches of ids it holds. Goal: >= 0.5.
//  3. distinct-key pulls per second against a bound: a hash-map lookup and
//     row copy over the same keys in one thread (absl::flat_hash_map, the
//     table's own index structure), the data-structure limit of this machine.
//
// Rounds of the compared streams alternate (--rounds of --steps each), so a
// noisy neighbour slows both alike. Prints a Markdown table and exits 1 when
// a goal is missed (--quick: a short run that checks the bench works).
//
//   fulcrum-lifecycle-bench [--batch=4096] [--dim=16] [--cap=1000000] [--rounds=5] [--steps=40] [--quick]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "server/parameter_server.h"
#include "worker/local_ps_client.h"

ABSL_FLAG(int32_t, batch, 4096, "distinct keys per pull and push");
ABSL_FLAG(int32_t, dim, 16, "floats per row");
ABSL_FLAG(int64_t, cap, 1000000, "rows the capped table keeps (eviction's max_rows)");
ABSL_FLAG(int32_t, rounds, 5, "alternating rounds of each compared stream");
ABSL_FLAG(int32_t, steps, 40, "pull + push steps a round");
ABSL_FLAG(double, drift, 0.05, "click-log stream: new ids a draw");
ABSL_FLAG(std::string, init, "normal", "the rows' initializer: normal (N(0, 0.01), as the models' embeddings) or uniform");
ABSL_FLAG(bool, quick, false, "a short run that checks the bench works (goals not enforced)");

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;
volatile float g_sink;  // keeps the bound's copies from being optimized away

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) {
    std::fprintf(stderr, "fulcrum-lifecycle-bench: %s: %s\n", what.c_str(), s.ToString().c_str());
    std::exit(2);
  }
}

std::shared_ptr<ParameterServer> StartServer() {
  auto map = ShardMap::RoundRobin(1, 256, {"in-process"});
  Check(map.status(), "shard map");
  ParameterServerOptions o;
  o.shard_map = map->ToProto();
  o.default_quota_bytes = uint64_t{16} << 30;
  auto created = ParameterServer::Create(std::move(o));
  Check(created.status(), "server");
  return std::move(*created);
}

v1::PsJobSpec Job(const std::string& id, int dim, int64_t cap) {
  v1::PsJobSpec spec;
  spec.set_job_id(id);
  spec.set_num_workers(1);
  spec.mutable_consistency()->set_model(v1::ConsistencySpec::ASP);
  v1::TableSpec* t = spec.add_tables();
  t->set_name("emb");
  t->set_kind(v1::TableSpec::SPARSE);
  t->set_dim(dim);
  if (absl::GetFlag(FLAGS_init) == "normal") {
    t->mutable_initializer()->set_kind(v1::InitializerSpec::NORMAL);
    t->mutable_initializer()->set_b(0.01f);
  } else {
    t->mutable_initializer()->set_kind(v1::InitializerSpec::UNIFORM);
    t->mutable_initializer()->set_a(-0.01f);
    t->mutable_initializer()->set_b(0.01f);
  }
  t->mutable_optimizer()->set_kind(v1::OptimizerSpec::ADAGRAD);
  t->mutable_optimizer()->set_learning_rate(0.05f);
  if (cap > 0) {
    t->mutable_eviction()->set_policy(v1::EvictionSpec::LRU);
    t->mutable_eviction()->set_max_rows(static_cast<uint64_t>(cap));
  }
  return spec;
}

// Keys spread over the 64-bit space, as hashed ids are.
uint64_t KeyOf(uint64_t i) { return (i + 1) * 0x9e3779b97f4a7c15ull; }

// A worker of one job: pulls then pushes a batch a step, timed.
class Feeder {
 public:
  // `first_step`: the clock to start from (a job's rows count their last
  // use in steps, so a second feeder of a job goes on from the first's);
  // each feeder is its own worker (the server drops a worker's repeated
  // sequence numbers as duplicates).
  Feeder(std::shared_ptr<ParameterServer> ps, const std::string& job, int dim, int batch, uint64_t first_step = 0)
      : client_(std::move(ps), absl::StrCat("bench-", job, "-", first_step)), job_(job), step_(first_step),
        rows_(size_t(batch) * dim), grads_(size_t(batch) * dim) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0, 0.1f);
    for (float& g : grads_) g = normal(rng);
  }
  // One step of `keys`; returns its seconds.
  double Step(const std::vector<uint64_t>& keys) {
    const auto t0 = Clock::now();
    Check(client_.Pull(job_, {step_, {}, {{"emb", keys.data(), keys.size(), rows_.data()}}}), "pull " + job_);
    Check(client_.Push(job_, {step_, {}, {{"emb", keys.data(), keys.size(), grads_.data()}}}), "push " + job_);
    ++step_;
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  double Pull(const std::vector<uint64_t>& keys) {
    const auto t0 = Clock::now();
    Check(client_.Pull(job_, {step_, {}, {{"emb", keys.data(), keys.size(), rows_.data()}}}), "pull " + job_);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

 private:
  LocalPsClient client_;
  std::string job_;
  uint64_t step_;
  std::vector<float> rows_, grads_;
};

struct Row {
  std::string what;
  double a_rate, b_rate;  // keys per second
  std::string a_name, b_name;
  double goal;
};

int Run() {
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int batch = quick ? 1024 : absl::GetFlag(FLAGS_batch);
  const int dim = absl::GetFlag(FLAGS_dim);
  const int64_t cap = quick ? 20000 : absl::GetFlag(FLAGS_cap);
  const int rounds = quick ? 2 : absl::GetFlag(FLAGS_rounds);
  const int steps = quick ? 8 : absl::GetFlag(FLAGS_steps);
  if (batch <= 0 || dim <= 0 || cap < batch || rounds <= 0 || steps <= 0) {
    std::fprintf(stderr, "fulcrum-lifecycle-bench: --batch, --dim, --rounds, --steps > 0 and --cap >= --batch\n");
    return 2;
  }
  std::shared_ptr<ParameterServer> ps = StartServer();
  std::vector<Row> out;

  // 1. Eviction on against off, on two streams:
  //  - a click log's ids: each draw a Zipf(1.1) rank over a window of
  //    4 x cap ids, the window sliding on by --drift new ids a draw, so an
  //    id's popularity fades with its age (as fulcrum-datagen ctr --drift);
  //    the capped table holds a quarter of the window (the goal's case);
  //  - a harsher one: half of each batch from a hot set of cap/2 ids drawn
  //    uniformly, half ids never seen (reported, no goal: its hot ids are
  //    reused too seldom for any policy to tell them from the new ones).
  const uint64_t window = static_cast<uint64_t>(cap) * 4;
  std::vector<double> cdf(window);
  {
    double sum = 0;
    for (uint64_t i = 0; i < window; ++i) cdf[i] = sum += std::pow(static_cast<double>(i + 1), -1.1);
    for (double& c : cdf) c /= sum;
  }
  const double drift = absl::GetFlag(FLAGS_drift);
  for (const bool zipf : {true, false}) {
    const std::string tag = zipf ? "zipf" : "half";
    Check(ps->CreateJob(Job("plain-" + tag, dim, 0)).status(), "job plain");
    Check(ps->CreateJob(Job("capped-" + tag, dim, cap)).status(), "job capped");
    Feeder plain(ps, "plain-" + tag, dim, batch), capped(ps, "capped-" + tag, dim, batch);
    std::mt19937_64 rng(1);
    std::uniform_real_distribution<double> unit(0, 1);
    const uint64_t hot = static_cast<uint64_t>(cap / 2);
    uint64_t fresh = uint64_t{1} << 40;
    uint64_t draws = 0;
    auto next_batch = [&] {
      std::vector<uint64_t> keys;
      keys.reserve(batch);
      if (zipf) {
        for (int i = 0; i < batch; ++i, ++draws) {
          const uint64_t rank = std::lower_bound(cdf.begin(), cdf.end(), unit(rng)) - cdf.begin();
          keys.push_back(KeyOf(static_cast<uint64_t>(static_cast<double>(draws) * drift) + window - 1 - rank));
        }
      } else {
        while (keys.size() < size_t(batch) / 2) keys.push_back(KeyOf(rng() % hot));
        while (keys.size() < size_t(batch)) keys.push_back(KeyOf(fresh++));
      }
      std::sort(keys.begin(), keys.end());
      keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
      return keys;
    };
    // Warm both until the capped table evicts, so it evicts from the start.
    for (int warm = 0;; ++warm) {
      const auto keys = next_batch();
      plain.Step(keys);
      capped.Step(keys);
      if (warm % 16 == 15 && ps->GetJob("capped-" + tag)->sparse_rows_evicted_cap() > 0) break;
      if (warm > 100000) {
        std::fprintf(stderr, "fulcrum-lifecycle-bench: the %s stream never filled the cap\n", tag.c_str());
        return 2;
      }
    }
    double t_plain = 0, t_capped = 0, keys_plain = 0, keys_capped = 0;
    for (int r = 0; r < rounds; ++r) {
      std::vector<std::vector<uint64_t>> round;
      for (int s = 0; s < steps; ++s) round.push_back(next_batch());
      // Alternate which goes first, so neither always meets a warmer cache.
      for (int pass = 0; pass < 2; ++pass) {
        const bool capped_now = (pass == 0) == (r % 2 == 0);
        for (const auto& keys : round) {
          if (capped_now) {
            t_capped += capped.Step(keys);
            keys_capped += keys.size();
          } else {
            t_plain += plain.Step(keys);
            keys_plain += keys.size();
          }
        }
      }
    }
    const v1::GetJobResponse cs = *ps->GetJob("capped-" + tag);
    const v1::GetJobResponse ps_ = *ps->GetJob("plain-" + tag);
    out.push_back({zipf ? absl::StrCat("push + pull, click-log ids (Zipf 1.1, ", drift, " new ids a draw): eviction on / off")
                        : "push + pull, half new ids a batch: eviction on / off",
                   keys_capped / t_capped, keys_plain / t_plain,
                   absl::StrCat("capped at ", cap, " rows (", cs.sparse_rows(), " held, ", cs.sparse_rows_evicted_cap(),
                                " evicted)"),
                   absl::StrCat("no cap (", ps_.sparse_rows(), " rows)"), zipf ? 0.9 : 0.0});
    Check(ps->DeleteJob("plain-" + tag).status(), "delete plain");
    if (zipf) Check(ps->DeleteJob("capped-" + tag).status(), "delete capped");
  }

  // 2. New keys against present keys, on the capped table (full).
  {
    Feeder capped(ps, "capped-half", dim, batch, uint64_t{1} << 30);
    // Each round: cap/2 ids never seen, in batches (each push makes rows and
    // evicts as many), then the same batches again, now present. The
    // replay touches as many rows as the new pass, so neither has the
    // cache to itself.
    const int batches = static_cast<int>(cap / 2 / batch);
    uint64_t fresh = uint64_t{1} << 50;
    std::vector<std::vector<uint64_t>> present;
    const v1::GetJobResponse before = *ps->GetJob("capped-half");
    double t_new = 0, t_present = 0, n_new = 0, n_present = 0;
    for (int r = 0; r < rounds; ++r) {
      present.clear();
      for (int s = 0; s < batches; ++s) {
        std::vector<uint64_t> keys(batch);
        for (auto& k : keys) k = KeyOf(fresh++);
        std::sort(keys.begin(), keys.end());
        t_new += capped.Step(keys);
        n_new += keys.size();
        present.push_back(std::move(keys));
      }
      for (const auto& keys : present) {
        t_present += capped.Step(keys);
        n_present += keys.size();
      }
    }
    const v1::GetJobResponse after = *ps->GetJob("capped-half");
    out.push_back({"push + pull at the cap: new ids / ids present", n_new / t_new, n_present / t_present,
                   absl::StrCat("new ids (", after.sparse_rows_evicted_cap() - before.sparse_rows_evicted_cap(),
                                " rows made, as many evicted)"),
                   "ids present", 0.5});

    // 3. Distinct-key pulls against a hash-map lookup and row copy.
    std::vector<uint64_t> keys;
    for (const auto& p : present) keys.insert(keys.end(), p.begin(), p.end());
    double t_pull = 0, n_pull = 0;
    for (int r = 0; r < rounds; ++r) {
      for (const auto& p : present) {
        t_pull += capped.Pull(p);
        n_pull += p.size();
      }
    }
    absl::flat_hash_map<uint64_t, uint32_t> index;
    index.reserve(static_cast<size_t>(cap));
    std::vector<float> table(static_cast<size_t>(cap) * dim * 2, 0.5f);  // weights and Adagrad's state
    std::mt19937_64 rng(3);
    // The same keys among as many others as the table holds.
    for (uint64_t i = 0; index.size() < static_cast<size_t>(cap) - keys.size(); ++i) index.emplace(KeyOf(rng()), 0);
    for (const uint64_t k : keys) index[k] = 0;
    uint32_t slot = 0;
    for (auto& [k, v] : index) v = slot++;
    std::vector<float> dst(size_t(batch) * dim);
    double t_bound = 0, n_bound = 0;
    float sink = 0;
    for (int r = 0; r < rounds; ++r) {
      for (const auto& p : present) {
        const auto t0 = Clock::now();
        for (size_t i = 0; i < p.size(); ++i) {
          const auto it = index.find(p[i]);
          std::memcpy(dst.data() + i * dim, table.data() + size_t{it->second} * dim * 2, size_t(dim) * sizeof(float));
        }
        t_bound += std::chrono::duration<double>(Clock::now() - t0).count();
        n_bound += p.size();
        sink += dst[size_t(batch / 2) * dim];
      }
    }
    out.push_back({"distinct-key pulls: the server / a hash-map lookup loop", n_pull / t_pull, n_bound / t_bound,
                   "pull through the job", "flat_hash_map find + row copy, 1 thread", 0});
    g_sink = sink;
  }

  std::printf("| what | measured | keys/s | peer or bound | keys/s | ratio | goal |\n|---|---|---|---|---|---|---|\n");
  bool ok = true;
  for (const Row& r : out) {
    const double ratio = r.a_rate / r.b_rate;
    const bool met = r.goal == 0 || ratio >= r.goal;
    ok = ok && met;
    std::printf("| %s | %s | %.0f | %s | %.0f | %.2f | %s |\n", r.what.c_str(), r.a_name.c_str(), r.a_rate,
                r.b_name.c_str(), r.b_rate, ratio,
                r.goal == 0 ? "reported" : absl::StrCat(">= ", r.goal, met ? " met" : " MISSED").c_str());
  }
  std::printf("batch %d distinct keys of dim %d (Adagrad), cap %lld rows over 256 virtual shards, %d rounds of %d steps\n",
              batch, dim, static_cast<long long>(cap), rounds, steps);
  return ok || quick ? 0 : 1;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  fulcrum::SetMinLogSeverity(fulcrum::LogSeverity::kWarning);
  return fulcrum::Run();
}
