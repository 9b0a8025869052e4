#include "server/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include <rocksdb/convenience.h>
#include <rocksdb/db.h>
#include <rocksdb/metadata.h>
#include <rocksdb/options.h>
#include <rocksdb/sst_file_writer.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_record.h"
#include "common/logging.h"
#include "common/rocksdb_options.h"
#include "common/rocksdb_status.h"
#include "common/status_macros.h"
#include "server/cold_cut.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

uint32_t Crc(uint32_t format, const void* data, size_t n, uint32_t crc = 0) {
  return CheckpointCrc(format, data, n, crc);
}

absl::Status CheckFormat(const v1::ShardCutMeta& meta, const std::string& where) {
  if (KnownFormat(meta.format())) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("checkpoint ", where, " has format ", meta.format(),
                                          ", which this build cannot read (newest known: ", kCurrentFormat, ")"));
}

template <typename T>
void Append(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

std::string DenseKey(const std::string& prefix, const std::string& table, uint32_t chunk) {
  return absl::StrCat(prefix, "dense/", table, "/", absl::StrFormat("%08x", chunk));
}
std::string SparseKey(const std::string& prefix, const std::string& table, uint32_t vshard) {
  return absl::StrCat(prefix, "sparse/", table, "/", absl::StrFormat("%08x", vshard));
}

// A key "cut/<job>/<16 hex>/<rest>" split at its cut prefix; false for
// keys of another shape.
bool SplitCutKey(std::string_view key, std::string_view* prefix, std::string_view* rest) {
  if (key.substr(0, 4) != "cut/") return false;
  const size_t job_end = key.find('/', 4);
  if (job_end == std::string_view::npos || key.size() < job_end + 18 || key[job_end + 17] != '/') return false;
  *prefix = key.substr(0, job_end + 18);
  *rest = key.substr(job_end + 18);
  return true;
}

absl::StatusOr<v1::ShardCutMeta> ParseMeta(const std::string& key, std::string_view raw) {
  v1::ShardCutMeta meta;
  if (!meta.ParseFromArray(raw.data(), static_cast<int>(raw.size()))) {
    return absl::DataLossError(absl::StrCat("checkpoint meta ", key, " does not parse"));
  }
  return meta;
}

// The first byte after every key starting with `prefix` (which ends in '/').
std::string PrefixEnd(const std::string& prefix) { return prefix.substr(0, prefix.size() - 1) + "0"; }


}  // namespace

std::string CutPrefix(const std::string& job_id, uint64_t cut_id) {
  return absl::StrCat("cut/", job_id, "/", absl::StrFormat("%016x", cut_id), "/");
}

namespace {

// A cut's cold tier cut, by name: "<job>-<cut, 16 hex>", from the cut's key
// prefix "cut/<job>/<cut, 16 hex>/".
std::string ColdCutName(std::string_view prefix) {
  const std::string_view inner = prefix.substr(4, prefix.size() - 5);
  const size_t slash = inner.rfind('/');
  return std::string(inner.substr(0, slash)) + "-" + std::string(inner.substr(slash + 1));
}

}  // namespace

std::string CheckpointStore::ColdCutDir(const std::string& job_id, uint64_t cut_id) const {
  return absl::StrCat(ColdCutsRoot(), "/", ColdCutName(CutPrefix(job_id, cut_id)));
}

absl::StatusOr<LinkedCut> CheckpointStore::Linked(const v1::ShardCutMeta& meta) const {
  LinkedCut cut;
  cut.job_id = meta.spec().job_id();
  if (meta.cold_cut().empty()) return cut;
  cut.spaces.insert(meta.cold_spaces().begin(), meta.cold_spaces().end());
  if (meta.cold_cut().find('/') != std::string::npos || meta.cold_cut().starts_with(".")) {
    return absl::DataLossError(absl::StrCat("cut ", meta.cut_id(), " of job '", meta.spec().job_id(), "' in ", dir_,
                                            " links a cold tier cut named '", meta.cold_cut(), "'"));
  }
  absl::MutexLock lock(&linked_mu_);
  if (auto it = linked_.find(meta.cold_cut()); it != linked_.end()) {
    cut.tier = it->second;
    return cut;
  }
  const std::string path = absl::StrCat(ColdCutsRoot(), "/", meta.cold_cut());
  absl::StatusOr<std::unique_ptr<ColdTier>> tier = ColdTier::OpenCut(path);
  if (!tier.ok()) {
    return absl::DataLossError(absl::StrCat("cut ", meta.cut_id(), " of job '", meta.spec().job_id(),
                                            "': its rows on disk lie in ", path, ": ", tier.status().message()));
  }
  if (linked_.size() >= 4) linked_.erase(linked_.begin());
  cut.tier = *std::move(tier);
  linked_[meta.cold_cut()] = cut.tier;
  return cut;
}

void CheckpointStore::CollectColdCuts(const std::set<std::string>& committed) {
  std::set<std::string> kept;
  for (const std::string& prefix : committed) kept.insert(ColdCutName(prefix));
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ColdCutsRoot(), ec)) {
    if (kept.count(e.path().filename().string())) continue;
    FLOG(INFO) << "checkpoints in " << dir_ << ": removing " << e.path().string() << ", a cold tier cut of no committed cut";
    std::error_code rm;
    fs::remove_all(e.path(), rm);
  }
}

absl::StatusOr<std::unique_ptr<CheckpointStore>> CheckpointStore::Open(const std::string& dir, rocksdb::Env* env,
                                                                       absl::Duration commit_delay) {
  std::error_code ec;
  fs::create_directories(fs::path(dir) / "ingest", ec);
  if (!ec) fs::create_directories(ColdCutsRootOf(dir), ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create checkpoint directory ", dir, ": ", ec.message()));
  std::unique_ptr<CheckpointStore> store(new CheckpointStore(dir, env, commit_delay));
  absl::MutexLock lock(&store->db_mu_);
  RETURN_IF_ERROR(store->OpenDbLocked());
  RETURN_IF_ERROR(store->CollectGarbageLocked(/*files=*/true));
  return store;
}

CheckpointStore::CheckpointStore(std::string dir, rocksdb::Env* env, absl::Duration commit_delay)
    : dir_(std::move(dir)), env_(env), commit_delay_(commit_delay) {}

CheckpointStore::~CheckpointStore() = default;

absl::Status CheckpointStore::OpenDbLocked() {
  rocksdb::Options options;
  options.create_if_missing = true;
  if (env_ != nullptr) options.env = env_;
  // Float tensors barely compress; compressing them costs more than the
  // bytes it saves on this machine's disk.
  options.compression = rocksdb::kNoCompression;
  // Open files stay bounded however many cuts and jobs the store holds
  // (RocksDB's default keeps every table file open): the table cache opens
  // the rest on demand. A cut is one file, so this covers 64 cuts read at
  // once without reopening.
  options.max_open_files = kMaxOpenFiles;
  // The store's own writes are small (a cut's meta, a deletion's
  // tombstones), but the info log, the manifest (one edit per ingest and
  // deletion) and the write-ahead log grow with each: bounded, for a server
  // that runs for months.
  BoundRocksDbOwnFiles(&options);
  rocksdb::DB* db = nullptr;
  db_.reset();  // RocksDB's lock on the directory goes with it
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(options, dir_, &db), absl::StrCat("opening checkpoints in ", dir_)));
  db_.reset(db);
  return absl::OkStatus();
}

absl::Status CheckpointStore::CheckOpenLocked() const {
  if (db_ != nullptr) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("checkpoints in ", dir_,
                                             " are closed: reopening them after a failed write failed; the next "
                                             "checkpoint tries again"));
}

absl::Status CheckpointStore::Wrote(const rocksdb::Status& s, const std::string& what) {
  if (!s.ok()) stuck_ = true;
  return FromRocks(s, what);
}

absl::Status CheckpointStore::RecoverIfStuck() {
  if (!stuck_.load()) return absl::OkStatus();
  absl::MutexLock lock(&db_mu_);  // waits for every read and write under way
  if (!stuck_.load()) return absl::OkStatus();
  // Reopened rather than resumed: RocksDB 7.8 resumed after a failed WAL
  // write (ENOSPC) then failed an assertion in its next ingest (a table
  // file numbered 0). Opening replays the log and manifest from the disk.
  FLOG(WARNING) << "checkpoints in " << dir_ << ": reopening RocksDB after a failed write";
  ++reopens_;
  RETURN_IF_ERROR(OpenDbLocked());
  // The failed write's records, ingested without their meta, go now. No
  // write runs (this lock is exclusive), but one may be writing its ingest
  // file: those files stay.
  RETURN_IF_ERROR(CollectGarbageLocked(/*files=*/false));
  stuck_ = false;
  FLOG(INFO) << "checkpoints in " << dir_ << " reopened after a failed write";
  return absl::OkStatus();
}

absl::Status CheckpointStore::CollectGarbageLocked(bool files) {
  // Cut prefixes seen, and which of them are committed.
  std::set<std::string> seen, committed;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("cut/"); it->Valid() && it->key().starts_with("cut/"); it->Next()) {
    std::string_view prefix, rest;
    if (!SplitCutKey(it->key().ToStringView(), &prefix, &rest)) continue;
    seen.emplace(prefix);
    if (rest == "meta") committed.emplace(prefix);
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scanning checkpoints"));
  for (const std::string& prefix : seen) {
    if (committed.count(prefix)) continue;
    RETURN_IF_ERROR(FromRocks(db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(), prefix,
                                               PrefixEnd(prefix)),
                              absl::StrCat("deleting the uncommitted cut ", prefix)));
    RETURN_IF_ERROR(ReclaimLocked(prefix));
  }
  if (!files) return absl::OkStatus();
  CollectColdCuts(committed);
  // Ingest files of writes that never finished.
  std::error_code ec;
  for (const auto& f : fs::directory_iterator(fs::path(dir_) / "ingest", ec)) fs::remove(f.path(), ec);
  return absl::OkStatus();
}

namespace {

// One record of a cut: its key, and which dense chunk or sparse shard of
// the captured state it holds.
struct CutRecord {
  std::string key;
  bool dense;
  size_t table, item;
  bool streamed = false;  // item indexes the table's `stream`, copied as it is written
};

// The cut's records in key order (SstFileWriter requires it).
absl::StatusOr<std::vector<CutRecord>> CutRecords(const std::string& prefix, const JobState& state) {
  std::vector<CutRecord> refs;
  for (size_t t = 0; t < state.dense.size(); ++t) {
    const std::string& name = state.dense[t].table->name();
    if (name.find('/') != std::string::npos) return absl::InvalidArgumentError("table names with '/' cannot be checkpointed");
    for (size_t i = 0; i < state.dense[t].chunks.size(); ++i) {
      refs.push_back({DenseKey(prefix, name, state.dense[t].chunks[i].chunk), true, t, i});
    }
  }
  for (size_t t = 0; t < state.sparse.size(); ++t) {
    const std::string& name = state.sparse[t].table->name();
    if (name.find('/') != std::string::npos) return absl::InvalidArgumentError("table names with '/' cannot be checkpointed");
    for (size_t i = 0; i < state.sparse[t].shards.size(); ++i) {
      refs.push_back({SparseKey(prefix, name, state.sparse[t].shards[i].vshard), false, t, i});
    }
    for (size_t i = 0; i < state.sparse[t].stream.size(); ++i) {
      refs.push_back({SparseKey(prefix, name, state.sparse[t].stream[i]), false, t, i, true});
    }
  }
  std::sort(refs.begin(), refs.end(), [](const CutRecord& a, const CutRecord& b) { return a.key < b.key; });
  return refs;
}

// A record's value before its checksum; adds a shard's rows to `rows` (and
// those it leaves in the cut's linked cold tier to `linked`). Fails only
// when a streamed shard's rows on disk could not be read.
absl::Status EncodeRecord(const JobState& state, const CutRecord& r, std::string* value, uint64_t* rows,
                          uint64_t* linked) {
  value->clear();
  if (r.dense) {
    const JobState::Dense& d = state.dense[r.table];
    const DenseTable::ChunkState& c = d.chunks[r.item];
    const uint32_t length = d.table->ChunkLength(c.chunk);
    const uint32_t slots = static_cast<uint32_t>(d.table->num_slots());
    Append(value, c.updates);
    Append(value, length);
    Append(value, slots);
    value->append(reinterpret_cast<const char*>(c.block.get()), size_t{length} * (1 + slots) * sizeof(float));
    return absl::OkStatus();
  }
  const JobState::Sparse& s = state.sparse[r.table];
  SparseTable::ShardState streamed;
  if (r.streamed) streamed = s.table->CaptureShard(s.stream[r.item], s.marks.empty() ? nullptr : &s.marks);
  const SparseTable::ShardState& sh = r.streamed ? streamed : s.shards[r.item];
  RETURN_IF_ERROR(sh.error);
  const size_t n = sh.keys.size();
  const SparseShardLife life = sh.Life();
  EncodeSparseRecord(s.table->dim(), static_cast<uint32_t>(s.table->num_slots()), n, sh.keys.data(),
                     sh.updates.data(), sh.rows.data(), sh.has_life ? &life : nullptr, value);
  *linked += sh.linked_cold_rows;
  *rows += n;
  return absl::OkStatus();
}

struct SstTotals {
  uint32_t combined = 0;  // the records' checksums, combined
  uint64_t bytes = 0, rows = 0;
  uint64_t linked = 0;  // rows left in the cut's linked cold tier
};

// Writes the records to the table file `sst`, each with its checksum.
absl::Status WriteSst(const std::string& sst, rocksdb::Env* env, const JobState& state,
                      const std::vector<CutRecord>& refs, SstTotals* totals) {
  rocksdb::Options sst_options;
  sst_options.compression = rocksdb::kNoCompression;
  if (env != nullptr) sst_options.env = env;
  rocksdb::EnvOptions env_options;
  // Start the writeback as the file grows, so the final sync has little left.
  env_options.bytes_per_sync = 8 << 20;
  rocksdb::SstFileWriter writer(env_options, sst_options);
  RETURN_IF_ERROR(FromRocks(writer.Open(sst), "creating " + sst));
  std::string value;
  for (const CutRecord& r : refs) {
    RETURN_IF_ERROR(EncodeRecord(state, r, &value, &totals->rows, &totals->linked));
    const uint32_t crc = Crc(kCurrentFormat, value.data(), value.size());
    Append(&value, crc);
    totals->combined = Crc(kCurrentFormat, &crc, sizeof(crc), totals->combined);
    totals->bytes += value.size();
    RETURN_IF_ERROR(FromRocks(writer.Put(r.key, value), "writing " + r.key));
  }
  return FromRocks(writer.Finish(), "finishing " + sst);
}

}  // namespace

absl::StatusOr<v1::ShardCutMeta> CheckpointStore::Write(const v1::PsJobSpec& spec, const JobState& state,
                                                        uint64_t cut_id, uint32_t server_index,
                                                        uint64_t shard_map_version) {
  // A cut of the cold tier taken with the state is this cut's once the
  // meta commits; until then any failure removes it.
  bool committed = false;
  absl::Cleanup remove_cold_cut = [&state, &committed] {
    if (committed || state.cold_cut_dir.empty()) return;
    std::error_code ec;
    fs::remove_all(state.cold_cut_dir, ec);
  };
  const std::string& job = spec.job_id();
  if (job.empty() || job.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("job id '", job, "' cannot name a checkpoint (empty or has '/')"));
  }
  RETURN_IF_ERROR(RecoverIfStuck());
  const std::string prefix = CutPrefix(job, cut_id);
  const std::string meta_key = prefix + "meta";
  if (absl::StatusOr<v1::ShardCutMeta> existing = Meta(job, cut_id); existing.ok()) {
    return absl::AlreadyExistsError(absl::StrCat("job '", job, "' already has cut ", cut_id));
  } else if (existing.status().code() != absl::StatusCode::kNotFound) {
    return existing.status();
  }
  ASSIGN_OR_RETURN(const std::vector<CutRecord> refs, CutRecords(prefix, state));
  // The records go to an ingest file first; ingesting moves it into the
  // database. A write that fails on the way leaves no file behind.
  const std::string sst = (fs::path(dir_) / "ingest" / absl::StrCat(job, "-", cut_id, ".sst")).string();
  absl::Cleanup remove_sst = [&sst] {
    std::error_code ec;
    fs::remove(sst, ec);
  };
  SstTotals totals;
  if (!refs.empty()) RETURN_IF_ERROR(WriteSst(sst, env_, state, refs, &totals));
  v1::ShardCutMeta meta;
  *meta.mutable_spec() = spec;
  meta.set_cut_id(cut_id);
  meta.set_format(kCurrentFormat);
  meta.set_step(state.step);
  for (uint64_t c : state.rank_clock) meta.add_rank_clock(c);
  meta.set_shard_map_version(shard_map_version);
  meta.set_server_index(server_index);
  size_t dense_chunks = 0;
  for (const auto& d : state.dense) dense_chunks += d.chunks.size();
  meta.set_dense_chunks(dense_chunks);
  meta.set_sparse_rows(totals.rows + totals.linked);
  if (!state.cold_cut_dir.empty()) {
    meta.set_cold_cut(fs::path(state.cold_cut_dir).filename().string());
    meta.set_cold_rows(totals.linked);
    for (const JobState::Sparse& t : state.sparse) {
      if (!t.marks.empty()) (*meta.mutable_cold_spaces())[t.table->name()] = t.table->tier_space();
    }
  }
  meta.set_bytes(totals.bytes);
  meta.set_records(refs.size());
  meta.set_crc32(totals.combined);
  meta.set_created_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count());
  absl::StatusOr<v1::ShardCutMeta> done = Commit(spec, cut_id, meta_key, refs.empty() ? std::string() : sst, meta);
  committed = done.ok();
  return done;
}

absl::StatusOr<v1::ShardCutMeta> CheckpointStore::Commit(const v1::PsJobSpec& spec, uint64_t cut_id,
                                                         const std::string& meta_key, const std::string& sst,
                                                         const v1::ShardCutMeta& meta) {
  // Ingest and commit under one shared lock: a reopen (exclusive) never
  // sees this cut's records without its meta while the write still runs.
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  if (!sst.empty()) {
    rocksdb::IngestExternalFileOptions ingest;
    ingest.move_files = true;
    RETURN_IF_ERROR(Wrote(db_->IngestExternalFile({sst}, ingest), "ingesting " + sst));
  }
  // Fault injection for crash tests: hold the records uncommitted this
  // long, so a test can kill the server mid-checkpoint.
  if (commit_delay_ > absl::ZeroDuration()) {
    // Says when, so the test kills the server inside the window.
    FLOG(INFO) << "job '" << spec.job_id() << "': holding cut " << cut_id << " uncommitted for "
               << absl::FormatDuration(commit_delay_) << " (--fault_checkpoint_commit_delay)";
    absl::SleepFor(commit_delay_);
  }
  rocksdb::WriteOptions sync;
  sync.sync = true;
  RETURN_IF_ERROR(Wrote(db_->Put(sync, meta_key, meta.SerializeAsString()), "committing " + meta_key));
  return meta;
}

absl::StatusOr<std::vector<v1::ShardCutMeta>> CheckpointStore::List(const std::string& job_id) const {
  std::vector<v1::ShardCutMeta> out;
  const std::string prefix = absl::StrCat("cut/", job_id, "/");
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  // Hop from cut to cut: seek each cut's meta record, then past the cut, so
  // listing never reads the (megabytes of) tensor records in between.
  it->Seek(prefix);
  while (it->Valid() && it->key().starts_with(prefix)) {
    std::string_view cut_view, rest;
    if (!SplitCutKey(it->key().ToStringView(), &cut_view, &rest)) {
      it->Next();
      continue;
    }
    const std::string cut(cut_view);
    const std::string meta_key = cut + "meta";
    if (rest != "meta") it->Seek(meta_key);
    if (it->Valid() && it->key().ToStringView() == meta_key) {
      ASSIGN_OR_RETURN(v1::ShardCutMeta meta, ParseMeta(meta_key, it->value().ToStringView()));
      out.push_back(std::move(meta));
    }
    it->Seek(PrefixEnd(cut));
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "listing checkpoints of job " + job_id));
  return out;
}

absl::StatusOr<v1::ShardCutMeta> CheckpointStore::Meta(const std::string& job_id, uint64_t cut_id) const {
  const std::string key = CutPrefix(job_id, cut_id) + "meta";
  std::string raw;
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &raw);
  if (s.IsNotFound()) {
    return absl::NotFoundError(absl::StrCat("job '", job_id, "' has no committed cut ", cut_id, " in ", dir_));
  }
  RETURN_IF_ERROR(FromRocks(s, "reading " + key));
  return ParseMeta(key, raw);
}

namespace {

// Key-range bounds splitting a cut's records into up to `threads` scans of
// about equal dense chunks: keys sort by table, then chunk, and the sparse
// records (after every dense one) go to the last range.
std::vector<std::string> ScanBounds(const v1::ShardCutMeta& meta, const std::string& prefix, int threads) {
  std::vector<std::string> bounds = {prefix};
  if (threads > 1) {
    std::map<std::string, uint64_t> chunks;
    uint64_t total = 0;
    for (const v1::TableSpec& t : meta.spec().tables()) {
      if (t.kind() != v1::TableSpec::DENSE) continue;
      uint64_t n = 1;
      for (int64_t d : t.shape()) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
      const uint64_t per = t.chunk_elements() == 0 ? 65536 : t.chunk_elements();
      chunks[t.name()] = (n + per - 1) / per;
      total += chunks[t.name()];
    }
    uint64_t seen = 0;
    int next = 1;
    for (const auto& [name, count] : chunks) {  // name order, as the keys
      for (uint64_t c = 0; c < count && next < threads; ++c, ++seen) {
        if (seen == total * static_cast<uint64_t>(next) / static_cast<uint64_t>(threads)) {
          bounds.push_back(DenseKey(prefix, name, static_cast<uint32_t>(c)));
          ++next;
        }
      }
    }
  }
  bounds.push_back(PrefixEnd(prefix));
  return bounds;
}

}  // namespace

absl::StatusOr<v1::ShardCutMeta> CheckpointStore::Read(const std::string& job_id, uint64_t cut_id,
                                                       const Visitor& visit, int threads) const {
  const std::string prefix = CutPrefix(job_id, cut_id);
  ASSIGN_OR_RETURN(v1::ShardCutMeta meta, Meta(job_id, cut_id));
  RETURN_IF_ERROR(CheckFormat(meta, prefix + " in " + dir_));

  ASSIGN_OR_RETURN(LinkedCut linked, Linked(meta));
  const CheckpointVisitor whole = LinkedCutVisitor(std::move(linked), visit);
  const std::vector<std::string> bounds = ScanBounds(meta, prefix, threads);
  const size_t ranges = bounds.size() - 1;
  absl::ReaderMutexLock lock(&db_mu_);  // for the scans, on this thread's behalf
  RETURN_IF_ERROR(CheckOpenLocked());
  rocksdb::DB* const db = db_.get();  // the scan threads use it under this lock

  struct Range {
    absl::Status status;
    std::vector<uint32_t> crcs;  // the records' own checksums, in key order
  };
  std::vector<Range> out(ranges);
  auto scan_range = [&](size_t r) {
    RecordDecoder decoder(meta.format());
    // One sequential pass over big values: read ahead, and keep them out of
    // the block cache.
    rocksdb::ReadOptions scan;
    scan.readahead_size = 4 << 20;
    scan.fill_cache = false;
    const rocksdb::Slice upper(bounds[r + 1]);
    scan.iterate_upper_bound = &upper;
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(scan));
    for (it->Seek(bounds[r]); it->Valid(); it->Next()) {
      const std::string_view rest = it->key().ToStringView().substr(prefix.size());
      if (rest == "meta") continue;
      uint32_t crc = 0;
      out[r].status = decoder.Decode(prefix, rest, it->value().ToStringView(), whole, &crc, " in " + dir_);
      if (!out[r].status.ok()) return;
      out[r].crcs.push_back(crc);
    }
    out[r].status = FromRocks(it->status(), "reading " + prefix);
  };
  if (ranges == 1) {
    scan_range(0);
  } else {
    std::vector<std::thread> pool;
    for (size_t r = 0; r < ranges; ++r) pool.emplace_back(scan_range, r);
    for (std::thread& t : pool) t.join();
  }
  uint32_t combined = 0;
  uint64_t records = 0;
  for (const Range& r : out) {
    RETURN_IF_ERROR(r.status);
    for (uint32_t crc : r.crcs) combined = Crc(meta.format(), &crc, sizeof(crc), combined);
    records += r.crcs.size();
  }
  if (records != meta.records() || combined != meta.crc32()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", prefix, " in ", dir_, ": ", records, " records (meta says ",
                                            meta.records(), "), combined checksum ",
                                            combined == meta.crc32() ? "matches" : "differs"));
  }
  return meta;
}

absl::StatusOr<v1::ReadCheckpointResponse> CheckpointStore::ReadPage(
    const v1::ReadCheckpointRequest& req, const std::function<bool(std::string_view table, uint32_t index, bool dense)>& keep) const {
  const std::string prefix = CutPrefix(req.job_id(), req.cut_id());
  v1::ReadCheckpointResponse resp;
  ASSIGN_OR_RETURN(*resp.mutable_meta(), Meta(req.job_id(), req.cut_id()));
  RETURN_IF_ERROR(CheckFormat(resp.meta(), prefix + " in " + dir_));
  ASSIGN_OR_RETURN(const LinkedCut linked, Linked(resp.meta()));
  const size_t max_bytes = req.max_bytes() == 0 ? size_t{4} << 20 : req.max_bytes();
  std::string whole;
  rocksdb::ReadOptions scan;
  scan.readahead_size = 4 << 20;
  scan.fill_cache = false;
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(scan));
  size_t bytes = 0;
  std::string last;
  it->Seek(prefix + req.start_after());
  for (; it->Valid() && it->key().starts_with(prefix); it->Next()) {
    const std::string_view rest = it->key().ToStringView().substr(prefix.size());
    if (rest == "meta" || rest == req.start_after()) continue;
    if (bytes >= max_bytes) break;
    RecordKey k;
    RETURN_IF_ERROR(ParseRecordKey(rest, &k, " in " + prefix));
    last = std::string(rest);
    if (keep && !keep(k.table, k.index, k.dense)) continue;
    // Sent as stored (the reader's RecordDecoder verifies each checksum),
    // or with the rows it left in the linked cold tier read back in.
    const std::string_view v = it->value().ToStringView();
    RETURN_IF_ERROR(ExpandLinkedRecord(linked, resp.meta().format(), prefix, rest, v, &whole));
    v1::CheckpointRecord* r = resp.add_records();
    r->set_key(std::string(rest));
    r->set_value(whole.empty() ? std::string(v) : whole);
    bytes += r->value().size();
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "reading " + prefix));
  if (it->Valid() && it->key().starts_with(prefix) && bytes >= max_bytes) resp.set_next_start_after(last);
  return resp;
}

absl::Status CheckpointStore::Delete(const std::string& job_id, uint64_t cut_id) {
  RETURN_IF_ERROR(RecoverIfStuck());
  const std::string prefix = CutPrefix(job_id, cut_id);
  rocksdb::WriteOptions sync;
  sync.sync = true;
  absl::ReaderMutexLock lock(&db_mu_);
  RETURN_IF_ERROR(CheckOpenLocked());
  RETURN_IF_ERROR(Wrote(db_->Delete(sync, prefix + "meta"), "uncommitting " + prefix));
  RETURN_IF_ERROR(Wrote(db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(), prefix,
                                         PrefixEnd(prefix)),
                        "deleting " + prefix));
  // Its cut of the cold tier (if any) goes with it: the links' files are
  // freed once no other cut and not the tier itself hold them.
  const std::string cold = ColdCutDir(job_id, cut_id);
  {
    absl::MutexLock linked_lock(&linked_mu_);
    linked_.erase(fs::path(cold).filename().string());
  }
  std::error_code ec;
  fs::remove_all(cold, ec);
  if (ec) return absl::InternalError(absl::StrCat("removing ", cold, ": ", ec.message()));
  return ReclaimLocked(prefix);
}

absl::Status CheckpointStore::ReclaimLocked(const std::string& prefix) {
  // A range tombstone hides the records but frees nothing: each cut was
  // ingested as its own file at the bottom level, where no compaction ever
  // looks unless told to. The cut's file holds only its keys, so it goes
  // whole; a file that also holds other keys (a compaction merged it with
  // its neighbours) is compacted over the range, which drops the records.
  const std::string end = PrefixEnd(prefix);
  const rocksdb::Slice begin_slice(prefix), end_slice(end);
  RETURN_IF_ERROR(Wrote(rocksdb::DeleteFilesInRange(db_.get(), db_->DefaultColumnFamily(), &begin_slice, &end_slice,
                                                    /*include_end=*/false),
                        "freeing the files of " + prefix));
  std::vector<rocksdb::LiveFileMetaData> files;
  db_->GetLiveFilesMetaData(&files);
  bool shared = false;
  for (const rocksdb::LiveFileMetaData& f : files) {
    // [smallest, largest] meets [prefix, end).
    shared = shared || (f.smallestkey < end && f.largestkey >= prefix);
  }
  if (!shared) return absl::OkStatus();
  rocksdb::CompactRangeOptions compact;
  compact.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForceOptimized;
  return Wrote(db_->CompactRange(compact, &begin_slice, &end_slice), "compacting away " + prefix);
}

absl::StatusOr<CheckpointStore::DiskUse> CheckpointStore::Disk() const {
  DiskUse use;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir_, ec)) {
    if (!e.is_regular_file(ec)) continue;
    ++use.files;
    const uint64_t size = e.file_size(ec);
    use.bytes += size;
    if (e.path().extension() != ".sst") use.own_bytes += size;
  }
  if (ec) return absl::InternalError(absl::StrCat("listing ", dir_, ": ", ec.message()));
  absl::ReaderMutexLock lock(&db_mu_);
  if (db_ != nullptr) {
    std::vector<rocksdb::LiveFileMetaData> files;
    db_->GetLiveFilesMetaData(&files);
    use.table_files = files.size();
  }
  return use;
}

std::vector<std::pair<std::string, uint64_t>> CheckpointStore::Properties() const {
  std::vector<std::pair<std::string, uint64_t>> out;
  absl::ReaderMutexLock lock(&db_mu_);
  if (db_ == nullptr) return out;
  for (const char* name : {"live-sst-files-size", "size-all-mem-tables", "estimate-num-keys",
                           "estimate-pending-compaction-bytes", "num-running-compactions", "num-running-flushes"}) {
    uint64_t v = 0;
    if (db_->GetIntProperty(std::string("rocksdb.") + name, &v)) out.emplace_back(name, v);
  }
  return out;
}

}  // namespace fulcrum
