// A RocksDB environment whose writes fail on demand, as on a full or failing
// disk: tests give it to the component under test (CoordinatorOptions::env)
// and check what it does when its state cannot be saved.
#ifndef FULCRUM_TESTS_TESTING_FAULT_FS_H_
#define FULCRUM_TESTS_TESTING_FAULT_FS_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"

namespace rocksdb {
class Env;
class FileSystem;
}  // namespace rocksdb

namespace fulcrum::testing {

class FaultFs {
 public:
  enum class Fault {
    kNone,
    kNoSpace,  // ENOSPC: RocksDB recovers by itself once there is room
    kIoError,  // EIO: RocksDB stops writing until it is reopened
  };
  FaultFs();
  ~FaultFs();

  // The environment to open RocksDB with; lives as long as this object.
  rocksdb::Env* env() const { return env_.get(); }
  // From now on, every write, flush, sync and file creation fails with
  // `fault` (kNone: they work again); with `only`, just those on files whose
  // path contains it (".log": RocksDB's write-ahead log).
  void Set(Fault fault, const std::string& only = "") {
    absl::MutexLock lock(&mu_);
    only_ = only;
    fault_ = fault;
  }
  // Writes that failed so far.
  int failed() const { return failed_; }

 private:
  class File;
  class Fs;
  // The fault for the file at `path` now (kNone: none).
  Fault FaultFor(const std::string& path);

  absl::Mutex mu_;
  std::string only_ ABSL_GUARDED_BY(mu_);
  std::atomic<Fault> fault_{Fault::kNone};
  std::atomic<int> failed_{0};
  std::shared_ptr<rocksdb::FileSystem> fs_;
  std::unique_ptr<rocksdb::Env> env_;
};

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_FAULT_FS_H_
