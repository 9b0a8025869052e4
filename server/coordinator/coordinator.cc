#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <set>
#include <thread>
#include <utility>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/config/job_spec.h"
#include "common/logging.h"
#include "common/shard_map.h"
#include "common/rocksdb_status.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

constexpr char kJobPrefix[] = "job/";
constexpr char kNodePrefix[] = "node/";
constexpr char kMetaKey[] = "meta";

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// Job ids ("name-N") and node ids ("server-N", "worker-N") end in the
// coordinator's counter: N orders jobs by submission and nodes by
// registration, across restarts.
// What is wrong with a job record that parsed, or "": a record can still be
// damaged (or written by hand), and the rest of the coordinator relies on
// these holding.
std::string JobRecordProblem(const std::string& key, const v1::Job& job) {
  if (key != kJobPrefix + job.id()) return absl::StrCat("it holds job '", job.id(), "'");
  const uint32_t n = job.spec().num_workers();
  if (n < 1 || n > config::kMaxWorkers) return absl::StrCat("num_workers ", n, " is not 1 to ", config::kMaxWorkers);
  // One progress entry per rank, in rank order, as SubmitJob made them.
  const auto& workers = job.status().workers();
  for (int i = 0; i < workers.size(); ++i) {
    if (workers[i].rank() != static_cast<uint32_t>(i)) {
      return absl::StrCat("worker entry ", i, " is for rank ", workers[i].rank());
    }
  }
  if (static_cast<uint32_t>(workers.size()) != n) {
    return absl::StrCat(workers.size(), " worker entries for num_workers ", n);
  }
  return "";
}

uint64_t Serial(const std::string& id) {
  const size_t dash = id.rfind('-');
  return dash == std::string::npos ? 0 : std::strtoull(id.c_str() + dash + 1, nullptr, 10);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Open(CoordinatorOptions options,
                                                               std::unique_ptr<ServerControl> servers) {
  if (options.data_dir.empty()) return absl::InvalidArgumentError("coordinator needs a data directory");
  std::unique_ptr<Coordinator> c(new Coordinator(std::move(options), std::move(servers)));
  std::error_code ec;
  std::filesystem::create_directories(c->options_.data_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create coordinator data directory ", c->options_.data_dir, ": ", ec.message()));
  }
  {
    absl::MutexLock lock(&c->mu_);
    RETURN_IF_ERROR(c->OpenStoreLocked());
  }
  RETURN_IF_ERROR(c->Load());
  c->scheduler_ = std::thread([p = c.get()] { p->SchedulerLoop(); });
  return c;
}

absl::Status Coordinator::OpenStoreLocked() {
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  if (options_.env != nullptr) db_options.env = options_.env;
  rocksdb::DB* db = nullptr;
  db_.reset();  // RocksDB's lock on the directory goes with it
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(db_options, options_.data_dir, &db),
                            absl::StrCat("opening coordinator state in ", options_.data_dir)));
  db_.reset(db);
  return absl::OkStatus();
}

Coordinator::Coordinator(CoordinatorOptions options, std::unique_ptr<ServerControl> servers)
    : options_(std::move(options)), servers_(std::move(servers)) {}

Coordinator::~Coordinator() {
  Shutdown();
  if (scheduler_.joinable()) scheduler_.join();
  absl::MutexLock lock(&mu_);
  // Shutdown woke every parked poll: each is answered before waker_ stops.
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return background_ == 0 && polls_.empty() && answering_ == 0;
  };
  mu_.Await(absl::Condition(&idle));
}

void Coordinator::Spawn(std::function<void()> f) {
  // Called with mu_ held (from the scheduler); the thread takes it later.
  ++background_;
  std::thread([this, f = std::move(f)] {
    f();
    absl::MutexLock lock(&mu_);
    --background_;
  }).detach();
}

void Coordinator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    ++generation_;
    for (const auto& [ticket, poll] : polls_) WakeLocked(ticket);
  }
  servers_->CancelAll();
}

absl::Status Coordinator::Load() {
  absl::MutexLock lock(&mu_);
  std::string meta_bytes;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), kMetaKey, &meta_bytes);
  if (s.ok()) {
    v1::CoordinatorMeta m;
    if (!m.ParseFromString(meta_bytes)) return absl::DataLossError("coordinator meta record is corrupt");
    next_job_ = m.next_job();
    next_node_ = m.next_node();
    if (m.has_shard_map()) {
      if (auto map = ShardMap::FromProto(m.shard_map()); !map.ok()) {
        return absl::DataLossError(
            absl::StrCat("coordinator meta record is corrupt: its shard map: ", map.status().message()));
      }
      shard_map_ = m.shard_map();
    }
  } else if (!s.IsNotFound()) {
    return FromRocks(s, "reading coordinator meta");
  }
  const absl::Time now = absl::Now();
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string key = it->key().ToString();
    auto corrupt = [&key](absl::string_view why) {
      return absl::DataLossError(
          absl::StrCat("coordinator record '", key, "' is corrupt", why.empty() ? "" : ": ", why));
    };
    if (absl::StartsWith(key, kJobPrefix)) {
      JobRecord r;
      if (!r.job.ParseFromString(it->value().ToString())) return corrupt("");
      if (const std::string why = JobRecordProblem(key, r.job); !why.empty()) return corrupt(why);
      r.ranks.resize(r.job.spec().num_workers());
      for (const v1::WorkerProgress& w : r.job.status().workers()) {
        RankSlot& slot = r.ranks[w.rank()];
        slot.incarnation = w.incarnation();
        slot.finished = w.state() == "finished";
        if (r.job.status().state() == v1::RUNNING && r.job.status().restoring_cut() == 0 && w.state() != "lost") {
          slot.node_id = w.worker_id();
        }
      }
      r.release_pending = config::JobEnded(r.job.status().state());
      r.final_cut_pending = r.job.status().state() == v1::RUNNING && r.job.status().restoring_cut() == 0 &&
                            !r.ranks.empty() &&
                            std::all_of(r.ranks.begin(), r.ranks.end(), [](const RankSlot& s) { return s.finished; });
      if (r.job.status().state() == v1::RUNNING) r.started = now;
      r.restore_since = now;
      if (r.job.status().checkpoints_size() > 0) {
        r.last_cut = absl::FromUnixMillis(r.job.status().checkpoints().rbegin()->created_unix_ms());
      }
      // Ids are never given twice, even if the meta record was not saved.
      next_job_ = std::max(next_job_, Serial(r.job.id()) + 1);
      jobs_.emplace(r.job.id(), std::move(r));
    } else if (absl::StartsWith(key, kNodePrefix)) {
      NodeRecord n;
      if (!n.info.ParseFromString(it->value().ToString())) return corrupt("");
      if (key != kNodePrefix + n.info.node_id()) return corrupt(absl::StrCat("it holds node '", n.info.node_id(), "'"));
      n.last_heartbeat = now;  // a grace period to heartbeat again
      n.heard = false;
      next_node_ = std::max(next_node_, Serial(n.info.node_id()) + 1);
      nodes_.emplace(n.info.node_id(), std::move(n));
    }
  }
  // A damaged block ends the scan early: starting on what was read before
  // it would forget the jobs after it, and overwrite them.
  RETURN_IF_ERROR(FromRocks(it->status(), absl::StrCat("reading coordinator state in ", options_.data_dir)));
  FLOG(INFO) << "coordinator state in " << options_.data_dir << ": " << jobs_.size() << " jobs, " << nodes_.size()
             << " nodes, shard map "
             << (shard_map_ ? absl::StrCat("version ", shard_map_->version(), " over ", shard_map_->servers_size(),
                                           " servers")
                            : std::string("not built yet"));
  return absl::OkStatus();
}

void Coordinator::SaveJobLocked(JobRecord& r, bool sync) {
  ++r.version;
  WakeJobLocked(r.job.id());
  WriteKeyLocked(kJobPrefix + r.job.id(), sync);
}

void Coordinator::SaveNodeLocked(const std::string& node_id) { WriteKeyLocked(kNodePrefix + node_id, true); }

void Coordinator::SaveMetaLocked() { WriteKeyLocked(kMetaKey, true); }

std::optional<std::string> Coordinator::ValueOfLocked(const std::string& key) const {
  if (key == kMetaKey) {
    v1::CoordinatorMeta m;
    m.set_next_job(next_job_);
    m.set_next_node(next_node_);
    if (shard_map_) *m.mutable_shard_map() = *shard_map_;
    return m.SerializeAsString();
  }
  if (absl::StartsWith(key, kJobPrefix)) {
    auto it = jobs_.find(key.substr(strlen(kJobPrefix)));
    if (it != jobs_.end()) return it->second.job.SerializeAsString();
  } else if (absl::StartsWith(key, kNodePrefix)) {
    // A dead node never comes back under its id (it registers anew), so
    // a restarted coordinator must not know it: it would give it a grace
    // period and then declare it dead a second time.
    auto it = nodes_.find(key.substr(strlen(kNodePrefix)));
    if (it != nodes_.end() && it->second.alive) return it->second.info.SerializeAsString();
  }
  return std::nullopt;
}

void Coordinator::WriteKeyLocked(const std::string& key, bool sync) {
  rocksdb::Status s = rocksdb::Status::IOError("the store is closed: reopening it failed");
  if (db_ != nullptr) {
    rocksdb::WriteOptions w;
    w.sync = sync;
    const std::optional<std::string> value = ValueOfLocked(key);
    s = value ? db_->Put(w, key, *value) : db_->Delete(w, key);
  }
  if (s.ok()) {
    unsaved_.erase(key);
    return;
  }
  unsaved_.insert(key);
  ++store_write_failures_;
  ++store_.failures;
  store_.error = s.ToString();
  const absl::Time now = absl::Now();
  if (store_.since == absl::InfinitePast()) {
    store_.since = now;
    store_.last_logged = now;
    store_.next_try = now + options_.store_retry;
    FLOG(ERROR) << "cannot save coordinator state in " << options_.data_dir << " (writing '" << key
                << "'): " << store_.error << "; until it works, job submissions, cancels, restores and node "
                << "registrations are refused with UNAVAILABLE; trying again every "
                << absl::FormatDuration(options_.store_retry);
  } else if (now - store_.last_logged >= absl::Minutes(1)) {
    store_.last_logged = now;
    FLOG(ERROR) << "still cannot save coordinator state in " << options_.data_dir << " after "
                << absl::FormatDuration(absl::Trunc(now - store_.since, absl::Seconds(1))) << " (" << store_.failures
                << " failed writes, " << unsaved_.size() << " records unsaved): " << store_.error;
  }
}

std::string Coordinator::StoreTroubleLocked() const {
  return absl::StrCat("the coordinator cannot save its state in ", options_.data_dir, " (", store_.error, ")");
}

absl::Status Coordinator::StoreUnavailableLocked(const std::string& what) const {
  return absl::UnavailableError(absl::StrCat(StoreTroubleLocked(), ": ", what,
                                             "; try again once it can (it retries every ",
                                             absl::FormatDuration(options_.store_retry),
                                             " and logs when it works again)"));
}

absl::Status Coordinator::ChangeJobLocked(JobRecord& r, const std::string& what,
                                          const std::function<void()>& change) {
  JobRecord before = r;
  change();
  if (SavedLocked(kJobPrefix + r.job.id())) return absl::OkStatus();
  r = std::move(before);  // the key stays unsaved: the repair writes the job as it is again
  return StoreUnavailableLocked(what);
}

void Coordinator::RepairStoreLocked() {
  const absl::Time now = absl::Now();
  size_t rewritten = 0;
  if (!unsaved_.empty()) {
    if (now < store_.next_try) return;
    store_.next_try = now + options_.store_retry;
    // A failed write stops RocksDB's writes (a background error) until it
    // resumes; reopening it, which replays its log, recovers from every
    // kind (the checkpoint store does the same, server/checkpoint.h).
    if (const absl::Status opened = OpenStoreLocked(); !opened.ok()) {
      ++store_.failures;
      store_.error = std::string(opened.message());
      return;
    }
    store_.reopened = true;
    const std::vector<std::string> keys(unsaved_.begin(), unsaved_.end());
    for (const std::string& key : keys) {
      WriteKeyLocked(key, true);
      if (!SavedLocked(key)) return;
    }
    rewritten = keys.size();
  }
  if (store_.since == absl::InfinitePast()) return;  // no trouble
  FLOG(INFO) << "coordinator state in " << options_.data_dir << " saved again after "
             << absl::FormatDuration(absl::Trunc(now - store_.since, absl::Milliseconds(1))) << "; "
             << store_.failures << " writes had failed, " << rewritten << (rewritten == 1 ? " record" : " records")
             << " written again" << (store_.reopened ? " (RocksDB reopened)" : "");
  store_ = StoreTrouble();
}

void Coordinator::BumpGenerationLocked() {
  ++generation_;
  kick_ = true;
  for (uint64_t ticket : heartbeat_polls_) WakeLocked(ticket);
}

// ---------------------------------------------------------------- long polls

uint64_t Coordinator::ParkLocked(PollKind kind, const std::string& job_id, bool now, absl::Time deadline,
                                 std::function<std::function<void()>()> answer) {
  const uint64_t ticket = next_poll_++;
  Poll& p = polls_[ticket];
  p.kind = kind;
  p.job_id = job_id;
  p.deadline = deadline;
  p.answer = std::move(answer);
  p.timer = waker_.Schedule(now ? absl::InfinitePast() : deadline, [this, ticket] { RunPoll(ticket); });
  if (kind == PollKind::kHeartbeat) {
    heartbeat_polls_.insert(ticket);
  } else {
    job_polls_[job_id].insert(ticket);
  }
  return ticket;
}

void Coordinator::WakeLocked(uint64_t ticket) {
  auto it = polls_.find(ticket);
  if (it == polls_.end()) return;
  // A failed Cancel means RunPoll is already on its way.
  if (waker_.Cancel(it->second.timer)) {
    it->second.timer = waker_.Schedule(absl::InfinitePast(), [this, ticket] { RunPoll(ticket); });
  }
}

void Coordinator::WakeJobLocked(const std::string& job_id) {
  auto it = job_polls_.find(job_id);
  if (it == job_polls_.end()) return;
  for (uint64_t ticket : it->second) WakeLocked(ticket);
}

void Coordinator::ForgetPollLocked(std::map<uint64_t, Poll>::iterator it) {
  if (it->second.kind == PollKind::kHeartbeat) {
    heartbeat_polls_.erase(it->first);
  } else if (auto j = job_polls_.find(it->second.job_id); j != job_polls_.end()) {
    j->second.erase(it->first);
    if (j->second.empty()) job_polls_.erase(j);
  }
  polls_.erase(it);
}

void Coordinator::RunPoll(uint64_t ticket) {
  std::function<void()> deliver;
  {
    absl::MutexLock lock(&mu_);
    auto it = polls_.find(ticket);
    if (it == polls_.end()) return;  // withdrawn
    deliver = it->second.answer();
    if (!deliver) {
      // Nothing to answer yet: parked again until the deadline or a wake.
      it->second.timer = waker_.Schedule(it->second.deadline, [this, ticket] { RunPoll(ticket); });
      return;
    }
    ForgetPollLocked(it);
    ++answering_;
  }
  deliver();
  absl::MutexLock lock(&mu_);
  --answering_;
}

bool Coordinator::CancelWait(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  auto it = polls_.find(ticket);
  if (it == polls_.end()) return false;
  waker_.Cancel(it->second.timer);  // or RunPoll finds nothing
  ForgetPollLocked(it);
  return true;
}

uint64_t Coordinator::WaitJobAsync(const std::string& job_id, uint64_t version, JobCallback done) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  const bool now = version == 0 || shutdown_ || it == jobs_.end() || it->second.version != version;
  return ParkLocked(PollKind::kWatch, job_id, now, absl::InfiniteFuture(),
                    [this, job_id, version, done = std::move(done)]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                        mu_) -> std::function<void()> {
                      absl::StatusOr<v1::Job> job;
                      uint64_t at = 0;
                      auto j = jobs_.find(job_id);
                      if (shutdown_) {
                        job = absl::UnavailableError("coordinator is shutting down");
                      } else if (j == jobs_.end()) {
                        job = absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
                      } else if (version != 0 && j->second.version == version) {
                        return nullptr;  // woken for its job's cut waiters: nothing new
                      } else {
                        job = j->second.job;
                        at = j->second.version;
                      }
                      return [done, job = std::move(job), at]() mutable { done(std::move(job), at); };
                    });
}

// ---------------------------------------------------------------- job API

absl::StatusOr<std::string> Coordinator::SubmitJob(const v1::JobSpec& spec_in, bool validate_only,
                                                   const std::string& owner) {
  v1::JobSpec spec = spec_in;
  config::NormalizeJobSpec(&spec);
  RETURN_IF_ERROR(config::ValidateJobSpec(spec));
  if (validate_only) return std::string();
  if (spec.seed() == 0) spec.set_seed(1);
  if (spec.consistency().model() == v1::ConsistencySpec::MODEL_UNSPECIFIED) {
    spec.mutable_consistency()->set_model(v1::ConsistencySpec::BSP);
  }
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
  if (!owner.empty() && options_.max_active_jobs_per_user > 0) {
    uint32_t active = 0;
    for (const auto& [_, other] : jobs_) {
      active += other.job.owner() == owner && !config::JobEnded(other.job.status().state());
    }
    if (active >= options_.max_active_jobs_per_user) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "user '", owner, "' has ", active, " jobs pending or running; the limit is ",
          options_.max_active_jobs_per_user, " (--max_active_jobs_per_user): cancel one or wait for one to end"));
    }
  }
  JobRecord r;
  const std::string id = absl::StrCat(spec.name(), "-", next_job_++);
  SaveMetaLocked();
  r.job.set_id(id);
  r.job.set_owner(owner);
  *r.job.mutable_spec() = spec;
  r.job.mutable_status()->set_create_time_unix_ms(NowMs());
  r.ranks.resize(spec.num_workers());
  for (uint32_t i = 0; i < spec.num_workers(); ++i) {
    v1::WorkerProgress* w = r.job.mutable_status()->add_workers();
    w->set_rank(i);
    w->set_state("pending");
  }
  SetStateLocked(r, v1::PENDING, "Created", "JobCreated", "accepted; waiting for servers and workers");
  auto [it, inserted] = jobs_.emplace(id, std::move(r));
  SaveJobLocked(it->second, true);
  if (!SavedLocked(kJobPrefix + id) || !SavedLocked(kMetaKey)) {
    // Its key stays unsaved: the repair deletes whatever part reached the
    // disk. The id is not given again (next_job_ moved on).
    jobs_.erase(it);
    return StoreUnavailableLocked("the job was not submitted");
  }
  kick_ = true;
  FLOG(INFO) << "job " << id << " submitted: model " << spec.model().type() << ", " << spec.num_workers()
             << " workers, " << spec.epochs() << " epochs, "
             << v1::ConsistencySpec::Model_Name(spec.consistency().model());
  return id;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  return it->second.job;
}

absl::StatusOr<Coordinator::JobPage> Coordinator::ListJobs(
    int page_size, const std::string& page_token, const std::function<bool(const v1::Job&)>& visible) const {
  if (page_size < 0 || page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: ", page_size, " must be 0 to ", kMaxPageSize, " (0 means ", kDefaultPageSize, ")"));
  }
  const size_t limit = page_size == 0 ? kDefaultPageSize : static_cast<size_t>(page_size);
  // The token is the serial number of the last job of the previous page: a
  // job forgotten meanwhile (ttl_seconds_after_finished) breaks nothing.
  uint64_t after = 0;
  if (!page_token.empty() &&
      (!absl::StartsWith(page_token, "after-") || !absl::SimpleAtoi(page_token.substr(6), &after))) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token: '", page_token.substr(0, 64), "' is not a next_page_token this coordinator gave"));
  }
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, const JobRecord*>> rs;
  for (const auto& [id, r] : jobs_) {
    const uint64_t serial = Serial(id);
    if (serial > after) rs.emplace_back(serial, &r);
  }
  std::sort(rs.begin(), rs.end());
  JobPage page;
  uint64_t last = 0;
  for (const auto& [serial, r] : rs) {
    if (!visible(r->job)) continue;
    if (page.jobs.size() == limit) {
      page.next_page_token = absl::StrCat("after-", last);
      break;
    }
    page.jobs.push_back(r->job);
    last = serial;
  }
  return page;
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  JobRecord& r = it->second;
  if (config::JobEnded(r.job.status().state())) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' already ended: ",
                                                      v1::JobState_Name(r.job.status().state())));
  }
  auto cancel = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FinishLocked(r, v1::CANCELLED, "JobCancelled", "cancelled by request");
  };
  RETURN_IF_ERROR(ChangeJobLocked(r, absl::StrCat("job '", job_id, "' was not cancelled"), cancel));
  FLOG(INFO) << "job " << job_id << " cancelled";
  return r.job;
}

void Coordinator::SetStateLocked(JobRecord& r, v1::JobState state, const std::string& type,
                                 const std::string& reason, const std::string& message) {
  v1::JobStatus* st = r.job.mutable_status();
  st->set_state(state);
  st->set_reason(reason);
  st->set_message(message);
  v1::JobCondition* c = st->add_conditions();
  c->set_type(type);
  c->set_reason(reason);
  c->set_message(message);
  c->set_time_unix_ms(NowMs());
}

void Coordinator::FinishLocked(JobRecord& r, v1::JobState state, const std::string& reason,
                               const std::string& message) {
  static const std::map<v1::JobState, std::string> kType = {
      {v1::SUCCEEDED, "Succeeded"}, {v1::FAILED, "Failed"}, {v1::CANCELLED, "Cancelled"}};
  SetStateLocked(r, state, kType.at(state), reason, message);
  r.final_cut_pending = false;
  v1::JobStatus* st = r.job.mutable_status();
  st->set_end_time_unix_ms(NowMs());
  st->set_eta_seconds(0);
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    v1::WorkerProgress* w = st->mutable_workers(static_cast<int>(i));
    if (w->state() != "finished" && w->state() != "failed") w->set_state(state == v1::CANCELLED ? "cancelled" : "stopped");
    r.ranks[i].node_id.clear();
  }
  RecomputeLocked(r);
  r.release_pending = true;
  SaveJobLocked(r, true);
  BumpGenerationLocked();
}

void Coordinator::RecomputeLocked(JobRecord& r) {
  v1::JobStatus* st = r.job.mutable_status();
  uint64_t min_step = UINT64_MAX;
  uint32_t min_epoch = UINT32_MAX;
  double loss = 0, acc = 0, sps = 0;
  int n = 0;
  uint32_t active = 0, succeeded = 0, failed = 0;
  for (const v1::WorkerProgress& w : st->workers()) {
    min_step = std::min<uint64_t>(min_step, w.step());
    min_epoch = std::min(min_epoch, w.epoch());
    if (w.state() == "finished") ++succeeded;
    else if (w.state() == "failed") ++failed;
    else if (!r.ranks.empty() && w.rank() < r.ranks.size() && !r.ranks[w.rank()].node_id.empty()) ++active;
    // Ranks that just (re)started have no figures yet: averaging their
    // zeros in would halve the job's accuracy after every rollback.
    if ((w.state() == "training" || w.state() == "evaluating") && w.has_metrics()) {
      loss += w.loss();
      acc += w.train_accuracy();
      sps += w.samples_per_second();
      ++n;
    }
  }
  if (min_step != UINT64_MAX) st->set_step(min_step);
  if (min_epoch != UINT32_MAX) st->set_epoch(min_epoch);
  if (n > 0) {
    st->set_loss(loss / n);
    st->set_train_accuracy(acc / n);
    st->set_samples_per_second(sps);
    const double steps_per_second = sps / std::max(1u, r.job.spec().num_workers()) / std::max(1u, std::max(r.job.spec().batch_size(), st->batch_size()));
    if (steps_per_second > 0 && st->total_steps() > st->step()) {
      st->set_eta_seconds(static_cast<double>(st->total_steps() - st->step()) / steps_per_second);
    }
  } else if (!config::JobEnded(st->state()) && succeeded < static_cast<uint32_t>(st->workers_size())) {
    // Nothing trains (restoring, waiting for a worker or a server): no
    // speed and no ETA rather than the last ones. A job whose ranks all
    // finished, or that ended, keeps its last figures.
    st->set_samples_per_second(0);
    st->set_eta_seconds(0);
  }
  st->set_active_workers(active);
  st->set_succeeded_workers(succeeded);
  st->set_failed_workers(failed);
}

// ---------------------------------------------------------------- cluster API

namespace {

constexpr size_t kMaxNodeString = 256;   // hostname, version, address, device fields
constexpr uint32_t kMaxSlots = 1024;     // as fulcrum-worker --slots
constexpr int kMaxDevices = 1024;

// What a node says of itself is kept, shown by `fulcrumctl cluster` and,
// for a server, dialled: every field has a bound, and a server's address
// must be HOST:PORT.
absl::Status CheckNodeInfo(const v1::NodeInfo& n) {
  auto too_long = [](const char* field, const std::string& v) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: ", field, " is ", v.size(), " bytes; at most ", kMaxNodeString, " allowed"));
  };
  if (n.hostname().size() > kMaxNodeString) return too_long("hostname", n.hostname());
  if (n.version().size() > kMaxNodeString) return too_long("version", n.version());
  if (n.node_id().size() > kMaxNodeString) return too_long("node_id", n.node_id());
  if (n.address().size() > kMaxNodeString) return too_long("address", n.address());
  if (n.slots() > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("register: slots is ", n.slots(), "; allowed: 1 to ", kMaxSlots,
                                                   " (0 means 1)"));
  }
  if (n.devices_size() > kMaxDevices) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: ", n.devices_size(), " devices; at most ", kMaxDevices, " allowed"));
  }
  for (const v1::DeviceInfo& d : n.devices()) {
    if (d.kind().size() > kMaxNodeString) return too_long("devices.kind", d.kind());
    if (d.name().size() > kMaxNodeString) return too_long("devices.name", d.name());
  }
  if (n.role() == v1::SERVER) {
    const size_t colon = n.address().rfind(':');
    uint32_t port = 0;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(n.address().substr(colon + 1), &port) ||
        port == 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("register: a server's address must be HOST:PORT with a port of "
                                                     "1 to 65535; got '", n.address(), "'"));
    }
  }
  return absl::OkStatus();
}

// What a failing shard-map install is called in the log, and its key in
// failing_calls_ (the waiting jobs' message looks it up).
constexpr char kInstallingShardMap[] = "installing the shard map";

// What a worker's progress report may carry. A report is saved with the job
// and sent to every watcher, so its strings are bounded; its speeds and times
// are summed into the job's, so they must be numbers a worker can measure.
constexpr size_t kMaxStateString = 32;     // assigned, loading, training, ...
constexpr size_t kMaxReasonString = 64;    // a CamelCase word
constexpr size_t kMaxFingerprint = 128;    // hex of a hash
constexpr size_t kMaxErrorMessage = 4096;  // longer ones are cut, not refused

absl::Status CheckProgressReport(const v1::ReportProgressRequest& req) {
  auto too_long = [](const char* field, size_t size, size_t max) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress report: ", field, " is ", size, " bytes; at most ", max, " allowed"));
  };
  const v1::WorkerProgress& p = req.progress();
  if (p.state().size() > kMaxStateString) return too_long("progress.state", p.state().size(), kMaxStateString);
  if (p.device().size() > kMaxNodeString) return too_long("progress.device", p.device().size(), kMaxNodeString);
  if (req.error_reason().size() > kMaxReasonString) {
    return too_long("error_reason", req.error_reason().size(), kMaxReasonString);
  }
  if (req.weights_fingerprint().size() > kMaxFingerprint) {
    return too_long("weights_fingerprint", req.weights_fingerprint().size(), kMaxFingerprint);
  }
  if (p.batch_size_choice().size() > kMaxErrorMessage) {
    return too_long("progress.batch_size_choice", p.batch_size_choice().size(), kMaxErrorMessage);
  }
  if (p.batch_size() > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress report: progress.batch_size is ", p.batch_size(), "; at most 65536 allowed"));
  }
  const std::pair<const char*, double> measured[] = {
      {"progress.gpu_busy_seconds", p.gpu_busy_seconds()},
      {"progress.gpu_idle_seconds", p.gpu_idle_seconds()},
      {"progress.lr_scale", p.lr_scale()},
      {"progress.samples_per_second", p.samples_per_second()},
      {"progress.data_wait_seconds", p.data_wait_seconds()},
      {"progress.learning_rate", p.learning_rate()},
      {"epoch_done.samples_per_second", req.epoch_done().samples_per_second()},
      {"epoch_done.seconds", req.epoch_done().seconds()},
  };
  for (const auto& [field, v] : measured) {
    if (!std::isfinite(v) || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("progress report: ", field, " is ", v, "; must be a finite number >= 0"));
    }
  }
  return absl::OkStatus();
}

// `message` cut to at most `max` bytes at a UTF-8 character boundary (proto3
// strings must stay valid UTF-8), saying how much was cut.
std::string CutMessage(const std::string& message, size_t max) {
  if (message.size() <= max) return message;
  size_t end = max;
  while (end > 0 && (static_cast<unsigned char>(message[end]) & 0xC0) == 0x80) --end;
  return absl::StrCat(message.substr(0, end), " ... (", message.size() - end, " more bytes)");
}

}  // namespace

absl::StatusOr<v1::RegisterNodeResponse> Coordinator::RegisterNode(const v1::NodeInfo& node_in) {
  if (node_in.role() != v1::SERVER && node_in.role() != v1::WORKER) {
    return absl::InvalidArgumentError("register: role must be SERVER or WORKER");
  }
  if (node_in.role() == v1::SERVER && node_in.address().empty()) {
    return absl::InvalidArgumentError("register: a server must give the address its parameter service listens on");
  }
  RETURN_IF_ERROR(CheckNodeInfo(node_in));
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
  v1::NodeInfo info = node_in;
  auto known = info.node_id().empty() ? nodes_.end() : nodes_.find(info.node_id());
  const bool fresh = known == nodes_.end() || known->second.info.role() != info.role();
  if (!fresh) {
    known->second.info = info;  // a node re-registering after our restart
  } else {
    // A server restarted at an address already known replaces the old entry.
    if (info.role() == v1::SERVER) {
      for (auto& [id, n] : nodes_) {
        if (n.info.role() == v1::SERVER && n.info.address() == info.address() && n.alive) {
          // The scheduler declares it dead at its next tick, and deals with
          // the jobs that had shards on it.
          n.last_heartbeat = absl::Now() - options_.node_timeout;
          FLOG(WARNING) << "server " << id << " at " << info.address() << " re-registered: the old process is gone";
        }
      }
    }
    info.set_node_id(absl::StrCat(info.role() == v1::SERVER ? "server-" : "worker-", next_node_++));
    SaveMetaLocked();
  }
  if (info.slots() == 0) info.set_slots(1);
  NodeRecord& n = nodes_[info.node_id()];
  n.info = info;
  n.alive = true;
  n.Heard();
  SaveNodeLocked(info.node_id());
  if (!SavedLocked(kNodePrefix + info.node_id()) || (fresh && !SavedLocked(kMetaKey))) {
    // Its key stays unsaved: the repair deletes whatever part reached the disk.
    if (fresh) nodes_.erase(info.node_id());
    return StoreUnavailableLocked(absl::StrCat(info.role() == v1::SERVER ? "server" : "worker", " at ",
                                               info.hostname(), " pid ", info.pid(), " not registered"));
  }
  if (info.role() == v1::SERVER) {
    installed_.erase(info.address());  // a new process: install the map again
    BumpGenerationLocked();
  } else {
    // Only the scheduler has news for a new worker (its first heartbeat is
    // answered at once): waking every node's heartbeat for each worker that
    // registers made a cluster of N workers coming up answer N^2 of them.
    kick_ = true;
  }
  std::vector<std::string> devices;
  for (const auto& d : info.devices()) devices.push_back(absl::StrCat(d.kind(), ":", d.ordinal(), " ", d.name()));
  FLOG(INFO) << "registered " << info.node_id() << " (" << info.hostname() << " pid " << info.pid()
             << (info.role() == v1::SERVER ? absl::StrCat(", parameter service at ", info.address())
                                           : absl::StrCat(", ", info.slots(), " slot(s), devices: ",
                                                          absl::StrJoin(devices, "; ")))
             << ")";
  v1::RegisterNodeResponse r;
  r.set_node_id(info.node_id());
  r.set_heartbeat_interval_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  return r;
}

std::vector<v1::Assignment> Coordinator::AssignmentsOfLocked(const std::string& node_id) const {
  std::vector<v1::Assignment> out;
  for (const auto& [id, r] : jobs_) {
    if (r.job.status().state() != v1::RUNNING) continue;
    for (uint32_t rank = 0; rank < r.ranks.size(); ++rank) {
      const RankSlot& s = r.ranks[rank];
      if (s.node_id != node_id || s.finished) continue;
      v1::Assignment a;
      a.set_job_id(id);
      a.set_rank(rank);
      a.set_world_size(static_cast<uint32_t>(r.ranks.size()));
      a.set_incarnation(s.incarnation);
      *a.mutable_spec() = r.job.spec();
      // batch_size auto, once rank 0 has chosen: every rank trains with it.
      if (a.spec().batch_size() == 0 && r.job.status().batch_size() > 0) {
        a.mutable_spec()->set_batch_size(r.job.status().batch_size());
      }
      if (shard_map_) *a.mutable_shard_map() = *shard_map_;
      out.push_back(std::move(a));
    }
  }
  return out;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& req) {
  std::promise<absl::StatusOr<v1::HeartbeatResponse>> answer;
  auto got = answer.get_future();
  HeartbeatAsync(req, [&answer](absl::StatusOr<v1::HeartbeatResponse> r) { answer.set_value(std::move(r)); });
  return got.get();
}

uint64_t Coordinator::HeartbeatAsync(const v1::HeartbeatRequest& req, HeartbeatCallback done) {
  absl::MutexLock lock(&mu_);
  absl::Status refused;
  auto it = nodes_.find(req.node_id());
  if (it == nodes_.end()) {
    refused = absl::NotFoundError(absl::StrCat("node '", req.node_id(), "' is not registered; register again"));
  } else if (!it->second.alive) {
    // Declared dead (a long pause): its work has moved; it starts over.
    refused = absl::NotFoundError(absl::StrCat("node '", req.node_id(), "' was declared dead; register again"));
  } else {
    it->second.Heard();
  }
  const bool now = !refused.ok() || shutdown_ || req.generation() == 0 || req.generation() != generation_;
  const absl::Duration wait = std::min(absl::Milliseconds(req.wait_ms()), options_.heartbeat_interval);
  auto answer = [this, node_id = req.node_id(), refused, done = std::move(done)]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::StatusOr<v1::HeartbeatResponse> r =
        refused.ok() ? HeartbeatAnswerLocked(node_id) : absl::StatusOr<v1::HeartbeatResponse>(refused);
    return [done, r = std::move(r)]() mutable { done(std::move(r)); };
  };
  return ParkLocked(PollKind::kHeartbeat, "", now, absl::Now() + wait, std::move(answer));
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::HeartbeatAnswerLocked(const std::string& node_id) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end() || !it->second.alive) {
    return absl::NotFoundError(absl::StrCat("node '", node_id, "' was declared dead; register again"));
  }
  // last_heartbeat is not touched again here: the caller may have died
  // during the wait, and a server restarted at its address wakes this call
  // (RegisterNode bumps the generation) just after marking the old entry
  // overdue. Refreshing it then kept a kill -9'd server "alive" for another
  // node_timeout, and its jobs rolled back twice.
  v1::HeartbeatResponse r;
  r.set_generation(generation_);
  if (shard_map_) *r.mutable_shard_map() = *shard_map_;
  if (it->second.info.role() == v1::WORKER) {
    for (v1::Assignment& a : AssignmentsOfLocked(node_id)) *r.add_assignments() = std::move(a);
  } else {
    // The jobs a server may hold: those running (restoring included), with
    // the quota their spec grants.
    r.set_admitted_jobs_set(true);
    for (const auto& [id, job] : jobs_) {
      if (job.job.status().state() != v1::RUNNING) continue;
      v1::AdmittedJob* a = r.add_admitted_jobs();
      a->set_job_id(id);
      a->set_quota_bytes(job.job.spec().quota_bytes());
    }
  }
  return r;
}

absl::StatusOr<v1::ReportProgressResponse> Coordinator::ReportProgress(const v1::ReportProgressRequest& req) {
  RETURN_IF_ERROR(CheckProgressReport(req));
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::ReportProgressResponse> resp = ReportProgressLocked(req);
  // A result (an epoch's summary, the end, an error) is acknowledged once it
  // is saved: until then the worker keeps it and sends it again (applying
  // one twice changes nothing). Periodic progress is saved when it can be.
  if (resp.ok() && config::CarriesResult(req) && !SavedLocked(kJobPrefix + req.job_id())) {
    return StoreUnavailableLocked(absl::StrCat("the report of job '", req.job_id(), "' rank ", req.rank(),
                                               " is applied but not saved"));
  }
  return resp;
}

absl::StatusOr<v1::ReportProgressResponse> Coordinator::ReportProgressLocked(const v1::ReportProgressRequest& req) {
  v1::ReportProgressResponse resp;
  auto it = jobs_.find(req.job_id());
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", req.job_id(), "'"));
  JobRecord& r = it->second;
  if (r.job.status().state() != v1::RUNNING || req.rank() >= r.ranks.size() ||
      r.ranks[req.rank()].node_id != req.node_id() || r.ranks[req.rank()].incarnation != req.incarnation()) {
    resp.set_stop(true);  // cancelled, ended, or the rank moved on
    return resp;
  }
  if (req.has_epoch_done() && req.epoch_done().epoch() >= r.job.spec().epochs()) {
    return absl::InvalidArgumentError(absl::StrCat("epoch_done.epoch ", req.epoch_done().epoch(),
                                                   " is out of range: job '", r.job.id(), "' has ",
                                                   r.job.spec().epochs(), " epochs (0 to ",
                                                   r.job.spec().epochs() - 1, ")"));
  }
  auto node = nodes_.find(req.node_id());
  if (node != nodes_.end()) node->second.Heard();
  // A rank that finished stays finished. Periodic progress sent before the
  // end can arrive after it (a worker sends its results first); taken, it
  // would turn the rank back to "training", and the job would end with the
  // rank "stopped" and one succeeded worker short.
  const bool rank_finished = r.ranks[req.rank()].finished;
  if (rank_finished && !config::CarriesResult(req)) return resp;
  v1::JobStatus* st = r.job.mutable_status();
  v1::WorkerProgress* w = st->mutable_workers(static_cast<int>(req.rank()));
  const std::string prev_state = w->state();
  const uint64_t prev_step = w->step();
  const uint32_t prev_epoch = w->epoch();
  // GPU time: the job's totals grow by what this incarnation of the rank
  // added since its last report (a new incarnation starts from 0).
  const bool same_incarnation = w->incarnation() == req.incarnation();
  const double busy_before = same_incarnation ? w->gpu_busy_seconds() : 0;
  const double idle_before = same_incarnation ? w->gpu_idle_seconds() : 0;
  st->set_gpu_busy_seconds(st->gpu_busy_seconds() + std::max(0.0, req.progress().gpu_busy_seconds() - busy_before));
  st->set_gpu_idle_seconds(st->gpu_idle_seconds() + std::max(0.0, req.progress().gpu_idle_seconds() - idle_before));
  *w = req.progress();
  // A new incarnation loading its data does not know yet where its rank
  // resumes (it reports step 0): the rank stays where it was (its last step,
  // or the cut's after a rollback), so the job's step never drops to 0.
  if (w->state() == "loading" || w->state() == "assigned") {
    w->set_step(std::max(w->step(), prev_step));
    w->set_epoch(std::max(w->epoch(), prev_epoch));
  }
  if (rank_finished) w->set_state("finished");  // a result sent again
  w->set_rank(req.rank());
  w->set_worker_id(req.node_id());
  w->set_incarnation(req.incarnation());
  w->set_updated_unix_ms(NowMs());
  if (req.total_steps() > 0) st->set_total_steps(req.total_steps());
  bool sync = w->state() != prev_state;
  // batch_size auto: rank 0's choice becomes the job's, and every rank's
  // assignment carries it from the next heartbeat on.
  if (req.rank() == 0 && r.job.spec().batch_size_auto().enabled() && r.job.spec().batch_size() == 0 &&
      st->batch_size() == 0 && req.progress().batch_size() > 0) {
    st->set_batch_size(req.progress().batch_size());
    st->set_batch_size_choice(req.progress().batch_size_choice());
    FLOG(INFO) << "job " << r.job.id() << ": batch_size auto chose " << st->batch_size_choice();
    BumpGenerationLocked();
    sync = true;
  }
  // What the workers read, at the job's level: rank 0's, or the first to come.
  if (req.progress().has_train_data() && (req.rank() == 0 || !st->has_train_data())) {
    sync = sync || !st->has_train_data();
    *st->mutable_train_data() = req.progress().train_data();
  }
  if (req.progress().has_test_data() && (req.rank() == 0 || !st->has_test_data())) {
    sync = sync || !st->has_test_data();
    *st->mutable_test_data() = req.progress().test_data();
  }
  if (req.has_epoch_done()) {
    const v1::EpochSummary& e = req.epoch_done();
    v1::EpochSummary* sum = nullptr;
    for (auto& x : *st->mutable_epochs()) {
      if (x.epoch() == e.epoch()) sum = &x;
    }
    if (sum == nullptr) {
      sum = st->add_epochs();
      sum->set_epoch(e.epoch());
    }
    // Train metrics: mean over ranks; speed: their sum; test metrics: rank 0.
    // Each rank counts once (see EpochSummary.reported_ranks). A report of
    // an evaluation only fills in test figures the epoch lacks.
    const bool first = !absl::c_linear_search(sum->reported_ranks(), req.rank());
    if (first && !e.evaluation_only()) {
      sum->add_reported_ranks(req.rank());
      const int k = sum->reported_ranks_size();
      sum->set_train_loss(sum->train_loss() + (e.train_loss() - sum->train_loss()) / k);
      sum->set_train_accuracy(sum->train_accuracy() + (e.train_accuracy() - sum->train_accuracy()) / k);
      sum->set_samples_per_second(sum->samples_per_second() + e.samples_per_second());
      sum->set_seconds(std::max(sum->seconds(), e.seconds()));
    }
    if (req.rank() == 0 && (e.evaluation_only() ? e.tested() && !sum->tested() : first)) {
      sum->set_test_loss(e.test_loss());
      sum->set_test_accuracy(e.test_accuracy());
      sum->set_test_rmse(e.test_rmse());
      sum->set_tested(e.tested());
      st->set_test_loss(e.test_loss());
      st->set_test_accuracy(e.test_accuracy());
      st->set_test_rmse(e.test_rmse());
    }
    sync = true;
  }
  if (!req.weights_fingerprint().empty()) st->set_weights_fingerprint(req.weights_fingerprint());
  // FinishLocked and the end of this function recompute the job's totals.
  if (!req.error().empty()) {
    w->set_state("failed");
    const std::string reason = req.error_reason().empty() ? "WorkerError" : req.error_reason();
    const std::string error = CutMessage(req.error(), kMaxErrorMessage);
    FLOG(WARNING) << "job " << r.job.id() << " rank " << req.rank() << " on " << req.node_id()
                  << " failed: " << error;
    const std::string message = absl::StrCat("rank ", req.rank(), " on ", req.node_id(), ": ", error);
    // Bad data and bad specs fail the same way every time; anything else
    // (a server that lost its state, a crash) rolls back to the last cut.
    // A server that lost the job (ServerLost) does not count against the
    // backoff limit, as when the scheduler finds a server dead.
    if (reason != "BadData" && reason != "BadSpec" &&
        BeginRollbackLocked(r, 0, reason, message, /*counts_as_restart=*/reason != "ServerLost")) {
      resp.set_stop(true);
      return resp;
    }
    FinishLocked(r, v1::FAILED, reason, message);
    return resp;
  }
  if (req.finished()) {
    w->set_state("finished");
    r.ranks[req.rank()].finished = true;
    bool all = true;
    for (const RankSlot& s : r.ranks) all = all && s.finished;
    if (all) {
      // The final weights are cut before the job counts as succeeded (and
      // its tables go), so they can be exported as soon as it has.
      r.final_cut_pending = true;
      r.job.mutable_status()->set_message("all ranks finished; taking the final checkpoint");
      kick_ = true;
    }
    BumpGenerationLocked();
    sync = true;
  }
  RecomputeLocked(r);
  SaveJobLocked(r, sync);
  return resp;
}

v1::ClusterState Coordinator::GetCluster() const {
  absl::MutexLock lock(&mu_);
  v1::ClusterState s;
  s.set_generation(generation_);
  if (shard_map_) *s.mutable_shard_map() = *shard_map_;
  for (const auto& [id, n] : nodes_) {
    v1::NodeStatus* ns = s.add_nodes();
    *ns->mutable_info() = n.info;
    ns->set_alive(n.alive);
    ns->set_last_heartbeat_unix_ms(absl::ToUnixMillis(n.last_heartbeat));
    for (const v1::Assignment& a : AssignmentsOfLocked(id)) {
      ns->add_assignments(absl::StrCat(a.job_id(), "/", a.rank()));
    }
  }
  return s;
}

// ---------------------------------------------------------------- scheduler

std::map<std::string, int> Coordinator::FreeSlotsLocked() const {
  std::map<std::string, int> free;
  for (const auto& [id, n] : nodes_) {
    if (n.alive && n.heard && n.info.role() == v1::WORKER) free[id] = static_cast<int>(n.info.slots());
  }
  for (const auto& [jid, r] : jobs_) {
    if (r.job.status().state() != v1::RUNNING) continue;
    for (const RankSlot& s : r.ranks) {
      if (!s.node_id.empty() && !s.finished && free.count(s.node_id)) --free[s.node_id];
    }
  }
  return free;
}

std::vector<std::string> Coordinator::LiveServersLocked() const {
  std::vector<std::pair<uint64_t, std::string>> v;
  for (const auto& [id, n] : nodes_) {
    if (n.alive && n.info.role() == v1::SERVER) v.emplace_back(Serial(id), n.info.address());
  }
  std::sort(v.begin(), v.end());
  std::vector<std::string> out;
  for (auto& [seq, a] : v) out.push_back(a);
  return out;
}

bool Coordinator::MapListsExactlyLocked(const std::vector<std::string>& servers) const {
  // The same servers in any order: a server restarted at its address keeps
  // its place (and its checkpoints' shards).
  if (!shard_map_) return false;
  std::set<std::string> have(shard_map_->servers().begin(), shard_map_->servers().end());
  return have == std::set<std::string>(servers.begin(), servers.end());
}

bool Coordinator::MapInstalledLocked(const std::vector<std::string>& live) const {
  return MapListsExactlyLocked(live) && std::all_of(live.begin(), live.end(), [&](const std::string& s)
                                                                                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                                                                                    auto it = installed_.find(s);
                                                                                    return it != installed_.end() &&
                                                                                           it->second ==
                                                                                               shard_map_->version();
                                                                                  });
}

bool Coordinator::AnyRunningLocked() const {
  // A job rolling back holds no tables yet: the map may change under it.
  for (const auto& [id, r] : jobs_) {
    if (r.job.status().state() == v1::RUNNING && r.job.status().restoring_cut() == 0) return true;
  }
  return false;
}

void Coordinator::SchedulerLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return shutdown_ || kick_; };
      mu_.AwaitWithTimeout(absl::Condition(&wake), options_.tick);
      if (shutdown_) return;
      kick_ = false;
    }
    Tick();
  }
}

void Coordinator::StallForTesting(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  absl::SleepFor(d);
}

void Coordinator::Tick() {
  absl::MutexLock lock(&mu_);
  // 0. Records a failed write left unsaved are written again.
  RepairStoreLocked();
  const absl::Time now = absl::Now();
  // 1. Liveness. Dead nodes are forgotten after their retention.
  //
  // A scheduler that itself could not run for a while (the lock held by a
  // write stuck on a slow disk, the process or machine paused) cannot tell
  // a node that stopped heartbeating from one whose heartbeats waited
  // behind it: every node then gets a fresh node_timeout instead of being
  // declared dead at once (a 15 s disk stall on a CI machine once failed
  // every job that way).
  const absl::Duration gap = now - last_tick_;
  last_tick_ = now;
  // (Past half a node_timeout, and past five ticks so that a node_timeout
  // shorter than the tick, as in tests, still declares nodes dead.)
  if (gap > std::max(options_.node_timeout / 2, 5 * options_.tick)) {
    size_t spared = 0;
    for (auto& [id, n] : nodes_) {
      if (n.alive && now - n.last_heartbeat >= options_.node_timeout / 2) {
        n.last_heartbeat = now;
        ++spared;
      }
    }
    FLOG(WARNING) << "the coordinator's scheduler did not run for " << absl::FormatDuration(gap)
                  << " (lock held or process paused); " << spared
                  << " node(s) get a fresh node_timeout to heartbeat before any is declared dead";
  }
  const size_t known = nodes_.size();
  std::erase_if(nodes_, [&](const auto& kv) {
    return !kv.second.alive && now - kv.second.dead_since > options_.dead_node_retention;
  });
  if (nodes_.size() != known) BumpGenerationLocked();
  std::erase_if(failing_calls_, [&](const auto& kv) { return now - kv.second.last_failure > absl::Minutes(10); });
  for (auto& [id, n] : nodes_) {
    if (!n.alive || now - n.last_heartbeat < options_.node_timeout) continue;
    n.alive = false;
    n.dead_since = now;
    WriteKeyLocked(kNodePrefix + id, false);  // deletes it (ValueOfLocked)
    BumpGenerationLocked();
    FLOG(WARNING) << id << " missed heartbeats for " << absl::FormatDuration(now - n.last_heartbeat)
                  << ": declared dead";
    for (auto& [jid, r] : jobs_) {
      if (r.job.status().state() != v1::RUNNING) continue;
      if (n.info.role() == v1::SERVER) {
        if (r.job.status().restoring_cut() == 0 && shard_map_ &&
            std::count(shard_map_->servers().begin(), shard_map_->servers().end(), n.info.address())) {
          const std::string why = absl::StrCat("parameter server ", id, " at ", n.info.address(),
                                               " stopped; its shards of this job are lost");
          if (!BeginRollbackLocked(r, 0, "ServerLost", why, false)) {
            FinishLocked(r, v1::FAILED, "ServerLost", absl::StrCat(why, " (and the job has no checkpoint)"));
          }
        }
        continue;
      }
      for (uint32_t rank = 0; rank < r.ranks.size(); ++rank) {
        RankSlot& s = r.ranks[rank];
        if (s.node_id != id || s.finished) continue;
        s.node_id.clear();
        r.job.mutable_status()->mutable_workers(static_cast<int>(rank))->set_state("lost");
        if (CountFailureLocked(r, absl::StrCat("worker ", id, " (rank ", rank, ") lost"))) break;
        SetStateLocked(r, v1::RUNNING, "Restarting", "WorkerLost",
                       absl::StrCat("worker ", id, " running rank ", rank,
                                    " stopped heartbeating; its rank moves to another worker"));
        SaveJobLocked(r, true);
      }
    }
  }
  // 2. Active deadlines and TTLs.
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    JobRecord& r = it->second;
    const uint32_t deadline = r.job.spec().run_policy().active_deadline_seconds();
    if (r.job.status().state() == v1::RUNNING && deadline > 0 && r.started != absl::InfinitePast() &&
        now - r.started > absl::Seconds(deadline)) {
      FinishLocked(r, v1::FAILED, "DeadlineExceeded",
                   absl::StrCat("the job ran longer than activeDeadlineSeconds (", deadline, " s)"));
    }
    const uint32_t ttl = r.job.spec().run_policy().ttl_seconds_after_finished();
    if (config::JobEnded(r.job.status().state()) && ttl > 0 && !r.release_pending &&
        NowMs() - r.job.status().end_time_unix_ms() > int64_t{ttl} * 1000) {
      std::vector<std::pair<uint64_t, std::vector<std::string>>> cuts;
      for (const v1::CheckpointInfo& c : r.job.status().checkpoints()) {
        cuts.emplace_back(c.cut_id(), std::vector<std::string>(c.servers().begin(), c.servers().end()));
      }
      if (!cuts.empty()) {
        Spawn([this, jid = r.job.id(), cuts = std::move(cuts)] { DeleteCuts(jid, cuts); });
      }
      FLOG(INFO) << "job " << r.job.id() << " forgotten " << ttl << " s after it ended (ttlSecondsAfterFinished)";
      const std::string key = kJobPrefix + r.job.id();
      const std::string forgotten = r.job.id();
      it = jobs_.erase(it);
      WakeJobLocked(forgotten);  // its watchers learn it is gone
      WriteKeyLocked(key, false);  // deletes it (ValueOfLocked)
      continue;
    }
    ++it;
  }
  // 3. The shard map follows the live servers while no job runs.
  const std::vector<std::string> live = LiveServersLocked();
  const bool running = AnyRunningLocked();
  if (!live.empty() && !running &&
      !MapListsExactlyLocked(live)) {
    auto m = ShardMap::RoundRobin(shard_map_ ? shard_map_->version() + 1 : 1,
                                  shard_map_ ? shard_map_->num_virtual_shards() : options_.virtual_shards, live);
    if (m.ok()) {
      shard_map_ = m->ToProto();
      installed_.clear();
      SaveMetaLocked();
      BumpGenerationLocked();
      FLOG(INFO) << "shard map version " << shard_map_->version() << ": " << shard_map_->num_virtual_shards()
                 << " virtual shards over " << absl::StrJoin(live, ", ");
    }
  }
  if (shard_map_ && !install_in_flight_) {
    std::vector<std::string> to_install;
    for (const std::string& s : shard_map_->servers()) {
      auto inst = installed_.find(s);
      if ((inst == installed_.end() || inst->second != shard_map_->version()) &&
          std::count(live.begin(), live.end(), s)) {
        to_install.push_back(s);
      }
    }
    if (!to_install.empty()) {
      install_in_flight_ = true;
      Spawn([this, map = *shard_map_, to_install] { InstallOnServers(map, to_install); });
    }
  }
  // 4. Releases of finished jobs.
  for (auto& [jid, r] : jobs_) {
    if (!r.release_pending || r.release_in_flight || r.final_cut_pending || r.cut_in_flight ||
        r.restore_in_flight || !shard_map_) {
      continue;
    }
    r.release_in_flight = true;
    Spawn([this, jid = jid, servers = std::vector<std::string>(shard_map_->servers().begin(),
                                                               shard_map_->servers().end())] {
      ReleaseOnServers(jid, servers);
    });
  }
  // 5. Reassign lost ranks, then start pending jobs, in submission order.
  std::vector<JobRecord*> order;
  for (auto& [jid, r] : jobs_) order.push_back(&r);
  std::sort(order.begin(), order.end(),
            [](JobRecord* a, JobRecord* b) { return Serial(a->job.id()) < Serial(b->job.id()); });
  std::map<std::string, int> free = FreeSlotsLocked();
  auto take = [&free](const std::set<std::string>& avoid) -> std::string {
    std::string best;
    int best_free = 0;
    for (const auto& [id, f] : free) {
      if (f > best_free && !avoid.count(id)) {
        best = id;
        best_free = f;
      }
    }
    if (best.empty()) {  // a worker already in the job, if it has room
      for (const auto& [id, f] : free) {
        if (f > best_free) {
          best = id;
          best_free = f;
        }
      }
    }
    if (!best.empty()) --free[best];
    return best;
  };
  for (JobRecord* r : order) {
    // A job rolling back gets its workers once the servers hold the cut.
    if (r->job.status().state() != v1::RUNNING || r->job.status().restoring_cut() != 0) continue;
    std::set<std::string> in_job;
    for (const RankSlot& s : r->ranks) {
      if (!s.node_id.empty()) in_job.insert(s.node_id);
    }
    bool changed = false;
    for (uint32_t rank = 0; rank < r->ranks.size(); ++rank) {
      RankSlot& s = r->ranks[rank];
      if (!s.node_id.empty() || s.finished) continue;
      const std::string node = take(in_job);
      if (node.empty()) {
        r->job.mutable_status()->set_message(absl::StrCat("rank ", rank, " waits for a worker with a free slot"));
        continue;
      }
      s.node_id = node;
      ++s.incarnation;
      in_job.insert(node);
      v1::WorkerProgress* w = r->job.mutable_status()->mutable_workers(static_cast<int>(rank));
      // After a rollback every rank starts again, most on the worker they
      // had: only a rank that moved had its worker replaced.
      const bool moved = !w->worker_id().empty() && w->worker_id() != node;
      w->set_worker_id(node);
      w->set_incarnation(s.incarnation);
      w->set_state("assigned");
      w->set_has_metrics(false);
      FLOG(INFO) << "job " << r->job.id() << ": rank " << rank << (moved ? " moves to " : " starts on ") << node
                 << " (incarnation " << s.incarnation << ")";
      if (moved) {
        SetStateLocked(*r, v1::RUNNING, "Running", "WorkerReplaced", absl::StrCat("rank ", rank, " resumed on ", node));
      } else if (s.incarnation > 1) {
        r->job.mutable_status()->set_message(absl::StrCat("rank ", rank, " resumed on ", node));
      }
      changed = true;
    }
    if (changed) {
      SaveJobLocked(*r, true);
      BumpGenerationLocked();
    }
  }
  const bool map_ready = !live.empty() && live.size() >= options_.min_servers && MapInstalledLocked(live);
  bool blocked = false;  // first-come first-served: a waiting job holds back later ones
  for (JobRecord* r : order) {
    if (r->job.status().state() != v1::PENDING) continue;
    std::string why, reason = "WorkersNotReady";
    const uint32_t need = r->job.spec().num_workers();
    int free_workers = 0;
    for (const auto& [id, f] : free) free_workers += f > 0 ? 1 : 0;
    if (live.size() < std::max<size_t>(1, options_.min_servers)) {
      why = absl::StrCat("waiting for parameter servers: ", live.size(), " of ", std::max<uint32_t>(1, options_.min_servers),
                         " live");
      reason = "ServersNotReady";
    } else if (!map_ready) {
      reason = "ShardMapNotReady";
      if (running) {
        why = "the shard map changes when the running jobs end (a server joined or left)";
      } else {
        why = "installing the shard map on the servers";
        // Say which server does not take it, and why (its address is wrong,
        // a firewall, mismatched TLS), rather than wait without a word.
        for (const std::string& s : live) {
          auto f = failing_calls_.find({kInstallingShardMap, s});
          if (f != failing_calls_.end()) {
            absl::StrAppend(&why, "; ", s, " fails: ", f->second.error);
            break;
          }
        }
      }
    } else if (blocked) {
      why = "an earlier job is waiting for workers";
      reason = "Queued";
    } else if (free_workers < static_cast<int>(need)) {
      int live_workers = 0, unheard = 0;
      for (const auto& [id, n] : nodes_) {
        if (!n.alive || n.info.role() != v1::WORKER) continue;
        ++(n.heard ? live_workers : unheard);
      }
      why = absl::StrCat("needs ", need, " workers with a free slot; ", free_workers, " free of ", live_workers,
                         " live");
      if (unheard > 0) {
        absl::StrAppend(&why, "; ", unheard, " known from before the coordinator restarted, not heard from since");
      }
    }
    if (!why.empty()) {
      blocked = true;
      if (r->job.status().message() != why) {
        r->job.mutable_status()->set_message(why);
        r->job.mutable_status()->set_reason(reason);
        SaveJobLocked(*r, false);
      }
      continue;
    }
    std::set<std::string> used;
    for (uint32_t rank = 0; rank < need; ++rank) {
      const std::string node = take(used);
      used.insert(node);
      r->ranks[rank].node_id = node;
      r->ranks[rank].incarnation = 0;
      v1::WorkerProgress* w = r->job.mutable_status()->mutable_workers(static_cast<int>(rank));
      w->set_worker_id(node);
      w->set_state("assigned");
    }
    r->started = absl::Now();
    r->job.mutable_status()->set_start_time_unix_ms(NowMs());
    SetStateLocked(*r, v1::RUNNING, "Running", "JobRunning",
                   absl::StrCat(need, " workers assigned; shard map version ", shard_map_->version(), " over ",
                                shard_map_->servers_size(), " servers"));
    RecomputeLocked(*r);
    SaveJobLocked(*r, true);
    BumpGenerationLocked();
    FLOG(INFO) << "job " << r->job.id() << " running on " << absl::StrJoin(used, ", ");
  }
  ScheduleCheckpointsLocked();
}

// ---------------------------------------------------------------- checkpoints

namespace {

const v1::CheckpointInfo* FindCut(const v1::JobStatus& st, uint64_t cut_id) {
  if (st.checkpoints_size() == 0) return nullptr;
  if (cut_id == 0) return &*st.checkpoints().rbegin();
  for (const v1::CheckpointInfo& c : st.checkpoints()) {
    if (c.cut_id() == cut_id) return &c;
  }
  return nullptr;
}

std::string CutIds(const v1::JobStatus& st) {
  std::vector<std::string> ids;
  for (const v1::CheckpointInfo& c : st.checkpoints()) ids.push_back(absl::StrCat(c.cut_id()));
  return ids.empty() ? std::string("none") : absl::StrJoin(ids, ", ");
}

// Calls `call` for every server at once, each on its own thread; returns
// the answers in the servers' order.
template <typename Result>
std::vector<Result> CallEachServer(const std::vector<std::string>& servers,
                                   const std::function<Result(const std::string&)>& call) {
  std::vector<Result> results(servers.size(), Result(absl::UnknownError("not asked")));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < servers.size(); ++i) threads.emplace_back([&, i] { results[i] = call(servers[i]); });
  for (std::thread& th : threads) th.join();
  return results;
}

// CallEachServer for cuts and restores. On success *out holds the answers
// in the servers' order; otherwise the first failure, naming its server.
absl::Status OnEachServer(const std::vector<std::string>& servers, std::vector<v1::ShardCutMeta>* out,
                          const std::function<absl::StatusOr<v1::ShardCutMeta>(const std::string&)>& call) {
  std::vector<absl::StatusOr<v1::ShardCutMeta>> results = CallEachServer(servers, call);
  out->clear();
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) {
      return absl::Status(results[i].status().code(),
                          absl::StrCat("server ", servers[i], ": ", results[i].status().message()));
    }
    out->push_back(*std::move(results[i]));
  }
  return absl::OkStatus();
}

// Whether the servers collect the job's steps in order. Local steps with
// no staleness run BSP rounds there.
bool IsBsp(const v1::JobSpec& spec) {
  const auto& c = spec.consistency();
  return c.model() == v1::ConsistencySpec::BSP || c.model() == v1::ConsistencySpec::MODEL_UNSPECIFIED ||
         (c.model() == v1::ConsistencySpec::LOCAL && c.staleness() == 0);
}

// Local steps: the servers' clock counts rounds of sync_every_steps, and
// each epoch ends one (worker/training/trainer.h). The rounds a rank has
// completed after `step` inner steps, and the inner steps a clock of
// `rounds` stands for; both the identity for other models.
uint64_t RoundsOfSteps(const v1::JobSpec& spec, uint64_t steps_per_epoch, uint64_t step) {
  const auto& c = spec.consistency();
  if (c.model() != v1::ConsistencySpec::LOCAL || c.sync_every_steps() == 0 || steps_per_epoch == 0) return step;
  const uint64_t h = c.sync_every_steps(), per_epoch = (steps_per_epoch + h - 1) / h;
  const uint64_t in_epoch = step % steps_per_epoch;
  return step / steps_per_epoch * per_epoch + in_epoch / h;
}
uint64_t StepsOfRounds(const v1::JobSpec& spec, uint64_t steps_per_epoch, uint64_t rounds) {
  const auto& c = spec.consistency();
  if (c.model() != v1::ConsistencySpec::LOCAL || c.sync_every_steps() == 0 || steps_per_epoch == 0) return rounds;
  const uint64_t h = c.sync_every_steps(), per_epoch = (steps_per_epoch + h - 1) / h;
  return rounds / per_epoch * steps_per_epoch + std::min(steps_per_epoch, rounds % per_epoch * h);
}

}  // namespace

void Coordinator::SucceedLocked(JobRecord& r, const std::string& note) {
  const v1::JobStatus& s = r.job.status();
  const std::string accuracy = absl::StrCat(s.test_accuracy());
  FinishLocked(r, v1::SUCCEEDED, "JobSucceeded",
               absl::StrCat("all ", r.ranks.size(), " ranks finished; test accuracy ", accuracy, note));
  FLOG(INFO) << "job " << r.job.id() << " succeeded: test accuracy " << accuracy << ", " << s.step()
             << " steps per rank" << note;
}

bool Coordinator::CountFailureLocked(JobRecord& r, const std::string& message) {
  v1::JobStatus* st = r.job.mutable_status();
  st->set_restarts(st->restarts() + 1);
  ++reassignments_;
  // Progress since the last failure starts the count again.
  if (st->failures_in_a_row() > 0 && st->step() > st->step_at_last_failure()) st->set_failures_in_a_row(0);
  st->set_failures_in_a_row(st->failures_in_a_row() + 1);
  st->set_step_at_last_failure(std::max(st->step_at_last_failure(), st->step()));
  const uint32_t limit =
      r.job.spec().run_policy().backoff_limit() == 0 ? 6 : r.job.spec().run_policy().backoff_limit();
  if (st->failures_in_a_row() <= limit) return false;
  FinishLocked(r, v1::FAILED, "BackoffLimitExceeded",
               absl::StrCat(message, "; ", st->failures_in_a_row(), " failures in a row without progress (stuck at "
                            "step ", st->step_at_last_failure(), ") exceed the backoff limit of ", limit));
  return true;
}

bool Coordinator::BeginRollbackLocked(JobRecord& r, uint64_t cut_id, const std::string& reason,
                                      const std::string& message, bool counts_as_restart) {
  v1::JobStatus* st = r.job.mutable_status();
  const v1::CheckpointInfo* cut = FindCut(*st, cut_id);
  if (cut == nullptr) return false;
  const uint64_t id = cut->cut_id(), step = cut->step();
  if (counts_as_restart && CountFailureLocked(r, message)) return true;
  st->set_restoring_cut(id);
  st->set_rollbacks(st->rollbacks() + 1);
  st->set_end_time_unix_ms(0);
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    r.ranks[i].node_id.clear();
    r.ranks[i].finished = false;
    st->mutable_workers(static_cast<int>(i))->set_state("restoring");
  }
  r.final_cut_pending = false;
  r.restore_since = absl::Now();
  if (r.started == absl::InfinitePast()) r.started = absl::Now();
  SetStateLocked(r, v1::RUNNING, "Restarting", reason,
                 absl::StrCat(message, "; rolling back to checkpoint ", id, " (step ", step, ")"));
  RecomputeLocked(r);
  SaveJobLocked(r, true);
  BumpGenerationLocked();
  FLOG(WARNING) << "job " << r.job.id() << ": " << message << "; rolling back to checkpoint " << id << " (step "
                << step << ")";
  return true;
}

void Coordinator::ScheduleCheckpointsLocked() {
  if (!shard_map_ || shutdown_) return;
  const std::vector<std::string> live = LiveServersLocked();
  const std::set<std::string> live_set(live.begin(), live.end());
  const bool map_ready = MapInstalledLocked(live);
  const absl::Time now = absl::Now();
  for (auto& [jid, r] : jobs_) {
    if (r.job.status().state() == v1::RUNNING && r.job.status().restoring_cut() != 0) {
      MaybeStartRestoreLocked(jid, r, live_set, map_ready, now);
    } else if (map_ready && !r.cut_in_flight) {
      MaybeStartCutLocked(jid, r, now);
    }
  }
}

void Coordinator::MaybeStartRestoreLocked(const std::string& jid, JobRecord& r, const std::set<std::string>& live,
                                          bool map_ready, absl::Time now) {
  if (r.restore_in_flight || r.release_pending) return;
  v1::JobStatus* st = r.job.mutable_status();
  const v1::CheckpointInfo* cut = FindCut(*st, st->restoring_cut());
  if (cut == nullptr) {
    FinishLocked(r, v1::FAILED, "CheckpointLost",
                 absl::StrCat("checkpoint ", st->restoring_cut(), " is no longer recorded"));
    return;
  }
  // Restore once every server holding the cut is back and the map is in place.
  std::vector<std::string> missing;
  for (const std::string& s : cut->servers()) {
    if (!live.count(s)) missing.push_back(s);
  }
  if (!missing.empty() || !map_ready) {
    if (now - r.restore_since > options_.restore_timeout) {
      FinishLocked(r, v1::FAILED, "ServerLost",
                   absl::StrCat("checkpoint ", cut->cut_id(), " has parts on ", absl::StrJoin(missing, ", "),
                                ", not back after ", absl::FormatDuration(options_.restore_timeout)));
      return;
    }
    const std::string why =
        missing.empty() ? absl::StrCat("installing the shard map before restoring checkpoint ", cut->cut_id())
                        : absl::StrCat("waiting for ", absl::StrJoin(missing, ", "),
                                       " to come back: it holds part of checkpoint ", cut->cut_id());
    if (st->message() != why) {
      st->set_message(why);
      SaveJobLocked(r, false);
    }
    return;
  }
  RestoreTask t;
  t.job_id = jid;
  t.cut = *cut;
  t.targets.assign(shard_map_->servers().begin(), shard_map_->servers().end());
  for (const RankSlot& s : r.ranks) t.min_incarnation = std::max(t.min_incarnation, s.incarnation);
  ++t.min_incarnation;
  r.restore_in_flight = true;
  FLOG(INFO) << "job " << jid << ": restoring checkpoint " << cut->cut_id() << " (step " << cut->step()
             << ", written by " << absl::StrJoin(cut->servers(), ", ") << ") onto " << absl::StrJoin(t.targets, ", ");
  Spawn([this, t = std::move(t)]() mutable { RunRestore(std::move(t)); });
}

void Coordinator::MaybeStartCutLocked(const std::string& jid, JobRecord& r, absl::Time now) {
  v1::JobStatus* st = r.job.mutable_status();
  if (st->state() != v1::RUNNING || r.ranks.empty()) return;
  const bool final = r.final_cut_pending;
  if (!final && now < r.cut_backoff_until && r.manual_requested == r.manual_served) return;
  const v1::JobSpec& spec = r.job.spec();
  const v1::CheckpointPolicy& policy = spec.checkpoint();
  uint64_t cur = 0;
  for (const v1::WorkerProgress& w : st->workers()) cur = std::max<uint64_t>(cur, w.step());
  const double rate = st->samples_per_second() / std::max(1u, spec.num_workers()) / std::max(1u, std::max(spec.batch_size(), st->batch_size()));
  // Progress reports lag up to 0.5 s: ask for a step about a second ahead.
  const uint64_t lead = static_cast<uint64_t>(std::ceil(rate)) + 2 + r.extra_lead;
  const uint64_t last_step = st->checkpoints_size() > 0 ? st->checkpoints().rbegin()->step() : 0;
  CutTask t;
  if (final) {
    if (st->total_steps() == 0) {
      SucceedLocked(r, "");
      return;
    }
    t.trigger = "final";
    t.at_step = st->total_steps();
  } else if (r.manual_requested > r.manual_served) {
    t.trigger = "manual";
    t.manual_ticket = r.manual_requested;
    t.at_step = cur + lead;
  } else if (st->checkpoints_size() == 0 && !r.first_cut_failed && cur > 0) {
    // A cut soon after training starts, whatever the policy: a server lost
    // before the first periodic cut then costs a rollback, not the job.
    t.trigger = "first";
    t.at_step = cur + lead;
  } else if (policy.every_steps() > 0 && cur > 0) {
    const uint64_t n = policy.every_steps();
    if (IsBsp(spec)) {
      // BSP cuts name a step ahead, which the servers wait for.
      const uint64_t next = (last_step / n + 1) * n;
      if (cur + 2 * lead < next) return;
      t.at_step = next >= cur + lead ? next : (cur + lead + n - 1) / n * n;
    } else {
      // SSP/ASP cuts are taken when asked: ask once the fastest rank has
      // crossed the next boundary, once per boundary.
      const uint64_t next = (std::max(last_step, r.steps_boundary_asked) / n + 1) * n;
      if (cur < next) return;
      r.steps_boundary_asked = cur / n * n;
    }
    t.trigger = "steps";
  } else if (policy.every_seconds() > 0 &&
             now - std::max(r.last_cut, r.started) >= absl::Seconds(policy.every_seconds())) {
    t.trigger = "seconds";
    t.at_step = cur + lead;
  } else {
    return;
  }
  if (!IsBsp(spec)) {
    t.at_step = 0;  // SSP/ASP cuts are taken when asked
  } else if (!final && st->total_steps() > 0 && t.at_step >= st->total_steps()) {
    return;  // the final cut covers the end
  }
  const uint64_t spe = spec.epochs() > 0 ? st->total_steps() / spec.epochs() : 0;
  if (t.at_step > 0 && spec.consistency().model() == v1::ConsistencySpec::LOCAL) {
    // The servers count rounds: name the first round that ends at or after
    // the step (the final cut: every round).
    const uint64_t rounds = RoundsOfSteps(spec, spe, t.at_step);
    t.at_step = StepsOfRounds(spec, spe, rounds) < t.at_step ? rounds + 1 : rounds;
  }
  // No cut while state cannot be saved: a cut id is never used twice.
  if (!unsaved_.empty()) return;
  t.job_id = jid;
  t.cut_id = st->next_cut_id() == 0 ? 1 : st->next_cut_id();
  st->set_next_cut_id(t.cut_id + 1);
  t.servers.assign(shard_map_->servers().begin(), shard_map_->servers().end());
  t.map_version = shard_map_->version();
  t.steps_per_epoch = spe;
  t.spec = spec;
  t.rollbacks = st->rollbacks();
  SaveJobLocked(r, true);
  if (!SavedLocked(kJobPrefix + jid)) return;
  r.cut_in_flight = true;
  Spawn([this, t = std::move(t)]() mutable { RunCut(std::move(t)); });
}

v1::CheckpointInfo Coordinator::CommittedCut(const CutTask& t, const std::vector<v1::ShardCutMeta>& metas) {
  v1::CheckpointInfo info;
  info.set_cut_id(t.cut_id);
  info.set_trigger(t.trigger);
  info.set_shard_map_version(t.map_version);
  info.set_created_unix_ms(NowMs());
  for (const std::string& s : t.servers) info.add_servers(s);
  uint64_t step = UINT64_MAX;
  std::vector<uint64_t> clocks;  // per rank, the lowest over the servers
  for (const auto& m : metas) {
    step = std::min(step, m.step());
    info.set_bytes(info.bytes() + m.bytes());
    info.set_pause_seconds(std::max(info.pause_seconds(), m.capture_seconds()));
    info.set_write_seconds(std::max(info.write_seconds(), m.write_seconds()));
    if (clocks.empty()) clocks.assign(m.rank_clock().begin(), m.rank_clock().end());
    for (size_t k = 0; k < clocks.size() && k < static_cast<size_t>(m.rank_clock_size()); ++k) {
      clocks[k] = std::min(clocks[k], m.rank_clock(static_cast<int>(k)));
    }
  }
  info.set_step(StepsOfRounds(t.spec, t.steps_per_epoch, step));
  for (size_t k = 0; k < clocks.size(); ++k) {
    v1::RankPosition* p = info.add_positions();
    p->set_rank(static_cast<uint32_t>(k));
    // Under local steps the servers' clock counts rounds: positions are in
    // the ranks' steps.
    const uint64_t rank_step = StepsOfRounds(t.spec, t.steps_per_epoch, clocks[k]);
    p->set_step(rank_step);
    if (t.steps_per_epoch > 0) {
      p->set_epoch(static_cast<uint32_t>(rank_step / t.steps_per_epoch));
      p->set_batch(rank_step % t.steps_per_epoch);
    }
  }
  return info;
}

void Coordinator::RunCut(CutTask t) {
  const absl::Time t0 = absl::Now();
  std::vector<v1::ShardCutMeta> metas;
  absl::Status failed = OnEachServer(t.servers, &metas, [&](const std::string& server) {
    return servers_->Checkpoint(server, t.job_id, t.cut_id, t.at_step, options_.checkpoint_wait);
  });
  std::vector<std::pair<uint64_t, std::vector<std::string>>> to_delete;
  std::set<uint64_t> kept;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(t.job_id);
    if (it == jobs_.end()) {
      to_delete.emplace_back(t.cut_id, t.servers);
    } else {
      JobRecord& r = it->second;
      v1::JobStatus* st = r.job.mutable_status();
      r.cut_in_flight = false;
      const bool current = st->state() == v1::RUNNING && st->restoring_cut() == 0 &&
                           (t.trigger != "final" || r.final_cut_pending);
      if (failed.ok() && !current) failed = absl::AbortedError("the job changed state while the cut was taken");
      // Parts captured on both sides of a rollback would mix two histories
      // of the job: a cut commits only if no rollback began while it ran.
      if (failed.ok() && st->rollbacks() != t.rollbacks) {
        failed = absl::AbortedError("the job rolled back while the cut was taken");
      }
      if (failed.ok() && (!shard_map_ || shard_map_->version() != t.map_version)) {
        failed = absl::AbortedError("the shard map changed while the cut was taken");
      }
      v1::CheckpointInfo info;
      const bool too_late = failed.code() == absl::StatusCode::kFailedPrecondition &&
                            absl::StrContains(failed.message(), "too late");
      if (failed.ok()) {
        info = CommittedCut(t, metas);
        *st->add_checkpoints() = info;
        const uint32_t keep = r.job.spec().checkpoint().keep() == 0 ? 3 : r.job.spec().checkpoint().keep();
        while (static_cast<uint32_t>(st->checkpoints_size()) > keep) {
          const v1::CheckpointInfo& old = st->checkpoints(0);
          to_delete.emplace_back(old.cut_id(), std::vector<std::string>(old.servers().begin(), old.servers().end()));
          st->mutable_checkpoints()->DeleteSubrange(0, 1);
        }
        for (const v1::CheckpointInfo& c : st->checkpoints()) kept.insert(c.cut_id());
        st->clear_last_checkpoint_error();
        r.last_cut = absl::Now();
        SaveJobLocked(r, true);
        FLOG(INFO) << "job " << t.job_id << ": checkpoint " << t.cut_id << " committed (" << t.trigger << ", step "
                   << info.step() << ", " << info.bytes() << " bytes on " << t.servers.size() << " servers, pause "
                   << info.pause_seconds() << " s, " << absl::FormatDuration(absl::Now() - t0) << " in all)";
      } else if (too_late) {
        // The step went by before a server was asked: ask again at once,
        // further ahead (a manual request stays pending).
        r.extra_lead = std::max<uint64_t>(16, r.extra_lead * 2);
        to_delete.emplace_back(t.cut_id, t.servers);
        FLOG(INFO) << "job " << t.job_id << ": checkpoint " << t.cut_id << " at step " << t.at_step
                   << " came too late; asking again " << r.extra_lead << " steps further ahead";
      } else {
        st->set_last_checkpoint_error(absl::StrCat("checkpoint ", t.cut_id, ": ", failed.message()));
        r.cut_backoff_until = absl::Now() + absl::Seconds(5);
        if (t.trigger == "first") r.first_cut_failed = true;
        SaveJobLocked(r, false);
        to_delete.emplace_back(t.cut_id, t.servers);
        FLOG(WARNING) << "job " << t.job_id << ": checkpoint " << t.cut_id << " (" << t.trigger << ") failed: " << failed;
      }
      // A manual cut answers the requests made before it; the final cut
      // answers every one still waiting.
      const uint64_t answers = t.trigger == "final" ? r.manual_requested : t.manual_ticket;
      if (!too_late && answers > r.manual_served) {
        r.manual_served = answers;
        if (failed.ok()) {
          r.manual_result = info;
        } else {
          r.manual_result = failed;
        }
      }
      if (t.trigger == "final" && r.final_cut_pending && st->state() == v1::RUNNING && st->restoring_cut() == 0) {
        SucceedLocked(r, failed.ok() ? absl::StrCat("; final checkpoint ", t.cut_id)
                                     : absl::StrCat("; no final checkpoint (", failed.message(), ")"));
      }
      // Its waiters learn the answer (a cut that came too late saves nothing).
      WakeJobLocked(t.job_id);
    }
  }
  DeleteCuts(t.job_id, to_delete);
  if (!failed.ok()) return;
  if (t.trigger == "final") return;  // the job's tables are being released
  // Parts of cuts this coordinator never committed (it stopped mid-cut, or
  // a server failed one) are deleted once a later cut commits.
  for (const std::string& s : t.servers) {
    absl::StatusOr<std::vector<v1::ShardCutMeta>> cuts = servers_->ListCuts(s, t.job_id);
    if (!cuts.ok()) continue;
    for (const v1::ShardCutMeta& m : *cuts) {
      if (m.cut_id() < t.cut_id && !kept.count(m.cut_id())) (void)servers_->DeleteCut(s, t.job_id, m.cut_id());
    }
  }
}

void Coordinator::RunRestore(RestoreTask t) {
  const absl::Time t0 = absl::Now();
  const std::vector<std::string> sources(t.cut.servers().begin(), t.cut.servers().end());
  std::vector<v1::ShardCutMeta> results;
  const absl::Status failed = OnEachServer(t.targets, &results, [&](const std::string& server) {
    return servers_->Restore(server, t.job_id, t.cut.cut_id(), sources, t.min_incarnation);
  });
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(t.job_id);
  if (it == jobs_.end()) return;
  JobRecord& r = it->second;
  r.restore_in_flight = false;
  v1::JobStatus* st = r.job.mutable_status();
  if (st->state() != v1::RUNNING || st->restoring_cut() != t.cut.cut_id()) return;  // superseded
  if (!failed.ok()) {
    st->set_last_checkpoint_error(absl::StrCat("restoring checkpoint ", t.cut.cut_id(), ": ", failed.message()));
    FLOG(WARNING) << "job " << t.job_id << ": restoring checkpoint " << t.cut.cut_id() << " failed: " << failed;
    if (failed.code() == absl::StatusCode::kNotFound || failed.code() == absl::StatusCode::kDataLoss) {
      // That cut is gone or damaged: fall back to the one before it.
      auto* cps = st->mutable_checkpoints();
      for (int i = 0; i < cps->size(); ++i) {
        if (cps->Get(i).cut_id() == t.cut.cut_id()) {
          cps->DeleteSubrange(i, 1);
          break;
        }
      }
      if (cps->empty()) {
        FinishLocked(r, v1::FAILED, "CheckpointLost",
                     absl::StrCat("no usable checkpoint left: ", failed.message()));
        return;
      }
      st->set_restoring_cut(cps->rbegin()->cut_id());
    } else if (absl::Now() - r.restore_since > options_.restore_timeout) {
      // Retried at every tick until then; a failure that persists (a server
      // that cannot hold the job, a source that never answers) must end the
      // job with its cause, not leave it restoring for ever.
      FinishLocked(r, v1::FAILED, "RestoreFailed",
                   absl::StrCat("restoring checkpoint ", t.cut.cut_id(), " still failed after ",
                                absl::FormatDuration(options_.restore_timeout), ": ", failed.message()));
      return;
    }
    SaveJobLocked(r, true);
    return;
  }
  // Every server holds the cut: the ranks start again from it, as new
  // incarnations (the servers refuse the old ones).
  st->set_restoring_cut(0);
  uint32_t min_epoch = UINT32_MAX;
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    r.ranks[i].node_id.clear();
    r.ranks[i].finished = false;
    r.ranks[i].incarnation = t.min_incarnation - 1;  // the reassignment bumps it to min_incarnation
    v1::WorkerProgress* w = st->mutable_workers(static_cast<int>(i));
    w->set_state("restored");
    if (i < static_cast<size_t>(t.cut.positions_size())) {
      w->set_step(t.cut.positions(static_cast<int>(i)).step());
      w->set_epoch(t.cut.positions(static_cast<int>(i)).epoch());
      min_epoch = std::min(min_epoch, w->epoch());
    }
  }
  // Epochs from the cut's on will be trained (and reported) again.
  auto* epochs = st->mutable_epochs();
  for (int i = epochs->size() - 1; i >= 0; --i) {
    if (epochs->Get(i).epoch() >= min_epoch) {
      epochs->DeleteSubrange(i, 1);
    }
  }
  st->clear_weights_fingerprint();
  SetStateLocked(r, v1::RUNNING, "Running", "CheckpointRestored",
                 absl::StrCat("restored checkpoint ", t.cut.cut_id(), " (step ", t.cut.step(), ") onto ",
                              t.targets.size(), " servers in ", absl::FormatDuration(absl::Now() - t0),
                              "; workers resume there"));
  RecomputeLocked(r);
  SaveJobLocked(r, true);
  BumpGenerationLocked();
  FLOG(INFO) << "job " << t.job_id << ": checkpoint " << t.cut.cut_id() << " restored onto " << t.targets.size()
             << " servers in " << absl::FormatDuration(absl::Now() - t0);
}

void Coordinator::InstallOnServers(const v1::ShardMap& map, const std::vector<std::string>& servers) {
  const std::vector<absl::Status> results = CallEachServer<absl::Status>(
      servers, [&](const std::string& s) { return servers_->InstallShardMap(s, map); });
  absl::MutexLock lock(&mu_);
  install_in_flight_ = false;
  // A map replaced meanwhile is no longer wanted: a server that refused it
  // for having the newer one (from its heartbeat) did right.
  if (!shard_map_ || shard_map_->version() != map.version()) return;
  for (size_t i = 0; i < servers.size(); ++i) {
    NoteRetriedCallLocked("install_shard_map", kInstallingShardMap, servers[i], results[i]);
    if (results[i].ok()) {
      installed_[servers[i]] = map.version();
      kick_ = true;  // pending jobs may start now (failures wait for the next tick)
    }
  }
}

void Coordinator::NoteRetriedCallLocked(const char* call, const std::string& what, const std::string& server,
                                        const absl::Status& s) {
  const auto key = std::make_pair(what, server);
  auto it = failing_calls_.find(key);
  const absl::Time now = absl::Now();
  if (s.ok()) {
    if (it != failing_calls_.end()) {
      FLOG(INFO) << what << " on " << server << " worked after " << it->second.failures << " failed tries over "
                 << absl::FormatDuration(absl::Trunc(now - it->second.first_failure, absl::Milliseconds(1)));
      failing_calls_.erase(it);
    }
    return;
  }
  ++call_failures_[call];
  RetriedCall& f = failing_calls_[key];
  if (f.failures++ == 0) f.first_failure = now;
  f.last_failure = now;
  f.error = s.ToString();
  if (f.failures == 1 || now - f.last_logged >= absl::Minutes(1)) {
    FLOG(WARNING) << what << " on " << server << " failed: " << f.error << " (" << f.failures
                  << (f.failures == 1 ? " failure" : " failures in a row")
                  << "; retried every tick, logged once a minute)";
    f.last_logged = now;
  }
}

void Coordinator::ReleaseOnServers(const std::string& job_id, const std::vector<std::string>& servers) {
  const std::vector<absl::Status> results = CallEachServer<absl::Status>(
      servers, [&](const std::string& s) { return servers_->DeleteJob(s, job_id); });
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  it->second.release_in_flight = false;
  bool all = true;
  for (size_t i = 0; i < servers.size(); ++i) {
    NoteRetriedCallLocked("delete_job", absl::StrCat("releasing job ", job_id), servers[i], results[i]);
    all = all && results[i].ok();
  }
  if (all && it->second.release_pending) {
    it->second.release_pending = false;
    FLOG(INFO) << "job " << job_id << " released: tables dropped on every server";
  }
}

void Coordinator::DeleteCuts(const std::string& job_id,
                             const std::vector<std::pair<uint64_t, std::vector<std::string>>>& cuts) {
  for (const auto& [cut, servers] : cuts) {
    for (const std::string& s : servers) {
      absl::Status st = servers_->DeleteCut(s, job_id, cut);
      if (!st.ok()) FLOG(WARNING) << "deleting checkpoint " << cut << " of job " << job_id << " on " << s << ": " << st;
    }
  }
}

uint64_t Coordinator::CheckpointJobAsync(const std::string& job_id, absl::Duration timeout,
                                         CheckpointCallback done) {
  absl::MutexLock lock(&mu_);
  auto at_once = [&](absl::Status refused) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ParkLocked(PollKind::kCheckpoint, job_id, true, absl::InfinitePast(),
                      [refused, done = std::move(done)]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                        return std::function<void()>([done, refused] { done(refused); });
                      });
  };
  if (shutdown_) return at_once(absl::UnavailableError("coordinator is shutting down"));
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return at_once(absl::NotFoundError(absl::StrCat("no job '", job_id, "'")));
  const v1::JobStatus& st = it->second.job.status();
  if (st.state() != v1::RUNNING) {
    return at_once(absl::FailedPreconditionError(
        absl::StrCat("job '", job_id, "' is ", v1::JobState_Name(st.state()),
                     "; only a running job can be checkpointed (its checkpoints: ", CutIds(st), ")")));
  }
  const uint64_t ticket = ++it->second.manual_requested;
  kick_ = true;
  const absl::Time deadline = absl::Now() + timeout;
  auto answer = [this, job_id, ticket, timeout, deadline, done = std::move(done)]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> std::function<void()> {
    absl::StatusOr<v1::CheckpointInfo> r;
    auto j = jobs_.find(job_id);
    if (shutdown_) {
      r = absl::UnavailableError("coordinator is shutting down");
    } else if (j == jobs_.end()) {
      r = absl::NotFoundError(absl::StrCat("job '", job_id, "' was deleted"));
    } else if (j->second.manual_served >= ticket) {
      r = j->second.manual_result;
    } else if (config::JobEnded(j->second.job.status().state()) && !j->second.final_cut_pending &&
               !j->second.cut_in_flight) {
      r = absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' ended before the checkpoint was taken"));
    } else if (absl::Now() >= deadline) {
      r = absl::DeadlineExceededError(absl::StrCat(
          "checkpoint of job '", job_id, "' not committed within ", absl::FormatDuration(timeout),
          unsaved_.empty() ? std::string() : absl::StrCat("; ", StoreTroubleLocked(), ", and starts no cut until it can")));
    } else {
      return nullptr;  // not yet
    }
    return [done, r = std::move(r)]() mutable { done(std::move(r)); };
  };
  return ParkLocked(PollKind::kCheckpoint, job_id, false, deadline, std::move(answer));
}

absl::StatusOr<v1::Job> Coordinator::RestoreJob(const std::string& job_id, uint64_t cut_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  JobRecord& r = it->second;
  const v1::JobStatus& st = r.job.status();
  if (FindCut(st, cut_id) == nullptr) {
    return absl::NotFoundError(absl::StrCat("job '", job_id, "' has no committed checkpoint",
                                            cut_id == 0 ? std::string() : absl::StrCat(" ", cut_id),
                                            " (its checkpoints: ", CutIds(st), ")"));
  }
  if (st.state() == v1::PENDING) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' has not started"));
  }
  auto restore = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (config::JobEnded(r.job.status().state())) r.started = absl::Now();
    BeginRollbackLocked(r, cut_id, "RestoreRequested", "restore requested", false);
  };
  RETURN_IF_ERROR(ChangeJobLocked(r, absl::StrCat("job '", job_id, "' was not restored"), restore));
  kick_ = true;
  return r.job;
}

absl::Status Coordinator::ExportCheckpoint(const std::string& job_id, uint64_t cut_id,
                                           const std::function<bool(const v1::ExportCheckpointChunk&)>& write) {
  v1::CheckpointInfo info;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
    const v1::CheckpointInfo* cut = FindCut(it->second.job.status(), cut_id);
    if (cut == nullptr) {
      return absl::NotFoundError(absl::StrCat("job '", job_id, "' has no committed checkpoint",
                                              cut_id == 0 ? std::string() : absl::StrCat(" ", cut_id),
                                              " (its checkpoints: ", CutIds(it->second.job.status()), ")"));
    }
    info = *cut;
  }
  bool first = true;
  for (const std::string& server : info.servers()) {
    v1::ReadCheckpointRequest req;
    req.set_job_id(job_id);
    req.set_cut_id(info.cut_id());
    for (;;) {
      absl::StatusOr<v1::ReadCheckpointResponse> page = servers_->ReadCut(server, req);
      if (!page.ok()) {
        return absl::Status(page.status().code(), absl::StrCat("reading checkpoint ", info.cut_id(), " from ", server,
                                                               ": ", page.status().message()));
      }
      v1::ExportCheckpointChunk chunk;
      if (first) {
        *chunk.mutable_checkpoint() = info;
        *chunk.mutable_meta() = page->meta();
        first = false;
      }
      chunk.mutable_records()->Swap(page->mutable_records());
      if (!write(chunk)) return absl::CancelledError("the reader went away");
      if (page->next_start_after().empty()) break;
      req.set_start_after(page->next_start_after());
    }
  }
  return absl::OkStatus();
}

void Coordinator::CollectMetrics(metrics::Scrape* out) const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::map<int, double> by_state;
  for (int st = v1::PENDING; st <= v1::CANCELLED; ++st) by_state[st] = 0;
  for (const auto& [id, r] : jobs_) by_state[r.job.status().state()] += 1;
  for (const auto& [st, n] : by_state) {
    out->Gauge("fulcrum_coordinator_jobs", "Jobs in the registry, by state",
               {{"state", metrics::LabelValue(v1::JobState_Name(static_cast<v1::JobState>(st)))}}, n);
  }
  double live[2][2] = {{0, 0}, {0, 0}};  // [role: server, worker][alive]
  for (const auto& [id, n] : nodes_) {
    const bool worker = n.info.role() == v1::WORKER;
    const std::string role = worker ? "worker" : "server";
    live[worker ? 1 : 0][n.alive ? 1 : 0] += 1;
    if (!n.alive) continue;
    out->Gauge("fulcrum_coordinator_node_heartbeat_age_seconds", "Seconds since a live node's last heartbeat",
               {{"node", id}, {"role", role}}, absl::ToDoubleSeconds(now - n.last_heartbeat));
  }
  for (int role = 0; role < 2; ++role) {
    for (int alive = 0; alive < 2; ++alive) {
      out->Gauge("fulcrum_coordinator_nodes", "Registered nodes, by role and liveness",
                 {{"role", role ? "worker" : "server"}, {"state", alive ? "live" : "dead"}}, live[role][alive]);
    }
  }
  for (const char* call : {"install_shard_map", "delete_job"}) {
    auto it = call_failures_.find(call);
    out->Counter("fulcrum_coordinator_server_call_failures_total",
                 "Failed calls to parameter servers that the scheduler retries (since this coordinator started)",
                 {{"call", call}}, it == call_failures_.end() ? 0.0 : static_cast<double>(it->second));
  }
  out->Counter("fulcrum_coordinator_store_write_failures_total",
               "Failed writes of the coordinator's state to RocksDB (since this coordinator started)", {},
               static_cast<double>(store_write_failures_));
  out->Gauge("fulcrum_coordinator_store_unsaved_records",
             "Records (jobs, nodes, the meta record) whose last write failed and is not yet redone", {},
             static_cast<double>(unsaved_.size()));
  size_t watches = 0, cuts = 0;
  for (const auto& [ticket, poll] : polls_) {
    watches += poll.kind == PollKind::kWatch;
    cuts += poll.kind == PollKind::kCheckpoint;
  }
  const char* help = "Heartbeats, WatchJob streams and CheckpointJob calls waiting for a change, by call";
  out->Gauge("fulcrum_coordinator_long_polls", help, {{"call", "heartbeat"}},
             static_cast<double>(heartbeat_polls_.size()));
  out->Gauge("fulcrum_coordinator_long_polls", help, {{"call", "watch_job"}}, static_cast<double>(watches));
  out->Gauge("fulcrum_coordinator_long_polls", help, {{"call", "checkpoint_job"}}, static_cast<double>(cuts));
  out->Counter("fulcrum_coordinator_reassignments_total",
               "Ranks handed to another worker after one was lost (since this coordinator started)", {},
               static_cast<double>(reassignments_));
  if (shard_map_) {
    out->Gauge("fulcrum_coordinator_shard_map_version", "Version of the current shard map", {},
               static_cast<double>(shard_map_->version()));
  }
  for (const auto& [id, r] : jobs_) {
    const v1::JobStatus& st = r.job.status();
    const metrics::Labels job = {{"job", id}};
    out->Gauge("fulcrum_coordinator_job_state", "1 for the job's current state",
               {{"job", id}, {"state", metrics::LabelValue(v1::JobState_Name(st.state()))}}, 1);
    out->Gauge("fulcrum_coordinator_job_epoch", "The epoch the job's slowest rank is in", job, st.epoch());
    out->Gauge("fulcrum_coordinator_job_step", "Steps the job's slowest rank completed", job,
               static_cast<double>(st.step()));
    out->Gauge("fulcrum_coordinator_job_total_steps", "Steps per rank over all epochs (0 until known)", job,
               static_cast<double>(st.total_steps()));
    out->Gauge("fulcrum_coordinator_job_loss", "The job's latest training loss, as its workers report it", job,
               st.loss());
    out->Gauge("fulcrum_coordinator_job_train_accuracy", "Training accuracy over the current epoch (0-1)", job,
               st.train_accuracy());
    out->Gauge("fulcrum_coordinator_job_test_accuracy", "Test accuracy after the last evaluated epoch (0-1)", job,
               st.test_accuracy());
    out->Gauge("fulcrum_coordinator_job_samples_per_second", "The job's training throughput over all ranks", job,
               st.samples_per_second());
    out->Gauge("fulcrum_coordinator_job_active_workers", "Ranks with a worker running them", job,
               st.active_workers());
    out->Gauge("fulcrum_coordinator_job_restarts", "Worker replacements so far (counts toward backoffLimit)", job,
               st.restarts());
    out->Gauge("fulcrum_coordinator_job_rollbacks", "Rollbacks to a checkpoint so far", job, st.rollbacks());
    if (st.gpu_busy_seconds() + st.gpu_idle_seconds() > 0) {
      const char* help = "GPU time the job's ranks held while training, every incarnation, split by NVML utilization";
      metrics::Labels busy = job, idle = job;
      busy.push_back({"state", "busy"});
      idle.push_back({"state", "idle"});
      out->Counter("fulcrum_coordinator_job_gpu_seconds_total", help, busy, st.gpu_busy_seconds());
      out->Counter("fulcrum_coordinator_job_gpu_seconds_total", help, idle, st.gpu_idle_seconds());
    }
    if (st.batch_size() > 0) {
      out->Gauge("fulcrum_coordinator_job_batch_size", "The batch batch_size auto chose for every rank", job,
                 st.batch_size());
    }
    if (st.checkpoints_size() > 0) {
      const double created = static_cast<double>(st.checkpoints(st.checkpoints_size() - 1).created_unix_ms()) / 1e3;
      out->Gauge("fulcrum_coordinator_job_checkpoint_timestamp_seconds", "When the job's last committed cut was taken",
                 job, created);
      out->Gauge("fulcrum_coordinator_job_checkpoint_age_seconds", "Seconds since the job's last committed cut", job,
                 absl::ToDoubleSeconds(now - absl::UnixEpoch()) - created);
    }
    // The interval cuts are expected at: every_seconds, or every_steps at
    // the job's pace so far; absent when neither applies yet.
    if (st.state() == v1::RUNNING) {
      const v1::CheckpointPolicy& p = r.job.spec().checkpoint();
      double interval = p.every_seconds();
      if (p.every_steps() > 0 && st.step() > 0 && r.started != absl::InfinitePast()) {
        const double per_step = absl::ToDoubleSeconds(now - r.started) / static_cast<double>(st.step());
        const double by_steps = per_step * p.every_steps();
        interval = interval > 0 ? std::min(interval, by_steps) : by_steps;
      }
      if (interval > 0) {
        out->Gauge("fulcrum_coordinator_job_checkpoint_interval_seconds",
                   "How often the job's policy asks for a cut, in seconds (every_steps at the job's pace)", job,
                   interval);
      }
    }
  }
}

}  // namespace fulcrum
