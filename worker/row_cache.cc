#include "worker/row_cache.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/shard_map.h"

namespace fulcrum {

namespace {

// Host memory a cached row takes beyond its floats: key, clock, reference
// bit and index entry.
constexpr size_t kRowOverhead = 32;

void NoteMax(std::atomic<uint64_t>* a, uint64_t v) {
  uint64_t cur = a->load(std::memory_order_relaxed);
  while (v > cur && !a->compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

}  // namespace

// One table's rows: slots of `dim` floats, an index from key to slot, the
// clock each slot was pulled at, a reference bit per slot for the clock hand
// and a count-min sketch of pull frequencies.
class CachingPsClient::TableCache {
 public:
  TableCache(size_t capacity, size_t dim) : capacity_(capacity), dim_(dim) {
    size_t w = 1024;
    while (w < 4 * capacity_) w <<= 1;
    width_mask_ = w - 1;
    sketch_.assign(kDepth * w, 0);
    index_.reserve(capacity_);
  }

  size_t dim() const { return dim_; }
  size_t row_bytes() const { return dim_ * sizeof(float) + kRowOverhead; }
  size_t rows() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return keys_.size(); }

  // Counts one pull of `key`; halves every counter once the sketch has seen
  // ten pulls per counter of one row, so old popularity fades.
  void Count(uint64_t key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const uint64_t h = Mix64(key);
    for (size_t d = 0; d < kDepth; ++d) {
      uint8_t& c = sketch_[d * (width_mask_ + 1) + (Slot(h, d) & width_mask_)];
      if (c < 255) ++c;
    }
    if (++counted_ >= 10 * (width_mask_ + 1)) {
      for (uint8_t& c : sketch_) c >>= 1;
      counted_ = 0;
    }
  }

  // The row of `key` when held and pulled within [clock - bound, clock]:
  // its values and age.
  const float* Lookup(uint64_t key, uint64_t clock, uint64_t bound, uint64_t* age)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    const uint32_t s = it->second;
    if (pulled_at_[s] > clock || clock - pulled_at_[s] > bound) return nullptr;
    ref_[s] = 1;
    *age = clock - pulled_at_[s];
    return &values_[static_cast<size_t>(s) * dim_];
  }

  // Keeps the row the servers sent for `key` at `clock`, where admitted.
  void Offer(uint64_t key, const float* row, uint64_t clock) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    uint32_t s;
    auto it = index_.find(key);
    if (it != index_.end()) {
      s = it->second;
      if (pulled_at_[s] > clock) return;  // a newer copy is held
    } else if (keys_.size() < capacity_) {
      s = static_cast<uint32_t>(keys_.size());
      keys_.push_back(key);
      pulled_at_.push_back(0);
      ref_.push_back(0);
      values_.resize(values_.size() + dim_);
      index_.emplace(key, s);
    } else {
      // The clock hand's next unreferenced slot is the victim, kept unless
      // the new key was pulled more often.
      for (;;) {
        if (hand_ >= keys_.size()) hand_ = 0;
        if (ref_[hand_] == 0) break;
        ref_[hand_++] = 0;
      }
      s = static_cast<uint32_t>(hand_);
      if (Frequency(key) <= Frequency(keys_[s])) return;
      ++hand_;
      index_.erase(keys_[s]);
      keys_[s] = key;
      index_.emplace(key, s);
    }
    pulled_at_[s] = clock;
    ref_[s] = 0;
    std::memcpy(&values_[static_cast<size_t>(s) * dim_], row, dim_ * sizeof(float));
  }

  absl::Mutex mu;

 private:
  static constexpr size_t kDepth = 4;
  static uint64_t Slot(uint64_t h, size_t d) { return (h >> (16 * d)) ^ (h * (2 * d + 1)); }
  uint32_t Frequency(uint64_t key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const uint64_t h = Mix64(key);
    uint32_t m = 255;
    for (size_t d = 0; d < kDepth; ++d) {
      m = std::min<uint32_t>(m, sketch_[d * (width_mask_ + 1) + (Slot(h, d) & width_mask_)]);
    }
    return m;
  }

  const size_t capacity_;
  const size_t dim_;
  size_t width_mask_ = 0;
  std::vector<uint8_t> sketch_ ABSL_GUARDED_BY(mu);
  size_t counted_ ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<uint64_t, uint32_t> index_ ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> keys_ ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> pulled_at_ ABSL_GUARDED_BY(mu);
  std::vector<uint8_t> ref_ ABSL_GUARDED_BY(mu);
  std::vector<float> values_ ABSL_GUARDED_BY(mu);
  size_t hand_ ABSL_GUARDED_BY(mu) = 0;
};

// The rows of one pull that the servers are asked for, per sparse target:
// where each goes in the caller's output and where it lands first.
struct CachingPsClient::PendingPull {
  struct Part {
    std::shared_ptr<TableCache> cache;
    std::string table;
    float* out = nullptr;              // the caller's rows
    std::vector<uint64_t> keys;        // asked of the servers
    std::vector<uint32_t> positions;   // each one's index in the caller's keys
    std::vector<float> rows;           // what they sent
  };
  uint64_t clock = 0;
  std::vector<Part> parts;
};

CachingPsClient::CachingPsClient(PsClient* inner, RowCacheOptions options)
    : inner_(inner), options_(options), stats_(options.stats != nullptr ? options.stats : &own_stats_) {}

CachingPsClient::~CachingPsClient() {
  absl::MutexLock lock(&mu_);
  for (auto& [job, tables] : jobs_) Forget(tables);
}

void CachingPsClient::Forget(const absl::flat_hash_map<std::string, std::shared_ptr<TableCache>>& tables) {
  for (auto& [name, c] : tables) {
    absl::MutexLock l(&c->mu);
    stats_->rows.fetch_sub(c->rows(), std::memory_order_relaxed);
    stats_->bytes.fetch_sub(c->rows() * c->row_bytes(), std::memory_order_relaxed);
  }
}

absl::Status CachingPsClient::CreateJob(const v1::PsJobSpec& spec) {
  absl::Status s = inner_->CreateJob(spec);
  if (!s.ok() || options_.rows == 0) return s;
  absl::MutexLock lock(&mu_);
  auto& tables = jobs_[spec.job_id()];
  for (const v1::TableSpec& t : spec.tables()) {
    if (t.kind() != v1::TableSpec::SPARSE || t.dim() == 0 || tables.contains(t.name())) continue;
    tables.emplace(t.name(), std::make_shared<TableCache>(options_.rows, t.dim()));
  }
  return s;
}

absl::Status CachingPsClient::OpenJob(const std::string& job_id) { return inner_->OpenJob(job_id); }

absl::Status CachingPsClient::DeleteJob(const std::string& job_id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) {
      Forget(it->second);
      jobs_.erase(it);
    }
  }
  return inner_->DeleteJob(job_id);
}

Future<absl::Status> CachingPsClient::PushAsync(const std::string& job_id, const PushBatch& batch) {
  return inner_->PushAsync(job_id, batch);
}

absl::StatusOr<v1::GetJobResponse> CachingPsClient::GetJobStats(const std::string& job_id, size_t server) {
  return inner_->GetJobStats(job_id, server);
}

void CachingPsClient::ExpectPush() { inner_->ExpectPush(); }

void CachingPsClient::Prefetch(const std::string& job_id, const std::vector<SparseTarget>& keys) {
  inner_->Prefetch(job_id, keys);
}

size_t CachingPsClient::CachedRows(const std::string& job_id, const std::string& table) const {
  TableCache* c = Find(job_id, table);
  if (c == nullptr) return 0;
  absl::MutexLock l(&c->mu);
  return c->rows();
}

CachingPsClient::TableCache* CachingPsClient::Find(const std::string& job_id, const std::string& table) const {
  absl::MutexLock lock(&mu_);
  auto j = jobs_.find(job_id);
  if (j == jobs_.end()) return nullptr;
  auto t = j->second.find(table);
  return t == j->second.end() ? nullptr : t->second.get();
}

Future<absl::Status> CachingPsClient::PullAsync(const std::string& job_id, const PullBatch& batch) {
  if (options_.rows == 0 || batch.exact || batch.sparse.empty()) return inner_->PullAsync(job_id, batch);
  auto pending = std::make_shared<PendingPull>();
  pending->clock = batch.step;
  PullBatch ask;
  ask.step = batch.step;
  ask.unclocked = batch.unclocked;
  ask.dense = batch.dense;
  uint64_t hits = 0, saved = 0;
  std::vector<uint64_t> ages(options_.max_staleness_steps + 1, 0);
  {
    absl::MutexLock lock(&mu_);
    auto j = jobs_.find(job_id);
    for (const SparseTarget& t : batch.sparse) {
      std::shared_ptr<TableCache> c;
      if (j != jobs_.end()) {
        auto it = j->second.find(t.table);
        if (it != j->second.end()) c = it->second;
      }
      if (c == nullptr) {
        ask.sparse.push_back(t);
        continue;
      }
      PendingPull::Part part;
      part.cache = c;
      part.table = t.table;
      part.out = t.out;
      const size_t dim = c->dim();
      {
        absl::MutexLock l(&c->mu);
        for (size_t i = 0; i < t.num_keys; ++i) {
          const uint64_t key = t.keys[i];
          c->Count(key);
          uint64_t age = 0;
          const float* row = c->Lookup(key, batch.step, options_.max_staleness_steps, &age);
          if (row != nullptr) {
            std::memcpy(t.out + i * dim, row, dim * sizeof(float));
            ++ages[age];
            ++hits;
            saved += sizeof(uint64_t) + dim * options_.wire_value_bytes;
          } else {
            part.keys.push_back(key);
            part.positions.push_back(static_cast<uint32_t>(i));
          }
        }
      }
      if (part.keys.empty()) continue;
      part.rows.resize(part.keys.size() * dim);
      pending->parts.push_back(std::move(part));
    }
  }
  for (PendingPull::Part& p : pending->parts) {
    ask.sparse.push_back({p.table, p.keys.data(), p.keys.size(), p.rows.data()});
  }
  stats_->hits.fetch_add(hits, std::memory_order_relaxed);
  stats_->bytes_saved.fetch_add(saved, std::memory_order_relaxed);
  for (size_t a = 0; a < ages.size(); ++a) {
    if (ages[a] == 0) continue;
    stats_->staleness.Observe(static_cast<double>(a), ages[a]);
    NoteMax(&stats_->max_staleness, a);
  }
  uint64_t misses = 0;
  for (const PendingPull::Part& p : pending->parts) misses += p.keys.size();
  stats_->misses.fetch_add(misses, std::memory_order_relaxed);

  if (ask.dense.empty() && ask.sparse.empty()) {
    Promise<absl::Status> done;
    done.Set(absl::OkStatus());
    return done.future();
  }
  Promise<absl::Status> done;
  Future<absl::Status> f = done.future();
  RowCacheStats* stats = stats_;
  inner_->PullAsync(job_id, ask).Then([pending, done, stats](const absl::Status& s) {
    if (s.ok()) {
      for (PendingPull::Part& p : pending->parts) {
        const size_t dim = p.cache->dim();
        absl::MutexLock l(&p.cache->mu);
        const size_t before = p.cache->rows();
        for (size_t i = 0; i < p.keys.size(); ++i) {
          const float* row = &p.rows[i * dim];
          std::memcpy(p.out + static_cast<size_t>(p.positions[i]) * dim, row, dim * sizeof(float));
          p.cache->Offer(p.keys[i], row, pending->clock);
        }
        const size_t added = p.cache->rows() - before;
        stats->rows.fetch_add(added, std::memory_order_relaxed);
        stats->bytes.fetch_add(added * p.cache->row_bytes(), std::memory_order_relaxed);
      }
    }
    done.Set(s);
  });
  return f;
}

}  // namespace fulcrum
