// libFuzzer target: the coordinator's request handling, driven by sequences
// of calls as nodes and users would make them over gRPC. Each input is a
// list of records [op][length][payload]; every input runs against a fresh
// coordinator whose RocksDB lives in memory (rocksdb::NewMemEnv), with fake
// parameter servers that answer every call at once. The op picks the call:
//
//   0 SubmitJob      a valid softmax spec with the payload merged over it
//   1 RegisterNode   a server or worker NodeInfo, payload merged over it
//   2 Heartbeat      of a registered node (payload: generation and wait)
//   3 ReportProgress of a registered node for a submitted job
//   4 CancelJob      5 RestoreJob       6 GetJob and ListJobs
//   7 CheckpointJob  8 WatchJob (parked, then withdrawn)
//   9 ExportCheckpoint               10 GetCluster and the metrics scrape
//  11 a pause of 1-16 ms, so the scheduler thread acts (starts jobs, takes
//     cuts, and after a restart with short node timeouts declares nodes
//     that did not heartbeat dead)
//  12 the coordinator restarts from its store (Load of what the input wrote),
//     after bytes were appended to one of its records when the payload asks
//     (a record that parses to something odd, or not at all: the coordinator
//     must then refuse to start, not crash); the restarted coordinator
//     declares nodes dead after 10 ms without a heartbeat when asked
//
// Payload bytes name nodes and jobs by index into those registered and
// submitted so far, so most calls reach the state they are about. Nothing
// here may crash, trip a sanitizer or hang (10 s per input).
#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/config/spec_text.h"
#include "common/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "server/coordinator/coordinator.h"

namespace {

using fulcrum::Coordinator;
namespace v1 = fulcrum::v1;

// Parameter servers that take every cut and restore at once.
class FakeServers : public fulcrum::ServerControl {
 public:
  absl::Status InstallShardMap(const std::string&, const v1::ShardMap&) override { return absl::OkStatus(); }
  absl::Status DeleteJob(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string&, const std::string& job_id, uint64_t cut_id,
                                              uint64_t at_step, absl::Duration) override {
    v1::ShardCutMeta m;
    m.mutable_spec()->set_job_id(job_id);
    m.set_cut_id(cut_id);
    m.set_step(at_step);
    m.set_records(1);
    m.set_bytes(64);
    return m;
  }
  absl::StatusOr<v1::ShardCutMeta> Restore(const std::string& address, const std::string& job_id, uint64_t cut_id,
                                           const std::vector<std::string>&, uint32_t) override {
    return Checkpoint(address, job_id, cut_id, 0, absl::ZeroDuration());
  }
  absl::Status DeleteCut(const std::string&, const std::string&, uint64_t) override { return absl::OkStatus(); }
  absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string&, const std::string&) override {
    return std::vector<v1::ShardCutMeta>{};
  }
  absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const std::string& address,
                                                     const v1::ReadCheckpointRequest& req) override {
    v1::ReadCheckpointResponse r;
    *r.mutable_meta() = *Checkpoint(address, req.job_id(), req.cut_id(), 0, absl::ZeroDuration());
    v1::CheckpointRecord* rec = r.add_records();
    rec->set_key(req.start_after() + "x");
    if (rec->key().size() < 3) r.set_next_start_after(rec->key());  // three pages per server
    return r;
  }
};

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool Next(uint8_t* op, std::string* payload) {
    if (pos_ + 2 > size_) return false;
    *op = data_[pos_];
    const size_t n = std::min<size_t>(data_[pos_ + 1], size_ - pos_ - 2);
    payload->assign(reinterpret_cast<const char*>(data_ + pos_ + 2), n);
    pos_ += 2 + n;
    return true;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Reads small numbers off the front of a payload; the rest is a proto.
class Bytes {
 public:
  explicit Bytes(const std::string& s) : s_(s) {}
  uint8_t Take() { return pos_ < s_.size() ? static_cast<uint8_t>(s_[pos_++]) : 0; }
  std::string Rest() const { return s_.substr(std::min(pos_, s_.size())); }

 private:
  const std::string& s_;
  size_t pos_ = 0;
};

const v1::JobSpec& BaseSpec() {
  static const v1::JobSpec spec = [] {
    v1::JobSpec s;
    const absl::Status st = fulcrum::config::ParseSpecText(
        "name: f\nmodel: {type: softmax, num_features: 4, num_classes: 2}\n"
        "data: {train: {format: csv, path: t.csv}, test_fraction: 0.2}\n"
        "optimizer: {kind: sgd, learning_rate: 0.1}\nnum_workers: 1\nbatch_size: 8\nepochs: 1\n"
        "checkpoint: {every_steps: 2}\n",
        "base.yaml", &s);
    if (!st.ok()) std::abort();
    return s;
  }();
  return spec;
}

// Appends `bytes` to a record of the coordinator's store (protobuf's
// encoding merges what is appended, when it parses at all): a record that
// reads back odd, or not at all. The coordinator is closed meanwhile.
void Tamper(rocksdb::Env* env, const std::string& key, const std::string& bytes) {
  rocksdb::Options o;
  o.env = env;
  rocksdb::DB* raw = nullptr;
  if (!rocksdb::DB::Open(o, "/fuzz-coordinator", &raw).ok()) std::abort();
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string value;
  if (db->Get(rocksdb::ReadOptions(), key, &value).ok()) {
    if (!db->Put(rocksdb::WriteOptions(), key, value + bytes).ok()) std::abort();
  }
}

// `short_timeouts`: nodes that miss 10 ms of heartbeats die, and dead ones
// are forgotten 20 ms later, so an input can lose workers and servers.
absl::StatusOr<std::unique_ptr<Coordinator>> TryOpen(rocksdb::Env* env, bool short_timeouts = false) {
  fulcrum::CoordinatorOptions o;
  o.data_dir = "/fuzz-coordinator";
  o.env = env;
  o.tick = absl::Milliseconds(1);
  o.heartbeat_interval = absl::Milliseconds(2);
  o.checkpoint_wait = absl::Milliseconds(10);
  o.restore_timeout = absl::Milliseconds(50);
  o.store_retry = absl::Milliseconds(5);
  o.max_active_jobs_per_user = 4;
  if (short_timeouts) {
    o.node_timeout = absl::Milliseconds(10);
    o.dead_node_retention = absl::Milliseconds(20);
  }
  return Coordinator::Open(o, std::make_unique<FakeServers>());
}

std::unique_ptr<Coordinator> Open(rocksdb::Env* env) {
  auto c = TryOpen(env);
  if (!c.ok()) {
    fprintf(stderr, "opening the coordinator: %s\n", c.status().ToString().c_str());
    std::abort();
  }
  return std::move(*c);
}

template <typename T>
const T& Pick(const std::vector<T>& v, uint8_t i, const T& none) {
  return v.empty() ? none : v[i % v.size()];
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // FULCRUM_FUZZ_VERBOSE=1 keeps the coordinator's log, to see what an input did.
  if (getenv("FULCRUM_FUZZ_VERBOSE") == nullptr) fulcrum::SetMinLogSeverity(fulcrum::LogSeverity::kError);
  google::protobuf::SetLogHandler(nullptr);
  (void)BaseSpec();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<rocksdb::Env> env(rocksdb::NewMemEnv(rocksdb::Env::Default()));
  std::unique_ptr<Coordinator> c = Open(env.get());
  std::vector<std::string> nodes, jobs;
  const std::string none = "none";
  Input in(data, size);
  uint8_t op = 0;
  std::string payload;
  for (int calls = 0; calls < 64 && in.Next(&op, &payload); ++calls) {
    Bytes b(payload);
    switch (op % 13) {
      case 0: {
        v1::JobSpec spec = BaseSpec();
        if (!spec.MergeFromString(b.Rest())) break;
        auto id = c->SubmitJob(spec, op & 0x80, (op & 0x40) ? "user" : "");
        if (id.ok() && !id->empty()) jobs.push_back(*id);
        break;
      }
      case 1: {
        v1::NodeInfo n;
        const uint8_t role = b.Take();
        n.set_role(role & 1 ? v1::WORKER : v1::SERVER);
        n.set_address("127.0.0.1:" + std::to_string(7000 + role));
        n.set_slots(1 + (role >> 1) % 3);
        if ((role & 0x80) && !nodes.empty()) n.set_node_id(Pick(nodes, role, none));  // a re-registration
        if (!n.MergeFromString(b.Rest())) break;
        auto r = c->RegisterNode(n);
        if (r.ok()) nodes.push_back(r->node_id());
        break;
      }
      case 2: {
        v1::HeartbeatRequest req;
        req.set_node_id(Pick(nodes, b.Take(), none));
        req.set_generation(b.Take());
        if (!req.MergeFromString(b.Rest())) break;
        req.set_wait_ms(std::min<uint32_t>(req.wait_ms(), 3));
        (void)c->Heartbeat(req);
        break;
      }
      case 3: {
        v1::ReportProgressRequest req;
        req.set_node_id(Pick(nodes, b.Take(), none));
        req.set_job_id(Pick(jobs, b.Take(), none));
        req.set_rank(b.Take() % 3);
        req.set_incarnation(b.Take() % 3);
        if (!req.MergeFromString(b.Rest())) break;
        (void)c->ReportProgress(req);
        break;
      }
      case 4:
        (void)c->CancelJob(Pick(jobs, b.Take(), none));
        break;
      case 5: {
        const std::string& job = Pick(jobs, b.Take(), none);
        (void)c->RestoreJob(job, b.Take());
        break;
      }
      case 6: {
        (void)c->GetJob(payload.empty() ? none : Pick(jobs, b.Take(), payload));
        const int page = static_cast<int8_t>(b.Take()) * 9;
        (void)c->ListJobs(page, b.Rest(), [&](const v1::Job& j) { return j.id().size() % 2 == op % 2u; });
        break;
      }
      case 7: {
        auto done = std::make_shared<absl::Notification>();
        const uint64_t t = c->CheckpointJobAsync(Pick(jobs, b.Take(), none), absl::Milliseconds(b.Take() % 20),
                                                 [done](absl::StatusOr<v1::CheckpointInfo>) { done->Notify(); });
        if (!done->WaitForNotificationWithTimeout(absl::Milliseconds(50)) && !c->CancelWait(t)) {
          done->WaitForNotification();
        }
        break;
      }
      case 8: {
        auto done = std::make_shared<absl::Notification>();
        const uint64_t t = c->WaitJobAsync(Pick(jobs, b.Take(), none), b.Take(),
                                           [done](absl::StatusOr<v1::Job>, uint64_t) { done->Notify(); });
        if (!done->WaitForNotificationWithTimeout(absl::Milliseconds(2)) && !c->CancelWait(t)) {
          done->WaitForNotification();
        }
        break;
      }
      case 9: {
        const std::string& job = Pick(jobs, b.Take(), none);
        const uint64_t cut = b.Take();
        int budget = b.Take() % 8;
        (void)c->ExportCheckpoint(job, cut, [&](const v1::ExportCheckpointChunk&) { return budget-- > 0; });
        break;
      }
      case 10: {
        (void)c->GetCluster();
        fulcrum::metrics::Scrape scrape;
        c->CollectMetrics(&scrape);
        break;
      }
      case 11:
        absl::SleepFor(absl::Milliseconds(1 + b.Take() % 16));
        break;
      default: {
        c.reset();
        const uint8_t what = b.Take();
        if (what % 4 == 1) Tamper(env.get(), "meta", b.Rest());
        if (what % 4 == 2) Tamper(env.get(), "job/" + Pick(jobs, b.Take(), none), b.Rest());
        if (what % 4 == 3) Tamper(env.get(), "node/" + Pick(nodes, b.Take(), none), b.Rest());
        auto reopened = TryOpen(env.get(), what & 0x80);
        if (reopened.ok()) {
          c = std::move(*reopened);
        } else if (what % 4 != 0) {
          // A record that no longer parses is refused, and named: start afresh.
          env.reset(rocksdb::NewMemEnv(rocksdb::Env::Default()));
          c = Open(env.get());
          nodes.clear();
          jobs.clear();
        } else {
          fprintf(stderr, "reopening the coordinator: %s\n", reopened.status().ToString().c_str());
          std::abort();
        }
        break;
      }
    }
  }
  c.reset();
  return 0;
}
