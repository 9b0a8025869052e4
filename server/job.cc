#include "server/job.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/errors.h"
#include "common/parallel.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

constexpr uint32_t kMaxWorkers = 65536;
constexpr uint32_t kMaxParts = 4096;
constexpr size_t kMaxTables = 1024;
// BSP buffers at most this many steps ahead of the first unapplied one.
constexpr uint64_t kMaxPendingSteps = 16;
// A BSP step's dense update is shared among cores from this many elements
// (512 KiB of fp32): below it, waking a helper costs about what it saves.
constexpr size_t kParallelApplyElements = size_t{1} << 17;
// Sparse keys in one push or pull: what fits kMaxPayloadBytes (4 MiB) of
// uint64 keys, the most a client that splits requests ever sends.
constexpr size_t kMaxKeysPerRequest = size_t{1} << 19;

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

}  // namespace

absl::StatusOr<std::shared_ptr<Job>> Job::Create(const v1::PsJobSpec& spec,
                                                 uint32_t num_virtual_shards,
                                                 uint64_t default_quota_bytes,
                                                 DeadlineTimer* timer,
                                                 std::shared_ptr<MemoryQuota> memory_pool) {
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
  uint64_t chunks = 0;
  for (const v1::TableSpec& t : spec.tables()) {
    if (job->tables_.contains(t.name())) {
      return absl::InvalidArgumentError(
          absl::StrCat("job '", id, "' declares table '", t.name(), "' twice"));
    }
    auto table = CreateTable(t, num_virtual_shards, &job->quota_);
    if (!table.ok()) return Annotate(table.status(), absl::StrCat("job '", id, "'"));
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
  std::iota(g.idx.begin(), g.idx.end(), 0);
  std::sort(g.idx.begin(), g.idx.end(), [&](uint32_t a, uint32_t b) {
    if (vs[a] != vs[b]) return vs[a] < vs[b];
    if (keys[a] != keys[b]) return keys[a] < keys[b];
    return a < b;
  });
  for (size_t i = 0; i < n; ++i) {
    if (i + 1 == n || vs[g.idx[i + 1]] != vs[g.idx[i]]) g.runs.push_back({vs[g.idx[i]], i + 1});
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
  const std::string from = absl::StrCat(" in push from ", Who(m.worker_id, m.rank));
  // Pass 1: validate shapes and ownership, size the fp32 buffer (BSP keeps
  // dense gradients to combine later, and gradients the sender can still
  // change must be copied before the NaN check; elsewhere they are read in
  // place).
  const bool copy_dense = model_ == Model::kBsp || m.volatile_payload;
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

  // Pass 2: decode, group sparse keys by virtual shard and check ownership
  // once per shard.
  out->grads.resize(total);
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
  // Check finiteness slice by slice, naming the first offending one.
  std::string where;
  for (const DenseItem& d : out->dense) {
    const size_t n = d.table->ChunkLength(d.chunk);
    const bool finite =
        d.src != nullptr
            ? ForEachFloatBlock(*d.src, d.dtype, n,
                                [](const float* b, size_t, size_t len) { return AllFinite(b, len); })
            : AllFinite(d.g, n);
    if (!finite) {
      where = absl::StrCat("table '", d.table->name(), "' chunk ", d.chunk);
      break;
    }
  }
  for (size_t i = 0; where.empty() && i < out->sparse.size(); ++i) {
    const SparseItem& sp = out->sparse[i];
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
  if (model_ == Model::kAsp) return false;  // no steps to speak of: applied on arrival
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
  const bool reuse = model_ != Model::kBsp;
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
  if (s.ok()) s = ChargeBufferedPush(m, &decoded);
  if (s.ok() && model_ != Model::kBsp) {
    const absl::Time t0 = absl::Now();
    s = ApplyDecoded(decoded);
    metrics_.apply_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  if (reuse) decoded.grads.swap(scratch);
  if (!s.ok()) {
    dedup_.Abort(m.worker_id, m.seq);
    return s;
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

absl::Status Job::Resume(bool drain, std::vector<std::function<void(absl::Status)>>* ready) {
  absl::Status s = drain ? DrainBspSteps(ready) : absl::OkStatus();
  for (auto& r : *ready) r(absl::OkStatus());
  return s;
}

absl::Status Job::DrainBspSteps(std::vector<std::function<void(absl::Status)>>* ready) {
  absl::Status result;
  mu_.Lock();
  if (applying_) {
    mu_.Unlock();
    return result;
  }
  applying_ = true;
  while (!shut_down_ && holds_.count(applied_step_) == 0 && StepCompleteLocked(applied_step_)) {
    const uint64_t step = applied_step_;
    std::vector<RankStep> ranks = std::move(steps_[step]);
    steps_.erase(step);
    std::vector<bool> active = active_;
    mu_.Unlock();

    // Combine in rank order, and within a rank in sequence order, so the sum
    // (and so the run) is bit-for-bit reproducible.
    uint32_t contributors = 0;
    double lr_scale_sum = 0;  // the step's rate: its ranks' mean lr_scale
    // A dense chunk's first contribution is its accumulator: the later ones
    // are added into that rank's decoded buffer, which this loop owns.
    struct Chunk {
      DenseTable* table;
      uint32_t chunk;
      float* acc;
    };
    std::vector<Chunk> dense_order;  // first-seen order
    absl::flat_hash_map<std::pair<DenseTable*, uint32_t>, size_t> dense;  // -> index in dense_order
    absl::flat_hash_map<SparseTable*, std::pair<absl::flat_hash_map<uint64_t, size_t>, std::vector<float>>> sparse;
    size_t dense_elements = 0;
    std::vector<SparseTable*> sparse_order;
    const std::vector<float> weight = RankWeights(ranks, active);
    for (uint32_t r = 0; r < ranks.size(); ++r) {
      if (!active[r]) continue;
      ++contributors;
      const float w = weight[r];
      auto& parts = ranks[r].parts;
      std::sort(parts.begin(), parts.end(),
                [](const Decoded& a, const Decoded& b) { return a.seq < b.seq; });
      lr_scale_sum += parts.empty() ? 1.0 : parts.front().lr_scale;
      for (Decoded& part : parts) {
        for (const DenseItem& d : part.dense) {
          const size_t n = d.table->ChunkLength(d.chunk);
          if (w != 1.0f) {
            for (size_t i = 0; i < n; ++i) d.g[i] *= w;
          }
          const float* g = d.g;
          auto [it, inserted] = dense.try_emplace({d.table, d.chunk}, dense_order.size());
          if (inserted) {
            dense_order.push_back({d.table, d.chunk, d.g});
            dense_elements += n;
          } else {
            float* acc = dense_order[it->second].acc;
            for (size_t i = 0; i < n; ++i) acc[i] += g[i];
          }
        }
        for (const SparseItem& s : part.sparse) {
          const uint32_t dim = s.table->dim();
          if (w != 1.0f) {
            for (size_t i = 0; i < s.groups.keys.size() * dim; ++i) s.g[i] *= w;
          }
          auto [it, inserted] = sparse.try_emplace(s.table);
          if (inserted) sparse_order.push_back(s.table);
          auto& [index, values] = it->second;
          for (size_t k = 0; k < s.groups.keys.size(); ++k) {
            const float* g = s.g + k * dim;
            auto [kit, kinserted] = index.try_emplace(s.groups.keys[k], values.size());
            if (kinserted) {
              values.insert(values.end(), g, g + dim);
            } else {
              float* acc = values.data() + kit->second;
              for (uint32_t j = 0; j < dim; ++j) acc[j] += g[j];
            }
          }
        }
      }
    }
    const float scale = mean_ && contributors > 0 ? 1.0f / static_cast<float>(contributors) : 1.0f;
    const float lr_scale = contributors > 0 ? static_cast<float>(lr_scale_sum / contributors) : 1.0f;
    const absl::Time apply_start = absl::Now();
    absl::Status s;
    // The workers wait for this step: apply its chunks on every core.
    std::vector<absl::Status> applied(dense_order.size());
    auto apply_chunk = [&](size_t k) {
      const auto& [table, chunk, g] = dense_order[k];
      if (scale != 1.0f) {
        const size_t n = table->ChunkLength(chunk);
        for (size_t i = 0; i < n; ++i) g[i] *= scale;
      }
      applied[k] = table->Apply(chunk, g, step, lr_scale);
    };
    if (dense_elements >= kParallelApplyElements) {
      ParallelRunner::Shared().ForEach(dense_order.size(), apply_chunk);
    } else {
      for (size_t k = 0; k < dense_order.size(); ++k) apply_chunk(k);
    }
    for (const absl::Status& a : applied) s.Update(a);
    for (SparseTable* t : sparse_order) {
      auto& [index, values] = sparse[t];
      if (scale != 1.0f) for (float& x : values) x *= scale;
      std::vector<uint64_t> keys(index.size());
      for (const auto& [key, off] : index) keys[off / t->dim()] = key;
      s.Update(ApplySparse(t, GroupKeys(*t, std::move(keys)), values.data(), step, lr_scale));
    }
    result.Update(s);
    metrics_.apply_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - apply_start));

    mu_.Lock();
    KeepSpareGradsLocked(ranks);
    applied_step_ = step + 1;
    CollectReadyLocked(ready);
  }
  applying_ = false;
  mu_.Unlock();
  return result;
}

// ------------------------------------------------------------------ pull

uint64_t Job::MinClockLocked() const {
  uint64_t min = UINT64_MAX;
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (active_[r]) min = std::min(min, clock_[r]);
  }
  return min;
}

bool Job::ReadyLocked(uint64_t step) const {
  switch (model_) {
    case Model::kBsp: return applied_step_ >= step;
    case Model::kSsp: return step <= staleness_ || MinClockLocked() >= step - staleness_;
    case Model::kAsp: return true;
  }
  return true;
}

std::string Job::WaitReasonLocked(uint64_t step) const {
  std::vector<std::string> missing;
  if (model_ == Model::kBsp) {
    auto it = steps_.find(applied_step_);
    for (uint32_t r = 0; r < num_workers_; ++r) {
      if (!active_[r]) continue;
      if (it == steps_.end() || !it->second[r].complete()) {
        missing.push_back(absl::StrCat(r));
      }
    }
    return absl::StrCat("step ", applied_step_, " waits for workers ", absl::StrJoin(missing, ", "));
  }
  const uint64_t need = step - staleness_;
  for (uint32_t r = 0; r < num_workers_; ++r) {
    if (active_[r] && clock_[r] < need) missing.push_back(absl::StrCat(r, " (at clock ", clock_[r], ")"));
  }
  return absl::StrCat("clock ", step, " waits for workers ", absl::StrJoin(missing, ", "),
                      " to reach clock ", need, " (staleness bound ", staleness_, ")");
}

void Job::CollectReadyLocked(std::vector<std::function<void(absl::Status)>>* ready) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (ReadyLocked(it->second.step)) {
      // A timer that already fired finds the waiter gone and does nothing.
      timer_->Cancel(it->second.timer_id);
      ready->push_back(std::move(it->second.resume));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
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

absl::Status Job::ValidatePull(const PullMessage& m, const ShardMap& map, uint32_t self,
                              std::vector<KeyGroups>* sparse) const {
  RETURN_IF_ERROR(CheckIncarnation(m.incarnation, m.worker_id, m.rank, "pull"));
  RETURN_IF_ERROR(CheckDType(m.dtype, "<response>", "pull"));
  if (m.rank >= num_workers_) {
    return absl::InvalidArgumentError(absl::StrCat("pull from worker '", m.worker_id, "' has rank ",
                                                   m.rank, " but job '", id(), "' has ",
                                                   num_workers_, " workers"));
  }
  for (const DenseChunkRef& d : m.dense) {
    ASSIGN_OR_RETURN(Table * table, FindTable(d.table, true));
    auto* t = static_cast<DenseTable*>(table);
    if (d.chunk >= t->num_chunks()) {
      return absl::InvalidArgumentError(absl::StrCat("table '", d.table, "' has ", t->num_chunks(),
                                                     " chunks; pull names chunk ", d.chunk));
    }
    RETURN_IF_ERROR(CheckOwned(VShardOfChunk(t->name_hash(), d.chunk, num_virtual_shards_),
                               absl::StrCat("table '", d.table, "' chunk ", d.chunk), map, self,
                               m.shard_map_version));
  }
  size_t pull_keys = 0;
  for (const SparseKeysView& s : m.sparse) pull_keys += s.keys.size() / 8;
  RETURN_IF_ERROR(CheckKeyCount(pull_keys, "pull"));
  for (const SparseKeysView& s : m.sparse) {
    ASSIGN_OR_RETURN(Table * table, FindTable(s.table, false));
    if (s.keys.size() % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat("table '", s.table, "': keys field has ",
                                                     s.keys.size(),
                                                     " bytes, not a multiple of 8 (uint64)"));
    }
    KeyGroups& g = sparse->emplace_back(
        GroupKeys(*static_cast<const SparseTable*>(table), DecodeKeys(s.keys)));
    size_t begin = 0;
    for (const auto& [v, end] : g.runs) {
      RETURN_IF_ERROR(CheckOwned(v, absl::StrCat("table '", s.table, "' key ", g.keys[g.idx[begin]]),
                                 map, self, m.shard_map_version));
      begin = end;
    }
  }
  return absl::OkStatus();
}

absl::Status Job::ReadSparse(SparseTable* table, const KeyGroups& g, float* out) {
  size_t begin = 0;
  for (const auto& [v, end] : g.runs) {
    RETURN_IF_ERROR(table->Read(v, g.keys.data(), g.idx.data() + begin, end - begin, out));
    begin = end;
  }
  return absl::OkStatus();
}

uint64_t Job::StalenessLocked(uint32_t rank, uint64_t step) const {
  const auto& reads = reads_[rank];
  auto it = reads.upper_bound(step);  // the read for `step`, or the latest before it
  if (it == reads.begin()) return 1;   // no pull seen: counted fresh
  return updates_ - std::prev(it)->second + 1;
}

void Job::RecordReadLocked(uint32_t rank, uint64_t step) {
  auto& reads = reads_[rank];
  // A step's first pull counts: its later parts read weights at least as new.
  reads.try_emplace(step, updates_);
  // A client pulling far ahead without pushing (ASP allows it) keeps only
  // the latest entries.
  while (reads.size() > kMaxReadsPerRank) reads.erase(reads.begin());
}

absl::StatusOr<PullResult> Job::Serve(const PullMessage& m, const std::vector<KeyGroups>& sparse) {
  PullResult result;
  if (staleness_lr_) {
    // Before the weights are read: an update landing during the read counts
    // as not seen, so staleness errs high (a smaller rate), never low.
    absl::MutexLock lock(&mu_);
    RecordReadLocked(m.rank, m.step);
  }
  const size_t esize = DTypeSize(m.dtype);
  thread_local std::vector<float> scratch;
  for (const DenseChunkRef& d : m.dense) {
    auto* t = static_cast<DenseTable*>(tables_.find(d.table)->second.get());
    const size_t n = t->ChunkLength(d.chunk);
    PullResult::Dense& out = result.dense.emplace_back();
    out.table = d.table;
    out.chunk = d.chunk;
    out.dtype = m.dtype;
    if (m.dtype == DType::kFp32) {
      // Served from the chunk's memory: no copy (the chunk copies itself if
      // updated before gRPC has sent it).
      ASSIGN_OR_RETURN(std::shared_ptr<const float[]> weights, t->Snapshot(d.chunk));
      out.shared = weights.get();
      out.shared_size = n * sizeof(float);
      out.owner = std::move(weights);
    } else {
      out.data = OwnedBuffer::Allocate(n * esize);
      RETURN_IF_ERROR(t->Read(d.chunk, m.dtype, out.data.data.get()));
    }
  }
  for (size_t i = 0; i < m.sparse.size(); ++i) {
    const SparseKeysView& s = m.sparse[i];
    auto* t = static_cast<SparseTable*>(tables_.find(s.table)->second.get());
    const size_t n = sparse[i].keys.size() * t->dim();
    PullResult::Sparse& out = result.sparse.emplace_back();
    out.table = s.table;
    out.dtype = m.dtype;
    out.values = OwnedBuffer::Allocate(n * esize);
    float* dst = reinterpret_cast<float*>(out.values.data.get());
    if (m.dtype != DType::kFp32) {
      scratch.resize(n);
      dst = scratch.data();
    }
    RETURN_IF_ERROR(ReadSparse(t, sparse[i], dst));
    if (m.dtype != DType::kFp32) EncodeFloats(dst, n, m.dtype, out.values.data.get());
  }
  absl::MutexLock lock(&mu_);
  result.applied_step = applied_step_;
  return result;
}

void Job::Pull(std::shared_ptr<const PullMessage> m, std::shared_ptr<const ShardMap> map,
               uint32_t self, absl::Time deadline, PullCallback done) {
  auto sparse = std::make_shared<std::vector<KeyGroups>>();
  absl::Status valid = ValidatePull(*m, *map, self, sparse.get());
  if (!valid.ok()) {
    done(valid);
    return;
  }
  std::shared_ptr<Job> me = shared_from_this();
  auto serve = [me, m, sparse, done](absl::Status s) {
    if (!s.ok()) {
      done(s);
      return;
    }
    done(me->Serve(*m, *sparse));
  };
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (model_ != Model::kBsp && !shut_down_) {
      const uint64_t min = MinClockLocked();
      metrics_.staleness.Observe(m->step > min ? static_cast<double>(m->step - min) : 0.0);
    }
    // A pull no worker could legitimately make waits for nothing but its
    // deadline: refuse it, and bound how many may wait (a hostile client
    // could otherwise park pulls until memory runs out).
    const uint64_t reachable = model_ == Model::kBsp   ? applied_step_ + kMaxPendingSteps + 1
                               : model_ == Model::kSsp ? MinClockLocked() + staleness_ + kMaxPendingSteps + 1
                                                       : ~uint64_t{0};
    const size_t max_waiters = size_t{16} * num_workers_ + 256;
    if (shut_down_) {
      refused = shutdown_reason_;
    } else if (m->step > reachable) {
      refused = absl::FailedPreconditionError(absl::StrCat(
          "pull for step ", m->step, " by ", Who(m->worker_id, m->rank), " is beyond step ", reachable,
          ", the furthest any worker of job '", id(), "' can be ahead"));
    } else if (ReadyLocked(m->step)) {
      // served below
    } else if (waiters_.size() >= max_waiters) {
      refused = absl::ResourceExhaustedError(absl::StrCat("job '", id(), "' already has ", waiters_.size(),
                                                          " pulls waiting; the limit is ", max_waiters,
                                                          " (16 per worker + 256)"));
    } else {
      const uint64_t wid = next_waiter_++;
      Waiter& w = waiters_[wid];
      w.step = m->step;
      w.rank = m->rank;
      w.worker = m->worker_id;
      w.start = absl::Now();
      w.resume = [me, start = w.start, serve = std::move(serve)](absl::Status s) {
        me->metrics_.pull_wait_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - start));
        serve(std::move(s));
      };
      std::weak_ptr<Job> weak = me;
      w.timer_id = timer_->Schedule(deadline, [weak, wid] {
        if (auto job = weak.lock()) job->Expire(wid);
      });
      return;
    }
  }
  metrics_.pull_wait_seconds.Observe(0);
  serve(refused);  // serves when OK; otherwise reports why not
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

absl::StatusOr<JobState> Job::Capture(uint64_t at_step, absl::Time deadline) {
  JobState state;
  const bool bsp = model_ == Model::kBsp;
  absl::Time paused;
  {
    absl::MutexLock lock(&mu_);
    if (bsp) {
      if (applied_step_ > at_step) {
        return absl::FailedPreconditionError(absl::StrCat("job '", id(), "': a cut at step ", at_step,
                                                          " is too late, step ", applied_step_ - 1,
                                                          " is already applied on this server"));
      }
      holds_.insert(at_step);
      auto reached = [this, at_step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return shut_down_ || (applied_step_ == at_step && !applying_);
      };
      const bool ok = mu_.AwaitWithDeadline(absl::Condition(&reached), deadline);
      if (!ok || shut_down_) {
        holds_.erase(holds_.find(at_step));
        if (shut_down_) return shutdown_reason_;
        return absl::DeadlineExceededError(absl::StrCat("job '", id(), "': a cut at step ", at_step,
                                                        " timed out with step ", applied_step_,
                                                        " next to apply (", WaitReasonLocked(applied_step_), ")"));
      }
      applying_ = true;  // nothing applies while the state is taken
    }
    paused = absl::Now();
    state.step = bsp ? applied_step_ : MinClockLocked();
  }
  v1::GetJobResponse stats = Stats();
  state.rank_clock.assign(stats.rank_clock().begin(), stats.rank_clock().end());
  std::vector<std::string> names;
  for (const auto& [name, t] : tables_) names.push_back(name);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const Table* t = tables_.at(name).get();
    if (t->is_dense()) {
      const auto* d = static_cast<const DenseTable*>(t);
      state.dense.push_back({d, d->Capture()});
    } else {
      const auto* s = static_cast<const SparseTable*>(t);
      state.sparse.push_back({s, s->Capture()});
    }
  }
  if (bsp) {
    std::vector<std::function<void(absl::Status)>> ready;
    bool drain;
    {
      absl::MutexLock lock(&mu_);
      applying_ = false;
      holds_.erase(holds_.find(at_step));
      drain = StepCompleteLocked(applied_step_);
    }
    state.pause_seconds = absl::ToDoubleSeconds(absl::Now() - paused);
    // Steps that completed meanwhile apply now.
    RETURN_IF_ERROR(Resume(drain, &ready));
  } else {
    state.pause_seconds = absl::ToDoubleSeconds(absl::Now() - paused);
  }
  return state;
}

absl::Status Job::RestoreDense(const std::string& table, uint32_t chunk, uint64_t updates, uint32_t length,
                               uint32_t slots, const void* block) {
  absl::StatusOr<Table*> t = FindTable(table, /*dense=*/true);
  if (!t.ok()) return absl::DataLossError(absl::StrCat("checkpoint record for job '", id(), "': ", t.status().message()));
  return static_cast<DenseTable*>(*t)->Restore(chunk, updates, length, slots, block);
}

absl::Status Job::RestoreSparse(const std::string& table, uint32_t vshard, uint32_t dim, uint32_t slots, size_t n,
                                const uint64_t* keys, const uint32_t* updates, const float* rows) {
  absl::StatusOr<Table*> t = FindTable(table, /*dense=*/false);
  if (!t.ok()) return absl::DataLossError(absl::StrCat("checkpoint record for job '", id(), "': ", t.status().message()));
  return static_cast<SparseTable*>(*t)->Restore(vshard, dim, slots, n, keys, updates, rows);
}

absl::Status Job::RestoreClocks(uint64_t step, const std::vector<uint64_t>& rank_clock) {
  if (rank_clock.size() != num_workers_) {
    return absl::InvalidArgumentError(absl::StrCat("job '", id(), "': a checkpoint with ", rank_clock.size(),
                                                   " ranks restored into a job of ", num_workers_, " workers"));
  }
  absl::MutexLock lock(&mu_);
  steps_.clear();
  for (auto& d : done_ahead_) d.clear();
  if (model_ == Model::kBsp) {
    applied_step_ = step;
  } else {
    clock_ = rank_clock;
  }
  return absl::OkStatus();
}

v1::GetJobResponse Job::Stats() const {
  v1::GetJobResponse r;
  *r.mutable_spec() = spec_;
  r.set_bytes_used(quota_.used());
  r.set_quota_bytes(quota_.limit());
  r.set_pushes_applied(pushes_applied_.load());
  r.set_duplicate_pushes(duplicates_.load());
  r.set_rejected_nonfinite(rejected_nonfinite_.load());
  uint64_t rows = 0;
  for (const auto& [name, t] : tables_) {
    if (!t->is_dense()) rows += static_cast<const SparseTable*>(t.get())->num_rows();
  }
  r.set_sparse_rows(rows);
  absl::MutexLock lock(&mu_);
  r.set_applied_step(applied_step_);
  for (uint32_t rank = 0; rank < num_workers_; ++rank) {
    uint64_t c = clock_[rank];
    if (model_ == Model::kBsp) {
      c = applied_step_;
      for (auto it = steps_.find(c); it != steps_.end() && it->first == c; it = steps_.find(++c)) {
        const RankStep& rs = it->second[rank];
        if (!rs.complete()) break;
      }
    }
    r.add_rank_clock(c);
  }
  return r;
}

void Job::CollectMetrics(metrics::Scrape* out) const {
  const metrics::Labels job = {{"job", id()}};
  const JobMetrics& m = metrics_;
  out->Counter("fulcrum_server_requests_total", "Push and pull requests a job served", {{"job", id()}, {"op", "push"}},
               static_cast<double>(m.push_requests.load()));
  out->Counter("fulcrum_server_requests_total", "Push and pull requests a job served", {{"job", id()}, {"op", "pull"}},
               static_cast<double>(m.pull_requests.load()));
  out->Counter("fulcrum_server_payload_bytes_total", "Tensor payload bytes: gradients received, parameters sent",
               {{"job", id()}, {"op", "push"}}, m.push_bytes.load());
  out->Counter("fulcrum_server_payload_bytes_total", "Tensor payload bytes: gradients received, parameters sent",
               {{"job", id()}, {"op", "pull"}}, m.pull_bytes.load());
  out->Histogram("fulcrum_server_request_duration_seconds",
                 "Time to handle a push or pull, from receipt to reply (pulls include the consistency wait)",
                 {{"job", id()}, {"op", "push"}}, m.push_seconds);
  out->Histogram("fulcrum_server_request_duration_seconds",
                 "Time to handle a push or pull, from receipt to reply (pulls include the consistency wait)",
                 {{"job", id()}, {"op", "pull"}}, m.pull_seconds);
  out->Histogram("fulcrum_server_consistency_wait_seconds",
                 "Time a pull waited for the consistency model (BSP step or SSP bound); 0 when it did not wait",
                 job, m.pull_wait_seconds);
  out->Histogram("fulcrum_server_optimizer_apply_seconds",
                 "Time the optimizer took over one push (ASP/SSP) or one combined BSP step", job, m.apply_seconds);
  if (model_ != Model::kBsp) {
    out->Histogram("fulcrum_server_staleness_steps",
                   "SSP/ASP: how many steps a pull's clock was ahead of the slowest worker's", job, m.staleness);
    if (staleness_lr_) {
      out->Histogram("fulcrum_server_push_staleness_updates",
                     "staleness_aware_lr: updates applied between a gradient's pull and its push, plus one "
                     "(its learning rate is divided by this)",
                     job, m.push_staleness);
    }
  }
  out->Counter("fulcrum_server_pushes_applied_total", "Pushes applied to the job's tables", job,
               static_cast<double>(pushes_applied_.load()));
  out->Counter("fulcrum_server_dedup_hits_total", "Retried pushes recognised by request id and not applied again",
               job, static_cast<double>(duplicates_.load()));
  out->Counter("fulcrum_server_superseded_push_parts_total",
               "Parts of a step from a rank's lost incarnation, dropped when its replacement sent the step again",
               job, static_cast<double>(superseded_parts_.load()));
  out->Counter("fulcrum_server_nonfinite_rejected_total", "Pushes refused for a NaN or Inf gradient", job,
               static_cast<double>(rejected_nonfinite_.load()));
  out->Gauge("fulcrum_server_job_memory_bytes", "Memory the job's parameters and optimizer state use here", job,
             static_cast<double>(quota_.used()));
  out->Gauge("fulcrum_server_job_quota_bytes", "The job's memory quota on this server", job,
             static_cast<double>(quota_.limit()));
  for (const auto& [name, t] : tables_) {
    double params = 0;
    if (t->is_dense()) {
      const auto* d = static_cast<const DenseTable*>(t.get());
      params = std::min(static_cast<double>(d->materialized_chunks()) * d->chunk_elements(),
                        static_cast<double>(d->num_elements()));
    } else {
      const auto* sp = static_cast<const SparseTable*>(t.get());
      params = static_cast<double>(sp->num_rows()) * sp->dim();
    }
    out->Gauge("fulcrum_server_parameters",
               "Parameters of a table held on this server (dense: whole chunks; sparse: rows x dim)",
               {{"job", id()}, {"table", name}}, params);
  }
  {
    absl::MutexLock lock(&mu_);
    uint64_t step = applied_step_;
    if (model_ != Model::kBsp) step = MinClockLocked();
    out->Gauge("fulcrum_server_job_step", "BSP: steps fully applied; SSP/ASP: the slowest worker's clock", job,
               static_cast<double>(step));
  }
  if (m.checkpoint_seconds.count() > 0) {
    out->Histogram("fulcrum_server_checkpoint_duration_seconds",
                   "Time to capture and durably write this server's part of a checkpoint", job, m.checkpoint_seconds);
    out->Gauge("fulcrum_server_checkpoint_bytes", "Size of the job's last checkpoint part written here", job,
               m.last_checkpoint_bytes.load());
    out->Gauge("fulcrum_server_checkpoint_timestamp_seconds", "When the job's last checkpoint part here was written",
               job, m.last_checkpoint_time.load());
    out->Gauge("fulcrum_server_checkpoint_age_seconds", "Seconds since the job's last checkpoint part here", job,
               absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()) - m.last_checkpoint_time.load());
  }
}

}  // namespace fulcrum
