// SparseTable: rows keyed by uint64 in per-virtual-shard partitions, their
// memory counted as it grows, and (with a lifecycle) admission by a
// count-min sketch and eviction by cap (LRU or decayed LFU over a window of
// candidates) and by TTL. Every choice is a function of the keys, steps and
// the order of pushes applied, so BSP runs stay bit-for-bit reproducible.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/float_env.h"
#include "common/shard_map.h"
#include "common/status_macros.h"
#include "common/table_lifecycle.h"
#include "server/cold_tier.h"
#include "server/table.h"

namespace fulcrum {
namespace {

// Candidates a cap eviction compares, taken in slot order from a cursor
// that moves on: the victim is the oldest (LRU) or least used (LFU) of them.
constexpr uint32_t kVictimWindow = 16;
// Slots a push's TTL sweep examines in each partition it touches.
constexpr uint32_t kTtlSweep = 16;
constexpr uint32_t kNoSlot = UINT32_MAX;
// A shard's sketch halves when its counters sum to this times its width.
constexpr uint64_t kSketchAgeAt = 2;

}  // namespace

absl::StatusOr<SparseTable::Lifecycle> SparseTable::LifecycleFromProto(const v1::TableSpec& spec,
                                                                       uint32_t num_virtual_shards,
                                                                       uint64_t row_bytes) {
  Lifecycle life;
  const auto problems = TableLifecycleProblems(spec.has_admission() ? &spec.admission() : nullptr,
                                               spec.has_eviction() ? &spec.eviction() : nullptr,
                                               spec.has_storage() ? &spec.storage() : nullptr, row_bytes);
  if (!problems.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse table '", spec.name(), "': ", problems[0].first, " ", problems[0].second));
  }
  if (spec.has_admission()) {
    const v1::AdmissionSpec& a = spec.admission();
    life.min_count = a.min_count();
    life.probability = a.probability() == 1 ? 0 : a.probability();
    if (a.sketch_width() != 0) life.sketch_width = a.sketch_width();
  }
  if (spec.has_eviction()) {
    const v1::EvictionSpec& e = spec.eviction();
    life.policy = e.policy() == v1::EvictionSpec::LFU ? Lifecycle::Policy::kLfu : Lifecycle::Policy::kLru;
    const uint64_t max_rows = e.max_bytes() != 0 ? e.max_bytes() / row_bytes : e.max_rows();
    if (max_rows != 0) {
      const uint64_t per = (max_rows + num_virtual_shards - 1) / num_virtual_shards;
      life.max_rows_per_shard = static_cast<uint32_t>(std::min<uint64_t>(per, uint64_t{1} << 31));
    }
    if (e.lfu_decay() != 0) life.lfu_decay = e.lfu_decay();
    life.ttl_steps = e.ttl_steps();
  }
  if (spec.has_storage()) {
    // The memory budget is the cap; rows past it go to disk.
    const uint64_t max_rows = spec.storage().memory_bytes() / row_bytes;
    const uint64_t per = (max_rows + num_virtual_shards - 1) / num_virtual_shards;
    life.max_rows_per_shard = static_cast<uint32_t>(std::min<uint64_t>(per, uint64_t{1} << 31));
    life.spill = true;
  }
  return life;
}

SparseTable::SparseTable(const v1::TableSpec& spec, OptimizerConfig opt, Initializer init, Lifecycle life,
                         uint32_t num_virtual_shards, MemoryQuota* quota)
    : Table(spec.name(), false, opt, init), dim_(spec.dim()), life_(life), quota_(quota) {
  partitions_.reserve(num_virtual_shards);
  for (uint32_t i = 0; i < num_virtual_shards; ++i) {
    partitions_.push_back(std::make_unique<Partition>());
  }
}

SparseTable::~SparseTable() { quota_->Release(bytes()); }

uint64_t SparseTable::bytes() const { return bytes_.load(std::memory_order_relaxed); }

void SparseTable::Charged(uint64_t bytes) { bytes_.fetch_add(bytes, std::memory_order_relaxed); }

SparseTable::Counts SparseTable::counts() const {
  Counts c;
  c.admitted = admitted_.load(std::memory_order_relaxed);
  c.rejected = rejected_.load(std::memory_order_relaxed);
  c.evicted_cap = evicted_cap_.load(std::memory_order_relaxed);
  c.evicted_ttl = evicted_ttl_.load(std::memory_order_relaxed);
  c.sketch_bytes = sketch_bytes_.load(std::memory_order_relaxed);
  c.sketch_agings = sketch_agings_.load(std::memory_order_relaxed);
  c.demoted = demoted_.load(std::memory_order_relaxed);
  c.promoted = promoted_.load(std::memory_order_relaxed);
  c.cold_reads = cold_reads_.load(std::memory_order_relaxed);
  c.prefetched = prefetched_.load(std::memory_order_relaxed);
  c.cold_rows = cold_rows_.load(std::memory_order_relaxed);
  return c;
}

absl::Status SparseTable::AttachColdTier(ColdTier* tier, uint32_t space) {
  if (life_.max_rows_per_shard == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sparse table '", name_, "' has no cap: a cold tier holds the rows past one"));
  }
  tier_ = tier;
  tier_space_ = space;
  for (auto& p : partitions_) {
    absl::MutexLock lock(&p->mu);
    p->moved_at.assign(kMoveBuckets, 0);
  }
  return absl::OkStatus();
}

size_t SparseTable::MoveBucket(uint64_t key) {
  // Another mix than the key's virtual shard's, so a shard's keys spread
  // over every bucket.
  return static_cast<size_t>(Mix64(key ^ 0x5bd1e9955bd1e995ull) % kMoveBuckets);
}

float* SparseTable::RowAt(Partition* p, uint32_t r) const {
  const size_t row_floats = size_t{dim_} * (1 + num_slots());
  size_t block, offset;
  if (r < 16) {
    block = 0;
    offset = r;
  } else if (r < kRowsPerBlock) {
    block = static_cast<size_t>(31 - __builtin_clz(r)) - 3;  // [16, 32) is block 1
    offset = r - (16u << (block - 1));
  } else {
    block = 6 + r / kRowsPerBlock;
    offset = r % kRowsPerBlock;
  }
  return p->blocks[block].get() + offset * row_floats;
}

uint64_t SparseTable::IndexBytes(const Partition& p) const {
  // flat_hash_map: a slot (key and row number, padded) and a control byte
  // per bucket, and one group of control bytes more; then the per-slot
  // fields at their capacity.
  using Slot = std::pair<const uint64_t, uint32_t>;
  const uint64_t buckets = p.index.bucket_count();
  return (buckets == 0 ? 0 : buckets * (sizeof(Slot) + 1) + 16) + p.updates.capacity() * sizeof(uint32_t) +
         p.slot_key.capacity() * sizeof(uint64_t) + p.live.capacity() + p.last_step.capacity() * sizeof(uint64_t) +
         p.freq.capacity() * sizeof(float) + p.free_slots.capacity() * sizeof(uint32_t);
}

absl::Status SparseTable::Grow(Partition* p, uint32_t slots) {
  // What the index will take: the smallest 2^k - 1 buckets that hold
  // `slots` at the 7/8 load the map allows; corrected to the real figure
  // below.
  uint64_t buckets = 15;
  while (buckets - buckets / 8 < slots) buckets = buckets * 2 + 1;
  using Slot = std::pair<const uint64_t, uint32_t>;
  uint64_t per_slot = sizeof(uint32_t);
  if (life_.on()) per_slot += sizeof(uint64_t) + 1 + sizeof(uint64_t) + sizeof(float) + sizeof(uint32_t);
  const uint64_t before = IndexBytes(*p);
  const uint64_t expect = buckets * (sizeof(Slot) + 1) + 16 + uint64_t{slots} * per_slot;
  if (expect > before) {
    RETURN_IF_ERROR(quota_->Reserve(expect - before, absl::StrCat("the index of table '", name_, "' for ", slots,
                                                                  " rows in one virtual shard")));
  }
  p->index.reserve(slots);
  p->updates.reserve(slots);
  if (life_.on()) {
    p->slot_key.reserve(slots);
    p->live.reserve(slots);
    p->last_step.reserve(slots);
    p->freq.reserve(slots);
    p->free_slots.reserve(slots);
  }
  p->room = slots;
  const uint64_t after = IndexBytes(*p);
  // Exact from here on: the estimate's error charged or given back.
  const uint64_t reserved = expect > before ? expect - before : 0;
  const uint64_t grew = after > before ? after - before : 0;
  if (grew > reserved) quota_->Charge(grew - reserved);
  if (reserved > grew) quota_->Release(reserved - grew);
  Charged(grew);
  return absl::OkStatus();
}

absl::Status SparseTable::EnsureCapacity(Partition* p, uint32_t slots) {
  while (p->block_rows < slots) {
    const uint32_t rows = BlockRows(p->blocks.size());
    const uint64_t block_bytes = uint64_t{rows} * RowBytes();
    RETURN_IF_ERROR(quota_->Reserve(block_bytes, absl::StrCat("a new row of table '", name_, "' (a block of ", rows,
                                                              " rows of ", RowBytes(), " bytes)")));
    p->blocks.push_back(std::make_unique<float[]>(size_t{dim_} * (1 + num_slots()) * rows));
    p->block_rows += rows;
    Charged(block_bytes);
  }
  if (slots > p->room) {
    uint32_t room = std::max<uint32_t>(16, p->room);
    while (room < slots) room *= 2;
    RETURN_IF_ERROR(Grow(p, room));
  }
  return absl::OkStatus();
}

absl::StatusOr<float*> SparseTable::Row(Partition* p, uint64_t key, uint32_t* row_index, uint64_t step) {
  auto it = p->index.find(key);
  if (it != p->index.end()) {
    *row_index = it->second;
    return RowAt(p, it->second);
  }
  return NewRow(p, key, row_index, step);
}

absl::StatusOr<float*> SparseTable::NewRow(Partition* p, uint64_t key, uint32_t* row_index, uint64_t step,
                                           const float* initial) {
  uint32_t r;
  if (!p->free_slots.empty()) {
    r = p->free_slots.back();
    p->free_slots.pop_back();
  } else {
    // Memory is reserved as it is allocated: a block of rows at a time, the
    // index as it doubles. A refusal leaves the partition unchanged.
    r = static_cast<uint32_t>(p->updates.size());
    RETURN_IF_ERROR(EnsureCapacity(p, r + 1));
    p->updates.push_back(0);
    if (life_.on()) {
      p->slot_key.push_back(0);
      p->live.push_back(0);
      p->last_step.push_back(0);
      p->freq.push_back(0);
    }
  }
  float* row = RowAt(p, r);
  if (initial != nullptr) {
    std::memcpy(row, initial, size_t{dim_} * sizeof(float));
  } else {
    init_.Fill(name_hash_, key, 0, row, dim_);
  }
  for (int s = 0; s < num_slots(); ++s) {
    std::fill_n(row + size_t{dim_} * (1 + s), dim_, InitialSlotValue(optimizer_, s));
  }
  p->index.emplace(key, r);
  rows_.fetch_add(1, std::memory_order_relaxed);
  p->updates[r] = 0;
  if (life_.on()) {
    p->slot_key[r] = key;
    p->live[r] = kLive;
    p->last_step[r] = step;
    p->freq[r] = 0;
  }
  *row_index = r;
  return row;
}

void SparseTable::Drop(Partition* p, uint32_t slot) {
  p->index.erase(p->slot_key[slot]);
  rows_.fetch_sub(1, std::memory_order_relaxed);
  p->live[slot] = 0;
  p->free_slots.push_back(slot);
}

absl::StatusOr<bool> SparseTable::Admit(Partition* p, uint64_t key, uint64_t step) {
  if (life_.probability > 0) {
    // A coin per (key, step): the same pushes admit the same keys.
    const uint64_t h = Mix64(key ^ Mix64(step + 0x9e3779b97f4a7c15ull) ^ name_hash_);
    if (static_cast<float>(h >> 40) * (1.0f / 16777216.0f) >= life_.probability) return false;
  }
  if (life_.min_count <= 1) return true;
  RETURN_IF_ERROR(EnsureSketch(p));
  // Count-min with conservative update: raise only the counters at the
  // minimum, so the estimate over-counts as little as the sketch allows.
  uint16_t* cell[kSketchRows];
  uint16_t least = UINT16_MAX;
  for (size_t d = 0; d < kSketchRows; ++d) {
    const uint64_t h = Mix64((key + (d + 1) * 0x9e3779b97f4a7c15ull) ^ name_hash_);
    cell[d] = &p->sketch[d * life_.sketch_width + h % life_.sketch_width];
    least = std::min(least, *cell[d]);
  }
  if (least < UINT16_MAX) {
    for (uint16_t* c : cell) {
      if (*c == least) {
        ++*c;
        ++p->sketch_sum;
      }
    }
    ++least;
  }
  // The sketch counts over a window: once its counters add up to twice its
  // width (half a count a counter), all halve, so an endless stream never
  // saturates it and a key must recur to be admitted.
  if (p->sketch_sum >= kSketchAgeAt * life_.sketch_width) AgeSketch(p);
  return least >= life_.min_count;
}

void SparseTable::AgeSketch(Partition* p) {
  uint64_t sum = 0;
  for (uint16_t& c : p->sketch) {
    c = static_cast<uint16_t>(c >> 1);
    sum += c;
  }
  p->sketch_sum = sum;
  sketch_agings_.fetch_add(1, std::memory_order_relaxed);
}

absl::Status SparseTable::EnsureSketch(Partition* p) {
  if (!p->sketch.empty()) return absl::OkStatus();
  const uint64_t bytes = uint64_t{kSketchRows} * life_.sketch_width * sizeof(uint16_t);
  RETURN_IF_ERROR(quota_->Reserve(bytes, absl::StrCat("the admission sketch of table '", name_, "'")));
  p->sketch.assign(size_t{kSketchRows} * life_.sketch_width, 0);
  Charged(bytes);
  sketch_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return absl::OkStatus();
}

uint32_t SparseTable::PickVictim(Partition* p, uint64_t step) {
  const uint32_t slots = static_cast<uint32_t>(p->live.size());
  uint32_t best = slots;
  double best_score = 0;
  uint32_t seen = 0;
  uint32_t s = p->victim_cursor % slots;
  for (uint32_t looked = 0; looked < slots && seen < kVictimWindow; ++looked, s = (s + 1) % slots) {
    if (!p->live[s]) continue;
    ++seen;
    const double score =
        life_.policy == Lifecycle::Policy::kLru
            ? static_cast<double>(p->last_step[s])
            : p->freq[s] * std::pow(static_cast<double>(life_.lfu_decay),
                                    static_cast<double>(step > p->last_step[s] ? step - p->last_step[s] : 0));
    if (best == slots || score < best_score) {
      best = s;
      best_score = score;
    }
  }
  p->victim_cursor = s;
  return best == slots ? kNoSlot : best;
}

void SparseTable::SweepExpired(Partition* p, uint64_t step, std::vector<uint64_t>* copies) {
  const uint32_t slots = static_cast<uint32_t>(p->live.size());
  if (slots == 0) return;
  uint32_t s = p->ttl_cursor % slots;
  for (uint32_t i = 0; i < std::min(kTtlSweep, slots); ++i, s = (s + 1) % slots) {
    if (p->live[s] && step > p->last_step[s] && step - p->last_step[s] > life_.ttl_steps) {
      if (p->live[s] & kCopyOnDisk) copies->push_back(p->slot_key[s]);
      Drop(p, s);
      evicted_ttl_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  p->ttl_cursor = s;
}

uint64_t SparseTable::num_rows() const { return rows_.load(std::memory_order_relaxed); }

absl::Status SparseTable::Read(uint32_t vshard, const uint64_t* keys, const uint32_t* idx,
                               size_t n, float* out) {
  // With a cold tier, rows in memory and on disk are read as for a pull.
  if (tier_ != nullptr) return ReadShards(keys, idx, {{vshard, n}}, out);
  Partition* p = partitions_[vshard].get();
  absl::MutexLock lock(&p->mu);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t key = keys[idx[i]];
    float* dst = out + size_t{idx[i]} * dim_;
    if (life_.on()) {
      // Rows are made by admitted pushes only: a missing one reads as it
      // would start.
      auto it = p->index.find(key);
      if (it == p->index.end()) {
        init_.Fill(name_hash_, key, 0, dst, dim_);
      } else {
        std::memcpy(dst, RowAt(p, it->second), size_t{dim_} * sizeof(float));
      }
      continue;
    }
    uint32_t r;
    ASSIGN_OR_RETURN(float* row, Row(p, key, &r));
    std::memcpy(dst, row, size_t{dim_} * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status SparseTable::ReadShards(const uint64_t* keys, const uint32_t* idx,
                                     const std::vector<std::pair<uint32_t, size_t>>& runs, float* out) {
  if (tier_ == nullptr) {
    size_t begin = 0;
    for (const auto& [v, end] : runs) {
      RETURN_IF_ERROR(Read(v, keys, idx + begin, end - begin, out));
      begin = end;
    }
    return absl::OkStatus();
  }
  // The tier's tables are always lifecycle tables: nothing is created here.
  std::vector<std::unique_ptr<absl::MutexLock>> locks;
  locks.reserve(runs.size());
  std::vector<uint32_t> cold_idx, cold_vshard;
  std::vector<uint64_t> cold_keys;
  uint64_t kept_reads = 0;  // rows on disk read from what the shard kept
  size_t begin = 0;
  for (const auto& [v, end] : runs) {
    Partition* p = partitions_[v].get();
    locks.push_back(std::make_unique<absl::MutexLock>(&p->mu));
    for (size_t i = begin; i < end; ++i) {
      const uint64_t key = keys[idx[i]];
      float* dst = out + size_t{idx[i]} * dim_;
      auto it = p->index.find(key);
      if (it != p->index.end()) {
        std::memcpy(dst, RowAt(p, it->second), size_t{dim_} * sizeof(float));
      } else if (auto r = p->read_at.find(key); r != p->read_at.end()) {
        // On disk as kept (read by an earlier pull, or moved there by a
        // push), and not pushed since.
        if (r->second == kNotOnDisk) {
          init_.Fill(name_hash_, key, 0, dst, dim_);
        } else {
          std::memcpy(dst, p->read.row(r->second), size_t{dim_} * sizeof(float));
          ++kept_reads;
        }
      } else {
        cold_idx.push_back(idx[i]);
        cold_vshard.push_back(v);
        cold_keys.push_back(key);
      }
    }
    begin = end;
  }
  cold_reads_.fetch_add(kept_reads, std::memory_order_relaxed);
  if (cold_keys.empty()) return absl::OkStatus();
  ColdRows rows;
  rows.row_floats = static_cast<uint32_t>(size_t{dim_} * (1 + num_slots()));
  std::vector<bool> found;
  RETURN_IF_ERROR(tier_->Get(tier_space_, cold_vshard.data(), cold_keys.data(), cold_keys.size(), &rows, &found));
  size_t next = 0;
  for (size_t i = 0; i < cold_keys.size(); ++i) {
    float* dst = out + size_t{cold_idx[i]} * dim_;
    // Kept for the push that follows (Partition::read_at); a shard's
    // kept rows start over once they fill kReadKeepBytes.
    Partition* p = partitions_[cold_vshard[i]].get();
    if (found[i]) {
      std::memcpy(dst, rows.row(next), size_t{dim_} * sizeof(float));
      Keep(p, cold_keys[i], &rows, next, /*start_over=*/true);
      ++next;
    } else {
      init_.Fill(name_hash_, cold_keys[i], 0, dst, dim_);
      Keep(p, cold_keys[i], nullptr, 0, /*start_over=*/true);
    }
  }
  cold_reads_.fetch_add(next, std::memory_order_relaxed);
  return absl::OkStatus();
}

bool SparseTable::Keep(Partition* p, uint64_t key, const ColdRows* rows, size_t j, bool start_over) const {
  if ((p->read.size() + 1) * RowBytes() > kReadKeepBytes || p->read_at.size() >= kReadKeepKeys) {
    if (!start_over) return false;
    p->read_at.clear();
    p->read.Clear();
  }
  if (rows == nullptr) {
    p->read_at.emplace(key, kNotOnDisk);
  } else if (p->read_at.emplace(key, static_cast<uint32_t>(p->read.size())).second) {
    p->read.row_floats = rows->row_floats;
    p->read.Add(key, rows->updates[j], rows->last_step[j], rows->freq[j], rows->row(j));
  }
  return true;
}

absl::StatusOr<uint64_t> SparseTable::Prefetch(const uint64_t* keys, const uint32_t* idx,
                                               const std::vector<std::pair<uint32_t, size_t>>& runs) {
  ASSIGN_OR_RETURN(const ReadAhead read, ReadAheadOf(keys, idx, runs));
  return KeepReadAhead(read);
}

absl::StatusOr<SparseTable::ReadAhead> SparseTable::ReadAheadOf(
    const uint64_t* keys, const uint32_t* idx, const std::vector<std::pair<uint32_t, size_t>>& runs) {
  ReadAhead out;
  if (tier_ == nullptr) return out;
  // The keys on neither memory nor a shard's kept rows, shard by shard,
  // and each shard's counts of moves and restores as they were then.
  out.shards.reserve(runs.size());
  out.seen.reserve(runs.size());
  size_t begin = 0;
  for (const auto& [v, end] : runs) {
    Partition* p = partitions_[v].get();
    absl::MutexLock lock(&p->mu);
    out.shards.push_back(v);
    out.seen.emplace_back(p->moves, p->restores);
    for (size_t i = begin; i < end; ++i) {
      const uint64_t key = keys[idx[i]];
      if (p->index.contains(key) || p->read_at.contains(key)) continue;
      out.vshard.push_back(v);
      out.keys.push_back(key);
    }
    begin = end;
  }
  if (out.keys.empty()) return out;
  // The disk read holds no shard's lock: pulls and pushes go on meanwhile.
  out.rows.row_floats = static_cast<uint32_t>(size_t{dim_} * (1 + num_slots()));
  RETURN_IF_ERROR(tier_->Get(tier_space_, out.vshard.data(), out.keys.data(), out.keys.size(), &out.rows, &out.found));
  return out;
}

uint64_t SparseTable::KeepReadAhead(const ReadAhead& read) {
  uint64_t kept = 0;
  size_t i = 0, next = 0;
  for (size_t r = 0; r < read.shards.size(); ++r) {
    Partition* p = partitions_[read.shards[r]].get();
    absl::MutexLock lock(&p->mu);
    // What a push moved meanwhile may differ from what was read: a key of
    // a bucket a push moved rows of since is not kept, nor is anything
    // after a restore.
    const bool restored = p->restores != read.seen[r].second;
    for (; i < read.keys.size() && read.vshard[i] == read.shards[r]; ++i) {
      const uint64_t key = read.keys[i];
      const size_t j = read.found[i] ? next++ : 0;
      if (restored || p->moved_at[MoveBucket(key)] > read.seen[r].first) continue;
      if (p->index.contains(key) || p->read_at.contains(key)) continue;
      if (!Keep(p, key, read.found[i] ? &read.rows : nullptr, j, /*start_over=*/false)) continue;
      kept += read.found[i] ? 1 : 0;
    }
  }
  prefetched_.fetch_add(kept, std::memory_order_relaxed);
  return kept;
}

absl::Status SparseTable::EnsureRows(uint32_t vshard, const uint64_t* keys, const uint32_t* idx,
                                     size_t n) {
  Partition* p = partitions_[vshard].get();
  absl::MutexLock lock(&p->mu);
  if (life_.on()) {
    // Room for every missing key, up to the cap: Apply then never fails
    // for memory halfway through a push. A shard with room for its cap
    // needs no more (and no look at the keys).
    if (life_.max_rows_per_shard != 0 && p->updates.size() >= life_.max_rows_per_shard) return absl::OkStatus();
    uint64_t missing = 0;
    for (size_t i = 0; i < n; ++i) missing += p->index.count(keys[idx[i]]) == 0;
    uint64_t want = p->index.size() + missing;
    if (life_.max_rows_per_shard != 0) want = std::min<uint64_t>(want, life_.max_rows_per_shard);
    if (want > p->updates.size()) RETURN_IF_ERROR(EnsureCapacity(p, static_cast<uint32_t>(want)));
    return absl::OkStatus();
  }
  for (size_t i = 0; i < n; ++i) {
    uint32_t r;
    RETURN_IF_ERROR(Row(p, keys[idx[i]], &r).status());
  }
  return absl::OkStatus();
}

absl::Status SparseTable::Apply(uint32_t vshard, const uint64_t* keys, const uint32_t* idx,
                                size_t n, const float* grads, uint64_t step, float lr_scale) {
  Partition* p = partitions_[vshard].get();
  const OptimizerConfig opt = optimizer_.AtStep(step, lr_scale);
  ScopedFlushDenormals flush;
  const size_t row_floats = size_t{dim_} * (1 + num_slots());
  // A new row's initial value, computed before it has a slot.
  absl::InlinedVector<float, 64> fresh(life_.max_rows_per_shard != 0 ? dim_ : 0);
  absl::MutexLock lock(&p->mu);
  // With a cold tier: the rows of pushed keys that lie on disk, read in one
  // batch and promoted as their keys come (their copies stay on disk,
  // kCopyOnDisk); the rows this push demotes, written in one batch after it
  // (a demoted key pushed later in the same push comes back from here,
  // with the mark it had); the copies of rows dropped for good, deleted.
  ColdRows cold, demoted;
  std::vector<uint8_t> demoted_marks;
  absl::flat_hash_map<uint64_t, uint32_t> cold_at, demoted_at;
  std::vector<uint64_t> promoted, copies_gone;
  std::vector<float> back;
  uint32_t back_updates = 0;
  uint64_t back_step = 0;
  float back_freq = 0;
  if (tier_ != nullptr) {
    cold.row_floats = demoted.row_floats = static_cast<uint32_t>(row_floats);
    // What pulls read from disk is taken from there, and this push's keys
    // are forgotten: they come into memory (or stay on neither tier), and
    // only keys of a push change what the tier holds (its victims were in
    // memory, so nothing kept names them).
    std::vector<uint64_t> missing;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t key = keys[idx[i]];
      if (p->index.contains(key)) continue;
      auto r = p->read_at.find(key);
      if (r == p->read_at.end()) {
        if (!cold_at.contains(key)) missing.push_back(key);
        continue;
      }
      if (r->second != kNotOnDisk) {
        const uint32_t j = r->second;
        cold_at[key] = static_cast<uint32_t>(cold.size());
        cold.Add(key, p->read.updates[j], p->read.last_step[j], p->read.freq[j], p->read.row(j));
      }
      p->read_at.erase(r);
    }
    if (p->read_at.empty()) p->read.Clear();
    if (!missing.empty()) {
      std::vector<bool> found;
      const size_t kept = cold.size();
      RETURN_IF_ERROR(tier_->Get(tier_space_, vshard, missing.data(), missing.size(), &cold, &found));
      for (uint32_t j = static_cast<uint32_t>(kept); j < cold.size(); ++j) cold_at[cold.keys[j]] = j;
    }
  }
  if (life_.ttl_steps != 0) SweepExpired(p, step, &copies_gone);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t key = keys[idx[i]];
    uint32_t r;
    float* row;
    if (!life_.on()) {
      ASSIGN_OR_RETURN(row, Row(p, key, &r));
    } else if (auto it = p->index.find(key); it != p->index.end()) {
      r = it->second;
      row = RowAt(p, r);
    } else {
      // A row coming back from the tier (or from this push's demotions).
      const ColdRows* from = nullptr;
      uint32_t at = 0;
      uint8_t mark = kLive;
      if (tier_ != nullptr) {
        if (auto c = cold_at.find(key); c != cold_at.end()) {
          from = &cold;
          at = c->second;
          mark = kLive | kCopyOnDisk;
        } else if (auto d = demoted_at.find(key); d != demoted_at.end()) {
          from = &demoted;
          at = d->second;
          mark = demoted_marks[at];
          demoted_at.erase(d);
        }
      }
      if (from == nullptr) {
        ASSIGN_OR_RETURN(const bool admitted, Admit(p, key, step));
        if (!admitted) {
          rejected_.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
      }
      uint32_t victim = kNoSlot;
      if (life_.max_rows_per_shard != 0 && p->index.size() >= life_.max_rows_per_shard) {
        victim = PickVictim(p, step);
      }
      // A promoted row, copied out before a demotion below can move the
      // buffer it lies in.
      if (from != nullptr) {
        back.assign(from->row(at), from->row(at) + row_floats);
        back_updates = from->updates[at];
        back_step = from->last_step[at];
        back_freq = from->freq[at];
      }
      const float* initial = from != nullptr ? back.data() : nullptr;
      if (victim != kNoSlot) {
        // The victim's index entry and row are likely out of cache: fetch
        // them while the new row's initial value is computed.
        p->index.prefetch(p->slot_key[victim]);
        const float* old_row = RowAt(p, victim);
        for (size_t b = 0; b < RowBytes(); b += 64) __builtin_prefetch(reinterpret_cast<const char*>(old_row) + b, 1);
        if (initial == nullptr) {
          init_.Fill(name_hash_, key, 0, fresh.data(), dim_);
          initial = fresh.data();
        }
        if (tier_ != nullptr) {
          demoted_at[p->slot_key[victim]] = static_cast<uint32_t>(demoted.size());
          demoted.Add(p->slot_key[victim], p->updates[victim], p->last_step[victim], p->freq[victim], old_row);
          demoted_marks.push_back(p->live[victim]);
          demoted_.fetch_add(1, std::memory_order_relaxed);
        } else {
          evicted_cap_.fetch_add(1, std::memory_order_relaxed);
        }
        Drop(p, victim);
      }
      ASSIGN_OR_RETURN(row, NewRow(p, key, &r, step, initial));
      if (from != nullptr) {
        // Bit for bit the row that left: optimizer state, update count,
        // last use and decayed count too.
        std::memcpy(row, back.data(), row_floats * sizeof(float));
        p->updates[r] = back_updates;
        p->last_step[r] = back_step;
        p->freq[r] = back_freq;
        p->live[r] = mark;
        if (from == &cold) promoted.push_back(key);
        promoted_.fetch_add(1, std::memory_order_relaxed);
      } else {
        admitted_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    ApplyOptimizer(opt, row, dim_, grads + size_t{idx[i]} * dim_, ++p->updates[r]);
    if (life_.on()) {
      if (life_.policy == Lifecycle::Policy::kLfu) {
        const uint64_t age = step > p->last_step[r] ? step - p->last_step[r] : 0;
        p->freq[r] = static_cast<float>(p->freq[r] * std::pow(static_cast<double>(life_.lfu_decay),
                                                                static_cast<double>(age)) + 1.0);
      }
      p->last_step[r] = std::max(p->last_step[r], step);
    }
  }
  if (tier_ != nullptr) {
    // Still under the partition's lock: no pull sees a row in neither tier.
    // One batch, deletions first, so a row dropped, made again and demoted
    // by this push ends on disk. A promotion deletes nothing: the row's
    // copy stays (kCopyOnDisk; deleting it made more than a third of the
    // tier's writes).
    ColdRows out;
    out.row_floats = static_cast<uint32_t>(row_floats);
    for (const auto& [key, j] : demoted_at) {
      out.Add(key, demoted.updates[j], demoted.last_step[j], demoted.freq[j], demoted.row(j));
    }
    if (!promoted.empty() || out.size() != 0 || !copies_gone.empty()) {
      // Before the write, which may land though it fails.
      ++p->moves;
      for (uint64_t key : promoted) p->moved_at[MoveBucket(key)] = p->moves;
      for (uint64_t key : copies_gone) p->moved_at[MoveBucket(key)] = p->moves;
      for (uint64_t key : out.keys) p->moved_at[MoveBucket(key)] = p->moves;
    }
    RETURN_IF_ERROR(tier_->Move(tier_space_, vshard, copies_gone.data(), copies_gone.size(), out));
    cold_rows_.fetch_add(out.size(), std::memory_order_relaxed);
    cold_rows_.fetch_sub(promoted.size(), std::memory_order_relaxed);
    p->cold += out.size();
    p->cold -= promoted.size();
    // The rows this push moved to disk are kept as a pull would have read
    // them: another worker may have pulled them from memory for the push
    // it sends next.
    for (size_t j = 0; j < out.size(); ++j) {
      if (!Keep(p, out.keys[j], &out, j, /*start_over=*/false)) break;
    }
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
