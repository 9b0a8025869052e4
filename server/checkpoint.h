// CheckpointStore: a server's checkpoints of its shards, in one RocksDB
// database under its data directory (docs/checkpoint-format.md).
//
// A cut is written as one SST file (SstFileWriter, then IngestExternalFile:
// about 3x the throughput of WriteBatch + WAL on this machine's disk) holding
// a record per dense chunk and per sparse virtual shard, each with its own
// crc32; then the cut's ShardCutMeta is put with a synced write. The meta is
// the commit: a cut whose records landed but whose meta did not (a crash
// mid-write) is invisible to List and Read and is deleted by Open.
// A failed write (a full or failing disk) stops RocksDB's writes; the next
// Write or Delete reopens it, so one bad moment of the disk does not end a
// server's checkpoints until it restarts.
// A cut of a job with tables that spill links the server's cold tier
// instead of copying its rows: a RocksDB checkpoint of the tier (hard
// links, ColdCutDir) taken as the state is, which the cut's sparse records
// refer to (format 5). It is committed and deleted with the cut, and read
// back merged into the records, here and for every peer reading pages.
// Thread-safe; writes of different cuts may run concurrently.
#ifndef FULCRUM_SERVER_CHECKPOINT_H_
#define FULCRUM_SERVER_CHECKPOINT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint_record.h"
#include "fulcrum/v1/ps.pb.h"
#include "server/cold_cut.h"
#include "server/cold_tier.h"
#include "server/job.h"

namespace rocksdb {
class DB;
class Env;
class Status;
}

namespace fulcrum {

class CheckpointStore {
 public:
  // Opens (creating) the database in `dir` and deletes the records of
  // uncommitted cuts. `env`: what RocksDB works through (nullptr: the
  // default; tests give one that fails on demand). `commit_delay`: fault
  // injection for crash tests, how long each cut's records wait
  // uncommitted (logged when the wait starts).
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& dir, rocksdb::Env* env = nullptr,
                                                               absl::Duration commit_delay = absl::ZeroDuration());
  ~CheckpointStore();

  const std::string& dir() const { return dir_; }
  // Where a cut of the cold tier for `cut_id` of `job_id` goes (Job::
  // Capture's cold_cut_dir): DIR-cold/<job>-<cut, 16 hex>, beside the store.
  std::string ColdCutDir(const std::string& job_id, uint64_t cut_id) const;

  // Writes `state` of job `spec` as cut `cut_id`, durably; returns its meta.
  // ALREADY_EXISTS when the cut is already committed. A state linked to a
  // cut of the cold tier (JobState::cold_cut_dir) commits it with the cut,
  // or removes it when the write fails.
  absl::StatusOr<v1::ShardCutMeta> Write(const v1::PsJobSpec& spec, const JobState& state, uint64_t cut_id,
                                         uint32_t server_index, uint64_t shard_map_version);

  // The committed cuts of a job, oldest first.
  absl::StatusOr<std::vector<v1::ShardCutMeta>> List(const std::string& job_id) const;
  // One committed cut's meta; NOT_FOUND when the cut is not committed.
  absl::StatusOr<v1::ShardCutMeta> Meta(const std::string& job_id, uint64_t cut_id) const;

  using Visitor = CheckpointVisitor;
  // Reads a committed cut, verifying every record's checksum and the meta's
  // counts and combined checksum (DATA_LOSS naming the record otherwise),
  // and hands each record to `visit`. NOT_FOUND when the cut is not committed.
  // With `threads` > 1 the records are read in that many key ranges at
  // once, and `visit` must be thread-safe.
  absl::StatusOr<v1::ShardCutMeta> Read(const std::string& job_id, uint64_t cut_id, const Visitor& visit,
                                        int threads = 1) const;

  // One page of a committed cut's raw records (ReadCheckpoint), in key
  // order, as stored (readers verify them with RecordDecoder); `keep`
  // (when given) filters by record.
  // NOT_FOUND when the cut is not committed.
  absl::StatusOr<v1::ReadCheckpointResponse> ReadPage(
      const v1::ReadCheckpointRequest& req,
      const std::function<bool(std::string_view table, uint32_t index, bool dense)>& keep) const;

  // Deletes a cut (its meta first, so a crash leaves it uncommitted) and
  // gives its disk space back before returning: the cut's table file is
  // removed (or, shared with other cuts after a compaction, compacted).
  absl::Status Delete(const std::string& job_id, uint64_t cut_id);

  // What the store's directory holds now: every file (tables, logs,
  // manifests), their bytes, and the table files RocksDB tracks.
  struct DiskUse {
    uint64_t files = 0, bytes = 0, table_files = 0;
    // RocksDB's own files (everything but the .sst tables: LOG, MANIFEST,
    // the write-ahead log, OPTIONS): at most kRocksDbOwnFilesBound.
    uint64_t own_bytes = 0;
  };
  absl::StatusOr<DiskUse> Disk() const;

  // Table files RocksDB keeps open at most (options.max_open_files).
  static constexpr int kMaxOpenFiles = 64;

  // RocksDB's integer properties for metrics: (name without "rocksdb.",
  // value) for live SST bytes, memtable bytes, estimated keys, pending
  // compaction bytes and running compactions and flushes.
  std::vector<std::pair<std::string, uint64_t>> Properties() const;
  // Times RocksDB was reopened after a failed write (since Open).
  uint64_t reopens() const { return reopens_.load(); }

 private:
  CheckpointStore(std::string dir, rocksdb::Env* env, absl::Duration commit_delay);
  // Write's last step: the table file `sst` (none when empty) ingested,
  // then the cut's meta written, which commits it.
  absl::StatusOr<v1::ShardCutMeta> Commit(const v1::PsJobSpec& spec, uint64_t cut_id, const std::string& meta_key,
                                          const std::string& sst, const v1::ShardCutMeta& meta);
  absl::Status OpenDbLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(db_mu_);
  // Deletes the records of uncommitted cuts; `files`: and the ingest files
  // of writes that never finished (only when no write can be running).
  absl::Status CollectGarbageLocked(bool files) ABSL_SHARED_LOCKS_REQUIRED(db_mu_);
  // Frees the disk of the deleted records under `prefix`.
  absl::Status ReclaimLocked(const std::string& prefix) ABSL_SHARED_LOCKS_REQUIRED(db_mu_);
  // The cut of the cold tier a meta links, opened (its tier null when it
  // links none); kept open for the next pages of the same cut.
  absl::StatusOr<LinkedCut> Linked(const v1::ShardCutMeta& meta) const;
  // Where the cuts of the cold tier lie: DIR-cold beside the store's DIR.
  static std::string ColdCutsRootOf(const std::string& dir) { return dir + "-cold"; }
  std::string ColdCutsRoot() const { return ColdCutsRootOf(dir_); }
  // Removes the cold tier cuts of no committed cut (`committed`: their
  // key prefixes).
  void CollectColdCuts(const std::set<std::string>& committed);
  // After a failed write: reopens RocksDB.
  absl::Status RecoverIfStuck() ABSL_LOCKS_EXCLUDED(db_mu_);
  // UNAVAILABLE while the database is closed (a reopen failed).
  absl::Status CheckOpenLocked() const ABSL_SHARED_LOCKS_REQUIRED(db_mu_);
  // `s` as an absl::Status; a failed write marks the store stuck.
  absl::Status Wrote(const rocksdb::Status& s, const std::string& what);

  const std::string dir_;
  rocksdb::Env* const env_;
  const absl::Duration commit_delay_;
  // Shared by every use of the database, exclusive to reopen it.
  mutable absl::Mutex db_mu_;
  std::unique_ptr<rocksdb::DB> db_ ABSL_GUARDED_BY(db_mu_);
  std::atomic<bool> stuck_{false};
  std::atomic<uint64_t> reopens_{0};
  // Opened cuts of the cold tier, by directory name (a few at most).
  mutable absl::Mutex linked_mu_;
  mutable std::map<std::string, std::shared_ptr<ColdTier>> linked_ ABSL_GUARDED_BY(linked_mu_);
};


// Key layout, exposed for tests and tools: "cut/<job>/<cut, 16 hex>/".
std::string CutPrefix(const std::string& job_id, uint64_t cut_id);

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_CHECKPOINT_H_
