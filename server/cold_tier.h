// ColdTier: a server's disk tier for sparse rows, one RocksDB database in
// its data directory (docs/embeddings.md, "Rows on disk").
//
// A row on disk is what it is in memory: its floats (weights, then each
// optimizer slot), its update count, and its lifecycle fields (the step of
// its last push, its decayed push count), so a row that goes to disk and
// comes back is bit for bit the row that left. Rows are grouped by space
// (one per job's table) and virtual shard, keyed so that one shard's rows
// are contiguous: a shard is read in key order (Scan) and a table dropped
// with one range deletion.
//
// The tier's contents mean something only beside the memory they were
// demoted from, which a restart loses: Open starts the database empty, and
// a restored job refills it from its cut. A cut of the tier is a RocksDB
// checkpoint (hard links to its table files, no copy), opened read-only by
// OpenCut.
//
// Writes go through RocksDB's write-ahead log, unsynced: a failed flush
// (a full or failing disk) loses nothing that a reopen does not replay. A
// failed write is returned naming the directory (RESOURCE_EXHAUSTED for a
// full disk) and the next call reopens the database, as CheckpointStore's.
// Thread-safe.
#ifndef FULCRUM_SERVER_COLD_TIER_H_
#define FULCRUM_SERVER_COLD_TIER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace rocksdb {
class DB;
class Env;
class Status;
}  // namespace rocksdb

namespace fulcrum {

// Rows of one table as they move between tiers: per row its key, update
// count, last push step and decayed count, and `row_floats` floats.
struct ColdRows {
  uint32_t row_floats = 0;
  std::vector<uint64_t> keys;
  std::vector<uint32_t> updates;
  std::vector<uint64_t> last_step;
  std::vector<float> freq;
  std::vector<float> values;

  size_t size() const { return keys.size(); }
  const float* row(size_t i) const { return values.data() + i * row_floats; }
  void Add(uint64_t key, uint32_t update_count, uint64_t step, float count, const float* v);
  void Clear();
};

// A shard's rows of both tiers in one key order, each with its update
// count, lifecycle fields and slot (kColdSlot for a row from disk).
struct MergedRows {
  std::vector<uint64_t> keys;
  std::vector<uint32_t> updates;
  std::vector<float> rows;
  std::vector<uint32_t> slot;
  std::vector<uint64_t> last_step;
  std::vector<float> freq;
};
// Merges `n` rows in memory (keys ascending, `row_floats` floats each)
// with `cold` (ascending; a key also in memory is an older copy of its row
// and is left out) into *out; returns the rows taken from `cold`.
size_t MergeTiers(uint32_t row_floats, size_t n, const uint64_t* keys, const uint32_t* updates, const float* rows,
                  const uint32_t* slot, const uint64_t* last_step, const float* freq, const ColdRows& cold,
                  MergedRows* out);

class ColdTier {
 public:
  // Opens an empty tier in `dir` (created; what a previous process left
  // there is deleted). `env`: what RocksDB works through (nullptr: the
  // default; tests give one that fails on demand).
  static absl::StatusOr<std::unique_ptr<ColdTier>> Open(const std::string& dir, rocksdb::Env* env = nullptr);
  // Opens a cut of a tier (a directory Checkpoint wrote), read-only.
  static absl::StatusOr<std::unique_ptr<ColdTier>> OpenCut(const std::string& dir);
  ~ColdTier();

  const std::string& dir() const { return dir_; }
  bool read_only() const { return read_only_; }

  // The space of a job's table: created on first use in a writable tier;
  // NOT_FOUND in a cut that holds none.
  absl::StatusOr<uint32_t> Space(const std::string& job_id, const std::string& table);

  // Writes `rows` (all of virtual shard `vshard`) in one batch, replacing
  // rows of the same keys.
  absl::Status Put(uint32_t space, uint32_t vshard, const ColdRows& rows);
  // Appends to `out` the rows of `keys` the tier holds (out->row_floats
  // floats each; DATA_LOSS naming the key when a stored row has another
  // size); found[i] says whether keys[i] was. One batched read.
  absl::Status Get(uint32_t space, uint32_t vshard, const uint64_t* keys, size_t n, ColdRows* out,
                   std::vector<bool>* found) const;
  // The same for keys of several virtual shards (keys[i] in vshards[i]),
  // in one batched read.
  absl::Status Get(uint32_t space, const uint32_t* vshards, const uint64_t* keys, size_t n, ColdRows* out,
                   std::vector<bool>* found) const;
  // Deletes the rows of `keys` (absent ones are no error), in one batch.
  absl::Status Delete(uint32_t space, uint32_t vshard, const uint64_t* keys, size_t n);
  // Delete, then Put, in one batch: a push's promotions and demotions.
  absl::Status Move(uint32_t space, uint32_t vshard, const uint64_t* gone, size_t n_gone, const ColdRows& rows);
  // Get, then Delete of what was found: rows promoted back to memory.
  absl::Status Take(uint32_t space, uint32_t vshard, const uint64_t* keys, size_t n, ColdRows* out,
                    std::vector<bool>* found);
  // Every row of one virtual shard in key order, handed to `visit` in
  // batches of up to `batch` rows (`row_floats` floats each).
  absl::Status Scan(uint32_t space, uint32_t vshard, uint32_t row_floats, size_t batch,
                    const std::function<absl::Status(const ColdRows&)>& visit) const;
  // Deletes every row of a space (a job that ended, a table restored anew).
  absl::Status Drop(uint32_t space);

  // Writes a cut of the whole tier into `dir` (which must not exist): the
  // memtable is flushed, then the table files are hard-linked.
  absl::Status Checkpoint(const std::string& dir);

  struct Counts {
    uint64_t rows_written = 0, rows_read = 0, rows_deleted = 0;
    uint64_t reads = 0, writes = 0;  // batched calls
    uint64_t reopens = 0;            // after a failed write
  };
  Counts counts() const;
  // Bytes of the tier's live table files and memtables (RocksDB's estimate).
  uint64_t DiskBytes() const;
  // Memory RocksDB holds for the tier: memtables, table readers (indexes
  // and Bloom filters) and block cache, as it counts them.
  uint64_t MemoryBytes() const;

 private:
  ColdTier(std::string dir, rocksdb::Env* env, bool read_only);
  absl::Status OpenDbLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(db_mu_);
  absl::Status CheckOpenLocked() const ABSL_SHARED_LOCKS_REQUIRED(db_mu_);
  // `s` as an absl::Status naming the directory; a failed write marks the
  // tier stuck, and the next call reopens it.
  absl::Status Wrote(const rocksdb::Status& s, const std::string& what);
  absl::Status RecoverIfStuck() ABSL_LOCKS_EXCLUDED(db_mu_);
  absl::Status LoadSpacesLocked() ABSL_SHARED_LOCKS_REQUIRED(db_mu_);

  const std::string dir_;
  rocksdb::Env* const env_;
  const bool read_only_;
  mutable absl::Mutex db_mu_;  // shared by every use, exclusive to reopen
  std::unique_ptr<rocksdb::DB> db_ ABSL_GUARDED_BY(db_mu_);
  std::atomic<bool> stuck_{false};
  absl::Mutex spaces_mu_;
  absl::flat_hash_map<std::string, uint32_t> spaces_ ABSL_GUARDED_BY(spaces_mu_);
  mutable std::atomic<uint64_t> rows_written_{0}, rows_read_{0}, rows_deleted_{0}, reads_{0}, writes_{0},
      reopens_{0};
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COLD_TIER_H_
