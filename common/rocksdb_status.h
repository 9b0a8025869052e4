// RocksDB status -> absl::Status, for the code that keeps state in RocksDB
// (the coordinator, the servers' checkpoints). Header-only: only targets
// that link RocksDB include it.
#ifndef FULCRUM_COMMON_ROCKSDB_STATUS_H_
#define FULCRUM_COMMON_ROCKSDB_STATUS_H_

#include <string>

#include <rocksdb/status.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fulcrum {

// `what` says what was being done ("opening checkpoints in DIR").
inline absl::Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError() && s.subcode() == rocksdb::Status::kNoSpace) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_ROCKSDB_STATUS_H_
