#include "server/job.h"

#include "server/job_internal.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/errors.h"
#include "common/parallel.h"
#include "common/status_macros.h"
#include "server/cold_tier.h"

namespace fulcrum {
namespace job_internal {

absl::Status CheckKeyCount(size_t keys, absl::string_view what) {
  if (keys <= kMaxKeysPerRequest) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(what, " carries ", keys, " sparse keys; the limit is ",
                                                   kMaxKeysPerRequest, " keys per request (split it)"));
}

std::string Who(const std::string& worker, uint32_t rank) {
  return absl::StrCat("worker '", worker, "' (rank ", rank, ")");
}

absl::Status CheckDType(DType dtype, const std::string& table, absl::string_view field) {
  return Annotate(DTypeFromWire(static_cast<int>(dtype)).status(),
                  absl::StrCat("table '", table, "': ", field));
}

// Gathers a possibly multi-piece payload of `n` elements of dtype into fp32.
void DecodePayload(const Payload& p, DType dtype, size_t n, float* out) {
  if (dtype == DType::kFp32) {
    p.CopyTo(out);
    return;
  }
  if (const uint8_t* c = p.contiguous()) {
    DecodeFloats(c, n, dtype, out);
    return;
  }
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(p.size());
  p.CopyTo(scratch.data());
  DecodeFloats(scratch.data(), n, dtype, out);
}

std::vector<uint64_t> DecodeKeys(const Payload& p) {
  std::vector<uint64_t> keys(p.size() / 8);
  p.CopyTo(keys.data());
  return keys;
}

}  // namespace job_internal

using job_internal::CheckDType;
using job_internal::CheckKeyCount;
using job_internal::DecodeKeys;
using job_internal::DecodePayload;
using job_internal::kMaxKeysPerRequest;
using job_internal::kMaxParts;
using job_internal::kMaxPendingSteps;
using job_internal::kMaxTables;
using job_internal::kMaxWorkers;
using job_internal::Who;

absl::StatusOr<std::shared_ptr<Job>> Job::Create(const v1::PsJobSpec& spec,
                                                 uint32_t num_virtual_shards,
                                                 uint64_t default_quota_bytes,
                                                 DeadlineTimer* timer,
                                                 std::shared_ptr<MemoryQuota> memory_pool,
                                                 ColdTier* cold_tier,
                                                 std::shared_ptr<ParallelRunner> runner) {
  const std::string& id = spec.job_id();
  if (id.empty() || id.size() > 128 ||
      !std::all_of(id.begin(), id.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
      })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_id '", id, "' must be 1 to 128 characters of letters, digits, '-', '_' or '.'"));
  }
  if (spec.num_workers() == 0) return absl::InvalidArgumentError(absl::StrCat("job '", id, "': num_workers 0 must be at least 1"));
  if (spec.num_workers() > kMaxWorkers) {
    return absl::ResourceExhaustedError(absl::StrCat("job '", id, "': num_workers ", spec.num_workers(),
                                                     " exceeds the limit of ", kMaxWorkers, " workers per job"));
  }
  if (spec.tables_size() == 0) return absl::InvalidArgumentError(absl::StrCat("job '", id, "' declares no tables"));
  if (static_cast<size_t>(spec.tables_size()) > kMaxTables) {
    return absl::ResourceExhaustedError(absl::StrCat("job '", id, "' declares ", spec.tables_size(),
                                                     " tables; the limit is ", kMaxTables, " tables per job"));
  }
  Model model;
  switch (spec.consistency().model()) {
    case v1::ConsistencySpec::MODEL_UNSPECIFIED:
    case v1::ConsistencySpec::BSP: model = Model::kBsp; break;
    case v1::ConsistencySpec::SSP: model = Model::kSsp; break;
    case v1::ConsistencySpec::ASP: model = Model::kAsp; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("job '", id, "': consistency.model ",
                                                     static_cast<int>(spec.consistency().model()),
                                                     " is not BSP, SSP or ASP"));
  }
  if (model != Model::kSsp && spec.consistency().staleness() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", id, "': consistency.staleness applies only to SSP"));
  }
  if (model == Model::kBsp && spec.consistency().staleness_aware_lr()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", id, "': consistency.staleness_aware_lr applies only to SSP and ASP (BSP gradients are never stale)"));
  }
  if (!v1::Aggregation_IsValid(spec.aggregation())) {
    return absl::InvalidArgumentError(absl::StrCat("job '", id, "': aggregation ",
                                                   static_cast<int>(spec.aggregation()),
                                                   " is not MEAN or SUM"));
  }
  const uint64_t quota = spec.quota_bytes() != 0 ? spec.quota_bytes() : default_quota_bytes;
  std::shared_ptr<Job> job(new Job(spec, model, quota, timer, std::move(memory_pool)));
  job->num_virtual_shards_ = num_virtual_shards;
  job->runner_ = std::move(runner);
  uint64_t chunks = 0;
  for (const v1::TableSpec& t : spec.tables()) {
    if (job->tables_.contains(t.name())) {
      return absl::InvalidArgumentError(
          absl::StrCat("job '", id, "' declares table '", t.name(), "' twice"));
    }
    auto table = CreateTable(t, num_virtual_shards, &job->quota_);
    if (!table.ok()) return Annotate(table.status(), absl::StrCat("job '", id, "'"));
    if (!(*table)->is_dense() && static_cast<SparseTable*>(table->get())->lifecycle().spill) {
      RETURN_IF_ERROR(job->AttachColdTier(static_cast<SparseTable*>(table->get()), cold_tier));
    }
    if ((*table)->is_dense()) chunks += static_cast<DenseTable*>(table->get())->num_chunks();
    if (chunks > kMaxDenseChunks) {
      return absl::ResourceExhaustedError(absl::StrCat("job '", id, "': its dense tables up to '", t.name(), "' make ",
                                                       chunks, " chunks, past the limit of ", kMaxDenseChunks,
                                                       " chunks per job; raise chunk_elements"));
    }
    job->tables_.emplace(t.name(), std::move(table).value());
  }
  return job;
}

Job::Job(const v1::PsJobSpec& spec, Model model, uint64_t quota, DeadlineTimer* timer,
         std::shared_ptr<MemoryQuota> memory_pool)
    : spec_(spec),
      model_(model),
      num_workers_(spec.num_workers()),
      staleness_(spec.consistency().staleness()),
      staleness_lr_(model != Model::kBsp && spec.consistency().staleness_aware_lr()),
      mean_(spec.aggregation() != v1::SUM),
      timer_(timer),
      quota_(spec.job_id(), quota, std::move(memory_pool)) {
  absl::MutexLock lock(&mu_);
  active_.assign(num_workers_, true);
  clock_.assign(num_workers_, 0);
  done_ahead_.resize(num_workers_);
  reads_.resize(num_workers_);
}

Job::~Job() {
  // Tables release their quota in their destructors; drop them first.
  tables_.clear();
  // No request holds the job any more: nothing writes its rows on disk.
  for (uint32_t space : cold_spaces_) {
    if (absl::Status s = cold_tier_->Drop(space); !s.ok()) {
      FLOG(WARNING) << "job '" << id() << "': its rows on disk stay until the server restarts: " << s;
    }
  }
}

absl::Status Job::AttachColdTier(SparseTable* table, ColdTier* tier) {
  if (tier == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", id(), "': table '", table->name(),
        "' spills rows to disk (storage.spill ROCKSDB), but this server has no data directory (start it with "
        "--data_dir) for its cold tier"));
  }
  // A space of this job's own, never one a deleted job of the same id
  // still drops: job ids come back (a job rolled back is created anew).
  static std::atomic<uint64_t> incarnation{0};
  cold_tier_ = tier;
  ASSIGN_OR_RETURN(const uint32_t space,
                   tier->Space(absl::StrCat(id(), "#", incarnation.fetch_add(1, std::memory_order_relaxed)),
                               table->name()));
  cold_spaces_.push_back(space);
  return table->AttachColdTier(tier, space);
}

absl::Status Job::MaterializeOwned(const ShardMap& map, uint32_t self) {
  for (auto& [name, table] : tables_) {
    if (!table->is_dense()) continue;
    auto* dense = static_cast<DenseTable*>(table.get());
    for (uint32_t c = 0; c < dense->num_chunks(); ++c) {
      if (map.owner(VShardOfChunk(dense->name_hash(), c, num_virtual_shards_)) == self) {
        RETURN_IF_ERROR(dense->EnsureChunk(c));
      }
    }
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------ push

absl::StatusOr<Table*> Job::FindTable(const std::string& name, bool dense) const {
  auto it = tables_.find(name);
  if (it == tables_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("job '", id(), "' has no table '", name, "'"));
  }
  if (it->second->is_dense() != dense) {
    return absl::InvalidArgumentError(
        dense ? absl::StrCat("table '", name, "' is sparse; send it as keys and rows, not chunks")
              : absl::StrCat("table '", name, "' is dense; send it as chunks, not keyed rows"));
  }
  return it->second.get();
}

Job::KeyGroups Job::GroupKeys(const SparseTable& table, std::vector<uint64_t> keys) const {
  KeyGroups g;
  const size_t n = keys.size();
  std::vector<uint32_t> vs(n);
  for (size_t i = 0; i < n; ++i) vs[i] = VShardOfKey(table.name_hash(), keys[i], num_virtual_shards_);
  g.idx.resize(n);
  if (n < num_virtual_shards_ / 4) {
    // Few keys for many shards: one sort by (shard, key, position).
    std::iota(g.idx.begin(), g.idx.end(), 0);
    std::sort(g.idx.begin(), g.idx.end(), [&](uint32_t a, uint32_t b) {
      if (vs[a] != vs[b]) return vs[a] < vs[b];
      return keys[a] != keys[b] ? keys[a] < keys[b] : a < b;
    });
    for (size_t i = 0; i < n; ++i) {
      if (i + 1 == n || vs[g.idx[i + 1]] != vs[g.idx[i]]) g.runs.push_back({vs[g.idx[i]], i + 1});
    }
    g.keys = std::move(keys);
    return g;
  }
  // By shard (counted, stable), then by (key, position) within each: the
  // same order, at a small sort a shard.
  std::vector<uint32_t> start(num_virtual_shards_ + 1, 0);
  for (size_t i = 0; i < n; ++i) ++start[vs[i] + 1];
  for (uint32_t v = 0; v < num_virtual_shards_; ++v) start[v + 1] += start[v];
  std::vector<uint32_t> at(start.begin(), start.end() - 1);
  for (size_t i = 0; i < n; ++i) g.idx[at[vs[i]]++] = static_cast<uint32_t>(i);
  for (uint32_t v = 0; v < num_virtual_shards_; ++v) {
    if (start[v] == start[v + 1]) continue;
    std::sort(g.idx.begin() + start[v], g.idx.begin() + start[v + 1], [&](uint32_t a, uint32_t b) {
      return keys[a] != keys[b] ? keys[a] < keys[b] : a < b;
    });
    g.runs.push_back({v, start[v + 1]});
  }
  g.keys = std::move(keys);
  return g;
}

absl::Status Job::CheckOwned(uint32_t vshard, const std::string& what, const ShardMap& map,
                             uint32_t self, uint64_t request_version) const {
  if (map.owner(vshard) == self) return absl::OkStatus();
  return WrongShardError(absl::StrCat(what, " is in virtual shard ", vshard, ", owned by server ",
                                      map.owner(vshard), " not server ", self,
                                      " under shard map version ", map.version(),
                                      " (request used version ", request_version, ")"),
                         map.version());
}

absl::Status Job::Decode(const PushMessage& m, const ShardMap& map, uint32_t self, Decoded* out) {
  // BSP keeps dense gradients to combine later, and gradients the sender
  // can still change must be copied before the NaN check; elsewhere they
  // are read in place.
  const bool copy_dense = model_ == Model::kBsp || m.volatile_payload;
  ASSIGN_OR_RETURN(const size_t total, CheckSlices(m, map, self, copy_dense));
  out->grads.resize(total);
  RETURN_IF_ERROR(DecodeSlices(m, map, self, copy_dense, out));
  return CheckFinite(m, *out);
}

absl::StatusOr<size_t> Job::CheckSlices(const PushMessage& m, const ShardMap& map, uint32_t self,
                                        bool copy_dense) const {
  const std::string from = absl::StrCat(" in push from ", Who(m.worker_id, m.rank));
  // Shapes and ownership; the floats to decode.
  size_t total = 0;
  for (const DenseSliceView& d : m.dense) {
    ASSIGN_OR_RETURN(Table * table, FindTable(d.table, true));
    auto* t = static_cast<DenseTable*>(table);
    RETURN_IF_ERROR(CheckDType(d.dtype, d.table, "gradient"));
    if (d.chunk >= t->num_chunks()) {
      return absl::InvalidArgumentError(absl::StrCat("table '", d.table, "' has ", t->num_chunks(),
                                                     " chunks; push names chunk ", d.chunk));
    }
    const size_t want = size_t{t->ChunkLength(d.chunk)} * DTypeSize(d.dtype);
    if (d.data.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", d.table, "' chunk ", d.chunk, " expects ", t->ChunkLength(d.chunk), " ",
          DTypeName(d.dtype), " elements (", want, " bytes), got ", d.data.size(), " bytes", from));
    }
    RETURN_IF_ERROR(CheckOwned(VShardOfChunk(t->name_hash(), d.chunk, num_virtual_shards_),
                               absl::StrCat("table '", d.table, "' chunk ", d.chunk), map, self,
                               m.shard_map_version));
    if (copy_dense) total += t->ChunkLength(d.chunk);
  }
  size_t push_keys = 0;
  for (const SparseSliceView& s : m.sparse) push_keys += s.keys.size() / 8;
  RETURN_IF_ERROR(CheckKeyCount(push_keys, "push"));
  for (const SparseSliceView& s : m.sparse) {
    ASSIGN_OR_RETURN(Table * table, FindTable(s.table, false));
    auto* t = static_cast<SparseTable*>(table);
    RETURN_IF_ERROR(CheckDType(s.dtype, s.table, "gradient"));
    if (s.keys.size() % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("table '", s.table, "': keys field has ",
                                                     s.keys.size(),
                                                     " bytes, not a multiple of 8 (uint64)"));
    }
    const size_t nkeys = s.keys.size() / 8;
    const size_t want = nkeys * t->dim() * DTypeSize(s.dtype);
    if (s.values.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", s.table, "' expects dim ", t->dim(), ": ", nkeys, " keys need ", want,
          " bytes of ", DTypeName(s.dtype), " values, got ", s.values.size(), from));
    }
    total += nkeys * t->dim();
  }
  return total;
}

absl::Status Job::DecodeSlices(const PushMessage& m, const ShardMap& map, uint32_t self, bool copy_dense,
                               Decoded* out) const {
  // Pass 2: decode, group sparse keys by virtual shard and check ownership
  // once per shard.
  size_t offset = 0;
  for (const DenseSliceView& d : m.dense) {
    auto* t = static_cast<DenseTable*>(tables_.find(d.table)->second.get());
    const size_t n = t->ChunkLength(d.chunk);
    if (!copy_dense) {
      out->dense.push_back({t, d.chunk, nullptr, &d.data, d.dtype});
      continue;
    }
    DecodePayload(d.data, d.dtype, n, out->grads.data() + offset);
    out->dense.push_back({t, d.chunk, out->grads.data() + offset});
    offset += n;
  }
  for (const SparseSliceView& s : m.sparse) {
    auto* t = static_cast<SparseTable*>(tables_.find(s.table)->second.get());
    KeyGroups groups = GroupKeys(*t, DecodeKeys(s.keys));
    size_t begin = 0;
    for (const auto& [v, end] : groups.runs) {
      RETURN_IF_ERROR(CheckOwned(v, absl::StrCat("table '", s.table, "' key ", groups.keys[groups.idx[begin]]),
                                 map, self, m.shard_map_version));
      begin = end;
    }
    const size_t n = groups.keys.size() * t->dim();
    DecodePayload(s.values, s.dtype, n, out->grads.data() + offset);
    out->sparse.push_back({t, std::move(groups), out->grads.data() + offset});
    offset += n;
  }
  return absl::OkStatus();
}

absl::Status Job::CheckFinite(const PushMessage& m, const Decoded& d) {
  // Check finiteness slice by slice, naming the first offending one.
  std::string where;
  for (const DenseItem& item : d.dense) {
    const size_t n = item.table->ChunkLength(item.chunk);
    const bool finite =
        item.src != nullptr
            ? ForEachFloatBlock(*item.src, item.dtype, n,
                                [](const float* b, size_t, size_t len) { return AllFinite(b, len); })
            : AllFinite(item.g, n);
    if (!finite) {
      where = absl::StrCat("table '", item.table->name(), "' chunk ", item.chunk);
      break;
    }
  }
  for (size_t i = 0; where.empty() && i < d.sparse.size(); ++i) {
    const SparseItem& sp = d.sparse[i];
    if (!AllFinite(sp.g, sp.groups.keys.size() * sp.table->dim())) {
      where = absl::StrCat("table '", sp.table->name(), "'");
    }
  }
  if (!where.empty()) {
    rejected_nonfinite_.fetch_add(1, std::memory_order_relaxed);
    return absl::InvalidArgumentError(absl::StrCat("gradient for ", where, " from ",
                                                    Who(m.worker_id, m.rank), " at step ", m.step,
                                                    " contains NaN or Inf; push rejected, nothing applied"));
  }
  return absl::OkStatus();
}

absl::Status Job::Prepare(const Decoded& d) {
  for (const DenseItem& item : d.dense) RETURN_IF_ERROR(item.table->EnsureChunk(item.chunk));
  for (const SparseItem& item : d.sparse) {
    const KeyGroups& g = item.groups;
    size_t begin = 0;
    for (const auto& [v, end] : g.runs) {
      RETURN_IF_ERROR(item.table->EnsureRows(v, g.keys.data(), g.idx.data() + begin, end - begin));
      begin = end;
    }
  }
  return absl::OkStatus();
}

absl::Status Job::ApplySparse(SparseTable* table, const KeyGroups& g, float* grads, uint64_t step, float lr_scale) {
  const uint32_t dim = table->dim();
  const uint64_t* keys = g.keys.data();
  std::vector<uint32_t> unique;
  size_t begin = 0;
  for (const auto& [v, end] : g.runs) {
    // Keys are sorted within the shard: sum duplicates into their first
    // occurrence (in request order) and apply each row once.
    unique.clear();
    for (size_t i = begin; i < end; ++i) {
      const uint32_t k = g.idx[i];
      if (!unique.empty() && keys[k] == keys[unique.back()]) {
        float* dst = grads + size_t{unique.back()} * dim;
        const float* src = grads + size_t{k} * dim;
        for (uint32_t j = 0; j < dim; ++j) dst[j] += src[j];
      } else {
        unique.push_back(k);
      }
    }
    RETURN_IF_ERROR(table->Apply(v, keys, unique.data(), unique.size(), grads, step, lr_scale));
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status Job::ApplyDecoded(Decoded& d) {
  for (const DenseItem& item : d.dense) {
    RETURN_IF_ERROR(item.src != nullptr ? item.table->Apply(item.chunk, *item.src, item.dtype, d.step, d.lr_scale)
                                        : item.table->Apply(item.chunk, item.g, d.step, d.lr_scale));
  }
  for (SparseItem& item : d.sparse) {
    RETURN_IF_ERROR(ApplySparse(item.table, item.groups, item.g, d.step, d.lr_scale));
  }
  return absl::OkStatus();
}

bool Job::RecordPartLocked(uint32_t rank, uint64_t step, uint32_t num_parts, uint32_t incarnation,
                           Decoded* bsp_part, absl::Status* error) {
  std::vector<RankStep>& ranks = steps_[step];
  if (ranks.empty()) ranks.resize(num_workers_);
  RankStep& rs = ranks[rank];
  if (!rs.empty() && incarnation != rs.incarnation) {
    if (incarnation < rs.incarnation) {
      *error = absl::FailedPreconditionError(absl::StrCat("a part of step ", step, " from rank ", rank,
                                                          "'s incarnation ", incarnation, ", which incarnation ",
                                                          rs.incarnation, " replaced"));
      return false;
    }
    // The parts a lost worker sent before it died: its replacement sends
    // the whole step again. Mixed with the new parts they would count one
    // part twice and leave another out (the step's gradient would differ
    // from an undisturbed run's).
    superseded_parts_.fetch_add(rs.received, std::memory_order_relaxed);
    FLOG(INFO) << "job '" << id() << "': dropping " << rs.received << " part(s) of step " << step << " from rank "
               << rank << "'s incarnation " << rs.incarnation << "; incarnation " << incarnation
               << " sends the step again";
    rs = RankStep();
  }
  rs.incarnation = incarnation;
  if (num_parts != 0 && rs.num_parts != 0 && rs.num_parts != num_parts) {
    *error = absl::InvalidArgumentError(absl::StrCat("rank ", rank, " announced ", rs.num_parts,
                                                     " parts for step ", step, ", then ",
                                                     num_parts));
    return false;
  }
  const uint32_t total = num_parts != 0 ? num_parts : rs.num_parts;
  if ((total != 0 && rs.received >= total) || rs.received >= kMaxParts) {
    *error = absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " already sent all ", total != 0 ? total : rs.received, " parts for step ", step));
    return false;
  }
  if (num_parts != 0) rs.num_parts = num_parts;
  ++rs.received;
  if (bsp_part != nullptr) rs.parts.push_back(std::move(*bsp_part));
  const bool complete = rs.complete();
  if (complete && model_ != Model::kBsp) {
    // Clocks only matter to SSP/ASP; BSP tracks completion through steps_.
    done_ahead_[rank].insert(step);
    while (done_ahead_[rank].count(clock_[rank])) {
      done_ahead_[rank].erase(clock_[rank]);
      ++clock_[rank];
    }
    ++updates_;
    if (staleness_lr_) {
      // Reads for steps before the rank's clock serve no push to come; the
      // latest of them stays, for a step pushed without a pull of its own.
      auto& reads = reads_[rank];
      auto keep = reads.lower_bound(clock_[rank]);
      if (keep != reads.begin()) reads.erase(reads.begin(), std::prev(keep));
    }
    // Outside BSP steps_ only counts parts: forget this rank's count, and the
    // step once no rank has parts of it in flight.
    rs = RankStep();
    if (std::all_of(ranks.begin(), ranks.end(),
                    [](const RankStep& x) { return x.empty(); })) {
      steps_.erase(step);
    }
  }
  return complete;
}

absl::Status Job::CheckIncarnation(uint32_t incarnation, const std::string& worker, uint32_t rank,
                                  const char* what) const {
  const uint32_t min = min_incarnation_.load();
  if (incarnation >= min) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, " from ", Who(worker, rank), " is of incarnation ",
                                                    incarnation, "; job '", id(),
                                                    "' was restored from a checkpoint for incarnation ", min,
                                                    " onwards"));
}

absl::Status Job::CheckPush(const PushMessage& m) const {
  RETURN_IF_ERROR(CheckIncarnation(m.incarnation, m.worker_id, m.rank, "push"));
  if (m.worker_id.empty()) {
    return absl::InvalidArgumentError("push has no worker_id; (worker_id, seq) identifies a push");
  }
  if (m.rank >= num_workers_) {
    return absl::InvalidArgumentError(absl::StrCat("push from worker '", m.worker_id, "' has rank ",
                                                   m.rank, " but job '", id(), "' has ",
                                                   num_workers_, " workers"));
  }
  if (m.more_parts && m.num_parts != 0) {
    return absl::InvalidArgumentError(absl::StrCat("push num_parts ", m.num_parts, " must be 0 with more_parts"));
  }
  if (m.num_parts > kMaxParts) {
    return absl::ResourceExhaustedError(
        absl::StrCat("push num_parts ", m.num_parts, " exceeds the limit of ", kMaxParts, " parts per step"));
  }
  if (m.unclocked && !m.dense.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unclocked push from ", Who(m.worker_id, m.rank),
                                                   " carries dense table '", m.dense.front().table,
                                                   "'; unclocked pushes carry sparse rows only"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Job::AdmitPush(const PushMessage& m, PushResult* out) {
  // A retry of a push already taken is acknowledged before anything else:
  // its step may have been applied since.
  if (!dedup_.Begin(m.worker_id, m.seq)) {
    duplicates_.fetch_add(1, std::memory_order_relaxed);
    out->duplicate = true;
    absl::MutexLock lock(&mu_);
    out->applied_step = applied_step_;
    return true;
  }
  // No steps to speak of: applied on arrival.
  if (model_ == Model::kAsp || m.unclocked) return false;
  absl::Status bad;
  {
    absl::MutexLock lock(&mu_);
    // A step this rank already completed here (a lost worker's replacement
    // resumes from the slowest server's clock and pushes again what other
    // servers already had, or its predecessor delivered before dying) is
    // acknowledged, not applied twice.
    bool done;
    if (model_ == Model::kSsp) {
      done = m.step < clock_[m.rank] || done_ahead_[m.rank].count(m.step) != 0;
    } else {
      auto pending = steps_.find(m.step);
      done = m.step < applied_step_ || (pending != steps_.end() && pending->second[m.rank].complete());
    }
    if (done) {
      duplicates_.fetch_add(1, std::memory_order_relaxed);
      out->duplicate = true;
      out->applied_step = applied_step_;
      return true;
    }
    if (model_ == Model::kBsp && m.step >= applied_step_ + kMaxPendingSteps) {
      bad = absl::FailedPreconditionError(absl::StrCat("push from ", Who(m.worker_id, m.rank), " is for step ", m.step,
                                                       ", more than ", kMaxPendingSteps, " steps ahead of step ",
                                                       applied_step_, " still being collected"));
    } else if (model_ == Model::kBsp && !active_[m.rank]) {
      bad = absl::FailedPreconditionError(
          absl::StrCat(Who(m.worker_id, m.rank), " is not an active worker of job '", id(), "'"));
    }
  }
  if (!bad.ok()) {
    dedup_.Abort(m.worker_id, m.seq);
    return bad;
  }
  return false;
}

float Job::PushRateScale(const PushMessage& m) {
  float scale = m.lr_scale;
  if (m.unclocked) return scale;  // a step's rows, not a round's
  const bool by_samples = m.samples != 0 && model_ != Model::kBsp;
  if (!by_samples && !staleness_lr_) return scale;
  uint64_t tau = 1;
  {
    absl::MutexLock lock(&mu_);
    if (by_samples) {
      // One rank's share of a round, applied on its own: its rate scaled by
      // its samples over the mean per push so far (1 exactly while every
      // push covers the same samples) and, under mean aggregation, by
      // 1 / workers, so a round's pushes from every rank add up to their
      // mean, as BSP's.
      samples_sum_ += m.samples;
      ++samples_pushes_;
      const double share = mean_ ? 1.0 / num_workers_ : 1.0;
      scale *= static_cast<float>(static_cast<double>(m.samples) * static_cast<double>(samples_pushes_) /
                                  static_cast<double>(samples_sum_) * share);
    }
    if (staleness_lr_) tau = StalenessLocked(m.rank, m.step);
  }
  if (staleness_lr_) {
    metrics_.push_staleness.Observe(static_cast<double>(tau));
    scale /= static_cast<float>(tau);
  }
  return scale;
}

absl::Status Job::ChargeBufferedPush(const PushMessage& m, Decoded* decoded) {
  // Buffered until every worker's part of the step arrives: count it
  // against the server's memory limit, so workers running ahead (up to
  // kMaxPendingSteps, in up to kMaxParts parts) cannot exhaust memory. The
  // step being collected is counted but never refused, so it can always
  // complete and free what waits behind it.
  if (model_ != Model::kBsp || quota_.pool() == nullptr) return absl::OkStatus();
  const uint64_t bytes = decoded->grads.capacity() * sizeof(float);
  uint64_t collecting;
  {
    absl::MutexLock lock(&mu_);
    collecting = applied_step_;
  }
  MemoryQuota& pool = *quota_.pool();
  uint64_t in_use;
  if (m.step <= collecting) {
    pool.Charge(bytes);
  } else if (!pool.TryAdd(bytes, &in_use)) {
    return pool.Exhausted(absl::StrCat("job '", id(), "': step ", m.step, "'s gradients from ", Who(m.worker_id, m.rank),
                                       ", buffered while step ", collecting, " is collected,"),
                          bytes, in_use);
  }
  decoded->hold = PoolHold(quota_.pool(), bytes);
  return absl::OkStatus();
}

absl::Status Job::Push(const PushMessage& m, const ShardMap& map, uint32_t self, PushResult* out) {
  RETURN_IF_ERROR(CheckPush(m));
  // A push that leaves num_parts out (proto3: 0) is one message.
  const uint32_t num_parts = m.more_parts ? 0 : std::max<uint32_t>(1, m.num_parts);
  ASSIGN_OR_RETURN(const bool taken_before, AdmitPush(m, out));
  if (taken_before) return absl::OkStatus();
  Decoded decoded;
  decoded.seq = m.seq;
  decoded.step = m.step;
  decoded.samples = m.samples;
  decoded.lr_scale = PushRateScale(m);
  // Outside BSP the decoded gradient dies with this call: reuse one buffer
  // per thread rather than faulting in fresh pages for every push.
  // BSP's are buffered until their step is applied, then kept for the
  // next step's pushes (Job::spare_grads_), for the same reason.
  thread_local GradBuffer scratch;
  const bool applied_now = model_ != Model::kBsp || m.unclocked;
  const bool reuse = applied_now;
  if (reuse) {
    decoded.grads.swap(scratch);
  } else {
    absl::MutexLock lock(&mu_);
    if (!spare_grads_.empty()) {
      decoded.grads = std::move(spare_grads_.back());
      spare_grads_.pop_back();
      spare_bytes_ -= decoded.grads.capacity() * sizeof(float);
    }
  }
  absl::Status s = Decode(m, map, self, &decoded);
  if (s.ok()) s = Prepare(decoded);
  if (s.ok() && !applied_now) s = ChargeBufferedPush(m, &decoded);
  if (s.ok() && applied_now) {
    const absl::Time t0 = absl::Now();
    s = ApplyDecoded(decoded);
    metrics_.apply_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  if (reuse) decoded.grads.swap(scratch);
  if (!s.ok()) {
    dedup_.Abort(m.worker_id, m.seq);
    return s;
  }
  if (m.unclocked) {
    // Rows of a step inside a local round: no part of a step or clock.
    pushes_applied_.fetch_add(1, std::memory_order_relaxed);
    unclocked_pushes_.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock lock(&mu_);
    out->applied_step = applied_step_;
    return absl::OkStatus();
  }
  return RecordPush(m, num_parts, &decoded, out);
}

absl::Status Job::RecordPush(const PushMessage& m, uint32_t num_parts, Decoded* decoded, PushResult* out) {
  std::vector<std::function<void(absl::Status)>> ready;
  bool drain = false;
  {
    absl::MutexLock lock(&mu_);
    absl::Status record;
    const bool complete = RecordPartLocked(m.rank, m.step, num_parts, m.incarnation,
                                           model_ == Model::kBsp ? decoded : nullptr, &record);
    if (!record.ok()) {
      dedup_.Abort(m.worker_id, m.seq);
      return record;
    }
    if (complete) {
      if (model_ == Model::kBsp) drain = !applying_ && StepCompleteLocked(applied_step_);
      else CollectReadyLocked(&ready);
    }
    out->applied_step = applied_step_;
  }
  pushes_applied_.fetch_add(1, std::memory_order_relaxed);
  absl::Status drained = Resume(drain, &ready);
  if (drain) {
    absl::MutexLock lock(&mu_);
    out->applied_step = applied_step_;
  }
  return drained;
}

std::vector<float> Job::RankWeights(const std::vector<RankStep>& ranks, const std::vector<bool>& active) {
  std::vector<float> weight(ranks.size(), 1.0f);
  std::vector<uint64_t> samples(ranks.size(), 0);
  uint64_t total = 0, first = 0;
  uint32_t n = 0;
  bool differ = false;
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    if (!active[r]) continue;
    for (const Decoded& part : ranks[r].parts) samples[r] = std::max(samples[r], part.samples);
    if (samples[r] == 0) return weight;  // a rank without samples: the plain mean
    if (n == 0) first = samples[r];
    differ |= samples[r] != first;
    total += samples[r];
    ++n;
  }
  if (!differ) return weight;
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    if (active[r]) weight[r] = static_cast<float>(static_cast<double>(samples[r]) * n / static_cast<double>(total));
  }
  return weight;
}

void Job::KeepSpareGradsLocked(std::vector<RankStep>& ranks) {
  uint64_t step_bytes = 0;
  for (RankStep& r : ranks) {
    for (Decoded& part : r.parts) {
      const uint64_t bytes = part.grads.capacity() * sizeof(float);
      if (bytes == 0) continue;
      step_bytes += bytes;
      spare_bytes_ += bytes;
      spare_grads_.push_back(std::move(part.grads));
    }
  }
  // At most one step's worth, the newest buffers: what the next step needs
  // when the steps are alike, and nothing much when they shrink.
  while (spare_bytes_ > step_bytes && !spare_grads_.empty()) {
    spare_bytes_ -= spare_grads_.front().capacity() * sizeof(float);
    spare_grads_.pop_front();
  }
}

bool Job::StepCompleteLocked(uint64_t step) const {
  auto it = steps_.find(step);
  if (it == steps_.end()) return false;
  bool any = false;
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (!active_[r]) continue;
    any = true;
    if (!it->second[r].complete()) return false;
  }
  return any;
}

void Job::Expire(uint64_t waiter_id) {
  std::function<void(absl::Status)> resume;
  std::string message;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(waiter_id);
    if (it == waiters_.end()) return;
    const Waiter& w = it->second;
    message = absl::StrCat("job '", id(), "': pull for step ", w.step, " by ",
                           Who(w.worker, w.rank), " timed out after ",
                           absl::FormatDuration(absl::Now() - w.start), ": ",
                           WaitReasonLocked(w.step));
    resume = std::move(it->second.resume);
    waiters_.erase(it);
  }
  resume(absl::DeadlineExceededError(message));
}

void Job::Shutdown(const absl::Status& reason) {
  std::vector<std::function<void(absl::Status)>> waiting;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    shutdown_reason_ = reason;
    for (auto& [id, w] : waiters_) {
      timer_->Cancel(w.timer_id);
      waiting.push_back(std::move(w.resume));
    }
    waiters_.clear();
  }
  for (auto& r : waiting) r(reason);
}

absl::Status Job::SetActiveWorkers(const std::vector<uint32_t>& ranks) {
  std::vector<std::function<void(absl::Status)>> ready;
  bool drain = false;
  {
    absl::MutexLock lock(&mu_);
    std::vector<bool> active(num_workers_, false);
    for (uint32_t r : ranks) {
      if (r >= num_workers_) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", r, " is out of range for ", num_workers_, " workers"));
      }
      active[r] = true;
    }
    active_ = std::move(active);
    if (model_ == Model::kBsp) drain = !applying_ && StepCompleteLocked(applied_step_);
    else CollectReadyLocked(&ready);
  }
  return Resume(drain, &ready);
}

}  // namespace fulcrum
