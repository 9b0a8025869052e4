#include "common/file_util.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace fulcrum {

absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (path.empty() || !in) return absl::NotFoundError(absl::StrCat("cannot read the ", what, " file ", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

FileVersion FileVersion::Of(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec, static_cast<int64_t>(st.st_size),
          static_cast<uint64_t>(st.st_ino), static_cast<uint32_t>(st.st_mode & 0777)};
}

}  // namespace fulcrum
