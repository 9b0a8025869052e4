#include "server/coordinator/coordinator_store.h"

#include <filesystem>
#include <utility>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/rocksdb_options.h"
#include "common/rocksdb_status.h"
#include "common/status_macros.h"

namespace fulcrum {

absl::StatusOr<std::unique_ptr<CoordinatorStore>> CoordinatorStore::Open(Options options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("coordinator needs a data directory");
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create coordinator data directory ", options.dir, ": ", ec.message()));
  }
  std::unique_ptr<CoordinatorStore> store(new CoordinatorStore(std::move(options)));
  absl::MutexLock lock(&store->mu_);
  RETURN_IF_ERROR(store->ReopenLocked());
  return store;
}

CoordinatorStore::CoordinatorStore(Options options)
    : options_(std::move(options)), clock_(options_.clock != nullptr ? options_.clock : Clock::Real()) {}

CoordinatorStore::~CoordinatorStore() = default;

absl::Status CoordinatorStore::ReopenLocked() {
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  if (options_.env != nullptr) db_options.env = options_.env;
  // Every job update and node registration is a write: RocksDB's own files
  // must not grow with them for as long as the coordinator runs.
  BoundRocksDbOwnFiles(&db_options);
  rocksdb::DB* db = nullptr;
  db_.reset();  // RocksDB's lock on the directory goes with it
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(db_options, options_.dir, &db),
                            absl::StrCat("opening coordinator state in ", options_.dir)));
  db_.reset(db);
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> CoordinatorStore::Get(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  if (db_ == nullptr) return absl::UnavailableError(TroubleLocked());
  std::string value;
  const rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &value);
  if (s.IsNotFound()) return std::optional<std::string>();
  RETURN_IF_ERROR(FromRocks(s, absl::StrCat("reading '", key, "' of the coordinator state in ", options_.dir)));
  return std::optional<std::string>(std::move(value));
}

absl::Status CoordinatorStore::Scan(
    const std::function<absl::Status(const std::string& key, const std::string& value)>& visit) const {
  absl::MutexLock lock(&mu_);
  if (db_ == nullptr) return absl::UnavailableError(TroubleLocked());
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    RETURN_IF_ERROR(visit(it->key().ToString(), it->value().ToString()));
  }
  // A damaged block ends the scan early: the caller must not start on what
  // was read before it (it would forget the records after it, then
  // overwrite them).
  return FromRocks(it->status(), absl::StrCat("reading coordinator state in ", options_.dir));
}

void CoordinatorStore::Write(const std::string& key, const std::optional<std::string>& value, bool sync) {
  absl::MutexLock lock(&mu_);
  WriteLocked(key, value, sync);
}

void CoordinatorStore::WriteLocked(const std::string& key, const std::optional<std::string>& value, bool sync) {
  rocksdb::Status s = rocksdb::Status::IOError("the store is closed: reopening it failed");
  if (db_ != nullptr) {
    rocksdb::WriteOptions w;
    w.sync = sync;
    s = value ? db_->Put(w, key, *value) : db_->Delete(w, key);
  }
  if (s.ok()) {
    unsaved_.erase(key);
    return;
  }
  unsaved_.insert(key);
  ++write_failures_;
  ++outage_.failures;
  outage_.error = s.ToString();
  const absl::Time now = clock_->Now();
  if (outage_.since == absl::InfinitePast()) {
    outage_.since = now;
    outage_.last_logged = now;
    outage_.next_try = now + options_.retry;
    FLOG(ERROR) << "cannot save coordinator state in " << options_.dir << " (writing '" << key
                << "'): " << outage_.error << "; until it works, job submissions, cancels, restores and node "
                << "registrations are refused with UNAVAILABLE; trying again every "
                << absl::FormatDuration(options_.retry);
  } else if (now - outage_.last_logged >= absl::Minutes(1)) {
    outage_.last_logged = now;
    FLOG(ERROR) << "still cannot save coordinator state in " << options_.dir << " after "
                << absl::FormatDuration(absl::Trunc(now - outage_.since, absl::Seconds(1))) << " ("
                << outage_.failures << " failed writes, " << unsaved_.size() << " records unsaved): " << outage_.error;
  }
}

bool CoordinatorStore::Saved(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  return unsaved_.count(key) == 0;
}

bool CoordinatorStore::AllSaved() const {
  absl::MutexLock lock(&mu_);
  return unsaved_.empty();
}

void CoordinatorStore::Repair(const std::function<std::optional<std::string>(const std::string& key)>& value_of) {
  const absl::Time now = clock_->Now();
  std::vector<std::string> keys;
  {
    absl::MutexLock lock(&mu_);
    if (!unsaved_.empty()) {
      if (now < outage_.next_try) return;
      outage_.next_try = now + options_.retry;
      // A failed write stops RocksDB's writes (a background error) until it
      // resumes; reopening it, which replays its log, recovers from every
      // kind (the checkpoint store does the same, server/checkpoint.h).
      if (const absl::Status opened = ReopenLocked(); !opened.ok()) {
        ++outage_.failures;
        outage_.error = std::string(opened.message());
        return;
      }
      outage_.reopened = true;
      keys.assign(unsaved_.begin(), unsaved_.end());
    }
  }
  for (const std::string& key : keys) {
    const std::optional<std::string> value = value_of(key);
    absl::MutexLock lock(&mu_);
    WriteLocked(key, value, true);
    if (unsaved_.count(key) > 0) return;
  }
  absl::MutexLock lock(&mu_);
  if (outage_.since == absl::InfinitePast() || !unsaved_.empty()) return;  // no trouble, or new trouble
  FLOG(INFO) << "coordinator state in " << options_.dir << " saved again after "
             << absl::FormatDuration(absl::Trunc(now - outage_.since, absl::Milliseconds(1))) << "; "
             << outage_.failures << " writes had failed, " << keys.size() << (keys.size() == 1 ? " record" : " records")
             << " written again" << (outage_.reopened ? " (RocksDB reopened)" : "");
  outage_ = Outage();
}

std::string CoordinatorStore::TroubleLocked() const {
  return absl::StrCat("the coordinator cannot save its state in ", options_.dir, " (", outage_.error, ")");
}

std::string CoordinatorStore::Trouble() const {
  absl::MutexLock lock(&mu_);
  return TroubleLocked();
}

absl::Status CoordinatorStore::Unavailable(const std::string& what) const {
  return absl::UnavailableError(absl::StrCat(Trouble(), ": ", what, "; try again once it can (it retries every ",
                                             absl::FormatDuration(options_.retry),
                                             " and logs when it works again)"));
}

uint64_t CoordinatorStore::write_failures() const {
  absl::MutexLock lock(&mu_);
  return write_failures_;
}

size_t CoordinatorStore::unsaved() const {
  absl::MutexLock lock(&mu_);
  return unsaved_.size();
}

}  // namespace fulcrum
