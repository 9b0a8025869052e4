#include "server/parameter_server.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {
// Answer a wait a little before the caller's transport deadline so our
// explanation, not a bare gRPC DEADLINE_EXCEEDED, reaches it.
constexpr absl::Duration kDeadlineMargin = absl::Milliseconds(50);
}  // namespace

absl::StatusOr<std::unique_ptr<ParameterServer>> ParameterServer::Create(
    ParameterServerOptions options) {
  std::shared_ptr<const ShardMap> map;
  if (options.shard_map) {
    ASSIGN_OR_RETURN(ShardMap m, ShardMap::FromProto(*options.shard_map));
    map = std::make_shared<const ShardMap>(std::move(m));
  }
  std::unique_ptr<ParameterServer> ps(new ParameterServer(std::move(options)));
  if (!ps->options_.data_dir.empty()) {
    ASSIGN_OR_RETURN(ps->store_, CheckpointStore::Open(ps->options_.data_dir + "/checkpoints",
                                                          ps->options_.checkpoint_env,
                                                          ps->options_.checkpoint_commit_delay));
    ASSIGN_OR_RETURN(ps->cold_tier_, ColdTier::Open(ps->options_.data_dir + "/cold", ps->options_.cold_tier_env));
  }
  uint32_t self = 0;
  if (map != nullptr) {
    ASSIGN_OR_RETURN(self, ps->IndexIn(*map));
  }
  absl::MutexLock lock(&ps->mu_);
  ps->map_ = std::move(map);
  ps->self_ = self;
  return ps;
}

namespace {
// A cgroup's memory limit in bytes (v2, then v1), or 0 when there is none:
// in a container the machine's memory is not what the process may use.
uint64_t CgroupMemoryLimit() {
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string v;
    if (!(in >> v) || v == "max") continue;
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
    if (end != v.c_str() && *end == '\0' && n > 0) return n;
  }
  return 0;
}

// 80% of what this process may use: the machine's memory, or its cgroup's
// limit when lower. The rest is for gRPC buffers and copy-on-write copies,
// which nothing counts.
uint64_t DefaultMemoryLimit() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  uint64_t total = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : uint64_t{10} << 30;
  const uint64_t cgroup = CgroupMemoryLimit();
  if (cgroup != 0 && cgroup < total) total = cgroup;
  return total / 5 * 4;
}
}  // namespace

ParameterServer::ParameterServer(ParameterServerOptions options)
    : options_(std::move(options)),
      memory_(std::make_shared<MemoryQuota>(
          "", options_.memory_limit_bytes != 0 ? options_.memory_limit_bytes
                                               : DefaultMemoryLimit() / std::max(1u, options_.servers_per_host))),
      runner_(std::make_shared<ParallelRunner>(ParallelRunner::DefaultHelpers())) {}

ParameterServer::~ParameterServer() {
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    jobs.swap(jobs_);
  }
  for (auto& [id, job] : jobs) job->Shutdown(absl::UnavailableError("server shutting down"));
}

absl::StatusOr<ParameterServer::MapRef> ParameterServer::Map() const {
  absl::MutexLock lock(&mu_);
  if (map_ == nullptr) {
    return absl::UnavailableError("this server has no shard map yet (waiting for SetShardMap)");
  }
  return MapRef{map_, self_};
}

absl::StatusOr<uint32_t> ParameterServer::IndexIn(const ShardMap& m) const {
  if (options_.advertise_address.empty()) {
    if (options_.server_index >= m.num_servers()) {
      return absl::InvalidArgumentError(absl::StrCat("shard map lists ", m.num_servers(),
                                                     " servers; this server has index ",
                                                     options_.server_index));
    }
    return options_.server_index;
  }
  for (uint32_t i = 0; i < m.num_servers(); ++i) {
    if (m.servers()[i] == options_.advertise_address) return i;
  }
  // Not listed: owns no virtual shard, so every request is routed elsewhere.
  return static_cast<uint32_t>(m.num_servers());
}

uint32_t ParameterServer::server_index() const {
  absl::MutexLock lock(&mu_);
  return self_;
}

std::vector<std::string> ParameterServer::JobIds() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

void ParameterServer::Drain() {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (auto& job : jobs) job->Shutdown(absl::UnavailableError("server is shutting down"));
}

absl::StatusOr<std::shared_ptr<Job>> ParameterServer::FindJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("server is shutting down");
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return JobNotOnServerError(job_id);
  }
  return it->second;
}

absl::StatusOr<v1::CreateJobResponse> ParameterServer::CreateJob(const v1::PsJobSpec& spec) {
  if (spec.quota_bytes() > memory_->limit()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job ", QuoteInput(spec.job_id()), ": quota_bytes ", spec.quota_bytes(), " exceeds this server's memory limit of ",
        memory_->limit(), " bytes (--memory_limit_bytes, shared by every job on it)"));
  }
  if (options_.require_admission) {
    absl::MutexLock lock(&mu_);
    auto it = admitted_.find(spec.job_id());
    if (it == admitted_.end()) {
      return absl::UnavailableError(absl::StrCat(
          "job ", QuoteInput(spec.job_id()),
          " is not admitted by the coordinator (yet): servers hold only the jobs it runs, and learn of a new one "
          "with its next heartbeat"));
    }
    if (it->second != spec.quota_bytes()) {
      return absl::PermissionDeniedError(absl::StrCat("job ", QuoteInput(spec.job_id()), " asks for quota_bytes ",
                                                      spec.quota_bytes(), "; the coordinator granted ", it->second));
    }
  }
  return CreateJobUnchecked(spec);
}

std::vector<std::string> ParameterServer::SetAdmittedJobs(const std::vector<v1::AdmittedJob>& jobs,
                                                          absl::Time now) {
  std::vector<std::string> reclaim;
  {
    absl::MutexLock lock(&owners_mu_);
    owners_.clear();
    for (const v1::AdmittedJob& j : jobs) {
      std::vector<v1::RankOwner>& ranks = owners_[j.job_id()];
      for (const v1::RankOwner& o : j.ranks()) {
        if (o.rank() >= static_cast<uint32_t>(j.ranks_size())) continue;  // not from our coordinator
        if (ranks.size() <= o.rank()) ranks.resize(o.rank() + 1);
        ranks[o.rank()] = o;
      }
    }
  }
  {
    absl::MutexLock lock(&mu_);
    admitted_.clear();
    for (const v1::AdmittedJob& j : jobs) admitted_[j.job_id()] = j.quota_bytes();
    for (auto it = unadmitted_since_.begin(); it != unadmitted_since_.end();) {
      auto next = std::next(it);
      if (!jobs_.contains(it->first) || admitted_.contains(it->first)) unadmitted_since_.erase(it);
      it = next;
    }
    for (const auto& [id, job] : jobs_) {
      if (admitted_.contains(id)) continue;
      const absl::Time since = unadmitted_since_.emplace(id, now).first->second;
      if (now - since >= options_.unadmitted_grace) reclaim.push_back(id);
    }
  }
  for (const std::string& id : reclaim) {
    FLOG(WARNING) << "dropping job " << QuoteInput(id) << ": the coordinator has not listed it for "
                  << absl::FormatDuration(options_.unadmitted_grace) << " (a job it does not run, or one it ended)";
    (void)DeleteJob(id);
  }
  return reclaim;
}

absl::StatusOr<v1::CreateJobResponse> ParameterServer::CreateJobUnchecked(const v1::PsJobSpec& spec) {
  ASSIGN_OR_RETURN(MapRef ref, Map());
  const std::shared_ptr<const ShardMap>& map = ref.map;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(spec.job_id());
    if (it != jobs_.end()) {
      if (it->second->spec().SerializeAsString() != spec.SerializeAsString()) {
        return absl::AlreadyExistsError(absl::StrCat(
            "job '", spec.job_id(), "' already exists on this server with a different spec"));
      }
      v1::CreateJobResponse r;
      r.set_bytes_used(it->second->bytes_used());
      return r;
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, Job::Create(spec, map->num_virtual_shards(),
                                                         options_.default_quota_bytes, &timer_, memory_,
                                                         cold_tier_.get(), runner_));
  RETURN_IF_ERROR(job->MaterializeOwned(*map, ref.self));
  v1::CreateJobResponse r;
  r.set_bytes_used(job->bytes_used());
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = jobs_.emplace(spec.job_id(), job);
    if (inserted) {
      if (auto fence = fences_.find(spec.job_id()); fence != fences_.end()) {
        job->set_min_incarnation(fence->second);
        fences_.erase(fence);
      }
    } else {
      // Created concurrently (every worker of a job creates it): the same
      // spec is success, a different one a conflict.
      if (it->second->spec().SerializeAsString() != spec.SerializeAsString()) {
        return absl::AlreadyExistsError(absl::StrCat(
            "job '", spec.job_id(), "' already exists on this server with a different spec"));
      }
      r.set_bytes_used(it->second->bytes_used());
      return r;
    }
  }
  FLOG(INFO) << "created job '" << spec.job_id() << "': " << spec.tables_size() << " tables, "
             << spec.num_workers() << " workers, " << job->bytes_used()
             << " bytes on this server (virtual shards " << map->DescribeOwned(ref.self)
             << ")";
  return r;
}

absl::StatusOr<uint64_t> ParameterServer::DeleteJob(const std::string& job_id) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return JobNotOnServerError(job_id);
    }
    job = std::move(it->second);
    jobs_.erase(it);
  }
  const uint64_t bytes = job->bytes_used();
  job->Shutdown(absl::AbortedError(absl::StrCat("job '", job_id, "' was deleted")));
  FLOG(INFO) << "deleted job '" << job_id << "', freeing " << bytes << " bytes";
  return bytes;  // freed when the last in-flight request drops its reference
}

absl::StatusOr<CheckpointStore*> ParameterServer::Store() const {
  if (store_ == nullptr) {
    return absl::FailedPreconditionError("this server has no data directory (start it with --data_dir) for checkpoints");
  }
  return store_.get();
}

absl::StatusOr<v1::ShardCutMeta> ParameterServer::Checkpoint(const std::string& job_id, uint64_t cut_id,
                                                             uint64_t at_step, absl::Duration wait,
                                                             std::function<void()> on_captured) {
  ASSIGN_OR_RETURN(CheckpointStore * store, Store());
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  ASSIGN_OR_RETURN(MapRef ref, Map());
  const absl::Time t0 = absl::Now();
  ASSIGN_OR_RETURN(JobState state, job->Capture(at_step, t0 + wait, store->ColdCutDir(job_id, cut_id)));
  const absl::Time t1 = absl::Now();
  if (on_captured) on_captured();
  // Training held for a table written shard by shard resumes once the
  // records are written (whether or not that worked).
  absl::StatusOr<v1::ShardCutMeta> written = store->Write(job->spec(), state, cut_id, ref.self, ref.map->version());
  const absl::Status resumed = job->EndCapture(&state);
  state.copies.Reset();
  RETURN_IF_ERROR(written.status());
  RETURN_IF_ERROR(resumed);
  v1::ShardCutMeta meta = *std::move(written);
  meta.set_capture_seconds(state.pause_seconds);
  meta.set_write_seconds(absl::ToDoubleSeconds(absl::Now() - t1));
  JobMetrics& jm = job->metrics();
  jm.checkpoint_seconds.Observe(meta.capture_seconds() + meta.write_seconds());
  jm.last_checkpoint_bytes.store(static_cast<double>(meta.bytes()));
  jm.last_checkpoint_time.store(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  FLOG(INFO) << "job '" << job_id << "': cut " << cut_id << " at step " << meta.step() << ", " << meta.bytes()
             << " bytes in " << meta.records() << " records (" << meta.sparse_rows() << " sparse rows, "
             << meta.cold_rows() << " of them left on disk in " << (meta.cold_cut().empty() ? "-" : meta.cold_cut())
             << "); waited " << absl::ToDoubleSeconds(state.paused - t0)
             << " s for the step, paused training " << meta.capture_seconds() << " s, written in "
             << meta.write_seconds() << " s";
  return meta;
}

absl::StatusOr<std::vector<v1::ShardCutMeta>> ParameterServer::ListCuts(const std::string& job_id) const {
  ASSIGN_OR_RETURN(CheckpointStore * store, Store());
  return store->List(job_id);
}

absl::Status ParameterServer::DeleteCut(const std::string& job_id, uint64_t cut_id) {
  ASSIGN_OR_RETURN(CheckpointStore * store, Store());
  return store->Delete(job_id, cut_id);
}

absl::StatusOr<v1::ReadCheckpointResponse> ParameterServer::ReadCut(const v1::ReadCheckpointRequest& req) const {
  ASSIGN_OR_RETURN(CheckpointStore * store, Store());
  if (!req.has_owner_map()) return store->ReadPage(req, nullptr);
  ASSIGN_OR_RETURN(ShardMap map, ShardMap::FromProto(req.owner_map()));
  const uint32_t owner = req.owner_index();
  return store->ReadPage(req, [&](std::string_view table, uint32_t index, bool dense) {
    return dense ? map.ServerOfChunk(table, index) == owner
                 : index < map.num_virtual_shards() && map.owner(index) == owner;
  });
}

absl::StatusOr<v1::ShardCutMeta> ParameterServer::Restore(const std::string& job_id, uint64_t cut_id,
                                                          const std::vector<CutReader>& sources,
                                                          uint32_t min_incarnation) {
  if (cut_id == 0) return RestartJob(job_id, min_incarnation);
  ASSIGN_OR_RETURN(MapRef ref, Map());
  const ShardMap& map = *ref.map;
  // The spec first (from a meta alone), then the job afresh.
  v1::ShardCutMeta cut;
  v1::ReadCheckpointRequest first;
  first.set_job_id(job_id);
  first.set_cut_id(cut_id);
  *first.mutable_owner_map() = map.ToProto();
  first.set_owner_index(ref.self);
  std::vector<v1::ReadCheckpointResponse> first_pages;
  if (sources.empty()) {
    ASSIGN_OR_RETURN(CheckpointStore * store, Store());
    ASSIGN_OR_RETURN(cut, store->Meta(job_id, cut_id));
  } else {
    ASSIGN_OR_RETURN(cut, SourcesMeta(job_id, cut_id, sources, first, &first_pages));
  }
  if (cut.spec().job_id() != job_id) {
    // A peer's (or a damaged store's) meta must not create another job.
    return absl::DataLossError(absl::StrCat("cut ", cut_id, " of job '", job_id, "' holds the spec of job '",
                                            cut.spec().job_id(), "'"));
  }
  if (FindJob(job_id).ok()) RETURN_IF_ERROR(DeleteJob(job_id).status());
  RETURN_IF_ERROR(CreateJobUnchecked(cut.spec()).status());
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  job->set_min_incarnation(min_incarnation);
  std::atomic<uint64_t> skipped{0}, restored{0};
  CheckpointStore::Visitor visit;
  visit.dense = [&](const std::string& table, uint32_t chunk, uint64_t updates, uint32_t length, uint32_t slots,
                    const void* block) -> absl::Status {
    if (map.ServerOfChunk(table, chunk) != ref.self) {
      ++skipped;  // owned elsewhere under the current map
      return absl::OkStatus();
    }
    ++restored;
    return job->RestoreDense(table, chunk, updates, length, slots, block);
  };
  visit.sparse = [&](const std::string& table, uint32_t vshard, uint32_t dim, uint32_t slots, size_t n,
                     const uint64_t* keys, const uint32_t* updates, const float* rows,
                     const SparseShardLife* life) -> absl::Status {
    if (vshard >= map.num_virtual_shards() || map.owner(vshard) != ref.self) {
      ++skipped;
      return absl::OkStatus();
    }
    ++restored;
    return job->RestoreSparse(table, vshard, dim, slots, n, keys, updates, rows, cut.step(), life);
  };
  absl::Status s;
  if (sources.empty()) {
    // Reading, checking and installing run in key ranges at once. More
    // ranges than cores: a range waiting on the disk leaves its core to one
    // that checks and installs (1 GiB on 2 cores: 0.53 of the disk's read
    // bound with 2 ranges and 16 MiB readahead, 0.68 with 8 and 4 MiB).
    const int threads = 8;
    s = store_->Read(job_id, cut_id, visit, threads).status();
  } else {
    if (!KnownFormat(cut.format())) {
      return absl::DataLossError(absl::StrCat("cut ", cut_id, " of job '", job_id, "' has format ", cut.format(),
                                              ", which this build cannot read"));
    }
    s = ReadSources(job_id, cut_id, cut.format(), sources, first, std::move(first_pages), visit);
  }
  if (s.ok()) s = job->RestoreClocks(cut.step(), {cut.rank_clock().begin(), cut.rank_clock().end()});
  if (!s.ok()) {
    // Never leave a half-restored job serving.
    (void)DeleteJob(job_id);
    return s;
  }
  FLOG(INFO) << "job '" << job_id << "': restored cut " << cut_id << " (step " << cut.step() << ") from "
             << (sources.empty() ? std::string("this server's store") : absl::StrCat(sources.size(), " source(s)"))
             << ": " << restored.load() << " records"
             << (sources.empty() ? absl::StrCat(", ", skipped.load(), " owned by other servers now") : std::string())
             << (min_incarnation > 0 ? absl::StrCat("; incarnations below ", min_incarnation, " fenced off") : std::string());
  return cut;
}

absl::StatusOr<v1::ShardCutMeta> ParameterServer::RestartJob(const std::string& job_id, uint32_t min_incarnation) {
  v1::ShardCutMeta meta;
  meta.mutable_spec()->set_job_id(job_id);
  {
    // Noted first: a worker creating the job while it is replaced below
    // creates it fenced.
    absl::MutexLock lock(&mu_);
    uint32_t& fence = fences_[job_id];
    fence = std::max(fence, min_incarnation);
  }
  absl::StatusOr<std::shared_ptr<Job>> old = FindJob(job_id);
  if (!old.ok()) {
    FLOG(INFO) << "job " << QuoteInput(job_id) << " starts again from step 0; it is not on this server: "
               << "incarnations below " << min_incarnation << " will be fenced off when it is created";
    return meta;
  }
  const v1::PsJobSpec spec = (*old)->spec();
  old->reset();
  RETURN_IF_ERROR(DeleteJob(job_id).status());
  // Created fenced (the fence noted above), also when a worker's CreateJob
  // made it between the two calls.
  RETURN_IF_ERROR(CreateJobUnchecked(spec).status());
  *meta.mutable_spec() = spec;
  FLOG(INFO) << "job " << QuoteInput(job_id) << " starts again from step 0: its tables are as created; "
             << "incarnations below " << min_incarnation << " fenced off";
  return meta;
}

absl::StatusOr<v1::ShardCutMeta> ParameterServer::SourcesMeta(const std::string& job_id, uint64_t cut_id,
                                                              const std::vector<CutReader>& sources,
                                                              const v1::ReadCheckpointRequest& first,
                                                              std::vector<v1::ReadCheckpointResponse>* first_pages) {
  v1::ShardCutMeta cut;
  // Every source's first page: its meta (clocks may differ under SSP/ASP).
  for (size_t i = 0; i < sources.size(); ++i) {
    absl::StatusOr<v1::ReadCheckpointResponse> page = sources[i](first);
    if (!page.ok()) {
      return absl::Status(page.status().code(),
                          absl::StrCat("reading cut ", cut_id, " of job '", job_id, "' from source ", i, ": ",
                                       page.status().message()));
    }
    const v1::ShardCutMeta& m = page->meta();
    if (i == 0) {
      cut = m;
    } else {
      const auto model = cut.spec().consistency().model();
      if ((model == v1::ConsistencySpec::BSP || model == v1::ConsistencySpec::MODEL_UNSPECIFIED) &&
          m.step() != cut.step()) {
        return absl::DataLossError(absl::StrCat("cut ", cut_id, " of job '", job_id, "' is not one BSP cut: source 0 has step ",
                                                cut.step(), ", source ", i, " step ", m.step()));
      }
      for (int r = 0; r < cut.rank_clock_size() && r < m.rank_clock_size(); ++r) {
        cut.set_rank_clock(r, std::min(cut.rank_clock(r), m.rank_clock(r)));
      }
      cut.set_step(std::min(cut.step(), m.step()));
      cut.set_records(cut.records() + m.records());
    }
    first_pages->push_back(*std::move(page));
  }
  return cut;
}

absl::Status ParameterServer::ReadSources(const std::string& job_id, uint64_t cut_id, uint32_t format,
                                          const std::vector<CutReader>& sources,
                                          const v1::ReadCheckpointRequest& first,
                                          std::vector<v1::ReadCheckpointResponse> first_pages,
                                          const CheckpointStore::Visitor& visit) {
  absl::Status s;
  RecordDecoder decoder(format);
  const std::string prefix = CutPrefix(job_id, cut_id);
  for (size_t i = 0; i < sources.size() && s.ok(); ++i) {
    const std::string where = absl::StrCat(" from source ", i);
    v1::ReadCheckpointResponse page = std::move(first_pages[i]);
    for (;;) {
      for (const v1::CheckpointRecord& r : page.records()) {
        uint32_t crc = 0;
        s = decoder.Decode(prefix, r.key(), r.value(), visit, &crc, where);
        if (!s.ok()) break;
      }
      if (!s.ok() || page.next_start_after().empty()) break;
      v1::ReadCheckpointRequest next = first;
      next.set_start_after(page.next_start_after());
      absl::StatusOr<v1::ReadCheckpointResponse> more = sources[i](next);
      if (!more.ok()) {
        s = absl::Status(more.status().code(), absl::StrCat("reading cut ", cut_id, " of job '", job_id,
                                                            "' from source ", i, ": ", more.status().message()));
        break;
      }
      page = *std::move(more);
    }
  }
  return s;
}

bool ParameterServer::IsSelf(const std::string& address) const {
  if (!options_.advertise_address.empty()) return address == options_.advertise_address;
  absl::MutexLock lock(&mu_);
  return map_ != nullptr && self_ < map_->num_servers() && map_->servers()[self_] == address;
}

absl::StatusOr<v1::GetJobResponse> ParameterServer::GetJob(const std::string& job_id) const {
  ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return job->Stats();
}

absl::StatusOr<v1::ShardMap> ParameterServer::GetShardMap() const {
  ASSIGN_OR_RETURN(MapRef ref, Map());
  return ref.map->ToProto();
}

absl::Status ParameterServer::SetShardMap(const v1::ShardMap& proto) {
  ASSIGN_OR_RETURN(ShardMap m, ShardMap::FromProto(proto));
  ASSIGN_OR_RETURN(const uint32_t self, IndexIn(m));
  absl::MutexLock lock(&mu_);
  if (map_ != nullptr) {
    if (m.version() <= map_->version()) {
      return absl::FailedPreconditionError(absl::StrCat("shard map version ", m.version(),
                                                        " is not newer than the installed ",
                                                        map_->version()));
    }
    if (m.num_virtual_shards() != map_->num_virtual_shards()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the number of virtual shards is fixed at ", map_->num_virtual_shards(), "; got ",
          m.num_virtual_shards()));
    }
  }
  FLOG(INFO) << "shard map version " << m.version() << ": " << m.num_servers() << " servers, "
             << m.num_virtual_shards() << " virtual shards; this server ("
             << (self < m.num_servers() ? absl::StrCat("index ", self) : std::string("not listed"))
             << ") owns " << (self < m.num_servers() ? m.DescribeOwned(self) : std::string("nothing"));
  map_ = std::make_shared<const ShardMap>(std::move(m));
  self_ = self;
  return absl::OkStatus();
}

void ParameterServer::CountRejected(int op, const absl::Status& s) const {
  const int code = static_cast<int>(s.code());
  if (code > 0 && code < 17) rejected_[op][code].fetch_add(1, std::memory_order_relaxed);
}

absl::Status ParameterServer::CheckRankCaller(const std::string& job_id, uint32_t rank, uint32_t incarnation,
                                              const std::string& caller, absl::string_view what) const {
  if (caller.empty() || !options_.require_admission) return absl::OkStatus();
  absl::MutexLock lock(&owners_mu_);
  auto it = owners_.find(job_id);
  // Every push and pull passes here: the message is made only for a refusal.
  auto who = [&] {
    return absl::StrCat(what, " as rank ", rank, " (incarnation ", incarnation, ") of job ", QuoteInput(job_id),
                        " with certificate ", caller);
  };
  if (it == owners_.end()) {
    // A job held here (the caller checked) that the coordinator does not
    // list as running: it ended (its tables wait for their release, and no
    // rank may touch them), or it was restored here before this server
    // heard it runs. Retryable, as a new incarnation is (a worker of a
    // running job retries; none of an ended one is left to).
    return absl::UnavailableError(absl::StrCat(who(), ": the coordinator does not list the job as running on this "
                                               "server (it ended, or this server learns of it with its next "
                                               "heartbeat)"));
  }
  if (rank >= it->second.size()) {
    return absl::InvalidArgumentError(absl::StrCat(who(), ": the job has ", it->second.size(), " ranks"));
  }
  const v1::RankOwner& owner = it->second[rank];
  if (incarnation > owner.incarnation()) {
    return absl::UnavailableError(absl::StrCat(who(), ": this server knows the rank up to incarnation ",
                                               owner.incarnation(),
                                               "; it learns new assignments with its next heartbeat"));
  }
  if (incarnation < owner.incarnation()) {
    return absl::FailedPreconditionError(absl::StrCat(who(), ": the rank moved on to incarnation ",
                                                      owner.incarnation(), " on node ",
                                                      owner.node_id().empty() ? std::string("(none yet)") : owner.node_id()));
  }
  if (owner.node_id().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(who(), ": the rank has no worker now (that incarnation was lost; its replacement resumes it)"));
  }
  if (owner.certificate() != caller) {
    return absl::PermissionDeniedError(absl::StrCat(
        who(), ": the rank belongs to node ", owner.node_id(), ", whose certificate is ",
        owner.certificate().empty() ? std::string("none (plaintext)") : owner.certificate(),
        "; a worker pushes and pulls only as the ranks the coordinator gave it"));
  }
  return absl::OkStatus();
}

absl::Status ParameterServer::Push(const PushMessage& m, PushResult* out) {
  const absl::Time t0 = absl::Now();
  // The job first: an unknown one is NOT_FOUND (a restarted server) whoever asks.
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(m.job_id);
  if (job.ok()) {
    if (absl::Status s = CheckRankCaller(m.job_id, m.rank, m.incarnation, m.caller, "push"); !s.ok()) {
      CountRejected(0, s);
      return s;
    }
  }
  absl::StatusOr<MapRef> ref = job.ok() ? Map() : job.status();
  absl::Status s = ref.ok() ? (*job)->Push(m, *ref->map, ref->self, out) : ref.status();
  if (!s.ok()) {
    CountRejected(0, s);
    return s;
  }
  JobMetrics& jm = (*job)->metrics();
  jm.push_requests.fetch_add(1, std::memory_order_relaxed);
  size_t bytes = 0;
  for (const DenseSliceView& d : m.dense) bytes += d.data.size();
  for (const SparseSliceView& sp : m.sparse) bytes += sp.keys.size() + sp.values.size();
  metrics::AtomicAdd(&jm.push_bytes, static_cast<double>(bytes));
  jm.push_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - t0));
  return s;
}

void ParameterServer::Pull(std::shared_ptr<const PullMessage> m, absl::Time rpc_deadline,
                           PullCallback done) {
  auto job = FindJob(m->job_id);
  if (job.ok()) {
    if (absl::Status s = CheckRankCaller(m->job_id, m->rank, m->incarnation, m->caller, "pull"); !s.ok()) {
      CountRejected(1, s);
      done(s);
      return;
    }
  }
  auto map = job.ok() ? Map() : job.status();
  if (!map.ok()) {
    CountRejected(1, map.status());
    done(map.status());
    return;
  }
  // Count and time the pull when it is answered.
  done = [this, t0 = absl::Now(), job = *job, done = std::move(done)](absl::StatusOr<PullResult> r) {
    if (!r.ok()) {
      CountRejected(1, r.status());
    } else {
      JobMetrics& jm = job->metrics();
      jm.pull_requests.fetch_add(1, std::memory_order_relaxed);
      size_t bytes = 0;
      for (const PullResult::Dense& d : r->dense) bytes += d.owner ? d.shared_size : d.data.size;
      for (const PullResult::Sparse& sp : r->sparse) bytes += sp.values.size;
      metrics::AtomicAdd(&jm.pull_bytes, static_cast<double>(bytes));
      jm.pull_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - t0));
    }
    done(std::move(r));
  };
  absl::Duration wait = options_.max_wait;
  if (m->wait_timeout_ms != 0) wait = std::min(wait, absl::Milliseconds(m->wait_timeout_ms));
  absl::Time deadline = absl::Now() + wait;
  if (rpc_deadline != absl::InfiniteFuture()) {
    deadline = std::min(deadline, rpc_deadline - kDeadlineMargin);
  }
  (*job)->Pull(std::move(m), map->map, map->self, deadline, std::move(done));
}

std::vector<v1::JobSparseTables> ParameterServer::SparseTables() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  std::vector<v1::JobSparseTables> out;
  for (const auto& job : jobs) {
    std::vector<v1::SparseTableStats> tables = job->SparseTableStats();
    if (tables.empty()) continue;
    v1::JobSparseTables& j = out.emplace_back();
    j.set_job_id(job->id());
    for (auto& t : tables) *j.add_tables() = std::move(t);
  }
  return out;
}

void ParameterServer::CollectMetrics(metrics::Scrape* out) const {
  std::vector<std::shared_ptr<Job>> jobs;
  std::shared_ptr<const ShardMap> map;
  uint32_t self = 0;
  bool draining = false;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
    map = map_;
    self = self_;
    draining = draining_;
  }
  out->Gauge("fulcrum_server_jobs", "Jobs this server holds tables of", {}, static_cast<double>(jobs.size()));
  out->Gauge("fulcrum_server_draining", "1 while the server drains for shutdown", {}, draining ? 1 : 0);
  out->Gauge("fulcrum_server_memory_limit_bytes",
             "Parameter memory all jobs together may hold on this server (--memory_limit_bytes)", {},
             static_cast<double>(memory_->limit()));
  out->Gauge("fulcrum_server_memory_used_bytes", "Parameter memory all jobs hold on this server now", {},
             static_cast<double>(memory_->used()));
  if (map) {
    out->Gauge("fulcrum_server_shard_map_version", "Version of the shard map this server serves", {},
               static_cast<double>(map->version()));
    double owned = 0;
    for (uint32_t v = 0; v < map->num_virtual_shards(); ++v) owned += map->owner(v) == self ? 1 : 0;
    out->Gauge("fulcrum_server_owned_virtual_shards", "Virtual shards this server owns under its map", {}, owned);
  }
  static const char* const kOps[2] = {"push", "pull"};
  for (int op = 0; op < 2; ++op) {
    for (int code = 1; code < 17; ++code) {
      // Every code, zeros too (32 series): a rate is defined from the start.
      const uint64_t n = rejected_[op][code].load(std::memory_order_relaxed);
      const std::string reason = metrics::LabelValue(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)));
      out->Counter("fulcrum_server_rejected_requests_total",
                   "Pushes and pulls refused, by the status code's name (invalid_argument, failed_precondition, ...)",
                   {{"op", kOps[op]}, {"reason", reason}}, static_cast<double>(n));
    }
  }
  for (const auto& job : jobs) job->CollectMetrics(out);
  if (cold_tier_) {
    const ColdTier::Counts c = cold_tier_->counts();
    out->Gauge("fulcrum_server_cold_tier_bytes",
               "Bytes of the cold tier's live files and memtables (rows spilled from memory, every job)", {},
               static_cast<double>(cold_tier_->DiskBytes()));
    out->Gauge("fulcrum_server_cold_tier_memory_bytes",
               "Memory RocksDB holds for the cold tier: memtables, indexes and filters, block cache", {},
               static_cast<double>(cold_tier_->MemoryBytes()));
    out->Counter("fulcrum_server_cold_tier_reads_total", "Batched reads of the cold tier (each a RocksDB MultiGet)", {},
                 static_cast<double>(c.reads));
    out->Counter("fulcrum_server_cold_tier_writes_total", "Batched writes of the cold tier", {},
                 static_cast<double>(c.writes));
    out->Counter("fulcrum_server_cold_tier_reopens_total",
                 "Times the cold tier reopened RocksDB after a failed write (a full or failing disk)", {},
                 static_cast<double>(c.reopens));
  }
  if (store_) {
    out->Counter("fulcrum_server_checkpoint_store_reopens_total",
                 "Times the checkpoint store reopened RocksDB after a failed write (a full or failing disk)", {},
                 static_cast<double>(store_->reopens()));
    if (absl::StatusOr<CheckpointStore::DiskUse> disk = store_->Disk(); disk.ok()) {
      out->Gauge("fulcrum_server_checkpoint_store_bytes", "Bytes of every file in the checkpoint store's directory",
                 {}, static_cast<double>(disk->bytes));
      out->Gauge("fulcrum_server_checkpoint_store_files", "Files in the checkpoint store's directory", {},
                 static_cast<double>(disk->files));
    }
    for (const auto& [name, value] : store_->Properties()) {
      std::string metric = "fulcrum_server_rocksdb_" + name;
      for (char& c : metric) c = c == '-' ? '_' : c;
      const bool bytes = name.find("size") != std::string::npos || name.find("bytes") != std::string::npos;
      if (bytes && metric.find("_bytes") == std::string::npos) metric += "_bytes";
      out->Gauge(metric, "RocksDB property rocksdb." + name + " of the checkpoint store", {},
                 static_cast<double>(value));
    }
  }
}

}  // namespace fulcrum
