// SparseTable: checkpoints. A shard's rows captured under its lock (with
// a cold tier: merged with its rows on disk, or linked to a cut of the
// tier), and restored from a cut's records.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/shard_map.h"
#include "common/status_macros.h"
#include "server/cold_tier.h"
#include "server/table.h"

namespace fulcrum {

bool SparseTable::Captured(const Partition& p) const {
  return life_.on() ? !(p.updates.empty() && p.sketch.empty()) : !p.index.empty();
}

std::vector<uint32_t> SparseTable::CapturedShards() const {
  std::vector<uint32_t> out;
  for (uint32_t v = 0; v < partitions_.size(); ++v) {
    Partition* p = partitions_[v].get();
    absl::MutexLock lock(&p->mu);
    if (Captured(*p)) out.push_back(v);
  }
  return out;
}

uint64_t SparseTable::CaptureBytes() const {
  uint64_t per_row = RowBytes() + sizeof(uint64_t) + sizeof(uint32_t);
  if (life_.on()) per_row += sizeof(uint32_t) + sizeof(uint64_t) + sizeof(float);
  return num_rows() * per_row + sketch_bytes_.load(std::memory_order_relaxed);
}

SparseShardLife SparseTable::ShardState::Life() const {
  SparseShardLife l;
  l.slot = slot.data();
  l.last_step = last_step.data();
  l.freq = freq.data();
  l.slots = slots;
  l.victim_cursor = victim_cursor;
  l.ttl_cursor = ttl_cursor;
  l.free_slots = free_slots.data();
  l.num_free = static_cast<uint32_t>(free_slots.size());
  l.sketch = sketch.data();
  l.sketch_len = static_cast<uint32_t>(sketch.size());
  l.cold_linked = cold_linked;
  l.linked_cold_rows = linked_cold_rows;
  return l;
}

std::vector<uint64_t> SparseTable::MoveMarks() const {
  std::vector<uint64_t> marks;
  if (tier_ == nullptr) return marks;
  marks.reserve(partitions_.size());
  for (const auto& p : partitions_) {
    absl::MutexLock lock(&p->mu);
    marks.push_back(p->moves + p->restores);
  }
  return marks;
}

std::vector<SparseTable::ShardState> SparseTable::Capture(const std::vector<uint64_t>* marks) const {
  std::vector<ShardState> out;
  for (uint32_t v = 0; v < partitions_.size(); ++v) {
    ShardState s = CaptureShard(v, marks);
    if (s.vshard == v) out.push_back(std::move(s));
  }
  return out;
}

SparseTable::ShardState SparseTable::CaptureShard(uint32_t v, const std::vector<uint64_t>* marks) const {
  ShardState s;
  s.vshard = UINT32_MAX;  // nothing to capture
  if (v >= partitions_.size()) return s;
  const size_t row_floats = size_t{dim_} * (1 + num_slots());
  Partition* p = partitions_[v].get();
  absl::MutexLock lock(&p->mu);
  if (!Captured(*p)) return s;
  s.vshard = v;
  s.keys.reserve(p->index.size());
  s.updates.reserve(p->index.size());
  s.rows.resize(p->index.size() * row_floats);
  // Rows in key order, so a cut's bytes do not depend on arrival order.
  std::vector<std::pair<uint64_t, uint32_t>> order(p->index.begin(), p->index.end());
  std::sort(order.begin(), order.end());
  for (size_t k = 0; k < order.size(); ++k) {
    const uint32_t r = order[k].second;
    s.keys.push_back(order[k].first);
    s.updates.push_back(p->updates[r]);
    std::memcpy(s.rows.data() + k * row_floats, RowAt(p, r), row_floats * sizeof(float));
  }
  if (!life_.on()) return s;
  s.has_life = true;
  s.slot.reserve(order.size());
  s.last_step.reserve(order.size());
  s.freq.reserve(order.size());
  for (const auto& [key, r] : order) {
    s.slot.push_back(r);
    s.last_step.push_back(p->last_step[r]);
    s.freq.push_back(p->freq[r]);
  }
  if (tier_ != nullptr) {
    if (marks != nullptr && v < marks->size() && (*marks)[v] == p->moves + p->restores) {
      // Nothing moved on disk since the tier's cut: the rows stay there.
      s.cold_linked = true;
      s.linked_cold_rows = p->cold;
    } else {
      MergeColdRows(v, &s);
    }
  }
  s.slots = static_cast<uint32_t>(p->updates.size());
  s.victim_cursor = p->victim_cursor;
  s.ttl_cursor = p->ttl_cursor;
  s.free_slots = p->free_slots;
  s.sketch = p->sketch;
  return s;
}

void SparseTable::MergeColdRows(uint32_t v, ShardState* s) const {
  // The shard's rows on disk, read under its lock (no push moves a row
  // meanwhile) and merged with those in memory in key order, each with slot
  // kColdSlot. A read that fails leaves the state marked failed.
  const size_t row_floats = size_t{dim_} * (1 + num_slots());
  ColdRows cold;
  cold.row_floats = static_cast<uint32_t>(row_floats);
  const absl::Status read = tier_->Scan(tier_space_, v, cold.row_floats, size_t{1} << 16, [&](const ColdRows& batch) {
    for (size_t i = 0; i < batch.size(); ++i) {
      cold.Add(batch.keys[i], batch.updates[i], batch.last_step[i], batch.freq[i], batch.row(i));
    }
    return absl::OkStatus();
  });
  if (!read.ok()) {
    s->error = read;
    return;
  }
  if (cold.size() == 0) return;
  MergedRows m;
  MergeTiers(static_cast<uint32_t>(row_floats), s->keys.size(), s->keys.data(), s->updates.data(), s->rows.data(),
             s->slot.data(), s->last_step.data(), s->freq.data(), cold, &m);
  s->keys = std::move(m.keys);
  s->updates = std::move(m.updates);
  s->rows = std::move(m.rows);
  s->slot = std::move(m.slot);
  s->last_step = std::move(m.last_step);
  s->freq = std::move(m.freq);
}

absl::Status SparseTable::Restore(uint32_t vshard, uint32_t dim, uint32_t slots, size_t n, const uint64_t* keys,
                                  const uint32_t* updates, const float* rows, uint64_t step,
                                  const SparseShardLife* life) {
  if (vshard >= partitions_.size()) {
    return absl::DataLossError(absl::StrCat("checkpoint record of table '", name_, "' names virtual shard ", vshard,
                                            "; the job has ", partitions_.size()));
  }
  if (dim != dim_ || slots != static_cast<uint32_t>(num_slots())) {
    return absl::DataLossError(absl::StrCat("checkpoint record of table '", name_, "' virtual shard ", vshard,
                                            " holds rows of dim ", dim, " with ", slots,
                                            " optimizer slots; the table's rows have dim ", dim_, " with ",
                                            num_slots()));
  }
  for (size_t k = 0; k < n; ++k) {
    if (VShardOfKey(name_hash(), keys[k], static_cast<uint32_t>(partitions_.size())) != vshard) {
      return absl::DataLossError(absl::StrCat("checkpoint record of table '", name_, "' virtual shard ", vshard,
                                              " holds key ", keys[k], ", which belongs to virtual shard ",
                                              VShardOfKey(name_hash(), keys[k],
                                                          static_cast<uint32_t>(partitions_.size()))));
    }
  }
  const size_t row_floats = size_t{dim_} * (1 + num_slots());
  Partition* p = partitions_[vshard].get();
  absl::MutexLock lock(&p->mu);
  // A restore may put rows on disk: what pulls read there before is stale.
  p->read_at.clear();
  p->read.Clear();
  ++p->restores;
  if (life != nullptr && life_.on()) return RestoreLife(vshard, p, n, keys, updates, rows, *life);
  for (size_t k = 0; k < n; ++k) {
    uint32_t r;
    ASSIGN_OR_RETURN(float* row, Row(p, keys[k], &r, step));
    std::memcpy(row, rows + k * row_floats, row_floats * sizeof(float));
    p->updates[r] = updates[k];
  }
  return absl::OkStatus();
}

absl::Status SparseTable::RestoreLife(uint32_t vshard, Partition* p, size_t n, const uint64_t* keys,
                                      const uint32_t* updates, const float* rows, const SparseShardLife& life) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(
        absl::StrCat("checkpoint record of table '", name_, "' virtual shard ", vshard, ": ", why));
  };
  if (!p->updates.empty() || !p->sketch.empty()) return bad("the shard was already restored");
  if (life.cold_linked) {
    return bad("its rows on disk lie in a linked cut of another tier (the cut's store reads them in first)");
  }
  // Rows that lay in the cold tier go back there; the rest fill the slots.
  size_t cold = 0;
  for (size_t k = 0; k < n; ++k) cold += life.slot[k] == kColdSlot;
  if (cold != 0 && tier_ == nullptr) {
    return bad(absl::StrCat(cold, " of its rows lay in a cold tier, and the table has none"));
  }
  if (n - cold + uint64_t{life.num_free} != life.slots) {
    return bad(absl::StrCat(n - cold, " rows in memory and ", life.num_free, " freed slots do not make its ",
                            life.slots, " slots"));
  }
  if (life.sketch_len != 0 && life.sketch_len != kSketchRows * life_.sketch_width) {
    return bad(absl::StrCat("its admission sketch has ", life.sketch_len, " counters; the table's has ",
                            kSketchRows * life_.sketch_width));
  }
  // Every slot is a row's or freed, once.
  std::vector<uint8_t> seen(life.slots, 0);
  for (size_t k = 0; k < n; ++k) {
    if (life.slot[k] == kColdSlot) continue;
    if (life.slot[k] >= life.slots || seen[life.slot[k]]++) {
      return bad(absl::StrCat("key ", keys[k], " names slot ", life.slot[k], " of ", life.slots, " (or a taken one)"));
    }
  }
  for (uint32_t i = 0; i < life.num_free; ++i) {
    if (life.free_slots[i] >= life.slots || seen[life.free_slots[i]]++) {
      return bad(absl::StrCat("freed slot ", life.free_slots[i], " of ", life.slots, " is out of range or taken"));
    }
  }
  if (life.slots > 0) RETURN_IF_ERROR(EnsureCapacity(p, life.slots));
  if (life.sketch_len != 0) {
    RETURN_IF_ERROR(EnsureSketch(p));
    std::copy_n(life.sketch, life.sketch_len, p->sketch.begin());
    p->sketch_sum = 0;
    for (uint16_t c : p->sketch) p->sketch_sum += c;
  }
  const size_t row_floats = size_t{dim_} * (1 + num_slots());
  p->updates.assign(life.slots, 0);
  p->slot_key.assign(life.slots, 0);
  p->live.assign(life.slots, 0);
  p->last_step.assign(life.slots, 0);
  p->freq.assign(life.slots, 0);
  ColdRows on_disk;
  on_disk.row_floats = static_cast<uint32_t>(row_floats);
  for (size_t k = 0; k < n; ++k) {
    const uint32_t r = life.slot[k];
    if (r == kColdSlot) {
      on_disk.Add(keys[k], updates[k], life.last_step[k], life.freq[k], rows + k * row_floats);
      continue;
    }
    std::memcpy(RowAt(p, r), rows + k * row_floats, row_floats * sizeof(float));
    p->index.emplace(keys[k], r);
    rows_.fetch_add(1, std::memory_order_relaxed);
    p->updates[r] = updates[k];
    p->slot_key[r] = keys[k];
    p->live[r] = kLive;
    p->last_step[r] = life.last_step[k];
    p->freq[r] = life.freq[k];
  }
  p->free_slots.assign(life.free_slots, life.free_slots + life.num_free);
  p->victim_cursor = life.victim_cursor;
  p->ttl_cursor = life.ttl_cursor;
  if (on_disk.size() != 0) {
    RETURN_IF_ERROR(tier_->Put(tier_space_, vshard, on_disk));
    cold_rows_.fetch_add(on_disk.size(), std::memory_order_relaxed);
    p->cold += on_disk.size();
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
