#include "worker/local_ps_client.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/shard_map.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

Future<absl::Status> Ready(absl::Status s) {
  Promise<absl::Status> p;
  p.Set(std::move(s));
  return p.future();
}

absl::StatusOr<const v1::TableSpec*> FindTable(const v1::PsJobSpec& spec, const std::string& name) {
  for (const auto& t : spec.tables()) {
    if (t.name() == name) return &t;
  }
  return absl::NotFoundError(absl::StrCat("job ", spec.job_id(), " has no table \"", name, "\""));
}

}  // namespace

absl::StatusOr<std::shared_ptr<ParameterServer>> LocalPsClient::NewServer(ParameterServerOptions options,
                                                                          uint32_t virtual_shards) {
  ASSIGN_OR_RETURN(ShardMap map, ShardMap::RoundRobin(1, virtual_shards, {"in-process"}));
  options.server_index = 0;
  options.shard_map = map.ToProto();
  ASSIGN_OR_RETURN(std::unique_ptr<ParameterServer> ps, ParameterServer::Create(std::move(options)));
  return std::shared_ptr<ParameterServer>(std::move(ps));
}

LocalPsClient::LocalPsClient(std::shared_ptr<ParameterServer> server, std::string worker_id, uint32_t rank)
    : server_(std::move(server)), worker_id_(std::move(worker_id)), rank_(rank) {}

absl::Status LocalPsClient::CreateJob(const v1::PsJobSpec& spec) {
  RETURN_IF_ERROR(server_->CreateJob(spec).status());
  absl::MutexLock l(&mu_);
  jobs_[spec.job_id()] = std::make_shared<const v1::PsJobSpec>(spec);
  return absl::OkStatus();
}

absl::Status LocalPsClient::OpenJob(const std::string& job_id) {
  ASSIGN_OR_RETURN(v1::GetJobResponse r, server_->GetJob(job_id));
  absl::MutexLock l(&mu_);
  jobs_[job_id] = std::make_shared<const v1::PsJobSpec>(r.spec());
  return absl::OkStatus();
}

absl::StatusOr<v1::GetJobResponse> LocalPsClient::GetJobStats(const std::string& job_id, size_t server) {
  if (server != 0) {
    return absl::OutOfRangeError(
        absl::StrCat("server ", server, ": a LocalPsClient has one server, in its own process (index 0)"));
  }
  return server_->GetJob(job_id);
}

absl::Status LocalPsClient::DeleteJob(const std::string& job_id) {
  RETURN_IF_ERROR(server_->DeleteJob(job_id).status());
  absl::MutexLock l(&mu_);
  jobs_.erase(job_id);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const v1::PsJobSpec>> LocalPsClient::Spec(const std::string& job_id) {
  {
    absl::MutexLock l(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) return it->second;
  }
  RETURN_IF_ERROR(OpenJob(job_id));
  absl::MutexLock l(&mu_);
  return jobs_[job_id];
}

Future<absl::Status> LocalPsClient::PushAsync(const std::string& job_id, const PushBatch& batch) {
  absl::StatusOr<std::shared_ptr<const v1::PsJobSpec>> spec = Spec(job_id);
  if (!spec.ok()) return Ready(spec.status());
  auto map = server_->GetShardMap();
  if (!map.ok()) return Ready(map.status());
  PushMessage m;
  m.job_id = job_id;
  m.worker_id = worker_id_;
  m.seq = ++seq_;
  m.rank = rank_;
  m.step = batch.step;
  m.lr_scale = batch.lr_scale;
  m.samples = batch.samples;
  m.unclocked = batch.unclocked;
  m.shard_map_version = map->version();
  for (const DenseGradient& g : batch.dense) {
    absl::StatusOr<const v1::TableSpec*> found = FindTable(**spec, g.table);
    if (!found.ok()) return Ready(found.status());
    const v1::TableSpec* t = *found;
    const size_t ce = ChunkElements(*t);
    for (size_t begin = 0, c = 0; begin < g.size; begin += ce, ++c) {
      const size_t n = std::min(ce, g.size - begin);
      m.dense.push_back({g.table, static_cast<uint32_t>(c), DType::kFp32, Payload(g.data + begin, n * 4)});
    }
    if (g.size == 0) m.dense.push_back({g.table, 0, DType::kFp32, Payload()});
  }
  for (const SparseGradient& g : batch.sparse) {
    absl::StatusOr<const v1::TableSpec*> found = FindTable(**spec, g.table);
    if (!found.ok()) return Ready(found.status());
    const v1::TableSpec* t = *found;
    if (g.num_keys == 0) continue;
    m.sparse.push_back({g.table, DType::kFp32, Payload(g.keys, g.num_keys * 8),
                        Payload(g.values, g.num_keys * t->dim() * 4)});
  }
  // Groups of one step (PushBatch::last): "more follow" until the last,
  // which counts them all. Counted once the message is known to be sent.
  if (!batch.unclocked) {
    absl::MutexLock l(&mu_);
    uint32_t& sent = open_steps_[{job_id, batch.step}];
    ++sent;
    m.num_parts = batch.last ? sent : 0;
    m.more_parts = !batch.last;
    if (batch.last) open_steps_.erase({job_id, batch.step});
  }
  PushResult r;
  return Ready(server_->Push(m, &r));
}

Future<absl::Status> LocalPsClient::PullAsync(const std::string& job_id, const PullBatch& batch) {
  absl::StatusOr<std::shared_ptr<const v1::PsJobSpec>> spec = Spec(job_id);
  if (!spec.ok()) return Ready(spec.status());
  auto map = server_->GetShardMap();
  if (!map.ok()) return Ready(map.status());
  auto m = std::make_shared<PullMessage>();
  m->job_id = job_id;
  m->worker_id = worker_id_;
  m->rank = rank_;
  m->step = batch.step;
  m->unclocked = batch.unclocked;
  m->shard_map_version = map->version();
  m->dtype = DType::kFp32;
  // Where each result goes: dense chunk starts and sparse outputs.
  struct Dest {
    std::map<std::pair<std::string, uint32_t>, std::pair<float*, size_t>> dense;  // -> (out, elements)
    std::map<std::string, std::pair<float*, size_t>> sparse;                      // -> (out, floats)
  };
  auto dest = std::make_shared<Dest>();
  for (const DenseTarget& d : batch.dense) {
    absl::StatusOr<const v1::TableSpec*> found = FindTable(**spec, d.table);
    if (!found.ok()) return Ready(found.status());
    const v1::TableSpec* t = *found;
    const size_t ce = ChunkElements(*t);
    for (size_t begin = 0, c = 0; begin < d.size; begin += ce, ++c) {
      m->dense.push_back({d.table, static_cast<uint32_t>(c)});
      dest->dense[{d.table, static_cast<uint32_t>(c)}] = {d.out + begin, std::min(ce, d.size - begin)};
    }
  }
  for (const SparseTarget& s : batch.sparse) {
    absl::StatusOr<const v1::TableSpec*> found = FindTable(**spec, s.table);
    if (!found.ok()) return Ready(found.status());
    const v1::TableSpec* t = *found;
    if (s.num_keys == 0) continue;
    m->sparse.push_back({s.table, Payload(s.keys, s.num_keys * 8)});
    dest->sparse[s.table] = {s.out, s.num_keys * t->dim()};
  }
  Promise<absl::Status> promise;
  server_->Pull(m, absl::InfiniteFuture(), [dest, promise, step = batch.step, exact = batch.exact](
                                                absl::StatusOr<PullResult> r) {
    if (!r.ok()) {
      promise.Set(r.status());
      return;
    }
    if (exact && r->applied_step > step) {
      promise.Set(TornStepError(step, r->applied_step, "in-process"));
      return;
    }
    for (const PullResult::Dense& d : r->dense) {
      auto it = dest->dense.find({d.table, d.chunk});
      if (it == dest->dense.end()) continue;
      const void* src = d.shared != nullptr ? d.shared : d.data.data.get();
      const size_t bytes = d.shared != nullptr ? d.shared_size : d.data.size;
      std::memcpy(it->second.first, src, std::min(bytes, it->second.second * 4));
    }
    for (const PullResult::Sparse& s : r->sparse) {
      auto it = dest->sparse.find(s.table);
      if (it == dest->sparse.end()) continue;
      std::memcpy(it->second.first, s.values.data.get(), std::min(s.values.size, it->second.second * 4));
    }
    promise.Set(absl::OkStatus());
  });
  return promise.future();
}

}  // namespace fulcrum
