#include "server/cold_tier.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/options.h>
#include <rocksdb/slice.h>
#include <rocksdb/table.h>
#include <rocksdb/utilities/checkpoint.h>
#include <rocksdb/write_batch.h>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_record.h"
#include "common/logging.h"
#include "common/rocksdb_status.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

// Keys: big-endian space, virtual shard and row key (16 bytes), so one
// shard's rows are contiguous and in key order. Space names sit after every
// row, under four 0xff bytes (space ids stay below 0xffffffff).
constexpr size_t kKeyBytes = 16;
constexpr char kSpaceTag[] = "\xff\xff\xff\xff";
// A value: update count (4 bytes), last push step (8), decayed count (4),
// then the row's floats.
constexpr size_t kHeaderBytes = 16;

void PutBe(char* out, uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i, v >>= 8) out[i] = static_cast<char>(v & 0xff);
}
uint64_t GetBe(const char* in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | static_cast<uint8_t>(in[i]);
  return v;
}

struct RowKey {
  char b[kKeyBytes];
  RowKey(uint32_t space, uint32_t vshard, uint64_t key) {
    PutBe(b, space, 4);
    PutBe(b + 4, vshard, 4);
    PutBe(b + 8, key, 8);
  }
  rocksdb::Slice slice() const { return rocksdb::Slice(b, kKeyBytes); }
};

// The 8-byte prefix of (space, vshard) as a number, so the end of a range is
// the next number.
std::string Prefix(uint64_t space_and_shard) {
  std::string s(8, '\0');
  PutBe(s.data(), space_and_shard, 8);
  return s;
}

std::string SpaceName(const std::string& job_id, const std::string& table) {
  return absl::StrCat(kSpaceTag, job_id, std::string(1, '\0'), table);
}

absl::Status DecodeRow(const rocksdb::Slice& key, const rocksdb::Slice& v, ColdRows* out) {
  if (v.size() != kHeaderBytes + size_t{out->row_floats} * sizeof(float)) {
    return absl::DataLossError(absl::StrCat("row ", GetBe(key.data() + 8, 8), " of virtual shard ",
                                            GetBe(key.data() + 4, 4), " holds ", v.size(), " bytes, not the ",
                                            kHeaderBytes + size_t{out->row_floats} * sizeof(float), " of a row of ",
                                            out->row_floats, " floats"));
  }
  uint32_t updates;
  uint64_t step;
  float freq;
  std::memcpy(&updates, v.data(), 4);
  std::memcpy(&step, v.data() + 4, 8);
  std::memcpy(&freq, v.data() + 12, 4);
  out->keys.push_back(GetBe(key.data() + 8, 8));
  out->updates.push_back(updates);
  out->last_step.push_back(step);
  out->freq.push_back(freq);
  const size_t at = out->values.size();
  out->values.resize(at + out->row_floats);
  if (out->row_floats != 0) std::memcpy(out->values.data() + at, v.data() + kHeaderBytes, out->row_floats * sizeof(float));
  return absl::OkStatus();
}

}  // namespace

void ColdRows::Add(uint64_t key, uint32_t update_count, uint64_t step, float count, const float* v) {
  keys.push_back(key);
  updates.push_back(update_count);
  last_step.push_back(step);
  freq.push_back(count);
  values.insert(values.end(), v, v + row_floats);
}

void ColdRows::Clear() {
  keys.clear();
  updates.clear();
  last_step.clear();
  freq.clear();
  values.clear();
}

ColdTier::ColdTier(std::string dir, rocksdb::Env* env, bool read_only)
    : dir_(std::move(dir)), env_(env), read_only_(read_only) {}

ColdTier::~ColdTier() = default;

absl::StatusOr<std::unique_ptr<ColdTier>> ColdTier::Open(const std::string& dir, rocksdb::Env* env) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    // Rows a previous process demoted mean nothing without its memory.
    FLOG(INFO) << "cold tier in " << dir << ": deleting what a previous process left";
    fs::remove_all(dir, ec);
    if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot clear the cold tier in ", dir, ": ", ec.message()));
  }
  fs::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create the cold tier in ", dir, ": ", ec.message()));
  std::unique_ptr<ColdTier> tier(new ColdTier(dir, env, /*read_only=*/false));
  absl::MutexLock lock(&tier->db_mu_);
  RETURN_IF_ERROR(tier->OpenDbLocked());
  return tier;
}

absl::StatusOr<std::unique_ptr<ColdTier>> ColdTier::OpenCut(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::NotFoundError(absl::StrCat("no cut of a cold tier in ", dir));
  std::unique_ptr<ColdTier> tier(new ColdTier(dir, nullptr, /*read_only=*/true));
  absl::MutexLock lock(&tier->db_mu_);
  RETURN_IF_ERROR(tier->OpenDbLocked());
  return tier;
}

absl::Status ColdTier::OpenDbLocked() {
  rocksdb::Options options;
  options.create_if_missing = !read_only_;
  if (env_ != nullptr) options.env = env_;
  // Rows are floats, which barely compress.
  options.compression = rocksdb::kNoCompression;
  // Demotions come in batches of a shard's victims: a larger memtable turns
  // them into fewer, larger table files.
  options.write_buffer_size = 64 << 20;
  // Most reads look for a row in the memtable that is not there (it lies
  // in a table file, or was never demoted): a Bloom filter over the
  // memtable's keys answers them without a walk of its skip list (that
  // walk took a fifth of a spilling server's time).
  options.memtable_prefix_bloom_size_ratio = 0.05;
  options.memtable_whole_key_filtering = true;
  options.max_open_files = 256;
  options.keep_log_file_num = 2;
  options.max_log_file_size = 256 << 10;
  options.max_manifest_file_size = 1 << 20;
  // Point reads of absent keys (rows never demoted) stop at a Bloom filter.
  rocksdb::BlockBasedTableOptions table;
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::DB* db = nullptr;
  db_.reset();
  const rocksdb::Status s = read_only_ ? rocksdb::DB::OpenForReadOnly(options, dir_, &db)
                                       : rocksdb::DB::Open(options, dir_, &db);
  RETURN_IF_ERROR(FromRocks(s, absl::StrCat("opening the cold tier in ", dir_)));
  db_.reset(db);
  return LoadSpacesLocked();
}

absl::Status ColdTier::LoadSpacesLocked() {
  absl::MutexLock lock(&spaces_mu_);
  spaces_.clear();
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(kSpaceTag); it->Valid(); it->Next()) {
    const rocksdb::Slice k = it->key(), v = it->value();
    if (!k.starts_with(kSpaceTag)) break;
    if (v.size() != 4) return absl::DataLossError(absl::StrCat("cold tier in ", dir_, ": a space record of ", v.size(), " bytes"));
    spaces_[std::string(k.data() + 4, k.size() - 4)] = static_cast<uint32_t>(GetBe(v.data(), 4));
  }
  return FromRocks(it->status(), absl::StrCat("reading the cold tier's tables in ", dir_));
}

absl::Status ColdTier::CheckOpenLocked() const {
  if (db_ != nullptr) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("the cold tier in ", dir_,
                                             " is closed: reopening it after a failed write failed"));
}

absl::Status ColdTier::Wrote(const rocksdb::Status& s, const std::string& what) {
  if (!s.ok()) stuck_ = true;
  return FromRocks(s, absl::StrCat("cold tier in ", dir_, ": ", what));
}

absl::Status ColdTier::RecoverIfStuck() {
  if (!stuck_.load()) return absl::OkStatus();
  absl::MutexLock lock(&db_mu_);
  if (!stuck_.load()) return absl::OkStatus();
  // Reopened, which replays the write-ahead log: rows written before the
  // failure are kept.
  FLOG(WARNING) << "cold tier in " << dir_ << ": reopening RocksDB after a failed write";
  ++reopens_;
  RETURN_IF_ERROR(OpenDbLocked());
  stuck_ = false;
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> ColdTier::Space(const std::string& job_id, const std::string& table) {
  const std::string name = SpaceName(job_id, table);
  {
    absl::MutexLock lock(&spaces_mu_);
    auto it = spaces_.find(name.substr(4));
    if (it != spaces_.end()) return it->second;
    if (read_only_) {
      return absl::NotFoundError(absl::StrCat("the cut of a cold tier in ", dir_, " holds no rows of table '", table,
                                              "' of job ", job_id));
    }
  }
  RETURN_IF_ERROR(RecoverIfStuck());
  absl::ReaderMutexLock db_lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  absl::MutexLock lock(&spaces_mu_);
  auto it = spaces_.find(name.substr(4));
  if (it != spaces_.end()) return it->second;
  const uint32_t id = static_cast<uint32_t>(spaces_.size()) + 1;
  char v[4];
  PutBe(v, id, 4);
  RETURN_IF_ERROR(Wrote(db_->Put(rocksdb::WriteOptions(), name, rocksdb::Slice(v, 4)),
                        absl::StrCat("naming table '", table, "' of job ", job_id)));
  spaces_[name.substr(4)] = id;
  return id;
}

absl::Status ColdTier::Put(uint32_t space, uint32_t vshard, const ColdRows& rows) {
  return Move(space, vshard, nullptr, 0, rows);
}

absl::Status ColdTier::Delete(uint32_t space, uint32_t vshard, const uint64_t* keys, size_t n) {
  ColdRows none;
  return Move(space, vshard, keys, n, none);
}

absl::Status ColdTier::Move(uint32_t space, uint32_t vshard, const uint64_t* gone, size_t n_gone,
                            const ColdRows& rows) {
  if (read_only_) return absl::FailedPreconditionError(absl::StrCat("the cut of a cold tier in ", dir_, " is read-only"));
  if (n_gone == 0 && rows.size() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(RecoverIfStuck());
  // In key order: each insert into the memtable's skip list starts where
  // the one before it ended.
  std::vector<uint64_t> deletes(gone, gone + n_gone);
  std::sort(deletes.begin(), deletes.end());
  std::vector<uint32_t> order(rows.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&rows](uint32_t a, uint32_t b) { return rows.keys[a] < rows.keys[b]; });
  rocksdb::WriteBatch batch;
  for (uint64_t k : deletes) {
    RowKey key(space, vshard, k);
    batch.Delete(key.slice());
  }
  std::string value(kHeaderBytes + size_t{rows.row_floats} * sizeof(float), '\0');
  for (uint32_t i : order) {
    std::memcpy(value.data(), &rows.updates[i], 4);
    std::memcpy(value.data() + 4, &rows.last_step[i], 8);
    std::memcpy(value.data() + 12, &rows.freq[i], 4);
    if (rows.row_floats != 0) std::memcpy(value.data() + kHeaderBytes, rows.row(i), rows.row_floats * sizeof(float));
    RowKey key(space, vshard, rows.keys[i]);
    batch.Put(key.slice(), value);
  }
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  RETURN_IF_ERROR(Wrote(db_->Write(rocksdb::WriteOptions(), &batch),
                        absl::StrCat("writing ", rows.size(), " rows and deleting ", n_gone,
                                     " of virtual shard ", vshard)));
  rows_written_ += rows.size();
  rows_deleted_ += n_gone;
  ++writes_;
  return absl::OkStatus();
}

absl::Status ColdTier::Get(uint32_t space, uint32_t vshard, const uint64_t* keys, size_t n, ColdRows* out,
                           std::vector<bool>* found) const {
  const std::vector<uint32_t> vshards(n, vshard);
  return Get(space, vshards.data(), keys, n, out, found);
}

absl::Status ColdTier::Get(uint32_t space, const uint32_t* vshards, const uint64_t* keys, size_t n, ColdRows* out,
                           std::vector<bool>* found) const {
  found->assign(n, false);
  if (n == 0) return absl::OkStatus();
  std::vector<RowKey> k;
  k.reserve(n);
  std::vector<rocksdb::Slice> slices;
  slices.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    k.emplace_back(space, vshards[i], keys[i]);
    slices.push_back(k.back().slice());
  }
  std::vector<rocksdb::PinnableSlice> values(n);
  std::vector<rocksdb::Status> statuses(n);
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  db_->MultiGet(rocksdb::ReadOptions(), db_->DefaultColumnFamily(), n, slices.data(), values.data(), statuses.data());
  ++reads_;
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i].IsNotFound()) continue;
    RETURN_IF_ERROR(FromRocks(statuses[i], absl::StrCat("cold tier in ", dir_, ": reading row ", keys[i],
                                                        " of virtual shard ", vshards[i])));
    RETURN_IF_ERROR(DecodeRow(slices[i], values[i], out));
    (*found)[i] = true;
    ++rows_read_;
  }
  return absl::OkStatus();
}

absl::Status ColdTier::Take(uint32_t space, uint32_t vshard, const uint64_t* keys, size_t n, ColdRows* out,
                            std::vector<bool>* found) {
  const size_t before = out->size();
  RETURN_IF_ERROR(Get(space, vshard, keys, n, out, found));
  if (out->size() == before) return absl::OkStatus();
  return Delete(space, vshard, out->keys.data() + before, out->size() - before);
}

absl::Status ColdTier::Scan(uint32_t space, uint32_t vshard, uint32_t row_floats, size_t batch,
                            const std::function<absl::Status(const ColdRows&)>& visit) const {
  const uint64_t at = (uint64_t{space} << 32) | vshard;
  const std::string lo = Prefix(at), hi = Prefix(at + 1);
  const rocksdb::Slice upper(hi);
  rocksdb::ReadOptions ro;
  ro.iterate_upper_bound = &upper;
  // A scan reads each block once: it need not evict the point reads' blocks.
  ro.fill_cache = false;
  ColdRows rows;
  rows.row_floats = row_floats;
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
  for (it->Seek(lo); it->Valid(); it->Next()) {
    RETURN_IF_ERROR(DecodeRow(it->key(), it->value(), &rows));
    if (rows.size() >= batch) {
      RETURN_IF_ERROR(visit(rows));
      rows.Clear();
    }
  }
  RETURN_IF_ERROR(FromRocks(it->status(), absl::StrCat("cold tier in ", dir_, ": scanning virtual shard ", vshard)));
  if (rows.size() > 0) RETURN_IF_ERROR(visit(rows));
  return absl::OkStatus();
}

absl::Status ColdTier::Drop(uint32_t space) {
  if (read_only_) return absl::FailedPreconditionError(absl::StrCat("the cut of a cold tier in ", dir_, " is read-only"));
  RETURN_IF_ERROR(RecoverIfStuck());
  const std::string lo = Prefix(uint64_t{space} << 32), hi = Prefix(uint64_t{space + 1} << 32);
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  return Wrote(db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(), lo, hi),
               absl::StrCat("dropping space ", space));
}

absl::Status ColdTier::Checkpoint(const std::string& dir) {
  RETURN_IF_ERROR(RecoverIfStuck());
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  rocksdb::Checkpoint* raw = nullptr;
  RETURN_IF_ERROR(Wrote(rocksdb::Checkpoint::Create(db_.get(), &raw), "preparing a cut"));
  std::unique_ptr<rocksdb::Checkpoint> cp(raw);
  // 0: flush the memtable first, so the cut is table files only.
  return Wrote(cp->CreateCheckpoint(dir, /*log_size_for_flush=*/0), absl::StrCat("writing a cut into ", dir));
}

size_t MergeTiers(uint32_t row_floats, size_t n, const uint64_t* keys, const uint32_t* updates, const float* rows,
                  const uint32_t* slot, const uint64_t* last_step, const float* freq, const ColdRows& cold,
                  MergedRows* out) {
  const size_t total = n + cold.size();
  *out = MergedRows();
  out->keys.reserve(total);
  out->updates.reserve(total);
  out->rows.reserve(total * row_floats);
  out->slot.reserve(total);
  out->last_step.reserve(total);
  out->freq.reserve(total);
  size_t a = 0, b = 0, taken = 0;
  while (a < n || b < cold.size()) {
    if (a < n && b < cold.size() && keys[a] == cold.keys[b]) {
      ++b;  // an older copy of a row in memory: memory's is the row
      continue;
    }
    if (b == cold.size() || (a < n && keys[a] < cold.keys[b])) {
      out->keys.push_back(keys[a]);
      out->updates.push_back(updates[a]);
      out->rows.insert(out->rows.end(), rows + a * row_floats, rows + (a + 1) * row_floats);
      out->slot.push_back(slot[a]);
      out->last_step.push_back(last_step[a]);
      out->freq.push_back(freq[a]);
      ++a;
    } else {
      out->keys.push_back(cold.keys[b]);
      out->updates.push_back(cold.updates[b]);
      out->rows.insert(out->rows.end(), cold.row(b), cold.row(b) + row_floats);
      out->slot.push_back(kColdSlot);
      out->last_step.push_back(cold.last_step[b]);
      out->freq.push_back(cold.freq[b]);
      ++b;
      ++taken;
    }
  }
  return taken;
}

ColdTier::Counts ColdTier::counts() const {
  Counts c;
  c.rows_written = rows_written_.load();
  c.rows_read = rows_read_.load();
  c.rows_deleted = rows_deleted_.load();
  c.reads = reads_.load();
  c.writes = writes_.load();
  c.reopens = reopens_.load();
  return c;
}

uint64_t ColdTier::DiskBytes() const {
  absl::ReaderMutexLock lock(&db_mu_);
  if (db_ == nullptr) return 0;
  uint64_t sst = 0, mem = 0;
  db_->GetIntProperty("rocksdb.live-sst-files-size", &sst);
  db_->GetIntProperty("rocksdb.cur-size-all-mem-tables", &mem);
  return sst + mem;
}

uint64_t ColdTier::MemoryBytes() const {
  absl::ReaderMutexLock lock(&db_mu_);
  if (db_ == nullptr) return 0;
  uint64_t mem = 0, readers = 0, cache = 0;
  db_->GetIntProperty("rocksdb.cur-size-all-mem-tables", &mem);
  db_->GetIntProperty("rocksdb.estimate-table-readers-mem", &readers);
  db_->GetIntProperty("rocksdb.block-cache-usage", &cache);
  return mem + readers + cache;
}

}  // namespace fulcrum
