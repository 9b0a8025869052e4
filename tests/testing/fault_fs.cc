#include "tests/testing/fault_fs.h"

#include <string>
#include <utility>

#include <rocksdb/env.h>
#include <rocksdb/file_system.h>

namespace fulcrum::testing {

using rocksdb::IOStatus;

namespace {

IOStatus Injected(FaultFs::Fault fault) {
  return fault == FaultFs::Fault::kNoSpace ? IOStatus::NoSpace("injected by the test (FaultFs)")
                                           : IOStatus::IOError("injected by the test (FaultFs)");
}

}  // namespace

// Every writable file RocksDB opens (WAL, tables, MANIFEST), checking the
// fault before each call that reaches the disk.
class FaultFs::File : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  File(FaultFs* owner, std::string path, std::unique_ptr<rocksdb::FSWritableFile> file)
      : FSWritableFileOwnerWrapper(std::move(file)), owner_(owner), path_(std::move(path)) {}

  IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (IOStatus s = Check(); !s.ok()) return s;
    return FSWritableFileOwnerWrapper::Append(data, o, d);
  }
  IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o, const rocksdb::DataVerificationInfo& v,
                  rocksdb::IODebugContext* d) override {
    if (IOStatus s = Check(); !s.ok()) return s;
    return FSWritableFileOwnerWrapper::Append(data, o, v, d);
  }
  IOStatus Flush(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (IOStatus s = Check(); !s.ok()) return s;
    return FSWritableFileOwnerWrapper::Flush(o, d);
  }
  IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (IOStatus s = Check(); !s.ok()) return s;
    return FSWritableFileOwnerWrapper::Sync(o, d);
  }
  IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
    if (IOStatus s = Check(); !s.ok()) return s;
    return FSWritableFileOwnerWrapper::Fsync(o, d);
  }

 private:
  IOStatus Check() {
    const Fault f = owner_->FaultFor(path_);
    if (f == Fault::kNone) return IOStatus::OK();
    ++owner_->failed_;
    return Injected(f);
  }
  FaultFs* const owner_;
  const std::string path_;
};

class FaultFs::Fs : public rocksdb::FileSystemWrapper {
 public:
  explicit Fs(FaultFs* owner) : FileSystemWrapper(rocksdb::FileSystem::Default()), owner_(owner) {}
  const char* Name() const override { return "FulcrumFaultFs"; }

  IOStatus NewWritableFile(const std::string& name, const rocksdb::FileOptions& o,
                           std::unique_ptr<rocksdb::FSWritableFile>* out, rocksdb::IODebugContext* d) override {
    const Fault f = owner_->FaultFor(name);
    if (f != Fault::kNone) {
      ++owner_->failed_;
      return Injected(f);
    }
    std::unique_ptr<rocksdb::FSWritableFile> file;
    IOStatus s = target()->NewWritableFile(name, o, &file, d);
    if (s.ok()) *out = std::make_unique<File>(owner_, name, std::move(file));
    return s;
  }

 private:
  FaultFs* const owner_;
};

FaultFs::FaultFs() : fs_(std::make_shared<Fs>(this)), env_(rocksdb::NewCompositeEnv(fs_)) {}

FaultFs::~FaultFs() = default;

FaultFs::Fault FaultFs::FaultFor(const std::string& path) {
  const Fault f = fault_.load();
  if (f == Fault::kNone) return f;
  absl::MutexLock lock(&mu_);
  return only_.empty() || path.find(only_) != std::string::npos ? f : Fault::kNone;
}

}  // namespace fulcrum::testing
