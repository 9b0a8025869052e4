// Reading small configuration files (certificates, token and password
// files) and noticing when they change, for the files Fulcrum re-reads
// while it runs.
#ifndef FULCRUM_COMMON_FILE_UTIL_H_
#define FULCRUM_COMMON_FILE_UTIL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fulcrum {

// The whole file; NOT_FOUND "cannot read the <what> file <path>" otherwise.
absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what);

// What identifies one version of a file: rewriting it changes the
// modification time or size, replacing it (a rename, a Kubernetes Secret's
// symlink swap) the inode. A file that cannot be stat'ed is the default
// value.
struct FileVersion {
  int64_t mtime_ns = -1;
  int64_t size = -1;
  uint64_t inode = 0;
  uint32_t mode = 0;  // permission bits

  static FileVersion Of(const std::string& path);
  bool exists() const { return mtime_ns >= 0; }
  bool operator==(const FileVersion&) const = default;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_FILE_UTIL_H_
