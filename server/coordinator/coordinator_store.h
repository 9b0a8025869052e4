// CoordinatorStore: the coordinator's durable state, a RocksDB directory of
// whole records (the meta record, job/<id>, node/<id>), and what it does
// when the disk under it fails.
//
// A record is written whole; a write that fails leaves its key unsaved, and
// Repair (called by the scheduler) reopens RocksDB and writes every unsaved
// key again, at most once per `retry`, until that works. Callers that answer
// a client check Saved and refuse, with Unavailable, a change that could not
// be saved, so that nothing acknowledged is lost when the coordinator stops
// (docs/operations.md, "When the coordinator's disk fails").
//
// The store knows keys and bytes, not jobs or nodes. Its lock is its own:
// the coordinator calls it with its own lock held, never the other way.
#ifndef FULCRUM_SERVER_COORDINATOR_COORDINATOR_STORE_H_
#define FULCRUM_SERVER_COORDINATOR_COORDINATOR_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace rocksdb {
class DB;
class Env;
}  // namespace rocksdb

namespace fulcrum {

class CoordinatorStore {
 public:
  struct Options {
    std::string dir;                // created when missing
    rocksdb::Env* env = nullptr;    // nullptr: the default
    absl::Duration retry = absl::Seconds(1);
    const Clock* clock = nullptr;   // nullptr: the real one
  };
  static absl::StatusOr<std::unique_ptr<CoordinatorStore>> Open(Options options);
  ~CoordinatorStore();
  const std::string& dir() const { return options_.dir; }

  // The record under `key`; nullopt when there is none.
  absl::StatusOr<std::optional<std::string>> Get(const std::string& key) const;
  // Hands every record to `visit` in key order; stops at its first error
  // and returns it. A damaged block ends the scan with DATA_LOSS-like
  // errors rather than silently skipping what lies after it.
  absl::Status Scan(const std::function<absl::Status(const std::string& key, const std::string& value)>& visit) const;

  // Writes `value` under `key` (nullopt: deletes the key); `sync` for state
  // changes, not for progress. A failure marks the key unsaved and is
  // logged (the first of an outage at once, then once a minute).
  void Write(const std::string& key, const std::optional<std::string>& value, bool sync);
  // Whether `key`'s record in RocksDB is what was last written.
  bool Saved(const std::string& key) const;
  bool AllSaved() const;

  // After failed writes, at most once per `retry`: reopens RocksDB and
  // writes each unsaved key again with what `value_of` says it should hold
  // now; logs the end of an outage. `value_of` runs without the store's lock.
  void Repair(const std::function<std::optional<std::string>(const std::string& key)>& value_of);

  // "the coordinator cannot save its state in DIR (ERROR)".
  std::string Trouble() const;
  // UNAVAILABLE: the store cannot save; `what` says what was not done.
  absl::Status Unavailable(const std::string& what) const;

  uint64_t write_failures() const;  // since the store opened
  size_t unsaved() const;           // records that differ from memory now

 private:
  explicit CoordinatorStore(Options options);
  absl::Status ReopenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteLocked(const std::string& key, const std::optional<std::string>& value, bool sync)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string TroubleLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const Options options_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  std::unique_ptr<rocksdb::DB> db_ ABSL_GUARDED_BY(mu_);  // null after a failed reopen
  // Keys whose record in RocksDB may differ from memory (a failed write).
  std::set<std::string> unsaved_ ABSL_GUARDED_BY(mu_);
  struct Outage {
    absl::Time since = absl::InfinitePast();  // first failure of this outage
    absl::Time last_logged = absl::InfinitePast();
    absl::Time next_try = absl::InfinitePast();
    uint64_t failures = 0;  // in this outage
    bool reopened = false;  // RocksDB was reopened in this outage
    std::string error;      // the latest
  };
  Outage outage_ ABSL_GUARDED_BY(mu_);
  uint64_t write_failures_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_COORDINATOR_STORE_H_
