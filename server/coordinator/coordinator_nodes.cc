// The Coordinator's cluster API: node registration, heartbeats, progress
// reports, and what the scheduler reads of membership.
#include "server/coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <set>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/config/job_spec.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/coordinator/coordinator_internal.h"

namespace fulcrum {

using coordinator_internal::kJobPrefix;
using coordinator_internal::RollingBack;
using coordinator_internal::kMetaKey;
using coordinator_internal::kNodePrefix;
using coordinator_internal::Serial;

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
  if (n.job_id().size() > kMaxNodeString) return too_long("job_id", n.job_id());
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
      {"progress.progressive_log_loss", p.progressive_log_loss()},
      {"epoch_done.samples_per_second", req.epoch_done().samples_per_second()},
      {"epoch_done.seconds", req.epoch_done().seconds()},
  };
  for (const auto& [field, v] : measured) {
    if (!std::isfinite(v) || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("progress report: ", field, " is ", v, "; must be a finite number >= 0"));
    }
  }
  if (!(p.progressive_auc() >= 0 && p.progressive_auc() <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress report: progress.progressive_auc is ", p.progressive_auc(), "; must be in [0, 1]"));
  }
  constexpr uint64_t kMaxWindow = uint64_t{1} << 40;
  if (p.progressive_examples() > kMaxWindow) {
    return absl::InvalidArgumentError(absl::StrCat("progress report: progress.progressive_examples is ",
                                                   p.progressive_examples(), "; at most ", kMaxWindow, " allowed"));
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

absl::StatusOr<v1::RegisterNodeResponse> Coordinator::RegisterNode(const v1::NodeInfo& node_given,
                                                                   const std::string& certificate) {
  if (node_given.role() != v1::SERVER && node_given.role() != v1::WORKER) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: role must be SERVER or WORKER; got ", static_cast<int>(node_given.role())));
  }
  // The binding is the coordinator's to make: whatever the node wrote there
  // is replaced by the certificate it presented.
  v1::NodeInfo node_in = node_given;
  node_in.set_certificate(certificate);
  if (node_in.role() == v1::SERVER && node_in.address().empty()) {
    return absl::InvalidArgumentError("register: a server must give the address its parameter service listens on");
  }
  RETURN_IF_ERROR(CheckNodeInfo(node_in));
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
  RETURN_IF_ERROR(CheckUserWorkerLocked(node_in));
  ASSIGN_OR_RETURN(const Membership::Registered reg, members_.Register(node_in, Now()));
  for (const std::string& id : reg.displaced) {
    // The scheduler declares it dead at its next tick, and deals with the
    // jobs that had shards on it.
    FLOG(WARNING) << "server " << id << " at " << node_in.address() << " re-registered: the old process is gone";
  }
  if (reg.fresh) SaveMetaLocked();
  SaveNodeLocked(reg.node_id);
  const v1::NodeInfo info = members_.Get(reg.node_id)->info;
  if (!store_->Saved(kNodePrefix + info.node_id()) || (reg.fresh && !store_->Saved(kMetaKey))) {
    // Its key stays unsaved: the repair deletes whatever part reached the disk.
    if (reg.fresh) members_.Unregister(info.node_id());
    return store_->Unavailable(absl::StrCat(info.role() == v1::SERVER ? "server" : "worker", " at ",
                                            info.hostname(), " pid ", info.pid(), " not registered"));
  }
  if (info.role() == v1::SERVER) {
    shard_maps_.Forget(info.address());  // a new process: install the map again
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
                                           : absl::StrCat(", ", info.slots(), " slot(s)",
                                                          info.job_id().empty()
                                                              ? std::string()
                                                              : absl::StrCat(", a user process of job ", info.job_id()),
                                                          ", devices: ", absl::StrJoin(devices, "; ")))
             << ")";
  v1::RegisterNodeResponse r;
  r.set_node_id(info.node_id());
  r.set_heartbeat_interval_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  return r;
}

absl::Status Coordinator::CheckUserWorkerLocked(const v1::NodeInfo& node) const {
  if (node.job_id().empty()) return absl::OkStatus();
  if (node.role() != v1::WORKER) return absl::InvalidArgumentError("register: only a worker serves one job (job_id)");
  if (node.slots() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: a user process takes one rank of job ", node.job_id(), "; slots is ", node.slots()));
  }
  auto it = jobs_.find(node.job_id());
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("register: no job '", node.job_id(), "'"));
  const v1::Job& job = it->second.job;
  if (!job.spec().user_workers()) {
    return absl::FailedPreconditionError(
        absl::StrCat("register: job ", job.id(), " is trained by fulcrum-worker daemons (its spec has no "
                     "user_workers: true); a user process cannot take its ranks"));
  }
  if (const std::string over = UserJobOverLocked(job.id()); !over.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("register: ", over));
  }
  return absl::OkStatus();
}

std::string Coordinator::UserJobOverLocked(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::StrCat("job ", job_id, " is gone");
  const v1::JobState state = it->second.job.status().state();
  if (config::JobEnded(state)) return absl::StrCat("job ", job_id, " has ended (", v1::JobState_Name(state), ")");
  return "";
}

std::vector<v1::Assignment> Coordinator::AssignmentsOfLocked(const std::string& node_id) const {
  std::vector<v1::Assignment> out;
  const std::optional<v1::ShardMap> map = shard_maps_.map();
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
      if (map) *a.mutable_shard_map() = *map;
      out.push_back(std::move(a));
    }
  }
  return out;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& req,
                                                             const std::string& certificate) {
  std::promise<absl::StatusOr<v1::HeartbeatResponse>> answer;
  auto got = answer.get_future();
  HeartbeatAsync(
      req, [&answer](absl::StatusOr<v1::HeartbeatResponse> r) { answer.set_value(std::move(r)); }, certificate);
  return got.get();
}

uint64_t Coordinator::HeartbeatAsync(const v1::HeartbeatRequest& req, HeartbeatCallback done,
                                     const std::string& certificate) {
  absl::MutexLock lock(&mu_);
  // Another member's certificate: refused before the node is marked heard or
  // leaving, and without its assignments.
  absl::Status refused = members_.CheckCaller(req.node_id(), certificate, "heartbeat");
  const Membership::Heard heard = refused.ok() ? members_.Hear(req.node_id(), Now()) : Membership::Heard::kOk;
  if (!refused.ok()) {
    // Answered at once, with nothing of the node's.
  } else if (heard == Membership::Heard::kUnknown) {
    refused = absl::NotFoundError(absl::StrCat("node ", QuoteInput(req.node_id()), " is not registered; register again"));
  } else if (heard == Membership::Heard::kDead) {
    // Declared dead (a long pause): its work has moved; it starts over.
    refused = absl::NotFoundError(absl::StrCat("node ", QuoteInput(req.node_id()), " was declared dead; register again"));
  } else {
    // A user process whose job is gone or ended has nothing more to do:
    // told so (it stops waiting for a rank), and forgotten at the next tick.
    if (const std::string job_id = members_.Get(req.node_id())->info.job_id(); !job_id.empty()) {
      if (const std::string over = UserJobOverLocked(job_id); !over.empty()) {
        refused = absl::FailedPreconditionError(absl::StrCat(over, "; this process has no rank to take"));
        members_.MarkLeaving(req.node_id());
        kick_ = true;
      }
    }
    if (req.leaving()) {
      members_.MarkLeaving(req.node_id());
      kick_ = true;
    }
    NoteSparseTablesLocked(req.node_id(), req);
  }
  const bool now = req.leaving() || !refused.ok() || shutdown_ || req.generation() == 0 || req.generation() != generation_;
  const absl::Duration wait = std::min(absl::Milliseconds(req.wait_ms()), options_.heartbeat_interval);
  auto answer = [this, node_id = req.node_id(), refused, done = std::move(done)]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::StatusOr<v1::HeartbeatResponse> r =
        refused.ok() ? HeartbeatAnswerLocked(node_id) : absl::StatusOr<v1::HeartbeatResponse>(refused);
    return [done, r = std::move(r)]() mutable { done(std::move(r)); };
  };
  // Real time: the waker's (a poll's timeout is not the scheduler's clock).
  return polls_.Park(PollKind::kHeartbeat, "", now, absl::Now() + wait, std::move(answer));
}

namespace {

// Adds one server's figures of a table into the job's sum.
void AddTableStats(const v1::SparseTableStats& t, v1::SparseTableStats* sum) {
  sum->set_table(t.table());
  sum->set_rows(sum->rows() + t.rows());
  sum->set_bytes(sum->bytes() + t.bytes());
  sum->set_admitted(sum->admitted() + t.admitted());
  sum->set_rejected(sum->rejected() + t.rejected());
  sum->set_evicted_cap(sum->evicted_cap() + t.evicted_cap());
  sum->set_evicted_ttl(sum->evicted_ttl() + t.evicted_ttl());
  sum->set_sketch_bytes(sum->sketch_bytes() + t.sketch_bytes());
  sum->set_cold_rows(sum->cold_rows() + t.cold_rows());
  sum->set_demoted(sum->demoted() + t.demoted());
  sum->set_promoted(sum->promoted() + t.promoted());
  sum->set_cold_reads(sum->cold_reads() + t.cold_reads());
  sum->set_prefetched(sum->prefetched() + t.prefetched());
}

}  // namespace

void Coordinator::NoteSparseTablesLocked(const std::string& node_id, const v1::HeartbeatRequest& req) {
  const std::optional<Membership::Node> node = members_.Get(node_id);
  if (!node || node->info.role() != v1::SERVER) return;
  std::set<std::string> reported;
  for (const v1::JobSparseTables& j : req.sparse_tables()) {
    auto it = jobs_.find(j.job_id());
    if (it == jobs_.end()) continue;
    reported.insert(j.job_id());
    it->second.server_tables[node_id].assign(j.tables().begin(), j.tables().end());
  }
  // The jobs to sum again: those reported now, and those the server
  // reported before and no longer holds tables of (moved, dropped).
  std::set<std::string> touched = reported;
  if (auto b = server_jobs_.find(node_id); b != server_jobs_.end()) {
    for (const std::string& id : b->second) {
      if (reported.count(id)) continue;
      if (auto it = jobs_.find(id); it != jobs_.end() && it->second.server_tables.erase(node_id) > 0) touched.insert(id);
    }
    server_jobs_.erase(b);
  }
  if (!reported.empty()) server_jobs_[node_id] = std::move(reported);
  for (const std::string& id : touched) {
    JobRecord& r = jobs_.at(id);
    // An ended job keeps the figures of its last running moments (its
    // servers drop its tables once it ends).
    if (config::JobEnded(r.job.status().state())) continue;
    std::map<std::string, v1::SparseTableStats> sum;
    for (auto s = r.server_tables.begin(); s != r.server_tables.end();) {
      // A server declared dead counts no more: its shards moved.
      const std::optional<Membership::Node> n = members_.Get(s->first);
      if (!n || !n->alive) {
        s = r.server_tables.erase(s);
        continue;
      }
      for (const v1::SparseTableStats& t : s->second) AddTableStats(t, &sum[t.table()]);
      ++s;
    }
    auto* out = r.job.mutable_status()->mutable_sparse_tables();
    out->Clear();
    for (auto& [name, t] : sum) *out->Add() = std::move(t);
  }
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::HeartbeatAnswerLocked(const std::string& node_id) {
  const std::optional<Membership::Node> node = members_.Get(node_id);
  if (!node || !node->alive) {
    return absl::NotFoundError(absl::StrCat("node '", node_id, "' was declared dead; register again"));
  }
  // Its last_heard is not touched again here: the caller may have died
  // during the wait, and a server restarted at its address wakes this call
  // (RegisterNode bumps the generation) just after marking the old entry
  // overdue. Refreshing it then kept a kill -9'd server "alive" for another
  // node_timeout, and its jobs rolled back twice.
  v1::HeartbeatResponse r;
  r.set_generation(generation_);
  if (auto map = shard_maps_.map()) *r.mutable_shard_map() = *std::move(map);
  if (node->info.role() == v1::WORKER) {
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
      // Who may push and pull as each rank: its node's certificate.
      for (uint32_t rank = 0; rank < job.ranks.size(); ++rank) {
        const RankSlot& slot = job.ranks[rank];
        v1::RankOwner* o = a->add_ranks();
        o->set_rank(rank);
        o->set_incarnation(slot.incarnation);
        o->set_node_id(slot.node_id);
        if (slot.node_id.empty()) continue;
        if (const std::optional<Membership::Node> owner = members_.Get(slot.node_id)) {
          o->set_certificate(owner->info.certificate());
        }
      }
    }
  }
  return r;
}

absl::StatusOr<v1::ReportProgressResponse> Coordinator::ReportProgress(const v1::ReportProgressRequest& req,
                                                                      const std::string& certificate) {
  RETURN_IF_ERROR(CheckProgressReport(req));
  absl::MutexLock lock(&mu_);
  // A worker reports only as the node its certificate registered (and,
  // below, only for the ranks assigned to that node).
  RETURN_IF_ERROR(members_.CheckCaller(req.node_id(), certificate, "progress report"));
  absl::StatusOr<v1::ReportProgressResponse> resp = ReportProgressLocked(req);
  // A result (an epoch's summary, the end, an error) is acknowledged once it
  // is saved: until then the worker keeps it and sends it again (applying
  // one twice changes nothing). Periodic progress is saved when it can be.
  if (resp.ok() && config::CarriesResult(req) && !store_->Saved(kJobPrefix + req.job_id())) {
    return store_->Unavailable(absl::StrCat("the report of job '", req.job_id(), "' rank ", req.rank(),
                                               " is applied but not saved"));
  }
  return resp;
}

absl::StatusOr<v1::ReportProgressResponse> Coordinator::ReportProgressLocked(const v1::ReportProgressRequest& req) {
  v1::ReportProgressResponse resp;
  auto it = jobs_.find(req.job_id());
  if (it == jobs_.end()) return coordinator_internal::NoJobError(req.job_id());
  JobRecord& r = it->second;
  if (r.job.status().state() != v1::RUNNING || req.rank() >= r.ranks.size() ||
      r.ranks[req.rank()].node_id != req.node_id() || r.ranks[req.rank()].incarnation != req.incarnation()) {
    resp.set_stop(true);  // cancelled, ended, or the rank moved on
    return resp;
  }
  // (A user_workers job may leave its epochs to its processes: 0.)
  if (req.has_epoch_done() && r.job.spec().epochs() > 0 && req.epoch_done().epoch() >= r.job.spec().epochs()) {
    return absl::InvalidArgumentError(absl::StrCat("epoch_done.epoch ", req.epoch_done().epoch(),
                                                   " is out of range: job '", r.job.id(), "' has ",
                                                   r.job.spec().epochs(), " epochs (0 to ",
                                                   r.job.spec().epochs() - 1, ")"));
  }
  members_.Hear(req.node_id(), Now());
  // A rank that finished stays finished. Periodic progress sent before the
  // end can arrive after it (a worker sends its results first); taken, it
  // would turn the rank back to "training", and the job would end with the
  // rank "stopped" and one succeeded worker short.
  const bool rank_finished = r.ranks[req.rank()].finished;
  if (rank_finished && !config::CarriesResult(req)) return resp;
  bool sync = MergeProgressLocked(r, req, rank_finished);
  if (req.has_epoch_done()) {
    MergeEpochLocked(r, req);
    sync = true;
  }
  v1::JobStatus* st = r.job.mutable_status();
  if (!req.weights_fingerprint().empty()) st->set_weights_fingerprint(req.weights_fingerprint());
  // FinishLocked and the end of this function recompute the job's totals.
  if (!req.error().empty()) {
    resp.set_stop(RankFailedLocked(r, req));
    return resp;
  }
  if (req.finished()) {
    RankFinishedLocked(r, req.rank());
    sync = true;
  }
  RecomputeLocked(r);
  SaveJobLocked(r, sync);
  return resp;
}

bool Coordinator::MergeProgressLocked(JobRecord& r, const v1::ReportProgressRequest& req, bool rank_finished) {
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
  return sync;
}

void Coordinator::MergeEpochLocked(JobRecord& r, const v1::ReportProgressRequest& req) {
  v1::JobStatus* st = r.job.mutable_status();
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
    sum->set_train_auc(sum->train_auc() + (e.train_auc() - sum->train_auc()) / k);
    sum->set_samples_per_second(sum->samples_per_second() + e.samples_per_second());
    sum->set_seconds(std::max(sum->seconds(), e.seconds()));
  }
  if (req.rank() == 0 && (e.evaluation_only() ? e.tested() && !sum->tested() : first)) {
    sum->set_test_loss(e.test_loss());
    sum->set_test_accuracy(e.test_accuracy());
    sum->set_test_rmse(e.test_rmse());
    sum->set_test_auc(e.test_auc());
    sum->set_tested(e.tested());
    st->set_test_loss(e.test_loss());
    st->set_test_accuracy(e.test_accuracy());
    st->set_test_rmse(e.test_rmse());
    st->set_test_auc(e.test_auc());
  }
}

bool Coordinator::RankFailedLocked(JobRecord& r, const v1::ReportProgressRequest& req) {
  v1::WorkerProgress* w = r.job.mutable_status()->mutable_workers(static_cast<int>(req.rank()));
  w->set_state("failed");
  const std::string reason = req.error_reason().empty() ? "WorkerError" : req.error_reason();
  const std::string error = CutMessage(req.error(), kMaxErrorMessage);
  FLOG(WARNING) << "job " << r.job.id() << " rank " << req.rank() << " on " << req.node_id()
                << " failed: " << error;
  const std::string message = absl::StrCat("rank ", req.rank(), " on ", req.node_id(), ": ", error);
  // Bad data, bad specs, a user process's own error (UserError: an
  // exception in its code) and a table out of parameter memory
  // (QuotaExceeded: a rollback brings the same rows back) fail the same way
  // every time; anything else (a server that lost its state, a crash) rolls
  // back to the last cut. A server that lost the job (ServerLost) does not
  // count against the backoff limit, as when the scheduler finds a server
  // dead; nor does a step a lost worker left torn between servers
  // (TornStep: that worker's loss was the failure).
  const bool final = reason == "BadData" || reason == "BadSpec" || reason == "UserError" || reason == "QuotaExceeded";
  const bool counts = reason != "ServerLost" && reason != "TornStep";
  if (!final && BeginRollbackLocked(r, 0, reason, message, /*counts_as_restart=*/counts, /*or_start=*/true)) {
    return true;
  }
  FinishLocked(r, v1::FAILED, reason,
               reason == "QuotaExceeded"
                   ? absl::StrCat(message, " (a rollback would bring the same rows back: raise the job's quota_bytes "
                                           "or the servers' --memory_limit_bytes, or spread the job over more servers)")
                   : message);
  return false;
}

void Coordinator::RankFinishedLocked(JobRecord& r, uint32_t rank) {
  r.job.mutable_status()->mutable_workers(static_cast<int>(rank))->set_state("finished");
  r.ranks[rank].finished = true;
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
}

v1::ClusterState Coordinator::GetCluster() const {
  absl::MutexLock lock(&mu_);
  v1::ClusterState s;
  s.set_generation(generation_);
  if (auto map = shard_maps_.map()) *s.mutable_shard_map() = *std::move(map);
  for (const auto& [id, n] : members_.All()) {
    v1::NodeStatus* ns = s.add_nodes();
    *ns->mutable_info() = n.info;
    ns->set_alive(n.alive);
    ns->set_last_heartbeat_unix_ms(absl::ToUnixMillis(n.last_heard));
    for (const v1::Assignment& a : AssignmentsOfLocked(id)) {
      ns->add_assignments(absl::StrCat(a.job_id(), "/", a.rank()));
    }
  }
  return s;
}

// ---------------------------------------------------------------- scheduler

std::map<std::string, int> Coordinator::FreeSlotsLocked(const std::string& job_id) const {
  std::map<std::string, int> free = members_.WorkerSlots(job_id);
  for (const auto& [jid, r] : jobs_) {
    if (r.job.status().state() != v1::RUNNING) continue;
    for (const RankSlot& s : r.ranks) {
      if (!s.node_id.empty() && !s.finished && free.count(s.node_id)) --free[s.node_id];
    }
  }
  return free;
}

std::vector<std::string> Coordinator::LiveServersLocked() const { return members_.LiveServerAddresses(); }

bool Coordinator::AnyRunningLocked() const {
  // A job rolling back holds no tables yet: the map may change under it.
  for (const auto& [id, r] : jobs_) {
    if (r.job.status().state() == v1::RUNNING && !RollingBack(r.job.status())) return true;
  }
  return false;
}

}  // namespace fulcrum
